"""spec.trainer.rolloutDataDir and validationDataDir: each step's and each evaluation's responses as JSON lines,
with their scores and the reward function's other numbers (verl's rollout_data_dir and validation_data_dir)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ray
import torch

from hybridflow.api import parse_job
from hybridflow.api.load import SpecError
from hybridflow.driver import init_ray, run_training
from hybridflow.samples import sample_rows, samples_path, write_samples
from hybridflow.trackers import GENERATIONS, SAMPLE_COLUMNS, markdown_table
from tests.test_reward_extras import scored


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_record_per_response_with_its_score_other_numbers_and_advantage(example_doc) -> None:
    batch, worker = scored(example_doc, "tests.detailed_reward:score", n=16)
    worker.score(batch)
    batch.response_mask[0, 2:] = 0  # a response of 2 tokens: its advantage is the mean over those two
    batch.tensors["advantages"] = torch.arange(len(batch) * batch.response_mask.shape[1], dtype=torch.float32).view(
        len(batch), -1)
    rows = sample_rows(batch)
    assert len(rows) == len(batch)
    for i, row in enumerate(rows):
        assert (row["prompt"], row["response"], row["answer"], row["group"]) == (
            batch.prompts[i], batch.responses[i], batch.answers[i], batch.group_ids[i])
        assert row["score"] == float(batch.tensors["scores"][i])
        assert row["response_length"] == int(batch.response_mask[i].sum())
        right = row["score"] > 0
        assert row["reward_extra"] == {"acc": float(right), "words": len(row["response"].split())} | (
            {"bonus": 0.5} if right else {})  # bonus only where the function returned it
    width = batch.response_mask.shape[1]
    assert rows[0]["advantage"] == pytest.approx((0 + 1) / 2)
    assert rows[1]["advantage"] == pytest.approx(sum(range(width, 2 * width)) / width)
    elsewhere = sample_rows(batch, {"scores": torch.full((len(batch),), 0.25)})  # a remote reward's tensors
    assert {r["score"] for r in elsewhere} == {0.25} and not any("reward_extra" in r for r in elsewhere)


def test_the_file_of_a_step_is_replaced_whole(tmp_path: Path) -> None:
    write_samples(tmp_path / "d", 3, [{"response": "a"}, {"response": "b"}])
    path = samples_path(tmp_path / "d", 3)
    assert path.name == "step_00000003.jsonl"
    assert read_lines(path) == [{"step": 3, "response": "a"}, {"step": 3, "response": "b"}]
    write_samples(tmp_path / "d", 3, [{"response": "c"}])  # the step trained again after a rollback
    assert read_lines(path) == [{"step": 3, "response": "c"}]
    assert [p.name for p in (tmp_path / "d").iterdir()] == [path.name]


def test_validation_data_needs_val_prompts(example_doc) -> None:
    doc = example_doc("tiny-ppo.yaml")
    doc["spec"]["trainer"]["validationDataDir"] = "/tmp/val"
    with pytest.raises(SpecError, match=r"trainer\.validationDataDir needs data\.val"):
        parse_job(doc)


@pytest.fixture(scope="module")
def local_ray():
    init_ray(local=True, num_cpus=8)
    yield
    ray.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("example", ["tiny-grpo.yaml", "tiny-ppo-remote-reward.yaml"])
def test_a_run_writes_every_step_and_evaluation(local_ray, example_doc, tmp_path: Path, example: str) -> None:
    """tiny-grpo runs each step in one call on the actor's host; tiny-ppo-remote-reward scores on a node of its
    own, in training and in evaluation."""
    doc = example_doc(example)
    doc["metadata"]["name"] = f"rd-{example.split('.')[0]}"
    doc["spec"]["reward"]["function"] = "tests.detailed_reward:score"
    doc["spec"]["data"]["val"] = "builtin:tiny_task"
    doc["spec"]["trainer"] |= {"totalSteps": 2, "evalEvery": 1, "evalBeforeTrain": True,
                               "checkpoint": {"every": 0, "path": str(tmp_path / "ckpt")},
                               "rolloutDataDir": str(tmp_path / "rollouts"),
                               "validationDataDir": str(tmp_path / "val"),
                               "loggers": {"backends": ["jsonl", "tensorboard"], "dir": str(tmp_path / "trk"),
                                           "experiment": "e", "valGenerations": 3}}
    job = parse_job(doc)
    result = run_training(job, str(tmp_path / "m.jsonl"))
    records = {r["step"]: r for r in result["records"]}
    per_step = job.spec.data.batch_size * job.spec.rollout.samples_per_prompt
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == ["step_00000001.jsonl", "step_00000002.jsonl"]
    for step in (1, 2):
        rows = read_lines(samples_path(tmp_path / "rollouts", step))
        assert len(rows) == per_step and {r["step"] for r in rows} == {step}
        assert sum(r["score"] for r in rows) / per_step == pytest.approx(records[step]["reward_mean"], rel=1e-5)
        assert sum(r["reward_extra"]["acc"] for r in rows) / per_step == pytest.approx(
            records[step]["reward_extra/acc"], rel=1e-5)
        assert all(isinstance(r["advantage"], float) for r in rows) and any(r["response"] for r in rows)
    for step in (0, 1, 2):
        rows = read_lines(samples_path(tmp_path / "val", step))
        assert len(rows) == records[step]["val/samples"]
        assert sum(r["score"] for r in rows) / len(rows) == pytest.approx(records[step]["val/reward_mean"], rel=1e-5)
        assert "advantage" not in rows[0] and rows[0]["policy_version"] == step
    tables = tensorboard_texts(tmp_path / "trk" / "tb" / "hybridflow" / "e")  # the first 3 of each evaluation
    assert sorted(tables) == [0, 1, 2]
    for step, table in tables.items():
        first = read_lines(samples_path(tmp_path / "val", step))[:3]
        assert table[2:] == [markdown_table(SAMPLE_COLUMNS, [[r[c] for c in SAMPLE_COLUMNS]]).splitlines()[-1]
                             for r in first]


def tensorboard_texts(log_dir: Path) -> dict[int, list[str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return {e.step: e.tensor_proto.string_val[0].decode().splitlines()
            for e in acc.Tensors(f"{GENERATIONS}/text_summary")}
