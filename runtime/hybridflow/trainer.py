"""The single controller: walks the dataflow graph each step (generate, score, evaluate, update, sync).

It runs inside a Ray actor (see driver.py); the heavy work runs in WorkerHost actors placed by the
HybridScheduler. Only small batches pass through here: the advantage math is the controller's own.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import ray
import torch

from hybridflow import algos, checkpoint
from hybridflow.api.spec import MAX_STEPS, RLTrainingJob
from hybridflow.checkpoint import CONTROLLER_FILE, JOB_FILE
from hybridflow.control import store
from hybridflow.control.errors import ControlError
from hybridflow.control.names import job_ref
from hybridflow.control.steering import Steering
from hybridflow.dashboard import report_path, write_report
from hybridflow.data import DataError
from hybridflow.data.prompts import PromptSampler, load_prompts, repeat_samples
from hybridflow.dynamic_sampling import fill_with_varied_groups
from hybridflow.evaluation import PREFIX, eval_due, eval_seed, last_val_reward, val_metrics
from hybridflow.export import SPEC, export_policy
from hybridflow.metrics import MetricsLog, plot_metrics
from hybridflow.plan import (
    SP_FIELDS,
    STEP_OF_ROLE,
    RemoteStep,
    sequence_parallel_problem,
    sequence_parallel_sizes,
    sequences_per_step,
    step_plan,
    trainable_graph,
)
from hybridflow.ray_errors import innermost_message
from hybridflow.reporting import ProgressReporter
from hybridflow.samples import sample_rows, write_samples
from hybridflow.scheduler import HybridScheduler
from hybridflow.scheduler.group import HostGroup
from hybridflow.scheduler.head import HeadWatch
from hybridflow.scheduler.hybrid import WORKER_LOST
from hybridflow.scheduler.placement import bundle_for, pin_to_pools, torch_threads
from hybridflow.step import PhaseResult, Prompts, SyncResult, UpdateResult, run_step, step_record
from hybridflow.telemetry import StepExporter
from hybridflow.trackers import TRACKERS, TrackerSet, TrackerUnavailable, missing_extras, open_trackers
from hybridflow.workers.batch import RolloutBatch, extra_means
from hybridflow.workers.host import WorkerHost
from hybridflow.workers.modeling import quiet_transformers

log = logging.getLogger(__name__)

LOST_PROBE_S = 60.0
"""How long a host may take to answer before a failed step blames its death (Ray's node health check
takes about 30 s to declare a vanished pod's raylet dead)."""
MEMORY_SAMPLE_S = 5.0
"""How often the loop asks the hosts for their memory (the dashboard's heatmap): one round trip per host."""
HANDOVER_S = 0.002
"""How long the controller sleeps after a result with the next step queued behind it, before its bookkeeping.
A host whose torch holds every core of the machine it shares with the controller (a laptop run) needs a core
to hand over from one step to the next; the controller's bookkeeping at that moment starved it, and the host
then started its queued step about 1.5 ms late. The sleep overlaps the queued step, so it costs nothing while
it is shorter than a step (it is capped at a tenth of the step's compute)."""


def controller_state(step: int, kl_ctl: algos.FixedKLController | algos.AdaptiveKLController,
                     data: dict[str, int], ranks: list[str]) -> dict[str, Any]:
    """The controller's part of a checkpoint, in types `torch.load(weights_only=True)` reads back.

    The step, the KL coefficient, the data position (PromptSampler.state_dict) the next step draws from, the
    RNG states (torch's a tensor, Python's a tuple of ints) and the rank files written beside it.
    """
    return {"step": int(step), "kl_ctl": kl_ctl.state_dict(), "data": dict(data),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
            "world": dict.fromkeys(ranks, 1)}


def steps_of_epochs(sampler: PromptSampler, epochs: int) -> int:
    """spec.trainer.totalEpochs as a step count; a DataError beyond the steps a job may take."""
    steps = sampler.steps_for(epochs)
    if steps > MAX_STEPS:
        raise DataError(f"spec.trainer.totalEpochs: {epochs} passes over {len(sampler.rows)} prompts at batchSize "
                        f"{sampler.batch_size} take {steps} steps, more than the {MAX_STEPS} a job may take")
    return steps


class Trainer:
    """Owns the scheduler, the data position, the KL controller and the checkpoints."""

    def __init__(self, job: dict[str, Any], metrics_out: str | None = None, accelerator: str = "auto",
                 parallelism: int = 1, critic_parallelism: int | None = None) -> None:
        self.job = RLTrainingJob.model_validate(job)
        self.spec = self.job.spec
        missing = missing_extras(self.spec.trainer.loggers.backends)
        if missing:
            raise TrackerUnavailable("; ".join(missing))
        if accelerator == "auto":
            accelerator = "GPU" if ray.cluster_resources().get("GPU", 0) > 0 else "CPU"
        self.accelerator: Literal["GPU", "CPU"] = "GPU" if accelerator == "GPU" else "CPU"
        self.graph = pin_to_pools(trainable_graph(self.spec, self.accelerator, parallelism, critic_parallelism),
                                  ray.cluster_resources())
        self.plan = step_plan(self.graph, self.spec)
        t = self.spec.trainer
        self.scheduler = HybridScheduler(self.graph, self.spec.scheduling, max_restarts=t.worker_max_restarts,
                                         name_prefix=self.job.metadata.name,
                                         step_sequences=sequences_per_step(self.spec))
        self.groups = {n.name: HostGroup(n.name, self.scheduler) for n in self.graph.nodes}
        out = {e.dst_name: self.scheduler.channel(e.key) for e in self.graph.data_edges()
               if e.src_name == self.plan.actor.name}
        self._handed_in_process = [c for c in out.values() if c.transport == "in_process"]
        """Edges whose consumer runs in the actor's process: each generated chunk is handed over in place."""
        critic = self.plan.critic.name if self.plan.critic is not None else None
        self._to_critic = out.get(critic) if critic is not None and self.plan.critic in self.plan.trained else None
        """The edge a separate critic's values get the step's batch on in the scores phase (the object store)."""
        self.actor = self.groups[self.plan.actor.name]
        self.critic = self.groups[self.plan.critic.name] if self.plan.critic is not None else None
        self.trained = [self.groups[n.name] for n in self.plan.trained]
        sizes = sequence_parallel_sizes(self.spec)
        self.sp_asked = {n.name: sizes[n.role] for n in self.plan.trained}
        """Each trained group's sequence-parallel size in the spec (a critic on the actor's hosts follows the actor)."""
        self.sp = dict(self.sp_asked)
        """The sizes in force: a group's ranks take shards in groups of this many; 1 once disable_ulysses ran."""
        self._policy_syncs = self.scheduler.policy_syncs(self.plan.policy_edge)
        self._next: Prompts | None = None
        """With plan.lag 1: the next step's prompts, whose rollout overlaps this step's update."""
        self._data_before_next: dict[str, int] = {}
        """The data position before `_next` was drawn: where a checkpoint's resumed run draws again."""
        self._ready: list[RolloutBatch] | None = None
        """The batches of `_next`, back from the actor's hosts (a plan that is not fused)."""
        self._sampling_stats: dict[str, float] = {}
        """The last step's dynamic sampling (spec.algorithm.filterGroups)."""
        self.queue_ahead = True
        """Queue each fused step on the actor's host while the one before it runs (`_may_queue_next`)."""
        self._queued: _QueuedStep | None = None
        self._result_at = 0.0
        """When the last step's result arrived: a queued step's time runs from here."""
        self.queued_steps: list[int] = []
        """The steps queued while the one before them ran."""
        self.sampler = PromptSampler(load_prompts(self.spec, "train"), self.spec.data.batch_size, t.seed,
                                     self.spec.data.shuffle)
        if t.total_epochs is not None:  # before the hosts get the spec: their schedules end at totalSteps
            t.total_steps = steps_of_epochs(self.sampler, t.total_epochs)
            log.info("spec.trainer.totalEpochs %d over %d prompts of batchSize %d: %d steps", t.total_epochs,
                     len(self.sampler.rows), self.spec.data.batch_size, t.total_steps)
        self.val_rows = load_prompts(self.spec, "val")
        kl = self.spec.algorithm.kl_penalty
        self.kl_ctl = (algos.AdaptiveKLController(kl.coef, kl.target_kl, kl.horizon) if kl.adaptive
                       else algos.FixedKLController(kl.coef))
        self.metrics_out = metrics_out
        self.metrics = MetricsLog(metrics_out if "jsonl" in self.spec.trainer.loggers.backends else None)
        self.trackers = TrackerSet({})
        self.reporter = ProgressReporter.from_env()
        self.telemetry = StepExporter(self.job.metadata.name)
        self.head = HeadWatch()
        self.step = 0
        self.last_checkpoint: str | None = None
        self.owner: str | None = None
        """This controller's claim on the checkpoint directory (checkpoint.claim), when checkpoints are on."""
        self.latest: dict[str, Any] = {}
        self.last_val: dict[str, float] = {}
        """val/reward_mean of the last evaluation, carried into progress until the next one."""
        self.started = False
        self.recoveries = 0
        self._host_counts: dict[str, int] = {}
        self._steering_failure: Exception | None = None
        """A change from outside that failed at the last safe point; the loop recovers first if a host died."""
        self._memory_at: float | None = None
        self.ref = job_ref(self.job.metadata.name, self.job.metadata.namespace)
        self.steering = Steering(self.scheduler, store.TargetStore(Path(t.checkpoint.path) / store.FILE_NAME),
                                 rules=[self._parallelism_problem], on_change=self._sync_new_hosts,
                                 on_error=self._steering_failed)

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        spec_json = self.spec.model_dump(mode="json")
        use_gpu = self.accelerator == "GPU"
        seed = self.spec.trainer.seed

        def host_kwargs(group, instance: int) -> dict[str, Any]:
            return {"spec": spec_json, "roles": {n.name: n.role for n in group.nodes}, "instance": instance,
                    "seed": seed, "use_gpu": use_gpu, "job": self.job.metadata.name,
                    "threads": torch_threads(bundle_for(group)), "lag": self.plan.lag, "scored": self.plan.scored}

        self.scheduler.start(WorkerHost, host_kwargs)
        if self.spec.trainer.checkpoint.every:
            self.owner = checkpoint.claim(self.spec.trainer.checkpoint.path)
        self.started = True
        self._host_counts = {g.node: len(g.hosts) for g in self.trained}
        if self.spec.trainer.resume == "never" and not _restarted_by_ray():
            self.steering.store.clear()  # a fresh run starts from the spec, as it ignores checkpoints
        self.steering.reapply()  # before a checkpoint loads: it may hold the stored parallelism's ranks
        off = set(self.steering.store.read()["sequence_parallel_off"])
        if any(self.sp[n] > 1 for n in off & set(self.sp)):
            self._sequence_parallel_off("re-applied after a controller restart", off)

    def shutdown(self) -> None:
        if self.started:
            self.scheduler.shutdown()
            self.started = False

    def progress(self) -> dict[str, Any]:
        """Polled by the driver for its progress bar (the actor runs calls on several threads)."""
        return {"step": self.step, "total_steps": self.spec.trainer.total_steps, **self.latest}

    def control_status(self) -> dict[str, Any]:
        """For `hybridflow.connect` and `hybridflow ctl status`: the scheduler's status, the step, and
        what was asked for from outside. Answered on another of the actor's threads while `fit` runs."""
        for attempt in range(5):
            try:
                status = self.scheduler.get_status()
                break
            except RuntimeError:  # the loop changed a queue while it was read
                if attempt == 4:
                    raise
                time.sleep(0.05)
        controller = {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}
        return {"job": str(self.ref), "step": self.step, "total_steps": self.spec.trainer.total_steps,
                "controller": controller, **status, "manual": self.steering.status(),
                "metrics_path": str(self.metrics.path) if self.metrics.path else None}

    def dashboard_records(self, after: int = -1) -> list[dict[str, Any]]:
        """The metrics records past step `after`, for `hybridflow dashboard` (which may not see the file)."""
        return [r for r in self.metrics.read() if r.get("step", 0) > after]

    def control_scale(self, node: str, parallelism: int, reason: str, wait_s: float = 600.0) -> dict[str, Any]:
        """For `adjust_parallelism` from outside: applied at the next step boundary (see Steering)."""
        return self.steering.request(node, parallelism, reason, wait_s)

    def control_disable_ulysses(self, reason: str, wait_s: float = 600.0) -> dict[str, Any]:
        """For `disable_ulysses` from outside: at the next step boundary every trained group with sequence
        parallelism goes back to plain data parallelism over whole sequences (see Steering.at_boundary)."""
        return self.steering.at_boundary(lambda: self._disable_ulysses(reason or "no reason given"), wait_s)

    def _disable_ulysses(self, reason: str) -> dict[str, Any]:
        on = {n for n, size in self.sp.items() if size > 1}
        if not on:
            raise ControlError(f"sequence parallelism is not on in this job ({' and '.join(SP_FIELDS.values())} "
                               "are 1, or it was turned off already)")
        before = self.steering.store.read()
        try:  # kept first, so that a restarted controller leaves it off too
            for node in sorted(on):
                self.steering.store.record_sequence_parallel_off(node, self.sp[node], reason)
        except OSError as e:
            self.steering.store.write(before)
            raise ControlError(f"cannot store the change in {self.steering.store.path}: {e}") from None
        try:
            return self._sequence_parallel_off(reason, on)
        except BaseException:
            self.steering.store.write(before)
            raise

    def _sequence_parallel_off(self, reason: str, nodes: set[str]) -> dict[str, Any]:
        """The ranks of `nodes` go on over whole sequences, as plain data-parallel ranks; a Manual decision each.
        Returns {"changes": [{node, old, sequence_parallel, ranks}, ...]}."""
        changes = []
        for group in self.trained:
            if group.node not in nodes or self.sp[group.node] == 1:
                continue
            old, self.sp[group.node] = self.sp[group.node], 1
            group.call("disable_sequence_parallel")
            ranks = len(group)
            self.scheduler.decide(f"Manual: {group.node} sequence parallelism {old} -> off: {ranks} "
                                  f"data-parallel ranks over whole sequences ({reason})", "sequence_parallel",
                                  group.node, reason)
            changes.append({"node": group.node, "old": old, "sequence_parallel": 1, "ranks": ranks})
        return {"changes": changes}

    def _replicas(self, group: HostGroup) -> int:
        """Hosts of `group` that share each shard: its SP size in force."""
        return self.sp[group.node]

    def _retell_sequence_parallel_off(self, group: HostGroup, hosts: list[Any]) -> None:
        """Hosts built after SP was turned off on `group` (restarted by Ray, reset, or added by a scale-up) start
        at the spec's size; they are told again before they train."""
        if hosts and self.sp[group.node] < self.sp_asked[group.node]:
            ray.get([h.disable_sequence_parallel.remote() for h in hosts])

    def fit(self) -> dict[str, Any]:
        """Train to totalSteps; requests from outside are applied between steps."""
        self.steering.open()
        try:
            return self._fit()
        finally:
            self.steering.close()

    def _fit(self) -> dict[str, Any]:
        """Train to totalSteps, resuming from the newest checkpoint when resume=auto.

        Each record goes to metrics.jsonl and to the trackers of spec.trainer.loggers, opened here (after a
        resume, from the restored step on) and closed at the end. A rollback after a worker loss truncates
        metrics.jsonl, while the trackers simply receive the replayed steps again.
        """
        if not self.started:
            self.start()
        total = self.spec.trainer.total_steps
        if self.spec.trainer.resume == "auto" and self._restore():
            log.info("resumed from %s at step %d", self.last_checkpoint, self.step)
        else:
            if moved := checkpoint.retire(self.spec.trainer.checkpoint.path):
                log.info("this run starts from the spec: an earlier run's checkpoints are now in %s", moved)
            self.metrics.reset()
        baseline = self.spec.trainer.eval_before_train and self.step == 0 and bool(self.val_rows)
        self.trackers = open_trackers(self.job, TRACKERS, self.metrics_out,
                                      first_step=self.step if baseline else self.step + 1)
        try:
            if baseline:
                self._evaluate_before_training(total)
            self._loop(total)
        finally:
            self.trackers.close()
        exported = self.export_final()
        records = self.metrics.read()
        png = report = None
        if self.metrics.path:
            title = f"{self.job.metadata.name} ({self.spec.algorithm.name})"
            png = plot_metrics(records, self.metrics.path.with_suffix(".png"), title)
            report = self._write_report(records, title)
        return {"steps": self.step, "records": records, "plot": str(png) if png else None,
                "report": str(report) if report else None,
                "recoveries": self.recoveries, "last_checkpoint": self.last_checkpoint, "export": exported}

    def _evaluate_before_training(self, total: int) -> None:
        """spec.trainer.evalBeforeTrain: the starting policy's val/ metrics, the record of step 0."""
        record = {"step": 0} | self.evaluate(0)
        self.last_val = last_val_reward([record])
        self.latest = dict(self.last_val)
        self.metrics.write(record)
        self.trackers.log_record(record)
        self.telemetry.export_eval(record)
        if self.reporter:
            self.reporter.report(0, total, self.last_val, self.last_checkpoint, force=True)

    def export_final(self) -> str | None:
        """spec.trainer.export: the final policy as a Hugging Face folder (export.py), from rank 0's weights
        (gathered from the shards first where the ranks keep no full copy)."""
        ex = self.spec.trainer.export
        if not ex.path:
            return None
        quiet_transformers()
        hosts = self.scheduler.hosts(self.plan.actor.name)
        ray.get([h.hold_copies.remote() for h in hosts])
        weights: Any = ray.get(hosts[0].policy_weights.remote())  # name -> tensor
        done = export_policy(self.job, weights, self.step, ex.path, ex.adapters, overwrite=True, names=SPEC)
        log.info("exported the policy at step %d to %s", self.step, done.path)
        return str(done.path)

    def _write_report(self, records: list[dict[str, Any]], title: str) -> Path | None:
        """The run's dashboard as one HTML file beside its metrics; a failure here must not fail the run."""
        assert self.metrics.path is not None
        try:
            self.scheduler.sample_memory()
            return write_report(records, self.control_status(), report_path(self.metrics.path), title)
        except Exception as e:
            log.warning("could not write the dashboard report: %s", e)
            return None

    def _memory_due(self) -> bool:
        return self._memory_at is None or time.monotonic() - self._memory_at >= MEMORY_SAMPLE_S

    def _maybe_sample_memory(self) -> None:
        if self._queued is None and self._memory_due():  # a host answers only between its calls
            self._memory_at = time.monotonic()
            self.scheduler.sample_memory()

    def _loop(self, total: int) -> None:
        try:
            self._steps(total)
        finally:
            if self._queued is not None:  # the run stops early: a queued step must not run on
                ray.cancel(self._queued.ref)
                self._queued = None

    def _steps(self, total: int) -> None:
        while self.step < total:
            if self._queued is None:  # a safe point: nothing is in flight
                self.steering.serve()
            failed, self._steering_failure = self._steering_failure, None
            if failed is not None and self._worker_died(failed):
                self._recover(failed)
                continue
            try:
                record = self.train_step(self.step + 1, self._may_queue_next(self.step + 1, total))
                if self.val_rows and eval_due(record["step"], total, self.spec.trainer.eval_every):
                    record |= self.evaluate(record["step"])
            except (*WORKER_LOST, ray.exceptions.RayTaskError) as e:
                self._recover_or_raise(e)
                continue
            self.step = record["step"]
            self.last_val = last_val_reward([record]) or self.last_val
            self.latest = {k: record[k] for k in ("reward_mean", "kl", "tokens_per_s") if k in record} | self.last_val
            self.head.check()
            self._check_owner()
            self.metrics.write(record)
            self.trackers.log_record(record)
            self.telemetry.export(record, self.scheduler)
            self._maybe_sample_memory()
            try:
                self._maybe_checkpoint()
            except (*WORKER_LOST, ray.exceptions.RayTaskError) as e:  # this step is redone from the last checkpoint
                self._recover_or_raise(e)
                continue
            if self.reporter:
                self.reporter.report(self.step, total, self.last_val | record, self.last_checkpoint,
                                     force=self.step == total)

    # -- one step ---------------------------------------------------------------------------------

    def _prompts(self) -> Prompts:
        return repeat_samples(self.sampler.next_batch(), self.spec.rollout.samples_per_prompt)

    def _chunks(self, size: int, spread: int | None = None) -> list[tuple[int, int]]:
        """[a, b) ranges of micro_batch_size rows, else of an equal share of `spread` (default: all) per actor host."""
        per = self.spec.scheduling.micro_batch_size or math.ceil((spread or size) / len(self.actor))
        return [(a, min(a + per, size)) for a in range(0, size, per)]

    def train_step(self, step: int, queue_next: bool = False) -> dict[str, Any]:
        """rollout -> values -> advantages -> update -> sync here over the host groups, or in one call on the
        actor's host when the plan fuses the step; then the record. With plan.lag 1 the next step's prompts
        are drawn now, and their rollout overlaps this update. `queue_next` (see `_may_queue_next`) queues
        step + 1's call on the actor's host before this one's result is awaited; its time then runs from this
        step's result to its own."""
        t0 = time.perf_counter()
        kl_coef = self.kl_ctl.value
        queued, self._queued = self._queued, None
        fused: ray.ObjectRef | None = None
        if queued is not None:
            assert queued.step == step, f"step {queued.step} was queued, step {step} asked for"
            fused, t0 = queued.ref, max(queued.submitted, self._result_at)
        else:
            rows, gids = self._next or self._prompts()
            self._next = None
            if self.plan.lag and step < self.spec.trainer.total_steps:
                self._data_before_next = self.sampler.state_dict()
                self._next = self._prompts()
            if self.plan.fused:
                fused = self._submit_fused(rows, gids, kl_coef)
        if queue_next:
            data_before = self.sampler.state_dict()
            self._queued = _QueuedStep(step + 1, self._submit_fused(*self._prompts(), kl_coef), time.perf_counter(),
                                       data_before)
            self.queued_steps.append(step + 1)
        if fused is not None:
            out = ray.get(fused)
            for channel in self._handed_in_process:
                channel.record_bytes(out.rollout_bytes)
        else:
            out = run_step(self, self.plan.phases, rows, gids, self.spec, kl_coef, self._next,
                           max(1, len(self.actor) // self._replicas(self.actor)))
            out.stats |= self._sampling_stats
        self._result_at = time.perf_counter()
        elapsed = self._result_at - t0
        if self._queued is not None:
            time.sleep(min(HANDOVER_S, out.compute / 10))
        if out.kl is not None:
            self.kl_ctl.update(out.kl, int(out.stats["size"]))
        record = step_record(step, out, elapsed, self.kl_ctl.value)
        if out.samples is not None and self.spec.trainer.rollout_data_dir is not None:
            write_samples(self.spec.trainer.rollout_data_dir, step, out.samples)
        assert out.sync is not None
        self._policy_syncs.record(out.sync.version, out.sync.bytes, out.sync.seconds, record["policy_lag"])
        return record

    def _submit_fused(self, rows: list[dict[str, str]], gids: list[int], kl_coef: float) -> ray.ObjectRef:
        """The whole step as one call to the actor's single host."""
        host, = self.actor.hosts
        return host.run_step.remote(list(self.plan.phases), rows, gids, list(self.plan.colocated), kl_coef,
                                    self._next, self.plan.late)

    def _may_queue_next(self, step: int, total: int) -> bool:
        """Whether step + 1 may be queued on the actor's host while `step` runs, so that the controller's round
        trip and its work between steps overlap the host's compute. Only a fused, on-policy step with a fixed
        KL coefficient needs nothing from the step before it but the host's own state; and nothing may be due
        at this step's boundary that needs the host idle or this step's result: a checkpoint, an evaluation,
        a memory sample, an outside request, the end."""
        return (self.queue_ahead and self.plan.fused and not self.plan.lag and step < total
                and not self.spec.algorithm.kl_penalty.adaptive and not self._checkpoint_due(step)
                and not (self.val_rows and eval_due(step, total, self.spec.trainer.eval_every))
                and not self._memory_due() and not self.steering.pending())

    def _data_state(self) -> dict[str, int]:
        """Where the step after the last finished one draws its prompts (before any drawn ahead)."""
        if self._queued is not None:
            return self._queued.data_before
        return self._data_before_next if self._next is not None else self.sampler.state_dict()

    def _forget_pipeline(self) -> None:
        """A rollback: prompts and batches drawn ahead belong to the abandoned run (the hosts drop theirs on load),
        and a queued step's result is not waited for."""
        self._next, self._ready, self._queued = None, None, None

    def rollout_phase(self, rows: list[dict[str, str]], gids: list[int]) -> tuple[RolloutBatch, float]:
        """`_rollout`; with spec.algorithm.filterGroups, further prompts are drawn and rolled out until the batch holds
        data.batchSize groups that teach something (dynamic_sampling; their stats go into the step's record). Until
        then only the reward runs: the plan's other steps score the kept groups alone."""
        rule = self.spec.algorithm.filter_groups
        if rule is None:
            return self._rollout(rows, gids)
        first = {STEP_OF_ROLE["reward"].name}
        batch, compute = self._rollout(rows, gids, first)
        spent, prompts = [compute], len(set(gids))

        def more(k: int) -> RolloutBatch:
            rows, gids = self._prompts()
            part, seconds = self._rollout(rows, [g + k * prompts for g in gids], first)
            spent.append(seconds)
            return part

        batch, self._sampling_stats = fill_with_varied_groups(batch, more, self.spec.data.batch_size, rule)
        batch, seconds = self._score_rest(batch, first)
        return batch, sum(spent) + seconds

    def _rollout(self, rows: list[dict[str, str]], gids: list[int],
                 only: Collection[str] | None = None) -> tuple[RolloutBatch, float]:
        """Generate in chunks; co-located steps run inside the actor's process, remote ones are streamed
        to their nodes as each chunk completes (through the object store, watched by backpressure).
        A batch generated during the last update only gets its late steps and the remote ones now. `only`: of the
        plan's steps, only these run (see `_score_rest`).
        Returns the scored batch and the busiest host's compute."""
        chain, remote = self._steps_where(lambda step: only is None or step in only)
        ready, self._ready = self._ready, None
        if ready is None:
            dealt = self.actor.deal("rollout", [(rows[a:b], gids[a:b], chain) for a, b in self._chunks(len(rows))])
            timed_before: list[set[str]] = [set() for _ in dealt]
        else:
            dealt = self.actor.deal("late", [(part, list(self.plan.late)) for part in ready])
            timed_before = [set(part.timings) for part in ready]
        return self._collect(dealt, timed_before, remote)

    def _steps_where(self, keep: Callable[[str], bool]) -> tuple[list[str], list[RemoteStep]]:
        """The plan's steps that `keep` names: those of the actor's process (co-located, then late) and the
        remote ones."""
        return ([s for s in (*self.plan.colocated, *self.plan.late) if keep(s)],
                [r for r in self.plan.remote if keep(r.step.name)])

    def _score_rest(self, batch: RolloutBatch, done: Collection[str]) -> tuple[RolloutBatch, float]:
        """The plan's steps other than `done` on `batch`, in chunks dealt to the actor's hosts as `_rollout` deals
        its prompts, the remote ones streamed from there."""
        chain, remote = self._steps_where(lambda step: step not in done)
        if not chain and not remote:
            return batch, 0.0
        parts = [batch.slice(a, b) for a, b in self._chunks(len(batch))]
        return self._collect(self.actor.deal("late", [(part, chain) for part in parts]),
                             [set(part.timings) for part in parts], remote)

    def _collect(self, dealt: list[tuple[int, ray.ObjectRef]], timed_before: list[set[str]],
                 remote: list[RemoteStep]) -> tuple[RolloutBatch, float]:
        """The dealt chunks back, each through the `remote` steps as it arrives; the batch and the busiest host's
        compute (the seconds of the timings a chunk did not have in `timed_before`)."""
        gen_refs = [ref for _, ref in dealt]
        chunk_of = {ref: i for i, ref in enumerate(gen_refs)}
        sent: dict[str, list[int]] = {r.edge: [] for r in remote}
        got: dict[ray.ObjectRef, RolloutBatch] = {}
        waiting = list(gen_refs)
        while waiting and remote:
            done, waiting = ray.wait(waiting, num_returns=1)
            got[done[0]] = part = ray.get(done[0])  # its size decides whether it may leave the actor's process
            for r in remote:
                channel = self.scheduler.channel(r.edge)
                channel.record_bytes(part.nbytes())
                channel.put(self.groups[r.node.name].next("run", done[0], r.step.name), len(part))
                sent[r.edge].append(chunk_of[done[0]])
        rest = [ref for ref in gen_refs if ref not in got]
        got.update(zip(rest, ray.get(rest), strict=True))
        parts = [got[ref] for ref in gen_refs]
        for channel in self._handed_in_process:
            for part in parts:
                channel.record_bytes(part.nbytes())
        self._observe()
        busy: dict[str, float] = {}
        for (host, _), part, timed in zip(dealt, parts, timed_before, strict=True):
            _add_busy(busy, f"{self.actor.node}_{host}", part.seconds_besides(timed))
        for r in remote:
            results: list[PhaseResult] = self.scheduler.channel(r.edge).drain()
            for i, res in zip(sent[r.edge], results, strict=True):
                parts[i].tensors.update(res.tensors)
                parts[i].add_timing(res.step, res.seconds)
                _add_busy(busy, r.node.name, res.seconds)
        return RolloutBatch.concat(parts), max(busy.values())

    def evaluate(self, step: int) -> dict[str, float]:
        """The val/ metrics of the policy after `step` updates: spec.data.val answered with spec.trainer.eval's
        sampling and scored by the reward alone (no critic, no update), in chunks no larger than a training
        step gives each actor host, dealt over those hosts."""
        t0 = time.perf_counter()
        rows, prompt_ids = repeat_samples(self.val_rows, self.spec.trainer.eval.samples_per_prompt)
        local = "reward" in self.plan.colocated
        chunks = self._chunks(len(rows), min(len(rows), sequences_per_step(self.spec)))
        seed = self.spec.trainer.seed
        dealt = self.actor.deal("evaluate", [(rows[a:b], prompt_ids[a:b], local, eval_seed(seed, step, i))
                                             for i, (a, b) in enumerate(chunks)])
        refs = [ref for _, ref in dealt]
        parts: list[RolloutBatch] = ray.get(refs)
        remote = []
        for r in [] if local else [r for r in self.plan.remote if r.step.name == "reward"]:
            channel = self.scheduler.channel(r.edge)
            for ref, part in zip(refs, parts, strict=True):  # held to the edge's limit before it leaves
                channel.record_bytes(part.nbytes())
                remote.append(self.groups[r.node.name].next("run", ref, "reward"))
        results: list[RolloutBatch] | list[PhaseResult] = parts if local else ray.get(remote)
        scored = [res.tensors for res in results]
        into, shown = self.spec.trainer.validation_data_dir, self.spec.trainer.loggers.val_generations
        if into is not None or shown:
            samples = [row for part, tensors in zip(parts, scored, strict=True) for row in sample_rows(part, tensors)]
            if into is not None:
                write_samples(into, step, samples)
            if shown:
                self.trackers.log_samples(step, samples[:shown])
        scores = torch.cat([tensors["scores"] for tensors in scored])
        lengths = torch.cat([part.response_mask.sum(-1) for part in parts])
        metrics = val_metrics(scores.tolist(), lengths.tolist(), prompt_ids, self.spec.reward.type == "function")
        metrics |= {PREFIX + k: v for k, v in extra_means(scored).items()}
        return metrics | {"timing/eval": time.perf_counter() - t0}

    def scores_phase(self, batch: RolloutBatch) -> float:
        """The plan's scored steps: each group's hosts score their shards of the batch in one call each, every
        group at once; each step's time is its slowest rank's. Returns the slowest host's compute."""
        if self._to_critic is not None:
            self._to_critic.record_bytes(batch.nbytes())
        calls = []
        for node, steps in self.plan.scored_on().items():
            replicas = self._replicas(self.groups[node])
            calls.append((steps, replicas, self.groups[node].submit("score", batch, steps, replicas=replicas)))
        busiest = 0.0
        for steps, replicas, refs in calls:
            per_host: list[list[PhaseResult]] = ray.get(refs)
            for i, step in enumerate(steps):
                results = [host[i] for host in per_host]
                for key in results[0].tensors:
                    batch.tensors[key] = torch.cat([r.tensors[key] for r in results[::replicas]])
                batch.add_timing(step, max(r.seconds for r in results))
            busiest = max(busiest, *(sum(r.seconds for r in host) for host in per_host))
        return busiest

    def update_phase(self, batch: RolloutBatch, kl_coef: float, ahead: Prompts | None = None) -> UpdateResult:
        """Every trained group updates at once on its own shards (a critic on the actor's hosts in the same call).
        With `ahead`, each actor host first starts generating its chunks of those prompts in a thread of its
        own (WorkerHost.generate_ahead), on the policy before this update."""
        if ahead is not None:
            rows, gids = ahead
            chain = list(self.plan.colocated)
            self.actor.deal_lists("generate_ahead", [(rows[a:b], gids[a:b], chain) for a, b in self._chunks(len(rows))])
        refs = [ref for g in self.trained
                for ref in g.submit("update", batch, kl_coef, replicas=self._replicas(g))]
        return UpdateResult.slowest(ray.get(refs))

    def sync_phase(self) -> SyncResult:
        """The control edge: every actor rank's rollout engine gets the updated policy; the batches a
        pipelined rollout left on the hosts come back here, in chunk order, for the next step."""
        result = SyncResult.slowest(self.actor.call("sync_policy"))
        if self._next is not None:
            self._ready = HostGroup.in_call_order([b or [] for b in self.actor.call("take_ahead")])
        return result

    def _observe(self) -> None:
        """One backpressure observation, taken when no generation is in flight (lowering the actor's
        parallelism then never kills a busy host)."""
        self.scheduler.observe()
        self._sync_new_hosts()

    def _sync_new_hosts(self) -> None:
        """Hosts added to a trained group get its current state from its first host."""
        for group in self.trained:
            hosts = group.hosts
            known = self._host_counts.get(group.node, len(hosts))
            if len(hosts) > known:
                state: ray.ObjectRef = hosts[0].export_state.remote()
                ray.get([h.import_state.remote(state) for h in hosts[known:]])
                self._retell_sequence_parallel_off(group, hosts[known:])
            self._host_counts[group.node] = len(hosts)

    def _steering_failed(self, error: BaseException) -> None:
        """Steering's report of a change that failed at a safe point (see _loop)."""
        if isinstance(error, Exception):
            self._steering_failure = error

    def _parallelism_problem(self, node: str, parallelism: int) -> str | None:
        """The step plan's limits on a change from outside (the scheduler checks roles and resources):
        a fused step is one call on the actor's single host; every trained rank needs a sequence."""
        try:
            group = {n.name for n in self.graph.group_of(node).nodes}
        except KeyError:
            return None  # unknown: the scheduler says so
        if self.plan.fused and self.plan.actor.name in group and parallelism != 1:
            return (f"{node} cannot change parallelism: this plan runs each step in one call on the actor's "
                    "single host")
        for trained in (n for n in self.plan.trained if n.name in group):
            split = sequence_parallel_problem(node, parallelism, self.sp[trained.name], SP_FIELDS[trained.role])
            if split:
                return split
        have = sequences_per_step(self.spec)
        if parallelism > have and any(n.name in group for n in self.plan.trained):
            return (f"{parallelism} ranks of {node} need at least one sequence each, but a step has {have} "
                    "(spec.data.batchSize * spec.rollout.samplesPerPrompt)")
        return None

    # -- checkpoints and recovery -----------------------------------------------------------------

    def _checkpoint_due(self, step: int) -> bool:
        ck = self.spec.trainer.checkpoint
        return bool(ck.every) and (step % ck.every == 0 or step == self.spec.trainer.total_steps)

    def _maybe_checkpoint(self) -> None:
        if self._checkpoint_due(self.step):
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
        """Write step_N aside and rename it into place. A failed write removes what it staged (a partial
        checkpoint must not hold the room the next one needs) and stops the run with CheckpointWriteError,
        naming the file and the newest complete checkpoint, which a rerun resumes from."""
        root = self.spec.trainer.checkpoint.path
        staging: Path | None = None
        try:
            staging = checkpoint.staging_dir(root, self.step)
            ray.get([h.save.remote(str(staging), name) for name, h in self._instances()])
            checkpoint.save_state(controller_state(self.step, self.kl_ctl, self._data_state(),
                                                   [name for name, _ in self._instances()]),
                                  staging / CONTROLLER_FILE)
            (staging / JOB_FILE).write_text(json.dumps(self.job.model_dump(by_alias=True, mode="json"), indent=1))
            self._check_owner()
            final = checkpoint.commit(staging, root, self.step)
        except BaseException as e:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
            problem = _write_failure(e)
            if problem is None:
                raise
            newest = checkpoint.latest(root)
            after = (f"the newest complete checkpoint, {newest[1].name}, is intact and a rerun resumes from it"
                     if newest else "there is no complete checkpoint yet")
            raise checkpoint.CheckpointWriteError(
                f"checkpoint of step {self.step} not written: {problem}; {after} "
                f"(spec.trainer.checkpoint.path: {root})") from None
        checkpoint.prune(root, self.spec.trainer.checkpoint.keep)
        self.last_checkpoint = str(final)
        return self.last_checkpoint

    def _check_owner(self) -> None:
        if self.owner is not None:
            checkpoint.check_owner(self.spec.trainer.checkpoint.path, self.owner)

    def _restore(self) -> bool:
        """Load the checkpoint a (re)start resumes from (checkpoint.resume_source) into every host; False when
        there is none.

        A group's parallelism may differ from the checkpoint's (changed from outside or by backpressure
        after it was written): the training state is read resharded to the ranks running now
        (hybridflow.dcp), a rank the checkpoint lacks takes rank 0's file of versions and RNG, and saved
        ranks beyond those running are not needed.
        """
        t = self.spec.trainer
        found = checkpoint.resume_source(t.checkpoint.path, t.resume_from)
        if found is None:
            return False
        path, own = found
        state = checkpoint.load_state(path / CONTROLLER_FILE)
        saved = set(state["world"])
        running = self._instances()
        field = "" if own else "spec.trainer.resumeFrom: "
        lacking = sorted({_lead(n) for n in saved} - {_lead(n) for n, _ in running})
        if lacking:
            raise RuntimeError(f"{field}checkpoint {path} holds state of {', '.join(lacking)}, which this graph "
                               "lacks: resume needs the same graph")
        try:
            ray.get([h.load.remote(str(path), name if name in saved else f"{_lead(name)}_0") for name, h in running])
        except ray.exceptions.RayTaskError as e:
            if own:
                raise
            problem = innermost_message(e)
            raise RuntimeError(f"{field}checkpoint {path} does not load into this job: {problem}") from None
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.sampler.load_state_dict(state["data"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        self.step = int(state["step"])
        self.last_checkpoint = str(path)
        if own:
            self.metrics.truncate_after(self.step)
        else:  # another run's: its records are in its own metrics file
            self.metrics.reset()
        self.last_val = last_val_reward(self.metrics.read())
        return True

    def _recover_or_raise(self, error: Exception) -> None:
        if not self._worker_died(error):
            raise error
        self._recover(error)

    def _worker_died(self, error: Exception) -> bool:
        """Whether a failed call means a worker died: its own error, or a call that failed as a peer died."""
        if isinstance(error, WORKER_LOST):
            return True
        lost = self.scheduler.lost_hosts(timeout=LOST_PROBE_S)
        if lost:
            cause = error.cause if isinstance(error, ray.exceptions.RayTaskError) else None
            log.warning("%s failed as %s died", type(cause).__name__ if cause else "a call", ", ".join(lost))
        return bool(lost)

    def _recover(self, error: Exception) -> None:
        """A worker died: wait for Ray to restart it, rejoin the ranks, roll every role back together."""
        self.recoveries += 1
        self._steering_failure = None  # this recovery covers it
        if self.recoveries > max(1, self.spec.trainer.worker_max_restarts):
            raise RuntimeError(f"giving up after {self.recoveries - 1} recoveries: {error}") from error
        log.warning("worker lost at step %d (%s); restoring the last checkpoint", self.step + 1,
                    type(error).__name__)
        self.scheduler.rejoin(self.spec.scheduling.placement_timeout_seconds)
        if not self._restore():
            ray.get([h.reset.remote() for _, h in self._instances()])
            self.step = 0
            self.sampler.load_state_dict({"epoch": 0, "position": 0})
            self.kl_ctl.load_state_dict({"value": self.spec.algorithm.kl_penalty.coef})
            self.metrics.truncate_after(0)  # the baseline evaluation (step 0) measured the weights reset restores
            self.last_val = last_val_reward(self.metrics.read())
        for group in self.trained:
            self._retell_sequence_parallel_off(group, group.hosts)
        self._host_counts = {g.node: len(g.hosts) for g in self.trained}  # every rank now holds the same state
        self.scheduler.discard_in_flight()
        self._forget_pipeline()


@dataclass(frozen=True)
class _QueuedStep:
    """A fused step's call, queued on the actor's host while the step before it ran."""

    step: int
    ref: ray.ObjectRef
    submitted: float
    data_before: dict[str, int]
    """The data position before its prompts were drawn: where a resumed run draws them again."""


def _write_failure(error: BaseException) -> str | None:
    """What failed in a checkpoint write, in one line; None for errors that are not about writing (a lost worker)."""
    cause = error.cause if isinstance(error, ray.exceptions.RayTaskError) else error
    if isinstance(cause, checkpoint.CheckpointWriteError):
        return str(cause).strip().splitlines()[-1]
    if isinstance(cause, OSError):
        where = f"cannot write {cause.filename}" if cause.filename else "cannot write the checkpoint"
        return f"{where}: {checkpoint.write_problem(cause, cause.filename or '.')}"
    return None


def _add_busy(busy: dict[str, float], key: str, seconds: float) -> None:
    busy[key] = busy.get(key, 0.0) + seconds


def _lead(rank_name: str) -> str:
    """`critic_3` -> `critic`: the co-location group of a checkpoint file's rank."""
    return rank_name.rsplit("_", 1)[0]


def _restarted_by_ray() -> bool:
    """True in a controller actor that Ray restarted after its process died (not in a fresh run)."""
    ctx = ray.get_runtime_context()
    return ctx.get_actor_id() is not None and bool(ctx.was_current_actor_reconstructed)
