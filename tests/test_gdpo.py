"""algorithm.name gdpo: each reward component a reward function returns, group-normalised on its own, summed with
its weight and whitened (tests/test_algos_oracle.py checks the estimator against verl's)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from hybridflow import algos
from hybridflow.advantages import compute_advantages
from hybridflow.api import SpecError, parse_job
from hybridflow.api.spec import RLTrainingJobSpec
from hybridflow.data.prompts import repeat_samples
from hybridflow.workers.batch import RolloutBatch
from hybridflow.workers.host import WorkerHost
from tests.helpers import train_in_fresh_ray
from tests.test_workers import ROLES, rows


def gdpo_doc(example_doc, keys: list[str], weights: list[float] | None = None) -> dict[str, Any]:
    doc = example_doc("tiny-grpo.yaml")
    doc["spec"]["reward"]["function"] = "tests.detailed_reward:score"
    doc["spec"]["algorithm"] |= {"name": "gdpo", "gdpo": {"rewardKeys": keys} | (
        {"rewardWeights": weights} if weights else {})}
    return doc


@pytest.mark.parametrize(("change", "message"), [
    ({"algorithm": {"name": "gdpo"}}, r"algorithm\.gdpo\.rewardKeys \(the reward components to normalise\)"),
    ({"algorithm": {"name": "gdpo", "gdpo": {"rewardKeys": ["a", "b"], "rewardWeights": [1.0]}}},
     "one weight per rewardKeys entry"),
    ({"algorithm": {"name": "gdpo", "gdpo": {"rewardKeys": ["a", "a"]}}}, "rewardKeys 'a' appears more than once"),
    ({"algorithm": {"name": "gdpo", "gdpo": {"rewardKeys": ["a"]}},
      "reward": {"type": "model", "model": {"path": "/models/rm"}}}, "gdpo normalises the components"),
])
def test_gdpo_is_refused_without_what_it_needs(example_doc, change: dict[str, Any], message: str) -> None:
    doc = example_doc("tiny-grpo.yaml")
    for section, values in change.items():
        doc["spec"][section] = doc["spec"].get(section, {}) | values
    with pytest.raises(SpecError, match=message):
        parse_job(doc)


def scored_batch(example_doc, keys: list[str], weights: list[float] | None = None
                 ) -> tuple[RLTrainingJobSpec, RolloutBatch]:
    spec = parse_job(gdpo_doc(example_doc, keys, weights)).spec
    host = WorkerHost(spec.model_dump(mode="json"), ROLES, instance=0, use_gpu=False)
    r, _ = rows(4)
    batch = host.rollout(*repeat_samples(r, 8), ["reward"])
    return spec, batch


def test_the_advantages_normalise_each_component_in_its_group(example_doc) -> None:
    spec, batch = scored_batch(example_doc, ["score", "words"], [1.0, 0.5])
    compute_advantages(batch, spec, kl_coef=0.0)
    mask = batch.response_mask.float()
    components = torch.stack([batch.tensors["scores"], batch.tensors["reward_extra/words"]])
    expected = algos.compute_gdpo_advantages(components, [1.0, 0.5], batch.group_ids, mask)
    assert torch.allclose(batch.tensors["advantages"], expected)
    assert batch.tensors["advantages"].abs().sum() > 0
    # whitened over the valid tokens
    assert algos.masked_mean(batch.tensors["advantages"], mask).abs() < 1e-5


def test_a_component_missing_on_some_responses_names_the_key(example_doc) -> None:
    spec, batch = scored_batch(example_doc, ["score", "bonus"])  # bonus only where the reward is above 0
    missing = int(batch.tensors["reward_extra/bonus"].isnan().sum())
    assert 0 < missing < len(batch)
    with pytest.raises(ValueError, match=rf"algorithm\.gdpo\.rewardKeys: the reward function returned no number "
                                         rf"under 'bonus' for {missing} of {len(batch)} responses"):
        compute_advantages(batch, spec, kl_coef=0.0)


@pytest.mark.slow
def test_gdpo_learns_the_tiny_task_from_two_components(example_doc, tmp_path) -> None:
    """The tiny task's score and whether it earned anything, on the runtime (reward function in a Ray worker); the
    evaluation after the last step logs the function's other numbers as val/reward_extra/<key>."""
    doc = gdpo_doc(example_doc, ["score", "acc"], [1.0, 0.5])
    doc["metadata"]["name"] = "gdpo"
    doc["spec"]["trainer"] |= {"totalSteps": 48, "resume": "never", "evalEvery": 0,
                               "checkpoint": {"every": 0, "path": str(tmp_path / "ckpt")}}
    train_in_fresh_ray(parse_job(doc), tmp_path / "m.jsonl")
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    rewards = [r["reward_mean"] for r in records]
    assert sum(rewards[-5:]) / 5 > rewards[0] + 0.3, rewards
    assert records[-1]["reward_extra/acc"] > records[0]["reward_extra/acc"]
    # the evaluation after the last step logs them too
    assert 0 < records[-1]["val/reward_extra/acc"] <= 1 and records[-1]["val/reward_extra/words"] > 0
