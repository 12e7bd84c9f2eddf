"""RLTrainingJob -> the manifests it owns: ConfigMap, ServiceAccount, Role, RoleBinding, (NetworkPolicy,) RayJob.

Pure: the operator applies exactly this and `hybridflow render FILE` prints exactly this. Nothing here
reads a Secret: the pods reference the job's Secrets by name (spec.cluster env, envFrom, volumes), and
their values reach the containers only through the kubelet.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pydantic_core

from hybridflow.api import API_GROUP, KIND, PLURAL, RLTrainingJob, SpecError, parse_job, yaml_text
from hybridflow.k8s import names
from hybridflow.k8s.contract import CONFIG_FILE, ENTRYPOINT
from hybridflow.k8s.errors import RenderError
from hybridflow.k8s.layout import Layout, plan_layout
from hybridflow.k8s.pods import PodContext, head_group, needs_submitter_template, submitter_template, worker_group
from hybridflow.k8s.settings import RenderSettings

__all__ = ["ENTRYPOINT", "RenderError", "Rendered", "as_job", "render", "render_children", "render_manifests"]


@dataclass(frozen=True)
class Rendered:
    job: RLTrainingJob
    layout: Layout
    children: list[dict]


def as_job(job: Mapping[str, Any] | RLTrainingJob) -> RLTrainingJob:
    """The typed job; a spec the API models reject is a RenderError on `spec`."""
    if isinstance(job, RLTrainingJob):
        return job
    try:
        return parse_job(dict(job), source="spec")
    except SpecError as e:
        raise RenderError("spec", "InvalidSpec", "; ".join(e.problems)) from None


def render_children(job: Mapping[str, Any] | RLTrainingJob, settings: RenderSettings) -> list[dict]:
    """ConfigMap, ServiceAccount, Role, RoleBinding, the NetworkPolicy when the settings ask for one, and the
    RayJob, in the order they should be created."""
    return render(job, settings).children


def render(job: Mapping[str, Any] | RLTrainingJob, settings: RenderSettings) -> Rendered:
    """The children with the layout they came from (the operator needs its rollout group)."""
    job = as_job(job)
    layout = plan_layout(job.spec, settings.gpu_products)
    name = job.metadata.name
    namespace = job.metadata.namespace or "default"
    identity = names.runtime_identity_name(name)
    children = [
        _config_map(job, layout, namespace),
        _service_account(job, identity, namespace),
        _role(name, identity, namespace),
        _role_binding(identity, namespace),
    ]
    if settings.network_policy_peers is not None:
        children.append(_network_policy(job, namespace, settings.network_policy_peers))
    children.append(_rayjob(job, layout, settings, namespace))
    owner = owner_reference(name, (job.metadata.model_extra or {}).get("uid"))
    for child in children:
        child["metadata"]["labels"] = {**names.labels(name), **child["metadata"].get("labels", {})}
        if owner:
            child["metadata"]["ownerReferences"] = [owner]
    return Rendered(job, layout, children)


def render_manifests(job: Mapping[str, Any] | RLTrainingJob, settings: RenderSettings) -> str:
    """The children as multi-document YAML."""
    return yaml_text.dump_all(render_children(job, settings))


def owner_reference(name: str, uid: str | None) -> dict | None:
    """Controller reference to the job; None for a job read from a file (no uid yet)."""
    if not uid:
        return None
    return {"apiVersion": names.JOB_API_VERSION, "kind": KIND, "name": name, "uid": uid,
            "controller": True, "blockOwnerDeletion": True}


def cluster_hash(rayjob: Mapping[str, Any], rollout_group: str | None) -> str:
    """Hash of the cluster layout that cannot change on a running RayJob (rollout replicas excluded)."""
    spec = json.loads(json.dumps(rayjob["spec"]["rayClusterSpec"]))
    for group in spec.get("workerGroupSpecs", []):
        if group["groupName"] == rollout_group:
            for key in ("replicas", "minReplicas", "maxReplicas"):
                group.pop(key, None)
    return names.short_hash(json.dumps(spec, sort_keys=True), 16)


# -- children ---------------------------------------------------------------------------------------


def _object(api_version: str, kind: str, name: str, namespace: str) -> dict:
    return {"apiVersion": api_version, "kind": kind, "metadata": {"name": name, "namespace": namespace}}


def _config_map(job: RLTrainingJob, layout: Layout, namespace: str) -> dict:
    """The job as the runtime reads it: the spec with the resolved graph (parallelism filled in).

    JSON, not YAML: emitting YAML took most of a render, and a burst of new jobs waits on renders.
    """
    spec = job.spec.to_yaml_dict()
    spec["graph"] = layout.graph.to_spec().to_yaml_dict()
    doc = {"apiVersion": names.JOB_API_VERSION, "kind": KIND,
           "metadata": {"name": job.metadata.name, "namespace": namespace}, "spec": spec}
    cm = _object("v1", "ConfigMap", names.config_map_name(job.metadata.name), namespace)
    cm["data"] = {CONFIG_FILE: pydantic_core.to_json(doc, indent=2).decode()}
    return cm


def _service_account(job: RLTrainingJob, identity: str, namespace: str) -> dict:
    """Every Ray pod runs as it; its annotations bind it to a cloud identity (GKE, EKS, AKS workload identity)."""
    sa = _object("v1", "ServiceAccount", identity, namespace)
    settings = job.spec.cluster.service_account
    if settings is not None and settings.annotations:
        sa["metadata"]["annotations"] = dict(settings.annotations)
    return sa


def _role(job_name: str, identity: str, namespace: str) -> dict:
    """Patch this one job's status (the runtime's progress reports); nothing else: not its spec, not another
    job, no Secret. The runtime reads its spec from the ConfigMap, mounted by the kubelet."""
    role = _object("rbac.authorization.k8s.io/v1", "Role", identity, namespace)
    role["rules"] = [
        {"apiGroups": [API_GROUP], "resources": [f"{PLURAL}/status"], "resourceNames": [job_name],
         "verbs": ["patch"]},
    ]
    return role


def _role_binding(identity: str, namespace: str) -> dict:
    binding = _object("rbac.authorization.k8s.io/v1", "RoleBinding", identity, namespace)
    binding["roleRef"] = {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": identity}
    binding["subjects"] = [{"kind": "ServiceAccount", "name": identity, "namespace": namespace}]
    return binding


def _network_policy(job: RLTrainingJob, namespace: str, peers: tuple[Mapping[str, Any], ...]) -> dict:
    """Ray's ports (GCS, dashboard, client, object transfer) have no authentication: the job's Ray pods accept
    traffic only from one another, from KubeRay's submitter pod of the job (K8sJobMode), and from `peers`
    (the operator and KubeRay's operator, which polls the head's dashboard). Egress stays open.

    Port-forwarding to the head (`kubectl port-forward`) is not network traffic to the pod: it still works.
    """
    name = job.metadata.name
    sources: list[dict[str, Any]] = [{"podSelector": {"matchLabels": {names.JOB_LABEL: name}}}]
    if job.spec.cluster.submission_mode == "K8sJobMode":
        sources.append({"podSelector": {"matchLabels": {names.JOB_NAME_LABEL: names.rayjob_name(name)}}})
    sources += [copy.deepcopy(dict(peer)) for peer in peers]
    policy = _object("networking.k8s.io/v1", "NetworkPolicy", names.network_policy_name(name), namespace)
    policy["spec"] = {
        "podSelector": {"matchLabels": {names.JOB_LABEL: name}},
        "policyTypes": ["Ingress"],
        "ingress": [{"from": sources}],
    }
    return policy


def _rayjob(job: RLTrainingJob, layout: Layout, settings: RenderSettings, namespace: str) -> dict:
    name = job.metadata.name
    cluster = job.spec.cluster
    policy = job.spec.run_policy
    ctx = PodContext(
        job_name=name,
        namespace=namespace,
        image=cluster.image or settings.runtime_image,
        service_account=names.runtime_identity_name(name),
        config_map=names.config_map_name(name),
        labels=names.ray_pod_labels(name, names.propagated(job.metadata.labels), cluster.pod_labels),
        annotations={**names.propagated(job.metadata.annotations), **cluster.pod_annotations},
        cluster=cluster,
        gpu_products=tuple(settings.gpu_products.get(cluster.gpu_type, ())),
        progress_interval=settings.progress_interval,
    )
    spec: dict[str, Any] = {
        "entrypoint": ENTRYPOINT,
        "submissionMode": cluster.submission_mode,
        "shutdownAfterJobFinishes": True,
        "ttlSecondsAfterFinished": policy.ttl_seconds_after_finished,
        "backoffLimit": policy.backoff_limit,
        "suspend": policy.suspend,
        "rayClusterSpec": {
            "rayVersion": cluster.ray_version,
            "enableInTreeAutoscaling": False,
            "headGroupSpec": head_group(ctx),
            "workerGroupSpecs": [worker_group(g, ctx) for g in layout.groups],
        },
    }
    if policy.active_deadline_seconds is not None:
        spec["activeDeadlineSeconds"] = policy.active_deadline_seconds
    if needs_submitter_template(cluster):
        spec["submitterPodTemplate"] = submitter_template(ctx)
    rayjob = _object("ray.io/v1", "RayJob", names.rayjob_name(name), namespace)
    rayjob["spec"] = spec
    labels = names.propagated(job.metadata.labels, passthrough=(names.PRIORITY_CLASS_LABEL,))
    if cluster.queue_name:
        labels[names.QUEUE_LABEL] = cluster.queue_name
    if labels:
        rayjob["metadata"]["labels"] = labels
    annotations = names.propagated(job.metadata.annotations)
    annotations[names.CLUSTER_HASH_ANNOTATION] = cluster_hash(rayjob, layout.rollout_group)
    generation = (job.metadata.model_extra or {}).get("generation")
    if generation is not None:
        annotations[names.GENERATION_ANNOTATION] = str(generation)
    rayjob["metadata"]["annotations"] = annotations
    return rayjob



