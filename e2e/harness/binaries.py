"""Find the control-plane binaries, building them through e2e/toolchain/build.sh when missing.

Lookup order per binary: TEST_ASSET_<NAME> (the envtest convention, e.g. TEST_ASSET_KUBE_APISERVER),
then $KUBEBUILDER_ASSETS/<binary>, then the version-keyed cache that build.sh fills.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

TOOLCHAIN_DIR = Path(__file__).resolve().parents[1] / "toolchain"
BUILD_SCRIPT = TOOLCHAIN_DIR / "build.sh"
BUILD_TIMEOUT_S = 3 * 3600  # a cold build of everything on 2 cores takes well under an hour


KUBERAY_MODULE = "github.com/ray-project/kuberay/ray-operator"


@dataclass(frozen=True)
class Component:
    """One buildable component: where its version is pinned and what it yields."""

    name: str
    wrapper: str  # directory under e2e/toolchain holding the pinning go.mod
    module: str
    binary: str | None  # None: not a binary (kuberay-crds: KubeRay's CRD YAML from its module)
    cache_name: str = ""  # directory stem in the cache when it differs from `name`


COMPONENTS: dict[str, Component] = {
    c.name: c
    for c in (
        Component("etcd", "etcd", "go.etcd.io/etcd/server/v3", "etcd"),
        Component("kube-apiserver", "kubernetes", "k8s.io/kubernetes", "kube-apiserver"),
        Component("kube-controller-manager", "kubernetes", "k8s.io/kubernetes", "kube-controller-manager"),
        Component("kube-scheduler", "kubernetes", "k8s.io/kubernetes", "kube-scheduler"),
        Component("kwok", "kwok", "sigs.k8s.io/kwok", "kwok"),
        Component("kuberay", "kuberay", KUBERAY_MODULE, "ray-operator"),
        Component("kuberay-crds", "kuberay", KUBERAY_MODULE, None, cache_name="kuberay"),
        Component("helm", "helm", "helm.sh/helm/v3", "helm"),
        Component("kubectl", "kubernetes", "k8s.io/kubernetes", "kubectl"),
        Component("kubelet", "kubernetes", "k8s.io/kubernetes", "kubelet"),
        Component("kube-proxy", "kubernetes", "k8s.io/kubernetes", "kube-proxy"),
        Component("coredns", "coredns", "github.com/coredns/coredns", "coredns"),
    )
}
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


class MissingBinariesError(RuntimeError):
    """Raised when binaries are absent and cannot (or may not) be built."""


def cache_dir() -> Path:
    """Root of the build cache, shared by build.sh and the harness."""
    return Path(os.environ.get("HYBRIDFLOW_CACHE") or Path.home() / ".cache" / "hybridflow")


def version(component: str) -> str:
    """The version the component's wrapper go.mod pins (the single source of truth)."""
    c = COMPONENTS[component]
    text = (TOOLCHAIN_DIR / c.wrapper / "go.mod").read_text()
    match = re.search(rf"^\s*(?:require\s+)?{re.escape(c.module)}\s+(v\S+)", text, re.MULTILINE)
    if not match:
        raise MissingBinariesError(f"{c.wrapper}/go.mod does not require {c.module}")
    return match.group(1)


def cached_dir(component: str) -> Path:
    """Where build.sh puts a component: keyed by version so upgrades never mix."""
    c = COMPONENTS[component]
    return cache_dir() / "bin" / f"{c.cache_name or c.name}-{version(component)}"


def _env_override(binary: str) -> Path | None:
    explicit = os.environ.get("TEST_ASSET_" + binary.upper().replace("-", "_"))
    if explicit:
        return Path(explicit)
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    if assets and (Path(assets) / binary).is_file():
        return Path(assets) / binary
    return None


def find(component: str) -> Path | None:
    """The binary to run for a component, or None when neither the env nor the cache has it."""
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
