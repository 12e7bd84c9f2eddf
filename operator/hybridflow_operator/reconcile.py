"""Level-based reconciliation of one RLTrainingJob: make its children match, compute and write its status.

Framework-free (the controller calls in here) and safe to repeat: names are deterministic, creation
is create-or-read, and a status write carries the resourceVersion it was computed from.
"""

from __future__ import annotations

import asyncio
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
from hybridflow_operator.status import compute_status

KIND = "RLTrainingJob"
CONFLICT_RETRIES = 5
RETRYABLE = {409, 422}  # resourceVersion conflict; a failed JSON-patch test (the list moved)
# KubeRay's way from a RayJob to running pods is long, and the pods need their ServiceAccount: these two
# are created first, in this order, and ahead of every other job's ConfigMap, Role and RoleBinding
# (needed only once a container runs).
LEADING_KINDS = ("ServiceAccount", "RayJob")


class ChildConflict(RenderError):
    """A child's name is taken by an object this job does not own."""

    def __init__(self, message: str, *, temporary: bool) -> None:
        super().__init__("metadata.name", "NameConflict", message)
        self.temporary = temporary


@dataclass
class Applied:
    """What one reconciliation changed (for Events), and the RayJob as it now stands."""

    created: list[str] = field(default_factory=list)
    patched: list[str] = field(default_factory=list)
    layout_ignored: bool = False
    rayjob: dict | None = None


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


async def ensure_children(kube: Kube, job: Mapping[str, Any], settings: OperatorSettings, *,
                          fresh: bool) -> Applied:
    """Create what is missing, patch what may change; RenderError/ChildConflict when it cannot.

    The ServiceAccount and then the RayJob go as urgent requests (LEADING_KINDS); the other three go
    to the API server at the same time, behind them. A `fresh` job (one the operator never wrote a
    status for) has none yet: each child is POSTed straight away and read only when it turns out to
    exist (409). Otherwise each is read first, which costs a GET instead of a refused POST for every
    child that is still there.
    """
    rendered = render(job, settings)
    applied = Applied()
    group = rendered.layout.rollout_group
    leading = [c for kind in LEADING_KINDS for c in rendered.children if c["kind"] == kind]

    async def lead() -> None:
        for desired in leading:
            await _ensure(kube, desired, job, group, applied, fresh=fresh, urgent=True)

    outcomes = await asyncio.gather(
        lead(),
        *(_ensure(kube, desired, job, group, applied, fresh=fresh)
          for desired in rendered.children if desired["kind"] not in LEADING_KINDS),
        return_exceptions=True,
    )
    errors = [e for e in outcomes if isinstance(e, BaseException)]
    if errors:  # the user's problem first: a name conflict says more than an API error
        raise next((e for e in errors if isinstance(e, RenderError)), errors[0])
    return applied


async def _ensure(kube: Kube, desired: dict, job: Mapping[str, Any], rollout_group: str | None,
                  applied: Applied, *, fresh: bool, urgent: bool = False) -> None:
    meta = desired["metadata"]
    kind = desired["kind"]
    ref = f"{kind}/{meta['name']}"
    existing = None if fresh else await kube.get(desired["apiVersion"], kind, meta["namespace"], meta["name"],
                                                 urgent=urgent)
    if existing is None:
        if kind == "RayJob" and _finished(job):
            return  # a finished job's RayJob may be gone (TTL, manual delete): never start it again
        created, existing = await _create(kube, desired, urgent)
        if created is not None:
            applied.created.append(ref)
            if kind == "RayJob":
                applied.rayjob = created
            return
    owner = _owner(job)
    problem = ownership_problem(existing, owner)
    if problem:
        raise ChildConflict(problem, temporary=stale_owner(existing, owner))
    if kind == "RayJob":
        updated = await _update_rayjob(kube, existing, desired, rollout_group)
        if updated is not None:
            applied.patched.append(ref)
        applied.rayjob = updated or existing
        applied.layout_ignored = _generation(existing) != _generation(desired) and layout_changed(existing, desired)
        return
    patch = merge_patch(existing, desired)
    if patch:
        await kube.patch(desired["apiVersion"], kind, meta["namespace"], meta["name"], patch)
        applied.patched.append(ref)


def status_patch(job: Mapping[str, Any], rayjob: Mapping[str, Any] | None, pods: list[Mapping[str, Any]],
                 problem: RenderError | None) -> dict:
    """The status the job should have now (see status.compute_status)."""
    return compute_status(job, rayjob, pods, now(), str(problem) if problem else None,
                          error_reason=problem.reason if problem else "InvalidSpec")


async def write_status(kube: Kube, job: Mapping[str, Any], patch: Mapping[str, Any]) -> dict:
    """Merge-patch the status, conditional on the resourceVersion it was computed from (409 otherwise).

    Returns the job as the API server now has it.
    """
    meta = job["metadata"]
    body = {"metadata": {"resourceVersion": meta["resourceVersion"]}, "status": patch}
    return await kube.patch(JOB_API_VERSION, KIND, meta["namespace"], meta["name"], body, status=True)


def foreign_rayjob(job: Mapping[str, Any], rayjob: Mapping[str, Any] | None) -> ChildConflict | None:
    """The RayJob under the job's child name belongs to someone else."""
    problem = rayjob is not None and ownership_problem(rayjob, _owner(job))
    if not problem:
        return None
    return ChildConflict(problem, temporary=stale_owner(rayjob, _owner(job)))


def job_name_of(child: Mapping[str, Any]) -> str | None:
    """The RLTrainingJob a RayJob or Ray pod belongs to: the controller reference, else the label."""
    meta = child.get("metadata", {})
    for ref in meta.get("ownerReferences") or []:
        if ref.get("controller") and ref.get("kind") == KIND:
            return ref.get("name")
    return (meta.get("labels") or {}).get(names.JOB_LABEL)


# -- helpers --------------------------------------------------------------------------------------------


async def _create(kube: Kube, desired: Mapping[str, Any], urgent: bool) -> tuple[dict | None, dict | None]:
    """(created, None); on AlreadyExists (a previous run or another reconcile got there first) (None, existing)."""
    try:
        return await kube.create(desired, urgent=urgent), None
    except ApiException as e:
        if e.status != 409:
            raise
    meta = desired["metadata"]
    existing = await kube.get(desired["apiVersion"], desired["kind"], meta["namespace"], meta["name"],
                              urgent=urgent)
    if existing is None:  # deleted again in between (garbage collection of a stale one): next time
        raise ApiException(status=409, reason=f"{desired['kind']} {meta['name']} is being replaced")
    return None, existing


async def _update_rayjob(kube: Kube, existing: dict, desired: Mapping[str, Any],
                         rollout_group: str | None) -> dict | None:
    """Patch the allowed fields once per spec generation, so Kueue's or a user's later flips stand.

    The patched RayJob, or None when there was nothing to do.
    """
    meta = desired["metadata"]
    for _ in range(CONFLICT_RETRIES):
        if _generation(existing) == _generation(desired):
            return None
        ops = rayjob_patch(existing, desired, rollout_group)
        if not ops:
            return None
        try:
            return await kube.patch("ray.io/v1", "RayJob", meta["namespace"], meta["name"], ops, json_patch=True)
        except ApiException as e:
            if e.status not in RETRYABLE:
                raise
        existing = await kube.get("ray.io/v1", "RayJob", meta["namespace"], meta["name"]) or existing
    raise ApiException(status=409, reason=f"RayJob {meta['name']} kept changing under the operator")


def _generation(obj: Mapping[str, Any]) -> str | None:
    return (obj.get("metadata", {}).get("annotations") or {}).get(names.GENERATION_ANNOTATION)


def _finished(job: Mapping[str, Any]) -> bool:
    conditions = (job.get("status") or {}).get("conditions") or []
    return any(c.get("type") in ("Succeeded", "Failed") and c.get("status") == "True" for c in conditions)


def _owner(job: Mapping[str, Any]) -> dict | None:
    meta = job["metadata"]
    return owner_reference(meta["name"], meta.get("uid"))
