"""A real Kubernetes control plane on loopback, started from plain binaries.

Minimal mode runs etcd + kube-apiserver the way controller-runtime's envtest does. Full mode adds
kube-controller-manager (garbage collection, service accounts, Jobs), kube-scheduler, kwok (fake
nodes that turn bound pods Running) and the KubeRay operator running out of cluster. Every wait is
bounded and names what did not come up together with the tail of its log.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from . import binaries, certs

SERVICE_CIDR = "10.0.0.0/24"
LOOPBACK = "127.0.0.1"
KWOK_NODE_SELECTOR = "kwok.x-k8s.io/node=fake"
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
A100 = "NVIDIA-A100-SXM4-80GB"
H100 = "NVIDIA-H100-80GB-HBM3"

T = TypeVar("T")
STOP_GRACE_S = 10.0
POLL_S = 0.25
# A port free_port() picked can be taken by someone else before the component binds it: a fresh-clone
# `CI=true make test` on a busy machine lost 32 tests to one kube-apiserver that could not bind. A component
# whose log says so is restarted on new ports, this many times in all.
BIND_ATTEMPTS = 5
PORT_TAKEN = re.compile(r"address already in use", re.IGNORECASE)


class StartupError(RuntimeError):
    """A component did not come up in time; the message carries its log tail."""


class PortTakenError(StartupError):
    """A component could not bind one of its ports: another process took it after free_port() picked it."""


class KubectlError(subprocess.CalledProcessError):
    """A failed kubectl call whose message includes what kubectl said."""

    def __str__(self) -> str:
        return f"{super().__str__()}\nstderr: {(self.stderr or '').strip()}"


# ---------------------------------------------------------------------------------------------
# processes


def free_port() -> int:
    """A port the kernel just handed out on loopback; another process may take it before it is used (the
    control plane then moves the component that could not bind it, see ControlPlane._launch)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def dies_with_parent(argv: list[str]) -> list[str]:
    """argv behind util-linux setpriv, which sends it SIGTERM if the test process dies without cleaning up.

    Not a preexec_fn: Python code between fork and exec in a process with threads (Ray's, torch's) can meet
    a heap another thread held at the fork and abort the child ("malloc(): unaligned fastbin chunk")."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", "--", *argv] if setpriv else argv


def tail(path: Path, lines: int = 30) -> str:
    """The last lines of a log file, for error messages."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"(no log at {path})"
    return "\n".join(text.splitlines()[-lines:])


def run_kubectl(
    kubeconfig: Path, *args: str, input: str | None = None, check: bool = True, timeout: float = 60.0
) -> subprocess.CompletedProcess[str]:
    """kubectl with the given kubeconfig; raises KubectlError (with stderr) when check fails."""
    cmd = [kubectl_binary(), f"--kubeconfig={kubeconfig}", *args]
    result = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout, check=False)
    if check and result.returncode != 0:
        raise KubectlError(result.returncode, cmd, result.stdout, result.stderr)
    return result


@dataclass
class Process:
    """A started component: its pid, command line and log file."""

    name: str
    pid: int
    argv: list[str]
    log: Path
    popen: subprocess.Popen[bytes] | None = None

    @classmethod
    def start(
        cls,
        name: str,
        argv: list[str],
        log: Path,
        env: Mapping[str, str] | None = None,
        detach: bool = False,
    ) -> Process:
        """Start argv with output in `log`; detached processes outlive the caller (CLI `up`)."""
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out:
            popen = subprocess.Popen(
                argv if detach else dies_with_parent(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )
        return cls(name, popen.pid, argv, log, popen)

    def exit_code(self) -> int | None:
        """None while running; works for children and for processes started by another `up`."""
        if self.popen is not None:
            return self.popen.poll()
        if not _pid_matches(self.pid, self.argv[0]):
            return 0
        return None

    def running(self) -> bool:
        return self.exit_code() is None

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """SIGTERM, wait `grace` seconds, then SIGKILL."""
        if not self.running():
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and self.running():
            time.sleep(0.1)
        if self.running():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            if self.popen is not None:
                self.popen.wait(timeout=grace)

    def failure(self, what: str) -> StartupError:
        """An error naming this component, what it failed to do, and its log tail."""
        code = self.exit_code()
        state = f"exited with code {code}" if code is not None else "still running"
        return StartupError(f"{self.name} {what} ({state}); log {self.log}:\n{tail(self.log)}")


def _pid_matches(pid: int, executable: str) -> bool:
    """True if pid is alive and runs `executable`: guards against killing a recycled pid."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        status = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0]
    except (OSError, IndexError):
        return False
    return status != "Z" and os.path.basename(cmdline) == os.path.basename(executable)


def wait_until(check: Callable[[], bool], timeout: float, on_timeout: Callable[[], Exception]) -> None:
    """Poll `check` until it is true or `timeout` passes (then raise on_timeout())."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(Exception):
            if check():
                return
        if time.monotonic() >= deadline:
            raise on_timeout()
        time.sleep(POLL_S)


def eventually(check: Callable[[], T | None], timeout: float, what: str) -> T:
    """Poll until `check` returns something truthy and return it; AssertionError names `what`."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            value = check()
            if value:
                return value
        except Exception as exc:  # the check may race with the object it looks for
            last_error = exc
        if time.monotonic() >= deadline:
            detail = f" (last error: {last_error})" if last_error else ""
            raise AssertionError(f"{what}: not true after {timeout:.0f}s{detail}")
        time.sleep(POLL_S)


def http_ok(url: str, context: ssl.SSLContext | None = None) -> bool:
    """Whether GET url answers 200 within two seconds."""
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def insecure_context() -> ssl.SSLContext:
    """For health endpoints of components that serve self-signed loopback certificates."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def wait_healthy(
    proc: Process, url: str, timeout: float, context: ssl.SSLContext | None = None, log_offset: int = 0
) -> None:
    """Wait for a health URL, failing fast if the process exits, or says (in its log past `log_offset`)
    that a port it was given is taken: PortTakenError."""

    def port_taken() -> bool:
        with contextlib.suppress(OSError), proc.log.open("rb") as f:
            f.seek(log_offset)
            return bool(PORT_TAKEN.search(f.read().decode(errors="replace")))
        return False

    deadline = time.monotonic() + timeout
    while True:
        if port_taken():
            raise PortTakenError(str(proc.failure("could not bind a port it was given")))
        if not proc.running():
            if port_taken():  # it may have logged the error and exited since the check above
                continue
            raise proc.failure(f"exited before {url} answered")
        if http_ok(url, context):
            return
        if time.monotonic() >= deadline:
            raise proc.failure(f"did not answer {url} within {timeout:.0f}s")
        time.sleep(POLL_S)


# ---------------------------------------------------------------------------------------------
# kubeconfig


def write_kubeconfig(path: Path, server: str, ca: Path, client: certs.KeyPair, user: str) -> Path:
    """A self-contained kubeconfig (certificates embedded) for one client identity."""

    def b64(p: Path) -> str:
        return base64.b64encode(p.read_bytes()).decode()

    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "hybridflow-e2e", "cluster": {"server": server, "certificate-authority-data": b64(ca)}}],
        "users": [
            {
                "name": user,
                "user": {"client-certificate-data": b64(client.cert), "client-key-data": b64(client.key)},
            }
        ],
        "contexts": [{"name": "hybridflow-e2e", "context": {"cluster": "hybridflow-e2e", "user": user}}],
        "current-context": "hybridflow-e2e",
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
    return path


def kubectl_binary() -> str:
    """kubectl matching the server when available (env, KUBEBUILDER_ASSETS, cache), else PATH's."""
    found = binaries.find("kubectl") or shutil.which("kubectl")
    if not found:
        raise binaries.MissingBinariesError("kubectl not found (build it with build.sh, or put it on PATH)")
    return str(found)


# ---------------------------------------------------------------------------------------------
# fake GPU fleet


@dataclass(frozen=True)
class NodePool:
    """A group of identical fake nodes managed by kwok."""

    prefix: str
    count: int
    cpu: str
    memory: str
    instance_type: str
    gpu_product: str | None = None
    gpus: int = 0
    gpu_memory_mib: int = 0
    pods: str = "110"
    zone: str = "us-east-1a"


def default_fleet(a100: int = 4, h100: int = 2, cpu: int = 2) -> list[NodePool]:
    """4 DGX-A100-class nodes, 2 H100 nodes and 2 CPU nodes unless told otherwise."""
    pools = [
        NodePool("a100", a100, "96", "1152Gi", "p4de.24xlarge", A100, 8, 81920),
        NodePool("h100", h100, "192", "2048Gi", "p5.48xlarge", H100, 8, 81559),
        NodePool("cpu", cpu, "16", "64Gi", "m6i.4xlarge"),
    ]
    return [p for p in pools if p.count > 0]


def node_manifest(pool: NodePool, index: int) -> dict[str, Any]:
    """A Node with labels, taints and status the way GPU Feature Discovery would leave it."""
    name = f"kwok-{pool.prefix}-{index}"
    labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "node.kubernetes.io/instance-type": pool.instance_type,
        "topology.kubernetes.io/zone": pool.zone,
        "type": "kwok",
        "node-role.kubernetes.io/worker": "",
    }
    capacity = {"cpu": pool.cpu, "memory": pool.memory, "pods": pool.pods, "ephemeral-storage": "1Ti"}
    taints: list[dict[str, str]] = []
    if pool.gpu_product:
        labels |= {
            "node-role.kubernetes.io/gpu": "",
            "nvidia.com/gpu.present": "true",
            "nvidia.com/gpu.product": pool.gpu_product,
            "nvidia.com/gpu.count": str(pool.gpus),
            "nvidia.com/gpu.memory": str(pool.gpu_memory_mib),
        }
        capacity["nvidia.com/gpu"] = str(pool.gpus)
        taints.append(dict(GPU_TAINT))
    else:
        labels["node-role.kubernetes.io/cpu"] = ""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels, "annotations": {"kwok.x-k8s.io/node": "fake"}},
        "spec": {"taints": taints},
        "status": {"capacity": capacity, "allocatable": dict(capacity)},  # kwok fills in the rest
    }


def fleet_manifests(pools: Iterable[NodePool]) -> list[dict[str, Any]]:
    """Node manifests for every node of every pool."""
    return [node_manifest(pool, i) for pool in pools for i in range(pool.count)]


# ---------------------------------------------------------------------------------------------
# the control plane


def _port() -> int:
    return free_port()  # looked up when called, so that a test can hand out a port it holds


@dataclass
class Ports:
    """Loopback ports of every listening component."""

    etcd_client: int = field(default_factory=_port)
    etcd_peer: int = field(default_factory=_port)
    apiserver: int = field(default_factory=_port)
    controller_manager: int = field(default_factory=_port)
    scheduler: int = field(default_factory=_port)
    kwok: int = field(default_factory=_port)
    kuberay_metrics: int = field(default_factory=_port)
    kuberay_probe: int = field(default_factory=_port)

    def renew(self, *names: str) -> None:
        """New ports for the given fields."""
        for name in names:
            setattr(self, name, _port())


@dataclass
class Component:
    """How to start one component and see it healthy; `argv` and `health` read the ports when called."""

    name: str
    ports: tuple[str, ...]  # the fields of Ports it listens on
    argv: Callable[[], list[str]]
    health: Callable[[], str]
    context: ssl.SSLContext | None = None
    env: Mapping[str, str] | None = None
    before_start: Callable[[], None] | None = None  # e.g. write what depends on its ports


class KubectlClient:
    """kubectl against `self.kubeconfig`: a control plane of ours, or any cluster someone else made."""

    kubeconfig: Path

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this cluster; raises with stderr when check fails."""
        return run_kubectl(self.kubeconfig, *args, input=input, check=check, timeout=timeout)

    def get_json(self, *args: str) -> Any:
        """`kubectl get ... -o json` parsed."""
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)


class ControlPlane(KubectlClient):
    """etcd + kube-apiserver (+ controllers, scheduler, kwok, KubeRay with full=True) on loopback.

    Use as a context manager, or call start()/stop(). `kubeconfig` is an admin (system:masters)
    kubeconfig; kubectl() runs kubectl against it.
    """

    def __init__(
        self,
        *,
        full: bool = False,
        work_dir: Path | None = None,
        crd_dirs: Sequence[Path] = (),
        install_kuberay_crds: bool | None = None,
        keep: bool = False,
        detach: bool = False,
        allow_build: bool = True,
        timeout: float = 120.0,
        extra_apiserver_args: Sequence[str] = (),
        address: str = LOOPBACK,
        kuberay_args: Sequence[str] = (),
    ) -> None:
        self.full = full
        # Loopback unless real nodes need to reach the API server: then the address of their bridge, with the Node
        # authorizer and NodeRestriction a kubelet is meant to run under.
        self.address = address
        self.kuberay_args = list(kuberay_args)
        self.extra_apiserver_args = list(extra_apiserver_args)  # e.g. an audit log, for benchmarks
        self.crd_dirs = [Path(d) for d in crd_dirs]
        if install_kuberay_crds is None:  # default: when available; always for the operator, which needs them
            install_kuberay_crds = full or binaries.kuberay_crd_dir() is not None
        self.install_kuberay_crds = install_kuberay_crds
        self.keep = keep or work_dir is not None
        self.detach = detach
        self.allow_build = allow_build
        self.timeout = timeout
        self._own_dir = work_dir is None
        self.work_dir = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="hybridflow-cp-"))
        self.ports = Ports()
        self.processes: dict[str, Process] = {}
        self.pki: certs.PKI | None = None
        self.kubeconfig = self.work_dir / "kubeconfig"
        self.timings: dict[str, float] = {}
        self.fleet: list[str] = []
        self._t0 = time.monotonic()

    @property
    def server(self) -> str:
        return f"https://{self.address}:{self.ports.apiserver}"

    @property
    def real_nodes(self) -> bool:
        return self.address != LOOPBACK

    # -- lifecycle ------------------------------------------------------------------------------

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> ControlPlane:
        """Start every component and install CRDs; stops what started if anything fails."""
        t0 = self._t0 = time.monotonic()
        try:
            self.work_dir.mkdir(parents=True, exist_ok=True)
            bins = binaries.ensure(binaries.FULL if self.full else binaries.MINIMAL, self.allow_build)
            self.timings["binaries"] = time.monotonic() - t0
            self.pki = certs.generate(self.work_dir / "pki", extra_hosts=(self.address,))
            self._start_etcd(bins["etcd"])
            self._start_apiserver(bins["kube-apiserver"])
            self.timings["apiserver_ready"] = time.monotonic() - t0
            if self.full:
                self._start_controllers(bins)
            self.install_crds()
            self.timings["crds_installed"] = time.monotonic() - t0
            if self.full:
                self._start_kuberay(bins["kuberay"])
                self.timings["kuberay_ready"] = time.monotonic() - t0
                self.wait_for_service_account("default")
        except BaseException:
            self.stop()
            raise
        self.timings["total"] = time.monotonic() - t0
        return self

    def stop(self) -> None:
        """Terminate components in reverse start order, then remove the work dir unless kept."""
        for proc in reversed(list(self.processes.values())):
            proc.stop()
        self.processes.clear()
        if self._own_dir and not self.keep:
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def pids(self) -> dict[str, int]:
        return {name: p.pid for name, p in self.processes.items()}

    def state(self) -> dict[str, Any]:
        """What the CLI records so that a later `down` can stop this control plane."""
        return {
            "kubeconfig": str(self.kubeconfig),
            "server": self.server,
            "work_dir": str(self.work_dir),
            "full": self.full,
            "processes": [
                {"name": p.name, "pid": p.pid, "argv": p.argv, "log": str(p.log)} for p in self.processes.values()
            ],
        }

    @staticmethod
    def stop_from_state(state: Mapping[str, Any], remove_work_dir: bool = True) -> list[str]:
        """Stop the processes a detached `up` recorded; returns the names it stopped."""
        stopped = []
        for entry in reversed(state.get("processes", [])):
            proc = Process(entry["name"], int(entry["pid"]), list(entry["argv"]), Path(entry["log"]))
            if proc.running():
                proc.stop()
                stopped.append(proc.name)
        if remove_work_dir and state.get("work_dir"):
            shutil.rmtree(state["work_dir"], ignore_errors=True)
        return stopped

    # -- components -----------------------------------------------------------------------------

    def _log(self, name: str) -> Path:
        return self.work_dir / "logs" / f"{name}.log"

    def _spawn(self, component: Component) -> tuple[Process, int]:
        """Start a component; returns it and where its log stood before (a restart appends to the log)."""
        log = self._log(component.name)
        offset = log.stat().st_size if log.exists() else 0
        if component.before_start:
            component.before_start()
        proc = Process.start(component.name, component.argv(), log, component.env, self.detach)
        self.processes[component.name] = proc
        return proc, offset

    def _launch(self, *components: Component) -> None:
        """Start the components together, then wait for each to be healthy. One that could not bind a port
        (another process took it after free_port() picked it) is stopped and started again on new ports."""
        started = {c.name: self._spawn(c) for c in components}
        for c in components:
            for attempt in range(1, BIND_ATTEMPTS + 1):
                proc, offset = started[c.name]
                try:
                    wait_healthy(proc, c.health(), self.timeout, c.context, offset)
                    break
                except PortTakenError:
                    if attempt == BIND_ATTEMPTS:
                        raise
                    proc.stop()
                    self.ports.renew(*c.ports)
                    started[c.name] = self._spawn(c)

    def _start_etcd(self, etcd: Path) -> None:
        def client() -> str:
            return f"http://127.0.0.1:{self.ports.etcd_client}"

        def argv() -> list[str]:
            peer = f"http://127.0.0.1:{self.ports.etcd_peer}"
            return [
                str(etcd),
                "--name=default",
                f"--data-dir={self.work_dir / 'etcd'}",
                f"--listen-client-urls={client()}",
                f"--advertise-client-urls={client()}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=default={peer}",
                "--unsafe-no-fsync=true",  # throwaway data: fsync only slows tests down
                "--log-level=warn",
            ]

        def fresh() -> None:  # a data dir left by a start that could not bind records the old peer URL
            shutil.rmtree(self.work_dir / "etcd", ignore_errors=True)

        self._launch(Component("etcd", ("etcd_client", "etcd_peer"), argv, lambda: f"{client()}/health",
                               before_start=fresh))

    def _apiserver_args(self, apiserver: Path) -> list[str]:
        assert self.pki is not None
        pki = self.pki
        args = [
            str(apiserver),
            f"--etcd-servers=http://127.0.0.1:{self.ports.etcd_client}",
            f"--cert-dir={self.work_dir / 'apiserver-certs'}",
            f"--tls-cert-file={pki.serving.cert}",
            f"--tls-private-key-file={pki.serving.key}",
            f"--client-ca-file={pki.client_ca.cert}",
            f"--bind-address={self.address}",
            f"--advertise-address={self.address}",
            f"--secure-port={self.ports.apiserver}",
            f"--authorization-mode={'Node,RBAC' if self.real_nodes else 'RBAC'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--allow-privileged=true",
            f"--service-account-issuer={self.server}",
            f"--service-account-key-file={pki.service_account.cert}",
            f"--service-account-signing-key-file={pki.service_account.key}",
            "--profiling=false",
        ]
        if self.real_nodes:
            # Pods reach the API server through the `kubernetes` Service, whose endpoint is the bridge address;
            # logs and exec go from the API server to the kubelet with the admin identity.
            args += [
                "--enable-admission-plugins=NodeRestriction",
                f"--kubelet-client-certificate={pki.admin.cert}",
                f"--kubelet-client-key={pki.admin.key}",
                "--kubelet-preferred-address-types=InternalIP",
            ]
        else:
            # The only address is loopback, which Endpoints reject: keep the `kubernetes` Service
            # without endpoints instead of logging a failed sync every ten seconds.
            args.append("--endpoint-reconciler-type=none")
        if not self.full:
            # Without kube-controller-manager no `default` ServiceAccount ever appears, and the
            # ServiceAccount admission plugin would reject every Pod (envtest does the same).
            args.append("--disable-admission-plugins=ServiceAccount")
        return args + self.extra_apiserver_args

    def admin_tls_context(self) -> ssl.SSLContext:
        """TLS as the cluster admin (client certificate, the serving CA): for clients that speak HTTPS themselves."""
        assert self.pki is not None
        ctx = ssl.create_default_context(cafile=str(self.pki.serving_ca.cert))
        ctx.load_cert_chain(str(self.pki.admin.cert), str(self.pki.admin.key))
        return ctx

    def _start_apiserver(self, apiserver: Path) -> None:
        assert self.pki is not None
        pki = self.pki

        def admin_kubeconfig() -> None:  # it names the port
            write_kubeconfig(self.kubeconfig, self.server, pki.serving_ca.cert, pki.admin, "admin")

        self._launch(Component(
            "kube-apiserver", ("apiserver",), lambda: self._apiserver_args(apiserver), lambda: f"{self.server}/readyz",
            self.admin_tls_context(), before_start=admin_kubeconfig,
        ))

    def _component_kubeconfig(self, user: str) -> Path:
        """A kubeconfig whose client cert carries the user name the bootstrap RBAC roles expect."""
        assert self.pki is not None
        pair = certs.make_client_cert(self.pki.client_ca, self.pki.directory, user)
        path = self.work_dir / f"{user.split(':')[-1]}.kubeconfig"
        return write_kubeconfig(path, self.server, self.pki.serving_ca.cert, pair, user)

    def _start_controllers(self, bins: Mapping[str, Path]) -> None:
        """Start controller-manager, scheduler and kwok together, then wait for all three."""
        assert self.pki is not None
        kcm_config = self._component_kubeconfig("system:kube-controller-manager")
        sched_config = self._component_kubeconfig("system:kube-scheduler")
        # No --authentication/authorization-kubeconfig: delegated auth would wait for a front-proxy
        # CA this API server does not have; health endpoints are always allowed anyway.
        pki = self.pki
        insecure = insecure_context()
        kcm = Component(
            "kube-controller-manager",
            ("controller_manager",),
            lambda: [
                str(bins["kube-controller-manager"]),
                f"--kubeconfig={kcm_config}",
                f"--service-account-private-key-file={pki.service_account.key}",
                f"--root-ca-file={pki.serving_ca.cert}",
                f"--cluster-signing-cert-file={pki.client_ca.cert}",
                f"--cluster-signing-key-file={pki.client_ca.key}",
                "--controllers=*",
                "--use-service-account-credentials=true",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={self.ports.controller_manager}",
                f"--cert-dir={self.work_dir / 'kcm-certs'}",
                f"--flex-volume-plugin-dir={self.work_dir / 'flex-volumes'}",  # not /usr/libexec/kubernetes
                f"--service-cluster-ip-range={SERVICE_CIDR}",
            ],
            lambda: f"https://127.0.0.1:{self.ports.controller_manager}/healthz",
            insecure,
        )
        sched = Component(
            "kube-scheduler",
            ("scheduler",),
            lambda: [
                str(bins["kube-scheduler"]),
                f"--kubeconfig={sched_config}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={self.ports.scheduler}",
                f"--cert-dir={self.work_dir / 'scheduler-certs'}",
            ],
            lambda: f"https://127.0.0.1:{self.ports.scheduler}/healthz",
            insecure,
        )
        kwok = Component(
            "kwok",
            ("kwok",),
            lambda: [
                str(bins["kwok"]),
                f"--kubeconfig={self.kubeconfig}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={KWOK_NODE_SELECTOR}",
                f"--server-address=127.0.0.1:{self.ports.kwok}",
            ],
            lambda: f"http://127.0.0.1:{self.ports.kwok}/healthz",
            env={"KWOK_WORKDIR": str(self.work_dir / "kwok")},  # keep it away from ~/.kwok
        )
        self._launch(kcm, sched, kwok)
        self.timings["controllers_ready"] = time.monotonic() - self._t0

    def _start_kuberay(self, operator: Path) -> None:
        self._launch(Component(
            "kuberay-operator",
            ("kuberay_metrics", "kuberay_probe"),
            lambda: [
                str(operator),
                f"--kubeconfig={self.kubeconfig}",
                "--enable-leader-election=false",
                f"--metrics-addr=127.0.0.1:{self.ports.kuberay_metrics}",
                f"--health-probe-bind-address=127.0.0.1:{self.ports.kuberay_probe}",
                "--log-stdout-encoder=console",
                *self.kuberay_args,
            ],
            lambda: f"http://127.0.0.1:{self.ports.kuberay_probe}/readyz",
        ))

    # -- API helpers ----------------------------------------------------------------------------

    @property
    def env(self) -> dict[str, str]:
        """Environment for subprocesses that should talk to this control plane."""
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig)}

    def apply_objects(self, objects: Sequence[Mapping[str, Any]]) -> None:
        """Server-side apply of in-memory manifests (as one List)."""
        body = json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)})
        self.kubectl("apply", "--server-side", "--field-manager=hybridflow-e2e", "-f", "-", input=body)

    def crd_files(self) -> list[Path]:
        """KubeRay's CRDs (when wanted) plus every YAML file in the given CRD directories."""
        files: list[Path] = []
        if self.install_kuberay_crds:
            kuberay = binaries.kuberay_crd_dir()
            if kuberay is None:
                kuberay = binaries.ensure(("kuberay-crds",), self.allow_build)["kuberay-crds"]
            files += sorted(kuberay.glob("ray.io_*.yaml"))
        for directory in self.crd_dirs:
            files += sorted(p for p in directory.glob("*.y*ml") if p.suffix in (".yaml", ".yml"))
        return files

    def install_crds(self, files: Sequence[Path] | None = None) -> list[str]:
        """Server-side apply CRDs (KubeRay's are ~1 MB, too big for client-side apply); wait Established."""
        files = self.crd_files() if files is None else list(files)
        if not files:
            return []
        args = ["apply", "--server-side", "--force-conflicts", "--field-manager=hybridflow-e2e", "-o", "name"]
        for f in files:
            args += ["-f", str(f)]
        names = self.kubectl(*args, timeout=self.timeout).stdout.split()
        for attempt in range(1, 4):
            if not names:
                break
            wait = ["wait", "--for=condition=Established", f"--timeout={int(self.timeout)}s", *names]
            result = self.kubectl(*wait, check=False, timeout=self.timeout + 10)
            # `kubectl wait` fails at once, instead of waiting, on a CRD the API server has not yet given any
            # status conditions ("accessor error"): ask again.
            if result.returncode == 0:
                break
            if attempt == 3 or "accessor error" not in result.stderr:
                raise KubectlError(result.returncode, [kubectl_binary(), *wait], result.stdout, result.stderr)
            time.sleep(1)
        return names

    def wait_for_service_account(self, namespace: str, name: str = "default", timeout: float | None = None) -> None:
        """Pods are rejected until the controller-manager has created the namespace's ServiceAccount."""
        limit = timeout or self.timeout

        def exists() -> bool:
            return self.kubectl("get", "serviceaccount", name, "-n", namespace, check=False).returncode == 0

        kcm = self.processes.get("kube-controller-manager")
        wait_until(
            exists,
            limit,
            lambda: (
                kcm.failure(f"did not create serviceaccount {namespace}/{name} within {limit:.0f}s")
                if kcm
                else StartupError(f"serviceaccount {namespace}/{name} never appeared (no controller-manager runs)")
            ),
        )

    def create_namespace(self, name: str) -> None:
        """Create a namespace and, in full mode, wait until Pods may be created in it."""
        self.apply_objects([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}])
        if self.full:
            self.wait_for_service_account(name)

    def create_gpu_fleet(self, pools: Sequence[NodePool] | None = None, timeout: float | None = None) -> list[str]:
        """Create kwok-managed fake nodes (default_fleet() unless given) and wait until all are Ready."""
        if "kwok" not in self.processes:
            raise StartupError("create_gpu_fleet needs a full control plane (kwok is not running)")
        manifests = fleet_manifests(default_fleet() if pools is None else pools)
        # Plain create, not server-side apply: apply drops `status`, and the capacity lives there.
        body = json.dumps({"apiVersion": "v1", "kind": "List", "items": manifests})
        self.kubectl("create", "-f", "-", input=body)
        names = [m["metadata"]["name"] for m in manifests]
        limit = timeout or self.timeout
        self.kubectl(
            "wait",
            "--for=condition=Ready",
            f"--timeout={int(limit)}s",
            *(f"node/{n}" for n in names),
            timeout=limit + 10,
        )
        self.fleet += names
        return names
