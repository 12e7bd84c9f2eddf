"""The runtime fault-injection campaign: SIGKILL a worker or the controller of tiny real jobs in each phase of
a step, and fill the checkpoint file system mid-write; one row per fault kind.

    python -m benchmarks.chaos.runtime_faults --out DIR [--quick]

Every job trains on a multi-raylet `ray.cluster_utils.Cluster` started here (a head and two worker raylets
on this machine). A killed run must finish with every step exactly once in metrics.jsonl, redo at most one
checkpoint interval (see benchmarks/chaos/recovery.py for `redone`), and leave only checkpoint directories
whose files load with `hybridflow.checkpoint.load_state` (weights_only). Phases are found from outside:
Ray titles a worker `ray::WorkerHost.<method>` while the method runs (benchmarks/chaos/watch.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import yaml

from benchmarks.chaos.recovery import step_counts
from benchmarks.chaos.report import recovery
from benchmarks.chaos.watch import MetricsWatch, Phase, PhaseKiller
from benchmarks.operator.summarise import rounded

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
SEED = 20261202
STEPS = 8
EVERY = 2
"""Each killed job: 8 steps, a checkpoint every 2, so `redone` may be at most 2."""
RUN_TIMEOUT_S = 420.0
"""A run still going after this is stopped and counted as not survived (a hang is a failure too)."""
REWARD_SLOTS = 3
"""Reward hosts the cluster has room for in the backpressure phase: backpressure raises the reward once per
step until they are used (the queue of the actor->reward edge is above its watermark at every look)."""
SLOW_REWARD = "tests.slow_reward:score"
"""A reward that sleeps per sample, so the reward phase is long enough to be seen and backpressure acts."""

PHASES: dict[str, Phase] = {p.name: p for p in (
    Phase("rollout", frozenset({"rollout"}), ("actor_rollout",)),
    Phase("reward", frozenset({"run"}), ("reward",)),
    Phase("update", frozenset({"update"})),
    # a rank of the critic's two, FSDP2-sharded, killed in its update (its peer's inference copy is released then)
    Phase("sharded_update", frozenset({"update"}), ("critic",)),
    # the torch engine generates with the trained module (the control edge's sync_policy after an update
    # copies nothing); weights move between processes when a trained group gains a rank: the new rank joins
    # the process group, then copies rank 0
    Phase("weight_sync", frozenset({"setup_distributed", "export_state", "import_state"}), ("critic",)),
    Phase("checkpoint", frozenset({"save"}), staging=True),
    Phase("backpressure", new_host=True),
)}
ARM_STEPS: dict[str, tuple[int, int]] = {
    "rollout": (1, STEPS - 3), "reward": (1, STEPS - 3), "update": (1, STEPS - 3), "sharded_update": (1, STEPS - 3),
    "checkpoint": (1, STEPS - 3), "weight_sync": (1, STEPS - 3), "backpressure": (0, REWARD_SLOTS - 2),
}
"""The range of `after_step`: the fault lands in the first occurrence of the phase after that step. At least
three steps stay after it: a tiny job's rollout or update lasts a fraction of a second, and the killer may miss
one occurrence on a busy machine."""


@dataclass(frozen=True)
class FaultPlan:
    kind: str
    """worker_kill or controller_kill."""
    phase: str
    after_step: int


@dataclass
class RunOutcome:
    """One killed run and what the checks found."""

    plan: FaultPlan
    killed: bool = False
    in_phase: bool = False
    victim: str | None = None
    trigger: str | None = None
    completed: bool = False
    error: str | None = None
    steps: list[int] = field(default_factory=list)
    duplicates: int = 0
    losses: int = 0
    trained_before: int | None = None
    resumed_from: int | None = None
    redone: int | None = None
    recovery_s: float | None = None
    checkpoints: list[int] = field(default_factory=list)
    checkpoint_files: int = 0
    unloadable: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Completed with every step once, at most one interval redone, and every checkpoint loading."""
        return (self.completed and self.duplicates == 0 and self.losses == 0 and self.redone is not None
                and self.redone <= EVERY and not self.unloadable and self.checkpoint_files > 0)

    def summary(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(plan=asdict(self.plan), ok=self.ok, recovery_s=rounded(self.recovery_s),
                   wall_s=round(self.wall_s, 1))
        del out["steps"]
        return out


# -- the cluster and the jobs --------------------------------------------------------------------------------


@contextlib.contextmanager
def campaign_cluster() -> Iterator[Any]:
    """A head and two worker raylets on this machine; this checkout's runtime first on the workers' path."""
    import ray
    from ray.cluster_utils import Cluster

    store = 150 * 1024 * 1024
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False,
                                                            "object_store_memory": store})
    cluster.add_node(num_cpus=4, object_store_memory=store, resources={"chaos_reward": REWARD_SLOTS - 1})
    cluster.add_node(num_cpus=4, object_store_memory=store, resources={"chaos_reward": 1})
    try:
        cluster.wait_for_nodes()
        path = os.pathsep.join([str(ROOT / "runtime"), str(ROOT)])
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False,
                 runtime_env={"env_vars": {"PYTHONPATH": path, "HYBRIDFLOW_TORCH_THREADS": "1"}})
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def job_doc(name: str, checkpoint_path: Path, phase: str, steps: int = STEPS) -> dict[str, Any]:
    """The tiny PPO job with its reward on a node of its own (examples/tiny-ppo-remote-reward.yaml), smaller:
    a slow reward for the reward and backpressure phases, two critic ranks for weight sync and a sharded update."""
    doc = yaml.safe_load((EXAMPLES / "tiny-ppo-remote-reward.yaml").read_text())
    doc["metadata"]["name"] = name
    spec = doc["spec"]
    spec["data"]["batchSize"] = 32
    spec["algorithm"]["miniBatchSize"] = 32
    spec["scheduling"] = {"microBatchSize": 8}
    spec["trainer"].update(totalSteps=steps, resume="auto", checkpoint={"every": EVERY, "path": str(checkpoint_path)})
    nodes = {n["name"]: n for n in spec["graph"]["nodes"]}
    if phase in ("reward", "backpressure"):
        spec["reward"]["function"] = SLOW_REWARD
    if phase == "backpressure":
        nodes["reward"]["resources"] = {"CPU": 0.5, "chaos_reward": 1}
        spec["scheduling"].update(queueHighWatermark=1, backpressureWindow=1)
    if phase in ("weight_sync", "sharded_update"):
        nodes["critic"]["parallelism"] = 2
    return doc


# -- one run -------------------------------------------------------------------------------------------------


def fault_run(plan: FaultPlan, work: Path, name: str) -> RunOutcome:
    """Train one job while a PhaseKiller waits for `plan.phase`; then check what the run left."""
    from hybridflow.api import parse_job
    from hybridflow.checkpoint import complete_steps
    from hybridflow.control.client import connect
    from hybridflow.control.errors import ControlError
    from hybridflow.driver import run_training

    work.mkdir(parents=True, exist_ok=True)
    root = work / "ckpt"
    job = parse_job(job_doc(name, root, plan.phase))
    metrics = work / "metrics.jsonl"
    out = RunOutcome(plan)
    watch = MetricsWatch(metrics).start()

    def status() -> dict[str, Any] | None:
        return dict(connect(name, timeout_s=10).call("control_status", timeout_s=10))

    def scale_critic() -> None:
        def ask() -> None:
            try:
                connect(name, timeout_s=120).scale("critic", 3, "fault campaign: a new rank receives the weights")
            except ControlError as e:
                out.notes.append(f"scale request: {e}")
        threading.Thread(target=ask, daemon=True).start()

    victim = "controller" if plan.kind == "controller_kill" else "worker"
    killer = PhaseKiller(PHASES[plan.phase], victim, plan.after_step, watch, status, root,
                         on_arm=scale_critic if plan.phase == "weight_sync" else None).start()
    result: dict[str, Any] = {}

    def train() -> None:
        try:
            result.update(run_training(job, str(metrics)))
        except BaseException as e:
            result["error"] = f"{type(e).__name__}: {e}"

    t0 = time.monotonic()
    runner = threading.Thread(target=train, name=f"train-{name}", daemon=True)
    runner.start()
    runner.join(RUN_TIMEOUT_S)
    if runner.is_alive():
        out.notes.append(f"still running after {RUN_TIMEOUT_S:g}s: controller stopped")
        _stop_controller(name)
        runner.join(120)
    out.wall_s = time.monotonic() - t0
    killer.stop()
    watch.stop()

    k = killer.kill
    out.killed, out.in_phase, out.victim, out.trigger = killer.killed, k.in_phase, k.title, k.trigger
    out.notes += k.notes
    out.error = result.get("error")
    out.completed = out.error is None and result.get("steps") == STEPS
    records = watch.records
    out.steps = [int(r["step"]) for r in records]
    out.duplicates, out.losses = step_counts(records, STEPS)
    tr = watch.tracker
    out.trained_before, out.resumed_from, out.redone = tr.trained_before, tr.resumed_from, tr.redone
    out.recovery_s = tr.recovery_s
    out.checkpoints = complete_steps(root)
    out.checkpoint_files, out.unloadable = load_all(root)
    return out


def load_all(root: Path) -> tuple[int, list[str]]:
    """Every file of every complete checkpoint directory, read as a resume reads it: (files read, failures).
    A sharded training state (hybridflow.dcp) counts as one file: its index and every rank's shards."""
    from hybridflow import dcp
    from hybridflow.checkpoint import complete_steps, load_state, step_dir

    read, failed = 0, []
    for step in complete_steps(root):
        d = step_dir(root, step)
        for index in sorted(d.rglob(dcp.INDEX_FILE)):
            try:
                dcp.read_full(index.parent)
                read += 1
            except Exception as e:
                failed.append(f"{d.name}/{index.parent.relative_to(d)}: {type(e).__name__}: {e}")
        for f in sorted(d.iterdir()):
            try:
                if f.suffix == ".pt":
                    load_state(f)
                elif f.suffix == ".json":
                    json.loads(f.read_text())
                else:
                    continue
                read += 1
            except Exception as e:
                failed.append(f"{d.name}/{f.name}: {type(e).__name__}: {e}")
    return read, failed


def _stop_controller(name: str) -> None:
    import ray

    from hybridflow.control.names import RAY_NAMESPACE, controller_name, job_ref

    with contextlib.suppress(Exception):
        ray.kill(ray.get_actor(controller_name(job_ref(name)), namespace=RAY_NAMESPACE), no_restart=True)


# -- the campaign --------------------------------------------------------------------------------------------


def plans(kind: str, runs: int, rng: random.Random) -> list[FaultPlan]:
    """`runs` faults: the phases in a shuffled cycle (each phase as often as the count allows), a seeded step each."""
    order = list(PHASES)
    rng.shuffle(order)
    out = []
    for i in range(runs):
        phase = order[i % len(order)]
        lo, hi = ARM_STEPS[phase]
        out.append(FaultPlan(kind, phase, rng.randint(lo, hi)))
    return out


def kill_row(kind: str, outcomes: list[RunOutcome]) -> dict[str, Any]:
    """One row: kills that landed are `injected`; of those, the runs that passed every check `survived`.
    duplicates and losses are summed over every run, recovery over the kills that landed."""
    landed = [o for o in outcomes if o.killed]
    samples = [round(o.recovery_s, 3) for o in landed if o.recovery_s is not None]
    return {
        "kind": kind,
        "injected": len(landed),
        "survived": sum(o.ok for o in landed),
        "duplicates": sum(o.duplicates for o in outcomes),
        "losses": sum(o.losses for o in outcomes),
        "recovery_s": recovery(samples),
        "detail": {
            "runs": len(outcomes),
            "missed": sum(not o.killed for o in outcomes),
            "phases": dict(Counter(o.plan.phase for o in landed)),
            "steps": STEPS, "checkpoint_every": EVERY,
            "max_redone": max((o.redone for o in landed if o.redone is not None), default=None),
            "outcomes": [o.summary() for o in outcomes],
        },
    }


def kill_campaign(kind: str, runs: int, rng: random.Random, out_dir: Path, log: TextIO | None = None) -> dict[str, Any]:
    outcomes = []
    for i, plan in enumerate(plans(kind, runs, rng)):
        name = f"chaos-{kind.split('_')[0]}-{i}"
        outcome = fault_run(plan, out_dir / kind / f"{i:02d}-{plan.phase}", name)
        outcomes.append(outcome)
        if log is not None:
            print(f"{kind} {i + 1}/{runs} {plan.phase} after step {plan.after_step}: killed={outcome.killed} "
                  f"ok={outcome.ok} redone={outcome.redone} recovery_s={rounded(outcome.recovery_s)} "
                  f"({outcome.wall_s:.0f}s){' ' + outcome.error if outcome.error else ''}", file=log, flush=True)
    return kill_row(kind, outcomes)


def run(out_dir: Path, full: bool) -> list[dict[str, Any]]:
    """The whole campaign: worker kills (20, or 2 quick), controller kills (10, or 1), a full checkpoint disk."""
    from benchmarks.chaos.ckpt_full import checkpoint_write_failure

    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED)
    t0 = time.monotonic()
    with campaign_cluster():
        rows = [
            kill_campaign("worker_kill", 20 if full else 2, rng, out_dir, sys.stderr),
            kill_campaign("controller_kill", 10 if full else 1, rng, out_dir, sys.stderr),
            checkpoint_write_failure(out_dir / "checkpoint_write_failure"),
        ]
    wall = time.monotonic() - t0
    for row in rows:
        row["detail"]["campaign_wall_s"] = round(wall, 1)
    (out_dir / "runtime_faults.json").write_text(json.dumps(rows, indent=1) + "\n")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.chaos.runtime_faults", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="where the runs and runtime_faults.json go")
    p.add_argument("--quick", action="store_true", help="2 worker kills and 1 controller kill instead of 20 and 10")
    args = p.parse_args(argv)
    rows = run(args.out, full=not args.quick)
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
