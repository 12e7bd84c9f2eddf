"""Find the control-plane binaries, building them through e2e/toolchain/build.sh when missing.

Lookup order per binary: TEST_ASSET_<NAME> (the envtest convention, e.g. TEST_ASSET_KUBE_APISERVER),
then $KUBEBUILDER_ASSETS/<binary>, then the version-keyed cache that build.sh fills.
"""

from __future__ import annotations

import fcntl
import functools
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

TOOLCHAIN_DIR = Path(__file__).resolve().parents[1] / "toolchain"
BUILD_SCRIPT = TOOLCHAIN_DIR / "build.sh"
BUILD_TIMEOUT_S = 3 * 3600  # a cold build of everything on 2 cores takes well under an hour


COMPONENTS_TABLE = TOOLCHAIN_DIR / "components.tsv"


@dataclass(frozen=True)
class Component:
    """One buildable component (a row of e2e/toolchain/components.tsv, which build.sh reads too)."""

    name: str
    wrapper: str  # directory under e2e/toolchain whose go.mod pins the version
    module: str  # the module whose version that is
    package: str  # what `go build` builds
    binary: str | None  # None: not a binary (kuberay-crds: KubeRay's CRD YAML from its module)
    cache_name: str  # directory stem in the cache, before -<version>
    group: str  # control, node (a real kubelet node) or crds


def _read_components() -> dict[str, Component]:
    rows = [line.split("\t") for line in COMPONENTS_TABLE.read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    return {name: Component(name, wrapper, module, package, None if binary == "-" else binary, cache, group)
            for name, wrapper, module, package, binary, cache, group in rows}


COMPONENTS: dict[str, Component] = _read_components()
MINIMAL = ("etcd", "kube-apiserver")
FULL = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kwok",
    "kuberay",
    "kuberay-crds",
)
NODE = tuple(name for name, c in COMPONENTS.items() if c.group == "node")  # a real kubelet node


class MissingBinariesError(RuntimeError):
    """Raised when binaries are absent and cannot (or may not) be built."""


def cache_dir() -> Path:
    """Root of the build cache, shared by build.sh and the harness."""
    return Path(os.environ.get("HYBRIDFLOW_CACHE") or Path.home() / ".cache" / "hybridflow")


@functools.cache
def version(component: str) -> str:
    """The version the component's wrapper go.mod pins, as build.sh reads it (`build.sh --version`)."""
    result = subprocess.run(["bash", str(BUILD_SCRIPT), "--version", component], capture_output=True, text=True,
                            check=False)
    if result.returncode != 0 or not result.stdout.strip():
        raise MissingBinariesError(result.stderr.strip() or f"{BUILD_SCRIPT} --version {component} printed nothing")
    return result.stdout.strip()


def cached_dir(component: str) -> Path:
    """Where build.sh puts a component: keyed by version so upgrades never mix."""
    c = COMPONENTS[component]
    return cache_dir() / "bin" / f"{c.cache_name}-{version(component)}"


def _env_override(binary: str) -> Path | None:
    explicit = os.environ.get("TEST_ASSET_" + binary.upper().replace("-", "_"))
    if explicit:
        return Path(explicit)
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    if assets and (Path(assets) / binary).is_file():
        return Path(assets) / binary
    return None


def find(component: str) -> Path | None:
    """The binary to run for a component, or None when neither the env nor the cache has it.

    A build running meanwhile (build.sh holds its lock while it builds) is waited for first, so a
    binary it is about to produce is not reported missing."""
    wait_for_running_build()
    binary = COMPONENTS[component].binary
    if binary is None:
        return kuberay_crd_dir()
    path = _env_override(binary) or cached_dir(component) / binary
    return path if path.is_file() and os.access(path, os.X_OK) else None


def kuberay_crd_dir() -> Path | None:
    """KubeRay's CRDs, copied from its Go module by build.sh (or HYBRIDFLOW_KUBERAY_CRDS)."""
    explicit = os.environ.get("HYBRIDFLOW_KUBERAY_CRDS")
    path = Path(explicit) if explicit else cached_dir("kuberay-crds") / "crds"
    return path if (path / "ray.io_rayjobs.yaml").is_file() else None


def go_available() -> bool:
    """Whether build.sh can run here at all."""
    return shutil.which("go") is not None or Path("/usr/local/go/bin/go").is_file()


def missing(components: tuple[str, ...]) -> list[str]:
    """Components that cannot be found."""
    return [c for c in components if find(c) is None]


def build(components: tuple[str, ...] | list[str] = (), timeout: float = BUILD_TIMEOUT_S) -> None:
    """Run build.sh, streaming its progress to stderr; raises when the build fails."""
    if not go_available():
        raise MissingBinariesError("cannot build control-plane binaries: Go is not installed")
    cmd = ["bash", str(BUILD_SCRIPT), *components]
    result = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, timeout=timeout, check=False)
    if result.returncode != 0:
        raise MissingBinariesError(f"{' '.join(cmd)} failed with exit code {result.returncode}")


def _lock_path() -> Path:
    """build.sh's lock: held for the whole of a build."""
    return cache_dir() / "bin" / ".build.lock"


def build_running() -> bool:
    """Whether another process builds now (holds build.sh's lock), without waiting for it."""
    lock = _lock_path()
    if not lock.exists():
        return False
    with lock.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
    return False


def wait_for_running_build() -> None:
    """Block while another process builds (take build.sh's lock, then let it go at once)."""
    lock = _lock_path()
    if not lock.exists():
        return
    with lock.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        fcntl.flock(handle, fcntl.LOCK_UN)


@dataclass
class BackgroundBuild:
    """build.sh running beside the tests, at the lowest CPU priority, its output in a log file: Ray runs its
    workers at nice 15, and a build any higher (it shares the tests' session, so niceness weighs directly) takes
    the cores from the tests that need no binaries instead of filling the time they leave idle.

    The lock is taken here before the child starts and handed to it (HYBRIDFLOW_BUILD_LOCK_FD tells
    build.sh it holds it already), so a lookup made right after `start` already waits for the build."""

    components: tuple[str, ...]
    log_path: Path
    script: Path = BUILD_SCRIPT
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    finished: float | None = None
    _log: IO[bytes] | None = field(default=None, repr=False)

    def start(self, niceness: int = 19) -> BackgroundBuild:
        if not go_available():
            raise MissingBinariesError("cannot build control-plane binaries: Go is not installed")
        _lock_path().parent.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("wb")
        with _lock_path().open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.started = time.monotonic()
            # build.sh inherits the locked descriptor and so holds the lock until it exits
            self.process = subprocess.Popen(
                ["nice", "-n", str(niceness), "bash", str(self.script), *self.components], stdout=self._log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, pass_fds=(lock.fileno(),),
                env={**os.environ, "HYBRIDFLOW_BUILD_LOCK_FD": str(lock.fileno())},
            )
        # this process's descriptor is closed: the lock stays with the child until it exits
        return self

    def wait(self, timeout: float = BUILD_TIMEOUT_S) -> None:
        """Until the build ends; raises with the log's tail when it failed."""
        if self.process is None or (self.finished is not None and self.process.returncode == 0):
            return
        try:
            code = self.process.wait(timeout=max(1.0, timeout - (time.monotonic() - self.started)))
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        if self.finished is None:
            self.finished = time.monotonic()
            if self._log is not None:
                self._log.close()
        if code != 0:
            tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-20:])
            raise MissingBinariesError(f"{self.script.name} {' '.join(self.components)} failed with exit code {code} "
                                       f"(log: {self.log_path}):\n{tail}")

    @property
    def seconds(self) -> float:
        return (self.finished or time.monotonic()) - self.started


def ensure(components: tuple[str, ...], allow_build: bool = True) -> dict[str, Path]:
    """Paths of the given components' binaries, building the missing ones if allowed."""
    absent = missing(components)
    if absent and allow_build:
        build(absent)
        absent = missing(components)
    if absent:
        raise MissingBinariesError(
            f"missing control-plane binaries: {', '.join(absent)} "
            f"(run {BUILD_SCRIPT} with Go installed, or set KUBEBUILDER_ASSETS)"
        )
    found = {c: find(c) for c in components}
    return {c: path for c, path in found.items() if path is not None}
