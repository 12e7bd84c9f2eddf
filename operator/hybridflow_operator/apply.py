"""Level-based application of one RLTrainingJob: make its children match its spec, write its status.

Framework-free (the reconciler calls in here) and safe to repeat: names are deterministic, creation
is create-or-read, and a status write carries the resourceVersion it was computed from.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridflow.api import KIND
from hybridflow.k8s import contract, names
from hybridflow.k8s.errors import RenderError
from hybridflow.k8s.patches import (
    label_patch,
    layout_changed,
    merge_patch,
    ownership_problem,
    rayjob_patch,
    restore_patch,
    stale_owner,
)
from hybridflow.k8s.render import render
from hybridflow.k8s.settings import RenderSettings
from hybridflow_operator.machinery.client import ApiException, Kube, namespace_terminating
from hybridflow_operator.observed import JobView
from hybridflow_operator.status import compute_status

CONFLICT_RETRIES = 5
RETRYABLE = {409, 422}  # resourceVersion conflict; a failed JSON-patch test (the list moved)
# KubeRay's way from a RayJob to running pods is long, and the pods need their ServiceAccount: these are
# created first, in this order, and ahead of every other job's ConfigMap, Role and RoleBinding (needed only
# once a container runs). The NetworkPolicy (when the operator renders one) comes before the RayJob, so no
# Ray pod ever runs unprotected.
LEADING_KINDS = ("ServiceAccount", "NetworkPolicy", "RayJob")


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


async def ensure_children(kube: Kube, job: JobView, settings: RenderSettings, *, fresh: bool) -> Applied:
    """Create what is missing, patch what may change; RenderError/ChildConflict when it cannot.

    The ServiceAccount, the NetworkPolicy and then the RayJob go as urgent requests (LEADING_KINDS); the rest go
    to the API server at the same time, behind them. A `fresh` job (one the operator never wrote a
    status for) has none yet: each child is POSTed straight away and read only when it turns out to
    exist (409). Otherwise each is read first, which costs a GET instead of a refused POST for every
    child that is still there.
    """
    rendered = render(job.body, settings)
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
    if errors:  # the user's problem first: a name conflict says more than an API error; then a namespace
        # being deleted, which ends the job whatever else went wrong
        raise next((e for e in errors if isinstance(e, RenderError)),
                   next((e for e in errors if namespace_terminating(e)), errors[0]))
    return applied


async def _ensure(kube: Kube, desired: dict, job: JobView, rollout_group: str | None,
                  applied: Applied, *, fresh: bool, urgent: bool = False) -> None:
    meta = desired["metadata"]
    kind = desired["kind"]
    ref = f"{kind}/{meta['name']}"
    existing = None if fresh else await kube.get(desired["apiVersion"], kind, meta["namespace"], meta["name"],
                                                 urgent=urgent)
    if existing is None:
        if kind == "RayJob" and job.finished:
            return
        created, existing = await _create(kube, desired, urgent)
        if created:
            applied.created.append(ref)
            if kind == "RayJob":
                applied.rayjob = existing
            return
    problem = ownership_problem(existing, job.owner)
    if problem:
        raise ChildConflict(problem, temporary=stale_owner(existing, job.owner))
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


def status_patch(job: JobView, rayjob: Mapping[str, Any] | None, pods: Sequence[Mapping[str, Any]],
                 problem: RenderError | None) -> dict:
    """The status the job should have now (see status.compute_status)."""
    return compute_status(job.body, rayjob, pods, contract.timestamp(), str(problem) if problem else None,
                          error_reason=problem.reason if problem else "InvalidSpec")


async def write_status(kube: Kube, job: JobView, patch: Mapping[str, Any]) -> dict:
    """Merge-patch the status, conditional on the resourceVersion it was computed from (409 otherwise).

    Returns the job as the API server now has it.
    """
    body = {"metadata": {"resourceVersion": str(job.resource_version)}, "status": patch}
    return await kube.patch(names.JOB_API_VERSION, KIND, job.namespace, job.name, body, status=True)


def foreign_rayjob(job: JobView, rayjob: Mapping[str, Any] | None) -> ChildConflict | None:
    """The RayJob under the job's child name belongs to someone else."""
    problem = ownership_problem(rayjob, job.owner) if rayjob is not None else None
    if rayjob is None or not problem:
        return None
    return ChildConflict(problem, temporary=stale_owner(rayjob, job.owner))


# -- helpers --------------------------------------------------------------------------------------------


async def _create(kube: Kube, desired: Mapping[str, Any], urgent: bool) -> tuple[bool, dict]:
    """(True, the created object); on AlreadyExists (a previous run got there first) (False, the existing one)."""
    try:
        return True, await kube.create(desired, urgent=urgent)
    except ApiException as e:
        if e.status != 409:
            raise
    meta = desired["metadata"]
    existing = await kube.get(desired["apiVersion"], desired["kind"], meta["namespace"], meta["name"],
                              urgent=urgent)
    if existing is None:  # deleted again in between (garbage collection of a stale one): next time
        raise ApiException(status=409, reason=f"{desired['kind']} {meta['name']} is being replaced")
    return False, existing


async def _update_rayjob(kube: Kube, existing: dict, desired: Mapping[str, Any],
                         rollout_group: str | None) -> dict | None:
    """Patch the allowed fields once per spec generation, so Kueue's or a user's later flips stand; in between,
    restore only what nobody but the operator sets (patches.restore_patch).

    The patched RayJob, or None when there was nothing to do.
    """
    meta = desired["metadata"]
    for _ in range(CONFLICT_RETRIES):
        if _generation(existing) == _generation(desired):
            ops = restore_patch(existing, desired)
        else:
            ops = rayjob_patch(existing, desired, rollout_group) + label_patch(existing, desired)
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
