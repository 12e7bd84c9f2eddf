"""The real-node tier: RLTrainingJobs that train inside real Ray pods on a real kubelet node, to Succeeded.

One real node (kubelet, containerd, runc, a bridge CNI, kube-proxy, CoreDNS) doubles as a fake A100 node.
The Ray pods of this fast tier run a minimal image with this machine's Python and the project mounted read-only
(importing the 6.4 GiB runtime image alone takes 2-3 minutes: e2e/README.md; the full tier uses it).
Marker `realnodes`; needs root and Debian's packages (e2e/toolchain/install-node-packages.sh).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from e2e.harness import images
from e2e.harness.controlplane import eventually
from e2e.harness.hoststate import HostSnapshot, read_sysctl
from e2e.harness.nodes import NODE_NAME, NodeNetwork, guard_rule
from e2e.harness.operator import OperatorProcess
from e2e.harness.realcluster import RealNodeCluster, clean_after_dead_cluster, with_host_runtime
from e2e.harness.realcluster import node_images as node_images_of
from e2e.realnode_runs import MIN_FINAL_REWARD, TINY_GRPO, JobRun, require_real_nodes
from hybridflow.k8s import contract, names
from tests.helpers import condition, env_of, templates_of

pytestmark = pytest.mark.realnodes


@pytest.fixture(scope="module")
def node_images() -> tuple[dict[str, Path], str, str]:
    """(reference -> archive to import, pause image, node-base image), built once and cached by their inputs."""
    require_real_nodes()
    wanted = (images.PAUSE, images.NODE_BASE)
    built = images.build(wanted)
    return node_images_of(built, wanted), built[images.PAUSE].ref, built[images.NODE_BASE].ref


def test_teardown_restores_the_host(node_images: tuple[dict[str, Path], str, str],
                                    tmp_path_factory: pytest.TempPathFactory) -> None:
    """Up and down again: sysctls, iptables, fixed paths, cgroups and the bridge are as they were.

    What a dead cluster left (a killed run's kubelet sysctls) is undone first: the host is compared with itself
    as this cluster found it, not as another one left it."""
    archives, pause, _ = node_images
    clean_after_dead_cluster()
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


@pytest.fixture(scope="module")
def operator(real_cluster: RealNodeCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    log = tmp_path_factory.mktemp("real-operator") / "operator.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDFLOW_")}
    # the Ray pods patch status.progress every second (5 by default), so a short job shows its step rising
    proc = OperatorProcess(log, env | {"KUBECONFIG": str(real_cluster.kubeconfig),
                                  contract.ENV_PROGRESS_INTERVAL: "1"})
    proc.start()
    yield proc
    proc.stop()


def test_tiny_grpo_trains_in_real_pods_to_succeeded(real_cluster: RealNodeCluster, operator: OperatorProcess,
                                                    node_images: tuple[dict[str, Path], str, str]) -> None:
    """kubectl apply of examples/tiny-grpo-job.yaml (on the minimal image with this machine's Python): the Ray
    pods start, KubeRay's submitter runs `hybridflow train`, the driver serves the scheduler dashboard on the head
    (status.schedulerDashboardUrl), status.progress rises, the job ends Succeeded."""
    job = with_host_runtime(yaml.safe_load(TINY_GRPO.read_text()), node_images[2])
    run = JobRun(real_cluster, job, "real-grpo")
    run.apply()
    run.wait_for_step(1)
    _assert_the_scheduler_dashboard_is_served(real_cluster, run)
    result = run.to_end()
    result.assert_succeeded(MIN_FINAL_REWARD)
    rayjob = real_cluster.get_json("rayjob", result.job["metadata"]["name"], "-n", "real-grpo")
    assert rayjob["status"]["jobStatus"] == "SUCCEEDED"
    assert env_of(templates_of(rayjob)["head"])[contract.ENV_PROGRESS_INTERVAL] == "1"  # the operator's, as started
    print(f"\nGRPO: apply->first step {result.first_step_s:.1f}s, wall {result.wall_s:.1f}s, "
          f"final reward {result.final_reward:.3f}")


def _assert_the_scheduler_dashboard_is_served(cluster: RealNodeCluster, run: JobRun, timeout_s: float = 60.0) -> None:
    """status.schedulerDashboardUrl names the RayCluster's head Service and the head's port, and the page the
    driver serves there comes back through the API server's service proxy with the job's status (while the head
    lives); the RayJob's head Service reaches it too."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    seen: dict[str, float] = {}  # what each try found, first seen after how long
    while time.monotonic() < deadline:
        found = "no status.schedulerDashboardUrl"
        status = run.poll().get("status") or {}  # poll: JobRun keeps following the steps meanwhile
        url = status.get("schedulerDashboardUrl")
        if url:
            where = urllib.parse.urlsplit(url)
            service = names.head_service_name(status["rayClusterName"])
            assert (where.scheme, where.hostname, where.port) == \
                ("http", f"{service}.{run.namespace}.svc.cluster.local", contract.DASHBOARD_PORT), url
            proxy = f"/api/v1/namespaces/{run.namespace}/services/{service}:{where.port}/proxy/"
            page = cluster.kubectl("get", "--raw", proxy, check=False)
            view = cluster.kubectl("get", "--raw", proxy + "api/view", check=False)
            if page.returncode == 0 and f"<title>{run.namespace}/{run.name} " in page.stdout and view.returncode == 0:
                live = json.loads(view.stdout)
                # the RayJob's head Service too, which `kubectl ray session` and the README's port-forward use
                rayjob_proxy = proxy.replace(f"/services/{service}:", f"/services/{status['rayJobName']}-head-svc:")
                via_rayjob = cluster.kubectl("get", "--raw", rayjob_proxy, check=False)
                if live["has_status"] and live["graph"]["nodes"] and via_rayjob.returncode == 0:
                    return
                found = (f"the view has no controller status yet: {live.get('error')}" if via_rayjob.returncode == 0
                         else f"{rayjob_proxy}: {(via_rayjob.stderr or via_rayjob.stdout)[-300:].strip()}")
            else:
                found = f"{proxy}: {(page.stderr or page.stdout)[-300:].strip()}"
        head = cluster.get_json("pods", "-n", run.namespace, "-l", "ray.io/node-type=head")["items"]
        ready = [c["status"] for p in head for c in p.get("status", {}).get("conditions", []) if c["type"] == "Ready"]
        seen.setdefault(f"{found} (head Ready: {ready})", round(time.monotonic() - t0, 1))
        time.sleep(1.0)
    pods = cluster.kubectl("get", "pods", "-n", run.namespace, "-o", "wide", check=False).stdout
    raise AssertionError(f"the scheduler dashboard of {run.namespace}/{run.name} is not served within "
                         f"{timeout_s:.0f}s: {seen}\n{pods}")
