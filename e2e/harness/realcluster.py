"""The real-node tier: the full control plane on the bridge address, one real kubelet node, local volumes.

Start order: host snapshot, bridge and guard rule, control plane (whose API server binds the bridge address),
containerd, CoreDNS, kubelet, kube-proxy. Stop runs it backwards and restores the snapshot, so the machine
comes back as it was.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from . import chart, images
from .controlplane import ControlPlane, KubectlClient, eventually
from .hoststate import HostSnapshot, remove_tree
from .nodes import (
    NODE_NAME,
    NodeNetwork,
    RealNode,
    alive,
    containerd_socket,
    lock_owner,
    preflight,
    record_owner,
    stop_node,
)

REPO = Path(__file__).resolve().parents[2]
STORAGE_CLASS = "local-hostpath"


class RealNodeCluster(KubectlClient):
    """Use as a context manager, or start()/stop(); `up`/`down` of the CLI use state() and stop_from_state()."""

    def __init__(self, work_dir: Path, images: Mapping[str, Path], pause_image: str, *,
                 net: NodeNetwork | None = None, detach: bool = False, timeout: float = 120.0,
                 crd_dirs: tuple[Path, ...] = (REPO / "crds",)) -> None:
        self.work_dir = work_dir
        self.net = net or NodeNetwork()
        self.images = images
        self.pause_image = pause_image
        self.detach = detach
        self.cp = ControlPlane(full=True, work_dir=work_dir, crd_dirs=crd_dirs, detach=detach, timeout=timeout,
                               address=self.net.gateway, kuberay_args=["--use-kubernetes-proxy"])
        self.kubeconfig = self.cp.kubeconfig
        self.node_name = NODE_NAME
        self.node: RealNode | None = None
        self.snapshot: HostSnapshot | None = None
        self.timings: dict[str, float] = {}

    @property
    def volumes_dir(self) -> Path:
        return self.work_dir / "volumes"

    def __enter__(self) -> RealNodeCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> RealNodeCluster:
        t0 = time.monotonic()
        clean_after_dead_cluster()
        preflight()
        remove_tree(self.work_dir)
        self.work_dir.mkdir(parents=True)
        self.snapshot = HostSnapshot.take()
        (self.work_dir / "host.json").write_text(json.dumps(self.snapshot.to_json()))
        record_owner(self.work_dir, self.net, containerd_socket(self.work_dir))
        try:
            RealNode.network_up(self.net)
            self.cp.start()
            self.timings["control_plane"] = time.monotonic() - t0
            self.node = RealNode(self.cp, self.net, self.images, self.pause_image, self.detach).start()
            self.timings |= {k: v + self.timings["control_plane"] for k, v in self.node.timings.items()}
            self.cp.kubectl("apply", "-f", "-", input=json.dumps(storage_class()))
        except BaseException:
            self.stop()
            raise
        self.timings["total"] = time.monotonic() - t0
        return self

    def state(self) -> dict[str, Any]:
        assert self.node is not None and self.snapshot is not None
        return {"kind": "real-nodes", "kubeconfig": str(self.kubeconfig), "work_dir": str(self.work_dir),
                "network": {"bridge": self.net.bridge, "subnet": self.net.subnet},
                "control_plane": self.cp.state(), "node": self.node.state(), "host": self.snapshot.to_json()}

    def stop(self) -> list[str]:
        """Everything down and the host restored; returns what could not be restored."""
        if self.node is not None:
            self.node.stop()
        self.cp.stop()
        return _restore_host(self.net, self.snapshot, self.work_dir)

    @staticmethod
    def stop_from_state(state: Mapping[str, Any]) -> list[str]:
        if state.get("node"):
            stop_node(state["node"])
        ControlPlane.stop_from_state(state["control_plane"], remove_work_dir=False)
        net = NodeNetwork(**state["network"])
        return _restore_host(net, HostSnapshot.from_json(state["host"]), Path(state["work_dir"]))

    # -- volumes --------------------------------------------------------------------------------

    def hostpath_volume(self, name: str, namespace: str, size: str = "1Gi") -> Path:
        """A PersistentVolume on a directory of the node, pre-bound to the claim `namespace/name`, and that claim.

        Returns the directory: what the pods write there is readable after they are gone.
        """
        path = self.volumes_dir / namespace / name
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o777)  # the runtime image's user is not root
        pv_name = f"{namespace}-{name}"
        pv = {
            "apiVersion": "v1", "kind": "PersistentVolume",
            "metadata": {"name": pv_name, "labels": {"hybridflow.io/volume": name}},
            "spec": {
                "capacity": {"storage": size}, "accessModes": ["ReadWriteOnce"],
                "persistentVolumeReclaimPolicy": "Retain", "storageClassName": STORAGE_CLASS,
                "hostPath": {"path": str(path), "type": "Directory"},
                "claimRef": {"namespace": namespace, "name": name},
            },
        }
        pvc = {
            "apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": STORAGE_CLASS,
                     "volumeName": pv_name, "resources": {"requests": {"storage": size}}},
        }
        self.cp.apply_objects([pv, pvc])
        eventually(lambda: self.get_json("pvc", name, "-n", namespace)["status"].get("phase") == "Bound", 60,
                   f"claim {namespace}/{name} bound")
        return path


def clean_after_dead_cluster() -> list[str]:
    """A real-node cluster whose harness died (a killed test run) leaves containers, mounts, the bridge and
    host settings behind: stop and undo them from what it recorded, before anything else starts."""
    owner = lock_owner()
    if owner is None or alive(owner.get("containerd_pid")):
        return []
    work_dir = Path(owner["work_dir"])
    stop_node({"socket": owner["socket"], "dir": str(work_dir / "node"), "processes": []})
    snapshot_file = work_dir / "host.json"
    snapshot = HostSnapshot.from_json(json.loads(snapshot_file.read_text())) if snapshot_file.is_file() else None
    return _restore_host(NodeNetwork(**owner["network"]), snapshot, work_dir)


def storage_class() -> dict[str, Any]:
    """Static volumes only: a claim binds to a PersistentVolume made for it."""
    return {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
            "metadata": {"name": STORAGE_CLASS}, "provisioner": "kubernetes.io/no-provisioner",
            "volumeBindingMode": "Immediate", "reclaimPolicy": "Retain"}


def _restore_host(net: NodeNetwork, snapshot: HostSnapshot | None, work_dir: Path) -> list[str]:
    RealNode.network_down(net)
    problems = snapshot.restore() if snapshot is not None else []
    remove_tree(work_dir)
    return problems


def host_runtime_paths() -> list[Path]:
    """What a pod needs to run this machine's hybridflow: the Python installation, the venv and the project."""
    paths = [Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve(), REPO]
    unique: list[Path] = []
    for p in sorted(set(paths), key=lambda p: len(p.parts)):
        if not any(p.is_relative_to(u) for u in unique):
            unique.append(p)
    return unique


def with_host_runtime(job: dict[str, Any], image: str) -> dict[str, Any]:
    """The job on a minimal image with this machine's Python, venv and project mounted read-only at their own
    paths (the fast tier: no runtime image to build), `ray` and `python` found through PATH."""
    job = json.loads(json.dumps(job))
    cluster = job["spec"].setdefault("cluster", {})
    cluster["image"] = image
    for i, mounted in enumerate(host_runtime_paths()):
        name = f"host-runtime-{i}"
        volume = {"name": name, "hostPath": {"path": str(mounted), "type": "Directory"}}
        cluster.setdefault("volumes", []).append(volume)
        cluster.setdefault("volumeMounts", []).append({"name": name, "mountPath": str(mounted), "readOnly": True})
    search = f"{Path(sys.prefix).resolve() / 'bin'}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    cluster.setdefault("env", []).append({"name": "PATH", "value": search})
    return job


RELEASE = "hybridflow"
RELEASE_NAMESPACE = "hybridflow-system"
USER_IMAGES = (images.PAUSE, images.OPERATOR, images.RUNTIME_CPU)


def node_images(built: Mapping[str, images.BuiltImage], names: Sequence[str]) -> dict[str, Path]:
    """Reference -> archive of the images a node needs (the bases built along are left out)."""
    return {built[n].ref: built[n].archive for n in names}


OPERATOR_PROGRESS_INTERVAL = 1
"""The chart's progressInterval here: a tiny job's step, seen through status.progress, rises every second."""


def operator_values(operator_image: str, runtime_image: str) -> dict[str, Any]:
    """The chart's values for the real-node tier: the operator image built here, a toleration for the GPU taint
    (the one node is a GPU node; a real cluster would run the operator on a CPU node), and progress every
    second."""
    repository, tag = operator_image.rsplit(":", 1)
    return {
        "image": {"repository": repository, "tag": tag, "pullPolicy": "IfNotPresent"},
        "runtimeImage": runtime_image,
        "progressInterval": OPERATOR_PROGRESS_INTERVAL,
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    }


def up_for_users(work_dir: Path) -> RealNodeCluster:
    """What `make cluster-up` gives: the real-node cluster, the runtime and operator images imported, the chart's
    operator running from its image, and a `checkpoints` claim in the default namespace."""
    built = images.build(USER_IMAGES)
    cluster = RealNodeCluster(work_dir, node_images(built, USER_IMAGES), built[images.PAUSE].ref, detach=True)
    cluster.start()
    try:
        chart.install_chart(cluster, RELEASE, RELEASE_NAMESPACE,
                            operator_values(built[images.OPERATOR].ref, built[images.RUNTIME_CPU].ref))
        cluster.hostpath_volume("checkpoints", "default")
    except BaseException:
        cluster.stop()
        raise
    return cluster
