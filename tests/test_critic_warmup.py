"""spec.trainer.criticWarmupSteps: the critic trains alone for the first steps, then the actor joins on its schedule."""

from __future__ import annotations

import pytest
import torch

from hybridflow.api import parse_job
from hybridflow.api.load import SpecError
from hybridflow.api.spec import Optimizer, Trainer
from hybridflow.workers.host import WorkerHost
from hybridflow.workers.lr_schedule import learning_rate, lr_factor
from tests.test_workers import ROLES, rows


def test_the_actors_schedule_starts_after_the_warm_up_and_ends_at_total_steps() -> None:
    trainer = Trainer(total_steps=12, critic_warmup_steps=2,
                      optimizer=Optimizer(warmup_steps=2, schedule="cosine", min_lr_ratio=0.1))
    rates = [learning_rate(1.0, step, trainer, start=2) for step in range(2, 12)]
    assert rates == [lr_factor(k, 10, trainer.optimizer) for k in range(10)]
    assert rates[0] == 0.5 and rates[-1] > 0.1
    assert learning_rate(1.0, 12, trainer, start=2) == pytest.approx(0.1)  # the cosine's end is at totalSteps


def test_a_critic_warm_up_needs_a_critic(example_doc) -> None:
    doc = example_doc("tiny-grpo.yaml")
    doc["spec"]["trainer"]["criticWarmupSteps"] = 3
    with pytest.raises(SpecError, match="trainer.criticWarmupSteps trains the critic alone: it needs an algorithm "
                                         r"with a critic \(ppo\), or 0"):
        parse_job(doc)


def test_the_policy_keeps_its_weights_while_the_critic_warms_up_then_trains(example_doc) -> None:
    """Pipelined (lag 1), so that the rollout engine holds a copy: the warm-up's syncs copy nothing, yet the
    versions count every step and the batch generated ahead during a frozen step trains the first real update."""
    doc = example_doc("tiny-ppo.yaml")
    doc["spec"]["data"]["batchSize"] = 8
    doc["spec"]["algorithm"]["miniBatchSize"] = 8
    doc["spec"]["trainer"] |= {"totalSteps": 4, "actorLr": 1e-3, "criticWarmupSteps": 2,
                               "optimizer": {"warmupSteps": 2}}
    spec_json = parse_job(doc).spec.model_dump(mode="json")
    host = WorkerHost(spec_json, ROLES | {"critic": "critic"}, instance=0, use_gpu=False, lag=1)
    actor, critic = host.workers["actor_rollout"], host.workers["critic"]

    def weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in module.state_dict().items()}

    policy, values = weights(actor.model), weights(critic.model)
    chain, phases = ["reward", "reference", "old_log_probs"], ["rollout", "advantages", "update"]
    prompts, g = rows(32)[0], list(range(8))
    outs = []
    for step in range(3):
        now, ahead = prompts[8 * step:8 * step + 8], prompts[8 * step + 8:8 * step + 16]
        outs.append(host.run_step(phases, now, g, chain, 0.001, (ahead, g), ("values",)))
        if step < 2:
            assert all(torch.equal(v, policy[k]) for k, v in actor.model.state_dict().items())
    assert not all(torch.equal(v, policy[k]) for k, v in actor.model.state_dict().items())
    assert not all(torch.equal(v, values[k]) for k, v in critic.model.state_dict().items())

    assert [o.sync.version for o in outs] == [1, 2, 3]
    assert [o.sync.bytes for o in outs][:2] == [0, 0] and outs[2].sync.bytes > 0
    assert [o.update["actor_lr"] for o in outs] == [0.0, 0.0, 5e-4]  # step 1 of the actor's 2-step warm-up
    assert [o.update["policy_lag"] for o in outs] == [0.0, 1.0, 1.0]
    assert ["actor_loss" in o.update for o in outs] == [False, False, True]
    assert all("critic_loss" in o.update for o in outs)
    assert [o.update["critic_lr"] for o in outs] == pytest.approx([1.5e-3, 3e-3, 3e-3])  # its own warm-up: no wait
    copy = dict(actor.behaviour.named_parameters())
    assert all(torch.equal(copy[k], v) for k, v in actor.model.named_parameters())
