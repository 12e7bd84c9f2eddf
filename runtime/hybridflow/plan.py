"""Which graphs can train, how one step runs on them, and what they ask of a cluster.

Pure: `hybridflow validate`, preflight, the operator and the trainer all ask here, so a graph that
passes one of them passes them all. graph.py is the DSL and its structure; this module adds what an
algorithm needs from it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from hybridflow.api.spec import ALGORITHMS, CRITIC_ALGORITHMS, RLTrainingJobSpec, Role
from hybridflow.graph import (
    ROLES,
    ColocationGroup,
    DataflowGraph,
    GraphError,
    Node,
    needs_reference,
    reference_in_policy,
    rollout_gpus,
    spec_graph,
)

REQUIRED_ROLES: Mapping[str, tuple[Role, ...]] = MappingProxyType({
    algo: ("actor_rollout", "reward", "critic") if algo in CRITIC_ALGORITHMS else ("actor_rollout", "reward")
    for algo in ALGORITHMS
})
"""Each needs exactly one node; no role may have two (the trainer could not tell which to use)."""

Phase = Literal["rollout", "scores", "advantages", "update", "sync"]
"""The parts of a step, in order; `scores` is there only when some step is scored by every rank at once
(StepPlan.scored)."""


@dataclass(frozen=True)
class Step:
    """`method` of the worker of `role`, run on a rollout batch; it adds tensors to the batch."""

    name: str
    role: Role
    method: str


STEPS: Mapping[str, Step] = MappingProxyType({s.name: s for s in (
    Step("reward", "reward", "score"),
    Step("reference", "reference", "ref_log_probs"),
    Step("old_log_probs", "actor_rollout", "old_log_probs"),
    Step("values", "critic", "values"),
)})
"""The one step each role runs on a freshly generated batch."""

STEP_OF_ROLE: Mapping[str, Step] = MappingProxyType({s.role: s for s in STEPS.values()})


@dataclass(frozen=True)
class RemoteStep:
    """A step whose node does not share the actor's process: chunks reach it through the object store."""

    step: Step
    node: Node
    edge: str
    """The data edge actor->node whose queue carries the chunks (backpressure watches it)."""


@dataclass(frozen=True)
class StepPlan:
    """Where each part of one training step runs."""

    actor: Node
    critic: Node | None
    colocated: tuple[str, ...]
    """Steps run in the actor's process right after generation, in this order."""
    remote: tuple[RemoteStep, ...]
    trained: tuple[Node, ...]
    """One node per group of hosts that `update`: the actor, and the critic unless it shares the actor's hosts."""
    phases: tuple[Phase, ...]
    """rollout, scores, advantages, update; no scores phase when nothing is `scored`."""
    fused: bool
    """Every phase runs on the actor's single host, so the whole step is one call to it (not with dynamic sampling,
    whose further prompts the controller draws as the step goes)."""
    lag: int = 0
    """Updates the generating policy may be behind the trained one (policy_lag): 1 pipelines the rollout of
    step t+1 with the update of step t."""
    late: tuple[str, ...] = ()
    """Steps of the actor's process that read a module the update changes (the critic's values, a reference
    that is the LoRA policy's base): with lag 1 they run on a pipelined batch after the update, not during it."""
    policy_edge: str = ""
    """The control edge that brings the updated policy to the actor; every weight sync is recorded on it."""
    scored: tuple[str, ...] = ()
    """Steps run after the rollout by every rank of their role at once, each rank on its part of the whole
    batch (the `scores` phase; see scored_steps), in this order."""

    def scored_on(self) -> dict[str, list[str]]:
        """Trained node -> the scored steps its hosts run, in one call per host: a critic on the actor's hosts
        scores there, after the old log-probs."""
        out: dict[str, list[str]] = {}
        for step in self.scored:
            node = self.critic if step == STEP_OF_ROLE["critic"].name and self.critic in self.trained else self.actor
            assert node is not None
            out.setdefault(node.name, []).append(step)
        return out


def sequences_per_step(spec: RLTrainingJobSpec) -> int:
    return spec.data.batch_size * spec.rollout.samples_per_prompt


def optimizer_steps(spec: RLTrainingJobSpec) -> int:
    """Minibatches per epoch over the global batch: ceil(B * n / miniBatchSize)."""
    return -(-sequences_per_step(spec) // (spec.algorithm.mini_batch_size or sequences_per_step(spec)))


def old_log_probs_from_update(spec: RLTrainingJobSpec, lag: int) -> bool:
    """Whether the update takes the old log-probs from its own forward pass, detached, instead of a pass of
    their own: on-policy (lag 0) with one optimiser step per batch (ppoEpochs 1, one minibatch), every forward
    of the update runs on the weights that generated the batch, so pi_old = pi and the ratio is 1. A KL
    penalty in the reward, or the optimal token baseline, needs them before the advantages, so it keeps the
    pass; rolloutCorrection.bypass takes the engine's instead."""
    kl_in_reward = needs_reference(spec) and spec.algorithm.kl_penalty.mode == "reward"
    return (lag == 0 and spec.algorithm.ppo_epochs == 1 and optimizer_steps(spec) == 1 and not kl_in_reward
            and not spec.algorithm.needs_sum_pi_squared and not old_log_probs_from_rollout(spec))


def old_log_probs_from_rollout(spec: RLTrainingJobSpec) -> bool:
    """Whether the rollout engine's own log-probs are the old ones (rolloutCorrection.bypass): no pass of them."""
    return spec.algorithm.rollout_correction.bypass


def old_log_probs_pass(spec: RLTrainingJobSpec, lag: int) -> bool:
    """Whether a pass scores the old log-probs: neither the update's own forward nor the engine gives them."""
    return not old_log_probs_from_update(spec, lag) and not old_log_probs_from_rollout(spec)


def shards_training(ranks: int, shard: bool, lora: bool) -> bool:
    """Whether a role's ranks shard its weights, gradients and optimizer state (FSDP2): several ranks and
    spec.trainer.training.shard; LoRA adapters are small and stay replicated."""
    return ranks > 1 and shard and not lora


def trains_sharded(spec: RLTrainingJobSpec, node: Node) -> bool:
    """shards_training for a trained node at its declared parallelism."""
    lora = node.role == "actor_rollout" and spec.model.policy.lora is not None
    return shards_training(node.parallelism, spec.trainer.training.shard, lora)


def scored_steps(spec: RLTrainingJobSpec, actor: Node, critic: Node | None, critic_shares_hosts: bool,
                 lag: int) -> tuple[str, ...]:
    """The steps a rollout batch gets from every rank of their role at once, each rank scoring its part of the
    whole batch in one call, instead of chunk by chunk as it is generated (see StepPlan.scored):
      values          a critic on hosts of its own (data-parallel over its ranks), or a sharded one on the
                      actor's hosts, which then scores with its shards and keeps no full copy between updates;
      old_log_probs   a sharded actor whose rollout runs in vLLM's engine and that needs a pass of old
                      log-probs (old_log_probs_pass): scored with the shards, the actor keeps no full copy of the
                      policy while vLLM generates.
    Collectives pair up only when every rank runs the same passes, which chunks dealt to one host at a time
    cannot give."""
    steps: list[str] = []
    if spec.rollout.engine == "vllm" and old_log_probs_pass(spec, lag) and trains_sharded(spec, actor):
        steps.append(STEP_OF_ROLE["actor_rollout"].name)
    if critic is not None and (not critic_shares_hosts or trains_sharded(spec, critic)):
        steps.append(STEP_OF_ROLE["critic"].name)
    return tuple(steps)


def policy_copy_read_between_updates(spec: RLTrainingJobSpec, lag: int, scored: Collection[str] = ()) -> bool:
    """Whether anything reads the actor's full inference copy between updates: torch generation on lag 0 runs on
    it; with lag 1 it runs on a copy of its own, which also scores the old log-probs; vLLM generates in its own
    engine, so only a pass of old log-probs in the chain (see old_log_probs_pass; `scored` as
    StepPlan.scored) or a reference that is the LoRA policy's base reads it. Where nothing does, a sharded actor
    keeps only its shards (RoleTraining.keep_copy)."""
    if reference_in_policy(spec):
        return True
    if spec.rollout.engine == "vllm":
        return old_log_probs_pass(spec, lag) and STEP_OF_ROLE["actor_rollout"].name not in scored
    return lag == 0


# -- the rules ------------------------------------------------------------------------------------


def training_problems(graph: DataflowGraph, spec: RLTrainingJobSpec) -> list[str]:
    """Every reason `graph` cannot train `spec`'s algorithm, each naming the spec field; [] when it can.

    Assumes nothing about structure (graph.validate reports that), so both lists can be shown together.
    """
    algo = spec.algorithm.name
    at = _Locator(graph, spec)
    problems: list[str] = []
    for role in ROLES:
        nodes = graph.by_role(role)
        if not nodes and role in REQUIRED_ROLES[algo]:
            problems.append(f"{at.nodes}: {algo} needs a node with role {role}" + _critic_hint(algo, role))
        if len(nodes) > 1:
            problems.append(f"{at.nodes}: {len(nodes)} nodes have role {role} ({', '.join(n.name for n in nodes)}); "
                            f"allowed: exactly one")
    if not spec.algorithm.trains_critic:
        problems += [f"{at.node(n)}: {algo} trains no critic, so node {n.name!r} would never be used; remove it "
                     "or set spec.algorithm.name to ppo" for n in graph.by_role("critic")]
    actors = graph.by_role("actor_rollout")
    if len(actors) == 1:
        problems += _feed_problems(graph, spec, actors[0], at)
        problems += _engine_problems(graph, spec, actors[0], at)
    problems += _rank_problems(graph, spec, at)
    problems += _consistency_problems(graph, spec)
    problems += _sequence_parallel_problems(graph, spec, at)
    return problems


def policy_lag(graph: DataflowGraph) -> int:
    """1 when the control edge into the actor is `eventual` (one-step off-policy), else 0."""
    actor = graph.first("actor_rollout")
    return int(actor is not None and any(e.control and e.dst_name == actor.name and e.consistency == "eventual"
                                         for e in graph.edges))


def policy_edge(graph: DataflowGraph, spec: RLTrainingJobSpec) -> str:
    """The key of the control edge into the actor; a graph without one is read as having the built-in one
    (trainer -> actor, strong): every update reaches rollout, and its syncs are recorded under that key."""
    actor = graph.by_role("actor_rollout")[0]
    found = next((e.key for e in graph.edges if e.control and e.dst_name == actor.name), None)
    critic = graph.first("critic") if spec.algorithm.trains_critic else None
    return found or f"{(critic or actor).name}->{actor.name}"


def _consistency_problems(graph: DataflowGraph, spec: RLTrainingJobSpec) -> list[str]:
    """What one-step off-policy pipelining cannot do: a vLLM engine sleeps while the policy trains on its GPUs,
    dynamic sampling draws its prompts as the step goes, and the scheduling field is the built-in graph's (a
    written graph says it on its control edge)."""
    problems = []
    if spec.graph is not None and spec.scheduling.consistency == "eventual":
        problems.append("spec.scheduling.consistency: 'eventual' sets the built-in graph's control edge; with "
                        "spec.graph, set consistency: eventual on its control edge into the actor instead")
    if policy_lag(graph) and spec.algorithm.filter_groups is not None:
        problems.append("spec.algorithm.filterGroups: a step rolls out more prompts until its batch is full, which "
                        "a rollout drawn ahead during the update (consistency 'eventual') cannot; with filterGroups "
                        "allowed: strong")
    if policy_lag(graph) and spec.rollout.engine == "vllm":
        problems.append("spec.rollout.engine: 'vllm' sleeps while the policy trains on the same GPUs, so it cannot "
                        "generate during an update; with consistency 'eventual' allowed: torch")
    return problems


def _engine_problems(graph: DataflowGraph, spec: RLTrainingJobSpec, actor: Node, at: _Locator) -> list[str]:
    """A tensor-parallel vLLM engine runs on the GPUs of the actor's one bundle, so the bundle must hold them
    (a graph on GPUs; the built-in graph sizes it so)."""
    tp = rollout_gpus(spec)
    gpus = float(graph.group_of(actor.name).bundle.get("GPU", 0.0))
    if tp == 1 or gpus <= 0 or gpus >= tp:
        return []
    return [f"{at.node(actor)}: one instance of {actor.name!r} holds {gpus:g} GPUs with the nodes it shares a "
            f"process with, but spec.rollout.tensorParallelSize {tp} needs {tp} for one vLLM engine; give "
            f"{actor.name!r} resources {{GPU: {tp}}}"]


def _critic_hint(algo: str, role: str) -> str:
    needs_none = " (or set spec.algorithm.name to grpo, rloo or reinforce_plus_plus, which need none)"
    return needs_none if algo in CRITIC_ALGORITHMS and role == "critic" else ""


def _feed_problems(graph: DataflowGraph, spec: RLTrainingJobSpec, actor: Node, at: _Locator) -> list[str]:
    """A reward or reference node outside the actor's process gets its batches over a data edge from the actor."""
    shared = _group_of(graph, actor.name)
    fed = {e.dst_name for e in graph.data_edges() if e.src_name == actor.name}
    problems = []
    for node in graph.nodes:
        if node.role not in ("reward", "reference") or node.name in shared or node.name in fed:
            continue
        if node.role == "reference" and not needs_reference(spec):
            continue
        problems.append(f"{at.edges}: node {node.name!r} ({node.role}) does not share the actor's process, so it "
                        f"needs a data edge from {actor.name!r} ({{src: {actor.name}, dst: {node.name}}}) or a "
                        f"coLocate edge to it")
    return problems


def _rank_problems(graph: DataflowGraph, spec: RLTrainingJobSpec, at: _Locator) -> list[str]:
    """Every data-parallel rank of a trained node takes a shard of the step's batch: none may be left empty."""
    have = sequences_per_step(spec)
    problems = []
    for node in graph.by_role("actor_rollout") + graph.by_role("critic"):
        if node.parallelism > have:
            problems.append(
                f"{at.node(node)}.parallelism: {node.parallelism} ranks of {node.name!r} need at least one sequence "
                f"each, but a step has {have} (spec.data.batchSize * spec.rollout.samplesPerPrompt)"
            )
    return problems


SP_FIELDS: dict[str, str] = {"actor_rollout": "spec.model.policy.sequenceParallel",
                             "critic": "spec.model.critic.sequenceParallel"}
"""The spec field that sets each trained role's sequence-parallel size."""


def sequence_parallel_sizes(spec: RLTrainingJobSpec) -> dict[str, int]:
    """role -> the Ulysses group size the spec asks of it (1: off)."""
    return {"actor_rollout": spec.model.policy.sequence_parallel,
            "critic": spec.model.critic.sequence_parallel if spec.algorithm.trains_critic else 1}


def _sequence_parallel_problems(graph: DataflowGraph, spec: RLTrainingJobSpec, at: _Locator) -> list[str]:
    """Sequence parallelism splits a trained role's ranks into groups of P that share a shard: the role needs a
    multiple of P ranks, and a critic with SP needs hosts of its own (values computed in the actor's process
    follow the rows generated there)."""
    problems = []
    actors = graph.by_role("actor_rollout")
    for role, size in sequence_parallel_sizes(spec).items():
        nodes = graph.by_role(role)
        if size == 1 or len(nodes) != 1:
            continue
        node = nodes[0]
        if role == "critic" and actors and node.name in _group_of(graph, actors[0].name):
            problems.append(f"{SP_FIELDS[role]}: {size} needs a critic on hosts of its own, but {at.node(node)} "
                            "shares the actor's hosts; allowed there: 1")
            continue
        problem = sequence_parallel_problem(node.name, node.parallelism, size, SP_FIELDS[role],
                                            f"{at.node(node)}.parallelism")
        problems += [problem] if problem else []
    return problems


def sequence_parallel_problem(node: str, parallelism: int, size: int, field: str, where: str = "") -> str | None:
    """Why `parallelism` ranks of `node` cannot form groups of `size` sequence-parallel ranks, or None."""
    if size > 1 and parallelism % size:
        at = f"{where}: " if where else ""
        return (f"{at}{parallelism} ranks of {node!r} do not split into groups of {field} = {size}; "
                f"allowed: a multiple of {size}")
    return None


class _Locator:
    """Field paths for messages: spec.graph.nodes[i] for a written graph, the node's name for the built-in one."""

    def __init__(self, graph: DataflowGraph, spec: RLTrainingJobSpec) -> None:
        self.custom = spec.graph is not None
        self._index = {n.name: i for i, n in enumerate(spec.graph.nodes)} if spec.graph is not None else {}
        self.nodes = "spec.graph.nodes" if self.custom else f"the built-in {graph.name} graph"
        self.edges = "spec.graph.edges" if self.custom else f"the built-in {graph.name} graph"

    def node(self, node: Node) -> str:
        if node.name in self._index:
            return f"spec.graph.nodes[{self._index[node.name]}]"
        return f"{self.nodes} (node {node.name!r})"


def _group_of(graph: DataflowGraph, name: str) -> set[str]:
    return {n.name for n in graph.group_of(name).nodes}


# -- entry points ---------------------------------------------------------------------------------


def trainable_graph(spec: RLTrainingJobSpec, accelerator: Literal["GPU", "CPU"] = "GPU", parallelism: int = 1,
                    critic_parallelism: int | None = None) -> DataflowGraph:
    """spec.graph, else the built-in graph; raises GraphError with every structural and training problem.

    Each problem names its field: structural ones are prefixed `spec.graph: `.
    """
    graph = spec_graph(spec, accelerator, parallelism, critic_parallelism)
    problems: list[str] = []
    try:
        graph.validate()
    except GraphError as e:
        problems += [f"spec.graph: {p}" for p in e.problems]
    problems += training_problems(graph, spec)
    if problems:
        raise GraphError(problems)
    return graph


def graph_problems(spec: RLTrainingJobSpec, accelerator: Literal["GPU", "CPU"] = "GPU") -> list[str]:
    """What `trainable_graph` would raise, as a list (empty when the job's graph can train)."""
    try:
        trainable_graph(spec, accelerator)
    except GraphError as e:
        return e.problems
    return []


def step_plan(graph: DataflowGraph, spec: RLTrainingJobSpec) -> StepPlan:
    """Read a valid graph: which steps share the actor's process, which stream elsewhere, what trains.

    A critic that shares the actor's hosts scores values right after generation like any co-located
    step; a separate critic, and the steps of sharded roles whose copy nothing else reads, are scored in the
    `scores` phase by every rank at once (scored_steps).
    """
    problems = training_problems(graph, spec)
    if problems:
        raise GraphError(problems)
    actor = graph.by_role("actor_rollout")[0]
    critic = graph.by_role("critic")[0] if spec.algorithm.trains_critic else None
    shared = _group_of(graph, actor.name)
    colocated: list[str] = []
    remote: list[RemoteStep] = []
    for node in graph.topo_order():
        if node is actor or (node.role == "reference" and not needs_reference(spec)):
            continue
        step = STEP_OF_ROLE[node.role]
        if node.name in shared:
            colocated.append(step.name)
        elif node.role != "critic":
            remote.append(RemoteStep(step, node, f"{actor.name}->{node.name}"))
    lag = policy_lag(graph)
    if old_log_probs_pass(spec, lag):
        colocated.append(STEP_OF_ROLE["actor_rollout"].name)
    separate_critic = critic is not None and critic.name not in shared
    scored = scored_steps(spec, actor, critic, not separate_critic, lag)
    colocated = [s for s in colocated if s not in scored]
    phases: tuple[Phase, ...] = ("rollout", "scores", "advantages", "update") if scored else (
        "rollout", "advantages", "update")
    fused = (actor.parallelism == 1 and not remote and not separate_critic
             and spec.scheduling.micro_batch_size is None and spec.algorithm.filter_groups is None)
    trained = (actor, critic) if separate_critic and critic is not None else (actor,)
    reads_trained = {"values"} | ({"reference"} if reference_in_policy(spec) else set())
    late = tuple(s for s in colocated if lag and s in reads_trained)
    return StepPlan(actor, critic, tuple(s for s in colocated if s not in late), tuple(remote), trained, phases,
                    fused, lag, late, policy_edge(graph, spec), scored)


# -- what the graph asks of a cluster -------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class PoolDemand(Mapping[str, float]):
    """What one pool needs: resource -> amount in whole devices, read like a dict.

    `largest_bundle` is the most one instance asks for (summed over its co-located nodes): a single
    pod of the pool must hold at least that much.
    """

    resources: Mapping[str, float]
    largest_bundle: Mapping[str, float]

    def __getitem__(self, key: str) -> float:
        return self.resources[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.resources)

    def __len__(self) -> int:
        return len(self.resources)


@dataclass(frozen=True)
class ResourcePlan:
    """Everything rendering needs from a graph, asked once."""

    graph: DataflowGraph
    pools: tuple[str, ...]
    """Pool names in graph order."""
    groups: tuple[ColocationGroup, ...]
    demand: Mapping[str, PoolDemand]
    """Per pool, whole devices (graph.pool_demand())."""
    instance_gpus: Mapping[str, float]
    """Node name -> GPUs of the bundle one instance shares with its co-located nodes."""
    neighbours: Mapping[str, str]
    """Pool of only reward nodes that the actor feeds directly -> the actor's pool (run them side by side)."""
    rollout_pool: str | None
    """Pool of the actor_rollout node: the one whose size may change while the job runs."""


def resource_plan(graph: DataflowGraph) -> ResourcePlan:
    groups = tuple(graph.colocation_groups())
    pools = tuple(dict.fromkeys(n.pool for n in graph.nodes))
    totals = graph.pool_demand()
    largest: dict[str, dict[str, float]] = {p: {} for p in pools}
    for g in groups:
        for res, amount in g.bundle.items():
            largest[g.pool][res] = max(largest[g.pool].get(res, 0.0), amount)
    actor = graph.first("actor_rollout")
    return ResourcePlan(
        graph=graph,
        pools=pools,
        groups=groups,
        demand=MappingProxyType({p: PoolDemand(MappingProxyType(totals.get(p, {})), MappingProxyType(largest[p]))
                                 for p in pools}),
        instance_gpus=MappingProxyType({n.name: float(g.bundle.get("GPU", 0.0)) for g in groups for n in g.nodes}),
        neighbours=MappingProxyType(_reward_neighbours(graph, pools)),
        rollout_pool=actor.pool if actor else None,
    )


def _reward_neighbours(graph: DataflowGraph, pools: tuple[str, ...]) -> dict[str, str]:
    near: dict[str, str] = {}
    for pool in pools:
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
