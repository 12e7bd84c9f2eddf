"""Several real raylets on one machine (logical GPUs): placement, co-location, DP ranks, backpressure."""

from __future__ import annotations

import json
import math
import os
import threading

import pytest
import ray
import torch
from ray.cluster_utils import Cluster
from safetensors.torch import load_file

from hybridflow import checkpoint
from hybridflow.api import parse_job
from hybridflow.export import checkpoint_policy
from hybridflow.trainer import Trainer
from tests.conftest import ROOT
from tests.helpers import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    for i in range(2):
        c.add_node(num_cpus=3, num_gpus=2, resources={f"gpu_node_{i}": 1})
    c.wait_for_nodes()
    # this checkout's runtime first: an editable install elsewhere must not serve the workers
    path = os.pathsep.join([str(ROOT / "runtime"), str(ROOT)])
    ray.init(address=c.address, runtime_env={"env_vars": {"PYTHONPATH": path, "HYBRIDFLOW_TORCH_THREADS": "1"}})
    yield c
    ray.shutdown()
    c.shutdown()


def graph() -> dict:
    return {
        "nodes": [
            {"name": "actor_rollout", "role": "actor_rollout", "resources": {"GPU": 0.5, "CPU": 1},
             "parallelism": 2, "pool": "actor"},
            {"name": "reference", "role": "reference", "resources": {"GPU": 0.25}, "parallelism": 2, "pool": "actor"},
            {"name": "reward", "role": "reward", "resources": {"CPU": 1}, "parallelism": 1, "pool": "reward"},
            {"name": "critic", "role": "critic", "resources": {"GPU": 1}, "parallelism": 2, "pool": "critic"},
        ],
        "edges": [
            {"src": "actor_rollout", "dst": "reference", "coLocate": True},
            {"src": "actor_rollout", "dst": "reward", "dataType": "rollout_batch"},
            {"src": "actor_rollout", "dst": "critic", "dataType": "rollout_batch"},
            {"src": "critic", "dst": "actor_rollout", "dataType": "updated_policy", "control": True},
        ],
    }


def eventual_ppo(example_doc, name: str, batch: int, minibatch: int) -> dict:
    """The tiny PPO job on `graph()` with its control edge eventual."""
    doc = example_doc("tiny-ppo.yaml")
    doc["metadata"]["name"] = name
    doc["spec"]["graph"] = graph()
    doc["spec"]["graph"]["edges"][-1]["consistency"] = "eventual"
    doc["spec"]["data"]["batchSize"] = batch
    doc["spec"]["algorithm"]["miniBatchSize"] = minibatch
    return doc


def test_plan_runs_across_raylets_with_backpressure(cluster, example_doc, tmp_path) -> None:
    doc = example_doc("tiny-ppo.yaml")
    doc["metadata"]["name"] = "cluster-ppo"
    doc["spec"]["graph"] = graph()
    doc["spec"]["reward"]["function"] = "tests.slow_reward:score"
    doc["spec"]["data"]["batchSize"] = 64
    doc["spec"]["algorithm"]["miniBatchSize"] = 32
    doc["spec"]["trainer"].update(totalSteps=3, checkpoint={"every": 0, "path": str(tmp_path / "c")})
    doc["spec"]["scheduling"] = {"microBatchSize": 4, "queueHighWatermark": 3, "backpressureWindow": 1,
                                 "placementTimeoutSeconds": 60}
    job = parse_job(doc)
    trainer = Trainer(job.model_dump(by_alias=True, mode="json"), str(tmp_path / "m.jsonl"))
    try:
        result = trainer.fit()
        status = trainer.scheduler.get_status()
    finally:
        trainer.shutdown()
    assert result["steps"] == 3
    assert trainer.accelerator == "GPU"

    gpu_nodes = {n["NodeID"] for n in ray.nodes() if n["Resources"].get("GPU")}
    nodes = status["nodes"]
    # co-location: actor_rollout_i and reference_i are one process on one GPU node
    for a, r in zip(nodes["actor_rollout"]["workers"], nodes["reference"]["workers"], strict=True):
        assert a["pid"] == r["pid"] and a["node_id"] == r["node_id"] and a["node_id"] in gpu_nodes
        assert (f"Scheduling decision: co-located actor_rollout_{a['instance']} and reference_{a['instance']} "
                f"on node {a['node_id']}") in status["decisions"]
    # critic ranks: whole GPUs, two ranks, each with its own logical GPU on a GPU node
    critic = nodes["critic"]["workers"]
    assert len(critic) == 2 and all(w["node_id"] in gpu_nodes for w in critic)
    assert all(len(w["gpu_ids"]) == 1 for w in critic)
    assert len({(w["node_id"], w["gpu_ids"][0]) for w in critic}) == 2
    assert any(d.startswith("Scheduling decision: stage") and "critic" in d for d in status["decisions"])
    # backpressure: the slow reward's queue crossed the watermark and the scheduler acted on it
    events = status["backpressure"]
    assert events, status["edges"]
    raised = [e for e in events if e["node"] == "reward" and e["action"] == "raise_downstream" and e["applied"]]
    assert raised and "actor_rollout->reward" in raised[0]["reason"]
    assert nodes["reward"]["parallelism"] >= 2
    assert any(d.startswith("Backpressure: reward parallelism 1 -> 2") for d in status["decisions"])
    lat = status["edges"]["actor_rollout->reward"]["latency"]
    assert lat["count"] > 0 and lat["p95_s"] >= lat["mean_s"] > 0
    # the two actor ranks got rows of about the same number of tokens every step (one row holds at most 12)
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    balance = [r["shard_tokens_max_over_mean"] for r in records]
    assert len(balance) == 3 and all(1.0 <= b <= 1.02 for b in balance), balance


def test_eventual_consistency_pipelines_across_raylets(cluster, example_doc, tmp_path) -> None:
    """The same graph with its control edge eventual: two actor ranks generate the next step's chunks while
    they and the critic ranks update; the batches come back in order, go to the remote reward and the critic's
    scores phase, and the next update takes them one version behind."""
    doc = eventual_ppo(example_doc, "cluster-ppo-eventual", batch=32, minibatch=16)
    doc["spec"]["trainer"].update(totalSteps=4, checkpoint={"every": 0, "path": str(tmp_path / "c")})
    doc["spec"]["scheduling"] = {"microBatchSize": 4, "backpressure": False, "placementTimeoutSeconds": 60}
    trainer = Trainer(parse_job(doc).model_dump(by_alias=True, mode="json"), str(tmp_path / "m.jsonl"))
    try:
        assert trainer.plan.lag == 1 and not trainer.plan.fused
        result = trainer.fit()
        status = trainer.scheduler.get_status()
    finally:
        trainer.shutdown()
    recs = result["records"]
    assert [r["policy_lag"] for r in recs] == [0, 1, 1, 1]
    assert all(math.isfinite(r["critic_loss"]) and math.isfinite(r["actor_loss"]) for r in recs)
    edge = status["control_edges"]["critic->actor_rollout"]
    assert edge["syncs"] == 4 and edge["policy_version"] == 4 and edge["consistency"] == "eventual"
    assert edge["bytes_last"] > 0  # both ranks' generation copies filled
    # generation runs on a copy of its own, so the actor's sharded ranks keep no full copy of the policy between
    # updates: its weights reach generation straight from the shards
    assert all(r["actor_model_bytes"] == 0 for r in recs), [r["actor_model_bytes"] for r in recs]
    reward = status["edges"]["actor_rollout->reward"]
    assert reward["batches"] == 4 * 32 // 4  # every chunk of every step scored once, pipelined or not


def test_a_sharded_actor_without_its_full_copy_changes_its_ranks(cluster, example_doc, tmp_path) -> None:
    """Eventual consistency: generation runs on a copy of its own, so the two sharded actor ranks keep no full
    policy between updates (reading its weights is refused). Scaling to one rank (which trains its model
    itself) and back at step boundaries gathers the shards first: the ranks then hold exactly the weights of the
    checkpoint just written, and training goes on from them."""
    doc = eventual_ppo(example_doc, "cluster-ppo-released", batch=16, minibatch=16)
    root = tmp_path / "c"
    doc["spec"]["trainer"].update(totalSteps=6, checkpoint={"every": 1, "path": str(root)},
                                  export={"path": str(tmp_path / "policy")})
    doc["spec"]["scheduling"] = {"backpressure": False, "placementTimeoutSeconds": 60}
    job = parse_job(doc)
    trainer = Trainer(job.model_dump(by_alias=True, mode="json"), str(tmp_path / "m.jsonl"))

    def weights_of(host) -> dict:
        return ray.get(host.export_state.remote(), timeout=120)["roles"]["actor_rollout"]["model"]

    def scale_to(n: int):
        def action() -> dict:
            before = trainer.scheduler.hosts("actor_rollout")
            if len(before) > 1:  # one rank trains its model itself
                with pytest.raises(ray.exceptions.RayTaskError, match="inference copy is released"):
                    weights_of(before[0])
            step, saved = checkpoint_policy(checkpoint.step_dir(root, trainer.step), job)
            trainer.scheduler.adjust_parallelism("actor_rollout", n, "test", source="Manual")
            trainer._sync_new_hosts()
            hosts = trainer.scheduler.hosts("actor_rollout")
            gaps = [max(float((w[k].float() - saved[k].float()).abs().max()) for k in saved)
                    for w in map(weights_of, hosts)]
            return {"step": step, "ranks": len(hosts), "gaps": gaps}
        return action

    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.update(result=trainer.fit()), daemon=True)
    try:
        assert trainer.plan.lag == 1
        thread.start()
        wait_for(lambda: trainer.step >= 2 or not thread.is_alive(), 600, "two steps")
        down = trainer.steering.at_boundary(scale_to(1), wait_s=600)
        up = trainer.steering.at_boundary(scale_to(2), wait_s=600)
        thread.join(timeout=600)
    finally:
        trainer.shutdown()
    print(f"\nscaled down after step {down['step']}: gaps {down['gaps']}; up after step {up['step']}: {up['gaps']}")
    assert down["ranks"] == 1 and down["gaps"] == [0.0]
    assert up["ranks"] == 2 and up["gaps"] == [0.0, 0.0] and up["step"] > down["step"]
    recs = outcome["result"]["records"]
    assert len(recs) == 6 and all(math.isfinite(r["actor_loss"]) for r in recs)
    # the policy exported at the end is the last checkpoint's, read from the shards of the two ranks
    exported = load_file(tmp_path / "policy" / "model.safetensors")
    _, last = checkpoint_policy(checkpoint.step_dir(root, 6), job)
    assert exported and set(exported) <= set(last)  # a tied head is saved once, as its embedding
    assert all(torch.equal(exported[k], last[k]) for k in exported)
    # two ranks keep no full copy after an update; one rank trains its model itself; the two critic ranks score
    # their values in a phase of their own, with their shards
    assert all(r["critic_model_bytes"] == 0 for r in recs)
    assert [r["actor_model_bytes"] == 0 for r in recs] == [r["step"] <= down["step"] or r["step"] > up["step"]
                                                           for r in recs]


def test_a_sharded_critic_on_the_actors_hosts_scores_with_its_shards(cluster, example_doc, tmp_path) -> None:
    """The critic shares the actor's two processes and shards its training over them: its values leave the chain
    of each generated chunk for the scores phase, where both ranks score their part of the batch at once, with
    the shards; neither keeps a full copy of the critic between updates."""
    doc = example_doc("tiny-ppo.yaml")
    doc["metadata"]["name"] = "cluster-ppo-critic-in-actor"
    g = graph()
    g["nodes"][1]["resources"] = {"GPU": 0.25}
    g["nodes"][3].update(resources={"GPU": 0.25}, pool="actor")
    g["edges"][2]["coLocate"] = True
    doc["spec"]["graph"] = g
    doc["spec"]["data"]["batchSize"] = 16
    doc["spec"]["algorithm"]["miniBatchSize"] = 8
    doc["spec"]["trainer"].update(totalSteps=3, checkpoint={"every": 0, "path": str(tmp_path / "c")})
    doc["spec"]["scheduling"] = {"backpressure": False, "placementTimeoutSeconds": 60}
    trainer = Trainer(parse_job(doc).model_dump(by_alias=True, mode="json"), str(tmp_path / "m.jsonl"))
    try:
        assert trainer.plan.scored == ("values",) and "values" not in trainer.plan.colocated
        assert [n.name for n in trainer.plan.trained] == ["actor_rollout"]
        result = trainer.fit()
        status = trainer.scheduler.get_status()
    finally:
        trainer.shutdown()
    nodes = status["nodes"]
    for a, c in zip(nodes["actor_rollout"]["workers"], nodes["critic"]["workers"], strict=True):
        assert a["pid"] == c["pid"]
    recs = result["records"]
    assert len(recs) == 3 and all(math.isfinite(r["critic_loss"]) and math.isfinite(r["actor_loss"]) for r in recs)
    assert all(r["critic_model_bytes"] == 0 for r in recs), [r["critic_model_bytes"] for r in recs]
    assert all(r["timing/scores"] >= r["timing/values"] > 0 for r in recs)
