"""Evaluation during training on real local Ray: when the val/ metrics are logged (the baseline before the first
step included), that they rise as the policy learns, that greedy evaluation repeats exactly, and that a resumed run
neither repeats nor loses one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import ray

from hybridflow.api import parse_job
from hybridflow.driver import init_ray, run_training
from hybridflow.metrics import panels

pytestmark = pytest.mark.slow

TRAIN_KEYS = ("reward_mean", "kl", "actor_loss", "entropy", "response_length")
VAL_KEYS = ("val/reward_mean", "val/response_length_mean", "val/samples", "val/accuracy")


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    init_ray(local=True, num_cpus=8)
    yield
    ray.shutdown()


def val_job(example_doc, name: str, tmp_path: Path, steps: int, eval_every: int, every: int = 0):
    doc = example_doc(name)
    doc["metadata"]["name"] = f"v-{name.split('.')[0]}-{abs(hash(tmp_path)) % 10_000}"
    doc["spec"]["data"]["val"] = "builtin:tiny_task"
    doc["spec"]["trainer"].update(totalSteps=steps, resume="auto", evalEvery=eval_every, evalBeforeTrain=True)
    doc["spec"]["trainer"]["checkpoint"] = {"every": every, "path": str(tmp_path / "ckpt")}
    return parse_job(doc)


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def evaluated(recs: list[dict]) -> dict[int, dict]:
    return {r["step"]: {k: v for k, v in r.items() if k.startswith("val/")} for r in recs if "val/reward_mean" in r}


def test_val_metrics_are_logged_at_their_steps_and_rise_as_the_policy_learns(example_doc, tmp_path) -> None:
    """tiny-grpo, 40 steps, evaluating the starting policy (evalBeforeTrain) and every 8 steps on 200 held-out
    prompts, greedy. Measured on 2 cores: val reward 0.07 before training, 0.29 at step 8 and 0.87 at step 40."""
    job = val_job(example_doc, "tiny-grpo.yaml", tmp_path, steps=40, eval_every=8)
    seen: list[dict] = []
    result = run_training(job, str(tmp_path / "m.jsonl"), seen.append)
    recs = read_metrics(tmp_path / "m.jsonl")
    assert [r["step"] for r in recs] == list(range(0, 41))
    assert set(recs[0]) == {"step", "timing/eval", *VAL_KEYS}  # the baseline: no training metrics
    val = evaluated(recs)
    assert list(val) == [0, 8, 16, 24, 32, 40]
    for metrics in val.values():
        assert set(VAL_KEYS) <= set(metrics)
        assert metrics["val/samples"] == 200 and 0.0 <= metrics["val/accuracy"] <= metrics["val/reward_mean"] <= 1
    assert val[40]["val/reward_mean"] > val[8]["val/reward_mean"] + 0.3, val
    assert val[8]["val/reward_mean"] > val[0]["val/reward_mean"], val
    assert seen[-1]["val/reward_mean"] == val[40]["val/reward_mean"]
    assert Path(result["plot"]).is_file()
    reward_panel = dict(panels(result["records"]))["reward_mean"]
    assert [step for step, _ in reward_panel["val"]] == [0, 8, 16, 24, 32, 40]
    assert len(reward_panel["train"]) == 40


def test_a_resumed_run_keeps_its_evaluations_and_greedy_evaluation_repeats(example_doc, tmp_path) -> None:
    """Evaluating after every step, with the reward on a node of its own (chunks of 16 reach it through the
    object store). The first run stops after step 3, whose checkpoint is then lost, as when a run dies after
    logging a step but before saving it: the second run resumes from step 2, keeps the baseline and the
    evaluations of steps 1-2 as they were logged, and runs step 3 again, replacing its record; greedy evaluation
    of the same weights gives the same figures as the first time."""
    first = val_job(example_doc, "tiny-ppo-remote-reward.yaml", tmp_path, steps=3, eval_every=1, every=1)
    run_training(first, str(tmp_path / "m.jsonl"))
    before = read_metrics(tmp_path / "m.jsonl")
    shutil.rmtree(tmp_path / "ckpt" / "step_00000003")
    second = val_job(example_doc, "tiny-ppo-remote-reward.yaml", tmp_path, steps=4, eval_every=1, every=1)
    run_training(second, str(tmp_path / "m.jsonl"))
    after = read_metrics(tmp_path / "m.jsonl")
    assert [r["step"] for r in after] == [0, 1, 2, 3, 4]
    assert list(evaluated(after)) == [0, 1, 2, 3, 4]
    assert after[:3] == before[:3]  # the same records, timings included: not evaluated again
    assert after[3]["timing/eval"] != before[3]["timing/eval"]  # step 3 ran again ...
    assert evaluated(after)[3] == evaluated(before)[3]  # ... and its evaluation gave the same figures
    assert evaluated(after)[3]["val/samples"] == 200
    for key in TRAIN_KEYS:
        assert after[3][key] == pytest.approx(before[3][key], rel=1e-5, abs=1e-6), key
