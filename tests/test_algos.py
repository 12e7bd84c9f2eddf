"""Unit tests for hybridflow.algos: hand-computed examples and slow reference loops."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algos import (
    AGG_MODES,
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    agg_loss,
    apply_kl_to_rewards,
    behaviour_weights,
    compute_gae,
    compute_grpo_advantages,
    entropy_from_logits,
    gspo_policy_loss,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    ppo_policy_loss,
    scores_to_token_rewards,
    value_loss,
)
from tests.helpers import right_padded_mask

pytestmark = pytest.mark.usefixtures("float64_by_default")


# --------------------------------------------------------------------------------------------------
# masked reductions
# --------------------------------------------------------------------------------------------------


def test_masked_sum_and_mean() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert masked_sum(x, mask).item() == 7.0
    assert masked_mean(x, mask).item() == pytest.approx(7.0 / 3.0)
    assert torch.allclose(masked_sum(x, mask, dim=-1), torch.tensor([3.0, 4.0]))
    assert torch.allclose(masked_mean(x, mask, dim=-1), torch.tensor([1.5, 4.0]))
    assert torch.allclose(masked_mean(x, mask.bool(), dim=0), torch.tensor([2.5, 2.0, 0.0]))


def test_masked_mean_of_empty_mask_is_zero_not_nan() -> None:
    assert masked_mean(torch.ones(2, 3), torch.zeros(2, 3)).item() == 0.0


def test_masked_var_matches_torch_var_on_the_selected_elements() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 9, generator=g)
    mask = right_padded_mask([9, 3, 5, 1], 9)
    selected = x[mask.bool()]
    assert masked_var(x, mask).item() == pytest.approx(selected.var().item())
    assert masked_var(x, mask, unbiased=False).item() == pytest.approx(selected.var(unbiased=False).item())


def test_masked_var_of_one_element_is_zero() -> None:
    x = torch.tensor([[3.0, 100.0]])
    assert masked_var(x, torch.tensor([[1, 0]])).item() == 0.0


def test_masked_whiten_gives_mean_zero_std_one_over_the_mask() -> None:
    g = torch.Generator().manual_seed(1)
    x = 5.0 + 3.0 * torch.randn(6, 11, generator=g)
    x[:, -2:] = 1e6  # padding garbage must not leak in
    mask = right_padded_mask([9, 4, 7, 1, 9, 2], 11)
    white = masked_whiten(x, mask)
    selected = white[mask.bool()]
    assert selected.mean().item() == pytest.approx(0.0, abs=1e-9)
    assert selected.std().item() == pytest.approx(1.0, rel=1e-6)
    assert torch.all(white[~mask.bool()] == 0)

    kept = masked_whiten(x, mask, shift_mean=False)[mask.bool()]
    assert kept.mean().item() == pytest.approx(x[mask.bool()].mean().item())
    assert kept.std().item() == pytest.approx(1.0, rel=1e-6)


# --------------------------------------------------------------------------------------------------
# logits
# --------------------------------------------------------------------------------------------------


def test_entropy_of_uniform_logits_is_log_vocab() -> None:
    vocab = 37
    h = entropy_from_logits(torch.zeros(2, 5, vocab))
    assert h.shape == (2, 5)
    assert torch.allclose(h, torch.full((2, 5), math.log(vocab)))
    # Shift invariance with huge logits: no overflow.
    assert torch.allclose(entropy_from_logits(torch.full((3, vocab), 1e4)), torch.full((3,), math.log(vocab)))


def test_entropy_matches_categorical_and_ignores_banned_tokens() -> None:
    g = torch.Generator().manual_seed(2)
    logits = 4.0 * torch.randn(3, 4, 50, generator=g)
    expected = torch.distributions.Categorical(logits=logits).entropy()
    assert torch.allclose(entropy_from_logits(logits), expected)

    banned = torch.zeros(2, 8)
    banned[:, 4:] = float("-inf")
    h = entropy_from_logits(banned.requires_grad_())
    assert torch.allclose(h, torch.full((2,), math.log(4)))
    h.sum().backward()
    assert torch.isfinite(banned.grad).all()


def test_entropy_of_half_precision_logits_is_computed_in_float32() -> None:
    logits = torch.zeros(2, 1000, dtype=torch.bfloat16)
    h = entropy_from_logits(logits)
    assert h.dtype == torch.float32
    assert h[0].item() == pytest.approx(math.log(1000), rel=1e-6)


def test_logprobs_from_logits_matches_log_softmax_and_is_stable() -> None:
    g = torch.Generator().manual_seed(3)
    logits = 3.0 * torch.randn(2, 6, 40, generator=g)
    labels = torch.randint(0, 40, (2, 6), generator=g)
    expected = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)
    assert torch.allclose(logprobs_from_logits(logits, labels), expected)

    shifted = logprobs_from_logits(logits.float() + 1e4, labels)
    assert torch.isfinite(shifted).all()
    assert torch.allclose(shifted.double(), expected, atol=1e-2)


# --------------------------------------------------------------------------------------------------
# GAE
# --------------------------------------------------------------------------------------------------


def test_gae_hand_example_with_padding() -> None:
    gamma, lam = 0.9, 0.8
    rewards = torch.tensor([[0.0, 0.0, 1.0, 7.0]])
    values = torch.tensor([[0.5, 0.6, 0.7, float("nan")]])
    mask = torch.tensor([[1, 1, 1, 0]])
    adv, ret = compute_gae(rewards, values, mask, gamma, lam)
    # t=2: delta = 1 - 0.7 = 0.3 (value after the end is 0)
    # t=1: delta = 0.9*0.7 - 0.6 = 0.03;  A = 0.03 + 0.72*0.3   = 0.246
    # t=0: delta = 0.9*0.6 - 0.5 = 0.04;  A = 0.04 + 0.72*0.246 = 0.21712
    assert torch.allclose(adv, torch.tensor([[0.21712, 0.246, 0.3, 0.0]]))
    assert torch.allclose(ret, torch.tensor([[0.71712, 0.846, 1.0, 0.0]]))


def _gae_reference(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    n = len(rewards)
    adv = [0.0] * n
    running = 0.0
    for t in reversed(range(n)):
        next_value = values[t + 1] if t + 1 < n else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        adv[t] = running
    return adv


@pytest.mark.parametrize(("gamma", "lam"), [(0.99, 0.95), (1.0, 1.0), (0.5, 0.0), (0.0, 0.9)])
def test_gae_matches_slow_reference_on_random_padded_batch(gamma: float, lam: float) -> None:
    g = torch.Generator().manual_seed(4)
    lengths = [10, 0, 1, 6, 3, 10, 8]
    num_tokens = 10
    mask = right_padded_mask(lengths, num_tokens)
    rewards = torch.randn(len(lengths), num_tokens, generator=g)
    values = torch.randn(len(lengths), num_tokens, generator=g)
    adv, ret = compute_gae(rewards, values, mask, gamma, lam)

    for b, n in enumerate(lengths):
        expected = _gae_reference(rewards[b, :n].tolist(), values[b, :n].tolist(), gamma, lam)
        assert adv[b, :n].tolist() == pytest.approx(expected)
        assert ret[b, :n].tolist() == pytest.approx(
            [a + v for a, v in zip(expected, values[b, :n].tolist(), strict=True)]
        )
        assert torch.all(adv[b, n:] == 0)
        assert torch.all(ret[b, n:] == 0)


def test_gae_with_gamma_lam_one_gives_reward_to_go() -> None:
    g = torch.Generator().manual_seed(5)
    lengths = [5, 2, 7]
    mask = right_padded_mask(lengths, 7)
    rewards = torch.randn(3, 7, generator=g)
    values = torch.randn(3, 7, generator=g)
    adv, ret = compute_gae(rewards, values, mask, 1.0, 1.0)
    masked_rewards = rewards * mask
    reward_to_go = masked_rewards.flip(-1).cumsum(-1).flip(-1) * mask
    assert torch.allclose(ret, reward_to_go)
    assert torch.allclose(adv, (reward_to_go - values) * mask)


def test_gae_carries_no_gradient() -> None:
    values = torch.randn(2, 4, requires_grad=True)
    adv, ret = compute_gae(torch.randn(2, 4), values, torch.ones(2, 4), 0.99, 0.95)
    assert not adv.requires_grad
    assert not ret.requires_grad


# --------------------------------------------------------------------------------------------------
# GRPO
# --------------------------------------------------------------------------------------------------


def test_grpo_advantages_zero_mean_unit_std_per_group() -> None:
    g = torch.Generator().manual_seed(6)
    group_ids = torch.tensor([0, 0, 0, 0, 7, 7, 7, 3, 3, 3, 3, 3])
    scores = 10.0 * torch.randn(12, generator=g)
    adv = compute_grpo_advantages(scores, group_ids, eps=0.0)
    for gid in group_ids.unique():
        chunk = adv[group_ids == gid]
        assert chunk.mean().item() == pytest.approx(0.0, abs=1e-9)
        assert chunk.std().item() == pytest.approx(1.0)  # unbiased std, as torch.std


def test_grpo_advantages_match_the_formula_with_eps() -> None:
    scores = torch.tensor([1.0, 0.0, 0.0, 2.0, 4.0])
    group_ids = ["a", "a", "a", "b", "b"]
    adv = compute_grpo_advantages(scores, group_ids, eps=1e-6)
    a = scores[:3]
    b = scores[3:]
    expected = torch.cat([(a - a.mean()) / (a.std() + 1e-6), (b - b.mean()) / (b.std() + 1e-6)])
    assert torch.allclose(adv, expected)


def test_grpo_single_element_group_gets_zero_and_equal_scores_give_zero() -> None:
    scores = torch.tensor([5.0, 1.0, 1.0, 1.0, 0.0, 2.0])
    group_ids = torch.tensor([9, 1, 1, 1, 2, 2])
    adv = compute_grpo_advantages(scores, group_ids)
    assert adv[0].item() == 0.0
    assert torch.all(adv[1:4] == 0)
    assert torch.isfinite(adv).all()
    assert adv[4].item() == pytest.approx(-1.0 / math.sqrt(2.0), rel=1e-5)


def test_grpo_without_std_normalization_only_centers() -> None:
    scores = torch.tensor([1.0, 3.0, 10.0, 20.0, 30.0, 4.0])
    group_ids = [0, 0, 1, 1, 1, 2]
    adv = compute_grpo_advantages(scores, group_ids, normalize_std=False)
    assert torch.allclose(adv, torch.tensor([-1.0, 1.0, -10.0, 0.0, 10.0, 0.0]))


def test_grpo_accepts_integer_scores_and_rejects_bad_shapes() -> None:
    adv = compute_grpo_advantages(torch.tensor([0, 1]), [0, 0])
    assert adv.is_floating_point()
    with pytest.raises(ValueError, match="entries"):
        compute_grpo_advantages(torch.tensor([0.0, 1.0, 2.0]), [0, 0])
    with pytest.raises(ValueError, match="1-D"):
        compute_grpo_advantages(torch.zeros(2, 2), [0, 0])


# --------------------------------------------------------------------------------------------------
# aggregation
# --------------------------------------------------------------------------------------------------

LOSS_MAT = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
AGG_MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])


@pytest.mark.parametrize(
    ("agg", "expected"),
    [
        ("token-mean", (1 + 2 + 4) / 3),  # 7 / 3 tokens
        ("seq-mean-token-sum", (3 + 4) / 2),  # empty third row excluded
        ("seq-mean-token-mean", (1.5 + 4) / 2),
        ("seq-mean-token-sum-norm", (3 + 4) / 2 / 3),  # over the matrix's width without a horizon
    ],
)
def test_agg_loss_modes_on_hand_example(agg: str, expected: float) -> None:
    assert agg_loss(LOSS_MAT, AGG_MASK, agg).item() == pytest.approx(expected)


def test_the_sum_norm_mode_divides_by_the_horizon_whatever_the_padding() -> None:
    """Dr. GRPO's constant: the same rows trimmed of their shared padding (a micro-batch) lose the same."""
    assert agg_loss(LOSS_MAT, AGG_MASK, "seq-mean-token-sum-norm", horizon=10).item() == pytest.approx(3.5 / 10)
    trimmed = agg_loss(LOSS_MAT[:, :2], AGG_MASK[:, :2], "seq-mean-token-sum-norm", horizon=10)
    assert trimmed.item() == pytest.approx(3.5 / 10)
    for horizon in (None, 10):  # the other modes take no horizon
        assert agg_loss(LOSS_MAT, AGG_MASK, "seq-mean-token-sum", horizon=horizon).item() == pytest.approx(3.5)


def test_agg_loss_unknown_mode_names_the_allowed_values() -> None:
    with pytest.raises(ValueError) as info:
        agg_loss(LOSS_MAT, AGG_MASK, "sum")
    for mode in AGG_MODES:
        assert mode in str(info.value)


# --------------------------------------------------------------------------------------------------
# PPO policy loss
# --------------------------------------------------------------------------------------------------


def _ppo_case(
    ratio: float, advantage: float, **kwargs: float | None
) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    old = torch.zeros(1, 1)
    new = torch.full((1, 1), math.log(ratio), requires_grad=True)
    loss, metrics = ppo_policy_loss(old, new, torch.tensor([[advantage]]), torch.ones(1, 1), **kwargs)
    loss.backward()
    return loss, metrics, new.grad


def test_ppo_ratio_one_gives_minus_mean_advantage() -> None:
    g = torch.Generator().manual_seed(7)
    old = torch.randn(4, 6, generator=g)
    adv = torch.randn(4, 6, generator=g)
    adv[0, -1] = 1e6  # padding must be ignored
    mask = right_padded_mask([6, 2, 5, 3], 6)
    mask[0, -1] = 0
    loss, metrics = ppo_policy_loss(old, old.clone(), adv, mask)
    assert loss.item() == pytest.approx(-adv[mask.bool()].mean().item())
    assert metrics == {"clip_frac": 0.0, "approx_kl": 0.0, "ratio_mean": 1.0, "dual_clip_frac": 0.0}
    assert all(isinstance(v, float) for v in metrics.values())


def test_ppo_metrics_approx_kl_is_k3() -> None:
    old = torch.zeros(1, 2)
    new = torch.tensor([[math.log(1.1), math.log(0.95)]])
    _, metrics = ppo_policy_loss(old, new, torch.zeros(1, 2), torch.ones(1, 2))
    expected = ((1.1 - 1 - math.log(1.1)) + (0.95 - 1 - math.log(0.95))) / 2
    assert metrics["approx_kl"] == pytest.approx(expected)
    assert metrics["ratio_mean"] == pytest.approx(1.025)


def test_ppo_positive_advantage_clips_above_the_range_with_zero_gradient() -> None:
    loss, metrics, grad = _ppo_case(1.5, 2.0)
    assert loss.item() == pytest.approx(-2.0 * 1.2)
    assert metrics["clip_frac"] == 1.0
    assert grad.abs().item() == 0.0


def test_ppo_positive_advantage_below_the_range_is_not_clipped() -> None:
    loss, metrics, grad = _ppo_case(0.5, 2.0)
    assert loss.item() == pytest.approx(-2.0 * 0.5)
    assert metrics["clip_frac"] == 0.0
    assert grad.item() == pytest.approx(-2.0 * 0.5)  # d(-A * exp(logp)) / dlogp


def test_ppo_negative_advantage_clips_below_the_range_with_zero_gradient() -> None:
    loss, metrics, grad = _ppo_case(0.5, -1.0)
    assert loss.item() == pytest.approx(0.8)
    assert metrics["clip_frac"] == 1.0
    assert grad.abs().item() == 0.0


def test_ppo_inside_the_range_has_full_gradient() -> None:
    loss, metrics, grad = _ppo_case(1.1, 3.0)
    assert loss.item() == pytest.approx(-3.0 * 1.1)
    assert metrics["clip_frac"] == 0.0
    assert grad.item() == pytest.approx(-3.0 * 1.1)


def test_ppo_asymmetric_clip_range() -> None:
    loss, metrics, _ = _ppo_case(1.25, 1.0, clip_low=0.1, clip_high=0.3)
    assert loss.item() == pytest.approx(-1.25)
    assert metrics["clip_frac"] == 0.0
    loss, metrics, _ = _ppo_case(1.35, 1.0, clip_low=0.1, clip_high=0.3)
    assert loss.item() == pytest.approx(-1.3)
    assert metrics["clip_frac"] == 1.0
    loss, metrics, _ = _ppo_case(0.85, -1.0, clip_low=0.1, clip_high=0.3)
    assert loss.item() == pytest.approx(0.9)
    assert metrics["clip_frac"] == 1.0


def test_ppo_dual_clip_bounds_negative_advantages() -> None:
    loss, metrics, grad = _ppo_case(10.0, -1.0, dual_clip_c=3.0)
    assert loss.item() == pytest.approx(3.0)
    assert metrics["dual_clip_frac"] == 1.0
    assert grad.abs().item() == 0.0

    loss, metrics, grad = _ppo_case(10.0, -1.0, dual_clip_c=None)
    assert loss.item() == pytest.approx(10.0)
    assert metrics["dual_clip_frac"] == 0.0
    assert grad.item() == pytest.approx(10.0)

    # Below the bound the dual clip does nothing.
    loss, metrics, _ = _ppo_case(2.0, -1.0, dual_clip_c=3.0)
    assert loss.item() == pytest.approx(2.0)
    assert metrics["dual_clip_frac"] == 0.0

    # Positive advantages are never dual-clipped.
    loss, metrics, _ = _ppo_case(10.0, 1.0, dual_clip_c=3.0)
    assert loss.item() == pytest.approx(-1.2)
    assert metrics["dual_clip_frac"] == 0.0


@pytest.mark.parametrize("bad", [1.0, 0.5, -2.0])
def test_ppo_dual_clip_c_must_exceed_one(bad: float) -> None:
    with pytest.raises(ValueError, match="dual_clip_c"):
        ppo_policy_loss(
            torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), dual_clip_c=bad
        )


def test_ppo_clip_frac_counts_only_valid_tokens() -> None:
    old = torch.zeros(1, 4)
    new = torch.log(torch.tensor([[1.5, 1.0, 1.5, 1.5]]))
    mask = torch.tensor([[1, 1, 0, 0]])
    _, metrics = ppo_policy_loss(old, new, torch.ones(1, 4), mask)
    assert metrics["clip_frac"] == pytest.approx(0.5)


def test_ppo_sequence_advantages_broadcast_over_tokens() -> None:
    g = torch.Generator().manual_seed(8)
    old = torch.randn(3, 5, generator=g)
    new = old + 0.3 * torch.randn(3, 5, generator=g)
    seq_adv = torch.tensor([1.0, -2.0, 0.5])
    mask = right_padded_mask([5, 3, 1], 5)
    for agg in AGG_MODES:
        a, ma = ppo_policy_loss(old, new, seq_adv, mask, agg=agg)
        b, mb = ppo_policy_loss(old, new, seq_adv[:, None].expand(3, 5), mask, agg=agg)
        assert a.item() == pytest.approx(b.item())
        assert ma == mb
    with pytest.raises(ValueError, match="advantages"):
        ppo_policy_loss(old, new, torch.zeros(4), mask)


def test_ppo_unknown_agg_names_the_allowed_values() -> None:
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        ppo_policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), agg="mean")


# --------------------------------------------------------------------------------------------------
# value loss
# --------------------------------------------------------------------------------------------------


def test_value_loss_unclipped_case() -> None:
    pred = torch.tensor([[1.0, 2.0, 99.0]], requires_grad=True)
    returns = torch.tensor([[0.0, 4.0, 0.0]])
    old = torch.tensor([[0.8, 1.9, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, metrics = value_loss(pred, returns, old, mask, clip=0.5)
    assert loss.item() == pytest.approx(0.5 * (1.0 + 4.0) / 2)
    assert metrics["vf_clip_frac"] == 0.0
    assert metrics["value_mean"] == pytest.approx(1.5)


def test_value_loss_clipping_engages_and_stops_the_gradient() -> None:
    # V moved from 0 to 2, return is 3: clipped V = 0.5, (0.5 - 3)^2 = 6.25 > (2 - 3)^2 = 1.
    pred = torch.tensor([[2.0]], requires_grad=True)
    loss, metrics = value_loss(pred, torch.tensor([[3.0]]), torch.tensor([[0.0]]), torch.ones(1, 1), clip=0.5)
    assert loss.item() == pytest.approx(0.5 * 6.25)
    assert metrics["vf_clip_frac"] == 1.0
    loss.backward()
    assert pred.grad.abs().item() == 0.0

    # Moving past the return: unclipped term wins, the gradient is the plain one.
    pred = torch.tensor([[2.0]], requires_grad=True)
    loss, metrics = value_loss(pred, torch.tensor([[0.0]]), torch.tensor([[0.0]]), torch.ones(1, 1), clip=0.5)
    assert loss.item() == pytest.approx(0.5 * 4.0)
    assert metrics["vf_clip_frac"] == 0.0
    loss.backward()
    assert pred.grad.item() == pytest.approx(2.0)


def test_value_loss_clip_none_disables_and_bad_clip_raises() -> None:
    pred = torch.tensor([[2.0]])
    loss, metrics = value_loss(
        pred, torch.tensor([[3.0]]), torch.tensor([[0.0]]), torch.ones(1, 1), clip=None
    )
    assert loss.item() == pytest.approx(0.5)
    assert metrics["vf_clip_frac"] == 0.0
    with pytest.raises(ValueError, match="clip"):
        value_loss(pred, pred, pred, torch.ones(1, 1), clip=0.0)
    with pytest.raises(ValueError, match="token-mean"):
        value_loss(pred, pred, pred, torch.ones(1, 1), agg="nope")


# --------------------------------------------------------------------------------------------------
# KL
# --------------------------------------------------------------------------------------------------


def test_kl_kinds_on_known_values() -> None:
    logp = torch.log(torch.tensor([0.5, 0.25]))
    ref = torch.log(torch.tensor([0.25, 0.5]))
    ln2 = math.log(2.0)
    assert kl_penalty(logp, ref, "kl").tolist() == pytest.approx([ln2, -ln2])
    assert kl_penalty(logp, ref, "abs").tolist() == pytest.approx([ln2, ln2])
    assert kl_penalty(logp, ref, "mse").tolist() == pytest.approx([0.5 * ln2**2, 0.5 * ln2**2])
    # k3 = exp(ref - logp) - (ref - logp) - 1
    assert kl_penalty(logp, ref, "low_var_kl").tolist() == pytest.approx([0.5 + ln2 - 1.0, 2.0 - ln2 - 1.0])


def test_low_var_kl_is_nonnegative_zero_at_equality_and_clamped() -> None:
    g = torch.Generator().manual_seed(9)
    logp = 3.0 * torch.randn(1000, generator=g)
    ref = 3.0 * torch.randn(1000, generator=g)
    k3 = kl_penalty(logp, ref, "low_var_kl")
    assert torch.all(k3 >= 0)
    assert torch.all(k3 <= 10)
    assert torch.all(kl_penalty(logp, logp, "low_var_kl") == 0)
    assert kl_penalty(torch.tensor([0.0]), torch.tensor([100.0]), "low_var_kl").item() == 10.0


def test_kl_unknown_kind_names_the_allowed_kinds() -> None:
    with pytest.raises(ValueError) as info:
        kl_penalty(torch.zeros(2), torch.zeros(2), "full")
    for kind in KL_KINDS:
        assert kind in str(info.value)


def test_apply_kl_to_rewards() -> None:
    scores = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]])
    logp = torch.tensor([[0.0, 0.5, 9.0], [0.2, 0.2, 0.2]])
    ref = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    rewards, kl_mean = apply_kl_to_rewards(scores, logp, ref, mask, coef=0.1, kind="kl")
    expected = torch.tensor([[0.0, 1.0 - 0.05, 0.0], [-0.02, -0.02, 2.0 - 0.02]])
    assert torch.allclose(rewards, expected)
    assert isinstance(kl_mean, float)
    assert kl_mean == pytest.approx((0.25 + 0.2) / 2)


def test_scores_to_token_rewards_puts_the_score_on_the_last_valid_token() -> None:
    scores = torch.tensor([1.5, -2.0, 3.0, 4.0])
    mask = right_padded_mask([3, 1, 0, 4], 4)
    rewards = scores_to_token_rewards(scores, mask)
    expected = torch.zeros(4, 4)
    expected[0, 2] = 1.5
    expected[1, 0] = -2.0
    expected[3, 3] = 4.0
    assert torch.equal(rewards, expected)
    assert scores_to_token_rewards(torch.tensor([1, 2]), torch.ones(2, 3)).is_floating_point()


# --------------------------------------------------------------------------------------------------
# KL controllers
# --------------------------------------------------------------------------------------------------


def test_fixed_kl_controller_never_moves() -> None:
    ctl = FixedKLController(0.05)
    ctl.update(10.0, 100)
    assert ctl.value == 0.05
    other = FixedKLController(0.0)
    other.load_state_dict(ctl.state_dict())
    assert other.value == 0.05


def test_adaptive_kl_controller_moves_toward_target() -> None:
    up = AdaptiveKLController(init_coef=0.1, target_kl=1.0, horizon=1000)
    up.update(current_kl=1.1, n_steps=100)  # err = 0.1
    assert up.value == pytest.approx(0.1 * (1 + 0.1 * 100 / 1000))
    up.update(current_kl=5.0, n_steps=100)  # err clipped to 0.2
    assert up.value == pytest.approx(0.1 * 1.01 * 1.02)

    down = AdaptiveKLController(init_coef=0.1, target_kl=1.0, horizon=1000)
    down.update(current_kl=0.0, n_steps=500)  # err clipped to -0.2
    assert down.value == pytest.approx(0.1 * 0.9)

    steady = AdaptiveKLController(init_coef=0.1, target_kl=1.0, horizon=1000)
    steady.update(current_kl=1.0, n_steps=500)
    assert steady.value == pytest.approx(0.1)


def test_adaptive_kl_controller_state_round_trip_and_validation() -> None:
    ctl = AdaptiveKLController(0.2, 0.5, 100)
    ctl.update(1.0, 10)
    restored = AdaptiveKLController(0.2, 0.5, 100)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value
    assert ctl.value > 0.2
    with pytest.raises(ValueError, match="target_kl"):
        AdaptiveKLController(0.1, 0.0, 100)
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.1, 1.0, 0)
    with pytest.raises(ValueError, match="finite"):
        ctl.update(float("nan"), 1)


def test_behaviour_weights_are_the_truncated_ratio_of_proximal_to_behaviour() -> None:
    prox = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    behav = torch.log(torch.tensor([[0.25, 0.4, 0.3]]))
    w = behaviour_weights(prox, behav, cap=2.5)
    assert w.tolist()[0] == pytest.approx([2.0, 0.5, 2.5])  # 0.9 / 0.3 = 3 is cut at the cap
    assert behaviour_weights(prox, prox, cap=1.0).tolist() == [[1.0, 1.0, 1.0]]
    with pytest.raises(ValueError, match="cap must be >= 1"):
        behaviour_weights(prox, behav, cap=0.5)


@pytest.mark.parametrize("loss_fn", [ppo_policy_loss, gspo_policy_loss])
def test_weights_scale_each_tokens_policy_loss(loss_fn) -> None:
    """L = w * L_token before the aggregation: weights of 1 change nothing, and a token of weight 0 drops out."""
    torch.manual_seed(0)
    old = torch.randn(3, 4) * 0.1 - 1.0
    new = (old + torch.randn(3, 4) * 0.05).requires_grad_(True)
    adv, mask = torch.randn(3, 4), torch.ones(3, 4)
    plain, _ = loss_fn(old, new, adv, mask, agg="token-mean")
    ones, _ = loss_fn(old, new, adv, mask, agg="token-mean", weights=torch.ones(3, 4))
    assert ones.item() == pytest.approx(plain.item())
    weights = torch.ones(3, 4)
    weights[0] = 0.0
    dropped, _ = loss_fn(old, new, adv, mask, agg="token-mean", weights=weights)
    (grad,) = torch.autograd.grad(dropped, new)
    assert torch.all(grad[0] == 0) and torch.any(grad[1:] != 0)
    doubled, _ = loss_fn(old, new, adv, mask, agg="token-mean", weights=torch.full((3, 4), 2.0))
    assert doubled.item() == pytest.approx(2 * plain.item())
