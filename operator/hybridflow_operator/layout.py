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
from hybridflow.graph import DataflowGraph, GraphError, graph_for
from hybridflow_operator.errors import RenderError

GPUS_PER_POD = 8
MEMORY_PER_CPU_GI = 4  # CPU-only pools derived from the graph
KUEUE_MAX_WORKER_GROUPS = 7
_EPS = 1e-9


@dataclass(frozen=True)
class GroupPlan:
    """One Ray worker group: pods of `gpus`/`cpus`/`memory`, placed next to group `near` if set."""

    name: str
    replicas: int
    min_replicas: int
    max_replicas: int
    gpus: int
    cpus: int
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
    groups: tuple[GroupPlan, ...]
    rollout_group: str | None
    """The group of the actor_rollout node: the one whose replicas may change while the job runs."""


def plan_layout(spec: RLTrainingJobSpec, gpu_products: Mapping[str, Sequence[str]]) -> Layout:
    """Resolve the graph and its worker groups; raise RenderError naming the field to fix."""
    _check_unique_groups(spec.cluster.worker_groups)
    graph = _resolve_graph(spec)
    pools = pool_order(graph)
    groups = _user_groups(spec.cluster.worker_groups, pools) if spec.cluster.worker_groups else _derived_groups(graph)
    if spec.cluster.queue_name and len(groups) > KUEUE_MAX_WORKER_GROUPS:
        raise RenderError("spec.cluster.workerGroups", "TooManyWorkerGroups",
                          f"Kueue admits at most {KUEUE_MAX_WORKER_GROUPS} worker groups, "
                          f"the graph needs {len(groups)}")
    if any(g.gpus for g in groups) and spec.cluster.gpu_type not in gpu_products:
        raise RenderError("spec.cluster.gpuType", "UnknownGPUType",
                          f"unknown GPU type {spec.cluster.gpu_type!r}; known: {', '.join(sorted(gpu_products))} "
                          "(the operator's HYBRIDFLOW_GPU_PRODUCTS setting adds more)")
    _check_capacity(graph, {g.name: g for g in groups})
    near = _reward_neighbours(graph)
    groups = [replace(g, near=near.get(g.name)) for g in groups]
    actor = graph.first("actor_rollout")
    return Layout(graph=graph, groups=tuple(groups), rollout_group=actor.pool if actor else None)


def pool_order(graph: DataflowGraph) -> list[str]:
    return list(dict.fromkeys(n.pool for n in graph.nodes))


def instance_gpus(graph: DataflowGraph, node_name: str) -> float:
    """GPUs of the bundle one instance of the node shares with its co-located nodes."""
    for group in graph.colocation_groups():
        if any(n.name == node_name for n in group.nodes):
            return float(group.bundle.get("GPU", 0.0))
    raise KeyError(node_name)


def _check_unique_groups(groups: Sequence[WorkerGroup]) -> None:
    seen: set[str] = set()
    for i, g in enumerate(groups):
        if g.name in seen:
            raise RenderError(f"spec.cluster.workerGroups[{i}].name", "DuplicateWorkerGroup",
                              f"worker group {g.name!r} is named twice")
        seen.add(g.name)


def _resolve_graph(spec: RLTrainingJobSpec) -> DataflowGraph:
    """spec.graph as written, or the built-in graph as wide as the worker groups' GPUs allow."""
    try:
        if spec.graph is not None:
            return graph_for(spec)
        if not spec.cluster.worker_groups:
            return graph_for(spec, "GPU", GPUS_PER_POD, GPUS_PER_POD)
        probe = graph_for(spec, "GPU", 1, 1)
        widths = {role: _width(spec, probe, role) for role in ("actor_rollout", "critic") if probe.first(role)}
        return graph_for(spec, "GPU", widths["actor_rollout"], widths.get("critic"))
    except GraphError as e:
        raise RenderError("spec.graph", "InvalidGraph", str(e)) from None


def _width(spec: RLTrainingJobSpec, probe: DataflowGraph, role: str) -> int:
    """Instances of a built-in node: one per bundle of whole GPUs in its pool's worker group."""
    node = probe.first(role)
    assert node is not None
    index, group = _find_group(spec.cluster.worker_groups, node.pool, pool_order(probe))
    per_instance = max(1, math.ceil(instance_gpus(probe, node.name) - _EPS))
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


def _user_groups(groups: Sequence[WorkerGroup], pools: Sequence[str]) -> list[GroupPlan]:
    for pool in pools:
        _find_group(groups, pool, pools)
    plans = []
    for i, g in enumerate(groups):
        source = f"spec.cluster.workerGroups[{i}]"
        if g.name not in pools:
            raise RenderError(f"{source}.name", "UnknownWorkerGroup",
                              f"worker group {g.name!r} matches no graph pool (pools: {', '.join(pools)}); "
                              "its pods would hold resources nothing uses")
        low = g.replicas if g.min_replicas is None else g.min_replicas
        high = max(g.replicas, low) if g.max_replicas is None else g.max_replicas
        if not low <= g.replicas <= high:
            raise RenderError(f"{source}.replicas", "InvalidReplicas",
                              f"replicas {g.replicas} must lie within minReplicas {low} and maxReplicas {high}")
        plans.append(GroupPlan(g.name, g.replicas, low, high, g.gpus_per_worker, g.cpus_per_worker, g.memory, source))
    return plans


def _derived_groups(graph: DataflowGraph) -> list[GroupPlan]:
    """GPU pools: ceil(GPUs / 8) pods sharing the GPUs evenly; CPU pools: one pod with the CPUs asked."""
    demand = graph.pool_demand()
    defaults = WorkerGroup(name="default")
    plans = []
    for pool in pool_order(graph):
        need = demand.get(pool, {})
        gpus = math.ceil(need.get("GPU", 0.0) - _EPS)
        if gpus > 0:
            pods = math.ceil(gpus / GPUS_PER_POD)
            plan = GroupPlan(pool, pods, pods, pods, math.ceil(gpus / pods), defaults.cpus_per_worker,
                             defaults.memory, "spec.graph")
        else:
            cpus = max(1, math.ceil(need.get("CPU", 0.0) - _EPS))
            plan = GroupPlan(pool, 1, 1, 1, 0, cpus, f"{cpus * MEMORY_PER_CPU_GI}Gi", "spec.graph")
        plans.append(plan)
    return plans


def _check_capacity(graph: DataflowGraph, groups: Mapping[str, GroupPlan]) -> None:
    for cg in graph.colocation_groups():
        per_instance = cg.bundle.get("GPU", 0.0)
        group = groups[cg.pool]
        if per_instance > group.gpus + _EPS:
            names = ", ".join(n.name for n in cg.nodes)
            raise RenderError(group.source, "InsufficientGPUs",
                              f"one instance of {names} needs {per_instance:g} GPUs but a pod of worker group "
                              f"{group.name!r} has {group.gpus}")
    for pool, need in graph.pool_demand().items():
        group = groups[pool]
        gpus = need.get("GPU", 0.0)
        if gpus > group.total_gpus + _EPS:
            raise RenderError(group.source, "InsufficientGPUs",
                              f"graph pool {pool!r} needs {gpus:g} GPUs but worker group {group.name!r} holds "
                              f"{group.total_gpus} ({group.replicas} x {group.gpus})")


def _reward_neighbours(graph: DataflowGraph) -> dict[str, str]:
    """Pools of only reward nodes that the actor feeds directly: they run on the actor's nodes."""
    near: dict[str, str] = {}
    for pool in pool_order(graph):
        members = [n for n in graph.nodes if n.pool == pool]
        if not all(n.role == "reward" for n in members):
            continue
        names = {n.name for n in members}
        for edge in graph.data_edges():
            src = graph.get(edge.src_name)
            if edge.dst_name in names and src.role == "actor_rollout" and src.pool != pool:
                near[pool] = src.pool
                break
    return near
