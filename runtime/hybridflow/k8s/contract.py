"""What the rendered pods and the runtime inside them must agree on: paths, environment variables,
the entrypoint, the Ray resource that pins work to a pool, and the timestamp format of the status."""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import UTC, datetime

CONFIG_DIR = "/etc/hybridflow"
CONFIG_FILE = "job.json"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_FILE}"
"""The job as the runtime reads it, mounted from the job's ConfigMap (JSON: see render._config_map)."""

ENV_JOB_NAME = "HYBRIDFLOW_JOB_NAME"
ENV_JOB_NAMESPACE = "HYBRIDFLOW_JOB_NAMESPACE"
"""Set in every Ray pod: the runtime patches this job's status.progress."""
ENV_CONFIG = "HYBRIDFLOW_CONFIG"
"""Set in every Ray pod: `hybridflow train` reads its job from here when --config is not given."""
ENV_PROGRESS_INTERVAL = "HYBRIDFLOW_PROGRESS_INTERVAL"
"""Set in every Ray pod from the operator's own (settings.RenderSettings): seconds between two status.progress
patches."""
DEFAULT_PROGRESS_INTERVAL = 5.0

DASHBOARD_PORT = 8266
DASHBOARD_PORT_NAME = "hf-dashboard"
"""The head container's port where `hybridflow train` serves the live scheduler dashboard. KubeRay's head
Services expose every port the head container names; status.schedulerDashboardUrl points at it."""

ENTRYPOINT = f"python -m hybridflow train --config {CONFIG_PATH}"

POOL_RESOURCE_PREFIX = "pool_"
TIMESTAMP_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def job_from_env(env: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """(namespace, name) of the job whose pod this process runs in, or None outside a cluster."""
    env = os.environ if env is None else env
    name = env.get(ENV_JOB_NAME)
    return (env.get(ENV_JOB_NAMESPACE) or "default", name) if name else None


def pool_resource(pool: str) -> str:
    """The Ray custom resource a worker group's nodes advertise, so the runtime can pin bundles to a pool."""
    return f"{POOL_RESOURCE_PREFIX}{pool}"


def timestamp(now: datetime | None = None) -> str:
    """RFC 3339 in UTC, to the second, as Kubernetes writes times."""
    return (now or datetime.now(UTC)).strftime(TIMESTAMP_FORMAT)
