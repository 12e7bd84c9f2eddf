"""Operator settings: environment variables first, command-line flags on top.

Everything a cluster admin may need to change without a new image lives here, so the Helm chart
only sets environment variables (the GPU product map included). What rendering needs is the
runtime's `RenderSettings`, read from the same variables by `hybridflow render`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from hybridflow.k8s.settings import ENV_PREFIX, RenderSettings, SettingsError, positive_number

__all__ = ["OperatorSettings", "SettingsError", "from_env", "parse_namespaces"]


@dataclass(frozen=True)
class OperatorSettings:
    """What the operator needs to know about its cluster; immutable once running."""

    watch_namespaces: tuple[str, ...] = ()
    """Namespaces to watch; empty means cluster-wide."""
    log_level: str = "INFO"
    render: RenderSettings = field(default_factory=RenderSettings)
    """GPU products and the default runtime image, as `hybridflow render` reads them too."""
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
    """Ray clusters starting at once beyond which status writes slow down (see Reconciler.status_write_rate)."""
    max_requests: int = 32
    """API requests in flight at once; more wait for a slot instead of crowding the API server, each job's
    ServiceAccount and RayJob ahead of the rest."""
    metrics_port: int = 8081
    """Port of the Prometheus `/metrics` endpoint; 0 serves none."""

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


def _port(name: str, value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        raise SettingsError(f"{name} must be a port number, got {value!r}") from None
    if not 0 <= port <= 65535:
        raise SettingsError(f"{name} must be a port number (0 for none), got {value!r}")
    return port


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
    values["render"] = RenderSettings.from_env(environ)
    if env.get("STATUS_INTERVAL"):
        values["status_interval"] = positive_number(f"{ENV_PREFIX}STATUS_INTERVAL", env["STATUS_INTERVAL"])
    if env.get("STATUS_MIN_INTERVAL"):
        values["status_min_interval"] = positive_number(f"{ENV_PREFIX}STATUS_MIN_INTERVAL",
                                                        env["STATUS_MIN_INTERVAL"])
    if env.get("STATUS_WRITES_PER_S"):
        values["status_writes_per_s"] = positive_number(f"{ENV_PREFIX}STATUS_WRITES_PER_S",
                                                        env["STATUS_WRITES_PER_S"])
    if env.get("SPIN_UP_JOBS"):
        values["spin_up_jobs"] = max(1, int(positive_number(f"{ENV_PREFIX}SPIN_UP_JOBS", env["SPIN_UP_JOBS"])))
    if env.get("MAX_REQUESTS"):
        values["max_requests"] = max(1, int(positive_number(f"{ENV_PREFIX}MAX_REQUESTS", env["MAX_REQUESTS"])))
    if env.get("METRICS_PORT"):
        values["metrics_port"] = _port(f"{ENV_PREFIX}METRICS_PORT", env["METRICS_PORT"])
    values.update({k: v for k, v in overrides.items() if v is not None})
    settings = OperatorSettings(**values)  # type: ignore[arg-type]
    for level in (settings.log_level, settings.event_level):
        _level(level)  # refuse to start on a typo rather than log at an unexpected level
    return settings
