"""A real kubelet node on this machine: containerd, runc, a bridge CNI, kube-proxy and CoreDNS.

The node is a fake A100 node (labels, taint, `nvidia.com/gpu` in its status) whose pods really run: Ray starts,
the runtime trains on the CPU. Pods sit on a Linux bridge of their own; forwarding is on for that bridge only,
and a guard rule drops anything forwarded from it to another interface, so no pod packet leaves the machine.
Everything lives under the work directory; the few host-wide changes are recorded first and undone on stop
(hoststate.py). One real-node cluster per machine: a second start fails, naming the first.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from . import binaries, certs, images
from .controlplane import (
    A100,
    GPU_TAINT,
    ControlPlane,
    Process,
    StartupError,
    free_port,
    http_ok,
    wait_until,
    write_kubeconfig,
)
from .hoststate import unmount_under

CNI_BIN_DIR = Path("/usr/lib/cni")
HOST_TOOLS = ("containerd", "ctr", "runc", "iptables", "ip6tables", "conntrack", "ip")
INSTALL_SCRIPT = "e2e/toolchain/install-node-packages.sh"
CLUSTER_DOMAIN = "cluster.local"
GPUS_PER_NODE = 8
NODE_NAME = "hf-a100-0"
GUARD_COMMENT = "hybridflow: no pod packet leaves the machine"
K8S_NAMESPACE = images.NAMESPACE
NODE_READY_S = 120.0
LOCK_FILE = Path("/run/hybridflow-real-nodes.json")


class NodeSetupError(StartupError):
    """What the machine lacks for real nodes, with the command that provides it."""


@dataclass(frozen=True)
class NodeNetwork:
    """The bridge pods live on: its name, its /24, and the host's address on it (the pods' gateway, the API
    server's and CoreDNS's address)."""

    bridge: str = "hfbr0"
    subnet: str = "10.213.7.0/24"

    @property
    def gateway(self) -> str:
        return str(next(ipaddress.ip_network(self.subnet).hosts()))

    @property
    def prefix_length(self) -> int:
        return ipaddress.ip_network(self.subnet).prefixlen


def guard_rule(net: NodeNetwork) -> list[str]:
    """The mangle FORWARD rule that drops packets forwarded from the bridge to any other interface."""
    return ["-i", net.bridge, "!", "-o", net.bridge, "-m", "comment", "--comment", GUARD_COMMENT, "-j", "DROP"]


# ---------------------------------------------------------------------------------------------
# configuration files (pure)


def cni_config(net: NodeNetwork, data_dir: Path) -> dict[str, Any]:
    """A bridge without masquerade or gateway mode (which would turn global forwarding on); host-local IPAM."""
    return {
        "cniVersion": "0.4.0",
        "name": "hybridflow",
        "plugins": [
            {
                "type": "bridge",
                "bridge": net.bridge,
                "isGateway": False,
                "ipMasq": False,
                "hairpinMode": True,  # a pod reaching its own Service (the Ray head through its Service name)
                "ipam": {
                    "type": "host-local",
                    "dataDir": str(data_dir),
                    "ranges": [[{"subnet": net.subnet, "gateway": net.gateway}]],
                    "routes": [{"dst": "0.0.0.0/0", "gw": net.gateway}],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def containerd_config(root: Path, state: Path, socket: Path, cni_conf_dir: Path, pause_image: str) -> str:
    """containerd 1.6 with its own paths and the CRI settings this VM needs.

    restrict_oom_score_adj: the VM lacks CAP_SYS_RESOURCE in its bounding set, so a pause container's negative
    oom_score_adj fails. netns_mounts_under_state_dir keeps pod network namespaces under `state`.
    """
    return f"""version = 2
root = "{root}"
state = "{state}"

[grpc]
  address = "{socket}"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause_image}"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{cni_conf_dir}"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{state / 'runc'}"
"""


def kubelet_config(net: NodeNetwork, dirs: Mapping[str, Path], port: int, healthz_port: int,
                   client_ca: Path) -> dict[str, Any]:
    """KubeletConfiguration for cgroup v1 with cgroupfs, x509 client auth, CoreDNS on the bridge, and eviction
    thresholds low enough that a busy development disk does not evict the pods under test."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": net.gateway,
        "port": port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz_port,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(client_ca)},
        },
        "authorization": {"mode": "Webhook"},
        "cgroupDriver": "cgroupfs",
        # Requests still decide what fits on the node; without a CFS quota a 250m head is not throttled to a
        # quarter core while Ray's dashboard starts, on a machine with two cores in all.
        "cpuCFSQuota": False,
        "failSwapOn": False,
        "failCgroupV1": False,
        "clusterDNS": [net.gateway],
        "clusterDomain": CLUSTER_DOMAIN,
        "resolvConf": str(dirs["resolv_conf"]),
        "podLogsDir": str(dirs["pod_logs"]),
        "volumePluginDir": str(dirs["volume_plugins"]),
        "staticPodPath": "",
        "registerWithTaints": [dict(GPU_TAINT)],
        "serializeImagePulls": False,
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                         "nodefs.inodesFree": "1%"},
        "maxPods": 32,
        "shutdownGracePeriod": "0s",
        "localStorageCapacityIsolation": True,
    }


def kube_proxy_config(net: NodeNetwork, kubeconfig: Path, node: str, healthz_port: int,
                      metrics_port: int) -> dict[str, Any]:
    """iptables mode; NodePorts on the bridge address only; conntrack sizes left to the host (0 = untouched)."""
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "mode": "iptables",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "hostnameOverride": node,
        "bindAddress": net.gateway,
        "healthzBindAddress": f"127.0.0.1:{healthz_port}",
        "metricsBindAddress": f"127.0.0.1:{metrics_port}",
        "clusterCIDR": net.subnet,
        "nodePortAddresses": [f"{net.gateway}/32"],
        "iptables": {"localhostNodePorts": False},
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
    }


def corefile(net: NodeNetwork, kubeconfig: Path, health_port: int, ready_port: int) -> str:
    """Cluster names only: nothing is forwarded upstream (there is no upstream to reach)."""
    return f""".:53 {{
    bind {net.gateway}
    errors
    health 127.0.0.1:{health_port}
    ready 127.0.0.1:{ready_port}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig}
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
    cache 5
}}
"""


def gpu_node_labels(gpus: int = GPUS_PER_NODE) -> dict[str, str]:
    """What GPU Feature Discovery puts on a DGX A100 node (the same labels as the kwok A100 fleet)."""
    return {
        "node-role.kubernetes.io/gpu": "",
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": A100,
        "nvidia.com/gpu.count": str(gpus),
        "nvidia.com/gpu.memory": "81920",
        "node.kubernetes.io/instance-type": "p4de.24xlarge",
        "topology.kubernetes.io/zone": "local-a",
        "hybridflow.io/real-node": "true",
    }


# ---------------------------------------------------------------------------------------------
# preflight


def missing_host_tools() -> list[str]:
    tools = [t for t in HOST_TOOLS if shutil.which(t) is None]
    if not (CNI_BIN_DIR / "bridge").is_file():
        tools.append(f"CNI plugins in {CNI_BIN_DIR}")
    return tools


def preflight() -> None:
    """Root, cgroups and Debian's packages; a clear error naming what is missing and how to get it."""
    if os.geteuid() != 0:
        raise NodeSetupError("real nodes need root (kubelet, containerd and the bridge all do)")
    absent = missing_host_tools()
    if absent:
        raise NodeSetupError(f"missing on this machine: {', '.join(absent)}; run `sudo {INSTALL_SCRIPT}`")
    owner = lock_owner()
    if owner is not None and alive(owner.get("containerd_pid")):
        raise NodeSetupError(
            f"a real-node cluster already runs on this machine (work dir {owner.get('work_dir')}); "
            "stop it first (`make cluster-down`)")


def containerd_socket(work_dir: Path) -> Path:
    return work_dir / "node" / "containerd" / "containerd.sock"


def record_owner(work_dir: Path, net: NodeNetwork, socket: Path, containerd_pid: int | None = None) -> None:
    """Written before the host is touched (so that a start killed halfway is cleaned up by the next one) and
    again once containerd runs (so that a running cluster is not)."""
    LOCK_FILE.write_text(json.dumps({"work_dir": str(work_dir), "socket": str(socket), "containerd_pid": containerd_pid,
                                     "network": {"bridge": net.bridge, "subnet": net.subnet}}))


def lock_owner() -> dict[str, Any] | None:
    """What the running (or dead) real-node cluster of this machine recorded about itself."""
    return json.loads(LOCK_FILE.read_text()) if LOCK_FILE.exists() else None


def alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# the node


def _run(*argv: str, check: bool = True, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if check and result.returncode != 0:
        raise NodeSetupError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


class RealNode:
    """One real kubelet node of `cp`, with containerd, the bridge, kube-proxy and CoreDNS next to it.

    `cp` must run with `address=net.gateway` (see real_node_control_plane); start() also creates the bridge,
    so call `network_up()` before the control plane starts.
    """

    def __init__(self, cp: ControlPlane, net: NodeNetwork, archives: Mapping[str, Path], pause_image: str,
                 detach: bool = False, node_name: str = NODE_NAME) -> None:
        self.cp = cp
        self.net = net
        self.archives = dict(archives)  # image reference -> archive to import
        self.pause_image = pause_image
        self.detach = detach
        self.node_name = node_name
        self.dir = cp.work_dir / "node"
        self.socket = containerd_socket(cp.work_dir)
        self.processes: dict[str, Process] = {}
        self.timings: dict[str, float] = {}  # seconds from start() to each stage
        self.import_s = 0.0

    # -- host network ---------------------------------------------------------------------------

    @staticmethod
    def network_up(net: NodeNetwork) -> None:
        """The bridge with the gateway address, forwarding on it alone, and the guard rule (first in FORWARD)."""
        if _run("ip", "link", "show", net.bridge, check=False).returncode != 0:
            _run("ip", "link", "add", net.bridge, "type", "bridge")
        _run("ip", "addr", "replace", f"{net.gateway}/{net.prefix_length}", "dev", net.bridge)
        _run("ip", "link", "set", net.bridge, "up")
        Path(f"/proc/sys/net/ipv4/conf/{net.bridge}/forwarding").write_text("1")
        Path("/proc/sys/net/bridge/bridge-nf-call-iptables").write_text("1")  # Service NAT for pod-to-pod
        if _run("iptables", "-t", "mangle", "-C", "FORWARD", *guard_rule(net), check=False).returncode != 0:
            _run("iptables", "-t", "mangle", "-I", "FORWARD", "1", *guard_rule(net))

    @staticmethod
    def network_down(net: NodeNetwork) -> None:
        while _run("iptables", "-t", "mangle", "-D", "FORWARD", *guard_rule(net), check=False).returncode == 0:
            pass
        _run("ip", "link", "del", net.bridge, check=False)

    # -- components -----------------------------------------------------------------------------

    def _log(self, name: str) -> Path:
        return self.cp.work_dir / "logs" / f"{name}.log"

    def _start(self, name: str, argv: list[str], env: Mapping[str, str] | None = None) -> Process:
        proc = Process.start(name, argv, self._log(name), env, self.detach)
        self.processes[name] = proc
        return proc

    def _kubeconfig(self, user: str, groups: tuple[str, ...] = ()) -> Path:
        assert self.cp.pki is not None
        pki = self.cp.pki
        pair = certs.make_client_cert(pki.client_ca, pki.directory, user, groups)
        return write_kubeconfig(self.dir / f"{user.replace(':', '-')}.kubeconfig", self.cp.server,
                                pki.serving_ca.cert, pair, user)

    def start(self) -> RealNode:
        t0 = time.monotonic()
        bins = binaries.ensure(binaries.NODE, self.cp.allow_build)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._start_containerd()
        self.timings["containerd_ready"] = time.monotonic() - t0
        self.import_images()
        self.timings["images_imported"] = time.monotonic() - t0
        self._start_coredns(bins["coredns"])
        self._start_kubelet(bins["kubelet"])
        self._start_kube_proxy(bins["kube-proxy"])
        self._wait_ready()
        self.timings["node_ready"] = time.monotonic() - t0
        record_owner(self.cp.work_dir, self.net, self.socket, self.processes["containerd"].pid)
        return self

    def _start_containerd(self) -> None:
        root, state = self.dir / "containerd" / "root", self.dir / "containerd" / "state"
        conf_dir = self.dir / "cni" / "net.d"
        for d in (root, state, conf_dir):
            d.mkdir(parents=True, exist_ok=True)
        (conf_dir / "10-hybridflow.conflist").write_text(
            json.dumps(cni_config(self.net, self.dir / "cni" / "ipam"), indent=2))
        config = self.dir / "containerd" / "config.toml"
        config.write_text(containerd_config(root, state, self.socket, conf_dir, self.pause_image))
        proc = self._start("containerd", ["containerd", "--config", str(config), "--log-level", "warn"])
        wait_until(lambda: self.ctr("version", check=False).returncode == 0, self.cp.timeout,
                   lambda: proc.failure(f"did not answer on {self.socket}"))

    def ctr(self, *args: str, check: bool = True, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
        return _run("ctr", "--address", str(self.socket), "-n", K8S_NAMESPACE, *args, check=check, timeout=timeout)

    def import_images(self) -> None:
        seconds = images.import_images(str(self.socket), self.archives.values())
        self.import_s = round(sum(seconds.values()), 1)

    def _start_coredns(self, coredns: Path) -> None:
        kubeconfig = self._kubeconfig("system:coredns")
        self.cp.apply_objects(coredns_rbac())
        health, ready = free_port(), free_port()
        path = self.dir / "Corefile"
        path.write_text(corefile(self.net, kubeconfig, health, ready))
        proc = self._start("coredns", [str(coredns), "-conf", str(path)])
        wait_until(lambda: http_ok(f"http://127.0.0.1:{ready}/ready"), self.cp.timeout,
                   lambda: proc.failure("did not become ready"))

    def _start_kubelet(self, kubelet: Path) -> None:
        assert self.cp.pki is not None
        dirs = {name: self.dir / "kubelet" / name for name in ("root", "certs", "pod_logs", "volume_plugins")}
        for d in dirs.values():
            d.mkdir(parents=True, exist_ok=True)
        dirs["resolv_conf"] = self.dir / "kubelet" / "resolv.conf"
        dirs["resolv_conf"].write_text(f"nameserver {self.net.gateway}\n")
        self.healthz = free_port()
        config = self.dir / "kubelet" / "config.yaml"
        config.write_text(yaml.safe_dump(kubelet_config(self.net, dirs, free_port(), self.healthz,
                                                        self.cp.pki.client_ca.cert)))
        kubeconfig = self._kubeconfig(f"system:node:{self.node_name}", ("system:nodes",))
        proc = self._start("kubelet", [
            str(kubelet),
            f"--config={config}",
            f"--kubeconfig={kubeconfig}",
            f"--container-runtime-endpoint=unix://{self.socket}",
            f"--root-dir={dirs['root']}",
            f"--cert-dir={dirs['certs']}",
            f"--hostname-override={self.node_name}",
            f"--node-ip={self.net.gateway}",
            "--oom-score-adj=0",
            "--v=1",
        ])
        wait_until(lambda: http_ok(f"http://127.0.0.1:{self.healthz}/healthz"), self.cp.timeout,
                   lambda: proc.failure("did not answer /healthz"))

    def _start_kube_proxy(self, kube_proxy: Path) -> None:
        kubeconfig = self._kubeconfig("system:kube-proxy")
        healthz = free_port()
        config = self.dir / "kube-proxy.yaml"
        config.write_text(yaml.safe_dump(kube_proxy_config(self.net, kubeconfig, self.node_name, healthz,
                                                           free_port())))
        proc = self._start("kube-proxy", [str(kube_proxy), f"--config={config}", "--v=1"])
        wait_until(lambda: http_ok(f"http://127.0.0.1:{healthz}/healthz"), self.cp.timeout,
                   lambda: proc.failure("did not answer /healthz"))

    def _wait_ready(self) -> None:
        """Registered and Ready; then the labels and the GPU capacity of an A100 node."""

        def registered() -> bool:
            return self.cp.kubectl("get", "node", self.node_name, check=False).returncode == 0

        wait_until(registered, NODE_READY_S, lambda: self.processes["kubelet"].failure("did not register its node"))
        labels = [f"{k}={v}" for k, v in gpu_node_labels().items()]
        self.cp.kubectl("label", "node", self.node_name, "--overwrite", *labels)
        patch = {"status": {"capacity": {"nvidia.com/gpu": str(GPUS_PER_NODE)}}}
        self.cp.kubectl("patch", "node", self.node_name, "--subresource=status", "--type=merge",
                        "-p", json.dumps(patch))
        self.cp.kubectl("wait", "--for=condition=Ready", f"--timeout={int(NODE_READY_S)}s",
                        f"node/{self.node_name}", timeout=NODE_READY_S + 10)
        wait_until(lambda: self.allocatable_gpus() == GPUS_PER_NODE, 60,
                   lambda: StartupError(f"node {self.node_name} does not show nvidia.com/gpu allocatable"))

    def allocatable_gpus(self) -> int:
        node = self.cp.get_json("node", self.node_name)
        return int(node["status"].get("allocatable", {}).get("nvidia.com/gpu", "0"))

    # -- teardown -------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        return {
            "socket": str(self.socket),
            "dir": str(self.dir),
            "processes": [{"name": p.name, "pid": p.pid, "argv": p.argv, "log": str(p.log)}
                          for p in self.processes.values()],
        }

    def stop(self) -> None:
        stop_node(self.state())
        self.processes.clear()


def stop_node(state: Mapping[str, Any]) -> None:
    """Stop a node's components and containers and unmount what they left (works from a recorded state)."""
    procs = {p["name"]: Process(p["name"], int(p["pid"]), list(p["argv"]), Path(p["log"]))
             for p in state.get("processes", [])}
    for name in ("kube-proxy", "kubelet", "coredns"):
        if name in procs:
            procs[name].stop()
    socket = state["socket"]
    if "containerd" in procs and procs["containerd"].running():
        kill_containers(socket)
        procs["containerd"].stop()
    kill_shims(socket)
    unmount_under(Path(state["dir"]))
    LOCK_FILE.unlink(missing_ok=True)


def kill_containers(socket: str) -> None:
    """SIGKILL every container task of the node, then delete tasks and containers (pods die with them)."""
    ctr = ["ctr", "--address", socket, "-n", K8S_NAMESPACE]
    tasks = subprocess.run([*ctr, "tasks", "ls", "-q"], capture_output=True, text=True, check=False).stdout.split()
    for task in tasks:
        subprocess.run([*ctr, "tasks", "kill", "-a", "-s", "SIGKILL", task], capture_output=True, check=False)
    for task in tasks:
        subprocess.run([*ctr, "tasks", "delete", "-f", task], capture_output=True, check=False, timeout=30)
    containers = subprocess.run([*ctr, "containers", "ls", "-q"], capture_output=True, text=True,
                                check=False).stdout.split()
    for c in containers:
        subprocess.run([*ctr, "containers", "delete", c], capture_output=True, check=False)


def kill_shims(socket: str) -> None:
    """containerd leaves its shims running when it stops; kill the ones serving this node's containerd."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if socket and argv[0].endswith(b"containerd-shim-runc-v2") and socket.encode() in argv:
            subprocess.run(["kill", "-9", entry.name], capture_output=True, check=False)


def coredns_rbac() -> list[dict[str, Any]]:
    """What CoreDNS's kubernetes plugin reads, granted to its own user (the upstream system:coredns role)."""
    rules = [
        {"apiGroups": [""], "resources": ["endpoints", "services", "pods", "namespaces"], "verbs": ["list", "watch"]},
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
    ]
    return [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": "system:coredns"}, "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": "system:coredns"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:coredns"},
         "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "system:coredns"}]},
    ]
