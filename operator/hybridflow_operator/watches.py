"""The informers that feed the reconciler: RLTrainingJobs, our RayJobs, and Ray pods not yet bound.

One list+watch per kind and namespace (cluster-wide: one per kind), filtered by the API server: RayJobs
and pods by our job label, pods also by `spec.nodeName=` (only a pod not yet bound to a node can be
unschedulable; once bound it arrives as DELETED). A job is parsed into a JobView here, once per event.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridflow.api import KIND, PLURAL
from hybridflow.k8s.names import JOB_API_VERSION, JOB_LABEL
from hybridflow_operator.machinery.informer import Informer, Source, collection_path
from hybridflow_operator.observed import JobView
from hybridflow_operator.reconciler import Reconciler


def informers(reconciler: Reconciler, namespaces: tuple[str, ...]) -> list[Informer]:
    """Every informer the reconciler needs; it holds its runs until each has listed once."""

    def job_event(obj: Mapping[str, Any], event_type: str) -> None:
        reconciler.job_event(JobView.parse(obj), event_type)

    out = []
    for namespace in namespaces or (None,):
        where = namespace or "all namespaces"
        sources = (
            (Source(collection_path(JOB_API_VERSION, PLURAL, namespace), KIND), job_event, "RLTrainingJobs"),
            (Source(collection_path("ray.io/v1", "rayjobs", namespace), "RayJob", JOB_LABEL),
             reconciler.rayjob_event, "RayJobs"),
            (Source(collection_path("v1", "pods", namespace), "Pod", JOB_LABEL, "spec.nodeName="),
             reconciler.pod_event, "unbound Ray pods"),
        )
        for source, on_event, what in sources:
            informer = Informer(reconciler.kube, source, on_event, name=f"{what} in {where}")
            reconciler.follows(informer.synced)
            out.append(informer)
    return out
