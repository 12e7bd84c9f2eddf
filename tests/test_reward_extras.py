"""A reward function may return a mapping, as verl's compute_score may: its number under "score" trains, its other
numbers are logged per step (reward_extra/<key> in metrics.jsonl and the trackers)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hybridflow.advantages import batch_stats
from hybridflow.api import parse_job
from hybridflow.data.tiny import tiny_task_reward
from hybridflow.step import StepOutput, step_record
from hybridflow.trackers import namespaced
from hybridflow.workers.batch import RolloutBatch
from hybridflow.workers.host import WorkerHost
from hybridflow.workers.reward import RewardFunctionError, RewardWorker, score_value
from tests.test_workers import rows


@pytest.mark.parametrize(("value", "expected"), [
    (0.5, (0.5, {})),
    (1, (1.0, {})),
    (True, (1.0, {})),
    ({"score": 0.25, "acc": False, "n": 3, "pred": "7", "nan": math.nan}, (0.25, {"acc": 0.0, "n": 3.0})),
    ({"score": np.float32(0.5), "n": np.int64(2)}, (0.5, {"n": 2.0})),  # numpy's scalars, as verl's scorers return
])
def test_a_number_or_a_mapping_with_a_score(value: object, expected: tuple[float, dict[str, float]]) -> None:
    assert score_value(value, "m:f") == expected


@pytest.mark.parametrize(("value", "got"), [
    ({"acc": 1.0}, "a mapping without 'score' (keys: acc)"),
    ({"score": "1"}, "a str under 'score'"),
    ({"score": math.nan}, "NaN under 'score'"),
    (None, "a NoneType"),
    ("1.0", "a str"),
    (math.nan, "NaN"),
    ({"score": np.float32("nan")}, "NaN under 'score'"),
])
def test_anything_else_names_the_field_and_what_it_returned(value: object, got: str) -> None:
    with pytest.raises(RewardFunctionError) as e:
        score_value(value, "m:f")
    assert str(e.value) == (f"spec.reward.function 'm:f' returned {got}: it must return a number, or a mapping with "
                            "a number under 'score' (and any other numbers to log)")


def scored(example_doc, function: str, n: int = 8) -> tuple[RolloutBatch, RewardWorker]:
    doc = example_doc("tiny-grpo.yaml")
    doc["spec"]["reward"]["function"] = function
    spec = parse_job(doc).spec
    host = WorkerHost(spec.model_dump(mode="json"), {"actor_rollout": "actor_rollout"}, 0, use_gpu=False)
    r, g = rows(n)
    return host.rollout(r, g, []), RewardWorker(spec, torch.device("cpu"))


def test_the_score_trains_and_the_other_numbers_reach_the_step_record(example_doc) -> None:
    batch, worker = scored(example_doc, "tests.detailed_reward:score", n=16)
    worker.score(batch)
    expected = torch.tensor([tiny_task_reward(p, r, a) for p, r, a in
                             zip(batch.prompts, batch.responses, batch.answers, strict=True)])
    assert torch.equal(batch.tensors["scores"], expected)
    correct = expected > 0
    assert 0 < int(correct.sum()) < len(batch), "the untrained policy earns something on some rows, not all"
    assert torch.equal(batch.tensors["reward_extra/acc"], correct.float())
    bonus = batch.tensors["reward_extra/bonus"]
    assert torch.equal(bonus[correct], torch.full((int(correct.sum()),), 0.5)) and bonus[~correct].isnan().all()
    assert "reward_extra/pred" not in batch.tensors
    stats = batch_stats(batch)
    assert stats["reward_extra/acc"] == pytest.approx(float(correct.float().mean()))
    assert stats["reward_extra/bonus"] == 0.5  # the mean over the rows that returned it
    record = step_record(1, StepOutput(stats=stats), 1.0, 0.0)
    assert record["reward_extra/words"] == pytest.approx(sum(len(r.split()) for r in batch.responses) / len(batch))
    assert {"reward_extra/acc", "reward_extra/bonus", "reward_extra/words"} <= set(namespaced(record))


def test_shards_that_returned_other_numbers_join(example_doc) -> None:
    batch, worker = scored(example_doc, "tests.detailed_reward:score")
    first, second = batch.shard(2)
    worker.score(first)
    second.tensors["scores"] = torch.zeros(len(second))  # scored by a function that returned plain numbers
    both = RolloutBatch.concat([first, second])
    assert torch.equal(both.tensors["reward_extra/acc"][:len(first)], first.tensors["reward_extra/acc"])
    assert both.tensors["reward_extra/acc"][len(first):].isnan().all()


def test_a_mapping_without_a_score_stops_the_step_with_one_message(example_doc) -> None:
    batch, worker = scored(example_doc, "tests.detailed_reward:without_score")
    with pytest.raises(RewardFunctionError, match="'tests.detailed_reward:without_score' returned a mapping without "
                                                  r"'score' \(keys: acc\)"):
        worker.score(batch)


def test_a_batched_function_scores_the_whole_batch_in_one_call_as_the_per_response_one(example_doc) -> None:
    batch, worker = scored(example_doc, "tests.detailed_reward:score", n=16)
    one_by_one = worker.score(batch.slice(0, len(batch))).tensors
    batched = RewardWorker(parse_job(batched_doc(example_doc, "tests.detailed_reward:batch_scores")).spec,
                           torch.device("cpu"))
    calls = []
    fn = batched.fn
    assert fn is not None
    batched.fn = lambda *lists: calls.append(len(lists[1])) or fn(*lists)
    together = batched.score(batch.slice(0, len(batch))).tensors
    assert calls == [len(batch)]
    assert together.keys() == one_by_one.keys() and "reward_extra/bonus" in together
    for key, value in one_by_one.items():
        assert torch.allclose(together[key], value, equal_nan=True), key


def batched_doc(example_doc, function: str) -> dict:
    doc = example_doc("tiny-grpo.yaml")
    doc["spec"]["reward"] |= {"function": function, "batched": True}
    return doc


@pytest.mark.parametrize(("function", "got"), [
    ("tests.detailed_reward:batch_missing_one", "15 values"),
    ("tests.detailed_reward:without_score", "a dict"),  # one mapping for the whole batch
])
def test_a_batched_function_must_return_one_value_per_response(example_doc, function: str, got: str) -> None:
    batch, _ = scored(example_doc, "tests.detailed_reward:score", n=16)
    worker = RewardWorker(parse_job(batched_doc(example_doc, function)).spec, torch.device("cpu"))
    with pytest.raises(RewardFunctionError) as e:
        worker.score(batch)
    assert str(e.value) == (f"spec.reward.function {function!r} (reward.batched) returned {got} for 16 responses: it "
                            "must return a list with a number or a mapping for each")
