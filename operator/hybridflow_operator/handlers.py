"""kopf wiring: watch events go to the controller, which does the work on kopf's event loop.

kopf watches the RLTrainingJobs; its handler is a coroutine that only records what it saw and queues
the job, so no handler ever waits for a thread or an API call, and kopf keeps no per-object state: no
finalizer, no progress or diff-base annotations. The children the status is computed from (our
RayJobs, and Ray pods not yet bound to a node: only those can be unschedulable) come from lean
informers on the same loop (informer.py), filtered by the API server to our label.
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
from hybridflow_operator.informer import Informer, Source, collection_path
from hybridflow_operator.kube import Kube, load_configuration
from hybridflow_operator.settings import from_env
from hybridflow_operator.stateless import NoDiffBase, NoProgress

SETTINGS = from_env(os.environ)
JOBS = (API_GROUP, API_VERSION, PLURAL)
_controller: Controller | None = None
_tasks: list[asyncio.Task[None]] = []


def controller() -> Controller:
    assert _controller is not None, "the startup handler creates the controller"
    return _controller


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    global _controller
    settings.posting.level = SETTINGS.event_level_number
    settings.posting.loggers = False  # Events are the ones the controller posts, not kopf's log lines
    settings.persistence.diffbase_storage = NoDiffBase()
    settings.persistence.progress_storage = NoProgress()
    _controller = ctl = Controller(Kube(load_configuration(), SETTINGS.max_requests), SETTINGS, post_event)
    loop = asyncio.get_running_loop()
    _tasks.append(loop.create_task(ctl.resync_forever(), name="resync"))
    for namespace in SETTINGS.watch_namespaces or (None,):
        where = namespace or "all namespaces"
        rayjobs = Source(collection_path("ray.io/v1", "rayjobs", namespace), "RayJob", names.JOB_LABEL)
        # Only a pod not yet bound to a node can be unschedulable; once bound it arrives as DELETED.
        pods = Source(collection_path("v1", "pods", namespace), "Pod", names.JOB_LABEL, "spec.nodeName=")
        for source, on_event, what in ((rayjobs, ctl.rayjob_event, "RayJobs"),
                                       (pods, ctl.pod_event, "unbound Ray pods")):
            informer = Informer(ctl.kube, source, on_event, name=f"{what} in {where}")
            ctl.follows(informer.synced)
            _tasks.append(loop.create_task(informer.run(), name=informer.name))


def post_event(ref: Mapping[str, Any], event_type: str, reason: str, message: str) -> None:
    """Through kopf's Event poster, which drops Normal events below the configured level."""
    post = kopf.warn if event_type == "Warning" else kopf.info
    post(dict(ref), reason=reason, message=message)


@kopf.on.cleanup()
async def shutdown(**_: Any) -> None:
    for task in _tasks:
        task.cancel()
    _tasks.clear()
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
