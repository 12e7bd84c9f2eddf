"""A real Kubernetes control plane for tests, run from binaries built by e2e/toolchain/build.sh."""

from .binaries import MissingBinariesError, cache_dir, ensure, find, go_available, version
from .controlplane import A100, H100, ControlPlane, NodePool, StartupError, default_fleet

__all__ = [
    "A100",
    "H100",
    "ControlPlane",
    "MissingBinariesError",
    "NodePool",
    "StartupError",
    "cache_dir",
    "default_fleet",
    "ensure",
    "find",
    "go_available",
    "version",
]
