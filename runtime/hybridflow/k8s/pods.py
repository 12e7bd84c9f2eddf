"""Ray head and worker group specs (KubeRay v1) for a planned layout.

GPU pods: pinned to the GPU products of spec.cluster.gpuType, tolerate the nvidia.com/gpu taint,
limits equal requests (KubeRay reads GPUs from limits), a memory-backed /dev/shm of spec size, NCCL
settings. Pods without GPUs get NVIDIA_VISIBLE_DEVICES=void so the container runtime hides the
node's GPUs from them. Every Ray container drops all capabilities and may not gain privileges.

The pod settings of spec.cluster (volumes, mounts, env, envFrom, imagePullSecrets, priorityClassName,
pod labels and annotations, which win over the job's own) go into the head and every worker group alike,
after the operator's own: its variables come first, so the user's may reference them as
$(HYBRIDFLOW_JOB_NAME), and an explicit variable wins over envFrom in Kubernetes, so a Secret cannot
shadow them.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hybridflow.api import Cluster
from hybridflow.api.schema import CpuAmount, cpu_cores
from hybridflow.k8s.contract import (
    CONFIG_DIR,
    CONFIG_PATH,
    DASHBOARD_PORT,
    DASHBOARD_PORT_NAME,
    ENV_CONFIG,
    ENV_JOB_NAME,
    ENV_JOB_NAMESPACE,
    ENV_PROGRESS_INTERVAL,
    pool_resource,
)
from hybridflow.k8s.layout import WorkerGroupPlan
from hybridflow.k8s.names import JOB_LABEL, POOL_LABEL, RAY_GROUP_LABEL

GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
HOSTNAME_TOPOLOGY = "kubernetes.io/hostname"
HEAD_PORTS = (("gcs-server", 6379), ("dashboard", 8265), ("client", 10001), (DASHBOARD_PORT_NAME, DASHBOARD_PORT))
"""Ray's ports, and the scheduler dashboard the driver serves on the head (KubeRay's head Services expose each)."""
RAY_CONTAINER_SECURITY: dict = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
"""Ray needs no Linux capability and no setuid: every Ray container drops them all. (Not a read-only root:
Ray writes its session under /tmp/ray; not a user: the image's own, uid 1000 in Ray's images.)"""
_CONFIG_VOLUME = "hybridflow-config"
_SHM_VOLUME = "dshm"


@dataclass(frozen=True)
class PodContext:
    """What every Ray pod of one job shares."""

    job_name: str
    namespace: str
    image: str
    service_account: str
    config_map: str
    labels: Mapping[str, str]
    """Of every pod: names.ray_pod_labels."""
    annotations: Mapping[str, str]
    """Of every pod: the job's propagated annotations, then spec.cluster.podAnnotations."""
    cluster: Cluster
    gpu_products: Sequence[str]
    progress_interval: float
    """Seconds between two status.progress patches (settings.RenderSettings)."""


def head_group(ctx: PodContext) -> dict:
    """No GPUs and num-cpus 0: the driver and Ray's own services stay off the training path."""
    container = {
        "name": "ray-head",
        "image": ctx.image,
        "securityContext": _security(),
        "imagePullPolicy": "IfNotPresent",
        "ports": [{"name": name, "containerPort": port} for name, port in HEAD_PORTS],
        "resources": _resources(ctx.cluster.head_cpus, ctx.cluster.head_memory, 0),
        "env": [*_runtime_env(ctx), _env("NVIDIA_VISIBLE_DEVICES", "void")],
        "volumeMounts": [_config_mount()],
    }
    return {
        "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0"},
        "template": _template(ctx, dict(ctx.labels), container, [_config_volume(ctx)], gpu=False),
    }


def worker_group(plan: WorkerGroupPlan, ctx: PodContext) -> dict:
    gpu = plan.gpus > 0
    env = _runtime_env(ctx)
    env += _nccl_env(ctx.cluster) if gpu else [_env("NVIDIA_VISIBLE_DEVICES", "void")]
    mounts = [_config_mount()]
    volumes = [_config_volume(ctx)]
    if gpu:
        mounts.append({"name": _SHM_VOLUME, "mountPath": "/dev/shm"})
        volumes.append({"name": _SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": ctx.cluster.shm_size}})
    container = {
        "name": "ray-worker",
        "image": ctx.image,
        "securityContext": _security(),
        "imagePullPolicy": "IfNotPresent",
        "resources": _resources(plan.cpus, plan.memory, plan.gpus),
        "env": env,
        "volumeMounts": mounts,
    }
    template = _template(ctx, {**ctx.labels, POOL_LABEL: plan.name}, container, volumes,
                         gpu=gpu or plan.near is not None)
    affinity = _affinity(plan, ctx)
    if affinity:
        template["spec"]["affinity"] = affinity
    slots = plan.gpus if gpu else cpu_slots(plan.cpus)
    params = {"resources": ray_resources_param({pool_resource(plan.name): slots})}
    if gpu:
        params["num-gpus"] = str(plan.gpus)  # Ray's logical GPUs, whatever the image's drivers report
    return {
        "groupName": plan.name,
        "replicas": plan.replicas,
        "minReplicas": plan.min_replicas,
        "maxReplicas": plan.max_replicas,
        "rayStartParams": params,
        "template": template,
    }


def ray_resources_param(resources: Mapping[str, float]) -> str:
    """`ray start --resources` as KubeRay needs it: JSON in single quotes, without spaces.

    KubeRay pastes the value into a bash command line, and also parses it itself (after trimming quotes) to
    add GPU and accelerator resources: the form with escaped double quotes passes bash but not that parse,
    which then fails and drops `--num-gpus`.
    """
    return "'" + json.dumps(dict(resources), separators=(",", ":")) + "'"


def submitter_template(ctx: PodContext) -> dict:
    """KubeRay's default submitter pod (K8sJobMode) with the pod settings of spec.cluster.

    The default one runs the head's image and nothing else of the head's pod: without the job's pull secrets a
    private image would not pull, without its tolerations and node selector it may have no node to go to, and
    an image that needs the job's variables or mounts to find `ray` would not start. KubeRay fills in the
    command; requests and limits are KubeRay's defaults.
    """
    cluster = ctx.cluster
    container = _with_user_settings({
        "name": "ray-job-submitter",
        "image": ctx.image,
        "securityContext": _security(),
        "resources": {"requests": {"cpu": "500m", "memory": "200Mi"}, "limits": {"cpu": "1", "memory": "1Gi"}},
        "env": [],
        "volumeMounts": [],
    }, cluster)
    spec: dict = {"restartPolicy": "Never", "containers": [container]}
    spec |= _scheduling(cluster, gpu=False)
    if cluster.volumes:
        spec["volumes"] = [v.to_yaml_dict() for v in cluster.volumes]
    return {"spec": spec}  # no job label: the operator's pod watch is for Ray pods only


def needs_submitter_template(cluster: Cluster) -> bool:
    """Whether KubeRay's default submitter pod would lack something the job's pods need."""
    return cluster.submission_mode == "K8sJobMode" and bool(
        cluster.image_pull_secrets or cluster.tolerations or cluster.node_selector or cluster.env
        or cluster.env_from or cluster.volumes or cluster.priority_class_name)


def _scheduling(cluster: Cluster, *, gpu: bool) -> dict:
    """Pull secrets, priority, node selector and tolerations of a pod (GPU pods tolerate the GPU taint)."""
    tolerations = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}] if gpu else []
    tolerations += [t.to_yaml_dict() for t in cluster.tolerations]
    spec: dict = {}
    if cluster.image_pull_secrets:
        spec["imagePullSecrets"] = [s.to_yaml_dict() for s in cluster.image_pull_secrets]
    if cluster.priority_class_name:
        spec["priorityClassName"] = cluster.priority_class_name
    if cluster.node_selector:
        spec["nodeSelector"] = dict(cluster.node_selector)
    if tolerations:
        spec["tolerations"] = tolerations
    return spec


def _template(ctx: PodContext, labels: dict, container: dict, volumes: list[dict], *, gpu: bool) -> dict:
    """The pod template: the operator's container and volumes, then the pod settings of spec.cluster."""
    cluster = ctx.cluster
    volumes = [*volumes, *(v.to_yaml_dict() for v in cluster.volumes)]
    container = _with_user_settings(container, cluster)
    spec: dict = {"serviceAccountName": ctx.service_account, "containers": [container], "volumes": volumes}
    spec |= _scheduling(cluster, gpu=gpu)
    metadata: dict = {"labels": labels}
    if ctx.annotations:
        metadata["annotations"] = dict(ctx.annotations)
    return {"metadata": metadata, "spec": spec}


def _with_user_settings(container: dict, cluster: Cluster) -> dict:
    """The container with spec.cluster's env, envFrom and volumeMounts after the operator's own."""
    out = {
        **container,
        "env": [*container["env"], *(e.to_yaml_dict() for e in cluster.env)],
        "volumeMounts": [*container["volumeMounts"], *(m.to_yaml_dict() for m in cluster.volume_mounts)],
    }
    if cluster.env_from:
        out["envFrom"] = [e.to_yaml_dict() for e in cluster.env_from]
    return out


def _affinity(plan: WorkerGroupPlan, ctx: PodContext) -> dict:
    affinity: dict = {}
    if plan.gpus > 0:
        term = {"matchExpressions": [{"key": GPU_PRODUCT_LABEL, "operator": "In", "values": list(ctx.gpu_products)}]}
        affinity["nodeAffinity"] = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}
    if plan.near:
        selector = {"matchLabels": {JOB_LABEL: ctx.job_name, RAY_GROUP_LABEL: plan.near}}
        affinity["podAffinity"] = {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": selector, "topologyKey": HOSTNAME_TOPOLOGY}
            ]
        }
    return affinity


def cpu_slots(cpus: CpuAmount) -> int:
    """Slots of a CPU pool's Ray resource on one pod: its cores rounded up, at least one.

    Up, as KubeRay rounds the pod's CPU limit up for Ray's num-cpus, so the slots match the CPUs Ray
    counts on the pod; down would leave a 500m pod with no slot, and nothing of its pool could run.
    """
    return max(1, math.ceil(cpu_cores(cpus)))


def _resources(cpus: CpuAmount, memory: str, gpus: int) -> dict:
    """The amounts as written: Kubernetes reads "500m" and 2 itself; limits equal requests."""
    amounts = {"cpu": str(cpus), "memory": memory}
    if gpus:
        amounts[GPU_RESOURCE] = str(gpus)
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _runtime_env(ctx: PodContext) -> list[dict]:
    """Lets the runtime find its config and patch its own job's status.progress, as often as the operator says."""
    return [
        _env(ENV_JOB_NAME, ctx.job_name),
        _env(ENV_JOB_NAMESPACE, ctx.namespace),
        _env(ENV_CONFIG, CONFIG_PATH),
        _env(ENV_PROGRESS_INTERVAL, f"{ctx.progress_interval:g}"),
    ]


def _nccl_env(cluster: Cluster) -> list[dict]:
    """NCCL_CUMEM_ENABLE=0 as verl sets it; the interface/InfiniBand settings only when given."""
    nccl = cluster.nccl
    env = [_env("NCCL_CUMEM_ENABLE", "0")]
    optional = {
        "NCCL_SOCKET_IFNAME": nccl.socket_ifname,
        "NCCL_IB_HCA": nccl.ib_hca,
        "NCCL_IB_DISABLE": None if nccl.ib_disable is None else str(int(nccl.ib_disable)),
        "NCCL_DEBUG": nccl.debug,
    }
    return env + [_env(k, v) for k, v in optional.items() if v is not None]


def _config_mount() -> dict:
    return {"name": _CONFIG_VOLUME, "mountPath": CONFIG_DIR, "readOnly": True}


def _config_volume(ctx: PodContext) -> dict:
    return {"name": _CONFIG_VOLUME, "configMap": {"name": ctx.config_map}}


def _security() -> dict:
    return copy.deepcopy(RAY_CONTAINER_SECURITY)


def _env(name: str, value: str) -> dict:
    return {"name": name, "value": value}
