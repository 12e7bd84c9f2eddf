"""The naive Ray baseline: every role in its own actor, every batch through the driver and the object store.

It runs the same compute as hybridflow (the same worker role classes, advantage math and data) with the
plainest orchestration: the driver gets each result, puts the batch back into the object store and fans it
out; nothing is co-located, nothing is streamed. Only the orchestration differs from hybridflow.
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from hybridflow import algos
from hybridflow.advantages import compute_advantages
from hybridflow.api.spec import RLTrainingJobSpec
from hybridflow.data.prompts import PromptSampler, load_rows
from hybridflow.plan import old_log_probs_from_update
from hybridflow.step import measured_kl
from hybridflow.workers.actor import ActorRolloutWorker, ReferenceWorker
from hybridflow.workers.batch import RolloutBatch
from hybridflow.workers.modeling import pick_device, prepare_process
from hybridflow.workers.reward import RewardWorker


class RoleActor:
    """One role in its own process; `call` runs a method of that role's worker."""

    def __init__(self, role: str, spec: dict[str, Any], seed: int, use_gpu: bool = False) -> None:
        prepare_process()
        random.seed(seed)
        torch.manual_seed(seed)
        s = RLTrainingJobSpec.model_validate(spec)
        device = pick_device(use_gpu)
        if role == "actor_rollout":
            self.worker: Any = ActorRolloutWorker(s, device, seed)
        elif role == "reference":
            self.worker = ReferenceWorker(s, device)
        elif role == "reward":
            self.worker = RewardWorker(s, device)
        else:
            raise ValueError(f"unknown role {role!r}")

    def ready(self) -> bool:
        return True

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.worker, method)(*args)

    def timed_update(self, batch: RolloutBatch, kl_coef: float) -> tuple[dict[str, float], float]:
        """The actor's update, then its rollout engine takes the new weights (every loop must), and the seconds
        both took inside this process."""
        t0 = time.perf_counter()
        out = self.worker.update(batch, kl_coef)
        self.worker.sync_rollout()
        return out, time.perf_counter() - t0


@dataclass
class NaiveResult:
    """Per-step records (hybridflow's metric names) and the shape of the last training batch."""

    records: list[dict[str, Any]] = field(default_factory=list)
    batch_shape: tuple[int, ...] = ()
    batch_keys: list[str] = field(default_factory=list)


def run_naive(spec: RLTrainingJobSpec, steps: int, use_gpu: bool = False) -> NaiveResult:
    """Train `steps` GRPO steps; Ray must be initialised by the caller."""
    if spec.algorithm.name != "grpo":
        raise ValueError("the naive baseline runs GRPO only (no critic)")
    # the actor class travels by value: workers need not have benchmarks/ on their path
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    seed = spec.trainer.seed
    spec_json = spec.model_dump(mode="json")
    role: Any = ray.remote(RoleActor).options(num_cpus=1)  # handles are untyped to mypy
    actor = role.remote("actor_rollout", spec_json, seed, use_gpu)
    reward = role.remote("reward", spec_json, seed, use_gpu)
    with_ref = spec.model.reference.enabled and spec.algorithm.kl_penalty.coef > 0
    reference = role.remote("reference", spec_json, seed, use_gpu) if with_ref else None
    rows = load_rows(spec.data.train, spec.data.prompt_key, spec.data.answer_key, seed)
    sampler = PromptSampler(rows, spec.data.batch_size, seed, spec.data.shuffle)
    kl_ctl = algos.FixedKLController(spec.algorithm.kl_penalty.coef)
    n = spec.rollout.samples_per_prompt
    separate_old_pass = not old_log_probs_from_update(spec, lag=0)  # the same work as hybridflow's plan
    result = NaiveResult()
    try:
        ray.get([h.ready.remote() for h in (actor, reward, reference) if h is not None])
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            prompts = sampler.next_batch()
            batch_rows = [r for r in prompts for _ in range(n)]
            gids = [i for i in range(len(prompts)) for _ in range(n)]
            batch: RolloutBatch = ray.get(actor.call.remote("generate", batch_rows, gids))
            ref = ray.put(batch)
            calls = {"reward": reward.call.remote("score", ref)}
            if separate_old_pass:
                calls["old_log_probs"] = actor.call.remote("old_log_probs", ref)
            if reference is not None:
                calls["ref_log_probs"] = reference.call.remote("ref_log_probs", ref)
            parts = dict(zip(calls, ray.get(list(calls.values())), strict=True))
            for part in parts.values():
                batch.tensors.update(part.tensors)
            t_adv = time.perf_counter()
            adv = compute_advantages(batch, spec, kl_ctl.value)
            t_adv = time.perf_counter() - t_adv
            upd, update_s = ray.get(actor.timed_update.remote(ray.put(batch), kl_ctl.value))
            elapsed = time.perf_counter() - t0
            kl = measured_kl(adv, upd)
            if kl is not None:
                kl_ctl.update(kl, len(batch))
            # worker compute on the critical path: generate, then the slowest of the parallel scorers
            scorers = {k: p.timings[k] for k, p in parts.items()}
            compute = batch.timings["generate"] + max(scorers.values()) + t_adv + update_s
            mask = batch.response_mask.float()
            tokens = float(mask.sum())
            result.records.append({
                "step": step,
                "reward_mean": float(batch.tensors["scores"].mean()),
                "kl": kl or 0.0,
                "actor_loss": upd.get("actor_loss"),
                "response_length": float(mask.sum(-1).mean()),
                "tokens": tokens,
                "tokens_per_s": tokens / elapsed,
                "timing/step": elapsed,
                "timing/generate": batch.timings["generate"],
                **{f"timing/{k}": v for k, v in scorers.items()},
                "timing/advantages": t_adv,
                "timing/actor_update_compute": update_s,
                "orchestration_overhead_frac": max(0.0, 1.0 - compute / elapsed),
            })
            result.batch_shape = tuple(batch.input_ids.shape)
            result.batch_keys = sorted(batch.tensors)
    finally:
        for handle in (actor, reward, reference):
            if handle is not None:
                ray.kill(handle, no_restart=True)
    return result
