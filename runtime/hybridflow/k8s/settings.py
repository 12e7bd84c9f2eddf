"""What rendering needs to know about the cluster: its GPU products, the default runtime image, whether (and
from where) the Ray pods of each job accept traffic under a NetworkPolicy, and how often a running job patches
its status.progress.

The operator reads these from its environment (the Helm chart sets them); `hybridflow render` reads
the same variables, so both print the same manifests.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import yaml

from hybridflow._version import __version__
from hybridflow.k8s.contract import DEFAULT_PROGRESS_INTERVAL, ENV_PROGRESS_INTERVAL

ENV_PREFIX = "HYBRIDFLOW_"
ENV_GPU_PRODUCTS = f"{ENV_PREFIX}GPU_PRODUCTS"
ENV_RUNTIME_IMAGE = f"{ENV_PREFIX}RUNTIME_IMAGE"
ENV_NETWORK_POLICY_PEERS = f"{ENV_PREFIX}NETWORK_POLICY_PEERS"
PEER_FIELDS = ("podSelector", "namespaceSelector", "ipBlock")
DEFAULT_RUNTIME_IMAGE = f"docker.io/hybridflow/runtime:{__version__}"

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


class SettingsError(ValueError):
    """A malformed environment variable or flag: refuse to start rather than guess."""


@dataclass(frozen=True)
class RenderSettings:
    """The cluster facts a rendering depends on; immutable."""

    gpu_products: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: DEFAULT_GPU_PRODUCTS)
    runtime_image: str = DEFAULT_RUNTIME_IMAGE
    """Image for Ray pods when spec.cluster.image is empty."""
    network_policy_peers: tuple[Mapping[str, Any], ...] | None = None
    """None: no NetworkPolicy. Otherwise each job gets one: its Ray pods accept traffic only from the job's
    own pods (and KubeRay's submitter pod of the job) and from these NetworkPolicyPeers (the operator,
    KubeRay's operator, ...), set by the chart through HYBRIDFLOW_NETWORK_POLICY_PEERS."""
    progress_interval: float = DEFAULT_PROGRESS_INTERVAL
    """Seconds between two status.progress patches of a running job, set in its Ray pods under the same
    variable: about one API write per running job per interval."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RenderSettings:
        """From HYBRIDFLOW_GPU_PRODUCTS, HYBRIDFLOW_RUNTIME_IMAGE, HYBRIDFLOW_NETWORK_POLICY_PEERS and
        HYBRIDFLOW_PROGRESS_INTERVAL (the process environment by default)."""
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        if env.get(ENV_GPU_PRODUCTS, "").strip():
            values["gpu_products"] = parse_gpu_products(env[ENV_GPU_PRODUCTS])
        if env.get(ENV_RUNTIME_IMAGE):
            values["runtime_image"] = env[ENV_RUNTIME_IMAGE]
        if env.get(ENV_NETWORK_POLICY_PEERS, "").strip():
            values["network_policy_peers"] = parse_network_policy_peers(env[ENV_NETWORK_POLICY_PEERS])
        values["progress_interval"] = progress_interval_from_env(env)
        return cls(**values)  # type: ignore[arg-type]


def progress_interval_from_env(environ: Mapping[str, str]) -> float:
    """HYBRIDFLOW_PROGRESS_INTERVAL: the operator reads it from its own environment and sets it in every Ray pod,
    where the runtime reads it again."""
    value = environ.get(ENV_PROGRESS_INTERVAL, "").strip()
    return positive_number(ENV_PROGRESS_INTERVAL, value) if value else DEFAULT_PROGRESS_INTERVAL


def positive_number(name: str, value: str) -> float:
    """A setting that must be a finite number above 0 (seconds, a rate, a count); `name` is its variable."""
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not (number > 0 and math.isfinite(number)):
        raise SettingsError(f"{name} must be a positive number, got {value!r}")
    return number


def parse_gpu_products(value: str) -> dict[str, tuple[str, ...]]:
    """A JSON or YAML mapping gpuType -> product name (or list of them)."""
    try:
        doc = yaml.safe_load(value)
    except yaml.YAMLError as e:
        raise SettingsError(f"{ENV_GPU_PRODUCTS} is not valid JSON/YAML: {e}") from None
    if not isinstance(doc, dict) or not doc:
        raise SettingsError(f"{ENV_GPU_PRODUCTS} must be a non-empty mapping of gpuType to product names")
    out: dict[str, tuple[str, ...]] = {}
    for gpu_type, products in doc.items():
        names = [products] if isinstance(products, str) else products
        if not isinstance(names, list) or not names or not all(isinstance(p, str) and p for p in names):
            raise SettingsError(f"{ENV_GPU_PRODUCTS}[{gpu_type}] must be a product name or a non-empty list of them")
        out[str(gpu_type)] = tuple(names)
    return out


def parse_network_policy_peers(value: str) -> tuple[Mapping[str, Any], ...]:
    """A JSON or YAML list of NetworkPolicyPeers (podSelector, namespaceSelector, ipBlock); [] admits only the
    job's own pods."""
    try:
        doc = yaml.safe_load(value)
    except yaml.YAMLError as e:
        raise SettingsError(f"{ENV_NETWORK_POLICY_PEERS} is not valid JSON/YAML: {e}") from None
    if not isinstance(doc, list):
        raise SettingsError(f"{ENV_NETWORK_POLICY_PEERS} must be a list of NetworkPolicyPeers")
    for i, peer in enumerate(doc):
        if not isinstance(peer, dict) or not peer or not set(peer) <= set(PEER_FIELDS):
            raise SettingsError(f"{ENV_NETWORK_POLICY_PEERS}[{i}] must be a NetworkPolicyPeer: a mapping of "
                                f"{', '.join(PEER_FIELDS)}, got {peer!r}")
    return tuple(dict(peer) for peer in doc)
