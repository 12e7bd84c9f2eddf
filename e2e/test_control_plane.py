"""The e2e control plane itself: each component does its real job.

If these fail, every cluster test built on top would fail for reasons unrelated to hybridflow.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.harness import A100, binaries, controlplane
from e2e.harness.controlplane import ControlPlane, eventually

pytestmark = pytest.mark.controlplane

RAY_IMAGE = "rayproject/ray:2.46.0"
WAIT_S = 90.0


def create(cp: ControlPlane, namespace: str, manifest: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """kubectl create of one manifest; returns the result without raising so tests can inspect it."""
    return cp.kubectl("create", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest), check=False)


def rayjob(name: str, spec_overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """A minimal RayJob; suspended so a running operator leaves it alone (KubeRay allows that only
    together with shutdownAfterJobFinishes)."""
    spec: dict[str, Any] = {
        "entrypoint": "python -c 'print(1)'",
        "suspend": True,
        "shutdownAfterJobFinishes": True,
        "rayClusterSpec": {
            "headGroupSpec": {
                "rayStartParams": {},
                "template": {"spec": {"containers": [{"name": "ray-head", "image": RAY_IMAGE}]}},
            }
        },
    }
    spec.update(spec_overrides or {})
    return {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": {"name": name}, "spec": spec}


# --- API server --------------------------------------------------------------------------------


def test_kubectl_version_reports_the_pinned_release(control_plane: ControlPlane) -> None:
    info = json.loads(control_plane.kubectl("version", "-o", "json").stdout)
    server = info["serverVersion"]
    assert server["major"] == "1"
    if not os.environ.get("KUBEBUILDER_ASSETS") and not os.environ.get("TEST_ASSET_KUBE_APISERVER"):
        assert server["gitVersion"] == binaries.version("kube-apiserver")


def test_api_resources_include_core_and_kuberay_kinds(kuberay_crds: ControlPlane) -> None:
    names = set(kuberay_crds.kubectl("api-resources", "-o", "name").stdout.split())
    assert {
        "pods",
        "nodes",
        "deployments.apps",
        "jobs.batch",
        "customresourcedefinitions.apiextensions.k8s.io",
    } <= names
    assert {"rayjobs.ray.io", "rayclusters.ray.io"} <= names


def test_rbac_is_enforced(control_plane: ControlPlane) -> None:
    allowed = control_plane.kubectl("auth", "can-i", "create", "pods", "--as=nobody", check=False)
    assert allowed.stdout.strip() == "no"
    admin = control_plane.kubectl("auth", "can-i", "*", "*")
    assert admin.stdout.strip() == "yes"


# --- KubeRay's real CRDs -----------------------------------------------------------------------


def test_valid_rayjob_is_accepted(kuberay_crds: ControlPlane, namespace: str) -> None:
    result = create(kuberay_crds, namespace, rayjob("valid"))
    assert result.returncode == 0, result.stderr
    stored = kuberay_crds.get_json("rayjob", "valid", "-n", namespace)
    assert stored["spec"]["submissionMode"] == "K8sJobMode"  # defaulted by the CRD schema
    assert stored["spec"]["backoffLimit"] == 0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"shutdownAfterJobFinishes": "yes"}, "spec.shutdownAfterJobFinishes"),
        (
            {"rayClusterSpec": {"headGroupSpec": {"rayStartParams": {}}}},
            "spec.rayClusterSpec.headGroupSpec.template",
        ),
        ({"rayClusterSpec": {"workerGroupSpecs": []}}, "spec.rayClusterSpec.headGroupSpec"),
        ({"backoffLimit": "three"}, "spec.backoffLimit"),
    ],
    ids=["bool-as-string", "head-without-template", "no-head-group", "int-as-string"],
)
def test_invalid_rayjob_is_rejected_by_the_schema(
    kuberay_crds: ControlPlane, namespace: str, overrides: dict[str, Any], message: str
) -> None:
    result = create(kuberay_crds, namespace, rayjob("invalid", overrides))
    assert result.returncode != 0
    assert "is invalid" in result.stderr and message in result.stderr, result.stderr


# --- controllers, scheduler, kwok, KubeRay operator ---------------------------------------------


def nodes_by_product(cp: ControlPlane) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for node in cp.get_json("nodes", "-l", "type=kwok")["items"]:
        product = node["metadata"]["labels"].get("nvidia.com/gpu.product", "cpu")
        groups.setdefault(product, []).append(node)
    return groups


def is_ready(node: dict[str, Any]) -> bool:
    conditions = node["status"].get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def test_fake_fleet_is_ready_with_gpu_capacity(full_cluster: ControlPlane) -> None:
    groups = nodes_by_product(full_cluster)
    assert {k: len(v) for k, v in groups.items()} == {A100: 4, "NVIDIA-H100-80GB-HBM3": 2, "cpu": 2}
    for node in groups[A100]:
        assert is_ready(node)
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
        assert {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"} in node["spec"]["taints"]
    assert all(is_ready(n) for n in groups["cpu"])


def gpu_pod(name: str, product: str, gpus: int = 1, tolerate: bool = True) -> dict[str, Any]:
    """A Pod that asks for GPUs of one product, as a rendered Ray worker would."""
    spec: dict[str, Any] = {
        "containers": [
            {
                "name": "main",
                "image": "busybox",
                "resources": {
                    "limits": {"nvidia.com/gpu": str(gpus)},
                    "requests": {"cpu": "1", "memory": "1Gi"},
                },
            }
        ],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In", "values": [product]}]}
                    ]
                }
            }
        },
    }
    if tolerate:
        spec["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def test_gpu_pod_is_scheduled_on_an_a100_node_and_runs(full_cluster: ControlPlane, namespace: str) -> None:
    assert create(full_cluster, namespace, gpu_pod("trainer", A100, gpus=8)).returncode == 0
    full_cluster.kubectl(
        "wait",
        "-n",
        namespace,
        "pod/trainer",
        "--for=jsonpath={.status.phase}=Running",
        f"--timeout={WAIT_S:.0f}s",
    )
    pod = full_cluster.get_json("pod", "trainer", "-n", namespace)
    node = full_cluster.get_json("node", pod["spec"]["nodeName"])
    assert node["metadata"]["labels"]["nvidia.com/gpu.product"] == A100


def test_gpu_pod_without_toleration_stays_pending(full_cluster: ControlPlane, namespace: str) -> None:
    assert create(full_cluster, namespace, gpu_pod("untolerated", A100, tolerate=False)).returncode == 0

    def unschedulable() -> bool:
        pod = full_cluster.get_json("pod", "untolerated", "-n", namespace)
        conditions = pod["status"].get("conditions", [])
        return any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conditions)

    eventually(unschedulable, WAIT_S, "scheduler marks the untolerated GPU pod Unschedulable")
    assert not full_cluster.get_json("pod", "untolerated", "-n", namespace)["spec"].get("nodeName")


def raycluster(name: str) -> dict[str, Any]:
    """A RayCluster with a CPU head and one A100 worker, like the clusters the operator renders."""
    worker = gpu_pod("unused", A100, gpus=8)["spec"]
    worker["containers"][0] |= {"name": "ray-worker", "image": RAY_IMAGE}
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": name},
        "spec": {
            "headGroupSpec": {
                "rayStartParams": {"num-cpus": "0"},
                "template": {
                    "spec": {
                        "containers": [
                            {
                                "name": "ray-head",
                                "image": RAY_IMAGE,
                                "resources": {"requests": {"cpu": "2", "memory": "8Gi"}},
                            }
                        ]
                    }
                },
            },
            "workerGroupSpecs": [
                {
                    "groupName": "a100",
                    "replicas": 1,
                    "minReplicas": 1,
                    "maxReplicas": 1,
                    "rayStartParams": {},
                    "template": {"spec": worker},
                }
            ],
        },
    }


def ray_pods(cp: ControlPlane, namespace: str, cluster: str) -> list[dict[str, Any]]:
    return cp.get_json("pods", "-n", namespace, "-l", f"ray.io/cluster={cluster}")["items"]


def test_kuberay_operator_creates_bound_ray_pods(full_cluster: ControlPlane, namespace: str) -> None:
    assert create(full_cluster, namespace, raycluster("rc")).returncode == 0

    def bound_pods() -> dict[str, dict[str, Any]]:
        pods = {p["metadata"]["labels"]["ray.io/node-type"]: p for p in ray_pods(full_cluster, namespace, "rc")}
        both = {"head", "worker"} <= pods.keys()
        return pods if both and all(p["spec"].get("nodeName") for p in pods.values()) else {}

    pods = eventually(bound_pods, WAIT_S, "KubeRay creates head and worker pods and the scheduler binds them")
    head_node = full_cluster.get_json("node", pods["head"]["spec"]["nodeName"])
    worker_node = full_cluster.get_json("node", pods["worker"]["spec"]["nodeName"])
    assert "nvidia.com/gpu.product" not in head_node["metadata"]["labels"]  # untolerated: CPU node
    assert worker_node["metadata"]["labels"]["nvidia.com/gpu.product"] == A100
    full_cluster.kubectl(
        "wait",
        "-n",
        namespace,
        "pod",
        "-l",
        "ray.io/cluster=rc",
        "--for=condition=Ready",
        f"--timeout={WAIT_S:.0f}s",
    )


def test_deleting_an_owner_garbage_collects_its_children(full_cluster: ControlPlane, namespace: str) -> None:
    full_cluster.kubectl("create", "configmap", "owner", "-n", namespace)
    owner_uid = full_cluster.get_json("configmap", "owner", "-n", namespace)["metadata"]["uid"]
    child = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "child",
            "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner_uid}],
        },
    }
    assert create(full_cluster, namespace, child).returncode == 0
    full_cluster.kubectl("delete", "configmap", "owner", "-n", namespace)

    def child_gone() -> bool:
        return full_cluster.kubectl("get", "configmap", "child", "-n", namespace, check=False).returncode != 0

    eventually(child_gone, WAIT_S, "the garbage collector deletes the child ConfigMap")


def test_deleting_a_raycluster_removes_its_pods(full_cluster: ControlPlane, namespace: str) -> None:
    assert create(full_cluster, namespace, raycluster("gc")).returncode == 0
    eventually(lambda: len(ray_pods(full_cluster, namespace, "gc")) == 2, WAIT_S, "KubeRay creates the pods")
    full_cluster.kubectl("delete", "raycluster", "gc", "-n", namespace, f"--timeout={WAIT_S:.0f}s")
    eventually(lambda: not ray_pods(full_cluster, namespace, "gc"), WAIT_S, "the RayCluster's pods are deleted")


# --- ports taken between picking and binding ---------------------------------------------------


@contextlib.contextmanager
def ports_taken(monkeypatch: pytest.MonkeyPatch, count: int) -> Iterator[list[int]]:
    """`count` loopback ports held in LISTEN by this process, as another process would hold them; the
    harness's next free_port() hands out the first of them once more (a second collision in a row)."""
    sockets = []
    for _ in range(count):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind(("127.0.0.1", 0))
        s.listen()
        sockets.append(s)
    held = [s.getsockname()[1] for s in sockets]
    again = held[:1]
    real = controlplane.free_port
    monkeypatch.setattr(controlplane, "free_port", lambda: again.pop(0) if again else real())
    try:
        yield held
    finally:
        for s in sockets:
            s.close()


def bind_errors(cp: ControlPlane, component: str) -> int:
    return (cp.work_dir / "logs" / f"{component}.log").read_text().count("address already in use")


def test_etcd_and_apiserver_move_off_ports_taken_before_they_bind(
    minimal_binaries: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cp = ControlPlane(work_dir=tmp_path / "cp", install_kuberay_crds=False, allow_build=False)
    fields = ("etcd_client", "etcd_peer", "apiserver")
    with ports_taken(monkeypatch, len(fields)) as held:
        for field, port in zip(fields, held, strict=True):
            setattr(cp.ports, field, port)  # picked, then taken by someone else
        try:
            cp.start()  # every first start fails to bind, and so does etcd's first restart
            assert not {getattr(cp.ports, f) for f in fields} & set(held)
            assert cp.kubectl("get", "namespace", "default", "-o", "name").stdout.strip() == "namespace/default"
            assert cp.server in cp.kubeconfig.read_text()
            assert bind_errors(cp, "etcd") >= 2
            assert bind_errors(cp, "kube-apiserver") >= 1
        finally:
            cp.stop()


def test_controllers_and_kuberay_move_off_ports_taken_before_they_bind(
    full_binaries: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cp = ControlPlane(full=True, work_dir=tmp_path / "cp", allow_build=False)
    fields = ("controller_manager", "scheduler", "kwok", "kuberay_metrics", "kuberay_probe")
    with ports_taken(monkeypatch, len(fields)) as held:
        for field, port in zip(fields, held, strict=True):
            setattr(cp.ports, field, port)
        try:
            cp.start()
            assert not {getattr(cp.ports, f) for f in fields} & set(held)
            assert all(p.running() for p in cp.processes.values())
            for name in ("kube-controller-manager", "kube-scheduler", "kwok", "kuberay-operator"):
                assert bind_errors(cp, name) >= 1, name
        finally:
            cp.stop()


# --- processes ---------------------------------------------------------------------------------

ORPHANING_STARTER = """
import sys, threading, time
from pathlib import Path
from e2e.harness.controlplane import Process

for _ in range(4):  # threads churning the heap while the component is forked, as Ray's and torch's do
    threading.Thread(target=lambda: [bytearray(4096) for _ in iter(int, 1)], daemon=True).start()
proc = Process.start("sleeper", ["sleep", "600"], Path(sys.argv[1]))
print(proc.pid, flush=True)
time.sleep(600)
"""


def test_a_component_stops_when_the_test_process_is_killed(tmp_path: Path) -> None:
    starter = subprocess.Popen(
        [sys.executable, "-c", ORPHANING_STARTER, str(tmp_path / "sleeper.log")],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1],
    )
    try:
        assert starter.stdout is not None
        sleeper = controlplane.Process("sleeper", int(starter.stdout.readline()), ["sleep"], tmp_path / "sleeper.log")
        assert sleeper.running()
        starter.kill()
        starter.wait(timeout=10)
        eventually(lambda: not sleeper.running(), 10, "the orphaned component exited")
    finally:
        starter.kill()
