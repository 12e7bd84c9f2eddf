"""HybridScheduler: maps a DataflowGraph onto Ray once, then keeps its queues flowing.

Device mapping happens once, in `start`: one placement group per co-location group (bundle i holds
instance i of every member node) and one host actor per instance, so co-located roles hand data over
in-process. Whole-GPU groups with parallelism > 1 are staged: their ranks fill nodes and are logged
per node. Data-parallel groups get torch.distributed ranks. Between dispatches, `observe` turns queue
backlogs (in sequences) into parallelism changes (backpressure.py decides, this module acts).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol, cast

import ray
from ray.actor import ActorHandle
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hybridflow.api.spec import Scheduling
from hybridflow.control.names import RAY_NAMESPACE
from hybridflow.graph import ColocationGroup, DataflowGraph
from hybridflow.scheduler.backpressure import BackpressureDecision, BackpressurePolicy, high_watermark
from hybridflow.scheduler.edges import EdgeChannel, PolicySyncs
from hybridflow.scheduler.placement import (
    DP_ROLES,
    PlacementError,
    PlacementPlan,
    actor_options,
    capacity_error,
    describe_missing,
    fits,
    missing_resources,
    order_bundles_by_node,
    plan_placement,
    real_resources,
    scale,
    stages_of,
)
from hybridflow.telemetry import DecisionKind, count_decision

WORKER_LOST = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)
"""Errors that mean a host process died (Ray restarts it up to max_restarts)."""

log = logging.getLogger("hybridflow.scheduler")

NAMESPACE = RAY_NAMESPACE
DIST_BACKEND = "auto"
"""Passed to setup_distributed: the host picks nccl when CUDA is available in its process, else gloo."""


class Host(Protocol):
    """What the scheduler calls on a host class (the plain class, before ray.remote wraps it).

    `setup_distributed` may be called again on a live host (after a restart of a peer or a change of
    world size): it must tear down an existing default process group before joining the new one. Before a
    live data-parallel group changes size, `hold_copies` runs on all its hosts: whatever a rank keeps only in
    shards of the current group must be gathered while that group still exists.
    """

    def node_info(self) -> dict[str, Any]: ...  # node_id, ip, pid, gpu_ids
    def free_port(self) -> int: ...
    def memory(self) -> dict[str, Any]: ...  # {"kind": "gpu" or "rss", "bytes": n}; only sample_memory asks
    def setup_distributed(self, master_addr: str, master_port: int, rank: int, world_size: int,
                          backend: str) -> None: ...
    def hold_copies(self) -> bool: ...


HostKwargs = Callable[[ColocationGroup, int], dict[str, Any]]
Source = Literal["Backpressure", "Manual"]


def _kind(source: Source, change: Literal["up", "down", "refused"]) -> DecisionKind:
    """The metric label of a parallelism change: backpressure_up, manual_refused, ..."""
    return cast(DecisionKind, f"{source.lower()}_{change}")
"""Who changed a parallelism: the first word of its decision."""


@dataclass
class _Slot:
    """One reserved bundle; `actor` is None while the slot is idle (parallelism lowered below it)."""

    pg: PlacementGroup
    bundle_index: int
    extra: bool
    actor: ActorHandle | None = None
    name: str = ""
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Group:
    plan: PlacementPlan
    slots: list[_Slot]
    active: int
    pgs: list[PlacementGroup]
    target: int = 0
    """The level backpressure relaxes toward: the plan's parallelism until a manual change sets it."""

    def __post_init__(self) -> None:
        self.target = self.target or self.plan.parallelism

    @property
    def hosts(self) -> list[ActorHandle]:
        return [s.actor for s in self.slots[: self.active] if s.actor is not None]


class HybridScheduler:
    """Places a dataflow graph on Ray and adapts its parallelism; see the module docstring.

    `step_sequences`, the sequences one training step sends down a data edge, sets the default watermark.
    """

    def __init__(self, graph: DataflowGraph, scheduling: Scheduling, max_restarts: int = 3,
                 name_prefix: str = "hf", *, namespace: str = NAMESPACE,
                 dp_roles: Collection[str] = DP_ROLES, adjust_timeout_s: float = 10.0,
                 call_timeout_s: float = 300.0, step_sequences: int = 0) -> None:
        self.graph = graph.validate()
        self.scheduling = scheduling
        self.max_restarts = max_restarts
        self.name_prefix = name_prefix
        self.namespace = namespace
        self.dp_roles = tuple(dp_roles)
        self.adjust_timeout_s = min(adjust_timeout_s, scheduling.placement_timeout_seconds)
        """Bounded wait for the extra placement group of a raise: backpressure must never stall the loop."""
        self.call_timeout_s = call_timeout_s
        """Bound on actor start-up (node_info) and rank setup."""
        self.run_id = uuid.uuid4().hex[:8]
        self.decisions: list[str] = []
        self.decision_log: list[dict[str, Any]] = []
        """The decisions again, structured for the dashboard: time (Unix seconds), kind, node, reason, message."""
        self.events: list[BackpressureDecision] = []
        watermark = high_watermark(scheduling.queue_high_watermark, step_sequences)
        self._policy = BackpressurePolicy(watermark, scheduling.backpressure_window)
        self._groups: dict[str, _Group] = {}
        self._group_of: dict[str, str] = {}
        self._remote: Any = None
        self._host_kwargs: HostKwargs | None = None
        self._serial = 0
        self._started = False
        self._pg_prefix = ""
        shared = {n.name: i for i, g in enumerate(self.graph.colocation_groups()) for n in g.nodes}
        self._channels = {
            e.key: EdgeChannel(e.key, watermark, e.max_size_bytes,
                               "in_process" if shared[e.src_name] == shared[e.dst_name] else "object_store")
            for e in self.graph.data_edges()
        }
        self._syncs = {e.key: PolicySyncs(e.key, e.consistency) for e in self.graph.edges if e.control}

    # -- start -----------------------------------------------------------------------------------

    def start(self, host_cls: type, host_kwargs: HostKwargs) -> None:
        """Reserve every placement group, start one host per instance, set up data-parallel ranks.

        Raises PlacementError (naming what is missing) when the cluster is too small, at once, or when
        the placement groups are not ready within scheduling.placement_timeout_seconds.
        """
        if self._started:
            raise RuntimeError("HybridScheduler.start() called twice")
        if not ray.is_initialized():
            raise RuntimeError("ray.init() must run before HybridScheduler.start()")
        self._remote = ray.remote(host_cls)
        self._host_kwargs = host_kwargs
        self._pg_prefix = f"{self.name_prefix}-{self.graph.name}-{ray.get_runtime_context().get_job_id()}-"
        self._remove_predecessors()
        node_totals = [real_resources(n["Resources"]) for n in ray.nodes() if n.get("Alive")]
        totals = real_resources(ray.cluster_resources())
        plans = plan_placement(self.graph, node_totals, self.dp_roles)
        err = capacity_error(self.graph, plans, totals, node_totals)
        if err is not None:
            log.error("%s", err)
            raise err
        try:
            self._reserve(plans, totals)
            self._started = True
            self._launch_all()
            self.setup_distributed_all()
        except BaseException:
            self.shutdown()
            raise

    def _remove_predecessors(self) -> None:
        """Remove live placement groups an earlier incarnation of this controller left behind.

        Ray scopes a placement group to the Ray job, not to the actor that created it, so when a
        controller dies and Ray restarts it, the old groups keep their resources and the new ones
        could never be placed. The prefix holds the Ray job id, so other drivers are never touched.
        """
        for pg_id, info in placement_group_table().items():
            if info.get("name", "").startswith(self._pg_prefix) and info.get("state") != "REMOVED":
                log.warning("removing placement group %s left by an earlier controller", info["name"])
                remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))

    def _reserve(self, plans: list[PlacementPlan], totals: dict[str, float]) -> None:
        """Create every placement group (unique names: a retried driver never collides) and wait, bounded."""
        pgs: list[PlacementGroup] = []
        try:
            for p in plans:
                self.decide(f"Scheduling decision: placement group {p.describe()}", "placement", p.name)
                pgs.append(placement_group([dict(p.bundle)] * p.parallelism, strategy=p.strategy,
                                           name=self._pg_name(p.name)))
        except BaseException:
            for pg in pgs:
                remove_placement_group(pg)
            raise
        waits = {pg.ready(): i for i, pg in enumerate(pgs)}
        timeout = self.scheduling.placement_timeout_seconds
        _, not_ready = ray.wait(list(waits), num_returns=len(waits), timeout=timeout)
        if not_ready:
            late = [plans[waits[r]] for r in not_ready]
            demand: dict[str, float] = {}
            for p in late:
                for k, v in p.demand().items():
                    demand[k] = demand.get(k, 0.0) + v
            available = real_resources(ray.available_resources())
            for pg in pgs:
                remove_placement_group(pg)
            missing = missing_resources(demand, available)
            detail = describe_missing(demand, totals, available) or (
                "enough in total but not on single nodes: " + ", ".join(p.describe() for p in late))
            msg = (f"placement groups not ready after {timeout:g}s for {', '.join(p.name for p in late)}: "
                   f"{detail}")
            log.error("%s", msg)
            raise PlacementError(msg, missing)
        for p, pg in zip(plans, pgs, strict=True):
            slots = [_Slot(pg, i, extra=False) for i in order_bundles_by_node(self._bundle_nodes(pg))]
            self._groups[p.name] = _Group(p, slots, p.parallelism, [pg])
            for n in p.node_names:
                self._group_of[n] = p.name

    def _launch_all(self) -> None:
        launched = [(g, i) for g in self._groups.values() for i in range(g.active)]
        for g, i in launched:
            self._launch(g, i)
        self._fetch_info(launched)
        for g in self._groups.values():
            self._log_placement(g, range(g.active))

    def _launch(self, g: _Group, index: int) -> None:
        assert self._host_kwargs is not None
        slot = g.slots[index]
        self._serial += 1
        slot.name = f"{self.name_prefix}-{self.run_id}-{g.plan.name}-{self._serial}"
        strategy = PlacementGroupSchedulingStrategy(slot.pg, placement_group_bundle_index=slot.bundle_index)
        slot.actor = self._remote.options(
            **actor_options(g.plan.bundle), scheduling_strategy=strategy, max_restarts=self.max_restarts,
            max_task_retries=0, name=slot.name, namespace=self.namespace,
        ).remote(**self._host_kwargs(g.plan.group, index))

    def _fetch_info(self, which: list[tuple[_Group, int]]) -> None:
        refs = [g.slots[i].actor.node_info.remote() for g, i in which]  # type: ignore[union-attr]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.call_timeout_s)
        if len(ready) < len(refs):
            done = set(ready)
            late = [g.slots[i].name for (g, i), r in zip(which, refs, strict=True) if r not in done]
            raise TimeoutError(f"hosts did not start within {self.call_timeout_s:g}s: {', '.join(late)}")
        for (g, i), info in zip(which, ray.get(refs), strict=True):
            g.slots[i].info = dict(info)

    def _log_placement(self, g: _Group, indices: range) -> None:
        """Co-location decisions per instance, and for staged groups one decision per stage."""
        if len(g.plan.node_names) > 1:
            for i in indices:
                names = " and ".join(f"{n}_{i}" for n in g.plan.node_names)
                self.decide(f"Scheduling decision: co-located {names} on node {g.slots[i].info.get('node_id')}",
                             "colocation", g.plan.name)
        if g.plan.staged:
            placed = [(s.info.get("node_id", ""), list(s.info.get("gpu_ids", []))) for s in g.slots[: g.active]]
            stages = stages_of(placed)
            for st in stages:
                members = ", ".join(f"{g.plan.name}_{i}" for i in st.instances)
                self.decide(f"Scheduling decision: stage {st.index} of {g.plan.name}: {members} "
                             f"on node {st.node_id} (GPU ids {list(st.gpu_ids)})", "stage", g.plan.name)
            sizes = tuple(len(st.instances) for st in stages)
            if g.active == g.plan.parallelism and sorted(sizes) != sorted(g.plan.planned_stages):
                self.decide(f"Scheduling decision: {g.plan.name} landed in stages {list(sizes)}, "
                             f"planned {list(g.plan.planned_stages)}", "stage", g.plan.name)

    # -- distributed ranks -----------------------------------------------------------------------

    def setup_distributed_all(self) -> None:
        """(Re)build torch.distributed for every data-parallel group: rank 0's ip and a free port of its."""
        self._setup_distributed([g for g in self._groups.values() if g.plan.data_parallel])

    def rejoin(self, timeout: float) -> None:
        """After a host died: wait until every host answers (wait_ready), then rebuild the ranks. A host can
        answer and die after, its restart not yet under way when it answered: the setup then meets a lost
        worker, and both are tried again until `timeout` runs out."""
        deadline = time.monotonic() + timeout
        while True:
            self.wait_ready(max(0.0, deadline - time.monotonic()))
            try:
                self.setup_distributed_all()
                return
            except WORKER_LOST:
                if time.monotonic() >= deadline:
                    raise
                log.warning("a host died while the ranks re-formed; waiting for it again")

    def _setup_distributed(self, groups: list[_Group]) -> None:
        calls: list[tuple[str, ray.ObjectRef]] = []
        for g in groups:
            hosts = g.hosts
            if not hosts:
                continue
            answers: list[Any] = ray.get([hosts[0].node_info.remote(), hosts[0].free_port.remote()],
                                         timeout=self.call_timeout_s)
            info, port = answers
            g.slots[0].info = dict(info)
            ip = info["ip"]
            for rank, h in enumerate(hosts):
                calls.append((f"{g.plan.name} rank {rank}",
                              h.setup_distributed.remote(ip, port, rank, len(hosts), DIST_BACKEND)))
            self.decide(f"Scheduling decision: data-parallel {g.plan.name}: world size {len(hosts)}, "
                         f"master {ip}:{port}, backend {DIST_BACKEND}", "distributed", g.plan.name)
        if not calls:
            return
        refs = [r for _, r in calls]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.call_timeout_s)
        if len(ready) < len(refs):
            done = set(ready)
            late = [name for name, r in calls if r not in done]
            raise TimeoutError(f"distributed setup not done within {self.call_timeout_s:g}s: {', '.join(late)}")
        # Every call has ended, so no rank is still in this rendezvous when the next one starts. A rank that
        # died takes the others' setup down with it: its own error is the one raised, so the caller sees a
        # lost worker rather than a store timeout.
        errors = []
        for ref in refs:
            try:
                ray.get(ref)
            except ray.exceptions.RayError as e:
                errors.append(e)
        if errors:
            raise next((e for e in errors if isinstance(e, WORKER_LOST)), errors[0])

    # -- queries ---------------------------------------------------------------------------------

    def _group(self, node_name: str) -> _Group:
        if node_name not in self._group_of:
            if node_name in {n.name for n in self.graph.nodes}:
                raise RuntimeError("the scheduler has not been started")
            raise KeyError(f"unknown node {node_name!r}")
        return self._groups[self._group_of[node_name]]

    def hosts(self, node_name: str) -> list[ActorHandle]:
        """Active host actors serving `node_name`, in instance order (shared with co-located nodes)."""
        return self._group(node_name).hosts

    def instance_count(self, node_name: str) -> int:
        return self._group(node_name).active

    def colocated_with(self, node_name: str) -> tuple[str, ...]:
        """Every node sharing `node_name`'s hosts (itself included), in graph order."""
        return self._group(node_name).plan.node_names

    def planned_parallelism(self, node_name: str) -> int:
        """The level backpressure relaxes toward: the plan's, or the last manual change's."""
        return self._group(node_name).target

    def channel(self, edge_key: str) -> EdgeChannel:
        """The queue of data edge `src->dst`; control edges have none."""
        try:
            return self._channels[edge_key]
        except KeyError:
            raise KeyError(f"no data edge {edge_key!r}; data edges: {sorted(self._channels)}") from None

    def policy_syncs(self, edge_key: str) -> PolicySyncs:
        """The weight syncs carried by control edge `edge_key` (plan.policy_edge; kept from the first ask when
        the graph has no such edge)."""
        return self._syncs.setdefault(edge_key, PolicySyncs(edge_key, "strong"))

    def get_status(self) -> dict[str, Any]:
        nodes: dict[str, Any] = {}
        for n in self.graph.nodes:
            g = self._groups.get(self._group_of.get(n.name, ""))
            workers = [] if g is None else [
                {"instance": i, "node_id": s.info.get("node_id"), "ip": s.info.get("ip"), "pid": s.info.get("pid"),
                 "gpu_ids": list(s.info.get("gpu_ids", [])), "bundle": dict(g.plan.bundle), "actor": s.name,
                 "torch_threads": s.info.get("torch_threads"), "memory": s.info.get("memory")}
                for i, s in enumerate(g.slots[: g.active])
            ]
            nodes[n.name] = {
                "role": n.role,
                "workers": workers,
                "parallelism": g.active if g else 0,
                "planned_parallelism": n.parallelism,
                "target_parallelism": g.target if g else n.parallelism,
                "data_parallel": g.plan.data_parallel if g else False,
                "resources": dict(n.resources),
                "group": g.plan.name if g else None,
                "queue_len": sum(self._channels[e.key].pending() for e in self.graph.data_edges()
                                 if e.dst_name == n.name),
            }
        return {
            "nodes": nodes,
            "edges": {k: ch.status() for k, ch in self._channels.items()},
            "control_edges": {k: c.status() for k, c in self._syncs.items()},
            "decisions": list(self.decisions),
            "decision_log": [dict(d) for d in self.decision_log],
            "backpressure": [e.as_dict() for e in self.events],
            "graph": {"name": self.graph.name, "edges": [
                {"src": e.src_name, "dst": e.dst_name, "data_type": e.data_type, "control": e.control,
                 "co_locate": e.co_locate, "consistency": e.consistency} for e in self.graph.edges]},
        }

    def sample_memory(self, timeout_s: float = 5.0) -> None:
        """Ask every active host for its memory (`memory()`: GPU memory reserved by torch, else RSS) and keep
        the answers for get_status; call between steps, when the hosts are idle. A host that does not answer
        in time keeps its last sample: the dashboard must never stall training."""
        slots = [s for g in self._groups.values() for s in g.slots[: g.active] if s.actor is not None]
        if not slots:
            return
        refs = [s.actor.memory.remote() for s in slots]  # type: ignore[union-attr]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        done = set(ready)
        for s, ref in zip(slots, refs, strict=True):
            if ref not in done:
                continue
            try:
                s.info["memory"] = dict(ray.get(ref))
            except ray.exceptions.RayError as e:
                log.debug("memory of %s: %s", s.name, e)

    # -- parallelism -----------------------------------------------------------------------------

    def parallelism_problem(self, node_name: str, target: int) -> str | None:
        """Why `node_name` cannot run `target` instances now, or None; asks Ray, changes nothing.

        A group holding a training role but planned without data-parallel ranks cannot grow: its new
        instances would train apart from the first. Growing needs the extra bundles free right now.
        """
        names = [n.name for n in self.graph.nodes]
        if node_name not in names:
            return f"unknown node {node_name!r}; the graph has {', '.join(names)}"
        if node_name not in self._group_of:
            return "the scheduler has not placed the graph yet"
        if target < 1:
            return f"parallelism must be at least 1, got {target}"
        g = self._group(node_name)
        trains = sorted({n.role for n in g.plan.group.nodes} & set(self.dp_roles))
        if trains and not g.plan.data_parallel and target != g.active:
            return (f"{node_name} cannot change parallelism: its group {g.plan.name} trains ({', '.join(trains)}) "
                    f"without data-parallel ranks (planned parallelism {g.plan.parallelism}); plan it with "
                    "parallelism > 1 to make it scalable")
        need = target - len(g.slots)
        if need > 0:
            demand = scale(g.plan.bundle, need)
            available = real_resources(ray.available_resources())
            if not fits(demand, available):
                return (f"the cluster lacks the resources for {target} instances of {node_name} ({need} more "
                        f"bundles): {describe_missing(demand, real_resources(ray.cluster_resources()), available)}")
        return None

    def adjust_parallelism(self, node_name: str, target_parallelism: int, reason: str,
                           source: Source = "Backpressure") -> int:
        """Change the instance count of `node_name`'s co-location group; returns the count now in effect.

        Co-located nodes share hosts, so they change together. Lowering kills hosts from the highest
        instance down and keeps base bundles reserved, so relaxing back always fits. Raising reuses
        those idle bundles first, then reserves an extra placement group with a bounded wait; when the
        resources are not there it logs why and returns the unchanged count. Data-parallel groups get
        new ranks (setup_distributed on every host); the new hosts start from host_kwargs, so the
        trainer loads their state. A manual change also becomes the group's target (see `planned_parallelism`).
        """
        g = self._group(node_name)
        old, target = g.active, max(1, int(target_parallelism))
        if target == old:
            if source == "Manual":
                g.target = target
            return old
        partners = [n for n in g.plan.node_names if n != node_name]
        with_ = f"; with co-located {', '.join(partners)}" if partners else ""
        ranks = g.hosts
        if target < old:
            self._hold_copies(g, ranks)
            self._lower(g, target)
        elif self._raise(g, target, node_name, reason, source):
            try:
                self._hold_copies(g, ranks)
            except BaseException:
                self._lower(g, old)  # the group as it was, for the recovery that follows
                raise
        else:
            return old
        self.decide(f"{source}: {node_name} parallelism {old} -> {target} ({reason}){with_}",
                     _kind(source, "up" if target > old else "down"), node_name, reason)
        if source == "Manual":
            g.target = target
        if target > old:
            self._log_placement(g, range(old, target))
        if g.plan.data_parallel:
            self._setup_distributed([g])
        return target

    def _hold_copies(self, g: _Group, ranks: list[ActorHandle]) -> None:
        """A data-parallel group's ranks as they were gather what their roles released (Host.hold_copies), once
        the change is certain and before any of them goes: the new layout starts from those copies."""
        if g.plan.data_parallel:
            ray.get([h.hold_copies.remote() for h in ranks], timeout=self.call_timeout_s)

    def _lower(self, g: _Group, target: int) -> None:
        for s in g.slots[target: g.active]:
            if s.actor is not None:
                ray.kill(s.actor, no_restart=True)
            s.actor, s.info = None, {}
        g.active = target
        in_use = {s.pg.id for s in g.slots[:target]}
        for pg in g.pgs[1:]:
            if pg.id not in in_use:
                remove_placement_group(pg)
        g.pgs = [pg for i, pg in enumerate(g.pgs) if i == 0 or pg.id in in_use]
        kept = {pg.id for pg in g.pgs}
        g.slots = [s for s in g.slots if s.pg.id in kept]

    def _raise(self, g: _Group, target: int, node_name: str, reason: str, source: Source) -> bool:
        need = target - len(g.slots)
        if need > 0:
            demand = scale(g.plan.bundle, need)
            available = real_resources(ray.available_resources())
            if not fits(demand, available):
                why = describe_missing(demand, real_resources(ray.cluster_resources()), available)
                self.decide(f"{source}: cannot raise {node_name} parallelism {g.active} -> {target}: "
                             f"{why} ({reason})", _kind(source, "refused"), node_name, f"{reason}: {why}")
                return False
            pg = placement_group([dict(g.plan.bundle)] * need, strategy="PACK", name=self._pg_name(g.plan.name))
            ready, _ = ray.wait([pg.ready()], timeout=self.adjust_timeout_s)
            if not ready:
                remove_placement_group(pg)
                self.decide(f"{source}: cannot raise {node_name} parallelism {g.active} -> {target}: "
                             f"{need} more bundles not placed within {self.adjust_timeout_s:g}s ({reason})",
                             _kind(source, "refused"), node_name,
                             f"{reason}: {need} more bundles not placed within {self.adjust_timeout_s:g}s")
                return False
            g.pgs.append(pg)
            g.slots += [_Slot(pg, i, extra=True) for i in order_bundles_by_node(self._bundle_nodes(pg))]
        new = list(range(g.active, target))
        for i in new:
            self._launch(g, i)
        old, g.active = g.active, target
        try:
            self._fetch_info([(g, i) for i in new])
        except BaseException:
            self._lower(g, old)
            raise
        return True

    def _can_raise(self, node_name: str) -> bool:
        g = self._group(node_name)
        if g.active < len(g.slots):
            return True
        return fits(g.plan.bundle, real_resources(ray.available_resources()))

    def observe(self) -> list[BackpressureDecision]:
        """One backpressure observation of every data edge; returns the changes tried (see `applied`)."""
        if not self.scheduling.backpressure or not self._started:
            return []
        out: list[BackpressureDecision] = []
        for e in self.graph.data_edges():
            signal = self._policy.observe(e.key, self._channels[e.key].take_backlog())
            if signal is None:
                continue
            ends = (e.src_name, e.dst_name)
            current = {n: self.instance_count(n) for n in ends}
            planned = {n: self.planned_parallelism(n) for n in ends}
            tried: BackpressureDecision | None = None
            for cand in self._policy.candidates(signal, e.src_name, e.dst_name, current, planned,
                                                self._can_raise):
                got = self.adjust_parallelism(cand.node, cand.new, cand.reason)
                tried = replace(cand, applied=got == cand.new)
                self.events.append(tried)
                if tried.applied:
                    break
            if tried is not None:
                out.append(tried)
        return out

    # -- recovery and teardown -------------------------------------------------------------------

    def discard_in_flight(self) -> None:
        """Drop what a failed step left queued on the data edges (see EdgeChannel.discard)."""
        for ch in self._channels.values():
            if ch.discard():
                log.info("dropped the results a failed step left on %s", ch.key)

    def lost_hosts(self, timeout: float) -> list[str]:
        """Hosts that died since their node info was last taken: no answer within `timeout`, or an answer
        from another process (Ray restarted it, maybe in another pod: node id and pid both compared).

        gloo and NCCL report a peer's death to the survivors as an ordinary error of the collective; this
        tells such an error from one of the step itself.
        """
        slots = [s for g in self._groups.values() for s in g.slots[: g.active] if s.actor is not None]
        refs = [s.actor.node_info.remote() for s in slots]  # type: ignore[union-attr]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        answered = set(ready)
        lost = []
        for s, ref in zip(slots, refs, strict=True):
            try:
                info = ray.get(ref) if ref in answered else None
            except ray.exceptions.RayError:
                info = None
            if info is None or (info.get("node_id"), info.get("pid")) != (s.info.get("node_id"), s.info.get("pid")):
                lost.append(s.name)
        return lost

    def wait_ready(self, timeout: float) -> None:
        """Ask every host for its node info until all answer (Ray restarts dead ones up to max_restarts).

        The answer is the readiness signal, so a host that dies after answering is caught by the
        next call rather than here. Raises TimeoutError naming the hosts that did not answer in time.
        """
        deadline = time.monotonic() + timeout
        waiting = {s.name: s for g in self._groups.values() for s in g.slots[: g.active] if s.actor is not None}
        inflight: dict[str, ray.ObjectRef] = {}
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for name, s in waiting.items():
                if name not in inflight:
                    inflight[name] = s.actor.node_info.remote()  # type: ignore[union-attr]
            ready, _ = ray.wait(list(inflight.values()), num_returns=len(inflight), timeout=min(left, 1.0))
            for name, ref in list(inflight.items()):
                if ref not in ready:
                    continue
                del inflight[name]
                try:
                    info = ray.get(ref)
                except ray.exceptions.RayError:
                    continue
                waiting.pop(name).info = dict(info)
            if waiting and not inflight:
                time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        if waiting:
            raise TimeoutError(f"hosts not answering after {timeout:g}s: {', '.join(sorted(waiting))}")

    def shutdown(self) -> None:
        """Kill every host and remove every placement group; safe to call twice."""
        for g in self._groups.values():
            for s in g.slots:
                if s.actor is not None:
                    try:
                        ray.kill(s.actor, no_restart=True)
                    except Exception as e:  # already gone
                        log.debug("kill %s: %s", s.name, e)
                    s.actor = None
            for pg in g.pgs:
                try:
                    remove_placement_group(pg)
                except Exception as e:
                    log.debug("remove placement group: %s", e)
        self._groups.clear()
        self._group_of.clear()
        self._started = False

    def __enter__(self) -> HybridScheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- helpers ---------------------------------------------------------------------------------

    def _pg_name(self, group: str) -> str:
        return f"{self._pg_prefix}{group}-{self.run_id}-{uuid.uuid4().hex[:6]}"

    @staticmethod
    def _bundle_nodes(pg: PlacementGroup) -> dict[int, str]:
        table = placement_group_table(pg)
        return {int(k): str(v) for k, v in table.get("bundles_to_node_id", {}).items()}

    def decide(self, message: str, kind: DecisionKind, node: str, reason: str | None = None) -> None:
        """Log a decision, the scheduler's own or one taken beside it (sequence parallelism turned off);
        `reason` defaults to the message without its "Scheduling decision: " prefix."""
        self.decisions.append(message)
        self.decision_log.append({"time": time.time(), "kind": kind, "node": node,
                                  "reason": reason if reason is not None else message.split(": ", 1)[-1],
                                  "message": message})
        log.info("%s", message)
        count_decision(self.name_prefix, kind)
