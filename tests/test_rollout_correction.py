"""spec.algorithm.rolloutCorrection: importance weights from the rollout engine's own log-probs to the trainer's, and
rejection of what the engine sampled too far from the trainer. tests/test_algos_oracle.py checks the weights and the
rejection masks against verl's rollout_is and rollout_rs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from hybridflow import algos
from hybridflow.api import parse_job
from hybridflow.api.spec import Algorithm, RejectionRule, RolloutCorrection
from hybridflow.step import StepOutput, step_record
from hybridflow.trackers import namespaced
from hybridflow.workers.host import WorkerHost
from tests.test_policy_losses import STATS
from tests.test_workers import ROLES, rows


def test_token_weights_are_each_tokens_ratio_cut_at_the_threshold() -> None:
    trainer = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    engine = trainer - torch.tensor([[0.0, 0.5, -0.3, 9.0]])  # the last token is padding
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w, metrics = algos.rollout_weights(trainer, engine, mask, "token", upper=1.5)
    assert torch.allclose(w, torch.tensor([[1.0, 1.5, math.exp(-0.3), 0.0]]))
    assert metrics["rollout_weight_cut_frac"] == pytest.approx(1 / 3)  # exp(0.5) = 1.65 cut to 1.5
    assert metrics["rollout_weight_mean"] == pytest.approx((1.0 + 1.5 + math.exp(-0.3)) / 3)


def test_sequence_weights_are_the_responses_product_on_each_of_its_tokens() -> None:
    trainer = torch.zeros(2, 3)
    engine = -torch.tensor([[0.1, 0.2, 5.0], [-0.4, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    w, _ = algos.rollout_weights(trainer, engine, mask, "sequence", upper=10.0)
    assert torch.allclose(w, torch.tensor([[math.exp(0.3)] * 2 + [0.0], [math.exp(-0.4)] * 3]))


def test_icepop_zeroes_the_weights_outside_its_band_instead_of_cutting_them() -> None:
    trainer = torch.zeros(1, 4)
    engine = -torch.tensor([[1.0, 0.1, -0.1, -1.0]]).log1p()  # ratios 2, 1.1, 0.9, 0 (the last one all but)
    engine[0, 3] = 20.0
    w, metrics = algos.rollout_weights(trainer, engine, torch.ones(1, 4), "token", upper=1.5, lower=0.5)
    assert torch.allclose(w, torch.tensor([[0.0, 1.1, 0.9, 0.0]]))
    assert metrics["rollout_weight_cut_frac"] == 0.5


def test_the_gap_is_zero_for_the_same_numbers_and_grows_with_the_difference() -> None:
    trainer = torch.tensor([[-1.0, -2.0]])
    mask = torch.ones(1, 2)
    assert algos.rollout_kl(trainer, trainer, mask) == 0.0
    small, large = (algos.rollout_kl(trainer, trainer + d, mask) for d in (0.01, 0.3))
    assert 0 < small < large and small == pytest.approx(math.exp(-0.01) - 1 + 0.01, rel=1e-5)  # d in float32


def test_the_lower_threshold_must_be_below_the_threshold() -> None:
    with pytest.raises(ValueError, match=r"lowerThreshold must be below rolloutCorrection\.threshold"):
        RolloutCorrection(importance_sampling="token", threshold=1.5, lower_threshold=2.0)


def test_the_actor_weighs_each_tokens_loss_and_reports_the_gap(example_doc) -> None:
    """The torch engine generating on the trained module agrees with the trainer to float32 rounding; a batch whose
    engine log-probs are moved stands for one from an engine that disagrees. Its update takes a step other than the
    unweighted one, and the record carries the gap and the weights."""
    def host_with(correction: dict[str, object]) -> WorkerHost:
        doc = example_doc("tiny-grpo.yaml")
        doc["spec"]["data"]["batchSize"] = 4
        doc["spec"]["algorithm"] |= {"miniBatchSize": 8, "rolloutCorrection": correction}
        return WorkerHost(parse_job(doc).spec.model_dump(mode="json"), ROLES, instance=0, use_gpu=False)

    r, g = rows(4)
    plain, weighed = host_with({}), host_with({"importanceSampling": "token", "threshold": 1.2})
    batch = plain.rollout([x for x in r for _ in range(4)], [i for i in g for _ in range(4)],
                          ["reward", "reference", "old_log_probs"])
    valid = batch.response_mask.bool()
    gap = (batch.tensors["rollout_log_probs"] - batch.tensors["old_log_probs"])[valid].abs().max().item()
    assert batch.tensors["rollout_log_probs"][valid].abs().min() > 0 and gap < 1e-4
    batch.tensors["advantages"] = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(0))
    batch.tensors["rollout_log_probs"][:, ::2] -= 0.4  # the engine thought every other token less likely
    before = {k: v.clone() for k, v in plain.workers["actor_rollout"].model.state_dict().items()}
    a = plain.update(batch, 0.001).metrics
    b = weighed.update(batch, 0.001).metrics
    assert a["rollout_kl"] == pytest.approx(b["rollout_kl"]) and a["rollout_kl"] > 0.01
    assert "rollout_weight_mean" not in a and 0 < b["rollout_weight_cut_frac"] < 1
    assert b["rollout_weight_mean"] > 1
    moved = [not torch.equal(plain.workers["actor_rollout"].model.state_dict()[k],
                             weighed.workers["actor_rollout"].model.state_dict()[k]) for k in before]
    assert any(moved)
    record = step_record(1, StepOutput(stats=STATS, update=b), 1.0, 0.0)
    assert {"rollout_corr/kl", "rollout_corr/weight_mean", "rollout_corr/weight_cut_frac"} <= set(namespaced(record))


def tiny_host(example_doc, correction: dict[str, object]) -> WorkerHost:
    """The tiny GRPO job's workers on batches of 4 prompts x 4 samples, two minibatches a step."""
    doc = example_doc("tiny-grpo.yaml")
    doc["spec"]["data"]["batchSize"] = 4
    doc["spec"]["algorithm"] |= {"miniBatchSize": 8, "rolloutCorrection": correction}
    return WorkerHost(parse_job(doc).spec.model_dump(mode="json"), ROLES, instance=0, use_gpu=False)


@pytest.mark.parametrize("bypass", [False, True])
def test_rejected_responses_leave_the_update_and_the_rest_train_as_before(example_doc, bypass: bool) -> None:
    """The engine's log-probs of the first prompt's 4 responses are moved far from the trainer's: a seq_max_k2 rule
    drops them, so the update is the same whatever their advantages, while without the rule it is not. Measured on
    the old log-probs, or with bypass at each pass on the policy being updated."""
    rule = {"divergence": "seq_max_k2", "threshold": 0.05}
    r, g = rows(4)
    scored = [] if bypass else ["old_log_probs"]
    batch = tiny_host(example_doc, {}).rollout([x for x in r for _ in range(4)], [i for i in g for _ in range(4)],
                                               ["reward", "reference", *scored])
    batch.tensors["rollout_log_probs"][:4] -= 0.6  # k2 = 0.18 on every token of the first four
    advantages = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(0))

    def weights_after(correction: dict[str, object], first_rows_advantage: float) -> tuple[list[torch.Tensor],
                                                                                           dict[str, float]]:
        host = tiny_host(example_doc, {"bypass": bypass} | correction)
        copy = dataclasses.replace(batch, tensors=dict(batch.tensors))
        if bypass:
            copy.tensors["old_log_probs"] = copy.tensors["rollout_log_probs"]
        copy.tensors["advantages"] = advantages.clone()
        copy.tensors["advantages"][:4] = first_rows_advantage
        metrics = host.update(copy, 0.001).metrics
        return list(host.workers["actor_rollout"].model.state_dict().values()), metrics

    (kept_up, metrics), (kept_down, _) = (weights_after({"rejectionSampling": [rule]}, a) for a in (3.0, -3.0))
    assert all(torch.equal(a, b) for a, b in zip(kept_up, kept_down, strict=True))
    (plain_up, _), (plain_down, _) = (weights_after({}, a) for a in (3.0, -3.0))
    assert not all(torch.equal(a, b) for a, b in zip(plain_up, plain_down, strict=True))
    valid = batch.response_mask.float()
    if not bypass:  # the others are the trainer's own numbers; with bypass the update's drift may reject more
        assert metrics["rollout_rejected_seq_frac"] == 0.25
        assert metrics["rollout_rejected_frac"] == pytest.approx(float(valid[:4].sum() / valid.sum()))
    assert metrics["rollout_rejected_seq_frac"] >= 0.25
    record = step_record(1, StepOutput(stats=STATS, update=metrics), 1.0, 0.0)
    assert {"rollout_corr/rs_masked_fraction", "rollout_corr/rs_seq_masked_fraction"} <= set(namespaced(record))


def test_normalised_weights_are_divided_by_their_mean(example_doc) -> None:
    r, g = rows(4)
    host = tiny_host(example_doc, {"importanceSampling": "token", "threshold": 1.2, "batchNormalize": True})
    batch = host.rollout([x for x in r for _ in range(4)], [i for i in g for _ in range(4)],
                         ["reward", "reference", "old_log_probs"])
    batch.tensors["advantages"] = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(0))
    batch.tensors["rollout_log_probs"][:, ::2] -= 0.4
    metrics = host.update(batch, 0.001).metrics
    assert metrics["rollout_weight_norm_factor"] == pytest.approx(metrics["rollout_weight_mean"])
    assert metrics["rollout_weight_mean"] > 1
    valid = batch.response_mask.bool()
    assert batch.tensors["rollout_weights"][valid].mean().item() == pytest.approx(1.0)


@pytest.mark.parametrize(("rule", "message"), [
    ({"divergence": "seq_mean_k3", "threshold": 0.1, "lowerThreshold": 0.01}, "only a k1 divergence"),
    ({"divergence": "token_k1", "threshold": 0.9}, r"lowerThreshold \(default 1/threshold\) at most threshold"),
    ({"divergence": "token_k1", "threshold": 1.5, "lowerThreshold": 2.0}, "at most threshold"),
])
def test_a_rejection_rule_out_of_order_is_refused(rule: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RejectionRule.model_validate(rule)


def test_a_k1_band_defaults_to_the_inverse_of_its_threshold() -> None:
    assert RejectionRule.model_validate({"divergence": "seq_mean_k1", "threshold": 4.0}).band() == (0.25, 4.0)
    assert RejectionRule.model_validate({"divergence": "seq_max_k3", "threshold": 4.0}).band() == (None, 4.0)


def test_batch_normalisation_needs_importance_weights() -> None:
    with pytest.raises(ValueError, match="batchNormalize scales importance weights"):
        RolloutCorrection(batch_normalize=True)


def test_bypass_weighs_only_the_reinforce_loss() -> None:
    correction = RolloutCorrection(importance_sampling="token", bypass=True)
    with pytest.raises(ValueError, match="importanceSampling with bypass weighs REINFORCE's loss"):
        Algorithm(name="grpo", rollout_correction=correction)
    assert Algorithm(name="grpo", policy_loss="gpg", rollout_correction=correction).rollout_correction.bypass


def test_with_bypass_and_gpg_each_pass_weighs_reinforce_by_the_policy_being_trained(example_doc) -> None:
    """verl's bypass loss_type reinforce: -A log pi x min(pi / pi_rollout, threshold), pi the policy being updated.
    The engine thought every other token less likely: those weigh more, so the step differs from the unweighted one."""
    def host_with(correction: dict[str, object]) -> WorkerHost:
        doc = example_doc("tiny-grpo.yaml")
        doc["spec"]["data"]["batchSize"] = 4
        doc["spec"]["algorithm"] |= {"miniBatchSize": 8, "policyLoss": "gpg", "rolloutCorrection": correction}
        return WorkerHost(parse_job(doc).spec.model_dump(mode="json"), ROLES, instance=0, use_gpu=False)

    r, g = rows(4)
    plain = host_with({"bypass": True})
    weighed = host_with({"bypass": True, "importanceSampling": "token", "threshold": 1.2})
    batch = plain.rollout([x for x in r for _ in range(4)], [i for i in g for _ in range(4)], ["reward", "reference"])
    batch.tensors["rollout_log_probs"][:, ::2] -= 0.4
    batch.tensors["advantages"] = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(0))
    a = plain.update(dataclasses.replace(batch, tensors=dict(batch.tensors)), 0.001).metrics
    b = weighed.update(dataclasses.replace(batch, tensors=dict(batch.tensors)), 0.001).metrics
    assert "rollout_weight_mean" not in a and "rollout_kl" not in b
    assert b["rollout_weight_mean"] > 1 and 0 < b["rollout_weight_cut_frac"] < 1
    assert any(not torch.equal(x, y) for x, y in zip(plain.workers["actor_rollout"].model.state_dict().values(),
                                                     weighed.workers["actor_rollout"].model.state_dict().values(),
                                                     strict=True))


def test_with_bypass_the_batch_carries_the_engines_log_probs_as_the_old_ones(example_doc) -> None:
    doc = example_doc("tiny-grpo.yaml")
    doc["spec"]["data"]["batchSize"] = 4
    doc["spec"]["algorithm"] |= {"miniBatchSize": 32, "rolloutCorrection": {"bypass": True}}  # one step
    host = WorkerHost(parse_job(doc).spec.model_dump(mode="json"), ROLES, instance=0, use_gpu=False)
    r, g = rows(4)
    batch = host.rollout([x for x in r for _ in range(4)], [i for i in g for _ in range(4)], ["reward"])
    assert batch.tensors["old_log_probs"] is batch.tensors["rollout_log_probs"]
    batch.tensors["advantages"] = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(0))
    metrics = host.update(batch, 0.001).metrics
    assert "rollout_kl" not in metrics  # the gap to itself says nothing
    # one step on the weights that generated: the ratio to the engine's log-probs is 1 but for their rounding
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and metrics["actor_loss"] != 0


@pytest.mark.slow
def test_a_run_with_bypass_scores_no_old_log_probs_and_learns(example_doc, tmp_path) -> None:
    import json

    from tests.helpers import train_in_fresh_ray

    doc = example_doc("tiny-grpo.yaml")
    doc["metadata"]["name"] = "bypass"
    doc["spec"]["algorithm"]["rolloutCorrection"] = {"bypass": True}
    doc["spec"]["data"]["val"] = None
    doc["spec"]["trainer"] |= {"totalSteps": 40, "resume": "never", "evalEvery": 0,
                               "checkpoint": {"every": 0, "path": str(tmp_path / "ckpt")}}
    train_in_fresh_ray(parse_job(doc), tmp_path / "m.jsonl")
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert len(records) == 40 and not any("timing/old_log_probs" in r or "rollout_kl" in r for r in records)
    rewards = [r["reward_mean"] for r in records]
    assert sum(rewards[-5:]) / 5 > rewards[0] + 0.3, rewards
