"""The dataflow DSL: structure checks, co-location bundles, capacity, the built-in graphs."""

from __future__ import annotations

import pytest

from hybridflow import DataflowGraph, Edge, GraphError, Node
from hybridflow.api import load_job, parse_job
from hybridflow.graph import builtin_graph, devices_needed, gpus_needed, graph_for_gpus
from hybridflow.plan import step_plan, trainable_graph
from tests.conftest import EXAMPLES


def design_graph() -> DataflowGraph:
    g = DataflowGraph("ppo")
    actor = g.node(Node("actor_rollout", role="actor_rollout", resources={"GPU": 0.5}, parallelism=8))
    reward = g.node(Node("reward_score", role="reward", resources={"GPU": 0.5}, parallelism=8))
    critic = g.node(Node("critic_train", role="critic", resources={"GPU": 1}, parallelism=4))
    g.edge(Edge(actor, reward, data_type="rollout_batch", co_locate=True, max_size_bytes=10_000_000))
    g.edge(Edge(reward, critic, data_type="rewarded_batch"))
    g.edge(Edge(critic, actor, data_type="updated_policy", control=True, consistency="strong"))
    return g


def test_valid_graph_and_topological_order() -> None:
    g = design_graph().validate()
    assert [n.name for n in g.topo_order()] == ["actor_rollout", "reward_score", "critic_train"]
    groups = {tuple(n.name for n in grp.nodes): grp for grp in g.colocation_groups()}
    shared = groups[("actor_rollout", "reward_score")]
    assert shared.bundle == {"GPU": 1.0} and shared.parallelism == 8


def test_unknown_and_duplicate_nodes() -> None:
    g = design_graph()
    g.node(Node("critic_train", role="critic"))
    g.edge(Edge("actor_rollout", "nowhere"))
    with pytest.raises(GraphError) as info:
        g.validate()
    text = str(info.value)
    assert "duplicate node name 'critic_train'" in text
    assert "unknown node 'nowhere'" in text


def test_cycle_needs_a_control_edge() -> None:
    g = design_graph()
    g.edge(Edge("critic_train", "actor_rollout", data_type="values"))
    with pytest.raises(GraphError, match=r"cycle through .* is not closed by a control edge"):
        g.validate()


def test_co_located_pair_that_cannot_share_a_bundle() -> None:
    g = DataflowGraph("x")
    a = g.node(Node("a", "actor_rollout", {"GPU": 1}, 2))
    b = g.node(Node("b", "reward", {"GPU": 0.5}, 2))
    g.edge(Edge(a, b, co_locate=True))
    with pytest.raises(GraphError, match=r"cannot share a bundle: together they need GPU=1.5"):
        g.validate()


def test_co_located_nodes_need_the_same_parallelism_and_pool() -> None:
    g = DataflowGraph("x")
    a = g.node(Node("a", "actor_rollout", {"GPU": 0.5}, 2, pool="p1"))
    b = g.node(Node("b", "reward", {"GPU": 0.5}, 4, pool="p2"))
    g.edge(Edge(a, b, co_locate=True))
    with pytest.raises(GraphError) as info:
        g.validate()
    assert "same parallelism" in str(info.value) and "one pool" in str(info.value)


def test_capacity_names_the_missing_resources() -> None:
    g = design_graph().validate()
    g.check_capacity({"GPU": 12, "CPU": 64})
    with pytest.raises(GraphError, match=r"needs GPU=12 but the cluster has 8 \(missing 4\)"):
        g.check_capacity({"GPU": 8})
    with pytest.raises(GraphError, match=r"no node has more than 0\.5"):
        g.check_capacity({"GPU": 12}, per_node_max={"GPU": 0.5})


def test_unknown_role_is_rejected() -> None:
    g = DataflowGraph("x")
    g.node(Node("a", "rollout_only"))
    with pytest.raises(GraphError, match="unknown role 'rollout_only'"):
        g.validate()


def test_devices_needed_packs_fractions() -> None:
    assert devices_needed(0.5, 16) == 8
    assert devices_needed(0.75, 16) == 16
    assert devices_needed(1, 4) == 4
    assert devices_needed(2, 3) == 6


def test_builtin_graphs() -> None:
    ppo = load_job(EXAMPLES / "ppo-job.yaml").spec
    g = trainable_graph(ppo, "GPU", parallelism=16, critic_parallelism=8)
    assert {n.role for n in g.nodes} == {"actor_rollout", "reward", "reference", "critic"}
    assert g.pool_demand() == {"actor": {"GPU": 16.0}, "critic": {"GPU": 8.0}}
    grpo = load_job(EXAMPLES / "grpo-job.yaml").spec
    assert "critic" not in {n.role for n in trainable_graph(grpo, "GPU").nodes}
    cpu = trainable_graph(load_job(EXAMPLES / "tiny-ppo.yaml").spec, "CPU")
    assert all("GPU" not in n.resources for n in cpu.nodes)


def test_one_gpu_trains_ppo_with_the_critic_in_the_actors_pool() -> None:
    """The built-in ppo graph asks a GPU for the actor's roles and one for the critic; on a one-GPU machine the
    critic, still a process of its own, joins the actor's pool and takes a quarter of that GPU, and the graph
    passes the plan's checks."""
    tiny = load_job(EXAMPLES / "tiny-ppo.yaml").spec
    assert gpus_needed(builtin_graph(tiny, "GPU")) == 1.75
    compact = graph_for_gpus(tiny, 1)
    assert compact is not None and gpus_needed(compact) == 1
    assert {n.pool for n in compact.nodes} == {"actor"}
    assert sorted(sorted(n.role for n in g.nodes) for g in compact.colocation_groups()) == [
        ["actor_rollout", "reference", "reward"], ["critic"]]
    assert compact.get("critic").resources == {"GPU": 0.25} and compact.get("actor_rollout").resources == {"GPU": 0.5}
    compact.check_capacity({"GPU": 1})
    tiny.graph = compact.to_spec()
    step_plan(trainable_graph(tiny, "GPU"), tiny)
    assert graph_for_gpus(tiny, 1) is None  # a written graph stands


def test_the_built_in_graph_stands_where_it_fits_or_nothing_fits() -> None:
    tiny = load_job(EXAMPLES / "tiny-ppo.yaml").spec
    assert graph_for_gpus(tiny, 2) is None
    assert graph_for_gpus(load_job(EXAMPLES / "tiny-grpo.yaml").spec, 1) is None  # no critic to move
    doc = load_job(EXAMPLES / "tiny-ppo.yaml").model_dump(mode="json", by_alias=True)
    doc["spec"]["reward"] = {"type": "model", "model": {"path": "builtin:tiny"}}
    with_model = parse_job(doc).spec
    compact = builtin_graph(with_model, "GPU", critic_with_actor=True)
    shares = {n.role: n.resources.get("GPU", 0.0) for n in compact.nodes}
    assert shares == {"actor_rollout": 0.25, "reward": 0.25, "reference": 0.25, "critic": 0.25}
    assert graph_for_gpus(with_model, 1) is not None and graph_for_gpus(with_model, 0.5) is None


def test_spec_graph_round_trip() -> None:
    g = design_graph()
    again = DataflowGraph.from_spec(g.to_spec())
    assert [(n.name, n.resources, n.parallelism) for n in again.nodes] == [
        (n.name, n.resources, n.parallelism) for n in g.nodes
    ]
    assert [e.key for e in again.edges] == [e.key for e in g.edges]


def test_nodes_are_pinned_to_their_worker_group_when_the_cluster_advertises_it() -> None:
    from hybridflow.scheduler.placement import pin_to_pools

    g = pin_to_pools(design_graph(), {"GPU": 16, "pool_default": 8})
    assert g.get("actor_rollout").resources == {"GPU": 0.5, "pool_default": 0.5}
    assert g.get("critic_train").resources == {"GPU": 1, "pool_default": 1}
    untouched = pin_to_pools(design_graph(), {"GPU": 16})
    assert "pool_default" not in untouched.get("actor_rollout").resources


def test_eventual_consistency_belongs_to_a_control_edge() -> None:
    g = design_graph()
    g.edges[0].consistency = "eventual"
    with pytest.raises(GraphError, match=r"edge actor_rollout->reward_score: consistency 'eventual' is for the "
                                         r"control edge that brings the updated policy to the actor"):
        g.validate()
    g = design_graph()
    g.edges[-1].consistency = "eventual"
    assert g.validate() is g
