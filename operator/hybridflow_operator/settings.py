"""Operator settings: environment variables first, command-line flags on top.

Everything a cluster admin may need to change without a new image lives here, so the Helm chart
only sets environment variables (the GPU product map included).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import yaml

DEFAULT_RUNTIME_IMAGE = "docker.io/hybridflow/runtime:0.1.0"

# nvidia.com/gpu.product values (as GPU feature discovery writes them) for each spec.cluster.gpuType.
DEFAULT_GPU_PRODUCTS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "A100-80GB": ("NVIDIA-A100-SXM4-80GB", "NVIDIA-A100-80GB-PCIe"),
    "A100-40GB": ("NVIDIA-A100-SXM4-40GB", "NVIDIA-A100-PCIE-40GB"),
    "H100-80GB": ("NVIDIA-H100-80GB-HBM3", "NVIDIA-H100-PCIe"),
    "H100-94GB": ("NVIDIA-H100-NVL",),
    "H200-141GB": ("NVIDIA-H200", "NVIDIA-H200-NVL"),
    "B200-180GB": ("NVIDIA-B200",),
    "L40S": ("NVIDIA-L40S",),
    "L4": ("NVIDIA-L4",),
    "A10G": ("NVIDIA-A10G",),
})

ENV_PREFIX = "HYBRIDFLOW_"


class SettingsError(ValueError):
    """A malformed environment variable or flag: the operator refuses to start rather than guess."""


@dataclass(frozen=True)
class OperatorSettings:
    """What the operator needs to know about its cluster; immutable once running."""

    watch_namespaces: tuple[str, ...] = ()
    """Namespaces to watch; empty means cluster-wide."""
    log_level: str = "INFO"
    gpu_products: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: DEFAULT_GPU_PRODUCTS)
    runtime_image: str = DEFAULT_RUNTIME_IMAGE
    """Image for Ray pods when spec.cluster.image is empty."""
    status_interval: float = 300.0
    """Seconds between safety-net resyncs; status normally follows watch events."""
    event_level: str = "INFO"
    """Lowest level of the Kubernetes Events the operator posts (INFO posts Normal events too)."""
    status_min_interval: float = 1.0
    """Seconds between two runs for one job: a burst of pod events becomes one status write."""
    status_writes_per_s: float = 10.0
    """Status writes of all jobs together, per second: at scale they wait, and merge, rather than crowd
    the API server KubeRay and the scheduler need."""
    spin_up_jobs: int = 10
    """Ray clusters starting at once beyond which status writes slow down (see Controller.status_write_rate)."""
    max_requests: int = 32
    """API requests in flight at once; more wait for a slot instead of crowding the API server, each job's
    ServiceAccount and RayJob ahead of the rest."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> OperatorSettings:
        """Settings from the process environment (or `environ`); see the module-level from_env."""
        return from_env(os.environ if environ is None else environ, **overrides)

    @property
    def clusterwide(self) -> bool:
        return not self.watch_namespaces

    @property
    def log_level_number(self) -> int:
        return _level(self.log_level)

    @property
    def event_level_number(self) -> int:
        return _level(self.event_level)


def _level(name: str) -> int:
    level = logging.getLevelName(name.upper())
    if not isinstance(level, int):
        raise SettingsError(f"unknown log level {name!r} (use DEBUG, INFO, WARNING or ERROR)")
    return level


def parse_namespaces(value: str) -> tuple[str, ...]:
    """`a, b,,c` -> ('a', 'b', 'c'); blank means cluster-wide."""
    return tuple(dict.fromkeys(ns.strip() for ns in value.split(",") if ns.strip()))


def parse_gpu_products(value: str) -> dict[str, tuple[str, ...]]:
    """A JSON or YAML mapping gpuType -> product name (or list of them)."""
    try:
        doc = yaml.safe_load(value)
    except yaml.YAMLError as e:
        raise SettingsError(f"{ENV_PREFIX}GPU_PRODUCTS is not valid JSON/YAML: {e}") from None
    if not isinstance(doc, dict) or not doc:
        raise SettingsError(f"{ENV_PREFIX}GPU_PRODUCTS must be a non-empty mapping of gpuType to product names")
    out: dict[str, tuple[str, ...]] = {}
    for gpu_type, products in doc.items():
        names = [products] if isinstance(products, str) else products
        if not isinstance(names, list) or not names or not all(isinstance(p, str) and p for p in names):
            raise SettingsError(
                f"{ENV_PREFIX}GPU_PRODUCTS[{gpu_type}] must be a product name or a non-empty list of them"
            )
        out[str(gpu_type)] = tuple(names)
    return out


def _positive_float(name: str, value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise SettingsError(f"{name} must be a number of seconds, got {value!r}") from None
    if number <= 0:
        raise SettingsError(f"{name} must be positive, got {value!r}")
    return number


def from_env(environ: Mapping[str, str], **overrides: object) -> OperatorSettings:
    """Settings from HYBRIDFLOW_* variables; keyword overrides (from flags) win when not None."""
    values: dict[str, object] = {}
    env = {k.removeprefix(ENV_PREFIX): v for k, v in environ.items() if k.startswith(ENV_PREFIX)}
    if "WATCH_NAMESPACES" in env:
        values["watch_namespaces"] = parse_namespaces(env["WATCH_NAMESPACES"])
    if env.get("LOG_LEVEL"):
        values["log_level"] = env["LOG_LEVEL"].upper()
    if env.get("EVENT_LEVEL"):
        values["event_level"] = env["EVENT_LEVEL"].upper()
    if env.get("GPU_PRODUCTS", "").strip():
        values["gpu_products"] = parse_gpu_products(env["GPU_PRODUCTS"])
    if env.get("RUNTIME_IMAGE"):
        values["runtime_image"] = env["RUNTIME_IMAGE"]
    if env.get("STATUS_INTERVAL"):
        values["status_interval"] = _positive_float(f"{ENV_PREFIX}STATUS_INTERVAL", env["STATUS_INTERVAL"])
    if env.get("STATUS_MIN_INTERVAL"):
        values["status_min_interval"] = _positive_float(f"{ENV_PREFIX}STATUS_MIN_INTERVAL",
                                                        env["STATUS_MIN_INTERVAL"])
    if env.get("STATUS_WRITES_PER_S"):
        values["status_writes_per_s"] = _positive_float(f"{ENV_PREFIX}STATUS_WRITES_PER_S",
                                                        env["STATUS_WRITES_PER_S"])
    if env.get("SPIN_UP_JOBS"):
        values["spin_up_jobs"] = max(1, int(_positive_float(f"{ENV_PREFIX}SPIN_UP_JOBS", env["SPIN_UP_JOBS"])))
    if env.get("MAX_REQUESTS"):
        values["max_requests"] = max(1, int(_positive_float(f"{ENV_PREFIX}MAX_REQUESTS", env["MAX_REQUESTS"])))
    values.update({k: v for k, v in overrides.items() if v is not None})
    settings = OperatorSettings(**values)  # type: ignore[arg-type]
    for level in (settings.log_level, settings.event_level):
        _level(level)  # refuse to start on a typo rather than log at an unexpected level
    return settings
