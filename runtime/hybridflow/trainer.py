"""The single controller: walks the dataflow graph each step (generate, score, evaluate, update, sync).

It runs inside a Ray actor (see driver.py); the heavy work runs in WorkerHost actors placed by the
HybridScheduler. Only small batches pass through here: the advantage math is the controller's own.
"""

from __future__ import annotations

import logging
import math
import random
import time
from pathlib import Path
from typing import Any

import ray
import torch

from hybridflow import algos, checkpoint
from hybridflow.advantages import batch_stats, compute_advantages
from hybridflow.api.spec import RLTrainingJob
from hybridflow.data.prompts import PromptSampler, load_rows
from hybridflow.metrics import MetricsLog, plot_metrics
from hybridflow.plan import step_plan, trainable_graph
from hybridflow.reporting import ProgressReporter
from hybridflow.scheduler import HybridScheduler
from hybridflow.scheduler.placement import pin_to_pools
from hybridflow.workers.batch import RolloutBatch
from hybridflow.workers.host import WorkerHost

log = logging.getLogger(__name__)

# errors that mean a worker process died (Ray restarts it through max_restarts)
WORKER_LOST = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)

class Trainer:
    """Owns the scheduler, the data position, the KL controller and the checkpoints."""

    def __init__(self, job: dict[str, Any], metrics_out: str | None = None, accelerator: str = "auto",
                 parallelism: int = 1, critic_parallelism: int | None = None) -> None:
        self.job = RLTrainingJob.model_validate(job)
        self.spec = self.job.spec
        if accelerator == "auto":
            accelerator = "GPU" if ray.cluster_resources().get("GPU", 0) > 0 else "CPU"
        self.accelerator = accelerator
        self.graph = pin_to_pools(trainable_graph(self.spec, accelerator, parallelism, critic_parallelism),
                                  ray.cluster_resources())
        self.plan = step_plan(self.graph, self.spec)
        t = self.spec.trainer
        self.scheduler = HybridScheduler(self.graph, self.spec.scheduling, max_restarts=t.worker_max_restarts,
                                         name_prefix=self.job.metadata.name)
        rows = load_rows(self.spec.data.train, self.spec.data.prompt_key, self.spec.data.answer_key, t.seed)
        self.sampler = PromptSampler(rows, self.spec.data.batch_size, t.seed, self.spec.data.shuffle)
        kl = self.spec.algorithm.kl_penalty
        self.kl_ctl = (algos.AdaptiveKLController(kl.coef, kl.target_kl, kl.horizon) if kl.adaptive
                       else algos.FixedKLController(kl.coef))
        self.metrics = MetricsLog(metrics_out)
        self.reporter = ProgressReporter.from_env()
        self.step = 0
        self.last_checkpoint: str | None = None
        self.latest: dict[str, Any] = {}
        self.started = False
        self.recoveries = 0
        self._host_counts: dict[str, int] = {}

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        spec_json = self.spec.model_dump(mode="json")
        use_gpu = self.accelerator == "GPU"
        seed = self.spec.trainer.seed

        def host_kwargs(group, instance: int) -> dict[str, Any]:
            return {"spec": spec_json, "roles": {n.name: n.role for n in group.nodes}, "instance": instance,
                    "seed": seed, "use_gpu": use_gpu}

        self.scheduler.start(WorkerHost, host_kwargs)
        self.started = True

    def shutdown(self) -> None:
        if self.started:
            self.scheduler.shutdown()
            self.started = False

    def progress(self) -> dict[str, Any]:
        """Polled by the driver for its progress bar (the actor runs with max_concurrency=2)."""
        return {"step": self.step, "total_steps": self.spec.trainer.total_steps, **self.latest}

    def fit(self) -> dict[str, Any]:
        """Train to totalSteps, resuming from the newest checkpoint when resume=auto."""
        if not self.started:
            self.start()
        total = self.spec.trainer.total_steps
        if self.spec.trainer.resume == "auto" and self._restore_latest():
            log.info("resumed from %s at step %d", self.last_checkpoint, self.step)
        else:
            self.metrics.reset()
        first_reward = None
        while self.step < total:
            try:
                record = self.train_step(self.step + 1)
            except WORKER_LOST as e:
                self._recover(e)
                continue
            self.step = record["step"]
            first_reward = record["reward_mean"] if first_reward is None else first_reward
            self.latest = {k: record[k] for k in ("reward_mean", "kl", "tokens_per_s") if k in record}
            self.metrics.write(record)
            self._maybe_checkpoint()
            if self.reporter:
                self.reporter.report(self.step, total, record, self.last_checkpoint, force=self.step == total)
        records = self.metrics.read()
        png = None
        if self.metrics.path:
            png = plot_metrics(records, self.metrics.path.with_suffix(".png"),
                               f"{self.job.metadata.name} ({self.spec.algorithm.name})")
        return {"steps": self.step, "records": records, "plot": str(png) if png else None,
                "recoveries": self.recoveries, "last_checkpoint": self.last_checkpoint}

    # -- one step ---------------------------------------------------------------------------------

    def _prompts(self) -> tuple[list[dict[str, str]], list[int]]:
        rows = self.sampler.next_batch()
        n = self.spec.rollout.samples_per_prompt
        return [r for r in rows for _ in range(n)], [i for i in range(len(rows)) for _ in range(n)]

    def _chunks(self, size: int) -> list[tuple[int, int]]:
        hosts = len(self.scheduler.hosts(self.plan.actor.name))
        per = self.spec.scheduling.micro_batch_size or math.ceil(size / hosts)
        return [(a, min(a + per, size)) for a in range(0, size, per)]

    def rollout_phase(self, rows: list[dict[str, str]], gids: list[int]) -> tuple[RolloutBatch, dict[str, float]]:
        """Generate in chunks; co-located steps run inside the actor's process, remote ones are streamed
        to their nodes as each chunk completes (through the object store, watched by backpressure)."""
        actor_name = self.plan.actor.name
        hosts = self.scheduler.hosts(actor_name)
        chunks = self._chunks(len(rows))
        gen_refs = [hosts[i % len(hosts)].rollout.remote(rows[a:b], gids[a:b], list(self.plan.colocated))
                    for i, (a, b) in enumerate(chunks)]
        chunk_of = {ref: i for i, ref in enumerate(gen_refs)}
        sent: dict[str, list[int]] = {r.edge: [] for r in self.plan.remote}
        waiting, turn = list(gen_refs), 0
        while waiting and self.plan.remote:
            done, waiting = ray.wait(waiting, num_returns=1)
            for r in self.plan.remote:
                consumers = self.scheduler.hosts(r.node.name)
                self.scheduler.channel(r.edge).put(consumers[turn % len(consumers)].run.remote(r.step.name, done[0]))
                sent[r.edge].append(chunk_of[done[0]])
                turn += 1
        parts = ray.get(gen_refs)
        self._observe()
        busy: dict[str, float] = {}
        for i, p in enumerate(parts):
            _add_busy(busy, f"{actor_name}_{i % len(hosts)}", sum(p.timings.values()))
        for r in self.plan.remote:
            for i, out in zip(sent[r.edge], self.scheduler.channel(r.edge).drain(), strict=True):
                parts[i].tensors.update(out["tensors"])
                parts[i].add_timing(out["step"], out["seconds"])
                _add_busy(busy, r.node.name, out["seconds"])
        batch = RolloutBatch.concat(parts)
        phase = {f"timing/{k}": v for k, v in batch.timings.items()}
        phase["compute/rollout"] = max(busy.values())
        return batch, phase

    def _observe(self) -> None:
        """One backpressure observation, taken when no generation is in flight (lowering the actor's
        parallelism then never kills a busy host); hosts added to a trained role get its current state."""
        self.scheduler.observe()
        for node in (self.plan.actor, self.plan.critic):
            if node is None:
                continue
            hosts = self.scheduler.hosts(node.name)
            known = self._host_counts.get(node.name, len(hosts))
            if len(hosts) > known:
                state = hosts[0].export_state.remote()
                ray.get([h.import_state.remote(state) for h in hosts[known:]])
            self._host_counts[node.name] = len(hosts)

    def values_phase(self, batch: RolloutBatch) -> float:
        """Critic values, data-parallel over the critic's ranks; returns the slowest rank's compute."""
        hosts = self.scheduler.hosts(self.plan.critic.name)
        shards = batch.shard(len(hosts))
        outs = ray.get([h.run.remote("values", s) for h, s in zip(hosts, shards, strict=False)])
        batch.tensors["values"] = torch.cat([o["tensors"]["values"] for o in outs])
        return max(o["seconds"] for o in outs)

    def update_phase(self, batch: RolloutBatch) -> tuple[dict[str, float], float]:
        """Actor and critic updates run at the same time on their own ranks."""
        actors = self.scheduler.hosts(self.plan.actor.name)
        refs = [h.update_actor.remote(s, self.kl_ctl.value) for h, s in zip(actors, batch.shard(len(actors)),
                                                                             strict=False)]
        crefs = []
        if self.plan.critic is not None:
            critics = self.scheduler.hosts(self.plan.critic.name)
            crefs = [h.update_critic.remote(s) for h, s in zip(critics, batch.shard(len(critics)), strict=False)]
        actor_out = ray.get(refs)
        critic_out = ray.get(crefs)
        metrics = dict(actor_out[0])
        compute = max(o["timing/actor_update_compute"] for o in actor_out)
        if critic_out:
            metrics.update(critic_out[0])
            compute = max(compute, max(o["timing/critic_update_compute"] for o in critic_out))
        return metrics, compute

    def _fused(self) -> bool:
        """True when the whole step can run inside the single actor process (see WorkerHost.train_step)."""
        return self.plan.fused and self.plan.critic is None

    def train_step(self, step: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        rows, gids = self._prompts()
        if self._fused():
            host = self.scheduler.hosts(self.plan.actor.name)[0]
            out = ray.get(host.train_step.remote(rows, gids, list(self.plan.colocated), self.kl_ctl.value))
            elapsed = time.perf_counter() - t0
            upd, adv_metrics, stats = out["update"], out["advantages"], out["stats"]
            rollout_s = sum(out["timings"].values())
            update_s = upd["timing/actor_update_compute"]
            phase = {f"timing/{k}": v for k, v in out["timings"].items()}
            phase.update({"timing/rollout": rollout_s, "timing/advantages": out["advantages_s"],
                          "timing/update": update_s})
            compute = rollout_s + out["advantages_s"] + update_s
        else:
            batch, phase = self.rollout_phase(rows, gids)
            compute = phase.pop("compute/rollout")
            phase["timing/rollout"] = time.perf_counter() - t0
            t1 = time.perf_counter()
            if self.plan.critic is not None:
                compute += self.values_phase(batch)
            phase["timing/values"] = time.perf_counter() - t1
            t2 = time.perf_counter()
            adv_metrics = compute_advantages(batch, self.spec, self.kl_ctl.value)
            phase["timing/advantages"] = time.perf_counter() - t2
            t3 = time.perf_counter()
            upd, upd_compute = self.update_phase(batch)
            phase["timing/update"] = time.perf_counter() - t3
            compute += upd_compute + phase["timing/advantages"]
            elapsed = time.perf_counter() - t0
            stats = batch_stats(batch)
        if "kl" in adv_metrics:
            self.kl_ctl.update(adv_metrics["kl"], int(stats["size"]))
        record: dict[str, Any] = {
            "step": step,
            "reward_mean": stats["reward_mean"],
            "reward_max": stats["reward_max"],
            "kl": adv_metrics.get("kl", 0.0),
            "kl_coef": float(self.kl_ctl.value),
            "actor_loss": upd.get("actor_loss"),
            "critic_loss": upd.get("critic_loss"),
            "entropy": upd.get("entropy"),
            "clip_frac": upd.get("clip_frac"),
            "response_length": stats["response_length"],
            "tokens_per_s": stats["tokens"] / elapsed,
            "policy_version": int(stats["policy_version"]) + 1,
            "timing/step": elapsed,
            "orchestration_overhead_frac": max(0.0, 1.0 - compute / elapsed),
            **phase,
            **{k: v for k, v in adv_metrics.items() if k != "kl"},
        }
        return {k: v for k, v in record.items() if v is not None}

    # -- checkpoints and recovery -----------------------------------------------------------------

    def _maybe_checkpoint(self) -> None:
        ck = self.spec.trainer.checkpoint
        if ck.every and (self.step % ck.every == 0 or self.step == self.spec.trainer.total_steps):
            self.save_checkpoint()

    def _instances(self) -> list[tuple[str, Any]]:
        """(file name, host) for every host that owns trainable state, one file per rank."""
        out = []
        for group in self.graph.colocation_groups():
            lead = group.nodes[0].name
            for i, h in enumerate(self.scheduler.hosts(lead)):
                out.append((f"{lead}_{i}", h))
        return out

    def save_checkpoint(self) -> str:
        root = self.spec.trainer.checkpoint.path
        staging = checkpoint.staging_dir(root, self.step)
        ray.get([h.save.remote(str(staging), name) for name, h in self._instances()])
        torch.save({"step": self.step, "kl_ctl": self.kl_ctl.state_dict(), "data": self.sampler.state_dict(),
                    "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
                    "world": {name: 1 for name, _ in self._instances()}},
                   staging / "controller.pt")
        final = checkpoint.commit(staging, root, self.step)
        checkpoint.prune(root, self.spec.trainer.checkpoint.keep)
        self.last_checkpoint = str(final)
        return self.last_checkpoint

    def _restore_latest(self) -> bool:
        found = checkpoint.latest(self.spec.trainer.checkpoint.path)
        if found is None:
            return False
        _step, path = found
        state = torch.load(Path(path) / "controller.pt", weights_only=False)
        missing = sorted(set(state["world"]) - {name for name, _ in self._instances()})
        if missing:
            raise RuntimeError(f"checkpoint {path} was written by ranks {missing} that this plan lacks: "
                               "resume needs the same parallelism")
        ray.get([h.load.remote(str(path), name) for name, h in self._instances()])
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.sampler.load_state_dict(state["data"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        self.step = int(state["step"])
        self.last_checkpoint = str(path)
        self.metrics.truncate_after(self.step)
        return True

    def _recover(self, error: Exception) -> None:
        """A worker died: wait for Ray to restart it, rejoin the ranks, roll every role back together."""
        self.recoveries += 1
        if self.recoveries > max(1, self.spec.trainer.worker_max_restarts):
            raise RuntimeError(f"giving up after {self.recoveries - 1} recoveries: {error}") from error
        log.warning("worker lost at step %d (%s); restoring the last checkpoint", self.step + 1,
                    type(error).__name__)
        self.scheduler.wait_ready(self.spec.scheduling.placement_timeout_seconds)
        self.scheduler.setup_distributed_all()
        if not self._restore_latest():
            ray.get([h.reset.remote() for _, h in self._instances()])
            self.step = 0
            self.sampler.load_state_dict({"epoch": 0, "position": 0})
            self.kl_ctl.load_state_dict({"value": self.spec.algorithm.kl_penalty.coef})
            self.metrics.reset()


def _add_busy(busy: dict[str, float], key: str, seconds: float) -> None:
    busy[key] = busy.get(key, 0.0) + seconds
