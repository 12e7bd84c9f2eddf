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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.harness.controlplane import eventually
from e2e.harness.hoststate import HostSnapshot, read_sysctl
from e2e.harness.nodes import NODE_NAME, NodeNetwork, guard_rule, missing_host_tools
from e2e.harness.operator import OperatorProcess
from e2e.harness.realcluster import RealNodeCluster, with_host_runtime
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


def _require() -> None:
    reason = _unavailable()
    if reason is None:
        return
    if in_ci():
        pytest.fail(f"the real-node tier cannot run here: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def node_images() -> tuple[dict[str, Path], str, str]:
    """(archives to import, pause image, node-base image), built once and cached by their inputs."""
    _require()
    from e2e.harness import images

    built = images.build(["pause", "node-base"])
    return built, images.name("pause"), images.name("node-base")


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


@pytest.fixture(scope="module")
def operator(real_cluster: RealNodeCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    log = tmp_path_factory.mktemp("real-operator") / "operator.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDFLOW_")}
    proc = OperatorProcess(log, env | {"KUBECONFIG": str(real_cluster.kubeconfig)})
    proc.start()
    yield proc
    proc.stop()


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


def _job(path: Path, namespace: str, image: str) -> dict[str, Any]:
    job = yaml.safe_load(path.read_text())
    job["metadata"]["namespace"] = namespace
    return with_host_runtime(job, image)


def _train(cluster: RealNodeCluster, operator: OperatorProcess, example: Path, image: str,
           namespace: str) -> dict[str, Any]:
    """kubectl apply the example; follow status.progress until the job ends; return what was seen."""
    cluster.kubectl("create", "namespace", namespace)
    checkpoints = cluster.hostpath_volume("checkpoints", namespace)
    job = _job(example, namespace, image)
    name = job["metadata"]["name"]
    t0 = time.monotonic()
    cluster.kubectl("apply", "-f", "-", input=json.dumps(job))
    seen: list[dict[str, Any]] = []
    first_step_s = None
    deadline = t0 + RUN_S
    while time.monotonic() < deadline:
        found = cluster.get_json("rltrainingjob", name, "-n", namespace)
        progress = found.get("status", {}).get("progress") or {}
        if progress.get("step") and (not seen or seen[-1].get("step") != progress["step"]):
            seen.append(progress)
            first_step_s = first_step_s or time.monotonic() - t0
        done = [c for c in found.get("status", {}).get("conditions", [])
                if c["type"] in ("Succeeded", "Failed") and c["status"] == "True"]
        if done:
            return {"job": found, "progress": seen, "first_step_s": first_step_s,
                    "wall_s": time.monotonic() - t0, "checkpoints": checkpoints}
        time.sleep(2)
    pods = cluster.kubectl("get", "pods", "-n", namespace, "-o", "wide", check=False).stdout
    raise AssertionError(f"{name} did not finish in {RUN_S:.0f}s; progress {seen[-3:]}\n{pods}\n{operator.tail()}")


@pytest.mark.parametrize("example", [TINY_PPO, TINY_GRPO], ids=["ppo", "grpo"])
def test_a_tiny_job_trains_in_real_pods_to_succeeded(real_cluster: RealNodeCluster, operator: OperatorProcess,
                                                     node_images: tuple[dict[str, Path], str, str],
                                                     example: Path) -> None:
    namespace = f"real-{example.stem}"
    result = _train(real_cluster, operator, example, node_images[2], namespace)
    job = result["job"]
    assert condition(job, "Succeeded")["status"] == "True", json.dumps(job.get("status"), indent=1)
    steps = [p["step"] for p in result["progress"]]
    assert steps == sorted(steps) and len(steps) >= 3, steps
    rewards = [p["reward"] for p in result["progress"] if p.get("reward") is not None]
    assert rewards[-1] > rewards[0]
    final = job["status"]["progress"]
    assert final["step"] == 80 and final["reward"] >= MIN_FINAL_REWARD, final
    rayjob = real_cluster.get_json("rayjob", job["metadata"]["name"], "-n", namespace)
    assert rayjob["status"]["jobStatus"] == "SUCCEEDED"
    saved = sorted(p.name for p in (result["checkpoints"] / job["metadata"]["name"]).iterdir())
    assert saved, "no checkpoint on the claim's volume"
    print(f"\n{example.stem}: apply->first step {result['first_step_s']:.1f}s, wall {result['wall_s']:.1f}s, "
          f"final reward {final['reward']:.3f}, checkpoints {saved}")
