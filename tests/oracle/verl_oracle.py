"""Runs verl's own advantage estimators and policy losses on the inputs it is given; the other half of
tests/test_algos_oracle.py. Runs in the verl oracle environment (tests/oracle/setup-verl-oracle.sh), never
imports hybridflow.

stdin: {"cases": [{"kind": ..., inputs as nested lists}, ...]}; stdout: {"verl": version, "results": [...]},
one result per case, tensors as nested lists (float64 throughout, so JSON carries them exactly).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
import torch
import verl
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import core_algos
from verl.workers.config import ActorConfig
from verl.workers.config.actor import PolicyLossConfig


def t(x: list[Any]) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


def lists(x: torch.Tensor) -> list[Any]:
    return x.detach().tolist()


def rloo(case: dict[str, Any]) -> dict[str, Any]:
    adv, _ = core_algos.compute_rloo_outcome_advantage(
        t(case["token_rewards"]), t(case["mask"]), np.array(case["index"], dtype=object))
    return {"advantages": lists(adv)}


def reinforce_plus_plus(case: dict[str, Any]) -> dict[str, Any]:
    adv, ret = core_algos.compute_reinforce_plus_plus_outcome_advantage(
        t(case["token_rewards"]), t(case["mask"]), config=AlgoConfig(gamma=case["gamma"]))
    return {"advantages": lists(adv), "returns": lists(ret)}


def reinforce_plus_plus_baseline(case: dict[str, Any]) -> dict[str, Any]:
    adv, _ = core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(
        t(case["token_rewards"]), t(case["mask"]), np.array(case["index"], dtype=object))
    return {"advantages": lists(adv)}


def opo(case: dict[str, Any]) -> dict[str, Any]:
    adv, _ = core_algos.compute_opo_outcome_advantage(
        t(case["token_rewards"]), t(case["mask"]), np.array(case["index"], dtype=object))
    return {"advantages": lists(adv)}


def grpo_passk(case: dict[str, Any]) -> dict[str, Any]:
    adv, _ = core_algos.compute_grpo_passk_outcome_advantage(
        t(case["token_rewards"]), t(case["mask"]), np.array(case["index"], dtype=object),
        config=AlgoConfig(norm_adv_by_std_in_grpo=case["normalize"]))
    return {"advantages": lists(adv)}


def remax(case: dict[str, Any]) -> dict[str, Any]:
    adv, ret = core_algos.compute_remax_outcome_advantage(
        t(case["token_rewards"]), t(case["baselines"]), t(case["mask"]), config=AlgoConfig())
    return {"advantages": lists(adv), "returns": lists(ret)}


def rollout_is(case: dict[str, Any]) -> dict[str, Any]:
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights

    weights, _ = compute_rollout_correction_weights(
        t(case["trainer_log_probs"]) - t(case["rollout_log_probs"]), t(case["mask"]), rollout_is=case["level"],
        rollout_is_threshold=case["threshold"], rollout_is_batch_normalize=case["normalize"])
    return {"weights": lists(weights)}


def rollout_rs(case: dict[str, Any]) -> dict[str, Any]:
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_rejection_mask

    mask, metrics = compute_rollout_rejection_mask(
        t(case["trainer_log_probs"]) - t(case["rollout_log_probs"]), t(case["mask"]), rollout_rs=case["options"],
        rollout_rs_threshold=case["thresholds"])
    return {"mask": lists(mask), "rollout_rejected_frac": metrics["rollout_rs_masked_fraction"],
            "rollout_rejected_seq_frac": metrics["rollout_rs_seq_masked_fraction"]}


def policy_loss(case: dict[str, Any]) -> dict[str, Any]:
    """The loss_mode named by the case's kind; its clip fraction under the name hybridflow gives it."""
    config = ActorConfig(strategy="fsdp", clip_ratio=case["clip_low"], clip_ratio_low=case["clip_low"],
                         clip_ratio_high=case["clip_high"], ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1,
                         rollout_n=1, policy_loss=PolicyLossConfig(loss_mode=case["kind"], **case.get("cov", {})),
                         **case.get("actor", {}),
                         global_batch_info={"loss_scale_factor": case["horizon"]} if "horizon" in case else {})
    log_prob = t(case["log_probs"]).requires_grad_()
    loss, metrics = core_algos.get_policy_loss_fn(case["kind"])(
        t(case["old_log_probs"]), log_prob, t(case["advantages"]), t(case["mask"]),
        loss_agg_mode=case["agg"], config=config)
    loss.backward()
    assert log_prob.grad is not None
    out = {"loss": loss.item(), "grad": lists(log_prob.grad)}
    if case["kind"] in CLIP_FRACTIONS:
        out[CLIP_FRACTIONS[case["kind"]]] = metrics["actor/pg_clipfrac"]
    return out


def gdpo(case: dict[str, Any]) -> dict[str, Any]:
    """verl's GDPO on per-response components, handed over as its reward manager does (non_tensor_batch)."""
    mask = t(case["mask"])
    batch = {"prompts": torch.zeros(mask.shape[0], 1),
             "attention_mask": torch.cat([torch.ones(mask.shape[0], 1), mask], -1).long()}
    components = {f"c{k}": np.asarray(c) for k, c in enumerate(case["components"])}
    config = AlgoConfig(gdpo_reward_keys=list(components), gdpo_reward_weights=case["weights"])
    adv, _ = core_algos.compute_gdpo_outcome_advantage(
        torch.zeros_like(mask), mask, np.array(case["index"]), norm_adv_by_std_in_grpo=case["normalize"],
        config=config, non_tensor_batch=components, batch=batch)
    return {"advantages": lists(adv)}


def bypass_reinforce(case: dict[str, Any]) -> dict[str, Any]:
    """verl's bypass mode with loss_type reinforce: weights and rejection measured on the log-probs being trained
    against the engine's, then -A log pi weighed."""
    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    correction = RolloutCorrectionConfig(rollout_is=case["level"], rollout_is_threshold=case["threshold"],
                                         rollout_rs=case.get("options"), rollout_rs_threshold=case.get("thresholds"),
                                         bypass_mode=True, loss_type="reinforce")
    config = ActorConfig(strategy="fsdp", ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                         policy_loss=PolicyLossConfig(loss_mode="bypass_mode", rollout_correction=correction))
    log_prob = t(case["log_probs"]).requires_grad_()
    loss, _ = core_algos.get_policy_loss_fn("bypass_mode")(
        t(case["rollout_log_probs"]), log_prob, t(case["advantages"]), t(case["mask"]), loss_agg_mode=case["agg"],
        config=config)
    loss.backward()
    assert log_prob.grad is not None
    return {"loss": loss.item(), "grad": lists(log_prob.grad)}


def gpg_advantages(case: dict[str, Any]) -> dict[str, Any]:
    adv, _ = core_algos.compute_gpg_outcome_advantage(
        t(case["token_rewards"]), t(case["mask"]), np.array(case["index"], dtype=object))
    return {"advantages": lists(adv)}


def optimal_token_baseline(case: dict[str, Any]) -> dict[str, Any]:
    weights = case.get("weights")
    adv, _ = core_algos.compute_optimal_token_baseline_advantage(
        t(case["token_rewards"]), t(case["mask"]), np.array(case["index"], dtype=object), t(case["old_log_probs"]),
        t(case["sum_pi_squared"]), rollout_is_weights=None if weights is None else t(weights))
    return {"advantages": lists(adv)}


def pf_ppo(case: dict[str, Any]) -> dict[str, Any]:
    from verl.protocol import DataProto

    scores = t(case["token_scores"])
    data = DataProto.from_dict(tensors={"token_level_scores": scores,
                                        "row": torch.arange(scores.shape[0], dtype=torch.float64)})
    torch.manual_seed(case["seed"])
    drawn = core_algos.compute_pf_ppo_reweight_data(data, case["method"], case["power"])
    return {"rows": lists(drawn.batch["row"])}


CLIP_FRACTIONS = {"gspo": "clip_frac", "cispo": "clip_frac", "clip_cov": "cov_frac", "dppo_tv": "clip_frac",
                  "dppo_kl": "clip_frac"}
"""verl's actor/pg_clipfrac: the clipped tokens, for clip_cov those whose loss the covariance rule cut, for DPPO those
outside the trust region."""
POLICY_LOSSES = ("gspo", "cispo", "gpg", "sapo", "geo_mean", "clip_cov", "kl_cov", "dppo_tv", "dppo_kl", "dro")


KINDS = {f.__name__: f for f in (rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, opo, grpo_passk,
                                 remax, rollout_is, rollout_rs, bypass_reinforce,
                                 gdpo, gpg_advantages, optimal_token_baseline, pf_ppo)} | {
    mode: policy_loss for mode in POLICY_LOSSES}


def main() -> None:
    request = json.load(sys.stdin)
    results = [KINDS[case["kind"]](case) for case in request["cases"]]
    json.dump({"verl": verl.__version__, "results": results}, sys.stdout)


if __name__ == "__main__":
    main()
