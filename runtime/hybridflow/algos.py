"""PPO and GRPO math as pure functions on torch tensors.

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
    "compute_gae",
    "compute_grpo_advantages",
    "entropy_from_logits",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "ppo_policy_loss",
    "scores_to_token_rewards",
    "value_loss",
]

AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
KL_KINDS: tuple[str, ...] = ("kl", "abs", "mse", "low_var_kl")

# exp() of a log-ratio beyond this is inf or 0 in float32; clamping keeps losses finite.
_LOG_RATIO_CLAMP = 20.0


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
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D [B], got shape {tuple(scores.shape)}")
    r = scores if scores.is_floating_point() else scores.float()
    index = _group_index(group_ids, r.numel(), r.device)
    num_groups = int(index.max().item()) + 1 if index.numel() else 0

    count = torch.zeros(num_groups, dtype=r.dtype, device=r.device).index_add_(0, index, torch.ones_like(r))
    total = torch.zeros_like(count).index_add_(0, index, r)
    mean = total / count
    centered = r - mean[index]
    if not normalize_std:
        advantages = centered
    else:
        sq = torch.zeros_like(count).index_add_(0, index, centered**2)
        std = torch.sqrt(sq / (count - 1).clamp_min(1.0))
        advantages = centered / (std[index] + eps)
    return torch.where(count[index] > 1, advantages, torch.zeros_like(advantages))


# --------------------------------------------------------------------------------------------------
# losses
# --------------------------------------------------------------------------------------------------


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, agg: str) -> torch.Tensor:
    """Reduce a [B, T] loss matrix to a scalar.

        token-mean:          sum(L * mask) / sum(mask)
        seq-mean-token-sum:  mean_b  sum_t(L * mask)
        seq-mean-token-mean: mean_b (sum_t(L * mask) / sum_t(mask))

    The seq-mean modes average over sequences with at least one valid token.
    """
    if agg == "token-mean":
        return masked_mean(loss_mat, mask)
    if agg in ("seq-mean-token-sum", "seq-mean-token-mean"):
        _, m = _as_weights(loss_mat, mask)
        per_seq = masked_sum(loss_mat, m, dim=-1)
        tokens = m.sum(dim=-1)
        if agg == "seq-mean-token-mean":
            per_seq = per_seq / tokens.clamp_min(1e-8)
        has_tokens = (tokens > 0).to(loss_mat.dtype)
        return masked_mean(per_seq, has_tokens)
    raise ValueError(f"unknown agg {agg!r}; expected one of {', '.join(AGG_MODES)}")


def ppo_policy_loss(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip_c: float | None = 3.0,
    agg: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate with an asymmetric range and dual clip, per token then aggregated.

        ratio = exp(logp - logp_old)
        L     = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))
        L     = min(L, -A * dual_clip_c)      where A < 0   (dual clip; dual_clip_c=None disables)

    ``advantages`` is [B, T], or [B] for one advantage per sequence (broadcast over tokens).
    Metrics: clip_frac (tokens where the clipped term wins), dual_clip_frac (tokens bounded by the
    dual clip), ratio_mean, and approx_kl, the k3 estimate of KL(pi_old || pi):
    mean(ratio - 1 - log ratio), which is >= 0.
    """
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low and clip_high must be >= 0, got {clip_low} and {clip_high}")
    if dual_clip_c is not None and not dual_clip_c > 1.0:
        raise ValueError(f"dual_clip_c must be > 1 (or None to disable), got {dual_clip_c}")
    if advantages.dim() == log_probs.dim() - 1:
        advantages = advantages.unsqueeze(-1)
    try:
        advantages = advantages.expand_as(log_probs)
    except RuntimeError as exc:
        raise ValueError(
            f"advantages must be [B] or [B, T] for log_probs of shape {tuple(log_probs.shape)}, "
            f"got {tuple(advantages.shape)}"
        ) from exc

    log_ratio = torch.clamp(log_probs - old_log_probs, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    losses = torch.maximum(unclipped, clipped)

    if dual_clip_c is not None:
        bound = -advantages * dual_clip_c
        dual_hit = (advantages < 0) & (losses > bound)
        losses = torch.where(advantages < 0, torch.minimum(losses, bound), losses)
    else:
        dual_hit = torch.zeros_like(losses, dtype=torch.bool)

    loss = agg_loss(losses, mask, agg)

    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean((clipped > unclipped).to(losses.dtype), mask).item(),
            "approx_kl": masked_mean(ratio - 1.0 - log_ratio, mask).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
            "dual_clip_frac": masked_mean(dual_hit.to(losses.dtype), mask).item(),
        }
    return loss, metrics


def value_loss(
    pred_values: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None = 0.5,
    agg: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss, per token then aggregated.

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

    loss = agg_loss(losses, mask, agg)

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
