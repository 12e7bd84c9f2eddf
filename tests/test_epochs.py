"""trainer.totalEpochs: passes over data.train, counted as steps when the dataset loads."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hybridflow.api import parse_job
from hybridflow.api.spec import MAX_STEPS
from hybridflow.data import DataError
from hybridflow.data.prompts import PromptSampler, load_rows
from hybridflow.trainer import steps_of_epochs
from hybridflow.workers.lr_schedule import lr_factor
from tests.helpers import train_in_fresh_ray


def test_each_pass_draws_every_prompt_and_the_last_batch_tops_up_from_the_next() -> None:
    rows = [{"prompt": str(i), "answer": ""} for i in range(10)]
    sampler = PromptSampler(rows, batch_size=4, seed=1)
    assert [sampler.steps_for(e) for e in (1, 2, 3)] == [3, 5, 8]
    drawn = [r["prompt"] for _ in range(sampler.steps_for(2)) for r in sampler.next_batch()]
    assert sorted(drawn) == sorted([str(i) for i in range(10)] * 2)  # 5 steps of 4: two whole passes
    assert steps_of_epochs(PromptSampler(rows, batch_size=10), 7) == 7


def test_more_steps_than_a_job_may_take_is_a_data_error_naming_the_field() -> None:
    sampler = PromptSampler([{"prompt": "p", "answer": ""}] * 1000, batch_size=1)
    with pytest.raises(DataError, match=rf"^spec.trainer.totalEpochs: 100000 passes over 1000 prompts at batchSize 1 "
                                        rf"take 100000000 steps, more than the {MAX_STEPS} a job may take$"):
        steps_of_epochs(sampler, 100_000)


def small_train_set(tmp_path: Path, n: int) -> str:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in load_rows("builtin:tiny_task", "prompt", "answer")[:n]))
    return str(path)


@pytest.mark.slow
def test_a_run_takes_the_steps_of_its_epochs_and_its_schedule_ends_there(example_doc, tmp_path) -> None:
    """10 prompts, batches of 4, 2 epochs: 5 steps, whatever totalSteps says; the cosine schedule the workers run
    reaches its end at step 5, so they got the count too."""
    doc = example_doc("tiny-ppo.yaml")
    doc["metadata"]["name"] = "epochs"
    doc["spec"]["data"] |= {"train": small_train_set(tmp_path, 10), "batchSize": 4, "val": None}
    doc["spec"]["algorithm"]["miniBatchSize"] = 4
    doc["spec"]["trainer"] |= {"totalSteps": 50, "totalEpochs": 2, "resume": "never", "evalEvery": 0,
                               "checkpoint": {"every": 0, "path": str(tmp_path / "ckpt")},
                               "optimizer": {"schedule": "cosine", "minLrRatio": 0.1}}
    job = parse_job(doc)
    result = train_in_fresh_ray(job, tmp_path / "m.jsonl")
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5] and result["steps"] == 5
    optimizer = job.spec.trainer.optimizer
    assert records[-1]["actor_lr"] == pytest.approx(job.spec.trainer.actor_lr * lr_factor(4, 5, optimizer))
    assert lr_factor(4, 5, optimizer) < lr_factor(4, 50, optimizer)
    assert math.isclose(records[0]["actor_lr"], job.spec.trainer.actor_lr)


@pytest.mark.slow
def test_steps_on_the_command_line_win_over_epochs(example_doc, tmp_path) -> None:
    doc = example_doc("tiny-ppo.yaml")
    doc["metadata"]["name"] = "epochs-cli"
    doc["spec"]["data"] |= {"train": small_train_set(tmp_path, 10), "batchSize": 4, "val": None}
    doc["spec"]["algorithm"]["miniBatchSize"] = 4
    doc["spec"]["trainer"] |= {"totalEpochs": 50, "resume": "never",
                               "checkpoint": {"every": 0, "path": str(tmp_path / "ckpt")}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    done = subprocess.run([sys.executable, "-m", "hybridflow", "run", str(path), "--steps", "2", "--quiet",
                           "--metrics-out", str(tmp_path / "m.jsonl")], capture_output=True, text=True, timeout=600,
                          env=os.environ | {"RAY_ADDRESS": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["steps"] == 2
