"""spec.algorithm.filterGroups (DAPO's dynamic sampling): which groups are kept, how a step's batch fills up over
further rollouts, and what the spec refuses. tests/test_training.py trains with it on the runtime."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hybridflow.api import SpecError, parse_job
from hybridflow.api.spec import FilterGroups
from hybridflow.data.prompts import repeat_samples
from hybridflow.dynamic_sampling import PREFIX, fill_with_varied_groups, first_groups, varied_rows
from hybridflow.plan import graph_problems
from hybridflow.workers.batch import EXTRA_PREFIX, RolloutBatch
from hybridflow.workers.host import WorkerHost
from tests.test_workers import ROLES, rows


def test_varied_rows_keep_the_groups_that_differ_and_lone_samples() -> None:
    scores = torch.tensor([1.0, 1.0, 0.0, 0.5, 0.5, 0.5, 0.0, 2.0, 3.0, 3.0])
    groups = [7, 7, 7, 4, 4, 4, 9, 5, 5, 5]
    assert varied_rows(scores, groups).tolist() == [0, 1, 2, 6, 7, 8, 9]
    assert first_groups([3, 3, 1, 1, 8, 8], 2).tolist() == [0, 1, 2, 3]
    assert first_groups([3, 3, 1], 5).tolist() == [0, 1, 2]


@pytest.fixture
def rolled(example_doc) -> RolloutBatch:
    """4 prompts x 4 samples of the tiny task, scored (its reward function's numbers set below per test)."""
    host = WorkerHost(parse_job(example_doc("tiny-grpo.yaml")).spec.model_dump(mode="json"), ROLES,
                      instance=0, use_gpu=False)
    r, _ = rows(4)
    return host.rollout(*repeat_samples(r, 4), ["reward"])


def with_scores(batch: RolloutBatch, varied: set[int], offset: int, seconds: float) -> RolloutBatch:
    """`batch` as rollout number `offset` (its group ids moved up by 4 x offset), the groups in `varied` scoring
    0 and 1, the others 1 on every sample."""
    out = batch.slice_index(torch.arange(len(batch)))
    out.group_ids = [g + 4 * offset for g in batch.group_ids]
    out.tensors["scores"] = torch.tensor([float(i % 2) if g in varied else 1.0
                                          for i, g in enumerate(batch.group_ids)])
    out.timings = {"generate": seconds}
    return out


def test_the_step_fills_with_groups_that_differ_over_further_rollouts(rolled: RolloutBatch) -> None:
    asked: list[int] = []

    def more(k: int) -> RolloutBatch:
        asked.append(k)
        return with_scores(rolled, {1, 2, 3} if k == 1 else {0}, k, 2.0)

    batch, stats = fill_with_varied_groups(with_scores(rolled, {2}, 0, 1.0), more, 3, FilterGroups())
    assert asked == [1]
    # group 2 of the first rollout, then groups 1 and 2 of the second (ids 5 and 6); its group 7 is left over
    assert batch.group_ids == [2] * 4 + [5] * 4 + [6] * 4
    assert batch.tensors["scores"].tolist() == [0.0, 1.0, 0.0, 1.0] * 3
    assert batch.timings == {"generate": 3.0}
    assert stats == {PREFIX + "gen_batches": 2.0, PREFIX + "kept_group_frac": 4 / 8}


def test_a_step_still_short_after_max_gen_batches_names_the_field(rolled: RolloutBatch) -> None:
    rule = FilterGroups(maxGenBatches=3)
    calls: list[int] = []

    def more(k: int) -> RolloutBatch:
        calls.append(k)
        return with_scores(rolled, set(), k, 1.0)

    with pytest.raises(ValueError, match=r"algorithm\.filterGroups\.maxGenBatches: 3 rollouts of 4 prompts gave 1 "
                                         r"groups whose score differs, short of the 4 a step trains on"):
        fill_with_varied_groups(with_scores(rolled, {0}, 0, 1.0), more, 4, rule)
    assert calls == [1, 2]


def test_another_metric_is_a_number_the_reward_function_returns(rolled: RolloutBatch) -> None:
    batch = with_scores(rolled, {0, 1, 2, 3}, 0, 1.0)  # every score differs; only groups 1 and 3 differ in acc
    batch.tensors[EXTRA_PREFIX + "acc"] = torch.tensor([float(i % 2) if g in (1, 3) else 0.0
                                                        for i, g in enumerate(batch.group_ids)])
    kept, _ = fill_with_varied_groups(batch, lambda k: batch, 2, FilterGroups(metric="acc"))
    assert sorted(set(kept.group_ids)) == [1, 3]
    with pytest.raises(ValueError, match=r"algorithm\.filterGroups\.metric: the reward function returned no "
                                         r"number under 'format' for 16 of 16 responses"):
        fill_with_varied_groups(batch, lambda k: batch, 2, FilterGroups(metric="format"))


@pytest.mark.parametrize(("change", "message"), [
    ({"rollout": {"samplesPerPrompt": 1}, "algorithm": {"name": "reinforce_plus_plus", "miniBatchSize": None}},
     r"algorithm\.filterGroups drops the prompts whose samples all scored the same: it needs"),
    ({"reward": {"type": "model", "model": {"path": "/models/rm"}}, "algorithm": {"filterGroups": {"metric": "acc"}}},
     r"algorithm\.filterGroups\.metric other than score is a number the reward function returns"),
    ({"algorithm": {"filterGroups": {"maxGenBatches": 0}}}, r"algorithm\.filterGroups\.maxGenBatches"),
])
def test_the_spec_refuses_what_cannot_filter(example_doc, change: dict[str, Any], message: str) -> None:
    doc = example_doc("tiny-grpo.yaml")
    doc["spec"]["algorithm"]["filterGroups"] = {}
    for section, values in change.items():
        doc["spec"][section] = doc["spec"].get(section, {}) | values
    with pytest.raises(SpecError, match=message):
        parse_job(doc)


def test_a_pipelined_rollout_cannot_filter(example_doc) -> None:
    doc = example_doc("tiny-grpo.yaml")
    doc["spec"]["algorithm"]["filterGroups"] = {}
    doc["spec"]["scheduling"] = {"consistency": "eventual"}
    problems = graph_problems(parse_job(doc).spec, "CPU")
    assert any(p.startswith("spec.algorithm.filterGroups: a step rolls out more prompts") for p in problems), problems
