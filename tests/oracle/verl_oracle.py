"""Runs verl's own advantage estimators and GSPO loss on the inputs it is given; the other half of
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


def gspo(case: dict[str, Any]) -> dict[str, Any]:
    config = ActorConfig(strategy="fsdp", clip_ratio=case["clip_low"], clip_ratio_low=case["clip_low"],
                         clip_ratio_high=case["clip_high"], ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1,
                         rollout_n=1, global_batch_info={"loss_scale_factor": case["horizon"]} if "horizon" in case
                         else {})
    log_prob = t(case["log_probs"]).requires_grad_()
    loss, metrics = core_algos.compute_policy_loss_gspo(
        t(case["old_log_probs"]), log_prob, t(case["advantages"]), t(case["mask"]),
        loss_agg_mode=case["agg"], config=config)
    loss.backward()
    assert log_prob.grad is not None
    return {"loss": loss.item(), "grad": lists(log_prob.grad), "clip_frac": metrics["actor/pg_clipfrac"]}


KINDS = {f.__name__: f for f in (rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, gspo)}


def main() -> None:
    request = json.load(sys.stdin)
    results = [KINDS[case["kind"]](case) for case in request["cases"]]
    json.dump({"verl": verl.__version__, "results": results}, sys.stdout)


if __name__ == "__main__":
    main()
