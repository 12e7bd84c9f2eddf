"""One worker process hosting the co-located roles of one graph instance.

A plain class: the scheduler wraps it in a Ray actor; tests and GPU checks may use it directly.
Co-located steps run here back to back, so their hand-off never touches the object store.
"""

from __future__ import annotations

import functools
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hybridflow import checkpoint, telemetry
from hybridflow.api.spec import RLTrainingJobSpec
from hybridflow.graph import reference_in_policy
from hybridflow.plan import STEP_OF_ROLE, STEPS, Phase
from hybridflow.step import PhaseResult, Prompts, StepOutput, SyncResult, UpdateResult, run_step
from hybridflow.workers import distributed
from hybridflow.workers.actor import ActorRolloutWorker, ReferenceWorker
from hybridflow.workers.batch import RolloutBatch
from hybridflow.workers.critic import CriticWorker
from hybridflow.workers.modeling import pick_device, prepare_process
from hybridflow.workers.reward import RewardWorker


class WorkerHost:
    """Holds one worker per role; `roles` maps graph node name -> role; torch runs `threads` threads
    (scheduler.placement.torch_threads of the bundle); `lag` and `scored` are the plan's (StepPlan)."""

    def __init__(self, spec: dict[str, Any], roles: dict[str, str], instance: int, seed: int = 0,
                 use_gpu: bool = True, job: str = "", threads: int = 1, lag: int = 0,
                 scored: tuple[str, ...] = ()) -> None:
        self.threads = prepare_process(threads)
        self.spec = RLTrainingJobSpec.model_validate(spec)
        self.roles, self.instance, self.seed, self.lag = dict(roles), instance, seed, lag
        self.scored = tuple(scored)
        self._ahead: Pipelined | None = None
        self.device = pick_device(use_gpu)
        self._seed_everything()
        self.workers: dict[str, Any] = {}
        self._build()
        telemetry.watch_memory(job, f"{next(iter(self.roles))}_{instance}", self.device)

    def _seed_everything(self) -> None:
        s = self.seed * 1000 + self.instance
        random.seed(s)
        torch.manual_seed(s)

    def _build(self) -> None:
        """The actor first: a reference in the same process may run on its module (graph.reference_in_policy)."""
        for role in sorted(self.roles.values(), key=lambda r: r != "actor_rollout"):
            if role == "actor_rollout":
                group = self.instance // self.spec.model.policy.sequence_parallel  # its ranks cut the same minibatches
                self.workers[role] = ActorRolloutWorker(self.spec, self.device, self.seed + self.instance, self.lag,
                                                        shuffle_seed=self.seed + group, scored=self.scored)
            elif role == "reference":
                policy = self.workers.get("actor_rollout") if reference_in_policy(self.spec) else None
                self.workers[role] = ReferenceWorker(self.spec, self.device, policy)
            elif role == "critic":
                self.workers[role] = CriticWorker(self.spec, self.device, self.seed,
                                                  own_phase=STEP_OF_ROLE["critic"].name in self.scored)
            elif role == "reward":
                self.workers[role] = RewardWorker(self.spec, self.device)

    # -- what the scheduler needs -----------------------------------------------------------------

    def node_info(self) -> dict[str, Any]:
        node_id, gpu_ids = "local", []
        try:
            import ray

            if ray.is_initialized():
                node_id = ray.get_runtime_context().get_node_id()
                gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        except ImportError:
            pass
        return {"node_id": node_id, "ip": socket.gethostbyname(socket.gethostname()), "pid": os.getpid(),
                "gpu_ids": gpu_ids, "roles": self.roles, "device": str(self.device),
                "torch_threads": self.threads}

    def memory(self) -> dict[str, Any]:
        """This process's memory for the dashboard's heatmap, measured as the Prometheus gauge measures it."""
        kind, used = telemetry.memory_bytes(self.device)
        return {"kind": kind, "bytes": used}

    def free_port(self) -> int:
        return distributed.free_port()

    def setup_distributed(self, master_addr: str, master_port: int, rank: int, world_size: int,
                          backend: str = "auto") -> str:
        """Join the (new) ranks; the trained roles lay their weights out anew at their next update."""
        chosen = distributed.setup(master_addr, master_port, rank, world_size, backend)
        for worker in self._trainable().values():
            worker.training.invalidate()
        return chosen

    def hold_copies(self) -> bool:
        """Before this group's ranks change: trained roles whose full copy is released gather it from their shards
        (a collective of the live ranks), as the layout built for the new ranks starts from it."""
        for worker in self._trainable().values():
            worker.training.hold_copy()
        return True

    def disable_sequence_parallel(self) -> bool:
        """The trained roles here fall back to whole sequences (see ulysses.SequenceParallel); whether SP was on."""
        was = [w.sp.disable() for r, w in self.workers.items() if r in ("actor_rollout", "critic")]
        return any(was)

    # -- dataflow ---------------------------------------------------------------------------------

    def rollout(self, rows: list[dict[str, str]], group_ids: list[int], chain: list[str]) -> RolloutBatch:
        """Generate, then run the co-located steps of `chain` in this process."""
        batch = self.workers["actor_rollout"].generate(rows, group_ids)
        for step in chain:
            self._apply(step, batch)
        return batch

    def evaluate(self, rows: list[dict[str, str]], group_ids: list[int], score: bool, seed: int) -> RolloutBatch:
        """Answer val prompts (see ActorRolloutWorker.evaluate), scored here when the reward shares this process."""
        batch = self.workers["actor_rollout"].evaluate(rows, group_ids, seed)
        if score:
            self._apply("reward", batch)
        return batch

    def late(self, batch: RolloutBatch, steps: list[str]) -> RolloutBatch:
        """The steps of a pipelined batch that waited for the update (plan.late), run now."""
        for step in steps:
            self._apply(step, batch)
        return batch

    def generate_ahead(self, calls: list[tuple[list[dict[str, str]], list[int], list[str]]]) -> bool:
        """Start `rollout(*call)` for each call in a thread of this process and return at once: the update that
        follows runs meanwhile (consistency eventual). `take_ahead` collects the batches."""
        self.drop_ahead()
        self._ahead = Pipelined([functools.partial(self.rollout, *c) for c in calls])
        return True

    def take_ahead(self, rows: list[dict[str, str]] | None = None) -> list[RolloutBatch] | None:
        """The pipelined batches, once generated; None when none was started (or, given `rows`, when it was
        for other prompts: a step after a recovery generates afresh)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        batches = ahead.result()
        if rows is not None and [r for b in batches for r in b.prompts] != [r["prompt"] for r in rows]:
            return None
        return batches

    def drop_ahead(self) -> None:
        """Forget a pipelined rollout (after its thread ends: it holds the generation module)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.wait()

    def sync_policy(self) -> SyncResult:
        """The control edge: the updated policy into this rank's rollout engine, after the pipelined rollout
        (which generates on the old weights) is done."""
        t0 = time.perf_counter()
        if self._ahead is not None:
            self._ahead.wait()
        waited = time.perf_counter() - t0
        version, moved = self.workers["actor_rollout"].sync_rollout()
        return SyncResult(version, moved, time.perf_counter() - t0 - waited, waited)

    def run(self, batch: RolloutBatch, step: str) -> PhaseResult:
        """A step for a batch that arrived through the object store; only the new tensors go back."""
        before = set(batch.tensors)
        t0 = time.perf_counter()
        self._apply(step, batch)
        return PhaseResult({k: v for k, v in batch.tensors.items() if k not in before}, step,
                           time.perf_counter() - t0)

    def score(self, batch: RolloutBatch, steps: list[str]) -> list[PhaseResult]:
        """The scored steps this host runs on its part of the step's batch (plan.scored_steps), in order, in one
        call: the other ranks run the same ones, so their collectives pair up."""
        return [self.run(batch, step) for step in steps]

    def _apply(self, step: str, batch: RolloutBatch) -> None:
        s = STEPS[step]
        getattr(self.workers[s.role], s.method)(batch)

    def update(self, batch: RolloutBatch, kl_coef: float) -> UpdateResult:
        """Train every role this host holds that learns (actor, then critic) on its shard of the batch."""
        t0 = time.perf_counter()
        metrics: dict[str, float] = {}
        if "actor_rollout" in self.workers:
            metrics |= self.workers["actor_rollout"].update(batch, kl_coef)
        if "critic" in self.workers:
            metrics |= self.workers["critic"].update(batch)
        return UpdateResult(metrics, time.perf_counter() - t0)

    def run_step(self, phases: list[Phase], rows: list[dict[str, str]], group_ids: list[int], chain: list[str],
                 kl_coef: float, ahead: Prompts | None = None, late: tuple[str, ...] = ()) -> StepOutput:
        """A whole step in this process (the plan fused its phases here); only scalars go back. With `ahead`
        the next step's rollout overlaps the update, and stays here for the next call."""
        return run_step(_LocalPhases(self, chain, list(late)), phases, rows, group_ids, self.spec, kl_coef, ahead)

    def policy_version(self) -> int:
        return self.workers["actor_rollout"].version

    def policy_weights(self) -> dict[str, torch.Tensor]:
        """The policy's trained weights (adapters only under LoRA), for an export at the end of a run."""
        weights: dict[str, torch.Tensor] = self.workers["actor_rollout"].weights()
        return {k: v.detach().cpu() for k, v in weights.items()}

    # -- checkpoints ------------------------------------------------------------------------------

    def _trainable(self) -> dict[str, Any]:
        return {r: w for r, w in self.workers.items() if hasattr(w, "state_dict")}

    def export_state(self, with_model: bool = True) -> dict[str, Any]:
        """Weights, versions and RNG of this instance: what a new rank receives, and (without the weights) a
        checkpoint's rank file. The optimizer's state travels only in checkpoints (`save`)."""
        return {
            "roles": {r: w.state_dict(with_model) for r, w in self._trainable().items()},
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
        }

    def import_state(self, state: dict[str, Any]) -> bool:
        self.drop_ahead()  # generated by weights that are being replaced
        for role, s in state["roles"].items():
            self.workers[role].load_state_dict(s)
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        if state["rng"]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        return True

    def save(self, directory: str, name: str) -> str:
        """Write this instance's part of a checkpoint (nothing for stateless roles): directory/name.pt (versions,
        sampling order, RNG) and each trained role's training state, written together by the group's ranks
        (checkpoint.training_dir): its weights are there once, which resume and `hybridflow export` read."""
        trainable = self._trainable()
        if not trainable:
            return ""
        for role, worker in trainable.items():  # first: a failure there is every rank's (DCP gathers them)
            worker.training.save(checkpoint.training_dir(directory, name, role))
        path = Path(directory) / f"{name}.pt"
        checkpoint.save_state(self.export_state(with_model=False), path)
        return str(path)

    def load(self, directory: str, name: str) -> bool:
        """Read `name`'s rank file, then each role's training state, resharded to the ranks running now."""
        trainable = self._trainable()
        if not trainable:
            return True
        path = Path(directory) / f"{name}.pt"
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint {directory} has no state for {name}: resume needs the same graph")
        self.import_state(checkpoint.load_state(path))
        for role, worker in trainable.items():
            worker.load_training(str(checkpoint.training_dir(directory, name, role)))
        return True

    def reset(self) -> bool:
        """Back to the initial weights (recovery before the first checkpoint)."""
        self.drop_ahead()
        self._seed_everything()
        self.workers = {}
        self._build()
        return True


class Pipelined:
    """Calls run one after another in a thread of their own; `result` waits and returns theirs, or raises the
    first call's error in the caller's thread."""

    def __init__(self, calls: list[Callable[[], RolloutBatch]]) -> None:
        self._calls = calls
        self._out: list[RolloutBatch] = []
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="pipelined-rollout", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for call in self._calls:
                self._out.append(call())
        except BaseException as e:  # re-raised where the result is taken
            self._error = e

    def wait(self) -> None:
        self._thread.join()

    def result(self) -> list[RolloutBatch]:
        self.wait()
        if self._error is not None:
            raise self._error
        return self._out


class _LocalPhases:
    """The phases of a fused step, run on the host's own workers."""

    def __init__(self, host: WorkerHost, chain: list[str], late: list[str]) -> None:
        self.host, self.chain, self.late = host, chain, late

    def rollout_phase(self, rows: list[dict[str, str]], group_ids: list[int]) -> tuple[RolloutBatch, float]:
        ready = self.host.take_ahead(rows)
        if ready is None:
            batch = self.host.rollout(rows, group_ids, self.chain + self.late)
            return batch, batch.seconds_besides()
        batch = RolloutBatch.concat(ready)
        generated = set(batch.timings)
        self.host.late(batch, self.late)
        return batch, batch.seconds_besides(generated)

    def scores_phase(self, batch: RolloutBatch) -> float:
        return sum(r.seconds for r in self.host.score(batch, list(self.host.scored)))

    def update_phase(self, batch: RolloutBatch, kl_coef: float, ahead: Prompts | None) -> UpdateResult:
        if ahead is not None:
            self.host.generate_ahead([(*ahead, self.chain)])
        return self.host.update(batch, kl_coef)

    def sync_phase(self) -> SyncResult:
        return self.host.sync_policy()
