"""kopf wiring: watch events go to the controller, which does the work on kopf's event loop.

Every handler is a coroutine that only records what it saw and queues the job, so no handler ever
waits for a thread or an API call, and kopf keeps no per-object state: no finalizer, no progress
annotations. The API server filters the RayJob and pod watches to our children, and the pods to
the Pending ones.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from typing import Any

import kopf

from hybridflow.api import API_GROUP, API_VERSION, PLURAL
from hybridflow_operator import names
from hybridflow_operator.controller import Controller
from hybridflow_operator.kube import Kube, load_configuration
from hybridflow_operator.settings import from_env

SETTINGS = from_env(os.environ)
JOBS = (API_GROUP, API_VERSION, PLURAL)
_controller: Controller | None = None
_resync: asyncio.Task[None] | None = None


def controller() -> Controller:
    assert _controller is not None, "the startup handler creates the controller"
    return _controller


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    global _controller, _resync
    settings.posting.level = SETTINGS.event_level_number
    settings.posting.loggers = False  # Events are the ones the controller posts, not kopf's log lines
    settings.watching.label_selectors["ray.io", "rayjobs"] = names.JOB_LABEL
    settings.watching.label_selectors["v1", "pods"] = names.JOB_LABEL
    # Only a Pending pod can explain a wait; one that leaves Pending arrives as DELETED.
    settings.watching.field_selectors["v1", "pods"] = "status.phase=Pending"
    _controller = Controller(Kube(load_configuration(), SETTINGS.max_requests), SETTINGS, post_event)
    _resync = asyncio.get_running_loop().create_task(_controller.resync_forever(), name="resync")


def post_event(ref: Mapping[str, Any], event_type: str, reason: str, message: str) -> None:
    """Through kopf's Event poster, which drops Normal events below the configured level."""
    post = kopf.warn if event_type == "Warning" else kopf.info
    post(dict(ref), reason=reason, message=message)


@kopf.on.cleanup()
async def shutdown(**_: Any) -> None:
    if _resync is not None:
        _resync.cancel()
    if _controller is not None:
        _controller.queue.close()
        await _controller.kube.close()


@kopf.on.probe(id="kubernetes")
async def api_reachable(**_: Any) -> bool:
    """Liveness: the operator can still talk to the API server."""
    return bool(await controller().kube.version())


@kopf.on.event(*JOBS)
async def job_changed(body: kopf.Body, type: str | None, **_: Any) -> None:
    controller().job_event(body, type)


@kopf.on.event("ray.io", "v1", "rayjobs", labels={names.JOB_LABEL: kopf.PRESENT})
async def rayjob_changed(body: kopf.Body, type: str | None, **_: Any) -> None:
    """KubeRay moved the RayJob on (or it was deleted, and is recreated)."""
    controller().rayjob_event(body, type)


@kopf.on.event("v1", "pods", labels={names.JOB_LABEL: kopf.PRESENT})
async def pod_changed(body: kopf.Body, type: str | None, **_: Any) -> None:
    """A Pending Ray pod was scheduled or could not be: surfaced in the owner's status."""
    controller().pod_event(body, type)
