"""Which worker group each resource pool of the dataflow graph runs on, and how wide each node runs.

One KubeRay worker group per graph pool. With spec.cluster.workerGroups the groups are the user's
and the built-in graph's parallelism follows from their GPUs; without them the groups are sized
from the graph (8 GPUs per pod). Problems the CRD cannot see raise RenderError.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from hybridflow.api import RLTrainingJobSpec, WorkerGroup
from hybridflow.api.schema import CpuAmount
from hybridflow.graph import DataflowGraph, GraphError
from hybridflow.k8s.errors import RenderError
from hybridflow.plan import ResourcePlan, resource_plan, trainable_graph

GPUS_PER_POD = 8
MEMORY_PER_CPU_GI = 4  # CPU-only pools derived from the graph
_EPS = 1e-9


@dataclass(frozen=True)
class WorkerGroupPlan:
    """One KubeRay worker group: pods of `gpus`/`cpus`/`memory`, placed next to group `near` if set."""

    name: str
    replicas: int
    min_replicas: int
    max_replicas: int
    gpus: int
    cpus: CpuAmount
    memory: str
    source: str
    """Where the group came from, for error messages: spec.cluster.workerGroups[i] or spec.graph."""
    near: str | None = None

    @property
    def total_gpus(self) -> int:
        return self.replicas * self.gpus


@dataclass(frozen=True)
class Layout:
    graph: DataflowGraph
    groups: tuple[WorkerGroupPlan, ...]
    rollout_group: str | None
    """The group of the actor_rollout node: the one whose replicas may change while the job runs."""


def plan_layout(spec: RLTrainingJobSpec, gpu_products: Mapping[str, Sequence[str]]) -> Layout:
    """Resolve the graph and its worker groups; raise RenderError naming the field to fix."""
    _check_unique_groups(spec.cluster.worker_groups)
    plan = resource_plan(_resolve_graph(spec))
    if spec.cluster.worker_groups:
        groups = _user_groups(spec.cluster.worker_groups, plan.pools)
    else:
        groups = _derived_groups(plan)
    if any(g.gpus for g in groups) and spec.cluster.gpu_type not in gpu_products:
        raise RenderError("spec.cluster.gpuType", "UnknownGPUType",
                          f"unknown GPU type {spec.cluster.gpu_type!r}; known: {', '.join(sorted(gpu_products))} "
                          "(the operator's HYBRIDFLOW_GPU_PRODUCTS setting adds more)")
    _check_capacity(plan, {g.name: g for g in groups})
    groups = [replace(g, near=plan.neighbours.get(g.name)) for g in groups]
    return Layout(graph=plan.graph, groups=tuple(groups), rollout_group=plan.rollout_pool)


def _check_unique_groups(groups: Sequence[WorkerGroup]) -> None:
    seen: set[str] = set()
    for i, g in enumerate(groups):
        if g.name in seen:
            raise RenderError(f"spec.cluster.workerGroups[{i}].name", "DuplicateWorkerGroup",
                              f"worker group {g.name!r} is named twice")
        seen.add(g.name)


def _resolve_graph(spec: RLTrainingJobSpec) -> DataflowGraph:
    """spec.graph as written, or the built-in graph as wide as the worker groups' GPUs allow.

    A graph that cannot train (plan.trainable_graph: PPO without a reward node, ...) is a RenderError
    too, so the job stalls before any pod exists rather than failing inside its Ray cluster.
    """
    try:
        if spec.graph is not None:
            return trainable_graph(spec)
        if not spec.cluster.worker_groups:
            return trainable_graph(spec, "GPU", GPUS_PER_POD, GPUS_PER_POD)
        probe = resource_plan(trainable_graph(spec, "GPU", 1, 1))
        widths = {role: _width(spec, probe, role) for role in ("actor_rollout", "critic") if probe.graph.first(role)}
        return trainable_graph(spec, "GPU", widths["actor_rollout"], widths.get("critic"))
    except GraphError as e:
        # each problem names its field already; spec.graph is the one the condition points at
        message = "; ".join(p.removeprefix("spec.graph: ") for p in e.problems)
        raise RenderError("spec.graph", "InvalidGraph", message) from None


def _width(spec: RLTrainingJobSpec, probe: ResourcePlan, role: str) -> int:
    """Instances of a built-in node: one per bundle of whole GPUs in its pool's worker group."""
    node = probe.graph.first(role)
    assert node is not None
    index, group = _find_group(spec.cluster.worker_groups, node.pool, probe.pools)
    per_instance = max(1, math.ceil(probe.instance_gpus[node.name] - _EPS))
    width = (group.replicas * group.gpus_per_worker) // per_instance
    if width < 1:
        raise RenderError(f"spec.cluster.workerGroups[{index}]", "InsufficientGPUs",
                          f"worker group {group.name!r} holds {group.replicas * group.gpus_per_worker} GPUs; "
                          f"{node.name} needs at least {per_instance}")
    return width


def _find_group(groups: Sequence[WorkerGroup], pool: str, pools: Sequence[str]) -> tuple[int, WorkerGroup]:
    for i, g in enumerate(groups):
        if g.name == pool:
            return i, g
    raise RenderError("spec.cluster.workerGroups", "MissingWorkerGroup",
                      f"no worker group named {pool!r} for the graph pool of that name "
                      f"(the graph's pools: {', '.join(pools)})")


def _user_groups(groups: Sequence[WorkerGroup], pools: Sequence[str]) -> list[WorkerGroupPlan]:
    for pool in pools:
        _find_group(groups, pool, pools)
    plans = []
    for i, g in enumerate(groups):
        source = f"spec.cluster.workerGroups[{i}]"
        if g.name not in pools:
            raise RenderError(f"{source}.name", "UnknownWorkerGroup",
                              f"worker group {g.name!r} matches no graph pool (pools: {', '.join(pools)}); "
                              "its pods would hold resources nothing uses")
        low = g.replicas if g.min_replicas is None else g.min_replicas  # the spec keeps low <= replicas <= high
        high = g.replicas if g.max_replicas is None else g.max_replicas
        plans.append(WorkerGroupPlan(g.name, g.replicas, low, high, g.gpus_per_worker, g.cpus_per_worker, g.memory,
                                     source))
    return plans


def _derived_groups(plan: ResourcePlan) -> list[WorkerGroupPlan]:
    """GPU pools: as few pods of up to 8 GPUs as hold the pool, sharing its instances evenly (an instance of k
    GPUs, such as a tensor-parallel vLLM engine, never straddles two pods); CPU pools: one pod with the CPUs
    asked."""
    defaults = WorkerGroup(name="default")
    groups = []
    for pool in plan.pools:
        need = plan.demand[pool]
        gpus = math.ceil(need.get("GPU", 0.0) - _EPS)
        if gpus > 0:
            per = max(1, math.ceil(need.largest_bundle.get("GPU", 0.0) - _EPS))
            room = max(per, GPUS_PER_POD // per * per)
            pods = math.ceil(gpus / room)
            each = math.ceil(gpus / pods / per) * per
            group = WorkerGroupPlan(pool, pods, pods, pods, each, defaults.cpus_per_worker,
                                    defaults.memory, "spec.graph")
        else:
            cpus = max(1, math.ceil(need.get("CPU", 0.0) - _EPS))
            group = WorkerGroupPlan(pool, 1, 1, 1, 0, cpus, f"{cpus * MEMORY_PER_CPU_GI}Gi", "spec.graph")
        groups.append(group)
    return groups


def _check_capacity(plan: ResourcePlan, groups: Mapping[str, WorkerGroupPlan]) -> None:
    for cg in plan.groups:
        per_instance = cg.bundle.get("GPU", 0.0)
        group = groups[cg.pool]
        if per_instance > group.gpus + _EPS:
            names = ", ".join(n.name for n in cg.nodes)
            raise RenderError(group.source, "InsufficientGPUs",
                              f"one instance of {names} needs {per_instance:g} GPUs but a pod of worker group "
                              f"{group.name!r} has {group.gpus}")
    for pool, need in plan.demand.items():
        group = groups[pool]
        gpus = need.get("GPU", 0.0)
        if gpus > group.total_gpus + _EPS:
            raise RenderError(group.source, "InsufficientGPUs",
                              f"graph pool {pool!r} needs {gpus:g} GPUs but worker group {group.name!r} holds "
                              f"{group.total_gpus} ({group.replicas} x {group.gpus})")
