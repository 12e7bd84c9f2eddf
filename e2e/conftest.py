"""Fixtures that give tests a real Kubernetes control plane.

`control_plane`: etcd + kube-apiserver with KubeRay's CRDs and ours (crds/) installed, and no
controllers at all (as envtest): tests may play the controllers' part themselves.
`full_cluster`: a separate control plane with controller-manager, scheduler, kwok fake GPU nodes
and the KubeRay operator. Both are session-scoped and started on first use.
`operator` / `running`: our operator as a subprocess against `control_plane`, once per test module
(a module's OPERATOR_ENV adds to its environment); `crd`: our CRD installed there.

Missing binaries are built with e2e/toolchain/build.sh when Go is installed: right after
collection, in the background at a lower CPU priority, while the tests that need no binaries run
first; the first test that needs them waits for the build before its timeout starts. A build
already running at collection (.ci/run starts one while the venv installs) is waited for the same
way, and what it left out is built then. Without Go
the tests skip with instructions, except under CI=true, where they must run: there a missing Go
or a failed build fails those tests.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python -m e2e.harness` and the tests import the same package
    sys.path.insert(0, str(ROOT))

from e2e.harness import binaries  # noqa: E402
from e2e.harness.controlplane import ControlPlane, StartupError  # noqa: E402
from e2e.harness.operator import OperatorProcess  # noqa: E402
from tests.helpers import in_ci  # noqa: E402

CRDS_DIR = ROOT / "crds"
CRD_NAME = "rltrainingjobs.hybridflow.io"
CLUSTER_FIXTURES = {"control_plane", "full_cluster", "kuberay_crds", "namespace", "minimal_binaries", "full_binaries"}
FULL_FIXTURES = {"full_cluster", "full_binaries"}
HOW_TO_ENABLE = (
    "install Go >= 1.24 (the binaries are then built once into {cache}, 25-45 min on 2 cores, "
    "or run e2e/toolchain/build.sh), or set KUBEBUILDER_ASSETS to a directory holding etcd and "
    "kube-apiserver"
)


@dataclass
class Plan:
    """What this session can run: its binaries wanted after collection, their verdicts on first use."""

    wanted: tuple[str, ...] = ()
    full_wanted: bool = False
    full: bool = False
    build: binaries.BackgroundBuild | None = None
    build_elsewhere: bool = False  # another process was building at collection
    settled: bool = False
    skip_reason: str | None = None  # set when even the minimal control plane is unavailable
    full_skip_reason: str | None = None
    kuberay_crds_skip_reason: str | None = None
    build_error: str | None = None


PLAN = pytest.StashKey[Plan]()
NODE_MARKERS = {"realnodes", "realnodes_full"}
BINARY_MARKERS = {"controlplane"} | NODE_MARKERS
BINARY_FIXTURES = CLUSTER_FIXTURES | {"helm"}  # tests/test_chart.py renders with the pinned helm


def _may_build() -> bool:
    return binaries.go_available() and os.environ.get("HYBRIDFLOW_E2E_BUILD", "1") != "0"


def needs_binaries(item: pytest.Item) -> bool:
    return bool(set(getattr(item, "fixturenames", ())) & BINARY_FIXTURES
                or {m.name for m in item.iter_markers()} & BINARY_MARKERS)


def wanted_components(items: list[pytest.Item]) -> tuple[str, ...]:
    """The binaries the selected tests run, in the order they are first needed."""
    fixtures = set().union(*(getattr(item, "fixturenames", ()) for item in items))
    markers = {m.name for item in items for m in item.iter_markers()}
    wanted: list[str] = []
    if (fixtures & CLUSTER_FIXTURES) or (markers & BINARY_MARKERS):
        wanted += [*binaries.MINIMAL, "kubectl", "kuberay-crds"]  # kubectl: a client of the server's version
    if (fixtures & FULL_FIXTURES) or (markers & NODE_MARKERS):
        wanted += [*binaries.FULL, "helm"]  # the cluster tests install the chart
    if "helm" in fixtures:
        wanted.append("helm")
    if markers & NODE_MARKERS:
        wanted += binaries.NODE
    return tuple(dict.fromkeys(wanted))


def binaries_last(items: list[pytest.Item]) -> list[pytest.Item]:
    """Modules whose tests run built binaries go last (whole modules, so module fixtures stay whole): the
    rest run while a cold machine still builds."""
    late_modules = {getattr(item, "module", None) for item in items if needs_binaries(item)}
    early = [item for item in items if getattr(item, "module", None) not in late_modules]
    return early + [item for item in items if getattr(item, "module", None) in late_modules]


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Start building what the selected tests need in the background, and run those tests last."""
    wanted = wanted_components(items)
    plan = Plan(wanted=wanted, full_wanted=all(c in wanted for c in binaries.FULL))
    config.stash[PLAN] = plan
    if not plan.wanted:
        return
    items[:] = binaries_last(items)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if binaries.build_running():
        # .ci/run starts the build before the venv installs: the first test that needs a binary waits for it
        plan.build_elsewhere = True
        message = "a control-plane build started before this session is running; the tests that need it go last"
    else:
        message = _start_build(plan)
    if reporter is not None and message:
        reporter.write_line(message)


def _start_build(plan: Plan) -> str | None:
    """Build the wanted binaries that are missing, in the background; what to tell the user, if anything."""
    absent = binaries.missing(plan.wanted)  # waits for a build another process is running
    if not absent or not (_may_build() or in_ci()):
        return None
    log = binaries.cache_dir() / "bin" / "logs" / f"build-{time.strftime('%Y%m%d-%H%M%S')}.log"
    try:
        plan.build = binaries.BackgroundBuild(tuple(absent), log).start()
    except (binaries.MissingBinariesError, OSError) as exc:
        plan.build_error = f"building the control plane failed: {exc}"
        return None
    return f"building {', '.join(absent)} in the background (log: {log}); the tests that run them go last"


def _unavailable(components: tuple[str, ...]) -> str | None:
    """Why components are missing, or None; missing after a build that had to work is an error."""
    absent = binaries.missing(components)
    if not absent:
        return None
    if _may_build() or in_ci():
        raise BuildFailed(f"control-plane binaries missing after the build: {', '.join(absent)}")
    return f"control-plane binaries missing ({', '.join(absent)}): " + HOW_TO_ENABLE.format(
        cache=binaries.cache_dir() / "bin")


class BuildFailed(Exception):
    """A build that had to succeed (Go present, or CI=true) did not."""


def _settle(plan: Plan) -> None:
    """Wait for the background build once, then decide what can run."""
    plan.settled = True
    if plan.build_elsewhere:  # once it ends, build here whatever it left out (a failed build is retried, logged)
        _start_build(plan)
    try:
        if plan.build is not None:
            plan.build.wait()
        if plan.full_wanted:
            plan.full_skip_reason = _unavailable(binaries.FULL)
            plan.full = plan.full_skip_reason is None
        plan.skip_reason = _unavailable(binaries.MINIMAL)
        if not (binaries.find("kubectl") or shutil.which("kubectl")):
            plan.skip_reason = plan.skip_reason or "kubectl not found: put it on PATH or in KUBEBUILDER_ASSETS"
        plan.kuberay_crds_skip_reason = _unavailable(("kuberay-crds",))
    except (BuildFailed, binaries.MissingBinariesError) as exc:
        plan.build_error = f"building the control plane failed: {exc}"


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """Wait for the background build before the test's own timeout starts (pytest-timeout's timer runs
    inside this wrapper)."""
    plan = item.config.stash.get(PLAN, None)
    if plan is not None and not plan.settled and needs_binaries(item):
        _settle(plan)
    yield


def _plan(request: pytest.FixtureRequest) -> Plan:
    plan = request.config.stash.get(PLAN, None) or Plan()
    if not plan.settled and not plan.build_error:
        _settle(plan)
    if plan.build_error:
        pytest.fail(plan.build_error, pytrace=False)
    if plan.skip_reason:
        pytest.skip(plan.skip_reason)
    return plan


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """How long the background build took, per component (the lines build.sh logged)."""
    plan = terminalreporter.config.stash.get(PLAN, None)
    if plan is None or plan.build is None or plan.build.finished is None:
        return
    terminalreporter.write_line(f"control-plane build: {plan.build.seconds:.0f}s in the background")
    for line in plan.build.log_path.read_text(errors="replace").splitlines():
        if ": built in " in line or "ready in" in line:
            terminalreporter.write_line(f"  {line}")


def _start(full: bool, tmp_path_factory: pytest.TempPathFactory) -> ControlPlane:
    """Start a control plane (a component whose port was taken meanwhile moves to another: the harness)."""
    stem = "full-cluster" if full else "control-plane"
    work_dir = tmp_path_factory.mktemp(stem)  # pytest keeps the last few runs: logs stay readable
    cp = ControlPlane(full=full, work_dir=work_dir, crd_dirs=[CRDS_DIR] if CRDS_DIR.is_dir() else [],
                      allow_build=False)
    try:
        return cp.start()
    except (StartupError, binaries.MissingBinariesError) as exc:
        pytest.fail(f"{stem} did not start: {exc}", pytrace=False)


@pytest.fixture
def minimal_binaries(request: pytest.FixtureRequest) -> None:
    """For tests that start a control plane of their own: etcd, kube-apiserver and kubectl are there."""
    _plan(request)


@pytest.fixture
def full_binaries(request: pytest.FixtureRequest) -> None:
    """For tests that start a full control plane of their own: every binary it runs is there."""
    if not _plan(request).full:
        pytest.skip(_plan(request).full_skip_reason or "the full control plane is unavailable")


@pytest.fixture(scope="session")
def control_plane(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """etcd + kube-apiserver with CRDs installed, nothing else; `.kubeconfig`, `.kubectl(...)`, `.env`."""
    _plan(request)
    cp = _start(False, tmp_path_factory)
    try:
        yield cp
    finally:
        cp.stop()


@pytest.fixture(scope="session")
def full_cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """Everything, plus the default fake fleet (4x A100, 2x H100, 2 CPU nodes), all Ready."""
    plan = _plan(request)
    if not plan.full:
        pytest.skip(plan.full_skip_reason or "the full control plane is unavailable")
    cp = _start(True, tmp_path_factory)
    try:
        try:
            cp.create_gpu_fleet()
        except Exception as exc:
            pytest.fail(f"fake GPU fleet did not come up: {exc}", pytrace=False)
        yield cp
    finally:
        cp.stop()


@pytest.fixture
def kuberay_crds(request: pytest.FixtureRequest, control_plane: ControlPlane) -> ControlPlane:
    """The control plane, for tests that need KubeRay's CRDs (skips only where they are unavailable)."""
    if not control_plane.install_kuberay_crds:
        pytest.skip(_plan(request).kuberay_crds_skip_reason or "KubeRay's CRDs are not installed")
    return control_plane


@pytest.fixture
def namespace(request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace in the cluster the test uses (full_cluster if it asks for it, else
    control_plane); in a full cluster Pods may be created in it right away."""
    fixture = "full_cluster" if "full_cluster" in request.fixturenames else "control_plane"
    cp: ControlPlane = request.getfixturevalue(fixture)
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    cp.create_namespace(name)
    yield name
    cp.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def crd(control_plane: ControlPlane) -> str:
    """Our CRD, from crds/ (installed by the fixture) or generated now; skip only if neither exists."""
    if control_plane.kubectl("get", "crd", CRD_NAME, check=False).returncode == 0:
        return control_plane.kubectl("get", "crd", CRD_NAME, "-o", "yaml").stdout
    generated = subprocess.run(
        [sys.executable, "-m", "hybridflow.api.crd", "--stdout"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
        timeout=120,
    )
    if generated.returncode != 0:
        pytest.skip(f"no CRD in crds/ and `python -m hybridflow.api.crd --stdout` failed: {generated.stderr[-500:]}")
    control_plane.kubectl("apply", "--server-side", "-f", "-", input=generated.stdout)
    control_plane.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{CRD_NAME}")
    return generated.stdout


@pytest.fixture(scope="module")
def operator(
    request: pytest.FixtureRequest, control_plane: ControlPlane, crd: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    """The operator against `control_plane`, one per test module, with the module's OPERATOR_ENV on top."""
    # These tests play KubeRay's part; a KubeRay operator in the same control plane would race them.
    assert "kuberay-operator" not in control_plane.processes, "control_plane must run no KubeRay operator"
    env = {**control_plane.env, "HYBRIDFLOW_STATUS_INTERVAL": "600", "HYBRIDFLOW_LOG_LEVEL": "INFO",
           "PYTHONUNBUFFERED": "1", **getattr(request.module, "OPERATOR_ENV", {})}
    op = OperatorProcess(tmp_path_factory.mktemp("operator") / "operator.log", env)
    op.start()
    try:
        yield op
    finally:
        op.stop()


@pytest.fixture
def running(operator: OperatorProcess) -> Iterator[OperatorProcess]:
    """The operator, checked alive before and after the test (a crash is a failure, with its log)."""
    if not operator.alive():
        operator.start()
    yield operator
    assert operator.alive(), f"the operator died:\n{operator.tail()}"
