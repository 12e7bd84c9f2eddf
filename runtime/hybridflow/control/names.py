"""Where a running job's controller is found: one naming rule shared by the driver and `connect`.

Pure (no Ray import), so the CLI and the operator can name a controller without starting anything.
"""

from __future__ import annotations

from dataclasses import dataclass

RAY_NAMESPACE = "hybridflow"
"""The Ray namespace of every named hybridflow actor: the controller and its host actors."""

DEFAULT_NAMESPACE = "default"
"""The Kubernetes namespace of a job whose metadata names none (a local `hybridflow run`)."""


@dataclass(frozen=True)
class JobRef:
    """A job as Kubernetes names it: namespace and name."""

    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


def job_ref(job: str, namespace: str | None = None) -> JobRef:
    """`name` or `namespace/name`; `namespace` fills in (or must agree with) the namespace part."""
    parts = job.split("/")
    if len(parts) > 2 or not all(parts):
        raise ValueError(f"job {job!r}: expected NAME or NAMESPACE/NAME")
    if len(parts) == 2:
        if namespace is not None and namespace != parts[0]:
            raise ValueError(f"job {job!r} names namespace {parts[0]!r}, but namespace {namespace!r} was given")
        return JobRef(parts[0], parts[1])
    return JobRef(namespace or DEFAULT_NAMESPACE, parts[0])


def controller_name(ref: JobRef) -> str:
    """The controller actor's name in RAY_NAMESPACE: one per job and Ray cluster."""
    return f"controller/{ref.namespace}/{ref.name}"
