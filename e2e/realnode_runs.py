"""What both real-node suites share: the tiny cluster examples, whether this machine can run real nodes, and
JobRun, which applies a job with kubectl and follows it to its end."""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from e2e.harness.nodes import missing_host_tools
from e2e.harness.realcluster import RealNodeCluster
from hybridflow.checkpoint import OWNER_FILE
from tests.helpers import condition, in_ci

ROOT = Path(__file__).resolve().parents[1]
TINY_PPO = ROOT / "examples" / "tiny-ppo-job.yaml"
TINY_GRPO = ROOT / "examples" / "tiny-grpo-job.yaml"
RUN_S = 900.0  # a tiny run on 2 shared cores: pods start, Ray starts, 80 steps
MIN_FINAL_REWARD = 0.9


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "real nodes need root"
    missing = missing_host_tools()
    if missing:
        return f"missing {', '.join(missing)}: run e2e/toolchain/install-node-packages.sh as root"
    return None


def require_real_nodes() -> None:
    reason = _unavailable()
    if reason is None:
        return
    if in_ci():
        pytest.fail(f"the real-node tier cannot run here: {reason}", pytrace=False)
    pytest.skip(reason)


@dataclass
class RunResult:
    """How a job ended, and what was seen on the way."""

    job: dict[str, Any]
    progress: list[dict[str, Any]]  # status.progress, each time its step changed
    steps: list[tuple[float, int]]  # (monotonic time, step) of each line the metrics file gained
    first_step_s: float
    wall_s: float
    metrics_file: Path

    @property
    def final_reward(self) -> float:
        return float(self.job["status"]["progress"]["rewardMean"])

    def metrics(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.metrics_file.read_text().splitlines() if line.strip()]

    def describe(self) -> str:
        return json.dumps(self.job.get("status"), indent=1)[-3000:]

    def assert_succeeded(self, min_reward: float) -> None:
        assert condition(self.job, "Succeeded")["status"] == "True", self.describe()
        steps = [p["step"] for p in self.progress]
        assert len(steps) >= 3, steps  # kubectl get rlj showed Step rising
        every = self.job["spec"]["trainer"]["checkpoint"].get("every") or 0
        drops = [(a, b) for a, b in itertools.pairwise(steps) if b < a]
        assert all(a - b < every for a, b in drops), (steps, every)  # back at most to the last checkpoint
        rewards = [p["rewardMean"] for p in self.progress if p.get("rewardMean") is not None]
        assert rewards[-1] > rewards[0], rewards
        final = self.job["status"]["progress"]
        assert final["step"] == final["totalSteps"] and self.final_reward >= min_reward, final
        checkpoints = sorted(p.name for p in self.metrics_file.parent.iterdir() if p.name.startswith("step_"))
        assert checkpoints, f"no checkpoint in {self.metrics_file.parent}"


class JobRun:
    """One RLTrainingJob applied with kubectl into a namespace of its own, with a `checkpoints` claim on a local
    volume; followed through status.progress and the metrics file the runtime writes next to its checkpoints."""

    def __init__(self, cluster: RealNodeCluster, job: dict[str, Any], namespace: str) -> None:
        self.cluster = cluster
        self.job = json.loads(json.dumps(job))
        self.namespace = namespace
        self.name = self.job["metadata"]["name"]
        self.job["metadata"]["namespace"] = namespace
        # The Ray cluster goes as soon as the job ends: the next run on this small node needs its room.
        self.job["spec"].setdefault("runPolicy", {})["ttlSecondsAfterFinished"] = 0
        self.progress: list[dict[str, Any]] = []
        self.steps: list[tuple[float, int]] = []
        self.rollbacks: list[float] = []  # when the metrics file was cut back to a checkpoint
        self.claims: list[float] = []  # when a controller claimed the checkpoint directory
        self._owner: str | None = None
        self.t0 = 0.0
        self.volume = Path()
        self.metrics_file = Path()
        self._lines = 0

    def apply(self) -> None:
        self.cluster.kubectl("create", "namespace", self.namespace)
        self.volume = self.cluster.hostpath_volume("checkpoints", self.namespace)
        mount = next(m["mountPath"] for m in self.job["spec"]["cluster"]["volumeMounts"] if m["name"] == "checkpoints")
        inside = Path(self.job["spec"]["trainer"]["checkpoint"]["path"]).relative_to(mount)
        self.metrics_file = self.volume / inside / "metrics.jsonl"
        self.t0 = time.monotonic()
        self.cluster.kubectl("apply", "-f", "-", input=json.dumps(self.job))

    def poll(self) -> dict[str, Any]:
        """Read the job and any new metrics lines; returns the job."""
        found = self.cluster.get_json("rltrainingjob", self.name, "-n", self.namespace)
        progress = found.get("status", {}).get("progress") or {}
        if progress.get("step") and (not self.progress or self.progress[-1].get("step") != progress["step"]):
            self.progress.append(progress)
        if self.metrics_file.is_file():
            lines = [line for line in self.metrics_file.read_text().splitlines() if line.strip()]
            now = time.monotonic()
            if len(lines) < self._lines:  # rolled back to a checkpoint: the file was cut
                self._lines = len(lines)
                self.rollbacks.append(now)
            for line in lines[self._lines:]:
                self.steps.append((now, int(json.loads(line)["step"])))
            self._lines = len(lines)
        owner = self.metrics_file.parent / OWNER_FILE
        token = owner.read_text().strip() if owner.is_file() else None
        if token and token != self._owner:
            self._owner = token
            self.claims.append(time.monotonic())
        return found

    def _until(self, check: Callable[[dict[str, Any]], bool], what: str, timeout: float = RUN_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.poll()
            if check(found):
                return found
            time.sleep(0.5)
        pods = self.cluster.kubectl("get", "pods", "-n", self.namespace, "-o", "wide", check=False).stdout
        raise AssertionError(f"{self.namespace}/{self.name}: {what} not within {timeout:.0f}s; "
                             f"last progress {self.progress[-1:]}\n{pods}")

    def wait_for_step(self, step: int) -> int:
        """Until the metrics show `step` done; returns the newest step."""
        self._until(lambda _: bool(self.steps) and self.steps[-1][1] >= step, f"step {step}")
        return self.steps[-1][1]

    def seconds_until_step_after_rollback(self, t: float) -> float:
        """From `t` (a fault) to the first step completed after the run rolled back to its checkpoint."""
        return self._seconds_until_step_after(self.rollbacks, t, "a rollback to the last checkpoint")

    def seconds_until_step_after_claim(self, t: float) -> float:
        """From `t` (a fault) to the first step completed by a controller that claimed the directory after it."""
        return self._seconds_until_step_after(self.claims, t, "a new controller's claim")

    def _seconds_until_step_after(self, events: list[float], t: float, what: str) -> float:
        def stepped() -> bool:
            event = next((e for e in events if e > t), None)
            return event is not None and any(at > event for at, _ in self.steps)

        self._until(lambda _: stepped(), f"{what} and a step after it")
        event = next(e for e in events if e > t)
        return next(at for at, _ in self.steps if at > event) - t

    def to_end(self) -> RunResult:
        if not self.t0:
            self.apply()
        found = self._until(lambda job: any(c["type"] in ("Succeeded", "Failed") and c["status"] == "True"
                                            for c in job.get("status", {}).get("conditions", [])), "the end")
        first = self.steps[0][0] - self.t0 if self.steps else float("nan")
        return RunResult(found, self.progress, self.steps, first, time.monotonic() - self.t0, self.metrics_file)
