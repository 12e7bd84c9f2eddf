"""Which graphs can train: every rule at the plan level and at each entry point that must enforce it
(`hybridflow validate`, preflight, the trainer's step plan); the step plan and the resource plan."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from hybridflow import DataflowGraph, GraphError
from hybridflow.api import RLTrainingJobSpec, parse_job
from hybridflow.cli import main as cli_main
from hybridflow.plan import (
    REQUIRED_ROLES,
    STEP_OF_ROLE,
    STEPS,
    old_log_probs_from_rollout,
    old_log_probs_from_update,
    old_log_probs_pass,
    policy_copy_read_between_updates,
    resource_plan,
    step_plan,
    trainable_graph,
    training_problems,
)
from hybridflow.preflight import preflight
from tests.graph_rules import add_remote, drop, eventual, node, ppo_graph, set_parallelism


def test_each_rule_at_the_plan_level(broken) -> None:
    doc, needle = broken
    spec = parse_job(doc).spec
    assert any(needle in p for p in training_problems(DataflowGraph.from_spec(spec.graph), spec))
    with pytest.raises(GraphError) as info:
        trainable_graph(spec, "CPU")
    assert any(needle in p for p in info.value.problems)


def test_each_rule_in_hybridflow_validate(broken, tmp_path: Path, capsys) -> None:
    doc, needle = broken
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert cli_main(["validate", str(path)]) == 1
    err = capsys.readouterr().err
    assert needle in err, err
    assert "Traceback" not in err


def test_each_rule_in_preflight(broken) -> None:
    doc, needle = broken
    problems = preflight(parse_job(doc).spec, "CPU")
    assert any(needle in p for p in problems), problems


def test_each_rule_in_the_trainers_step_plan(broken) -> None:
    doc, needle = broken
    spec = parse_job(doc).spec
    with pytest.raises(GraphError) as info:
        step_plan(DataflowGraph.from_spec(spec.graph), spec)
    assert any(needle in p for p in info.value.problems)


def test_structural_and_training_problems_are_reported_together(example_doc) -> None:
    doc = example_doc("tiny-ppo.yaml")
    doc["spec"]["graph"] = drop(ppo_graph(), "score")
    doc["spec"]["graph"]["edges"].append({"src": "ref", "dst": "actor"})
    with pytest.raises(GraphError) as info:
        trainable_graph(parse_job(doc).spec)
    assert info.value.problems == ["spec.graph: cycle through actor, critic, ref is not closed by a control edge",
                                   "spec.graph.nodes: ppo needs a node with role reward"]


def test_the_built_in_graphs_name_the_node_when_ranks_outnumber_sequences(example_doc) -> None:
    spec = parse_job(example_doc("tiny-grpo.yaml")).spec  # 32 prompts x 8 samples
    trainable_graph(spec, "GPU", parallelism=256)
    with pytest.raises(GraphError, match=r"the built-in grpo graph \(node 'actor_rollout'\)\.parallelism: 257 ranks"):
        trainable_graph(spec, "GPU", parallelism=257)


def test_every_example_can_train(example_doc) -> None:
    from tests.conftest import EXAMPLES

    for path in EXAMPLES.glob("*.yaml"):
        spec = parse_job(yaml.safe_load(path.read_text())).spec
        step_plan(trainable_graph(spec, "GPU"), spec)


# -- the step plan --------------------------------------------------------------------------------


def spec_of(example_doc, name: str, graph: dict | None = None, **algorithm) -> RLTrainingJobSpec:
    doc = example_doc(name)
    doc["spec"]["algorithm"].update(algorithm)
    if graph is not None:
        doc["spec"]["graph"] = graph
        doc["spec"]["cluster"]["workerGroups"] = []  # derived from the graph's pools
    return parse_job(doc).spec


def test_one_step_table_for_every_role() -> None:
    assert {s.role for s in STEPS.values()} == {r for roles in REQUIRED_ROLES.values() for r in roles} | {"reference"}
    assert STEP_OF_ROLE["reference"].method == "ref_log_probs"
    assert STEP_OF_ROLE["actor_rollout"].name == "old_log_probs"


@pytest.mark.parametrize("algorithm", ["rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_the_other_critic_free_algorithms_run_grpos_graph_and_plan(example_doc, algorithm: str) -> None:
    grpo = spec_of(example_doc, "tiny-grpo.yaml")
    doc = example_doc("tiny-grpo.yaml")
    doc["spec"]["algorithm"]["name"] = algorithm
    spec = parse_job(doc).spec
    graph = trainable_graph(spec, "GPU", parallelism=4)
    assert graph.name == algorithm
    assert [(n.name, n.role, n.pool) for n in graph.nodes] == [
        (n.name, n.role, n.pool) for n in trainable_graph(grpo, "GPU", parallelism=4).nodes]
    plan = step_plan(trainable_graph(spec, "CPU"), spec)
    assert plan.critic is None and plan.phases == ("rollout", "advantages", "update")
    assert REQUIRED_ROLES[algorithm] == ("actor_rollout", "reward")
    doc["spec"]["graph"] = drop(drop(ppo_graph(), "score"), "critic")
    spec = parse_job(doc).spec
    assert training_problems(DataflowGraph.from_spec(spec.graph), spec) == [
        f"spec.graph.nodes: {algorithm} needs a node with role reward"]


def test_ppo_without_a_critic_names_the_critic_free_algorithms(example_doc) -> None:
    spec = spec_of(example_doc, "tiny-ppo.yaml", graph=drop(ppo_graph(), "critic"))
    assert spec.graph is not None
    problems = training_problems(DataflowGraph.from_spec(spec.graph), spec)
    assert problems == ["spec.graph.nodes: ppo needs a node with role critic (or set spec.algorithm.name to grpo, "
                        "rloo or reinforce_plus_plus, which need none)"]


def test_grpo_on_one_actor_is_one_call_per_step(example_doc) -> None:
    spec = spec_of(example_doc, "tiny-grpo.yaml")
    plan = step_plan(trainable_graph(spec, "CPU"), spec)
    assert plan.colocated == ("reward", "reference", "old_log_probs")
    assert plan.phases == ("rollout", "advantages", "update")
    assert plan.fused and plan.critic is None and plan.remote == ()
    assert [n.name for n in plan.trained] == ["actor_rollout"]


ONE_STEP = {"miniBatchSize": 256}  # the tiny GRPO job's whole batch: one optimiser step per batch


@pytest.mark.parametrize(("algorithm", "lag", "separate_pass"), [
    ({}, 0, True),  # two minibatches: the second is taken after a step
    (ONE_STEP, 0, False),
    (ONE_STEP | {"ppoEpochs": 2}, 0, True),
    (ONE_STEP, 1, True),  # pipelined: the batch comes from the policy before
    (ONE_STEP | {"klPenalty": {"coef": 0.01, "mode": "reward"}}, 0, True),  # the advantages need them
    (ONE_STEP | {"klPenalty": {"coef": 0.0, "mode": "reward"}}, 0, False),
])
def test_old_log_probs_get_a_pass_of_their_own_unless_the_update_is_one_on_policy_step(
        example_doc, algorithm: dict, lag: int, separate_pass: bool) -> None:
    spec = spec_of(example_doc, "tiny-grpo.yaml", **algorithm)
    assert old_log_probs_from_update(spec, lag) is not separate_pass
    assert old_log_probs_pass(spec, lag) is separate_pass
    if not lag:
        plan = step_plan(trainable_graph(spec, "CPU"), spec)
        assert ("old_log_probs" in plan.colocated) is separate_pass


BYPASS = {"rolloutCorrection": {"bypass": True}}


@pytest.mark.parametrize(("algorithm", "lag"), [({}, 0), (ONE_STEP, 0), (ONE_STEP, 1),
                                                ({"klPenalty": {"coef": 0.01, "mode": "reward"}}, 0)])
def test_with_bypass_the_engines_log_probs_are_the_old_ones_and_no_pass_scores_them(
        example_doc, algorithm: dict, lag: int) -> None:
    """Not even the update's own forward on one on-policy step: the ratio is taken to the engine's policy."""
    spec = spec_of(example_doc, "tiny-grpo.yaml", **(algorithm | BYPASS))
    assert old_log_probs_from_rollout(spec) and not old_log_probs_from_update(spec, lag)
    assert not old_log_probs_pass(spec, lag)
    if not lag:
        assert "old_log_probs" not in step_plan(trainable_graph(spec, "CPU"), spec).colocated


def test_a_sharded_vllm_actor_with_bypass_scores_nothing_and_keeps_no_copy(example_doc) -> None:
    spec = spec_of(example_doc, "ppo-job.yaml", **BYPASS)
    plan = step_plan(trainable_graph(spec, "GPU", parallelism=16), spec)
    assert plan.scored == ("values",) and "old_log_probs" not in plan.colocated
    assert policy_copy_read_between_updates(spec, plan.lag, plan.scored) is False


@pytest.mark.parametrize(("job", "algorithm", "lag", "read"), [
    ("tiny-grpo.yaml", {}, 0, True),  # torch generation runs on the copy
    ("tiny-grpo.yaml", {}, 1, False),  # generation and the old log-probs run on a copy of their own
    ("tiny-grpo-lora.yaml", {}, 1, True),  # the reference is the copy's base
    ("grpo-job.yaml", {}, 0, True),  # vLLM generates; four minibatches: the old log-probs are the copy's
    ("grpo-job.yaml", {"miniBatchSize": 1024}, 0, False),  # one step: the update scores them itself
])
def test_the_actor_keeps_its_full_copy_only_where_something_reads_it_between_updates(
        example_doc, job: str, algorithm: dict, lag: int, read: bool) -> None:
    assert policy_copy_read_between_updates(spec_of(example_doc, job, **algorithm), lag) is read


def test_old_log_probs_scored_from_the_shards_leave_nothing_to_read_the_vllm_actors_copy(example_doc) -> None:
    spec = spec_of(example_doc, "grpo-job.yaml")
    assert policy_copy_read_between_updates(spec, 0, ("old_log_probs",)) is False
    assert policy_copy_read_between_updates(spec_of(example_doc, "tiny-grpo.yaml"), 0, ("old_log_probs",)) is True


def test_ppo_with_its_own_critic_scores_values_in_a_phase_of_their_own(example_doc) -> None:
    spec = spec_of(example_doc, "tiny-ppo.yaml")
    plan = step_plan(trainable_graph(spec, "CPU"), spec)
    assert plan.phases == ("rollout", "scores", "advantages", "update")
    assert plan.scored == ("values",) and plan.scored_on() == {"critic": ["values"]}
    assert not plan.fused
    assert [n.name for n in plan.trained] == ["actor_rollout", "critic"]


@pytest.mark.parametrize(("ranks", "algorithm", "scored", "chain"), [
    (16, {}, ("old_log_probs", "values"), ("reward", "reference")),  # KL in the reward: a pass of its own
    (1, {}, ("values",), ("reward", "reference", "old_log_probs")),  # one rank shards nothing
    (16, {"klPenalty": {"type": "low_var_kl", "coef": 0.001, "mode": "loss"}}, ("values",),
     ("reward", "reference")),  # one optimiser step: the update scores them itself
])
def test_a_sharded_vllm_actor_scores_its_old_log_probs_with_every_rank_at_once(
        example_doc, ranks: int, algorithm: dict, scored: tuple, chain: tuple) -> None:
    spec = spec_of(example_doc, "ppo-job.yaml", **algorithm)
    plan = step_plan(trainable_graph(spec, "GPU", parallelism=ranks), spec)
    assert plan.scored == scored and plan.colocated == chain
    assert plan.scored_on() == ({"actor_rollout": ["old_log_probs"]} if "old_log_probs" in scored else {}) | {
        "critic": ["values"]}
    assert policy_copy_read_between_updates(spec, plan.lag, plan.scored) is (scored == ("values",) and ranks == 1)


def test_a_sharded_critic_on_the_actors_hosts_scores_values_with_every_rank_at_once(example_doc) -> None:
    """Its values leave the chain for the scores phase, run in the actor's hosts after the old log-probs would
    be; unsharded (training.shard off), it scores them chunk by chunk in the chain; with lag 1 they come after
    the update either way (the phase follows the rollout of the next step)."""
    graph = ppo_graph()
    graph["edges"][2]["coLocate"] = True
    for name in ("actor", "score", "ref", "critic"):
        set_parallelism(graph, name, 2)
    spec = spec_of(example_doc, "tiny-ppo.yaml", graph)
    plan = step_plan(trainable_graph(spec, "CPU"), spec)
    assert plan.colocated == ("reward", "reference", "old_log_probs") and plan.scored == ("values",)
    assert plan.phases == ("rollout", "scores", "advantages", "update") and not plan.fused
    assert plan.scored_on() == {"actor": ["values"]} and [n.name for n in plan.trained] == ["actor"]

    doc = example_doc("tiny-ppo.yaml")
    doc["spec"]["graph"], doc["spec"]["cluster"]["workerGroups"] = graph, []
    doc["spec"]["trainer"]["training"] = {"shard": False}
    spec = parse_job(doc).spec
    plan = step_plan(trainable_graph(spec, "CPU"), spec)
    assert plan.colocated == ("reward", "reference", "values", "old_log_probs") and plan.scored == ()

    spec = spec_of(example_doc, "tiny-ppo.yaml", eventual(graph))
    plan = step_plan(trainable_graph(spec, "CPU"), spec)
    assert plan.lag == 1 and plan.scored == ("values",) and plan.late == ()


def test_a_critic_sharing_the_actors_process_scores_values_in_it(example_doc) -> None:
    graph = ppo_graph()
    graph["edges"][2]["coLocate"] = True
    spec = spec_of(example_doc, "tiny-ppo.yaml", graph)
    plan = step_plan(trainable_graph(spec, "CPU"), spec)
    assert plan.colocated == ("reward", "reference", "values", "old_log_probs")
    assert plan.phases == ("rollout", "advantages", "update") and plan.fused
    assert plan.critic is not None and [n.name for n in plan.trained] == ["actor"]


def test_remote_steps_stream_over_the_actors_edge(example_doc) -> None:
    graph = add_remote(drop(ppo_graph(), "score"), "score", "reward", edge=True)
    spec = spec_of(example_doc, "tiny-ppo.yaml", graph)
    plan = step_plan(trainable_graph(spec, "CPU"), spec)
    assert [(r.step.name, r.node.name, r.edge) for r in plan.remote] == [("reward", "score", "actor->score")]
    assert plan.colocated == ("reference", "old_log_probs") and not plan.fused


def test_a_reference_node_is_ignored_without_a_kl_penalty(example_doc) -> None:
    graph = add_remote(drop(ppo_graph(), "ref"), "ref", "reference", edge=False)
    kl_off = copy.deepcopy(example_doc("tiny-ppo.yaml")["spec"]["algorithm"]["klPenalty"]) | {"coef": 0.0}
    spec = spec_of(example_doc, "tiny-ppo.yaml", graph, klPenalty=kl_off)
    plan = step_plan(trainable_graph(spec, "CPU"), spec)
    assert "reference" not in plan.colocated and plan.remote == ()


# -- the resource plan ----------------------------------------------------------------------------


def test_resource_plan_of_a_graph_with_a_reward_pool(example_doc) -> None:
    graph = {
        "nodes": [node("actor", "actor_rollout", parallelism=16, GPU=0.5), node("ref", "reference", parallelism=16,
                                                                                GPU=0.25),
                  node("score", "reward", pool="reward", parallelism=4, CPU=4),
                  node("critic", "critic", pool="critic", parallelism=8, GPU=1)],
        "edges": [{"src": "actor", "dst": "ref", "coLocate": True}, {"src": "actor", "dst": "score"},
                  {"src": "score", "dst": "critic"}, {"src": "critic", "dst": "actor", "control": True}],
    }
    plan = resource_plan(trainable_graph(spec_of(example_doc, "ppo-job.yaml", graph)))
    assert plan.pools == ("actor", "reward", "critic")
    assert plan.demand == {"actor": {"GPU": 16.0}, "reward": {"CPU": 16.0}, "critic": {"GPU": 8.0}}
    assert plan.demand["actor"].largest_bundle == {"GPU": 0.75}
    assert plan.instance_gpus == {"actor": 0.75, "ref": 0.75, "score": 0.0, "critic": 1.0}
    assert plan.neighbours == {"reward": "actor"}
    assert plan.rollout_pool == "actor"
    assert [tuple(n.name for n in g.nodes) for g in plan.groups] == [("actor", "ref"), ("score",), ("critic",)]


def test_eventual_consistency_pipelines_one_step_behind(example_doc) -> None:
    """scheduling.consistency sets the built-in control edge; values and a policy-base reference, which read
    modules the update changes, wait for it; every sync is recorded on that edge."""
    strong = step_plan(trainable_graph(spec_of(example_doc, "tiny-grpo.yaml"), "CPU"),
                       spec_of(example_doc, "tiny-grpo.yaml"))
    assert strong.lag == 0 and strong.late == () and strong.policy_edge == "actor_rollout->actor_rollout"
    doc = example_doc("tiny-grpo.yaml")
    doc["spec"]["scheduling"] = {"consistency": "eventual"}
    spec = parse_job(doc).spec
    graph = trainable_graph(spec, "CPU")
    control = [e for e in graph.edges if e.control]
    assert [(e.key, e.consistency) for e in control] == [("actor_rollout->actor_rollout", "eventual")]
    plan = step_plan(graph, spec)
    assert plan.lag == 1 and plan.fused and plan.late == ()
    assert plan.colocated == ("reward", "reference", "old_log_probs")

    graph_doc = ppo_graph()
    graph_doc["edges"][2]["coLocate"] = True
    graph_doc["edges"][3]["consistency"] = "eventual"
    spec = spec_of(example_doc, "tiny-ppo.yaml", graph_doc)
    plan = step_plan(trainable_graph(spec, "CPU"), spec)
    assert plan.lag == 1 and plan.policy_edge == "critic->actor"
    assert plan.colocated == ("reward", "reference", "old_log_probs") and plan.late == ("values",)

    lora = example_doc("tiny-grpo-lora.yaml")
    lora["spec"]["scheduling"] = {"consistency": "eventual"}
    spec = parse_job(lora).spec
    assert step_plan(trainable_graph(spec, "CPU"), spec).late == ("reference",)


def test_a_graph_without_a_control_edge_syncs_over_the_built_in_one(example_doc) -> None:
    graph_doc = ppo_graph()
    graph_doc["edges"] = [e for e in graph_doc["edges"] if not e.get("control")]
    spec = spec_of(example_doc, "tiny-ppo.yaml", graph_doc)
    plan = step_plan(trainable_graph(spec, "CPU"), spec)
    assert plan.policy_edge == "critic->actor" and plan.lag == 0
