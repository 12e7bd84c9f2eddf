"""CISPO, GPG, SAPO, GMPO, Clip-Cov, KL-Cov, DPPO and DRO (hybridflow.policy_losses): what sets each apart from
PPO's clipped surrogate. tests/test_algos_oracle.py checks their values and gradients against verl's own."""

from __future__ import annotations

import pytest
import torch

from hybridflow.algos import ppo_policy_loss
from hybridflow.api import parse_job
from hybridflow.policy_losses import (
    cispo_policy_loss,
    clip_cov_policy_loss,
    dppo_policy_loss,
    dro_policy_loss,
    geo_mean_policy_loss,
    gpg_policy_loss,
    kl_cov_policy_loss,
    sapo_policy_loss,
    token_covariance,
)
from hybridflow.step import StepOutput, step_record
from hybridflow.workers.host import WorkerHost
from tests.test_workers import ROLES, rows

STATS = {"reward_mean": 0.5, "reward_max": 1.0, "response_length": 3.0, "tokens": 48.0, "policy_version": 0.0}


def inputs(seed: int = 0, rows_: int = 6, tokens: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                     torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = -2.0 * torch.rand(rows_, tokens, generator=g, dtype=torch.float64)
    new = old + 0.5 * torch.randn(rows_, tokens, generator=g, dtype=torch.float64)
    adv = torch.randn(rows_, tokens, generator=g, dtype=torch.float64)
    mask = (torch.arange(tokens)[None, :] < torch.randint(1, tokens + 1, (rows_, 1), generator=g)).double()
    return old, new.requires_grad_(), adv, mask


def test_cispo_keeps_the_gradient_of_the_tokens_ppo_clips() -> None:
    old, new, adv, mask = inputs()
    loss, metrics = cispo_policy_loss(old, new, adv, mask, clip_low=0.1, clip_high=0.1)
    loss.backward()
    assert new.grad is not None
    ratio = (new - old).exp().detach()
    clipped = ((ratio < 0.9) | (ratio > 1.1)) & (mask > 0)
    assert 0 < metrics["clip_frac"] < 1
    expected = -ratio.clamp(0.9, 1.1) * adv * mask / mask.sum()
    torch.testing.assert_close(new.grad, expected)
    assert (new.grad[clipped] != 0).all()
    new.grad = None
    ppo, _ = ppo_policy_loss(old, new, adv, mask, clip_low=0.1, clip_high=0.1, dual_clip_c=None)
    ppo.backward()
    assert (new.grad[clipped & ((adv > 0) == (ratio > 1.1))] == 0).all()  # PPO's clip stops them


def test_gpg_is_the_plain_policy_gradient_whatever_the_old_policy() -> None:
    old, new, adv, mask = inputs()
    a, _ = gpg_policy_loss(old, new, adv, mask)
    b, metrics = gpg_policy_loss(old + 1.0, new, adv, mask)
    assert a.item() == pytest.approx(b.item()) == pytest.approx((-(adv * new) * mask).sum().item() / mask.sum().item())
    assert metrics["ratio_mean"] < 1  # the metrics still see the old policy, one nat more likely


def test_sapo_on_policy_steps_as_ppo_and_its_gate_fades_off_policy() -> None:
    old, _, adv, mask = inputs()
    on = old.clone().requires_grad_()
    loss, _ = sapo_policy_loss(old, on, adv, mask, tau_pos=1.0, tau_neg=1.3, agg="token-mean")
    loss.backward()
    torch.testing.assert_close(on.grad, -adv * mask / mask.sum())  # d/dr (4/tau) sigmoid(tau (r - 1)) = 1 at r = 1
    far = (old + 1.0).requires_grad_()
    sapo_policy_loss(old, far, adv, mask, tau_pos=1.0, tau_neg=1.3, agg="token-mean")[0].backward()
    assert (far.grad.abs() < on.grad.abs() * 2.72)[mask > 0].all()  # PPO's unclipped term would give e x the grad


def test_geo_mean_takes_the_geometric_mean_of_the_clipped_token_ratios() -> None:
    old = torch.zeros(2, 3, dtype=torch.float64)
    new = torch.tensor([[0.1, 0.5, -0.2], [0.3, -0.6, 9.0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    loss, metrics = geo_mean_policy_loss(old, new, adv, mask, clip_low=0.4, clip_high=0.4)
    # A > 0: only the upper clip binds (0.5 -> 0.4); A < 0: only the lower one (-0.6 -> -0.4); padding is left out
    first = -1.0 * torch.exp(torch.tensor((0.1 + 0.4 - 0.2) / 3))
    second = 2.0 * torch.exp(torch.tensor((0.3 - 0.4) / 2))
    assert loss.item() == pytest.approx(((first + second) / 2).item())
    assert metrics["clip_frac"] == pytest.approx(2 / 5)


def test_clip_cov_cuts_its_share_of_the_candidates_drawn_with_the_generator() -> None:
    old, new, adv, mask = inputs(rows_=40, tokens=10)
    c = token_covariance(adv, new.detach(), mask)
    lower, upper = 0.05, 3.0
    ratio = (new - old).exp().detach()
    clip_wins = (-adv * ratio.clamp(0.8, 1.2) > -adv * ratio) & (mask > 0)
    candidates = (mask > 0) & ~clip_wins & (c > lower) & (c < upper)
    picked = []
    for seed in (1, 1, 2):
        new.grad = None
        loss, metrics = clip_cov_policy_loss(old, new, adv, mask, share=0.05, lower=lower, upper=upper,
                                             generator=torch.Generator().manual_seed(seed))
        loss.backward()
        cut = (new.grad == 0) & (mask > 0) & ~clip_wins
        picked.append(cut)
        assert int(cut.sum()) == int(0.05 * mask.sum()) == round(metrics["cov_frac"] * mask.sum().item())
        assert (candidates[cut]).all()
    assert torch.equal(picked[0], picked[1]) and not torch.equal(picked[0], picked[2])


def test_kl_cov_penalises_the_tokens_of_largest_covariance() -> None:
    old, new, adv, mask = inputs(rows_=20, tokens=8)
    free, _ = kl_cov_policy_loss(old, new, adv, mask, share=0.1, coef=0.0)
    loss, metrics = kl_cov_policy_loss(old, new, adv, mask, share=0.1, coef=0.5)
    c = token_covariance(adv, new.detach(), mask).masked_fill(mask == 0, -torch.inf)
    top = torch.zeros_like(mask, dtype=torch.bool).view(-1)
    top[torch.topk(c.flatten(), int(0.1 * mask.sum())).indices] = True
    penalty = (0.5 * (new - old).abs().detach() * top.view_as(mask)).sum() / mask.sum()
    assert loss.item() == pytest.approx(free.item() + penalty.item())
    assert metrics["cov_frac"] == pytest.approx(int(0.1 * mask.sum()) / mask.sum().item())


def test_dppo_tv_drops_the_tokens_whose_probability_moved_too_far_the_way_the_advantage_pushes() -> None:
    old = torch.tensor([[0.5, 0.5, 0.01, 0.5]]).log()
    new = torch.tensor([[0.75, 0.6, 0.05, 0.2]]).log().requires_grad_()
    adv = torch.tensor([[1.0, 1.0, 1.0, -1.0]])
    mask = torch.ones(1, 4)
    loss, metrics = dppo_policy_loss(old, new, adv, mask, "tv", low=0.2, high=0.2, truncate=3.0)
    loss.backward()
    assert new.grad is not None
    # token 0 rose by 0.25 > 0.2 with A > 0: out; token 1 by 0.1: in; token 2 by 0.04 (ratio 5, which PPO would
    # clip at 1.2): in, its weight truncated at 3; token 3 fell by 0.3 > 0.2 with A < 0: out
    assert metrics["clip_frac"] == pytest.approx(0.5)
    assert new.grad.tolist()[0] == pytest.approx([0.0, -1.2 / 4, -3.0 / 4, 0.0])
    ppo, _ = ppo_policy_loss(old, new, adv, mask, clip_low=0.2, clip_high=0.2, dual_clip_c=None)
    new.grad = None
    ppo.backward()
    assert new.grad[0, 2].item() == 0.0  # the ratio's clip stops the rare token DPPO lets learn


def test_dppo_kl_bounds_the_binary_kl_and_lets_a_move_against_the_advantage_through() -> None:
    old = torch.tensor([[0.5, 0.5, 0.5]]).log()
    p = torch.tensor([[0.6, 0.9, 0.1]])
    adv = torch.tensor([[1.0, 1.0, 1.0]])
    mask = torch.ones(1, 3)
    kl = 0.5 * (0.5 / p).log() + 0.5 * ((0.5 + 1e-8) / (1 - p + 1e-8)).log()
    _, metrics = dppo_policy_loss(old, p.log().requires_grad_(), adv, mask, "kl", low=0.1, high=0.1)
    # KL_bin 0.02 (in), 0.51 (out), 0.51 but p fell while A > 0 (in: it is the move the trust region allows)
    assert kl[0, 0] < 0.1 < kl[0, 1] and kl[0, 2] > 0.1
    assert metrics["clip_frac"] == pytest.approx(1 / 3)


def test_dro_is_the_policy_gradient_with_a_quadratic_pull_back_to_the_old_policy() -> None:
    old, new, adv, mask = inputs()
    loss, _ = dro_policy_loss(old, new, adv, mask, beta=0.5)
    loss.backward()
    assert new.grad is not None
    expected = (-adv + 0.5 * (new - old)).detach() * mask / mask.sum()
    torch.testing.assert_close(new.grad, expected)
    free, _ = dro_policy_loss(old, new, adv, mask, beta=1e-12)
    assert free.item() == pytest.approx((-(adv * new) * mask).sum().item() / mask.sum().item())


@pytest.mark.parametrize("mode", ["cispo", "gpg", "sapo", "geo_mean", "clip_cov", "kl_cov", "dppo_tv", "dppo_kl",
                                  "dro"])
def test_each_policy_loss_trains_the_actor(example_doc, mode: str) -> None:
    doc = example_doc("tiny-grpo.yaml")
    doc["spec"]["data"]["batchSize"] = 4
    doc["spec"]["algorithm"] |= {"policyLoss": mode, "miniBatchSize": 16, "ppoEpochs": 2,
                                 "covariance": {"clipRatio": 0.1, "klRatio": 0.1}, "droBeta": 0.1}
    host = WorkerHost(parse_job(doc).spec.model_dump(mode="json"), ROLES, instance=0, use_gpu=False)
    model = host.workers["actor_rollout"].model
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    r, g = rows(4)
    batch = host.rollout([x for x in r for _ in range(4)], [i for i in g for _ in range(4)],
                         ["reward", "reference", "old_log_probs"])
    batch.tensors["advantages"] = torch.randn(batch.response_mask.shape)
    metrics = host.update(batch, 0.001).metrics
    assert torch.isfinite(torch.tensor(metrics["actor_loss"])) and "ratio_mean" in metrics
    assert ("cov_frac" in metrics) == mode.endswith("_cov")
    assert ("cov_frac" in step_record(1, StepOutput(stats=STATS, update=metrics), 1.0, 0.0)) == mode.endswith("_cov")
    assert not all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
