"""Placement planning: bundles, strategies, stages and what is missing.

Pure: nothing here talks to Ray, so every rule is unit-tested without a cluster. `hybrid.py` feeds in
what Ray reports (node totals, free resources, where bundles landed) and acts on the answers.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hybridflow.graph import ColocationGroup, DataflowGraph, GraphError
from hybridflow.k8s.contract import pool_resource

EMPTY_BUNDLE_CPU = 0.01
"""Ray rejects all-zero bundles, so a group that asks for nothing reserves this sliver of CPU."""

DP_ROLES = ("critic", "actor_rollout")
"""Roles that train: a group holding one of them with parallelism > 1 gets torch.distributed ranks."""

_SYNTHETIC_PREFIXES = ("node:", "bundle_group", "accelerator_type:")
_EPS = 1e-9


class PlacementError(RuntimeError):
    """The plan cannot be placed; `missing` maps each short resource to the amount lacking."""

    def __init__(self, message: str, missing: Mapping[str, float] | None = None,
                 problems: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.missing: dict[str, float] = dict(missing or {})
        self.problems: list[str] = list(problems)


# -- resource arithmetic -------------------------------------------------------------------------


def real_resources(resources: Mapping[str, float]) -> dict[str, float]:
    """Drop Ray's synthetic keys (node:<ip>, <res>_group_<pg id>, bundle_group_*): they are not capacity."""
    return {
        k: float(v) for k, v in resources.items()
        if "_group_" not in k and not k.startswith(_SYNTHETIC_PREFIXES)
    }


def scale(bundle: Mapping[str, float], n: int) -> dict[str, float]:
    return {k: v * n for k, v in bundle.items()}


def add(a: Mapping[str, float], b: Mapping[str, float]) -> dict[str, float]:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0.0) + v
    return out


def fits(demand: Mapping[str, float], have: Mapping[str, float]) -> bool:
    return all(v <= have.get(k, 0.0) + _EPS for k, v in demand.items() if v > 0)


def missing_resources(demand: Mapping[str, float], have: Mapping[str, float]) -> dict[str, float]:
    """Per resource: max(0, demand - have), only the positive ones."""
    out = {}
    for k, v in sorted(demand.items()):
        short = v - have.get(k, 0.0)
        if short > _EPS:
            out[k] = short
    return out


def describe_missing(demand: Mapping[str, float], total: Mapping[str, float],
                     available: Mapping[str, float] | None = None) -> str:
    """One clause per short resource, e.g. `GPU: need 4, cluster has 0 (missing 4)`."""
    have = total if available is None else available
    parts = []
    for res, short in missing_resources(demand, have).items():
        free = "" if available is None else f", {available.get(res, 0.0):g} free"
        parts.append(f"{res}: need {demand[res]:g}, cluster has {total.get(res, 0.0):g}{free} (missing {short:g})")
    return "; ".join(parts)


def per_node_max(node_totals: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The largest amount of each resource on any single node: a bundle never spans nodes."""
    out: dict[str, float] = {}
    for node in node_totals:
        for k, v in node.items():
            out[k] = max(out.get(k, 0.0), float(v))
    return out


def pin_to_pools(graph: DataflowGraph, cluster_resources: Mapping[str, float]) -> DataflowGraph:
    """Ask each node for its pool's Ray resource when the cluster advertises it.

    KubeRay worker groups rendered by the operator advertise pool_resource(group) (GPUs per pod, or CPUs
    for a group without GPUs); requesting the same share pins a node's instances to its own group.
    """
    for n in graph.nodes:
        key = pool_resource(n.pool)
        share = n.resources.get("GPU") or n.resources.get("CPU", 0.0)
        if key in cluster_resources and share > 0:
            n.resources[key] = share
    return graph


# -- the plan ------------------------------------------------------------------------------------


def group_name(group: ColocationGroup) -> str:
    return "+".join(n.name for n in group.nodes)


def bundle_for(group: ColocationGroup) -> dict[str, float]:
    """The group's summed per-instance demand, or EMPTY_BUNDLE_CPU of CPU when it asks for nothing."""
    bundle = {k: float(v) for k, v in group.bundle.items() if v > 0}
    return bundle or {"CPU": EMPTY_BUNDLE_CPU}


def torch_threads(bundle: Mapping[str, float]) -> int:
    """Threads a host's torch may use: the whole CPUs of its bundle, at least 1 (a GPU bundle asking for no
    CPU still needs one to drive its device)."""
    return max(1, math.floor(float(bundle.get("CPU", 0.0)) + 1e-9))


def whole_gpus(bundle: Mapping[str, float]) -> bool:
    gpus = float(bundle.get("GPU", 0.0))
    return gpus >= 1 and float(gpus).is_integer()


def is_data_parallel(group: ColocationGroup, dp_roles: Collection[str] = DP_ROLES) -> bool:
    """A critic always gets ranks (world size 1 included); other training roles once parallelism > 1."""
    roles = {n.role for n in group.nodes}
    return "critic" in roles or (group.parallelism > 1 and bool(roles & set(dp_roles)))


def actor_options(bundle: Mapping[str, float]) -> dict[str, Any]:
    """Ray actor options asking for exactly one bundle, so the actor always fits the bundle it targets."""
    opts: dict[str, Any] = {"num_cpus": float(bundle.get("CPU", 0.0)), "num_gpus": float(bundle.get("GPU", 0.0))}
    if bundle.get("memory"):
        opts["memory"] = bundle["memory"]
    custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU", "memory")}
    if custom:
        opts["resources"] = custom
    return opts


@dataclass(frozen=True)
class PlacementPlan:
    """How one co-location group is placed: `parallelism` bundles of `bundle` in one placement group."""

    name: str
    group: ColocationGroup
    bundle: Mapping[str, float]
    strategy: str
    data_parallel: bool
    staged: bool
    planned_stages: tuple[int, ...] = ()
    """Ranks per node the simulation expects (staged groups only); Ray has the final word."""

    @property
    def parallelism(self) -> int:
        return self.group.parallelism

    @property
    def node_names(self) -> tuple[str, ...]:
        return tuple(n.name for n in self.group.nodes)

    def demand(self, instances: int | None = None) -> dict[str, float]:
        return scale(self.bundle, self.parallelism if instances is None else instances)

    def describe(self) -> str:
        res = ", ".join(f"{k}: {v:g}" for k, v in sorted(self.bundle.items()))
        text = f"{self.name}: {self.parallelism} x {{{res}}} with {self.strategy}"
        if self.staged:
            text += f" (whole GPUs, ranks fill nodes; planned stages {list(self.planned_stages)})"
        return text


def _instances_fitting(bundle: Mapping[str, float], node: Mapping[str, float]) -> int:
    counts = [math.floor(node.get(k, 0.0) / v + _EPS) for k, v in bundle.items() if v > 0]
    return min(counts) if counts else 0


def _simulate_stages(bundle: Mapping[str, float], n: int,
                     nodes: list[dict[str, float]]) -> tuple[str, tuple[int, ...]]:
    """STRICT_PACK on the tightest node that holds all n instances, else PACK filling the roomiest nodes.

    SPREAD is not used: it balances ranks over every node instead of filling nodes, which puts more
    NCCL traffic between machines than needed. Mutates `nodes` to what is left.
    """
    total = scale(bundle, n)
    whole = [i for i, node in enumerate(nodes) if fits(total, node)]
    if whole:
        best = min(whole, key=lambda i: (nodes[i].get("GPU", 0.0), i))
        for k, v in total.items():
            nodes[best][k] = nodes[best].get(k, 0.0) - v
        return "STRICT_PACK", (n,)
    order = sorted(range(len(nodes)), key=lambda i: (-_instances_fitting(bundle, nodes[i]), i))
    stages, left = [], n
    for i in order:
        take = min(left, _instances_fitting(bundle, nodes[i]))
        if take <= 0:
            break
        for k, v in bundle.items():
            nodes[i][k] = nodes[i].get(k, 0.0) - v * take
        stages.append(take)
        left -= take
    return "PACK", tuple(stages)


def plan_placement(graph: DataflowGraph, node_totals: Sequence[Mapping[str, float]],
                   dp_roles: Collection[str] = DP_ROLES) -> list[PlacementPlan]:
    """One PlacementPlan per co-location group, staged (whole-GPU, parallelism > 1) groups first.

    Staged groups go first, largest GPU demand first, so the simulation of where they land matches the
    order the placement groups are created in; every other group is PACKed.
    """
    nodes = [real_resources(n) for n in node_totals]
    plans: list[PlacementPlan] = []
    rest: list[PlacementPlan] = []
    groups = graph.colocation_groups()
    staged = [g for g in groups if whole_gpus(bundle_for(g)) and g.parallelism > 1]
    staged.sort(key=lambda g: -bundle_for(g)["GPU"] * g.parallelism)
    for g in staged:
        bundle = bundle_for(g)
        strategy, stages = _simulate_stages(bundle, g.parallelism, nodes)
        plans.append(PlacementPlan(group_name(g), g, bundle, strategy, is_data_parallel(g, dp_roles), True, stages))
    for g in groups:
        if g in staged:
            continue
        rest.append(PlacementPlan(group_name(g), g, bundle_for(g), "PACK", is_data_parallel(g, dp_roles), False))
    return plans + rest


def capacity_error(graph: DataflowGraph, plans: Sequence[PlacementPlan], totals: Mapping[str, float],
                   node_totals: Sequence[Mapping[str, float]]) -> PlacementError | None:
    """The fail-fast check before any placement group exists: graph.check_capacity plus the real bundles.

    The real bundles include EMPTY_BUNDLE_CPU for resource-free groups, which the graph does not count.
    """
    totals = real_resources(totals)
    problems: list[str] = []
    try:
        graph.check_capacity(totals, per_node_max([real_resources(n) for n in node_totals]))
    except GraphError as e:
        problems += e.problems
    demand: dict[str, float] = {}
    for p in plans:
        demand = add(demand, p.demand())
    missing = missing_resources(demand, totals)
    if not missing and not problems:
        return None
    if missing:
        problems.append("placement needs " + describe_missing(demand, totals))
    return PlacementError("cannot place the dataflow graph: " + "; ".join(problems), missing, problems)


# -- where instances landed ----------------------------------------------------------------------


def order_bundles_by_node(bundles_to_node: Mapping[int, str]) -> list[int]:
    """Bundle indices grouped by node (nodes in order of their first bundle): ranks on one node are contiguous."""
    first: dict[str, int] = {}
    for idx in sorted(bundles_to_node):
        first.setdefault(bundles_to_node[idx], idx)
    return sorted(bundles_to_node, key=lambda i: (first[bundles_to_node[i]], i))


def _gpu_key(gpu_ids: Sequence[Any]) -> tuple[tuple[int, Any], ...]:
    return tuple((0, int(g)) if str(g).isdigit() else (1, str(g)) for g in gpu_ids)


@dataclass(frozen=True)
class Stage:
    """Instances of one staged group that share a Ray node: the unit NCCL talks over NVLink within."""

    index: int
    node_id: str
    instances: tuple[int, ...]
    gpu_ids: tuple[Any, ...]


def stages_of(placements: Sequence[tuple[str, Sequence[Any]]]) -> list[Stage]:
    """Group instance i, landed on (node_id, gpu_ids), into stages: one per node, in order of first instance."""
    by_node: dict[str, list[int]] = {}
    for i, (node_id, _) in enumerate(placements):
        by_node.setdefault(node_id, []).append(i)
    out = []
    for k, (node_id, members) in enumerate(by_node.items()):
        members.sort(key=lambda i: _gpu_key(placements[i][1]))
        gpus = tuple(g for i in members for g in placements[i][1])
        out.append(Stage(k, node_id, tuple(members), gpus))
    return out
