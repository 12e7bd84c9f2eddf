"""The operator's control loop: one queued worker per RLTrainingJob, fed by what the watches saw.

The informers (watches.py) deliver watch events; the reconciler keeps the latest job, its RayJob and
its unbound Ray pods in memory (observed.py) and queues the job. A run applies the spec when this
process has not yet applied the job's current generation, then computes the status from memory and
writes it only when it changed (right after creating children it waits one interval, so the RayJob's
first status comes along). A status sync therefore costs no reads, and a burst of pod events costs one
write at most a second. Creates are never held back; reports are: a status write and the Events that
go with it take one slot of a rate limit for all jobs together, shared out while many Ray clusters
start. A job waiting for its first status is not invisible meanwhile: the API server shows it with
status.observedGeneration 0, not yet observed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hybridflow.api import KIND
from hybridflow.k8s.errors import RenderError
from hybridflow.k8s.names import JOB_API_VERSION
from hybridflow.k8s.patches import owned_state
from hybridflow_operator.apply import (
    CONFLICT_RETRIES,
    Applied,
    ChildConflict,
    ensure_children,
    foreign_rayjob,
    status_patch,
    write_status,
)
from hybridflow_operator.machinery.client import (
    REQUEST_FAILED,
    UNREACHABLE,
    ApiException,
    Kube,
    api_message,
    failure,
    namespace_terminating,
)
from hybridflow_operator.machinery.ratelimit import TokenBucket
from hybridflow_operator.machinery.workqueue import WorkQueue
from hybridflow_operator.metrics import OperatorMetrics
from hybridflow_operator.observed import JobView, Key, Observed, Revision
from hybridflow_operator.settings import OperatorSettings
from hybridflow_operator.status import INITIALIZING, TERMINAL, reported, status_changed, transitions

PostEvent = Callable[[Mapping[str, Any], str, str, str], None]  # (job reference, Normal|Warning, reason, message)
Report = tuple[str, str, str]  # an Event to post: (Normal|Warning, reason, message)

RETRY_DELAY_S = 10.0
STALE_CHILD_DELAY_S = 30.0
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stalled:
    """A revision of a job that cannot be applied until its spec changes, and why."""

    revision: Revision
    problem: RenderError


class Reconciler:
    """Applies each job's spec and keeps its status true; see the module docstring."""

    def __init__(self, kube: Kube, settings: OperatorSettings, post_event: PostEvent,
                 metrics: OperatorMetrics | None = None) -> None:
        self.kube = kube
        self.settings = settings
        self.post_event = post_event
        self.metrics = metrics
        self.status_writes = TokenBucket(settings.status_writes_per_s, burst=max(1.0, settings.status_writes_per_s))
        self.observed = Observed()
        self.queue: WorkQueue[Key] = WorkQueue(self.process, min_interval=settings.status_min_interval,
                                               error_delay=RETRY_DELAY_S, observer=metrics)
        self._applied: dict[Key, Revision] = {}  # what this process has applied
        self._owned: dict[Key, tuple[Any, ...]] = {}  # owned_state of each RayJob as this process left it
        self._stalled: dict[Key, Stalled] = {}
        self._recheck: set[Key] = set()  # read the job again before acting: its RayJob vanished
        self._reports: dict[Key, list[Report]] = {}  # Events waiting for the job's next status write
        self._sources: list[asyncio.Event] = []  # each set once its informer has listed
        self._terminating: set[str] = set()  # namespaces being deleted: their jobs go with them

    def follows(self, listed: asyncio.Event) -> None:
        """Hold every run until this informer has listed once (`listed` is set).

        A status computed before the unbound pods are known would drop an Unschedulable condition
        after a restart, only to bring it back a moment later.
        """
        self._sources.append(listed)

    # -- watch events ------------------------------------------------------------------------------

    def job_event(self, job: JobView, event_type: str | None) -> None:
        key = self.observed.job(job, deleted=event_type == "DELETED")
        if event_type == "DELETED":
            self._forget(key)
            if job.namespace in self._terminating and not self._has_jobs(job.namespace):
                self._terminating.discard(job.namespace)  # its last job is gone: a namespace of that name is new
        self.queue.add(key)

    def rayjob_event(self, body: Mapping[str, Any], event_type: str | None) -> None:
        key = self.observed.rayjob(body, deleted=event_type == "DELETED")
        if key is None:
            return
        if event_type == "DELETED" and key in self.observed.jobs:
            self._applied.pop(key, None)  # recreate it, unless the job is finished or going too
            self._recheck.add(key)
        elif self._drifted(key):
            self._applied.pop(key, None)  # someone else changed what only the operator sets: restore it
        self.queue.add(key)

    def pod_event(self, body: Mapping[str, Any], event_type: str | None) -> None:
        key = self.observed.pod(body, deleted=event_type == "DELETED")
        if key is not None and key in self.observed.jobs:
            self.queue.add(key)

    # -- the work ----------------------------------------------------------------------------------

    async def process(self, key: Key) -> float | None:
        """Apply the spec if needed, then sync the status; seconds until a retry, or None."""
        for listed in self._sources:
            await listed.wait()
        if key[0] in self._terminating:
            self._forget(key)
            return None  # the namespace is being deleted: nothing to create, nothing to report
        if key in self._recheck:
            try:
                fresh = await self.kube.get(JOB_API_VERSION, KIND, *key)
            except REQUEST_FAILED as e:
                log.warning("reading %s/%s: %s; retrying in %.0f s", *key, failure(e), RETRY_DELAY_S)
                return RETRY_DELAY_S
            self._recheck.discard(key)
            if fresh is None:
                self.observed.jobs.pop(key, None)
            else:
                self.observed.job(JobView.parse(fresh))
        job = self.observed.jobs.get(key)
        if job is None or job.deleting:
            self._forget(key)
            return None
        revision = job.revision
        problem, retry = None, None
        stalled = self._stalled.get(key)
        if stalled is not None and stalled.revision == revision:
            problem = stalled.problem
        elif self._applied.get(key) != revision:
            try:
                applied = await ensure_children(self.kube, job, self.settings.render, fresh=not reported(job.body))
            except ChildConflict as e:
                problem, retry = e, STALE_CHILD_DELAY_S if e.temporary else None
                if not e.temporary:
                    self._stalled[key] = Stalled(revision, e)
            except RenderError as e:
                problem = e
                self._stalled[key] = Stalled(revision, e)
            except ApiException as e:
                if namespace_terminating(e):
                    self._namespace_terminating(key)
                    return None
                if e.status != 422:
                    log.warning("applying %s/%s: %s; retrying in %.0f s", *key, failure(e), RETRY_DELAY_S)
                    return RETRY_DELAY_S
                # the API server refused a child we rendered: retrying cannot help
                problem = RenderError("spec", "ChildRejected", api_message(e))
                self._stalled[key] = Stalled(revision, problem)
            except UNREACHABLE as e:  # an API server restarting: no bug, no traceback
                log.warning("applying %s/%s: %s; retrying in %.0f s", *key, failure(e), RETRY_DELAY_S)
                return RETRY_DELAY_S
            else:
                self._applied[key] = revision
                self._stalled.pop(key, None)
                self._announce(key, applied)
                if applied.rayjob is not None:
                    self.observed.rayjob(applied.rayjob)
                    self._owned[key] = owned_state(applied.rayjob)
                if applied.created:
                    # KubeRay is about to write the new RayJob's first status: one status write for both
                    return self.settings.status_min_interval
        try:
            await self._sync_status(key, job, problem)
        except REQUEST_FAILED as e:
            log.warning("status of %s/%s: %s; retrying in %.0f s", *key, failure(e), RETRY_DELAY_S)
            return RETRY_DELAY_S
        return retry

    async def _sync_status(self, key: Key, job: JobView, problem: RenderError | None) -> None:
        """Write the status if it changed, and post the job's Events waiting for it, in one paced slot."""
        waited = False
        for _ in range(CONFLICT_RETRIES):
            before = job.status
            patch = self._status_of(key, job, problem)
            changed = status_changed(before, patch)
            if not changed and not self._reports.get(key):
                return
            if not waited:  # wait for a slot once, then report what is true by then
                self.status_writes.set_rate(self.status_write_rate())
                await self.status_writes.acquire()
                waited = True
                latest = self.observed.jobs.get(key)
                if latest is None or latest.deleting:
                    return
                if latest is not job:
                    job = latest
                    continue
            if not changed:
                self._post_reports(key, job)
                return
            try:
                updated = await write_status(self.kube, job, patch)
            except ApiException as e:
                self._count_write({404: "gone", 409: "conflict"}.get(e.status or 0, "error"))
                if e.status == 404:
                    return
                if e.status != 409:
                    raise
                current = await self.kube.get(JOB_API_VERSION, KIND, *key)  # someone else wrote: read, redo
                if current is None:
                    return
                self.observed.job(JobView.parse(current))
                job = self.observed.jobs[key]
                continue
            self._count_write("written")
            self.observed.job(JobView.parse(updated))
            self._post_reports(key, job)
            for event_type, reason, message in transitions(before, updated.get("status") or {}):
                self.post_event(job.event_ref, event_type, reason, message)
            return
        raise ApiException(status=409, reason=f"status of {key[0]}/{key[1]} kept changing under the operator")

    def _count_write(self, result: str) -> None:
        if self.metrics is not None:
            self.metrics.status_write(result)

    def _post_reports(self, key: Key, job: JobView) -> None:
        for event_type, reason, message in self._reports.pop(key, ()):
            self.post_event(job.event_ref, event_type, reason, message)

    def status_write_rate(self) -> float:
        """Status writes a second for all jobs: the full rate, shared out while many Ray clusters start.

        rate = status_writes_per_s * min(1, spin_up_jobs / starting), at least 1 a second, where
        `starting` counts RayJobs still initializing. KubeRay creates their clusters one request after
        another, and every status write is a whole RLTrainingJob for the API server to validate, store
        and send to each watcher: while clusters start, statuses wait rather than slow them down.
        """
        starting = sum(1 for rayjob in self.observed.rayjobs.values()
                       if ((rayjob.get("status") or {}).get("jobDeploymentStatus") or "") in INITIALIZING)
        base = self.settings.status_writes_per_s
        if starting <= self.settings.spin_up_jobs:
            return base
        return max(min(1.0, base), base * self.settings.spin_up_jobs / starting)

    def _status_of(self, key: Key, job: JobView, problem: RenderError | None) -> dict:
        """The status patch from what the watches saw of the job's RayJob and pods."""
        rayjob = self.observed.rayjobs.get(key)
        conflict = foreign_rayjob(job, rayjob)
        if conflict is not None:
            problem, rayjob = problem or conflict, None
        deployment = ((rayjob or {}).get("status") or {}).get("jobDeploymentStatus") or ""
        pods = list(self.observed.pods.get(key, {}).values()) if rayjob and deployment not in TERMINAL else []
        return status_patch(job, rayjob, pods, problem)

    def _announce(self, key: Key, applied: Applied) -> None:
        """One Event per kind of change, not one per child, posted with the job's next status write."""
        reports: list[Report] = []
        for verb, refs in (("created", applied.created), ("updated", applied.patched)):
            if refs:
                log.info("%s/%s: %s %s", *key, verb, ", ".join(refs))
                reports.append(("Normal", verb.capitalize(), f"{verb} {', '.join(refs)}"))
        if applied.layout_ignored:
            reports.append(("Warning", "LayoutChangeIgnored",
                            "the Ray cluster layout changed but a RayJob keeps the layout it was created with; "
                            "only suspend, TTL, deadline and the rollout group's replicas apply to a running job"))
        if reports:
            self._reports.setdefault(key, []).extend(reports)

    def _namespace_terminating(self, key: Key) -> None:
        """The API server refused a child: the job's namespace is being deleted, and the job with it.

        Every job of that namespace stops here, without a retry, a status write or an Event (each would be
        refused too, or be deleted a moment later), until its last job is gone (job_event).
        """
        self._forget(key)
        if key[0] in self._terminating or not self._has_jobs(key[0]):  # noted already; or its jobs are gone
            return
        log.info("namespace %s is being deleted: its RLTrainingJobs go with it, nothing more is created there",
                 key[0])
        self._terminating.add(key[0])

    def _drifted(self, key: Key) -> bool:
        """The latest RayJob seen differs from this process's last apply in what only the operator sets."""
        rayjob, owned = self.observed.rayjobs.get(key), self._owned.get(key)
        return key in self._applied and rayjob is not None and owned is not None and owned_state(rayjob) != owned

    def _has_jobs(self, namespace: str) -> bool:
        return any(ns == namespace for ns, _ in self.observed.jobs)

    def _forget(self, key: Key) -> None:
        self._applied.pop(key, None)
        self._owned.pop(key, None)
        self._reports.pop(key, None)
        self._stalled.pop(key, None)
        self._recheck.discard(key)

    # -- safety net --------------------------------------------------------------------------------

    async def resync_forever(self) -> None:
        """Every status interval, check every job's children again (recreating lost ones) and its status.

        The reads are spread over half the interval, so a thousand jobs never arrive at once.
        """
        interval = self.settings.status_interval
        while True:
            await asyncio.sleep(interval)
            keys = list(self.observed.jobs)
            for key in keys:
                self._applied.pop(key, None)
                self.queue.add(key)
                await asyncio.sleep(interval / 2 / len(keys))

