"""One training step: rollout -> scores -> advantages -> update, and the record it leaves.

`run_step` is the step loop for wherever the phases run: the Trainer runs it over host groups, and a
WorkerHost runs it in its own process when the plan fuses every phase onto that host (one call per
step instead of a round trip per phase). The results below are what crosses Ray.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from hybridflow.advantages import batch_stats, compute_advantages, policy_filtered
from hybridflow.api.spec import RLTrainingJobSpec
from hybridflow.dynamic_sampling import PREFIX as SAMPLING_PREFIX
from hybridflow.plan import Phase
from hybridflow.samples import sample_rows
from hybridflow.workers.batch import EXTRA_PREFIX, RolloutBatch


@dataclass(frozen=True)
class PhaseResult:
    """A step run on a batch that came through the object store: only the tensors it added go back."""

    tensors: dict[str, torch.Tensor]
    step: str
    seconds: float


@dataclass(frozen=True)
class UpdateResult:
    """Metrics of the roles one host trained (the same on every rank) and the seconds it took."""

    metrics: dict[str, float]
    seconds: float

    @staticmethod
    def slowest(results: Sequence[UpdateResult]) -> UpdateResult:
        """Ranks that update at the same time: their metrics together, the slowest one's seconds."""
        return UpdateResult({k: v for r in results for k, v in r.metrics.items()}, max(r.seconds for r in results))


@dataclass(frozen=True)
class SyncResult:
    """One weight sync over the policy's control edge: the version rollout now holds, the bytes copied (0 when
    generation runs on the trained module), its seconds, and how long it first waited for a pipelined rollout
    still generating on the old weights."""

    version: int
    bytes: int
    seconds: float
    waited: float = 0.0

    @staticmethod
    def slowest(results: Sequence[SyncResult]) -> SyncResult:
        """Every actor rank syncs its own engine at once: the total bytes, the slowest rank's times."""
        return SyncResult(results[0].version, sum(r.bytes for r in results), max(r.seconds for r in results),
                          max(r.waited for r in results))


@dataclass
class StepOutput:
    """What a step reports, wherever its phases ran: scalars, cheap to send back, and the responses themselves
    only when spec.trainer.rolloutDataDir asks for them."""

    seconds: dict[str, float] = field(default_factory=dict)
    """Wall time of each phase."""
    compute: float = 0.0
    """Worker compute on the critical path (orchestration_overhead_frac = 1 - compute / step time)."""
    timings: dict[str, float] = field(default_factory=dict)
    """Worker-timed parts of the rollout: generate, reward, ref_log_probs, old_log_probs, values."""
    stats: dict[str, float] = field(default_factory=dict)
    advantages: dict[str, float] = field(default_factory=dict)
    update: dict[str, float] = field(default_factory=dict)
    rollout_bytes: int = 0
    """Tensor bytes of the scored rollout batch: what the actor's process handed its co-located steps."""
    sync: SyncResult | None = None
    samples: list[dict[str, Any]] | None = None
    """samples.sample_rows of the rollout, for spec.trainer.rolloutDataDir."""

    def add(self, phase: Phase, seconds: float, compute: float) -> None:
        self.seconds[phase] = seconds
        self.compute += compute

    @property
    def kl(self) -> float | None:
        return measured_kl(self.advantages, self.update)


def measured_kl(advantages: dict[str, float], update: dict[str, float]) -> float | None:
    """The batch's mean KL to the reference (None without one): measured on the old log-probs, by the
    advantages or, when it scored them itself, by the update."""
    return advantages.get("kl", update.get("kl"))


Prompts = tuple[list[dict[str, str]], list[int]]
"""Rows and their group ids: what a rollout answers."""


class PhaseRunner(Protocol):
    """Runs the phases that need workers; each returns the worker compute on its critical path."""

    def rollout_phase(self, rows: list[dict[str, str]], group_ids: list[int]) -> tuple[RolloutBatch, float]:
        """The batch for `rows`: the one generated during the last update when it was for these rows."""
        ...

    def scores_phase(self, batch: RolloutBatch) -> float:
        """The plan's scored steps, every rank of their role at once on its part of `batch` (plan.scored_steps)."""
        ...

    def update_phase(self, batch: RolloutBatch, kl_coef: float, ahead: Prompts | None) -> UpdateResult:
        """The update; with `ahead`, the rollout of those prompts runs meanwhile on the policy before it."""
        ...

    def sync_phase(self) -> SyncResult:
        """The updated policy reaches rollout over its control edge, once the pipelined rollout is done."""
        ...


def run_step(runner: PhaseRunner, phases: Sequence[Phase], rows: list[dict[str, str]], group_ids: list[int],
             spec: RLTrainingJobSpec, kl_coef: float, ahead: Prompts | None = None, shards: int = 1) -> StepOutput:
    """The step loop; `phases` (from the plan) holds "scores" when some step is scored by every rank at once.

    `ahead` (consistency eventual) are the next step's prompts: their rollout overlaps this step's update,
    and the next run_step finds their batch ready. With `shards` data-parallel ranks training on the batch,
    its rows are balanced over them (RolloutBatch.balanced) before any of them gets a part. With
    spec.algorithm.policyFiltration the update trains on the batch redrawn by score (`policy_filtered`); the step's
    stats are the rollout's.
    """
    out = StepOutput()
    t0 = time.perf_counter()
    batch, compute = runner.rollout_phase(rows, group_ids)
    if shards > 1:
        batch = batch.balanced(shards)
        tokens = [int(part.attention_mask.sum()) for part in batch.shard(shards)]
        out.stats["shard_tokens_max_over_mean"] = max(tokens) * len(tokens) / max(sum(tokens), 1)
    out.rollout_bytes = batch.nbytes()
    out.add("rollout", time.perf_counter() - t0, compute)
    if "scores" in phases:
        t0 = time.perf_counter()
        compute = runner.scores_phase(batch)
        out.add("scores", time.perf_counter() - t0, compute)
    out.timings = dict(batch.timings)
    t0 = time.perf_counter()
    out.advantages = compute_advantages(batch, spec, kl_coef)
    out.stats |= batch_stats(batch)
    if spec.trainer.rollout_data_dir is not None:
        out.samples = sample_rows(batch)
    if spec.algorithm.policy_filtration is not None:
        batch = policy_filtered(batch, spec)
        batch = batch.balanced(shards) if shards > 1 else batch
    seconds = time.perf_counter() - t0
    out.add("advantages", seconds, seconds)
    t0 = time.perf_counter()
    update = runner.update_phase(batch, kl_coef, ahead)
    out.update = update.metrics
    out.add("update", time.perf_counter() - t0, update.seconds)
    t0 = time.perf_counter()
    out.sync = runner.sync_phase()
    out.add("sync", time.perf_counter() - t0, out.sync.seconds + out.sync.waited)
    return out


FOOTPRINT_KEYS = ("actor_trainable_params", "actor_total_params", "actor_optimizer_state_bytes", "actor_model_bytes",
                  "critic_model_bytes")
"""The training footprint per worker (workers.footprint; the critic's copy), measured after each update."""


def step_record(step: int, out: StepOutput, elapsed: float, kl_coef: float) -> dict[str, Any]:
    """The metrics record of one step: what the JSONL log, Prometheus and status.progress show."""
    stats, upd, adv = out.stats, out.update, out.advantages
    lag = int(upd.get("policy_lag", 0))
    record: dict[str, Any] = {
        "step": step,
        "reward_mean": stats["reward_mean"],
        "reward_max": stats["reward_max"],
        "kl": out.kl or 0.0,
        "kl_coef": float(kl_coef),
        "actor_loss": upd.get("actor_loss"),
        "critic_loss": upd.get("critic_loss"),
        "entropy": upd.get("entropy"),
        "clip_frac": upd.get("clip_frac"),
        "cov_frac": upd.get("cov_frac"),
        "actor_grad_norm": upd.get("actor_grad_norm"),
        "critic_grad_norm": upd.get("critic_grad_norm"),
        "actor_lr": upd.get("actor_lr"),
        "critic_lr": upd.get("critic_lr"),
        "behaviour_weight_mean": upd.get("behaviour_weight_mean"),
        "rollout_kl": upd.get("rollout_kl"),
        "rollout_weight_mean": upd.get("rollout_weight_mean"),
        "rollout_weight_cut_frac": upd.get("rollout_weight_cut_frac"),
        "rollout_weight_norm_factor": upd.get("rollout_weight_norm_factor"),
        "rollout_rejected_frac": upd.get("rollout_rejected_frac"),
        "rollout_rejected_seq_frac": upd.get("rollout_rejected_seq_frac"),
        "response_length": stats["response_length"],
        "shard_tokens_max_over_mean": stats.get("shard_tokens_max_over_mean"),
        "tokens_per_s": stats["tokens"] / elapsed,
        "policy_version": int(stats["policy_version"]) + lag + 1,
        "policy_lag": lag,
        "timing/step": elapsed,
        "orchestration_overhead_frac": max(0.0, 1.0 - out.compute / elapsed),
        **{f"timing/{k}": v for k, v in out.timings.items()},
        **{f"timing/{k}": v for k, v in out.seconds.items()},
        **({"weight_sync_bytes": out.sync.bytes, "timing/pipeline_wait": out.sync.waited} if out.sync else {}),
        **{k: v for k, v in adv.items() if k != "kl"},
        **{k: v for k, v in stats.items() if k.startswith((EXTRA_PREFIX, SAMPLING_PREFIX))},
        **{k: upd[k] for k in FOOTPRINT_KEYS if k in upd},
    }
    return {k: v for k, v in record.items() if v is not None}
