"""The operator's control loop: what the watches saw, and one queued worker per RLTrainingJob.

kopf and the informers deliver watch events (handlers.py); the controller keeps the latest job, its
RayJob and its unbound Ray pods in memory and queues the job. A run applies the spec when this process
has not yet applied the job's current generation, then computes the status from memory and writes it
only when it changed (right after creating children it waits one interval, so the RayJob's first
status comes along). A status sync therefore costs no reads, and a burst of pod events costs one write
at most a second. Creates are never held back; reports are: a status write and the Events that go
with it take one slot of a rate limit for all jobs together, shared out while many Ray clusters start.
A job waiting for its first status is not invisible meanwhile: the API server shows it with
status.observedGeneration 0, not yet observed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hybridflow_operator.errors import RenderError
from hybridflow_operator.kube import JOB_API_VERSION, ApiException, Kube, api_message, namespace_terminating
from hybridflow_operator.ratelimit import TokenBucket
from hybridflow_operator.reconcile import (
    CONFLICT_RETRIES,
    KIND,
    Applied,
    ChildConflict,
    ensure_children,
    foreign_rayjob,
    job_name_of,
    status_patch,
    write_status,
)
from hybridflow_operator.settings import OperatorSettings
from hybridflow_operator.status import INITIALIZING, TERMINAL, reported, status_changed, transitions
from hybridflow_operator.workqueue import WorkQueue

Key = tuple[str, str]  # (namespace, job name)
PostEvent = Callable[[Mapping[str, Any], str, str, str], None]  # (job reference, Normal|Warning, reason, message)
Report = tuple[str, str, str]  # an Event to post: (Normal|Warning, reason, message)

RETRY_DELAY_S = 10.0
STALE_CHILD_DELAY_S = 30.0
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stalled:
    """A generation of a job that cannot be applied until its spec changes, and why."""

    uid: str
    generation: int
    problem: RenderError


def key_of(body: Mapping[str, Any]) -> Key:
    meta = body["metadata"]
    return meta["namespace"], meta["name"]


def owner_key(child: Mapping[str, Any]) -> Key | None:
    """The key of the job a RayJob or Ray pod belongs to; None for someone else's."""
    owner = job_name_of(child)
    return (child["metadata"]["namespace"], owner) if owner else None


def newer(candidate: Mapping[str, Any], current: Mapping[str, Any] | None) -> bool:
    """Whether `candidate` is a later version of the object than `current` (etcd revisions are ordered)."""
    if current is None:
        return True
    if candidate["metadata"].get("uid") != current["metadata"].get("uid"):
        return True
    try:
        return int(candidate["metadata"]["resourceVersion"]) >= int(current["metadata"]["resourceVersion"])
    except (KeyError, ValueError):
        return True


def slim_pod(pod: Mapping[str, Any]) -> dict:
    """What the status needs of a Ray pod: why it is not scheduled."""
    status = pod.get("status") or {}
    return {"metadata": {"name": pod["metadata"]["name"]},
            "status": {"phase": status.get("phase"), "conditions": status.get("conditions") or []}}


def slim(obj: Mapping[str, Any]) -> dict:
    """The object without managedFields, which can be most of its size."""
    meta = {k: v for k, v in obj["metadata"].items() if k != "managedFields"}
    return {**obj, "metadata": meta}


class Observed:
    """The latest RLTrainingJobs, RayJobs and Pending Ray pods seen, by job."""

    def __init__(self) -> None:
        self.jobs: dict[Key, dict] = {}
        self.rayjobs: dict[Key, dict] = {}
        self.pods: dict[Key, dict[str, dict]] = {}

    def job(self, body: Mapping[str, Any], deleted: bool = False) -> Key:
        key = key_of(body)
        if deleted:
            self.jobs.pop(key, None)
        elif newer(body, self.jobs.get(key)):
            self.jobs[key] = slim(body)
        return key

    def rayjob(self, body: Mapping[str, Any], deleted: bool = False) -> Key | None:
        key = owner_key(body)
        if key is None:
            return None
        current = self.rayjobs.get(key)
        if deleted:
            if current is not None and current["metadata"].get("uid") == body["metadata"].get("uid"):
                del self.rayjobs[key]
        elif newer(body, current):
            self.rayjobs[key] = slim(body)
        return key

    def pod(self, body: Mapping[str, Any], deleted: bool = False) -> Key | None:
        key = owner_key(body)
        if key is None:
            return None
        pods = self.pods.setdefault(key, {})
        if deleted:
            pods.pop(body["metadata"]["name"], None)
            if not pods:
                del self.pods[key]
        else:
            pods[body["metadata"]["name"]] = slim_pod(body)
        return key


class Controller:
    """Applies each job's spec and keeps its status true; see the module docstring."""

    def __init__(self, kube: Kube, settings: OperatorSettings, post_event: PostEvent) -> None:
        self.kube = kube
        self.settings = settings
        self.post_event = post_event
        self.status_writes = TokenBucket(settings.status_writes_per_s, burst=max(1.0, settings.status_writes_per_s))
        self.observed = Observed()
        self.queue: WorkQueue[Key] = WorkQueue(self.process, min_interval=settings.status_min_interval,
                                               error_delay=RETRY_DELAY_S)
        self._applied: dict[Key, tuple[str, int]] = {}  # (uid, generation) this process has applied
        self._stalled: dict[Key, Stalled] = {}
        self._recheck: set[Key] = set()  # read the job again before acting: its RayJob vanished
        self._reports: dict[Key, list[Report]] = {}  # Events waiting for the job's next status write
        self._sources: list[asyncio.Event] = []  # each set once an informer of children has listed

    def follows(self, listed: asyncio.Event) -> None:
        """Hold every run until this source of children has been listed once (`listed` is set).

        A status computed before the unbound pods are known would drop an Unschedulable condition
        after a restart, only to bring it back a moment later.
        """
        self._sources.append(listed)

    # -- watch events ------------------------------------------------------------------------------

    def job_event(self, body: Mapping[str, Any], event_type: str | None) -> None:
        key = self.observed.job(body, deleted=event_type == "DELETED")
        if event_type == "DELETED":
            self._forget(key)
        self.queue.add(key)

    def rayjob_event(self, body: Mapping[str, Any], event_type: str | None) -> None:
        key = self.observed.rayjob(body, deleted=event_type == "DELETED")
        if key is None:
            return
        if event_type == "DELETED" and key in self.observed.jobs:
            self._applied.pop(key, None)  # recreate it, unless the job is finished or going too
            self._recheck.add(key)
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
        if key in self._recheck:
            try:
                fresh = await self.kube.get(JOB_API_VERSION, KIND, *key)
            except ApiException as e:
                log.warning("reading %s/%s: API error %s: %s; retrying in %.0f s", *key, e.status, api_message(e),
                            RETRY_DELAY_S)
                return RETRY_DELAY_S
            self._recheck.discard(key)
            if fresh is None:
                self.observed.jobs.pop(key, None)
            else:
                self.observed.job(fresh)
        job = self.observed.jobs.get(key)
        if job is None or job["metadata"].get("deletionTimestamp"):
            self._forget(key)
            return None
        meta = job["metadata"]
        revision = (meta["uid"], int(meta.get("generation") or 0))
        problem, retry = None, None
        stalled = self._stalled.get(key)
        if stalled is not None and (stalled.uid, stalled.generation) == revision:
            problem = stalled.problem
        elif self._applied.get(key) != revision:
            try:
                applied = await ensure_children(self.kube, job, self.settings, fresh=not reported(job))
            except ChildConflict as e:
                problem, retry = e, STALE_CHILD_DELAY_S if e.temporary else None
                if not e.temporary:
                    self._stalled[key] = Stalled(*revision, e)
            except RenderError as e:
                problem = e
                self._stalled[key] = Stalled(*revision, e)
            except ApiException as e:
                if namespace_terminating(e):
                    return None  # the job goes with its namespace
                if e.status != 422:
                    log.warning("applying %s/%s: API error %s: %s; retrying in %.0f s", *key, e.status,
                                api_message(e), RETRY_DELAY_S)
                    return RETRY_DELAY_S
                # the API server refused a child we rendered: retrying cannot help
                problem = RenderError("spec", "ChildRejected", api_message(e))
                self._stalled[key] = Stalled(*revision, problem)
            else:
                self._applied[key] = revision
                self._stalled.pop(key, None)
                self._announce(key, job, applied)
                if applied.rayjob is not None:
                    self.observed.rayjob(applied.rayjob)
                if applied.created:
                    # KubeRay is about to write the new RayJob's first status: one status write for both
                    return self.settings.status_min_interval
        try:
            await self._sync_status(key, job, problem)
        except ApiException as e:
            log.warning("status of %s/%s: API error %s: %s; retrying in %.0f s", *key, e.status, api_message(e),
                        RETRY_DELAY_S)
            return RETRY_DELAY_S
        return retry

    async def _sync_status(self, key: Key, job: dict, problem: RenderError | None) -> None:
        """Write the status if it changed, and post the job's Events waiting for it, in one paced slot."""
        waited = False
        for _ in range(CONFLICT_RETRIES):
            before = job.get("status") or {}
            patch = self._status_of(key, job, problem)
            changed = status_changed(before, patch)
            if not changed and not self._reports.get(key):
                return
            if not waited:  # wait for a slot once, then report what is true by then
                self.status_writes.set_rate(self.status_write_rate())
                await self.status_writes.acquire()
                waited = True
                latest = self.observed.jobs.get(key)
                if latest is None or latest["metadata"].get("deletionTimestamp"):
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
                if e.status == 404:
                    return
                if e.status != 409:
                    raise
                current = await self.kube.get(JOB_API_VERSION, KIND, *key)  # someone else wrote: read, redo
                if current is None:
                    return
                self.observed.job(current)
                job = self.observed.jobs[key]
                continue
            self.observed.job(updated)
            self._post_reports(key, job)
            for event_type, reason, message in transitions(before, updated.get("status") or {}):
                self.post_event(_ref(job), event_type, reason, message)
            return
        raise ApiException(status=409, reason=f"status of {key[0]}/{key[1]} kept changing under the operator")

    def _post_reports(self, key: Key, job: Mapping[str, Any]) -> None:
        for event_type, reason, message in self._reports.pop(key, ()):
            self.post_event(_ref(job), event_type, reason, message)

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

    def _status_of(self, key: Key, job: Mapping[str, Any], problem: RenderError | None) -> dict:
        """The status patch from what the watches saw of the job's RayJob and pods."""
        rayjob = self.observed.rayjobs.get(key)
        conflict = foreign_rayjob(job, rayjob)
        if conflict is not None:
            problem, rayjob = problem or conflict, None
        deployment = ((rayjob or {}).get("status") or {}).get("jobDeploymentStatus") or ""
        pods = list(self.observed.pods.get(key, {}).values()) if rayjob and deployment not in TERMINAL else []
        return status_patch(job, rayjob, pods, problem)

    def _announce(self, key: Key, job: Mapping[str, Any], applied: Applied) -> None:
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

    def _forget(self, key: Key) -> None:
        self._applied.pop(key, None)
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


def _ref(job: Mapping[str, Any]) -> dict:
    """Just enough of the job for kopf to address an Event to it."""
    meta = job["metadata"]
    return {"apiVersion": job.get("apiVersion", JOB_API_VERSION), "kind": job.get("kind", KIND),
            "metadata": {"name": meta["name"], "namespace": meta["namespace"], "uid": meta["uid"]}}
