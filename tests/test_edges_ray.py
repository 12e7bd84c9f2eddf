"""Edge semantics in a real training run on a local Ray: batch sizes per edge, maxSizeBytes as a hard limit on
what leaves a process, and backpressure that fires in a job with the default watermark and window."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import yaml

from hybridflow.api import parse_job
from hybridflow.data.prompts import load_prompts
from hybridflow.scheduler.edges import EdgeSizeError
from hybridflow.trainer import Trainer
from tests.conftest import EXAMPLES, ROOT

pytestmark = pytest.mark.slow

STEPS = 4
"""One more than the default backpressureWindow (3): the third step's observation raises the reward."""


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    # actor, reward and critic take a CPU each; the fourth is the room backpressure raises the reward into
    path = os.pathsep.join([str(ROOT / "runtime"), str(ROOT)])
    ray.init(num_cpus=4, num_gpus=0, include_dashboard=False, logging_level=logging.WARNING,
             runtime_env={"env_vars": {"PYTHONPATH": path, "HYBRIDFLOW_TORCH_THREADS": "1"}})
    yield
    ray.shutdown()


def remote_reward_job(tmp: Path, steps: int) -> dict[str, Any]:
    """examples/tiny-ppo-remote-reward.yaml (reward on a node of its own) with a slow reward; its scheduling
    keeps the default queueHighWatermark and backpressureWindow: 64 sequences a step in 4 micro-batches."""
    doc = yaml.safe_load((EXAMPLES / "tiny-ppo-remote-reward.yaml").read_text())
    spec = doc["spec"]
    spec["reward"]["function"] = "tests.slow_reward:slower_score"
    spec["algorithm"].update(ppoEpochs=1)
    spec["trainer"].update(totalSteps=steps, checkpoint={"every": 0, "path": str(tmp / "ckpt")})
    assert spec["scheduling"] == {"microBatchSize": 16} and spec["data"]["batchSize"] == 64
    return doc


def train(doc: dict[str, Any], tmp: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    trainer = Trainer(parse_job(doc).model_dump(by_alias=True, mode="json"), str(tmp / "metrics.jsonl"))
    try:
        result = trainer.fit()
        return result, trainer.scheduler.get_status()
    finally:
        trainer.shutdown()


def test_a_slow_reward_raises_its_parallelism_with_the_default_watermark(local_ray: None, tmp_path: Path) -> None:
    result, status = train(remote_reward_job(tmp_path, STEPS), tmp_path)
    assert result["steps"] == STEPS
    edges = status["edges"]
    reward = edges["actor_rollout->reward"]
    # the default watermark: half of a step's 64 sequences
    assert reward["high_watermark"] == 32
    raised = [e for e in status["backpressure"] if e["action"] == "raise_downstream"]
    assert raised, edges
    assert (raised[0]["node"], raised[0]["old"], raised[0]["new"], raised[0]["applied"]) == ("reward", 1, 2, True)
    assert raised[0]["reason"].startswith("queue actor_rollout->reward at ")
    assert raised[0]["reason"].endswith(" > 32 for 3 observations")
    assert any(d.startswith("Backpressure: reward parallelism 1 -> 2") for d in status["decisions"])
    assert status["nodes"]["reward"]["parallelism"] == 2
    # sizes per edge: four micro-batches a step to the reward's process through the object store, the same
    # ones handed over in place to the co-located reference, and the whole step's batch to the critic
    assert reward["transport"] == "object_store" and reward["batches"] == 4 * STEPS
    assert reward["bytes_max"] > 0 and reward["bytes_total"] <= 4 * STEPS * reward["bytes_max"]
    ref = edges["actor_rollout->reference"]
    assert ref["transport"] == "in_process" and ref["batches"] == 4 * STEPS
    critic = edges["actor_rollout->critic"]
    assert critic["transport"] == "object_store" and critic["batches"] == STEPS
    assert critic["bytes_max"] > reward["bytes_max"]
    print("edge sizes:", {k: {f: v[f] for f in ("transport", "batches", "bytes_last", "bytes_max", "bytes_total")}
                          for k, v in edges.items()})
    print("backpressure:", status["backpressure"])


def test_a_batch_over_max_size_bytes_stops_the_step_naming_the_edge(local_ray: None, tmp_path: Path) -> None:
    doc = remote_reward_job(tmp_path, 1)
    doc["spec"]["reward"]["function"] = "builtin:tiny_task"
    (edge,) = [e for e in doc["spec"]["graph"]["edges"] if e["dst"] == "reward"]
    edge["maxSizeBytes"] = 1000  # a 16-sequence micro-batch is several KB
    with pytest.raises(EdgeSizeError) as err:
        train(doc, tmp_path)
    message = str(err.value)
    assert message.startswith("edge actor_rollout->reward: a batch of ")
    assert "bytes is over its maxSizeBytes 1000" in message
    print("refused:", message)


def test_evaluation_batches_cross_the_reward_edge_checked_and_counted(local_ray: None, tmp_path: Path) -> None:
    """An evaluation's chunks reach a reward in another process through the same edge as training's, held to
    its maxSizeBytes before they leave the actor's process."""
    doc = remote_reward_job(tmp_path, 1)
    spec = doc["spec"]
    spec["reward"]["function"] = "builtin:tiny_task"
    spec["data"]["val"] = "builtin:tiny_task"
    spec["trainer"]["evalEvery"] = 1
    job = parse_job(doc)
    chunks = math.ceil(len(load_prompts(job.spec, "val")) * job.spec.trainer.eval.samples_per_prompt / 16)
    result, status = train(doc, tmp_path)
    reward = status["edges"]["actor_rollout->reward"]
    assert reward["batches"] == 4 + chunks  # one step's four micro-batches, then the evaluation's
    assert 0.0 <= result["records"][-1]["val/reward_mean"] <= 1.0
    (edge,) = [e for e in spec["graph"]["edges"] if e["dst"] == "reward"]
    edge["maxSizeBytes"] = reward["bytes_max"] - 1  # the largest of them, training's or the evaluation's, is over
    with pytest.raises(EdgeSizeError, match="edge actor_rollout->reward: a batch of"):
        train(doc, tmp_path / "limited")
