"""algorithm.name optimal_token_baseline: the pass of old log-probs also scores each token's sum_v pi_v^2, and the
advantages weigh the group's returns by it (tests/test_algos_oracle.py checks the estimator against verl's)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hybridflow import algos
from hybridflow.advantages import compute_advantages
from hybridflow.api import SpecError, parse_job
from hybridflow.api.spec import RLTrainingJobSpec
from hybridflow.data.prompts import repeat_samples
from hybridflow.plan import old_log_probs_from_update
from hybridflow.workers.batch import RolloutBatch
from hybridflow.workers.host import WorkerHost
from hybridflow.workers.modeling import response_logits
from tests.test_workers import ROLES, rows


def otb_doc(example_doc, **correction: Any) -> dict[str, Any]:
    doc = example_doc("tiny-grpo.yaml")
    doc["spec"]["algorithm"]["name"] = "optimal_token_baseline"
    if correction:
        doc["spec"]["algorithm"]["rolloutCorrection"] = correction
    return doc


def scored(spec: RLTrainingJobSpec) -> tuple[WorkerHost, RolloutBatch]:
    host = WorkerHost(spec.model_dump(mode="json"), ROLES, instance=0, use_gpu=False)
    r, _ = rows(4)
    batch = host.rollout(*repeat_samples(r, 4), ["reward", "old_log_probs"])
    return host, batch


def test_bypass_is_refused_and_the_update_never_scores_the_old_log_probs_itself(example_doc) -> None:
    with pytest.raises(SpecError, match="optimal_token_baseline weighs each token by the trainer's sum of squared"
                                        " probabilities"):
        parse_job(otb_doc(example_doc, bypass=True))
    doc = otb_doc(example_doc)
    doc["spec"]["algorithm"]["miniBatchSize"] = None  # one optimiser step a batch
    spec = parse_job(doc).spec
    assert not old_log_probs_from_update(spec, lag=0)
    spec.algorithm.name = "grpo"  # the same job otherwise takes them from the update's own pass
    assert old_log_probs_from_update(spec, lag=0)


def test_the_pass_of_old_log_probs_scores_sum_pi_squared_in_micro_batches_too(example_doc) -> None:
    spec = parse_job(otb_doc(example_doc)).spec
    host, batch = scored(spec)
    mask = batch.response_mask.float()
    actor = host.workers["actor_rollout"]
    with torch.no_grad():
        logits = response_logits(actor.model, batch, torch.device("cpu")).float()
    expected = torch.softmax(logits, -1).square().sum(-1) * mask
    torch.testing.assert_close(batch.tensors["sum_pi_squared"], expected)
    valid = mask > 0
    assert bool((batch.tensors["sum_pi_squared"][valid] >= batch.tensors["old_log_probs"][valid].exp().square()
                 - 1e-6).all())
    # in passes of 3 rows: the log-probs and sum_pi_squared travel together and land on the same rows
    whole = batch.tensors["old_log_probs"].clone()
    actor.spec.trainer.training.micro_batch_size = 3
    again = actor.old_log_probs(batch)
    torch.testing.assert_close(again.tensors["sum_pi_squared"], expected)
    torch.testing.assert_close(again.tensors["old_log_probs"], whole)


def test_the_advantages_take_the_rollout_weights_and_the_tokens_rejection_keeps(example_doc) -> None:
    rules = [{"divergence": "token_k1", "threshold": 1.3, "lowerThreshold": 0.8}]
    spec = parse_job(otb_doc(example_doc, importanceSampling="token", threshold=1.5,
                             rejectionSampling=rules)).spec
    _, batch = scored(spec)
    g = torch.Generator().manual_seed(0)
    mask = batch.response_mask.float()
    engine = batch.tensors["old_log_probs"] + 0.2 * torch.randn(mask.shape, generator=g) * mask
    batch.tensors["rollout_log_probs"] = engine
    compute_advantages(batch, spec, kl_coef=0.0)
    old, spp = batch.tensors["old_log_probs"], batch.tensors["sum_pi_squared"]
    weights, _ = algos.rollout_weights(old, engine, mask, "token", 1.5)
    kept, rejected = algos.rollout_rejection(old, engine, mask, [("token_k1", 0.8, 1.3)])
    assert 0 < rejected["rollout_rejected_frac"] < 1
    rewards = algos.scores_to_token_rewards(batch.tensors["scores"], mask)
    expected = algos.compute_optimal_token_baseline_advantages(rewards, kept, batch.group_ids, old, spp, weights)
    torch.testing.assert_close(batch.tensors["advantages"], expected)
    plain = algos.compute_optimal_token_baseline_advantages(rewards, mask, batch.group_ids, old, spp)
    assert not torch.allclose(expected, plain)
    assert batch.tensors["advantages"].abs().sum() > 0
