"""Unit tests for RLOO, REINFORCE++ (plain and with a group baseline), OPO, Pass@k, ReMax and GSPO in
hybridflow.algos, on inputs
small enough to check by hand. tests/test_algos_oracle.py compares the same functions with verl's."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algos import (
    AGG_MODES,
    compute_discounted_returns,
    compute_grpo_passk_advantages,
    compute_opo_advantages,
    compute_reinforce_plus_plus_advantages,
    compute_reinforce_plus_plus_baseline_advantages,
    compute_remax_advantages,
    compute_rloo_advantages,
    gspo_log_ratio,
    gspo_policy_loss,
    gspo_ratio,
    masked_mean,
    masked_var,
    ppo_policy_loss,
)
from tests.helpers import right_padded_mask

pytestmark = pytest.mark.usefixtures("float64_by_default")


# -- RLOO ------------------------------------------------------------------------------------------


def test_rloo_baseline_is_the_mean_of_the_other_samples() -> None:
    # Group a: [1, 0, 0, 1]; for a 1 the others average 1/3, so A = 2/3; for a 0 they average 2/3.
    # Group b: [3, 1]: each sample's baseline is the other one.
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0])
    adv = compute_rloo_advantages(scores, ["a", "a", "a", "a", "b", "b"])
    expected = torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 2.0, -2.0])
    assert torch.allclose(adv, expected)


def test_rloo_equals_n_over_n_minus_1_times_the_centered_score() -> None:
    torch.manual_seed(0)
    scores = torch.randn(12)
    groups = torch.arange(12) // 4
    adv = compute_rloo_advantages(scores, groups)
    for g in range(3):
        r = scores[groups == g]
        assert torch.allclose(adv[groups == g], 4 / 3 * (r - r.mean()))


def test_rloo_lone_sample_keeps_its_score_and_integer_scores_work() -> None:
    adv = compute_rloo_advantages(torch.tensor([5, 1, 3]), [0, 1, 1])
    assert adv.dtype == torch.float32
    assert adv.tolist() == [5.0, -2.0, 2.0]


def test_rloo_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="1-D"):
        compute_rloo_advantages(torch.zeros(2, 2), [0, 0])
    with pytest.raises(ValueError, match="group_ids has 3 entries"):
        compute_rloo_advantages(torch.zeros(2), [0, 0, 1])


# -- REINFORCE++ -----------------------------------------------------------------------------------


def test_discounted_returns_by_hand() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 9.0]])
    mask = right_padded_mask([3, 2], 3)
    returns = compute_discounted_returns(rewards, mask, gamma=0.5)
    # Row 0: 0.25, 0.5, 1. Row 1: the reward on the padding is ignored: 1, 2, 0.
    assert returns.tolist() == [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]]


def test_discounted_returns_carry_through_masked_tokens() -> None:
    # A masked token inside the response (e.g. a tool's output) neither adds its reward nor breaks the sum.
    returns = compute_discounted_returns(torch.tensor([[1.0, 5.0, 2.0]]), torch.tensor([[1, 0, 1]]), gamma=0.5)
    assert returns.tolist() == [[2.0, 0.0, 2.0]]


def test_reinforce_plus_plus_whitens_the_returns_over_the_batch() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = right_padded_mask([3, 2], 3)
    adv, returns = compute_reinforce_plus_plus_advantages(rewards, mask, gamma=0.5)
    assert returns.tolist() == [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]]
    valid = [0.25, 0.5, 1.0, 1.0, 2.0]
    mean = sum(valid) / 5
    std = math.sqrt(sum((v - mean) ** 2 for v in valid) / 4 + 1e-8)
    expected = [[(v - mean) / std for v in valid[:3]], [(v - mean) / std for v in valid[3:]] + [0.0]]
    assert torch.allclose(adv, torch.tensor(expected))
    assert masked_mean(adv, mask).item() == pytest.approx(0.0, abs=1e-12)
    assert masked_var(adv, mask).item() == pytest.approx(1.0, rel=1e-6)


def test_reinforce_plus_plus_without_whitening_returns_the_returns() -> None:
    rewards = torch.tensor([[0.0, 1.0]])
    adv, returns = compute_reinforce_plus_plus_advantages(rewards, torch.ones(1, 2), gamma=1.0, whiten=False)
    assert adv.tolist() == returns.tolist() == [[1.0, 1.0]]


def test_reinforce_plus_plus_baseline_centers_per_group_then_whitens_per_token() -> None:
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0])
    mask = right_padded_mask([2, 1, 1, 3], 3)
    adv = compute_reinforce_plus_plus_baseline_advantages(scores, ["a", "a", "b", "b"], mask)
    # Centered: a -> 0.5, -0.5; b -> 0, 0. On the 7 valid tokens: .5 .5 | -.5 | 0 | 0 0 0.
    tokens = [0.5, 0.5, -0.5, 0.0, 0.0, 0.0, 0.0]
    mean = sum(tokens) / 7
    std = math.sqrt(sum((v - mean) ** 2 for v in tokens) / 6 + 1e-8)
    w = [(v - mean) / std for v in tokens]
    expected = [[w[0], w[1], 0.0], [w[2], 0.0, 0.0], [w[3], 0.0, 0.0], [w[4], w[5], w[6]]]
    assert torch.allclose(adv, torch.tensor(expected))
    unwhitened = compute_reinforce_plus_plus_baseline_advantages(scores, ["a", "a", "b", "b"], mask, whiten=False)
    assert unwhitened.tolist() == [[0.5, 0.5, 0.0], [-0.5, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]


def test_reinforce_plus_plus_baseline_lone_sample_has_no_baseline() -> None:
    adv = compute_reinforce_plus_plus_baseline_advantages(torch.tensor([2.0, 1.0, 3.0]), [0, 1, 1],
                                                          torch.ones(3, 1), whiten=False)
    assert adv.tolist() == [[2.0], [-1.0], [1.0]]


# -- OPO, Pass@k, ReMax ----------------------------------------------------------------------------


def test_opo_baseline_is_the_length_weighted_group_mean() -> None:
    scores = torch.tensor([1.0, 0.0, 0.0, 2.0, 5.0])
    lengths = torch.tensor([3, 1, 4, 2, 7])
    adv = compute_opo_advantages(scores, ["a", "a", "a", "b", "c"], lengths)
    # a: b = (3*1 + 1*0 + 4*0) / 8 = 0.375; b, c: alone, baseline 0.
    assert adv.tolist() == [0.625, -0.375, -0.375, 2.0, 5.0]
    # with equal lengths the baseline is the plain mean, as GRPO's without the std
    even = compute_opo_advantages(scores[:3], [0, 0, 0], torch.ones(3))
    assert torch.allclose(even, scores[:3] - scores[:3].mean())


def test_passk_rewards_only_the_best_by_its_lead_over_the_second() -> None:
    scores = torch.tensor([0.2, 0.9, 0.5, 1.0, 1.0, 0.0, 3.0])
    groups = [0, 0, 0, 1, 1, 1, 2]
    with pytest.raises(ValueError, match="at least 2 samples in every group"):
        compute_grpo_passk_advantages(scores, groups)
    groups[-1] = 1
    raw = compute_grpo_passk_advantages(scores, groups, normalize_std=False)
    # group 0: 0.9 leads 0.5 by 0.4; group 1: 3.0 leads 1.0 by 2.0; everyone else 0.
    assert torch.allclose(raw, torch.tensor([0.0, 0.4, 0.0, 0.0, 0.0, 0.0, 2.0]))
    normed = compute_grpo_passk_advantages(scores, groups)
    std0, std1 = scores[:3].std(), scores[3:].std()
    assert torch.allclose(normed, torch.tensor([0.0, 0.4 / (std0 + 1e-6), 0.0, 0.0, 0.0, 0.0, 2.0 / (std1 + 1e-6)]))
    tied = compute_grpo_passk_advantages(torch.tensor([1.0, 1.0, 0.0]), [0, 0, 0])
    assert tied.tolist() == [0.0, 0.0, 0.0]


def test_remax_subtracts_the_greedy_reward_from_the_reward_to_go() -> None:
    rewards = torch.tensor([[0.1, 0.2, 1.0], [0.5, 0.0, 0.0]])
    mask = right_padded_mask([3, 1], 3)
    adv, returns = compute_remax_advantages(rewards, torch.tensor([0.5, 1.0]), mask)
    assert torch.allclose(returns, torch.tensor([[1.3, 1.2, 1.0], [0.5, 0.0, 0.0]]))
    assert torch.allclose(adv, torch.tensor([[0.8, 0.7, 0.5], [-0.5, 0.0, 0.0]]))


# -- GSPO ------------------------------------------------------------------------------------------


def test_gspo_ratio_is_the_length_normalised_sequence_ratio_on_every_token() -> None:
    old = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    new = old + torch.tensor([[0.2, 0.0, 7.0], [-0.1, 0.0, 0.0]])
    mask = right_padded_mask([2, 1], 3)
    log_ratio = gspo_log_ratio(new, old, mask)
    # log s_0 = (0.2 + 0) / 2 = 0.1 (the padding's 7 is ignored); log s_1 = -0.1.
    assert torch.allclose(log_ratio, torch.tensor([[0.1] * 3, [-0.1] * 3]))
    assert torch.allclose(gspo_ratio(new, old, mask), torch.exp(torch.tensor([[0.1] * 3, [-0.1] * 3])))
    assert gspo_ratio(old + 50.0, old, torch.ones(2, 3)).max().item() == pytest.approx(math.exp(10.0))
    assert gspo_log_ratio(new, old, torch.zeros(2, 3)).abs().max().item() == 0.0


def test_gspo_token_ratio_has_the_sequence_value_and_the_token_gradient() -> None:
    old = torch.tensor([[-1.0, -2.0]])
    new = (old + torch.tensor([[0.3, -0.1]])).requires_grad_()
    s = gspo_ratio(new, old, torch.ones(1, 2))
    s[0, 0].backward()
    # d s_{0,0} / d logp = s * [1, 0]: the stop-gradient form differentiates only through its own token.
    assert torch.allclose(new.grad, torch.tensor([[math.exp(0.1), 0.0]]))


def test_gspo_clips_whole_sequences_by_hand() -> None:
    old = torch.zeros(2, 2)
    new = torch.tensor([[0.2, 0.0], [-0.1, 5.0]], requires_grad=True)
    mask = right_padded_mask([2, 1], 2)
    adv = torch.tensor([1.0, 1.0])
    loss, metrics = gspo_policy_loss(old, new, adv, mask, clip_low=0.05, clip_high=0.05)
    # Sequence 0: s = e^0.1 = 1.105 > 1.05, clipped: L = -1.05 on both tokens, no gradient.
    # Sequence 1: s = e^-0.1 = 0.905 < 0.95; for A > 0 the unclipped term is the larger: L = -0.905.
    # seq-mean-token-mean: (-1.05 + -0.905) / 2.
    assert loss.item() == pytest.approx((-1.05 - math.exp(-0.1)) / 2)
    loss.backward()
    assert torch.allclose(new.grad, torch.tensor([[0.0, 0.0], [-math.exp(-0.1) / 2, 0.0]]))
    assert metrics["clip_frac"] == pytest.approx(2 / 3)
    assert metrics["ratio_mean"] == pytest.approx((math.exp(0.1) + math.exp(-0.1)) / 2)
    assert metrics["dual_clip_frac"] == 0.0
    assert metrics["approx_kl"] == pytest.approx(((math.exp(0.2) - 1 - 0.2) + (math.exp(-0.1) - 1 + 0.1)) / 3)


def test_gspo_equals_ppo_when_every_token_of_a_sequence_has_the_same_ratio() -> None:
    torch.manual_seed(1)
    old = torch.randn(4, 5)
    per_seq = torch.randn(4, 1) * 0.3
    mask = right_padded_mask([5, 3, 1, 4], 5)
    adv = torch.randn(4)
    for agg in AGG_MODES:
        new = old + per_seq.expand(4, 5)
        gspo, _ = gspo_policy_loss(old, new, adv, mask, clip_low=0.2, clip_high=0.28, agg=agg)
        ppo, _ = ppo_policy_loss(old, new, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip_c=None, agg=agg)
        assert gspo.item() == pytest.approx(ppo.item()), agg


def test_gspo_rejects_negative_clips_and_bad_advantages() -> None:
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="clip_low and clip_high"):
        gspo_policy_loss(z, z, torch.zeros(2), torch.ones(2, 3), clip_low=-0.1)
    with pytest.raises(ValueError, match="advantages must be"):
        gspo_policy_loss(z, z, torch.zeros(3), torch.ones(2, 3))
