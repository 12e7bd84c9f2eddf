"""kopf wiring: which events reconcile which job. I/O only; the decisions live in reconcile/render/status.

A job is reconciled on create, on resume (operator restart) and on spec updates; its status follows
its RayJob and Ray pods through watches; a long-interval timer is only a safety net. Errors the
user must fix stop the handler (kopf.PermanentError) after Stalled=True and a Warning Event, so a
bad job causes neither a retry storm nor a crash loop.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any

import kopf

from hybridflow.api import API_GROUP, API_VERSION, PLURAL
from hybridflow_operator import kube, names, reconcile
from hybridflow_operator.errors import RenderError
from hybridflow_operator.reconcile import ChildConflict, StatusWrite
from hybridflow_operator.settings import from_env

SETTINGS = from_env(os.environ)
JOBS = (API_GROUP, API_VERSION, PLURAL)
RETRY_DELAY_S = 10.0
STALE_CHILD_DELAY_S = 30.0
_client: kube.Kube | None = None


def client() -> kube.Kube:
    global _client
    if _client is None:
        kube.load_config()
        _client = kube.Kube()
    return _client


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = names.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=API_GROUP, key="last-handled-configuration")
    settings.posting.level = SETTINGS.event_level_number
    settings.execution.max_workers = SETTINGS.workers
    # Only our children reach the operator: the API server filters the watch streams.
    settings.watching.label_selectors["ray.io", "rayjobs"] = names.JOB_LABEL
    settings.watching.label_selectors["v1", "pods"] = names.JOB_LABEL
    client()


@kopf.on.probe(id="kubernetes")
def api_reachable(**_: Any) -> bool:
    """Liveness: the operator can still talk to the API server."""
    return bool(client().version())


@kopf.on.resume(*JOBS)
@kopf.on.create(*JOBS)
@kopf.on.update(*JOBS, field="spec")
def reconcile_job(body: kopf.Body, name: str, namespace: str, **_: Any) -> None:
    """Make the children match the spec, then write the status."""
    _reconcile(body, name, namespace)


@kopf.timer(*JOBS, interval=SETTINGS.status_interval, initial_delay=SETTINGS.status_interval)
def resync(body: kopf.Body, name: str, namespace: str, logger: logging.Logger, **_: Any) -> None:
    """Safety net for missed watch events: recreate lost children, recompute the status."""
    try:
        _reconcile(body, name, namespace)
    except kopf.PermanentError as e:
        logger.debug("resync of %s/%s stopped: %s", namespace, name, e)


@kopf.on.event("ray.io", "v1", "rayjobs", labels={names.JOB_LABEL: kopf.PRESENT})
def rayjob_changed(body: kopf.Body, namespace: str, type: str | None, logger: logging.Logger, **_: Any) -> None:
    """KubeRay moved the RayJob on: mirror it into the owner's status; a lost RayJob is recreated."""
    name = reconcile.job_name_of(body)
    if not name:
        return
    job = client().get(kube.JOB_API_VERSION, "RLTrainingJob", namespace, name) if type == "DELETED" else None
    if job is None or job["metadata"].get("deletionTimestamp"):
        _write(namespace, name)
        return
    try:
        _reconcile(job, name, namespace)
    except (kopf.PermanentError, kopf.TemporaryError) as e:
        logger.warning("recreating the RayJob of %s/%s failed: %s", namespace, name, e)


@kopf.on.event("v1", "pods", labels={names.JOB_LABEL: kopf.PRESENT})
def pod_changed(body: kopf.Body, namespace: str, **_: Any) -> None:
    """A Ray pod was scheduled or could not be: surface it in the owner's status."""
    _follow(body, namespace)


# -- helpers ----------------------------------------------------------------------------------------------


def _reconcile(body: Mapping[str, Any], name: str, namespace: str) -> None:
    try:
        applied = reconcile.ensure_children(client(), body, SETTINGS)
    except ChildConflict as e:
        _write(namespace, name, e)
        if e.temporary:
            raise kopf.TemporaryError(str(e), delay=STALE_CHILD_DELAY_S) from None
        raise kopf.PermanentError(str(e)) from None
    except RenderError as e:
        _write(namespace, name, e)
        raise kopf.PermanentError(str(e)) from None
    except kube.ApiException as e:
        if e.status == 422:  # the API server refused a child we rendered: retrying cannot help
            _write(namespace, name, RenderError("spec", "ChildRejected", _api_message(e)))
            raise kopf.PermanentError(_api_message(e)) from None
        raise kopf.TemporaryError(f"API error {e.status}: {_api_message(e)}", delay=RETRY_DELAY_S) from None
    for ref in applied.created:
        kopf.info(body, reason="Created", message=f"created {ref}")
    for ref in applied.patched:
        kopf.info(body, reason="Updated", message=f"updated {ref}")
    if applied.layout_ignored:
        kopf.warn(body, reason="LayoutChangeIgnored",
                  message="the Ray cluster layout changed but a RayJob keeps the layout it was created with; "
                          "only suspend, TTL, deadline and the rollout group's replicas apply to a running job")
    _write(namespace, name)


def _follow(child: kopf.Body, namespace: str) -> None:
    name = reconcile.job_name_of(child)
    if name:
        _write(namespace, name)


def _write(namespace: str, name: str, error: RenderError | None = None) -> StatusWrite | None:
    try:
        written = reconcile.sync_status(client(), namespace, name, SETTINGS, error)
    except kube.ApiException as e:
        raise kopf.TemporaryError(f"status of {namespace}/{name}: {_api_message(e)}", delay=RETRY_DELAY_S) from None
    if written is not None:
        for kind, reason, message in written.transitions():
            post = kopf.warn if kind == "Warning" else kopf.info
            post(_ref(written.job), reason=reason, message=message)
    return written


def _ref(job: Mapping[str, Any]) -> dict:
    """Just enough of the job for kopf to address an Event to it."""
    meta = job["metadata"]
    return {"apiVersion": job["apiVersion"], "kind": job["kind"],
            "metadata": {"name": meta["name"], "namespace": meta["namespace"], "uid": meta["uid"]}}


def _api_message(e: kube.ApiException) -> str:
    try:
        return json.loads(e.body or "{}").get("message") or str(e.reason)
    except ValueError:
        return str(e.reason)
