"""The status of an RLTrainingJob from what the operator sees: its RayJob, the Ray pods, a render error.

Pure. Conditions follow metav1.Condition and kstatus, batch style (like a Kubernetes Job):
Ready=True once the RayJob is admitted and running (and after it succeeded), the outcome in
Succeeded/Failed, Reconciling=True while work is under way, Stalled=True when nothing will
happen without a change (a spec the operator cannot render, a failed run). The top-level
observedGeneration is the generation last applied to the RayJob, so it lags while an update is
on its way. status.progress belongs to the runtime and is never part of the patch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hybridflow.api import CONDITION_TYPES
from hybridflow.k8s.contract import DASHBOARD_PORT_NAME
from hybridflow.k8s.names import GENERATION_ANNOTATION, head_service_name

MAX_MESSAGE = 32768
DEFAULT_CLUSTER_DOMAIN = "cluster.local"

# RayJob.status.jobDeploymentStatus values (KubeRay v1).
INITIALIZING = {"", "Initializing", "Waiting"}
RETRYING = "Retrying"
RUNNING = "Running"
COMPLETE = "Complete"
FAILED = "Failed"
VALIDATION_FAILED = "ValidationFailed"
SUSPENDING = "Suspending"
SUSPENDED = "Suspended"
TERMINAL = {COMPLETE, FAILED, VALIDATION_FAILED}
UNSUCCESSFUL_JOB_STATUSES = {"FAILED", "STOPPED"}


@dataclass(frozen=True)
class Cond:
    status: str
    reason: str
    message: str = ""


def _true(reason: str, message: str = "") -> Cond:
    return Cond("True", reason, message)


def _false(reason: str, message: str = "") -> Cond:
    return Cond("False", reason, message)


def compute_status(
    job: Mapping[str, Any],
    rayjob: Mapping[str, Any] | None,
    pods: Sequence[Mapping[str, Any]] | None,
    now: str,
    render_error: str | None,
    *,
    error_reason: str = "InvalidSpec",
) -> dict:
    """The whole status patch (every key; None deletes a stale one), conditions as one full list."""
    meta = job.get("metadata", {})
    generation = meta.get("generation")
    previous = job.get("status") or {}
    applied = _applied_generation(rayjob)
    observed = generation if render_error else (applied if applied is not None else previous.get("observedGeneration"))
    conds, phase = _assess(job, rayjob, pods or [], render_error, error_reason)
    if not render_error and observed != generation and conds["Reconciling"].status != "True":
        conds["Reconciling"] = _true("Progressing", f"applying generation {generation}")
    rj_status = (rayjob or {}).get("status") or {}
    deployment = rj_status.get("jobDeploymentStatus") or None
    return {
        "observedGeneration": observed,
        "conditions": _conditions(conds, previous.get("conditions") or [], now, generation),
        "phase": phase,
        "rayJobName": (rayjob or {}).get("metadata", {}).get("name"),
        "rayClusterName": rj_status.get("rayClusterName") or None,
        "dashboardUrl": rj_status.get("dashboardURL") or None,
        "schedulerDashboardUrl": scheduler_dashboard_url(rayjob, deployment),
        "jobDeploymentStatus": deployment,
        "jobStatus": rj_status.get("jobStatus") or None,
        "startTime": previous.get("startTime") or rj_status.get("startTime"),
        "completionTime": _completion_time(deployment, rj_status, previous, now),
        "restarts": _restarts(deployment, rj_status),
    }


def scheduler_dashboard_url(rayjob: Mapping[str, Any] | None, deployment: str | None) -> str | None:
    """The live scheduler dashboard the driver serves on the Ray head, through its RayCluster's head Service.

    Only while the RayJob runs (before, nothing listens; after, its cluster is gone) and only when its head
    declares the port (a RayJob rendered before the head served it does not). The DNS domain is the one
    KubeRay's own dashboardURL uses.
    """
    if rayjob is None or deployment != RUNNING:
        return None
    cluster = (rayjob.get("status") or {}).get("rayClusterName")
    if not cluster:
        return None
    port = _head_port(rayjob, DASHBOARD_PORT_NAME)
    if port is None:
        return None
    meta = rayjob.get("metadata") or {}
    host = str((rayjob.get("status") or {}).get("dashboardURL") or "").split("://")[-1].rsplit(":", 1)[0]
    domain = host.partition(".svc.")[2] or DEFAULT_CLUSTER_DOMAIN
    return f"http://{head_service_name(cluster)}.{meta.get('namespace') or 'default'}.svc.{domain}:{port}"


def reported(job: Mapping[str, Any]) -> bool:
    """Whether the operator has written the job's status yet: the conditions are its own.

    Before that the API server shows its default, observedGeneration 0 (not yet observed).
    """
    return bool((job.get("status") or {}).get("conditions"))


def status_changed(current: Mapping[str, Any] | None, patch: Mapping[str, Any]) -> bool:
    """Whether writing `patch` would change anything (None keys count as absent)."""
    current = current or {}
    return any(current.get(k) != v for k, v in patch.items())


# Condition turning True -> Event (type); Stalled also when its message changes (a new problem).
ANNOUNCED = {"Stalled": "Warning", "Failed": "Warning", "Succeeded": "Normal", "Ready": "Normal",
             "Suspended": "Normal"}


def transitions(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(event type, reason, message) for each condition that newly became True, in condition order."""
    old = {c.get("type"): c for c in before.get("conditions") or []}
    new = {c.get("type"): c for c in after.get("conditions") or []}
    failed = (new.get("Failed") or {}).get("status") == "True"
    out = []
    for cond in after.get("conditions") or []:
        kind, prior = cond["type"], old.get(cond["type"]) or {}
        if kind not in ANNOUNCED or cond["status"] != "True" or (kind == "Stalled" and failed):
            continue  # a failed run is one Event (Failed), not two
        renewed = kind == "Stalled" and prior.get("message") != cond.get("message")
        if prior.get("status") != "True" or renewed:
            out.append((ANNOUNCED[kind], cond["reason"], cond.get("message") or f"{kind}"))
    return out


def unschedulable(pods: Sequence[Mapping[str, Any]]) -> list[str]:
    """`pod: scheduler message` for each Pending pod the scheduler could not place, by pod name."""
    out = []
    for pod in sorted(pods, key=lambda p: p.get("metadata", {}).get("name", "")):
        status = pod.get("status") or {}
        if status.get("phase") != "Pending":
            continue
        for c in status.get("conditions") or []:
            if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
                out.append(f"{pod['metadata']['name']}: {c.get('message') or 'unschedulable'}")
    return out


# -- assessment -------------------------------------------------------------------------------------


def _assess(job: Mapping[str, Any], rayjob: Mapping[str, Any] | None, pods: Sequence[Mapping[str, Any]],
            render_error: str | None, error_reason: str) -> tuple[dict[str, Cond], str]:
    """One Cond per condition type, and the phase."""
    suspend = bool(((job.get("spec") or {}).get("runPolicy") or {}).get("suspend"))
    if rayjob is not None:
        suspend = bool((rayjob.get("spec") or {}).get("suspend"))
    conds = {t: _false("NotFinished") for t in ("Succeeded", "Failed")}
    conds["Stalled"] = _false("NoError")
    conds["Suspended"] = _suspended(suspend, rayjob, job)
    if rayjob is None:
        conds["Ready"] = _false("Creating", "creating the RayJob")
        conds["Reconciling"] = _true("Creating", "creating the RayJob")
        phase = "Pending"
    else:
        phase = _assess_rayjob(conds, rayjob, pods, suspend)
    if render_error:
        conds["Stalled"] = _true(error_reason, render_error)
        conds["Ready"] = _false(error_reason, render_error)
        conds["Reconciling"] = _false(error_reason, "waiting for a change to the spec")
        phase = "Stalled"
    return conds, phase


def _assess_rayjob(conds: dict[str, Cond], rayjob: Mapping[str, Any], pods: Sequence[Mapping[str, Any]],
                   suspend: bool) -> str:
    status = rayjob.get("status") or {}
    deployment = status.get("jobDeploymentStatus") or ""
    job_status = status.get("jobStatus") or ""
    name = rayjob["metadata"]["name"]
    message = status.get("message") or ""
    if deployment == COMPLETE and job_status not in UNSUCCESSFUL_JOB_STATUSES:
        conds["Succeeded"] = _true("Succeeded", message or f"RayJob {name} completed")
        conds["Ready"] = _true("Succeeded", "training finished")
        conds["Reconciling"] = _false("Succeeded")
        return "Succeeded"
    if deployment in TERMINAL:
        reason = status.get("reason") or ("Stopped" if job_status == "STOPPED" else "Failed")
        detail = message or f"RayJob {name}: jobDeploymentStatus {deployment}, jobStatus {job_status or 'unknown'}"
        conds["Failed"] = _true(reason, detail)
        conds["Stalled"] = _true(reason, detail)
        conds["Ready"] = _false(reason, detail)
        conds["Reconciling"] = _false(reason)
        conds["Succeeded"] = _false(reason)
        return "Failed"
    if suspend or deployment in (SUSPENDING, SUSPENDED):
        cond = conds["Suspended"]
        settled = suspend and deployment == SUSPENDED
        conds["Ready"] = _false(cond.reason, cond.message)
        conds["Reconciling"] = _false(cond.reason, cond.message) if settled else _true(cond.reason, cond.message)
        return "Suspended" if suspend else "Pending"
    stuck = unschedulable(pods)
    if deployment == RUNNING:
        note = f"; {len(stuck)} pod(s) unschedulable: {stuck[0]}" if stuck else ""
        conds["Ready"] = _true("Running", f"RayJob {name} is running (jobStatus {job_status or 'PENDING'}){note}")
        conds["Reconciling"] = _false("Running")
        return "Running"
    reason = "Retrying" if deployment == RETRYING else "Initializing"
    text = f"RayJob {name} is {reason.lower()}" + (f" (jobDeploymentStatus {deployment})" if deployment else "")
    if stuck:
        reason, text = "Unschedulable", f"{len(stuck)} pod(s) unschedulable: {'; '.join(stuck)}"
    conds["Ready"] = _false(reason, text)
    conds["Reconciling"] = _true(reason, text)
    return "Pending"


def _suspended(suspend: bool, rayjob: Mapping[str, Any] | None, job: Mapping[str, Any]) -> Cond:
    deployment = ((rayjob or {}).get("status") or {}).get("jobDeploymentStatus") or ""
    if deployment in TERMINAL:
        return _false("Finished")
    if not suspend:
        if deployment in (SUSPENDING, SUSPENDED):
            return _false("Resuming", "resuming: KubeRay recreates the Ray cluster")
        return _false("NotSuspended")
    user_suspended = bool(((job.get("spec") or {}).get("runPolicy") or {}).get("suspend"))
    queued = not user_suspended and ((job.get("spec") or {}).get("cluster") or {}).get("queueName")
    if deployment == SUSPENDED:
        if queued:
            return _true("Queued", "waiting for admission by Kueue")
        return _true("Suspended", "the Ray cluster is released; set spec.runPolicy.suspend=false to resume")
    return _true("Suspending", "waiting for KubeRay to release the Ray cluster")


# -- helpers ------------------------------------------------------------------------------------------


def _head_port(rayjob: Mapping[str, Any], name: str) -> int | None:
    """The number of the head container's port called `name`, as the RayJob declares it."""
    head = ((rayjob.get("spec") or {}).get("rayClusterSpec") or {}).get("headGroupSpec") or {}
    for container in ((head.get("template") or {}).get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == name and port.get("containerPort"):
                return int(port["containerPort"])
    return None


def _applied_generation(rayjob: Mapping[str, Any] | None) -> int | None:
    raw = ((rayjob or {}).get("metadata", {}).get("annotations") or {}).get(GENERATION_ANNOTATION)
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


def _conditions(conds: Mapping[str, Cond], previous: list[Mapping[str, Any]], now: str,
                generation: int | None) -> list[dict]:
    """metav1.Condition list in a fixed order; lastTransitionTime moves only when status does."""
    before = {c.get("type"): c for c in previous}
    out = []
    for kind in CONDITION_TYPES:
        cond = conds[kind]
        prior = before.get(kind)
        since = prior.get("lastTransitionTime") if prior and prior.get("status") == cond.status else None
        entry = {"type": kind, "status": cond.status, "reason": cond.reason,
                 "message": cond.message[:MAX_MESSAGE], "lastTransitionTime": since or now}
        if generation is not None:
            entry["observedGeneration"] = generation
        out.append(entry)
    return out


def _completion_time(deployment: str | None, rj_status: Mapping[str, Any], previous: Mapping[str, Any],
                     now: str) -> str | None:
    if deployment not in TERMINAL:
        return None
    return previous.get("completionTime") or rj_status.get("endTime") or now


def _restarts(deployment: str | None, rj_status: Mapping[str, Any]) -> int:
    """Retries started: KubeRay counts each failed attempt, the final one included when it gave up."""
    failed = int(rj_status.get("failed") or 0)
    return max(0, failed - 1) if deployment == FAILED else failed
