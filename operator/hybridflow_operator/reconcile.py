"""Level-based reconciliation of one RLTrainingJob: make its children match, then write its status.

Framework-free (the kopf handlers call in here), synchronous, and safe to repeat: names are
deterministic, creation is get-or-create, and a status write carries the resourceVersion it was
computed from.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from hybridflow_operator import names
from hybridflow_operator.errors import RenderError
from hybridflow_operator.kube import JOB_API_VERSION, ApiException, Kube
from hybridflow_operator.patches import (
    layout_changed,
    merge_patch,
    ownership_problem,
    rayjob_patch,
    stale_owner,
)
from hybridflow_operator.render import owner_reference, render
from hybridflow_operator.settings import OperatorSettings
from hybridflow_operator.status import TERMINAL, compute_status, status_changed
from hybridflow_operator.status import transitions as status_transitions

KIND = "RLTrainingJob"
CONFLICT_RETRIES = 5
RETRYABLE = {409, 422}  # resourceVersion conflict; a failed JSON-patch test (the list moved)


class ChildConflict(RenderError):
    """A child's name is taken by an object this job does not own."""

    def __init__(self, message: str, *, temporary: bool) -> None:
        super().__init__("metadata.name", "NameConflict", message)
        self.temporary = temporary


@dataclass
class Applied:
    """What one reconciliation changed, for Events."""

    created: list[str] = field(default_factory=list)
    patched: list[str] = field(default_factory=list)
    layout_ignored: bool = False


@dataclass(frozen=True)
class StatusWrite:
    before: Mapping[str, Any]
    after: Mapping[str, Any]
    job: Mapping[str, Any]

    def transitions(self) -> list[tuple[str, str, str]]:
        return status_transitions(self.before, self.after)


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def ensure_children(kube: Kube, job: Mapping[str, Any], settings: OperatorSettings) -> Applied:
    """Create what is missing, patch what may change; RenderError/ChildConflict when it cannot."""
    rendered = render(job, settings)
    owner = _owner(job)
    finished = _finished(job)
    applied = Applied()
    for desired in rendered.children:
        meta = desired["metadata"]
        ref = f"{desired['kind']}/{meta['name']}"
        existing = kube.get(desired["apiVersion"], desired["kind"], meta["namespace"], meta["name"])
        if existing is None:
            if desired["kind"] == "RayJob" and finished:
                continue  # a finished job's RayJob may be gone (TTL, manual delete): never start it again
            existing = _create(kube, desired)
            if existing is None:
                applied.created.append(ref)
                continue
        problem = ownership_problem(existing, owner)
        if problem:
            raise ChildConflict(problem, temporary=stale_owner(existing, owner))
        if desired["kind"] == "RayJob":
            if _update_rayjob(kube, existing, desired, rendered.layout.rollout_group):
                applied.patched.append(ref)
            applied.layout_ignored = _generation(existing) != _generation(desired) and layout_changed(existing, desired)
        else:
            patch = merge_patch(existing, desired)
            if patch:
                kube.patch(desired["apiVersion"], desired["kind"], meta["namespace"], meta["name"], patch)
                applied.patched.append(ref)
    return applied


def sync_status(kube: Kube, namespace: str, name: str, settings: OperatorSettings,
                error: RenderError | None = None) -> StatusWrite | None:
    """Recompute the job's status from its RayJob and pods and write it if it changed.

    Serialised per job (handlers run in threads) and retried on conflicts, so the last writer
    always computed from the latest state. Without `error`, the spec is rendered again to find out
    whether it is (still) unrenderable. None when the job is gone or being deleted.
    """
    with _lock_for(namespace, name):
        for _ in range(CONFLICT_RETRIES):
            job = kube.get(JOB_API_VERSION, KIND, namespace, name)
            if job is None or job["metadata"].get("deletionTimestamp"):
                return None
            problem = error or _render_problem(job, settings)
            rayjob = kube.get("ray.io/v1", "RayJob", namespace, names.rayjob_name(name))
            foreign = rayjob is not None and ownership_problem(rayjob, _owner(job))
            if foreign:
                problem = problem or ChildConflict(foreign, temporary=stale_owner(rayjob, _owner(job)))
                rayjob = None
            pods = _pods(kube, namespace, name, rayjob)
            before = job.get("status") or {}
            patch = compute_status(job, rayjob, pods, now(), str(problem) if problem else None,
                                   error_reason=problem.reason if problem else "InvalidSpec")
            if not status_changed(before, patch):
                return StatusWrite(before, before, job)
            body = {"metadata": {"resourceVersion": job["metadata"]["resourceVersion"]}, "status": patch}
            try:
                kube.patch(JOB_API_VERSION, KIND, namespace, name, body, status=True)
            except ApiException as e:
                if e.status == 409:
                    continue
                raise
            after = {k: v for k, v in {**before, **patch}.items() if v is not None}
            return StatusWrite(before, after, job)
    raise ApiException(status=409, reason=f"status of {namespace}/{name} kept changing under the operator")


def job_name_of(child: Mapping[str, Any]) -> str | None:
    """The RLTrainingJob a RayJob or Ray pod belongs to: the controller reference, else the label."""
    meta = child.get("metadata", {})
    for ref in meta.get("ownerReferences") or []:
        if ref.get("controller") and ref.get("kind") == KIND:
            return ref.get("name")
    return (meta.get("labels") or {}).get(names.JOB_LABEL)


# -- helpers --------------------------------------------------------------------------------------------


def _create(kube: Kube, desired: Mapping[str, Any]) -> dict | None:
    """Create; on AlreadyExists (another reconcile got there first) return the existing object."""
    try:
        kube.create(desired)
        return None
    except ApiException as e:
        if e.status != 409:
            raise
    meta = desired["metadata"]
    return kube.get(desired["apiVersion"], desired["kind"], meta["namespace"], meta["name"])


def _update_rayjob(kube: Kube, existing: dict, desired: Mapping[str, Any], rollout_group: str | None) -> bool:
    """Patch the allowed fields once per spec generation, so Kueue's or a user's later flips stand."""
    meta = desired["metadata"]
    for _ in range(CONFLICT_RETRIES):
        if _generation(existing) == _generation(desired):
            return False
        ops = rayjob_patch(existing, desired, rollout_group)
        if not ops:
            return False
        try:
            kube.patch("ray.io/v1", "RayJob", meta["namespace"], meta["name"], ops, json_patch=True)
            return True
        except ApiException as e:
            if e.status not in RETRYABLE:
                raise
        existing = kube.get("ray.io/v1", "RayJob", meta["namespace"], meta["name"]) or existing
    raise ApiException(status=409, reason=f"RayJob {meta['name']} kept changing under the operator")


def _generation(obj: Mapping[str, Any]) -> str | None:
    return (obj.get("metadata", {}).get("annotations") or {}).get(names.GENERATION_ANNOTATION)


def _finished(job: Mapping[str, Any]) -> bool:
    conditions = (job.get("status") or {}).get("conditions") or []
    return any(c.get("type") in ("Succeeded", "Failed") and c.get("status") == "True" for c in conditions)


def _render_problem(job: Mapping[str, Any], settings: OperatorSettings) -> RenderError | None:
    try:
        render(job, settings)
    except RenderError as e:
        return e
    return None


def _owner(job: Mapping[str, Any]) -> dict | None:
    meta = job["metadata"]
    return owner_reference(meta["name"], meta.get("uid"))


def _pods(kube: Kube, namespace: str, name: str, rayjob: Mapping[str, Any] | None) -> list[dict]:
    """The job's Ray pods, read only while they can explain a wait (not for a finished RayJob)."""
    deployment = ((rayjob or {}).get("status") or {}).get("jobDeploymentStatus") or ""
    if rayjob is None or deployment in TERMINAL:
        return []
    return kube.list("v1", "Pod", namespace, f"{names.JOB_LABEL}={name}")


_locks: dict[tuple[str, str], threading.Lock] = {}
_locks_guard = threading.Lock()


def _lock_for(namespace: str, name: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault((namespace, name), threading.Lock())
