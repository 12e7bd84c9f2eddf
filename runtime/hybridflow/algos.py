"""PPO, GRPO, RLOO, REINFORCE++ and GSPO math as pure functions on torch tensors.

Advantage estimators: compute_gae (PPO, with a critic), compute_grpo_advantages, compute_rloo_advantages,
compute_reinforce_plus_plus_advantages and compute_reinforce_plus_plus_baseline_advantages (no critic).
Policy losses: ppo_policy_loss (token-level ratio) and gspo_policy_loss (sequence-level ratio, gspo_ratio); the
others verl names are in hybridflow.policy_losses.

Shapes: B sequences, T response tokens, V vocabulary entries. Token tensors are [B, T], right-padded,
with ``mask`` 1 on valid response tokens and 0 on padding. Nothing here does I/O or knows about Ray;
every function takes tensors (and plain numbers) and returns tensors (and plain numbers).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import torch

__all__ = [
    "AGG_MODES",
    "KL_KINDS",
    "AdaptiveKLController",
    "FixedKLController",
    "agg_loss",
    "apply_kl_to_rewards",
    "behaviour_weights",
    "compute_discounted_returns",
    "compute_gae",
    "compute_gpg_advantages",
    "compute_grpo_advantages",
    "compute_optimal_token_baseline_advantages",
    "compute_reinforce_plus_plus_advantages",
    "compute_reinforce_plus_plus_baseline_advantages",
    "compute_rloo_advantages",
    "entropy_from_logits",
    "gspo_log_ratio",
    "gspo_policy_loss",
    "gspo_ratio",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "pf_ppo_weights",
    "ppo_policy_loss",
    "ratio_metrics",
    "scores_to_token_rewards",
    "sum_pi_squared_from_logits",
    "token_advantages",
    "token_log_ratio",
    "value_loss",
    "weighted",
]

AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
SEQ_MEAN_MODES: tuple[str, ...] = AGG_MODES[1:]
"""The modes that average over sequences (with at least one valid token)."""
KL_KINDS: tuple[str, ...] = ("kl", "abs", "mse", "low_var_kl")

# exp() of a log-ratio beyond this is inf or 0 in float32; clamping keeps losses finite.
_LOG_RATIO_CLAMP = 20.0
# GSPO's sequence ratio is clamped above at exp(10) (~2e4, far outside any clip range), as verl does: a
# length-normalised log-ratio that large means the sequence is off-policy, and its clipped term wins anyway.
_GSPO_LOG_RATIO_MAX = 10.0


# --------------------------------------------------------------------------------------------------
# masked reductions
# --------------------------------------------------------------------------------------------------


def _as_weights(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Broadcast ``x`` and ``mask`` together, with the mask as weights in ``x``'s dtype."""
    x, m = torch.broadcast_tensors(x, mask.to(x.dtype))
    return x, m


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(x * mask) over ``dim`` (all elements when None)."""
    x, m = _as_weights(x, mask)
    prod = x * m
    return prod.sum() if dim is None else prod.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(x * mask) / sum(mask) over ``dim`` (all elements when None); 0 where the mask is empty."""
    x, m = _as_weights(x, mask)
    total = (x * m).sum() if dim is None else (x * m).sum(dim=dim)
    count = m.sum() if dim is None else m.sum(dim=dim)
    return total / count.clamp_min(1e-8)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over the masked elements: sum(mask * (x - mean)^2) / (n - 1), n = sum(mask).

    With ``unbiased=False`` the divisor is n. With fewer than two valid elements the Bessel
    correction is skipped (a single element has variance 0, not nan).
    """
    x, m = _as_weights(x, mask)
    mean = masked_mean(x, m)
    var = masked_mean((x - mean) ** 2, m)
    if unbiased:
        n = m.sum()
        var = torch.where(n > 1, var * n / (n - 1).clamp_min(1e-8), var)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the masked elements (unbiased var); 0 outside the mask.

    With ``shift_mean=False`` the mean is added back: x_white = (x - mean) / std + mean.
    """
    x, m = _as_weights(x, mask)
    mean = masked_mean(x, m)
    var = masked_var(x, m, unbiased=True)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(m.bool(), whitened, torch.zeros_like(whitened))


# --------------------------------------------------------------------------------------------------
# logits
# --------------------------------------------------------------------------------------------------


def _upcast(logits: torch.Tensor) -> torch.Tensor:
    """Half-precision logits are reduced in float32; softmax sums lose too much in 16 bits."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        return logits.float()
    return logits


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-token entropy, [..., V] -> [...]: H = logsumexp(z) - sum_v softmax(z)_v * z_v.

    Stable for large logits; entries at -inf (banned tokens) contribute 0.
    """
    z = _upcast(logits)
    lse = torch.logsumexp(z, dim=-1)
    p = torch.softmax(z, dim=-1)
    z_finite = z.masked_fill(torch.isneginf(z), 0.0)
    return lse - (p * z_finite).sum(dim=-1)


def sum_pi_squared_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-token sum_v pi_v^2 = sum_v softmax(z)_v^2, [..., V] -> [...]: the squared norm of the softmax, which
    the optimal token baseline's score norm takes (compute_optimal_token_baseline_advantages)."""
    return torch.softmax(_upcast(logits), dim=-1).square().sum(dim=-1)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token log-probabilities of ``labels``, [..., V] and [...] -> [...].

    log p(y) = z_y - logsumexp(z), i.e. log_softmax(z) gathered at y.
    """
    z = _upcast(logits)
    picked = z.gather(dim=-1, index=labels.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(z, dim=-1)


# --------------------------------------------------------------------------------------------------
# advantages
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def compute_gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over response tokens, all [B, T].

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}
        R_t     = A_t + V_t

    The value after the last valid token is 0 (the episode ends there), so A at that token is
    r - V. Masked positions are skipped: they neither contribute nor break the recursion, and they
    are 0 in both outputs. Advantages are not whitened. No gradient flows.
    """
    valid = mask.bool()
    zero = torch.zeros_like(values)
    r = torch.where(valid, token_rewards.to(values.dtype), zero)
    v = torch.where(valid, values, zero)
    m = valid.to(values.dtype)

    num_tokens = r.shape[-1]
    advantages = torch.zeros_like(v)
    next_value = torch.zeros_like(v[:, 0])
    next_adv = torch.zeros_like(v[:, 0])
    for t in reversed(range(num_tokens)):
        delta = r[:, t] + gamma * next_value - v[:, t]
        adv_t = delta + gamma * lam * next_adv
        # On a masked token, carry the next valid token's value and advantage through unchanged.
        next_adv = m[:, t] * adv_t + (1.0 - m[:, t]) * next_adv
        next_value = m[:, t] * v[:, t] + (1.0 - m[:, t]) * next_value
        advantages[:, t] = adv_t

    advantages = torch.where(valid, advantages, zero)
    returns = torch.where(valid, advantages + v, zero)
    return advantages, returns


def _group_index(group_ids: torch.Tensor | Sequence[Hashable], n: int, device: torch.device) -> torch.Tensor:
    """Map arbitrary group ids to 0..G-1, one per sequence."""
    if isinstance(group_ids, torch.Tensor):
        if group_ids.dim() != 1:
            raise ValueError(f"group_ids must be 1-D, got shape {tuple(group_ids.shape)}")
        index = torch.unique(group_ids, return_inverse=True)[1]
    else:
        seen: dict[Hashable, int] = {}
        index = torch.tensor([seen.setdefault(g, len(seen)) for g in group_ids], dtype=torch.long)
    if index.numel() != n:
        raise ValueError(f"group_ids has {index.numel()} entries but scores has {n}")
    return index.to(device)


def _group_stats(r: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group: (count, mean) of the sequences' scores ``r`` [B], with ``index`` [B] in 0..G-1."""
    num_groups = int(index.max().item()) + 1 if index.numel() else 0
    count = torch.zeros(num_groups, dtype=r.dtype, device=r.device).index_add_(0, index, torch.ones_like(r))
    total = torch.zeros_like(count).index_add_(0, index, r)
    return count, total / count.clamp_min(1.0)


def _sequence_scores(scores: torch.Tensor) -> torch.Tensor:
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D [B], got shape {tuple(scores.shape)}")
    return scores if scores.is_floating_point() else scores.float()


@torch.no_grad()
def compute_grpo_advantages(
    scores: torch.Tensor,
    group_ids: torch.Tensor | Sequence[Hashable],
    eps: float = 1e-6,
    normalize_std: bool = True,
) -> torch.Tensor:
    """Group-relative advantages, one per sequence: [B] -> [B].

        A_i = (r_i - mean_g) / (std_g + eps)      (normalize_std=True)
        A_i =  r_i - mean_g                       (normalize_std=False)

    mean_g and std_g are over the sequences sharing i's group id; std_g is the unbiased (n - 1)
    standard deviation, as torch.std computes it. A group of one sequence gets advantage 0.
    """
    r = _sequence_scores(scores)
    index = _group_index(group_ids, r.numel(), r.device)
    count, mean = _group_stats(r, index)
    centered = r - mean[index]
    if not normalize_std:
        advantages = centered
    else:
        sq = torch.zeros_like(count).index_add_(0, index, centered**2)
        std = torch.sqrt(sq / (count - 1).clamp_min(1.0))
        advantages = centered / (std[index] + eps)
    return torch.where(count[index] > 1, advantages, torch.zeros_like(advantages))


@torch.no_grad()
def compute_gdpo_advantages(components: torch.Tensor, weights: Sequence[float], group_ids: Sequence[Hashable],
                            mask: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GDPO: each reward component group-normalised on its own, summed with its weight, then whitened over the
    batch's valid tokens, [K, B] -> [B, T]:

        A = whiten( sum_k w_k * grpo(r_k) )      (grpo: compute_grpo_advantages, per sequence, on each token)
    """
    summed = sum((w * compute_grpo_advantages(c, group_ids, eps, normalize_std)
                  for w, c in zip(weights, components, strict=True)), torch.zeros(components.shape[1]))
    return masked_whiten(summed.unsqueeze(-1) * mask, mask) * mask


def compute_rloo_advantages(scores: torch.Tensor, group_ids: torch.Tensor | Sequence[Hashable]) -> torch.Tensor:
    """REINFORCE Leave-One-Out advantages, one per sequence: [B] -> [B].

        A_i = r_i - 1/(n-1) * sum_{j in g, j != i} r_j  =  n/(n-1) * (r_i - mean_g)

    n is the size of i's group (the samples of one prompt): each sample's baseline is the mean score of
    the others, which does not depend on the sample itself, so the estimate stays unbiased (Ahmadian et
    al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human Feedback
    in LLMs", arXiv:2402.14740). Not normalised by a std. A group of one sequence has no others: its
    baseline is 0 and A_i = r_i (as verl's `rloo` estimator does).
    """
    r = _sequence_scores(scores)
    index = _group_index(group_ids, r.numel(), r.device)
    count, mean = _group_stats(r, index)
    n = count[index]
    loo = n / (n - 1).clamp_min(1.0) * (r - mean[index])
    return torch.where(n > 1, loo, r)


@torch.no_grad()
def compute_discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Discounted reward-to-go over response tokens, [B, T] -> [B, T]:  G_t = r_t + gamma * G_{t+1}.

    G after the last valid token is 0. Masked positions are skipped (their rewards ignored, the running
    return carried through them unchanged) and are 0 in the output. No gradient flows.
    """
    valid = mask.bool()
    r = torch.where(valid, token_rewards, torch.zeros_like(token_rewards))
    m = valid.to(r.dtype)
    returns = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[-1])):
        g = r[:, t] + gamma * running
        returns[:, t] = m[:, t] * g
        running = m[:, t] * g + (1.0 - m[:, t]) * running
    return returns


@torch.no_grad()
def compute_reinforce_plus_plus_advantages(
    token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, whiten: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ advantages (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large
    Language Models", arXiv:2501.03262), all [B, T]: no critic and no per-prompt baseline.

        G_t = r_t + gamma * G_{t+1}                        (compute_discounted_returns)
        A   = (G - mean(G)) / sqrt(var(G) + 1e-8)          (over every valid token of the batch)

    Token rewards carry the KL penalty when klPenalty.mode is `reward`, so the discounting spreads it
    over the tokens before it. The batch-wide whitening (``whiten=False`` skips it) is the method's
    variance reduction in place of a critic. Returns (advantages, returns); both 0 outside the mask.
    """
    returns = compute_discounted_returns(token_rewards, mask, gamma)
    advantages = masked_whiten(returns, mask) if whiten else returns
    return advantages, returns


@torch.no_grad()
def compute_reinforce_plus_plus_baseline_advantages(
    scores: torch.Tensor,
    group_ids: torch.Tensor | Sequence[Hashable],
    mask: torch.Tensor,
    whiten: bool = True,
) -> torch.Tensor:
    """REINFORCE++ with a group baseline (REINFORCE++-baseline, Hu 2025, arXiv:2501.03262): [B] -> [B, T].

        a_i = r_i - mean_g                                 (mean over i's group; 0 for a group of one)
        A   = whiten(a_i on each valid token of i)         (mean and unbiased var over every valid token)

    The group mean removes each prompt's difficulty, the batch-wide whitening scales the result; each
    sequence weighs in the whitening by its number of tokens.
    """
    r = _sequence_scores(scores)
    index = _group_index(group_ids, r.numel(), r.device)
    count, mean = _group_stats(r, index)
    centered = torch.where(count[index] > 1, r - mean[index], r)
    valid = mask.bool()
    per_token = torch.where(valid, centered.unsqueeze(-1).to(r.dtype), torch.zeros((), dtype=r.dtype))
    return masked_whiten(per_token, mask) if whiten else per_token


@torch.no_grad()
def compute_opo_advantages(scores: torch.Tensor, group_ids: torch.Tensor | Sequence[Hashable],
                           lengths: torch.Tensor) -> torch.Tensor:
    """OPO's advantages (Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline", arXiv:2505.23585): [B] -> [B].

        A_i = r_i - b_g,   b_g = sum_{j in g} |y_j| r_j / sum_{j in g} |y_j|

    |y_j| is response j's number of valid tokens: the baseline that minimises the gradient's variance when each
    sequence's gradient norm grows with its length. Not normalised. A group of one has baseline 0 (as verl's `opo`).
    """
    r = _sequence_scores(scores)
    index = _group_index(group_ids, r.numel(), r.device)
    n = lengths.to(r.dtype)
    count, _ = _group_stats(r, index)
    weight = torch.zeros_like(count).index_add_(0, index, n)
    baseline = torch.zeros_like(count).index_add_(0, index, n * r) / weight.clamp_min(torch.finfo(r.dtype).tiny)
    return r - torch.where(count > 1, baseline, torch.zeros_like(baseline))[index]


@torch.no_grad()
def compute_grpo_passk_advantages(scores: torch.Tensor, group_ids: torch.Tensor | Sequence[Hashable],
                                  eps: float = 1e-6, normalize_std: bool = True) -> torch.Tensor:
    """Pass@k advantages (Chen et al. 2025, "Pass@k Training for Adaptively Balancing Exploration and Exploitation
    of Large Reasoning Models", arXiv:2503.19595, as verl's `grpo_passk`): [B] -> [B].

        A_best = (r_max - r_second) / (std_g + eps),   A_i = 0 for every other sample of the group

    The group's k samples are rewarded as one attempt at the prompt: only the best one learns, by how far it leads
    the runner-up (a tie for the best gives 0). std_g is unbiased; normalize_std=False drops the
    division. Every group needs at least two samples.
    """
    r = _sequence_scores(scores)
    index = _group_index(group_ids, r.numel(), r.device)
    count, _ = _group_stats(r, index)
    if bool((count < 2).any()):
        raise ValueError("grpo_passk needs at least 2 samples in every group")
    advantages = torch.zeros_like(r)
    for g in range(count.numel()):
        rows = (index == g).nonzero().squeeze(-1)
        group = r[rows]
        top = torch.topk(group, 2)
        lead = top.values[0] - top.values[1]
        advantages[rows[top.indices[0]]] = lead / (group.std() + eps) if normalize_std else lead
    return advantages


@torch.no_grad()
def compute_gpg_advantages(scores: torch.Tensor, group_ids: torch.Tensor | Sequence[Hashable]) -> torch.Tensor:
    """GPG's advantages (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model
    Reasoning", arXiv:2504.02546, as verl's `gpg`): [B] -> [B].

        A_i = alpha (r_i - mean_g),   alpha = B / max(1, #{j : r_j != 0})

    alpha scales the batch's gradient up by the share of its responses that scored anything, so that groups whose
    samples all scored 0 (and so learn nothing) do not dilute the rest. Not divided by the group's std; a group of
    one has baseline 0.
    """
    r = _sequence_scores(scores)
    index = _group_index(group_ids, r.numel(), r.device)
    count, mean = _group_stats(r, index)
    alpha = r.numel() / max(int(torch.count_nonzero(r)), 1)
    return alpha * (r - torch.where(count > 1, mean, torch.zeros_like(mean))[index])


@torch.no_grad()
def compute_optimal_token_baseline_advantages(
    token_rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor | Sequence[Hashable],
    old_log_probs: torch.Tensor, sum_pi_squared: torch.Tensor, weights: torch.Tensor | None = None,
    eps: float = 1e-8,
) -> torch.Tensor:
    """The optimal token baseline's advantages (verl's `optimal_token_baseline`), [B, T]: a baseline for each
    position t of a group, weighing each response's return by how much its score function varied up to t.

        G_t = sum_{s >= t} r_s,   w_t = (1 - 2 pi_t + sum_v pi_v^2) rho_t^2,   W_t = sum_{s <= t} w_s
        B_t = sum_{i in g} G_it W_it / (sum_{i in g} W_it + eps),   A_t = (G_t - B_t) on the valid tokens

    pi_t is the old policy's probability of token t and 1 - 2 pi_t + sum_v pi_v^2 the squared norm of its log-prob's
    gradient with respect to the logits; rho_t the rollout importance weight (`weights`; 1 without). A group of one
    has baseline 0, and so do the positions of a group's longest response past its second longest (nothing else to
    compare them with).
    """
    returns = (token_rewards * mask).flip(-1).cumsum(-1).flip(-1)
    w = 1.0 - 2.0 * old_log_probs.exp() + sum_pi_squared
    if weights is not None:
        w = w * weights.square()
    w_path = (w * mask).cumsum(-1) * mask
    index = _group_index(group_ids, returns.shape[0], returns.device)
    count, _ = _group_stats(returns[:, 0], index)
    numerator = torch.zeros(count.numel(), returns.shape[1], dtype=returns.dtype,
                            device=returns.device).index_add_(0, index, returns * w_path)
    denominator = torch.zeros_like(numerator).index_add_(0, index, w_path) + eps
    baseline = torch.where((count > 1)[:, None], numerator / denominator, torch.zeros_like(numerator))[index]
    lengths = mask.sum(-1)
    longest = torch.zeros_like(count).scatter_reduce(0, index, lengths, "amax", include_self=False)
    at_longest = lengths == longest[index]
    shorter = torch.where(at_longest, torch.full_like(lengths, -1.0), lengths)
    second = torch.full_like(count, -1.0).scatter_reduce(0, index, shorter, "amax")
    lone_longest = at_longest & (torch.zeros_like(count).index_add_(0, index, at_longest.to(count))[index] == 1) & (
        count[index] > 1)
    tail = torch.arange(returns.shape[1], device=returns.device)[None, :] >= second[index][:, None]
    baseline = torch.where(lone_longest[:, None] & tail, torch.zeros_like(baseline), baseline)
    return (returns - baseline) * mask


@torch.no_grad()
def pf_ppo_weights(scores: torch.Tensor, method: str, power: float) -> torch.Tensor:
    """PF-PPO's sampling weight of each response by its score, [B] -> [B] (verl's compute_pf_ppo_reweight_data):

        pow: |r|^power     max_min: 1 where r is the batch's max or min, else 0     max_random: 0.4 at the max, else 0.1

    plus 1e-8, so that every row may be drawn."""
    if method == "pow":
        weights = scores.abs().pow(power)
    elif method == "max_min":
        weights = ((scores == scores.max()) | (scores == scores.min())).to(scores.dtype)
    elif method == "max_random":
        weights = torch.where(scores == scores.max(), 0.4, 0.1).to(scores.dtype)
    else:
        raise ValueError(f"unknown PF-PPO reweight method {method!r}: one of pow, max_min, max_random")
    return (weights + 1e-8).clamp(min=1e-8)


@torch.no_grad()
def compute_remax_advantages(token_rewards: torch.Tensor, baselines: torch.Tensor,
                             mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax's advantages (Li et al. 2024, "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method
    for Aligning Large Language Models", arXiv:2310.10505), all [B, T]:

        G_t = sum_{s >= t} r_s,   A_t = G_t - b          (on valid tokens; 0 elsewhere)

    b [B] is the reward of the greedy response to the same prompt: a baseline that needs no critic and no group,
    one more generation per prompt instead. Not normalised. Returns (advantages, returns).
    """
    returns = compute_discounted_returns(token_rewards, mask, 1.0)
    return returns - baselines.to(returns.dtype).unsqueeze(-1) * mask.to(returns.dtype), returns


# --------------------------------------------------------------------------------------------------
# losses
# --------------------------------------------------------------------------------------------------


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, agg: str, horizon: int | None = None) -> torch.Tensor:
    """Reduce a [B, T] loss matrix to a scalar.

        token-mean:              sum(L * mask) / sum(mask)
        seq-mean-token-sum:      mean_b  sum_t(L * mask)
        seq-mean-token-mean:     mean_b (sum_t(L * mask) / sum_t(mask))
        seq-mean-token-sum-norm: mean_b  sum_t(L * mask) / H

    The seq-mean modes average over sequences with at least one valid token. H (Dr. GRPO's constant
    normaliser, no bias towards short or long responses) is `horizon`, the longest response a rollout can
    give; None takes the matrix's width T, which a batch trimmed of its padding makes vary.
    """
    if agg == "token-mean":
        return masked_mean(loss_mat, mask)
    if agg in SEQ_MEAN_MODES:
        _, m = _as_weights(loss_mat, mask)
        per_seq = masked_sum(loss_mat, m, dim=-1)
        tokens = m.sum(dim=-1)
        if agg == "seq-mean-token-mean":
            per_seq = per_seq / tokens.clamp_min(1e-8)
        has_tokens = (tokens > 0).to(loss_mat.dtype)
        loss = masked_mean(per_seq, has_tokens)
        return loss / (horizon or loss_mat.shape[-1]) if agg == "seq-mean-token-sum-norm" else loss
    raise ValueError(f"unknown agg {agg!r}; expected one of {', '.join(AGG_MODES)}")


def token_advantages(advantages: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor:
    """[B] (one per sequence, broadcast over tokens) or [B, T] advantages as [B, T]."""
    if advantages.dim() == log_probs.dim() - 1:
        advantages = advantages.unsqueeze(-1)
    try:
        return advantages.expand_as(log_probs)
    except RuntimeError as exc:
        raise ValueError(
            f"advantages must be [B] or [B, T] for log_probs of shape {tuple(log_probs.shape)}, "
            f"got {tuple(advantages.shape)}"
        ) from exc


def token_log_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log(pi / pi_old) per token, clamped to +-20 so that exp() stays finite in float32, and the ratio itself."""
    log_ratio = torch.clamp(log_probs - old_log_probs, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return log_ratio, torch.exp(log_ratio)


def weighted(losses: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """Each token's loss times its weight w (behaviour_weights for a batch one version behind); None: w = 1."""
    return losses if weights is None else losses * weights


@torch.no_grad()
def ratio_metrics(log_ratio: torch.Tensor, ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """approx_kl, the k3 estimate of KL(pi_old || pi), mean(ratio - 1 - log ratio) >= 0; and ratio_mean."""
    return {"approx_kl": masked_mean(ratio - 1.0 - log_ratio, mask).item(),
            "ratio_mean": masked_mean(ratio, mask).item()}


@torch.no_grad()
def rollout_weights(trainer_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor,
                    level: str, upper: float, lower: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Importance weights from the rollout engine's policy mu to the trainer's pi for the same weights, [B, T]:

        token:     w_t = exp(log pi_t - log mu_t)
        sequence:  w_t = exp(sum_s (log pi_s - log mu_s))      (the response's product, on each of its tokens)

    log-ratios clamped to +-20 (as verl's rollout_is); then cut to `upper` (truncated IS), or, given `lower`, set to
    0 outside [lower, upper] (IcePop). 0 outside the mask. Metrics: rollout_weight_mean, and rollout_weight_cut_frac,
    the share of the valid tokens whose weight the bounds changed.
    """
    log_ratio = (trainer_log_probs - rollout_log_probs) * mask
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(mask)
    raw = torch.exp(torch.clamp(log_ratio, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)) * mask
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    return weights, {"rollout_weight_mean": masked_mean(weights, mask).item(),
                     "rollout_weight_cut_frac": masked_mean((weights != raw).to(raw.dtype), mask).item()}


def weight_mean_terms(weights: torch.Tensor, mask: torch.Tensor, level: str) -> tuple[float, float]:
    """(sum, count) whose ratio is the weights' mean, added up over ranks before dividing: over the valid tokens
    (`token`), or over the responses with one (`sequence`, whose tokens all carry the response's weight)."""
    if level == "sequence":
        rows = mask.sum(-1) > 0
        return float(masked_mean(weights, mask, dim=-1)[rows].sum()), float(rows.sum())
    return float((weights * mask).sum()), float(mask.sum())


def divided_by_mean(weights: torch.Tensor, total: float, count: float) -> tuple[torch.Tensor, float]:
    """The weights over their mean total / count (weight_mean_terms, summed over ranks), and that divisor; a mean
    of at most 1e-8 (no weight left) divides by 1."""
    mean = total / count if count else 0.0
    return (weights / mean, mean) if mean > 1e-8 else (weights, 1.0)


@torch.no_grad()
def rollout_rejection(trainer_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor,
                      rules: Sequence[tuple[str, float | None, float]]) -> tuple[torch.Tensor, dict[str, float]]:
    """The mask with what any rule rejects set to 0, [B, T] (verl's rollout_rs). Per token, with the log-ratio
    d = log mu - log pi of the engine's policy mu to the trainer's pi, clamped to +-20:

        k1 = d,   k2 = d^2 / 2,   k3 = exp(-d) - 1 + d

    A rule (name, lower, upper) is `token_kN`, or `seq_sum_kN`, `seq_mean_kN`, `seq_max_kN` over each response's
    valid tokens, rejecting the whole response. k1 keeps log lower <= value <= log upper; k2 and k3 value <= upper.
    Metrics: rollout_rejected_frac (of the valid tokens) and rollout_rejected_seq_frac (of the responses).
    """
    d = torch.clamp(rollout_log_probs - trainer_log_probs, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    token = {"k1": d, "k2": 0.5 * d * d, "k3": torch.expm1(-d) + d}
    valid = mask > 0
    keep = torch.ones_like(valid)
    for name, lower, upper in rules:
        level, divergence = name.rsplit("_", 1)
        value = token[divergence]
        if level == "seq_sum":
            value = (value * mask).sum(-1, keepdim=True)
        elif level == "seq_mean":
            value = masked_mean(value, mask, dim=-1).unsqueeze(-1)
        elif level == "seq_max":
            top = value.masked_fill(~valid, float("-inf")).amax(-1, keepdim=True)
            value = torch.where(torch.isinf(top), torch.zeros_like(top), top)
        kept = value <= upper if lower is None else (value >= math.log(lower)) & (value <= math.log(upper))
        keep &= kept.expand_as(valid)
    kept_mask = mask * keep.to(mask.dtype)
    rejected = valid & ~keep
    return kept_mask, {"rollout_rejected_frac": masked_mean(rejected.to(d.dtype), mask).item(),
                       "rollout_rejected_seq_frac": rejected.any(-1).to(d.dtype).mean().item()}


@torch.no_grad()
def rollout_kl(trainer_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor) -> float:
    """KL(mu || pi) of the rollout engine's policy mu to the trainer's pi, on mu's samples: the k3 estimate
    mean(r - 1 - log r), r = pi / mu, >= 0; 0 where both compute the same numbers. In float64: the gaps of
    interest are small enough that float32's r - 1 would be its rounding."""
    d = torch.clamp(trainer_log_probs.double() - rollout_log_probs.double(), -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return masked_mean(torch.expm1(d) - d, mask.double()).item()


@torch.no_grad()
def behaviour_weights(proximal_log_probs: torch.Tensor, behaviour_log_probs: torch.Tensor,
                      cap: float) -> torch.Tensor:
    """Truncated importance weights of off-policy tokens, [B, T]:  w = min(pi_prox / pi_behaviour, cap).

    Decoupled PPO (Hilton et al. 2021, "Batch size-invariance for policy optimization", arXiv:2110.00641):
    samples drawn by an older behaviour policy are clipped around the proximal policy (the one the update
    starts from) and weighed by w, so the trust region stays where the update is while the lag is corrected.
    The cap bounds the variance of the estimate, as truncated importance sampling does.
    """
    if not cap >= 1.0:
        raise ValueError(f"cap must be >= 1, got {cap}")
    log_ratio = torch.clamp(proximal_log_probs - behaviour_log_probs, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return torch.clamp(torch.exp(log_ratio), max=cap)


def ppo_policy_loss(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip_c: float | None = 3.0,
    agg: str = "token-mean",
    weights: torch.Tensor | None = None,
    horizon: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate with an asymmetric range and dual clip, per token then aggregated (agg_loss, `agg`
    and `horizon`).

        ratio = exp(logp - logp_old)
        L     = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))
        L     = min(L, -A * dual_clip_c)      where A < 0   (dual clip; dual_clip_c=None disables)
        L     = w * L                         (``weights`` w, e.g. behaviour_weights; None: w = 1)

    ``advantages`` is [B, T], or [B] for one advantage per sequence (broadcast over tokens).
    Metrics: clip_frac (tokens where the clipped term wins), dual_clip_frac (tokens bounded by the
    dual clip), ratio_mean, and approx_kl, the k3 estimate of KL(pi_old || pi):
    mean(ratio - 1 - log ratio), which is >= 0.
    """
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low and clip_high must be >= 0, got {clip_low} and {clip_high}")
    if dual_clip_c is not None and not dual_clip_c > 1.0:
        raise ValueError(f"dual_clip_c must be > 1 (or None to disable), got {dual_clip_c}")
    advantages = token_advantages(advantages, log_probs)

    log_ratio, ratio = token_log_ratio(log_probs, old_log_probs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    losses = torch.maximum(unclipped, clipped)

    if dual_clip_c is not None:
        bound = -advantages * dual_clip_c
        dual_hit = (advantages < 0) & (losses > bound)
        losses = torch.where(advantages < 0, torch.minimum(losses, bound), losses)
    else:
        dual_hit = torch.zeros_like(losses, dtype=torch.bool)
    losses = weighted(losses, weights)

    loss = agg_loss(losses, mask, agg, horizon)

    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean((clipped > unclipped).to(losses.dtype), mask).item(),
            **ratio_metrics(log_ratio, ratio, mask),
            "dual_clip_frac": masked_mean(dual_hit.to(losses.dtype), mask).item(),
        }
    return loss, metrics


def gspo_log_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's sequence-level log importance ratio in its token-level form, [B, T] -> [B, T].

        log s_i     = 1/|y_i| * sum_t (logp_{i,t} - logp_old_{i,t})        (valid tokens t of sequence i)
        log s_{i,t} = sg[log s_i] + logp_{i,t} - sg[logp_{i,t}]

    sg is stop-gradient. The value of log s_{i,t} is log s_i on every token of sequence i, and its
    gradient is that of logp_{i,t}: so s_{i,t} = s_i in value while d s_{i,t} = s_i * d logp_{i,t},
    which after the sequence-mean aggregation gives GSPO's gradient s_i/|y_i| * sum_t grad logp_{i,t}
    (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071, the GSPO-token form with
    one advantage per sequence). Length normalisation keeps s_i in a range one clip fits for any |y_i|.
    A sequence with no valid token gets log s_i = 0.
    """
    m = mask.to(log_probs.dtype)
    lengths = m.sum(dim=-1).clamp_min(1.0)
    seq = ((log_probs - old_log_probs) * m).sum(dim=-1) / lengths
    return seq.detach().unsqueeze(-1) + log_probs - log_probs.detach()


def gspo_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """s_{i,t} = exp(min(log s_{i,t}, 10)), [B, T]: the sequence ratio (pi/pi_old)^(1/|y_i|) on each token.

    See gspo_log_ratio for log s_{i,t}; the clamp keeps exp() finite (a ratio above e^10 is clipped anyway).
    """
    return torch.exp(torch.clamp(gspo_log_ratio(log_probs, old_log_probs, mask), max=_GSPO_LOG_RATIO_MAX))


def gspo_policy_loss(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    agg: str = "seq-mean-token-mean",
    weights: torch.Tensor | None = None,
    horizon: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO's clipped surrogate on the sequence-level ratio (Zheng et al. 2025, arXiv:2507.18071).

        s   = gspo_ratio(logp, logp_old)          (one value per sequence, on each of its tokens)
        L   = max(-A * s, -A * clip(s, 1 - clip_low, 1 + clip_high))
        L   = w * L                               (``weights`` w, as ppo_policy_loss)

    Whole sequences are clipped, not tokens; there is no dual clip. The paper's objective averages over
    sequences, ``agg="seq-mean-token-mean"`` (the default); as in verl, any of AGG_MODES may be asked.
    The paper's clip ranges are far smaller than PPO's (3e-4 and 4e-4) because s is a per-token
    geometric mean. ``advantages`` is [B] or [B, T]. Metrics as ppo_policy_loss: clip_frac (tokens
    of clipped sequences), approx_kl (token-level k3 estimate of KL(pi_old || pi)), ratio_mean (mean of
    s over sequences), dual_clip_frac (always 0).
    """
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low and clip_high must be >= 0, got {clip_low} and {clip_high}")
    advantages = token_advantages(advantages, log_probs)
    ratio = gspo_ratio(log_probs, old_log_probs, mask)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    losses = torch.maximum(unclipped, clipped)
    loss = agg_loss(weighted(losses, weights), mask, agg, horizon)

    with torch.no_grad():
        log_ratio, token_ratio = token_log_ratio(log_probs, old_log_probs)
        metrics = {
            "clip_frac": masked_mean((clipped > unclipped).to(losses.dtype), mask).item(),
            "approx_kl": masked_mean(token_ratio - 1.0 - log_ratio, mask).item(),
            "ratio_mean": agg_loss(ratio, mask, "seq-mean-token-mean").item(),
            "dual_clip_frac": 0.0,
        }
    return loss, metrics


def value_loss(
    pred_values: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None = 0.5,
    agg: str = "token-mean",
    horizon: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss, per token then aggregated (agg_loss, `agg` and `horizon`).

        V_clip = V_old + clip(V - V_old, -clip, +clip)
        L      = 0.5 * max((V - R)^2, (V_clip - R)^2)      (clip=None: L = 0.5 * (V - R)^2)

    Metrics: vf_clip_frac (tokens where the clipped term wins) and value_mean.
    """
    if clip is not None and not clip > 0:
        raise ValueError(f"clip must be > 0, or None to disable value clipping, got {clip}")
    unclipped = (pred_values - returns) ** 2
    if clip is None:
        losses = 0.5 * unclipped
        clip_hit = torch.zeros_like(unclipped, dtype=torch.bool)
    else:
        clipped_values = old_values + torch.clamp(pred_values - old_values, -clip, clip)
        clipped = (clipped_values - returns) ** 2
        losses = 0.5 * torch.maximum(unclipped, clipped)
        clip_hit = clipped > unclipped

    loss = agg_loss(losses, mask, agg, horizon)

    with torch.no_grad():
        metrics = {
            "vf_clip_frac": masked_mean(clip_hit.to(losses.dtype), mask).item(),
            "value_mean": masked_mean(pred_values, mask).item(),
        }
    return loss, metrics


# --------------------------------------------------------------------------------------------------
# KL and rewards
# --------------------------------------------------------------------------------------------------


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi; k1 = logp - logp_ref.

    kl:         k1
    abs:        |k1|
    mse:        0.5 * k1^2
    low_var_kl: k3 = exp(-k1) + k1 - 1 = exp(ref - logp) - (ref - logp) - 1, clamped to [-10, 10]
    """
    k1 = log_probs - ref_log_probs
    if kind == "kl":
        return k1
    if kind == "abs":
        return k1.abs()
    if kind == "mse":
        return 0.5 * k1.square()
    if kind == "low_var_kl":
        d = torch.clamp(-k1, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        return torch.clamp(torch.exp(d) - d - 1.0, -10.0, 10.0)
    raise ValueError(f"unknown KL kind {kind!r}; expected one of {', '.join(KL_KINDS)}")


@torch.no_grad()
def apply_kl_to_rewards(
    token_scores: torch.Tensor,
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    kind: str,
) -> tuple[torch.Tensor, float]:
    """Per-token KL-penalized rewards: r_t = score_t - coef * kl_t, 0 outside the mask.

    kl_mean = mean over sequences of each sequence's token-mean kl (sequences with at least one
    valid token); the number to feed a KL controller.
    """
    valid = mask.bool()
    kl = kl_penalty(log_probs, ref_log_probs, kind)
    kl = torch.where(valid, kl, torch.zeros_like(kl))
    rewards = token_scores - coef * kl
    rewards = torch.where(valid, rewards, torch.zeros_like(rewards))
    kl_mean = agg_loss(kl, mask, "seq-mean-token-mean").item()
    return rewards, kl_mean


def scores_to_token_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's scalar score on its last valid token: [B], [B, T] -> [B, T].

    r[b, t] = scores[b] if t is the last t with mask[b, t] = 1, else 0. Rows with no valid
    token stay 0.
    """
    if scores.dim() != 1 or scores.shape[0] != mask.shape[0]:
        raise ValueError(f"scores must be [B] with B = {mask.shape[0]}, got shape {tuple(scores.shape)}")
    dtype = scores.dtype if scores.is_floating_point() else torch.float32
    valid = mask.bool()
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(valid)
    last = torch.where(valid, positions, torch.full_like(positions, -1)).max(dim=-1).values
    rewards = torch.zeros(mask.shape, dtype=dtype, device=scores.device)
    rows = torch.nonzero(last >= 0, as_tuple=True)[0]
    rewards[rows, last[rows]] = scores[rows].to(dtype)
    return rewards


# --------------------------------------------------------------------------------------------------
# KL coefficient controllers
# --------------------------------------------------------------------------------------------------


class FixedKLController:
    """A constant KL coefficient: value = coef."""

    def __init__(self, coef: float) -> None:
        if coef < 0:
            raise ValueError(f"coef must be >= 0, got {coef}")
        self.value: float = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient never changes."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional KL coefficient controller (Ziegler et al., 2019).

        err    = clip(current_kl / target_kl - 1, -0.2, 0.2)
        value *= 1 + err * n_steps / horizon

    Only ``value`` is state; target_kl and horizon come from the configuration.
    """

    def __init__(self, init_coef: float, target_kl: float, horizon: float) -> None:
        if init_coef < 0:
            raise ValueError(f"init_coef must be >= 0, got {init_coef}")
        if not target_kl > 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if not horizon > 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value: float = float(init_coef)
        self.target_kl = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        if not math.isfinite(current_kl):
            raise ValueError(f"current_kl must be finite, got {current_kl}")
        err = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
