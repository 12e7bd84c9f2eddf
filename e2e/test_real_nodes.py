"""The real-node tier: RLTrainingJobs that train inside real Ray pods on a real kubelet node, to Succeeded.

One real node (kubelet, containerd, runc, a bridge CNI, kube-proxy, CoreDNS) doubles as a fake A100 node.
The Ray pods of this fast tier run a minimal image with this machine's Python and the project mounted read-only
(mk/real-nodes.md gives the measurement that puts the full runtime image in the full tier only).
Marker `realnodes`; needs root and Debian's packages (e2e/toolchain/install-node-packages.sh).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.harness import images
from e2e.harness.controlplane import eventually
from e2e.harness.hoststate import HostSnapshot, read_sysctl
from e2e.harness.nodes import NODE_NAME, NodeNetwork, guard_rule, missing_host_tools
from e2e.harness.operator import OperatorProcess
from e2e.harness.realcluster import RealNodeCluster, with_host_runtime
from e2e.harness.realcluster import node_images as node_images_of
from tests.helpers import condition, in_ci

pytestmark = pytest.mark.realnodes

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


@pytest.fixture(scope="module")
def node_images() -> tuple[dict[str, Path], str, str]:
    """(reference -> archive to import, pause image, node-base image), built once and cached by their inputs."""
    require_real_nodes()
    wanted = (images.PAUSE, images.NODE_BASE)
    built = images.build(wanted)
    return node_images_of(built, wanted), built[images.PAUSE].ref, built[images.NODE_BASE].ref


def test_teardown_restores_the_host(node_images: tuple[dict[str, Path], str, str],
                                    tmp_path_factory: pytest.TempPathFactory) -> None:
    """Up and down again: sysctls, iptables, fixed paths, cgroups and the bridge are as they were."""
    archives, pause, _ = node_images
    before = HostSnapshot.take()
    cluster = RealNodeCluster(tmp_path_factory.mktemp("real-teardown") / "run", archives, pause)
    cluster.start()
    assert read_sysctl(f"net.ipv4.conf.{cluster.net.bridge}.forwarding") == "1"
    problems = cluster.stop()
    after = HostSnapshot.take()
    assert problems == []
    assert after.sysctls == before.sysctls
    assert _rules(after.iptables) == _rules(before.iptables)
    assert after.absent_paths == before.absent_paths and after.had_cgroups == before.had_cgroups
    assert subprocess.run(["ip", "link", "show", cluster.net.bridge], capture_output=True).returncode != 0
    assert not cluster.work_dir.exists()


def _rules(saved: dict[str, str]) -> dict[str, list[str]]:
    return {tool: [line for line in text.splitlines() if not line.startswith("#")] for tool, text in saved.items()}


@pytest.fixture(scope="module")
def real_cluster(node_images: tuple[dict[str, Path], str, str],
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealNodeCluster]:
    archives, pause, _ = node_images
    cluster = RealNodeCluster(tmp_path_factory.mktemp("real-nodes") / "run", archives, pause)
    cluster.start()
    try:
        yield cluster
    finally:
        problems = cluster.stop()
        assert problems == [], problems


def test_the_node_is_a_ready_a100_node(real_cluster: RealNodeCluster) -> None:
    node = real_cluster.get_json("node", NODE_NAME)
    labels = node["metadata"]["labels"]
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB"
    assert {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"} in node["spec"]["taints"]
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
    assert condition(node, "Ready")["status"] == "True"


def _probe_pod(cluster: RealNodeCluster, name: str, image: str, script: str) -> str:
    """Run `script` with bash in a pod on the node and return its log."""
    pod = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "restartPolicy": "Never",
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
            "containers": [{"name": "probe", "image": image, "imagePullPolicy": "Never",
                            "command": ["bash", "-c", script]}],
        },
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))
    eventually(lambda: cluster.get_json("pod", name)["status"].get("phase") in ("Succeeded", "Failed"), 120,
               f"pod {name} done")
    return cluster.kubectl("logs", name).stdout


def test_pods_resolve_service_names_and_reach_the_api_server(
        real_cluster: RealNodeCluster, node_images: tuple[dict[str, Path], str, str]) -> None:
    out = _probe_pod(real_cluster, "dns-probe", node_images[2],
                     "getent hosts kubernetes.default.svc.cluster.local; "
                     "timeout 5 bash -c 'echo > /dev/tcp/kubernetes.default.svc.cluster.local/443' && echo reached")
    assert "10.0.0.1" in out and "reached" in out


def _guard_packets(net: NodeNetwork) -> int:
    listing = subprocess.run(["iptables", "-t", "mangle", "-L", "FORWARD", "-v", "-x", "-n"],
                             capture_output=True, text=True, check=True).stdout
    comment = guard_rule(net)[guard_rule(net).index("--comment") + 1]
    for line in listing.splitlines():
        if comment in line:
            return int(line.split()[0])
    raise AssertionError(f"the guard rule is missing from mangle FORWARD:\n{listing}")


def test_the_guard_drops_pod_packets_bound_off_the_machine(
        real_cluster: RealNodeCluster, node_images: tuple[dict[str, Path], str, str]) -> None:
    """Global forwarding stays off; what a pod sends to an address outside the bridge is dropped, counted."""
    assert read_sysctl("net.ipv4.ip_forward") == "0"
    before = _guard_packets(real_cluster.net)
    gateway = subprocess.run(["ip", "-4", "route", "show", "default"], capture_output=True, text=True).stdout.split()
    outside = gateway[2] if len(gateway) > 2 else "192.0.2.1"
    out = _probe_pod(real_cluster, "guard-probe", node_images[2],
                     f"timeout 3 bash -c 'echo > /dev/tcp/{outside}/80' && echo LEFT || echo blocked")
    assert "blocked" in out and "LEFT" not in out
    assert _guard_packets(real_cluster.net) > before


# -- training ---------------------------------------------------------------------------------------------------


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

    def first_step_after(self, t: float) -> float:
        return next(at for at, _ in self.steps if at > t) - t

    def describe(self) -> str:
        return json.dumps(self.job.get("status"), indent=1)[-3000:]

    def assert_succeeded(self, min_reward: float) -> None:
        assert condition(self.job, "Succeeded")["status"] == "True", self.describe()
        steps = [p["step"] for p in self.progress]
        assert steps == sorted(steps) and len(steps) >= 3, steps  # kubectl get rlj showed Step rising
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
        def resumed() -> bool:
            back = next((r for r in self.rollbacks if r > t), None)
            return back is not None and any(at > back for at, _ in self.steps)

        self._until(lambda _: resumed(), "a rollback to the last checkpoint and a step after it")
        back = next(r for r in self.rollbacks if r > t)
        return next(at for at, _ in self.steps if at > back) - t

    def to_end(self) -> RunResult:
        if not self.t0:
            self.apply()
        found = self._until(lambda job: any(c["type"] in ("Succeeded", "Failed") and c["status"] == "True"
                                            for c in job.get("status", {}).get("conditions", [])), "the end")
        first = self.steps[0][0] - self.t0 if self.steps else float("nan")
        return RunResult(found, self.progress, self.steps, first, time.monotonic() - self.t0, self.metrics_file)


@pytest.fixture(scope="module")
def operator(real_cluster: RealNodeCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    log = tmp_path_factory.mktemp("real-operator") / "operator.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDFLOW_")}
    proc = OperatorProcess(log, env | {"KUBECONFIG": str(real_cluster.kubeconfig)})
    proc.start()
    yield proc
    proc.stop()


def test_tiny_grpo_trains_in_real_pods_to_succeeded(real_cluster: RealNodeCluster, operator: OperatorProcess,
                                                    node_images: tuple[dict[str, Path], str, str]) -> None:
    """kubectl apply of examples/tiny-grpo-job.yaml (on the minimal image with this machine's Python): the Ray
    pods start, KubeRay's submitter runs `hybridflow train`, status.progress rises, the job ends Succeeded."""
    job = with_host_runtime(yaml.safe_load(TINY_GRPO.read_text()), node_images[2])
    result = JobRun(real_cluster, job, "real-grpo").to_end()
    result.assert_succeeded(MIN_FINAL_REWARD)
    rayjob = real_cluster.get_json("rayjob", result.job["metadata"]["name"], "-n", "real-grpo")
    assert rayjob["status"]["jobStatus"] == "SUCCEEDED"
    print(f"\nGRPO: apply->first step {result.first_step_s:.1f}s, wall {result.wall_s:.1f}s, "
          f"final reward {result.final_reward:.3f}")
