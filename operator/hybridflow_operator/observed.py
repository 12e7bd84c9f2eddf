"""What the watches saw: the latest RLTrainingJobs, their RayJobs and their unbound Ray pods, by job.

A job is parsed once, when its event arrives, into a `JobView`; a RayJob keeps its object without
managedFields (the status reads it whole), a pod only what explains a wait.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybridflow.api import KIND
from hybridflow.k8s.names import JOB_API_VERSION, JOB_LABEL
from hybridflow.k8s.render import owner_reference

Key = tuple[str, str]  # (namespace, job name)
Revision = tuple[str, int]  # (uid, generation): one spec of one incarnation of a job


@dataclass(frozen=True, slots=True)
class JobView:
    """An RLTrainingJob as the reconciler reads it; `body` is the object without managedFields."""

    namespace: str
    name: str
    uid: str
    generation: int
    resource_version: int | None
    deleting: bool
    body: Mapping[str, Any]

    @classmethod
    def parse(cls, obj: Mapping[str, Any]) -> JobView:
        """From a watch event or a read; a stub of a vanished job (no resourceVersion) parses too."""
        meta = obj["metadata"]
        try:
            version = int(meta["resourceVersion"])
        except (KeyError, ValueError):
            version = None
        slim_meta = {k: v for k, v in meta.items() if k != "managedFields"}  # often most of the object
        return cls(namespace=meta["namespace"], name=meta["name"], uid=meta.get("uid") or "",
                   generation=int(meta.get("generation") or 0), resource_version=version,
                   deleting=bool(meta.get("deletionTimestamp")), body={**obj, "metadata": slim_meta})

    @property
    def key(self) -> Key:
        return self.namespace, self.name

    @property
    def revision(self) -> Revision:
        return self.uid, self.generation

    @property
    def status(self) -> Mapping[str, Any]:
        return self.body.get("status") or {}

    @property
    def finished(self) -> bool:
        """Succeeded or Failed: its RayJob may be gone (TTL, manual delete) and is never started again."""
        return any(c.get("type") in ("Succeeded", "Failed") and c.get("status") == "True"
                   for c in self.status.get("conditions") or [])

    @property
    def owner(self) -> dict | None:
        """The controller reference its children carry."""
        return owner_reference(self.name, self.uid)

    @property
    def event_ref(self) -> dict:
        """Just enough of the job to address an Event to it."""
        return {"apiVersion": JOB_API_VERSION, "kind": KIND,
                "metadata": {"name": self.name, "namespace": self.namespace, "uid": self.uid}}

    def newer_than(self, current: JobView | None) -> bool:
        """Whether this is a later version than `current` (etcd revisions are ordered)."""
        if current is None or self.uid != current.uid:
            return True
        if self.resource_version is None or current.resource_version is None:
            return True
        return self.resource_version >= current.resource_version


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


def job_name_of(child: Mapping[str, Any]) -> str | None:
    """The RLTrainingJob a RayJob or Ray pod belongs to: the controller reference, else the label."""
    meta = child.get("metadata", {})
    for ref in meta.get("ownerReferences") or []:
        if ref.get("controller") and ref.get("kind") == KIND:
            return ref.get("name")
    return (meta.get("labels") or {}).get(JOB_LABEL)


def owner_key(child: Mapping[str, Any]) -> Key | None:
    """The key of the job a RayJob or Ray pod belongs to; None for someone else's."""
    owner = job_name_of(child)
    return (child["metadata"]["namespace"], owner) if owner else None


def slim(obj: Mapping[str, Any]) -> dict:
    """The object without managedFields, which can be most of its size."""
    meta = {k: v for k, v in obj["metadata"].items() if k != "managedFields"}
    return {**obj, "metadata": meta}


def slim_pod(pod: Mapping[str, Any]) -> dict:
    """What the status needs of a Ray pod: why it is not scheduled."""
    status = pod.get("status") or {}
    return {"metadata": {"name": pod["metadata"]["name"]},
            "status": {"phase": status.get("phase"), "conditions": status.get("conditions") or []}}


class Observed:
    """The latest RLTrainingJobs, RayJobs and Pending Ray pods seen, by job."""

    def __init__(self) -> None:
        self.jobs: dict[Key, JobView] = {}
        self.rayjobs: dict[Key, dict] = {}
        self.pods: dict[Key, dict[str, dict]] = {}

    def job(self, job: JobView, deleted: bool = False) -> Key:
        if deleted:
            self.jobs.pop(job.key, None)
        elif job.newer_than(self.jobs.get(job.key)):
            self.jobs[job.key] = job
        return job.key

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
