"""The dataflow DSL: nodes are worker roles, edges carry data (or, for control edges, close the loop).

Pure Python: the operator renders worker groups from the same graph the runtime schedules.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

from hybridflow.api.spec import Graph as GraphSpec
from hybridflow.api.spec import GraphEdge, GraphNode, RLTrainingJobSpec, Role

ROLES: tuple[Role, ...] = get_args(Role)


class GraphError(ValueError):
    """An invalid graph or an unsatisfiable plan; `problems` lists each one."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("; ".join(problems))


@dataclass(eq=False)
class Node:
    name: str
    role: str
    resources: dict[str, float] = field(default_factory=dict)
    parallelism: int = 1
    pool: str = "default"

    def __hash__(self) -> int:
        return hash(self.name)

    @property
    def gpus(self) -> float:
        return float(self.resources.get("GPU", 0.0))


@dataclass(eq=False)
class Edge:
    src: Node | str
    dst: Node | str
    data_type: str = "batch"
    control: bool = False
    co_locate: bool = False
    max_size_bytes: int | None = None
    consistency: Literal["strong", "eventual"] = "strong"

    @property
    def src_name(self) -> str:
        return self.src if isinstance(self.src, str) else self.src.name

    @property
    def dst_name(self) -> str:
        return self.dst if isinstance(self.dst, str) else self.dst.name

    @property
    def key(self) -> str:
        return f"{self.src_name}->{self.dst_name}"


@dataclass(frozen=True)
class ColocationGroup:
    """Nodes whose instance i share one placement bundle; `bundle` is the summed per-instance demand."""

    nodes: tuple[Node, ...]
    bundle: Mapping[str, float]
    parallelism: int
    pool: str


class DataflowGraph:
    """A named set of nodes and edges; `validate()` checks structure, `check_capacity()` a cluster."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._nodes: dict[str, Node] = {}
        self._edges: list[Edge] = []
        self._duplicates: list[str] = []

    def node(self, node: Node) -> Node:
        if node.name in self._nodes:
            self._duplicates.append(node.name)
        else:
            self._nodes[node.name] = node
        return node

    def edge(self, edge: Edge) -> Edge:
        self._edges.append(edge)
        return edge

    @property
    def nodes(self) -> list[Node]:
        return list(self._nodes.values())

    @property
    def edges(self) -> list[Edge]:
        return list(self._edges)

    def get(self, name: str) -> Node:
        return self._nodes[name]

    def by_role(self, role: str) -> list[Node]:
        return [n for n in self._nodes.values() if n.role == role]

    def first(self, role: str) -> Node | None:
        found = self.by_role(role)
        return found[0] if found else None

    def data_edges(self) -> list[Edge]:
        """Non-control edges between known nodes (unknown ends are reported by validate)."""
        return [e for e in self._edges if not e.control and e.src_name in self._nodes and e.dst_name in self._nodes]

    # -- validation -------------------------------------------------------------------------------

    def validate(self) -> DataflowGraph:
        """Raise GraphError listing every structural problem; return self when valid."""
        problems = [f"duplicate node name {d!r}" for d in self._duplicates]
        for n in self._nodes.values():
            if n.role not in ROLES:
                problems.append(f"node {n.name!r}: unknown role {n.role!r}, allowed: {', '.join(ROLES)}")
            if n.parallelism < 1:
                problems.append(f"node {n.name!r}: parallelism must be >= 1")
            for res, amount in n.resources.items():
                if amount < 0:
                    problems.append(f"node {n.name!r}: resource {res} must be >= 0")
                elif amount > 1 and not float(amount).is_integer():
                    problems.append(f"node {n.name!r}: resource {res}={amount}: above 1 it must be whole")
        for e in self._edges:
            for end in (e.src_name, e.dst_name):
                if end not in self._nodes:
                    problems.append(f"edge {e.key}: unknown node {end!r}")
            if e.consistency not in ("strong", "eventual"):
                problems.append(f"edge {e.key}: consistency must be 'strong' or 'eventual'")
            elif e.consistency == "eventual" and not e.control:
                problems.append(f"edge {e.key}: consistency 'eventual' is for the control edge that brings the "
                                "updated policy to the actor; a data edge is always 'strong'")
        problems += self._cycle_problems()
        problems += self._colocation_problems()
        if problems:
            raise GraphError(problems)
        return self

    def _cycle_problems(self) -> list[str]:
        try:
            self.topo_order()
        except GraphError as e:
            return e.problems
        return []

    def topo_order(self) -> list[Node]:
        """Nodes in data order; control edges are the only legal way back."""
        indeg = {n: 0 for n in self._nodes}
        for e in self.data_edges():
            indeg[e.dst_name] += 1
        ready = [n for n, d in indeg.items() if d == 0]
        order: list[str] = []
        while ready:
            cur = ready.pop(0)
            order.append(cur)
            for e in self.data_edges():
                if e.src_name == cur:
                    indeg[e.dst_name] -= 1
                    if indeg[e.dst_name] == 0:
                        ready.append(e.dst_name)
        if len(order) != len(self._nodes):
            stuck = sorted(n for n in self._nodes if n not in order)
            raise GraphError([f"cycle through {', '.join(stuck)} is not closed by a control edge"])
        return [self._nodes[n] for n in order]

    def group_of(self, name: str) -> ColocationGroup:
        """The co-location group of node `name` (KeyError for a name the graph lacks, as `get`)."""
        for g in self.colocation_groups():
            if any(n.name == name for n in g.nodes):
                return g
        raise KeyError(name)

    def colocation_groups(self) -> list[ColocationGroup]:
        """Union of co_locate edges; every node ends up in exactly one group (often alone)."""
        parent = {n: n for n in self._nodes}

        def find(x: str) -> str:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for e in self._edges:
            if e.co_locate and e.src_name in parent and e.dst_name in parent:
                parent[find(e.src_name)] = find(e.dst_name)
        members: dict[str, list[Node]] = {}
        for name, node in self._nodes.items():
            members.setdefault(find(name), []).append(node)
        groups = []
        for nodes in members.values():
            bundle: dict[str, float] = {}
            for n in nodes:
                for res, amount in n.resources.items():
                    bundle[res] = bundle.get(res, 0.0) + amount
            groups.append(
                ColocationGroup(
                    nodes=tuple(nodes),
                    bundle={k: v for k, v in bundle.items() if v > 0},
                    parallelism=max(n.parallelism for n in nodes),
                    pool=nodes[0].pool,
                )
            )
        return groups

    def _colocation_problems(self) -> list[str]:
        problems = []
        for g in self.colocation_groups():
            if len(g.nodes) < 2:
                continue
            names = " and ".join(n.name for n in g.nodes)
            pars = {n.parallelism for n in g.nodes}
            if len(pars) > 1:
                problems.append(f"co-located {names} must have the same parallelism, got {sorted(pars)}")
            pools = {n.pool for n in g.nodes}
            if len(pools) > 1:
                problems.append(f"co-located {names} must be in one pool, got {sorted(pools)}")
            for res, amount in g.bundle.items():
                if amount > 1 and not math.isclose(amount, round(amount)):
                    problems.append(
                        f"co-located {names} cannot share a bundle: together they need {res}={amount:g}; "
                        f"a shared bundle holds at most 1 {res} in fractions or a whole number"
                    )
        return problems

    def check_capacity(self, capacity: Mapping[str, float], per_node_max: Mapping[str, float] | None = None) -> None:
        """Raise GraphError naming what is missing when the plan exceeds `capacity` (cluster totals)."""
        need = self.demand()
        problems = []
        for g in self.colocation_groups():
            for res, amount in g.bundle.items():
                if per_node_max is not None and amount > per_node_max.get(res, 0.0) + 1e-9:
                    names = ", ".join(n.name for n in g.nodes)
                    problems.append(
                        f"{names}: one instance needs {res}={amount:g} but no node has more than "
                        f"{per_node_max.get(res, 0.0):g}"
                    )
        for res, amount in sorted(need.items()):
            have = capacity.get(res, 0.0)
            if amount > have + 1e-9:
                problems.append(
                    f"the plan needs {res}={amount:g} but the cluster has {have:g} (missing {amount - have:g})"
                )
        if problems:
            raise GraphError(problems)

    def demand(self) -> dict[str, float]:
        """Resources the whole plan asks of a cluster: every instance's bundle, fractions of a GPU included."""
        need: dict[str, float] = {}
        for g in self.colocation_groups():
            for res, amount in g.bundle.items():
                need[res] = need.get(res, 0.0) + amount * g.parallelism
        return need

    def pool_demand(self) -> dict[str, dict[str, float]]:
        """Total resources each pool needs: the operator sizes worker groups from this.

        GPUs count whole devices: bundles of b <= 1 GPU pack floor(1/b) to a device, so n of them need
        ceil(n / floor(1/b)) GPUs.
        """
        out: dict[str, dict[str, float]] = {}
        for g in self.colocation_groups():
            pool = out.setdefault(g.pool, {})
            for res, amount in g.bundle.items():
                pool[res] = pool.get(res, 0.0) + devices_needed(amount, g.parallelism, res)
        return out

    # -- conversion -------------------------------------------------------------------------------

    @classmethod
    def from_spec(cls, spec: GraphSpec, name: str = "custom") -> DataflowGraph:
        g = cls(name)
        for n in spec.nodes:
            g.node(Node(n.name, n.role, dict(n.resources), n.parallelism, n.pool))
        for e in spec.edges:
            g.edge(Edge(e.src, e.dst, e.data_type, e.control, e.co_locate, e.max_size_bytes, e.consistency))
        return g

    def to_spec(self) -> GraphSpec:
        return GraphSpec(
            nodes=[GraphNode(name=n.name, role=n.role, resources=n.resources, parallelism=n.parallelism, pool=n.pool)
                   for n in self.nodes],
            edges=[
                GraphEdge(src=e.src_name, dst=e.dst_name, data_type=e.data_type, control=e.control,
                          co_locate=e.co_locate, max_size_bytes=e.max_size_bytes, consistency=e.consistency)
                for e in self._edges
            ],
        )


def devices_needed(per_instance: float, instances: int, resource: str = "GPU") -> float:
    """GPUs are indivisible across bundles: ceil(n / floor(1/b)) for b < 1, else b*n."""
    if resource != "GPU" or per_instance >= 1 or per_instance <= 0:
        return per_instance * instances
    return float(math.ceil(instances / math.floor(1 / per_instance + 1e-9)))


def needs_reference(spec: RLTrainingJobSpec) -> bool:
    """A reference node scores log-probs only when the spec asks for a KL penalty against it."""
    return spec.model.reference.enabled and spec.algorithm.kl_penalty.coef > 0


def reference_in_policy(spec: RLTrainingJobSpec) -> bool:
    """A LoRA policy whose reference has no path of its own: the reference is the policy's frozen base.

    The reference node stays in the graph (its step scores ref log-probs as before), but a host that holds
    both roles loads no second model: the reference runs the actor's module with its adapters switched
    off. A reference node in another process (a custom graph) loads the base model itself, which is the
    same initial policy.
    """
    return spec.model.policy.lora is not None and spec.model.reference.path is None


def _add_loop(g: DataflowGraph, actor: Node, consumers: Iterable[Node], trainer: Node,
              consistency: Literal["strong", "eventual"]) -> None:
    for c in consumers:
        g.edge(Edge(actor, c, data_type="rollout_batch", co_locate=c.pool == actor.pool and c.role != "critic"))
    g.edge(Edge(trainer, actor, data_type="updated_policy", control=True, consistency=consistency))


def rollout_gpus(spec: RLTrainingJobSpec) -> int:
    """GPUs one rollout engine spans: vLLM's rollout.tensorParallelSize, else 1 (torch generate is unsharded)."""
    return spec.rollout.tensor_parallel_size if spec.rollout.engine == "vllm" else 1


def builtin_graph(spec: RLTrainingJobSpec, accelerator: Literal["GPU", "CPU"] = "GPU",
                  parallelism: int = 1, critic_parallelism: int | None = None,
                  critic_with_actor: bool = False) -> DataflowGraph:
    """The algorithm's graph: actor_rollout, reference and reward share bundles; the critic, for the
    algorithms that train one (ppo), runs in a process of its own, in a pool of its own on GPUs, and in the
    actor's pool on CPUs or with `critic_with_actor`. grpo, rloo and reinforce_plus_plus(_baseline) share the
    critic-free graph.

    The critic's parallelism defaults to the actor's, rounded up to a multiple of its sequence-parallel size.
    On GPUs each actor bundle is a GPU split 0.5/0.25/0.25 between actor, reference and reward; a reference
    that shares the LoRA policy's module (reference_in_policy) holds no model and asks for none. A critic in
    the actor's pool takes a quarter of that GPU, and the actor gives up what the four would need beyond it.
    A vLLM engine of tensorParallelSize N > 1 makes the bundle N whole GPUs, all the actor's: the engine's
    workers are the actor process's children on them, and reward and reference models run in that process on
    the same GPUs (a share above 1 must be whole, so N cannot be split 2:1:1 for every N).
    """
    algo = spec.algorithm.name
    g = DataflowGraph(algo)
    gpu = accelerator == "GPU"
    tp = rollout_gpus(spec)
    split = gpu and tp == 1
    critic_in_actor_pool = spec.algorithm.trains_critic and (not gpu or (critic_with_actor and split))
    share: dict[str, float] = {"GPU": 0.25} if split else {}
    reward_res = dict(share) if spec.reward.type == "model" else {}
    ref_res = dict(share) if not reference_in_policy(spec) else {}
    critic_res: dict[str, float] = dict(share) if critic_in_actor_pool and gpu else {"GPU": 1} if gpu else {"CPU": 1}
    actor_res: dict[str, float] = {"CPU": 1.0} if not gpu else {"GPU": 0.5} if split else {"GPU": float(tp)}
    if split and critic_in_actor_pool:
        held = [reward_res, ref_res if needs_reference(spec) else {}, critic_res]
        actor_res = {"GPU": 1.0 - sum(r.get("GPU", 0.0) for r in held)}
    actor = g.node(Node("actor_rollout", "actor_rollout", actor_res, parallelism, "actor"))
    consumers: list[Node] = [g.node(Node("reward_score", "reward", reward_res, parallelism, "actor"))]
    if needs_reference(spec):
        consumers.append(g.node(Node("reference", "reference", ref_res, parallelism, "actor")))
    trainer = actor
    if spec.algorithm.trains_critic:
        sp = spec.model.critic.sequence_parallel  # ranks come in sequence-parallel groups of sp
        cpar = critic_parallelism or -(-parallelism // sp) * sp
        critic = g.node(Node("critic", "critic", critic_res, cpar, "actor" if critic_in_actor_pool else "critic"))
        consumers.append(critic)
        trainer = critic
    _add_loop(g, actor, consumers, trainer, spec.scheduling.consistency)
    return g


def gpus_needed(graph: DataflowGraph) -> float:
    """GPUs the graph asks of a cluster (DataflowGraph.demand: a 0.75 and a 0.25 bundle fit one GPU)."""
    return graph.demand().get("GPU", 0.0)


def graph_for_gpus(spec: RLTrainingJobSpec, gpus: float) -> DataflowGraph | None:
    """For a run on one machine of `gpus` GPUs: when the built-in graph asks for more and one with the critic in
    the actor's pool (a process of its own on a share of the actor's GPU) fits, that graph: a laptop's one GPU
    trains ppo, as verl co-locates every model; else None, and the built-in graph stands. A written spec.graph
    is never replaced."""
    if spec.graph is not None or not spec.algorithm.trains_critic:
        return None
    if gpus_needed(builtin_graph(spec, "GPU")) <= gpus:
        return None
    compact = builtin_graph(spec, "GPU", critic_with_actor=True)
    return compact if gpus_needed(compact) <= gpus else None


def spec_graph(spec: RLTrainingJobSpec, accelerator: Literal["GPU", "CPU"] = "GPU",
               parallelism: int = 1, critic_parallelism: int | None = None) -> DataflowGraph:
    """spec.graph when given, else the built-in graph; not validated."""
    if spec.graph is not None:
        return DataflowGraph.from_spec(spec.graph, name=f"{spec.algorithm.name}-custom")
    return builtin_graph(spec, accelerator, parallelism, critic_parallelism)

