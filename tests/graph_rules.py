"""Graphs that break one training rule each, with the message every entry point must show for it.

test_plan.py checks them at the plan level, in `hybridflow validate`, preflight and the trainer's step
plan; test_render.py in rendering; test_operator_loop.py in the operator's status.
"""

from __future__ import annotations

from collections.abc import Callable

from hybridflow.api.spec import GROUP_ALGORITHMS


def node(name: str, role: str, pool: str = "actor", parallelism: int = 1, **resources: float) -> dict:
    return {"name": name, "role": role, "resources": resources, "parallelism": parallelism, "pool": pool}


def ppo_graph() -> dict:
    """The built-in PPO graph on CPUs, written out: reward and reference share the actor's process."""
    return {
        "nodes": [node("actor", "actor_rollout", CPU=1), node("score", "reward"), node("ref", "reference"),
                  node("critic", "critic", CPU=1)],
        "edges": [{"src": "actor", "dst": "score", "coLocate": True}, {"src": "actor", "dst": "ref", "coLocate": True},
                  {"src": "actor", "dst": "critic"}, {"src": "critic", "dst": "actor", "control": True}],
    }


def drop(graph: dict, name: str) -> dict:
    graph["nodes"] = [n for n in graph["nodes"] if n["name"] != name]
    graph["edges"] = [e for e in graph["edges"] if name not in (e["src"], e["dst"])]
    return graph


def add_remote(graph: dict, name: str, role: str, edge: bool) -> dict:
    graph["nodes"].append(node(name, role, pool="side"))
    if edge:
        graph["edges"].append({"src": "actor", "dst": name})
    return graph


Mutation = Callable[[dict], None]


def with_graph(change: Callable[[dict], dict], algorithm: str = "ppo") -> Mutation:
    def apply(doc: dict) -> None:
        doc["spec"]["algorithm"]["name"] = algorithm
        if algorithm in GROUP_ALGORITHMS:
            doc["spec"]["rollout"]["samplesPerPrompt"] = 2
        doc["spec"]["graph"] = change(ppo_graph())

    return apply


def set_parallelism(graph: dict, name: str, n: int) -> dict:
    for nd in graph["nodes"]:
        if nd["name"] == name:
            nd["parallelism"] = n
    return graph


def wide_actor(graph: dict) -> dict:
    """Actor, reward and reference co-located at 300 ranks, more than tiny-ppo's 256 sequences a step."""
    for name in ("actor", "score", "ref"):
        set_parallelism(graph, name, 300)
    return graph


def eventual(graph: dict) -> dict:
    """The policy reaches rollout one step late (one-step off-policy)."""
    for e in graph["edges"]:
        if e.get("control"):
            e["consistency"] = "eventual"
    return graph


def and_spec(mutation: Mutation, section: str, **fields: object) -> Mutation:
    def apply(doc: dict) -> None:
        mutation(doc)
        doc["spec"].setdefault(section, {}).update(fields)

    return apply


RULES: dict[str, tuple[Mutation, str]] = {
    "ppo without reward": (with_graph(lambda g: drop(g, "score")),
                           "spec.graph.nodes: ppo needs a node with role reward"),
    "ppo without critic": (with_graph(lambda g: drop(g, "critic")),
                           "spec.graph.nodes: ppo needs a node with role critic"),
    "no actor": (with_graph(lambda g: drop(g, "actor")),
                 "spec.graph.nodes: ppo needs a node with role actor_rollout"),
    "two reward nodes": (with_graph(lambda g: add_remote(g, "score2", "reward", edge=True)),
                         "spec.graph.nodes: 2 nodes have role reward (score, score2); allowed: exactly one"),
    "two critics": (with_graph(lambda g: add_remote(g, "critic2", "critic", edge=True)),
                    "spec.graph.nodes: 2 nodes have role critic (critic, critic2); allowed: exactly one"),
    "two references": (with_graph(lambda g: add_remote(g, "ref2", "reference", edge=True)),
                       "spec.graph.nodes: 2 nodes have role reference (ref, ref2); allowed: exactly one"),
    "critic in grpo": (with_graph(lambda g: g, algorithm="grpo"),
                       "spec.graph.nodes[3]: grpo trains no critic, so node 'critic' would never be used"),
    "critic in rloo": (with_graph(lambda g: g, algorithm="rloo"),
                       "spec.graph.nodes[3]: rloo trains no critic, so node 'critic' would never be used"),
    "remote reward without an edge from the actor": (
        with_graph(lambda g: add_remote(drop(g, "score"), "score", "reward", edge=False)),
        "spec.graph.edges: node 'score' (reward) does not share the actor's process, so it needs a data edge "
        "from 'actor'"),
    "remote reference without an edge from the actor": (
        with_graph(lambda g: add_remote(drop(g, "ref"), "ref", "reference", edge=False)),
        "spec.graph.edges: node 'ref' (reference) does not share the actor's process"),
    "more actor ranks than sequences": (
        with_graph(wide_actor),
        "spec.graph.nodes[0].parallelism: 300 ranks of 'actor' need at least one sequence each, but a step has 256"),
    "more critic ranks than sequences": (
        with_graph(lambda g: set_parallelism(g, "critic", 257)),
        "spec.graph.nodes[3].parallelism: 257 ranks of 'critic' need at least one sequence each"),
    "eventual consistency with a vllm engine": (
        and_spec(with_graph(eventual), "rollout", engine="vllm"),
        "spec.rollout.engine: 'vllm' sleeps while the policy trains on the same GPUs, so it cannot generate during "
        "an update; with consistency 'eventual' allowed: torch"),
    "scheduling consistency with a written graph": (
        and_spec(with_graph(lambda g: g), "scheduling", consistency="eventual"),
        "spec.scheduling.consistency: 'eventual' sets the built-in graph's control edge; with spec.graph, set "
        "consistency: eventual on its control edge into the actor instead"),
}
