"""Names and labels of the objects an RLTrainingJob owns.

Names are a pure function of the job name, so a restarted operator finds what it created before
instead of creating it twice.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Collection, Mapping

from hybridflow.api import API_GROUP, API_VERSION
from hybridflow.api.pod import in_domains

JOB_API_VERSION = f"{API_GROUP}/{API_VERSION}"
MAX_RAYJOB_NAME = 47  # KubeRay: RayCluster names <= 53 and it appends "-" + 5 characters
HASH_LEN = 6

NAME_LABEL = "app.kubernetes.io/name"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
JOB_LABEL = f"{API_GROUP}/job"
POOL_LABEL = f"{API_GROUP}/pool"
GENERATION_ANNOTATION = f"{API_GROUP}/generation"
CLUSTER_HASH_ANNOTATION = f"{API_GROUP}/cluster-hash"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_CLASS_LABEL = "kueue.x-k8s.io/priority-class"
"""Kueue reads a workload's priority from this label on the RayJob: the job's passes through."""
RESERVED_DOMAINS = (
    "kubernetes.io", "k8s.io", "x-k8s.io", API_GROUP, "ray.io",
    "argoproj.io", "fluxcd.io", "helm.sh", "k14s.io", "kopf.zalando.org",
)
"""Label and annotation domains (and their subdomains) that a job's labels and annotations do not pass on to
its RayJob and pods: Kubernetes' own (kubectl.kubernetes.io/last-applied-configuration, ...), Kueue's and
other SIG projects', the operator's and KubeRay's (which would change how KubeRay runs the cluster), kopf's
bookkeeping, and the GitOps tools' tracking labels and annotations (app.kubernetes.io/instance,
argocd.argoproj.io/tracking-id, kustomize.toolkit.fluxcd.io/name, meta.helm.sh/release-name,
kapp.k14s.io/app, ...), which would make Argo CD, Flux, Helm or kapp claim, or prune, objects that are not
in Git."""
RAY_GROUP_LABEL = "ray.io/group"
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
"""The Job controller's label on a Job's pods: KubeRay's submitter Job is named after the RayJob."""

_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def short_hash(text: str, length: int = HASH_LEN) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def rayjob_name(job_name: str) -> str:
    """The job name when KubeRay accepts it (DNS-1035, <= 47), else a prefix plus a hash of the full name."""
    if len(job_name) <= MAX_RAYJOB_NAME and _DNS1035.match(job_name):
        return job_name
    base = job_name if job_name[:1].isalpha() else f"rl-{job_name}"
    prefix = base[: MAX_RAYJOB_NAME - HASH_LEN - 1].rstrip("-")
    return f"{prefix}-{short_hash(job_name)}"


def head_service_name(ray_cluster: str) -> str:
    """KubeRay's Service for a RayCluster's head: it follows a retry's new cluster (through
    status.rayClusterName), where the RayJob's `<rayJobName>-head-svc` stays on the first one's name.
    <= 63 characters (RayCluster names are <= 53)."""
    return f"{ray_cluster}-head-svc"


def config_map_name(job_name: str) -> str:
    return f"{job_name}-config"


def network_policy_name(job_name: str) -> str:
    return f"{job_name}-ray"


def runtime_identity_name(job_name: str) -> str:
    """ServiceAccount, Role and RoleBinding share this name."""
    return f"{job_name}-runtime"


def labels(job_name: str) -> dict[str, str]:
    """Every child carries these; JOB_LABEL maps a child (or a Ray pod) back to its job."""
    return {NAME_LABEL: "hybridflow", MANAGED_BY_LABEL: "hybridflow-operator", JOB_LABEL: job_name}


def ray_pod_labels(job_name: str, *layers: Mapping[str, str]) -> dict[str, str]:
    """Of the Ray pods: `layers` in order, then `labels`, less app.kubernetes.io/name, whoever set it. KubeRay
    gives its pods `kuberay` there, and its head Services (the RayCluster's and the RayJob's
    `<rayJobName>-head-svc`, which `kubectl ray session` forwards) select the head by it."""
    merged = {k: v for layer in layers for k, v in layer.items()} | labels(job_name)
    merged.pop(NAME_LABEL)
    return merged


def propagated(job_metadata: Mapping[str, str], passthrough: Collection[str] = ()) -> dict[str, str]:
    """The job's labels or annotations its RayJob or pods carry too: all but those in RESERVED_DOMAINS, except
    the keys in `passthrough`."""
    return {k: v for k, v in job_metadata.items() if k in passthrough or not in_domains(k, RESERVED_DOMAINS)}
