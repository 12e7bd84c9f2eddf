"""spec.reward.overlongBuffer: DAPO's soft overlong punishment on every score, the greedy baselines' too."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hybridflow.api import SpecError, parse_job
from hybridflow.api.spec import OverlongBuffer
from hybridflow.data.prompts import repeat_samples
from hybridflow.data.tiny import tiny_task_reward
from hybridflow.workers.host import WorkerHost
from hybridflow.workers.reward import overlong_penalty
from tests.test_workers import ROLES, rows


def test_the_penalty_grows_through_the_buffer_by_hand() -> None:
    buffer = OverlongBuffer(length=4, penalty_factor=0.5)
    got = overlong_penalty(torch.tensor([0, 3, 4, 5, 7, 8]), 8, buffer)
    assert got.tolist() == [0.0, 0.0, 0.0, -0.125, -0.375, -0.5]
    whole = OverlongBuffer(length=8)  # the whole response is the buffer: every token costs 1/8
    assert overlong_penalty(torch.tensor([1, 8]), 8, whole).tolist() == [-0.125, -1.0]


@pytest.mark.parametrize(("buffer", "message"), [
    ({"length": 5}, r"reward\.overlongBuffer\.length must be at most data\.maxResponseLength \(5 > 4\)"),
    ({"length": 0}, r"reward\.overlongBuffer\.length"),
    ({"length": 2, "penaltyFactor": -1.0}, r"reward\.overlongBuffer\.penaltyFactor"),
])
def test_a_buffer_that_cannot_fit_is_refused(example_doc, buffer: dict[str, Any], message: str) -> None:
    doc = example_doc("tiny-grpo.yaml")  # data.maxResponseLength 4
    doc["spec"]["reward"] = {"overlongBuffer": buffer}
    with pytest.raises(SpecError, match=message):
        parse_job(doc)


def scored(example_doc, name: str, buffer: dict[str, Any]) -> tuple[Any, Any]:
    doc = example_doc("tiny-grpo.yaml")
    doc["spec"]["algorithm"]["name"] = name
    doc["spec"]["reward"] = {"overlongBuffer": buffer}
    spec = parse_job(doc).spec
    host = WorkerHost(spec.model_dump(mode="json"), ROLES, instance=0, use_gpu=False)
    r, _ = rows(4)
    batch = host.rollout(*repeat_samples(r, 4), ["reward"])
    return spec, batch


def test_every_score_takes_the_penalty_and_the_record_logs_it(example_doc) -> None:
    spec, batch = scored(example_doc, "grpo", {"length": 3, "penaltyFactor": 2.0})
    assert spec.reward.overlong_buffer is not None
    lengths = batch.response_mask.sum(-1)
    raw = torch.tensor([tiny_task_reward(p, r, a) for p, r, a in zip(batch.prompts, batch.responses, batch.answers,
                                                                        strict=True)])
    penalty = overlong_penalty(lengths, 4, spec.reward.overlong_buffer)
    assert bool((penalty < 0).any())  # responses reach into the buffer (past 1 token)
    torch.testing.assert_close(batch.tensors["scores"], raw + penalty.to(raw.dtype))
    torch.testing.assert_close(batch.tensors["reward_extra/overlong_reward"], penalty.float())
    assert batch.tensors["reward_extra/overlong"].tolist() == (penalty < 0).float().tolist()


def test_remax_s_greedy_baselines_take_it_by_their_own_length(example_doc) -> None:
    spec, batch = scored(example_doc, "remax", {"length": 4})
    assert spec.reward.overlong_buffer is not None
    first = {g: i for i, g in reversed(list(enumerate(batch.group_ids)))}
    for g, i in first.items():
        greedy = tiny_task_reward(batch.prompts[i], batch.baselines[i], batch.answers[i])
        length = batch.tensors["baseline_lengths"][i]
        expected = greedy + float(overlong_penalty(length.view(1), 4, spec.reward.overlong_buffer))
        rows_of_group = [j for j, h in enumerate(batch.group_ids) if h == g]
        got = batch.tensors["reward_baselines"][rows_of_group].tolist()
        assert got == pytest.approx([expected] * len(rows_of_group))
        assert 1 <= int(length) <= 4
