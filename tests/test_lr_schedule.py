"""spec.trainer.optimizer: the learning-rate schedule (warm-up, cosine) and AdamW's weight decay."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from hybridflow.advantages import compute_advantages
from hybridflow.api import parse_job
from hybridflow.api.spec import Optimizer, Training
from hybridflow.workers.host import WorkerHost
from hybridflow.workers.lr_schedule import lr_factor
from hybridflow.workers.training import RoleTraining
from tests.helpers import train_in_fresh_ray
from tests.test_workers import ROLES, rows


def test_the_warm_up_ramps_linearly_then_the_rate_holds() -> None:
    opt = Optimizer(warmup_steps=4)
    assert [lr_factor(s, 10, opt) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_factor(0, 10, Optimizer()) == 1.0


def test_the_cosine_falls_from_the_full_rate_to_the_minimum_at_the_last_step() -> None:
    opt = Optimizer(warmup_steps=2, schedule="cosine", min_lr_ratio=0.1)
    factors = [lr_factor(s, 12, opt) for s in range(14)]
    assert factors[:3] == [0.5, 1.0, 1.0]  # the cosine starts where the warm-up ends
    assert factors[7] == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the 10 steps after the warm-up
    assert all(a > b for a, b in itertools.pairwise(factors[2:12]))
    assert factors[11] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.9)))
    assert factors[12:] == [pytest.approx(0.1)] * 2  # steps past totalSteps stay at the minimum


def test_a_minimum_rate_without_the_cosine_is_refused() -> None:
    with pytest.raises(ValueError, match=r"optimizer\.minLrRatio is where schedule cosine ends"):
        Optimizer(min_lr_ratio=0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["plain", "masters"])
def test_weight_decay_shrinks_each_weight_by_lr_times_the_decay(dtype: torch.dtype) -> None:
    """With zero gradients Adam's step is 0 and only the decoupled decay moves the weights: w * (1 - lr * wd)."""
    model = torch.nn.Linear(8, 8).to(dtype)
    before = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    training = RoleTraining(model, lr=0.5, options=Training(), device=torch.device("cpu"), weight_decay=0.2)
    training.set_lr(0.25)
    training.zero_grad()
    for p in training.module.parameters():
        p.grad = torch.zeros_like(p)
    training.step(max_grad_norm=1.0)
    for n, p in model.named_parameters():
        assert torch.allclose(p.float(), (before[n] * (1 - 0.25 * 0.2)).to(dtype).float(), rtol=0, atol=0), n


def test_actor_and_critic_train_at_the_scheduled_rate_and_the_critic_resumes_on_it(example_doc, tmp_path) -> None:
    doc = example_doc("tiny-ppo.yaml")
    doc["spec"]["data"]["batchSize"] = 8
    doc["spec"]["algorithm"]["miniBatchSize"] = 8
    doc["spec"]["trainer"] |= {"totalSteps": 5, "actorLr": 1e-3, "criticLr": 2e-3,
                               "optimizer": {"warmupSteps": 2, "schedule": "cosine", "minLrRatio": 0.2}}
    spec = parse_job(doc).spec
    spec_json = spec.model_dump(mode="json")
    actor = WorkerHost(spec_json, ROLES, instance=0, use_gpu=False)
    critic = WorkerHost(spec_json, {"critic": "critic"}, instance=0, use_gpu=False)
    seen: list[tuple[float, float, float]] = []
    for _ in range(4):
        r, g = rows(8)
        batch = actor.rollout(r, g, ["reward", "reference", "old_log_probs"])
        batch.tensors.update(critic.run(batch, "values").tensors)
        compute_advantages(batch, spec, kl_coef=0.001)
        a, c = actor.update(batch, 0.001).metrics, critic.update(batch, 0.001).metrics
        groups = actor.workers["actor_rollout"].training.layout.optimizer.param_groups
        seen.append((a["actor_lr"], c["critic_lr"], groups[0]["lr"]))
        actor.sync_policy()
    factor = 0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi / 3))  # the second of the 3 steps after the warm-up
    assert seen == [(5e-4, 1e-3, 5e-4), (1e-3, 2e-3, 1e-3), (1e-3, 2e-3, 1e-3),
                    (pytest.approx(1e-3 * factor), pytest.approx(2e-3 * factor), pytest.approx(1e-3 * factor))]

    critic.save(str(tmp_path), "critic_0")
    resumed = WorkerHost(spec_json, {"critic": "critic"}, instance=0, use_gpu=False)
    resumed.load(str(tmp_path), "critic_0")
    assert resumed.workers["critic"].updates == 4


@pytest.mark.slow
def test_a_run_records_the_rate_and_gradient_norm_of_every_step(example_doc, tmp_path) -> None:
    doc = example_doc("tiny-ppo.yaml")
    doc["metadata"]["name"] = "lr-schedule"
    doc["spec"]["trainer"] |= {"totalSteps": 4, "resume": "never", "evalEvery": 0,
                               "checkpoint": {"every": 0, "path": str(tmp_path / "ckpt")},
                               "optimizer": {"warmupSteps": 2, "schedule": "cosine", "minLrRatio": 0.5}}
    doc["spec"]["data"]["val"] = None
    job = parse_job(doc)
    train_in_fresh_ray(job, tmp_path / "m.jsonl")
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    trainer = job.spec.trainer
    factors = [lr_factor(s, 4, trainer.optimizer) for s in range(4)]
    assert factors == [0.5, 1.0, 1.0, pytest.approx(0.5 + 0.5 * 0.5 * (1 + math.cos(math.pi / 2)))]
    assert [r["actor_lr"] for r in records] == [pytest.approx(trainer.actor_lr * f) for f in factors]
    assert [r["critic_lr"] for r in records] == [pytest.approx(trainer.critic_lr * f) for f in factors]
    assert all(r["actor_grad_norm"] > 0 and r["critic_grad_norm"] > 0 for r in records)
