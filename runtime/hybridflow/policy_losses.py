"""The policy losses besides PPO's clipped surrogate and GSPO (hybridflow.algos), under verl's loss_mode names:
CISPO, GPG, SAPO, GMPO (geo_mean), Clip-Cov, KL-Cov, DPPO (dppo_tv, dppo_kl) and DRO. Pure functions on [B, T]
tensors, as in algos.

Each takes the update's log-probs `log_probs` (with their graph), the old ones, the advantages ([B] or [B, T]) and
the response mask, and returns the aggregated loss (algos.agg_loss with `agg` and `horizon`) and its metrics:
approx_kl (the k3 estimate of KL(pi_old || pi)) and ratio_mean always, clip_frac where something is clipped, and
cov_frac, the share of the valid tokens the covariance rules picked. `weights` multiplies each token's loss
(algos.behaviour_weights for a batch one version behind), as in ppo_policy_loss.
"""

from __future__ import annotations

from typing import Literal

import torch

from hybridflow.algos import agg_loss, masked_mean, ratio_metrics, token_advantages, token_log_ratio, weighted


def cispo_policy_loss(old_log_probs: torch.Tensor, log_probs: torch.Tensor, advantages: torch.Tensor,
                      mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2, agg: str = "token-mean",
                      weights: torch.Tensor | None = None,
                      horizon: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, arXiv:2506.13585): the importance weight is clipped, not the update, so every token keeps
    its gradient:

        L = -sg(clip(ratio, 1 - clip_low, 1 + clip_high)) * A * log pi

    sg is stop-gradient. clip_frac: the tokens whose weight was clipped.
    """
    advantages = token_advantages(advantages, log_probs)
    log_ratio, ratio = token_log_ratio(log_probs, old_log_probs)
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    losses = -clipped.detach() * advantages * log_probs
    loss = agg_loss(weighted(losses, weights), mask, agg, horizon)
    with torch.no_grad():
        clip_frac = masked_mean((clipped != ratio).to(losses.dtype), mask).item()
    return loss, {"clip_frac": clip_frac} | ratio_metrics(log_ratio, ratio, mask)


def gpg_policy_loss(old_log_probs: torch.Tensor, log_probs: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, agg: str = "token-mean", weights: torch.Tensor | None = None,
                    horizon: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """GPG (Chu et al. 2025, arXiv:2504.02546): the plain policy gradient, no ratio and no clip:

        L = -A * log pi

    The old log-probs serve the metrics alone.
    """
    advantages = token_advantages(advantages, log_probs)
    losses = -advantages * log_probs
    log_ratio, ratio = token_log_ratio(log_probs.detach(), old_log_probs)
    return agg_loss(weighted(losses, weights), mask, agg, horizon), ratio_metrics(log_ratio, ratio, mask)


def sapo_policy_loss(old_log_probs: torch.Tensor, log_probs: torch.Tensor, advantages: torch.Tensor,
                     mask: torch.Tensor, tau_pos: float = 1.0, tau_neg: float = 1.05,
                     agg: str = "seq-mean-token-mean", weights: torch.Tensor | None = None,
                     horizon: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """SAPO (Gao et al. 2025, arXiv:2511.20347): a soft gate on the ratio in place of the hard clip,

        L = -A * (4 / tau) * sigmoid(tau * (ratio - 1)),      tau = tau_pos where A > 0, else tau_neg

    whose gradient is PPO's on-policy (ratio 1) and fades smoothly as the ratio leaves 1 (faster for negative
    advantages when tau_neg > tau_pos). The paper aggregates with seq-mean-token-mean.
    """
    advantages = token_advantages(advantages, log_probs)
    log_ratio, ratio = token_log_ratio(log_probs, old_log_probs)
    tau = torch.where(advantages > 0, tau_pos, tau_neg).to(ratio.dtype)
    losses = -advantages * (4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0))
    return agg_loss(weighted(losses, weights), mask, agg, horizon), ratio_metrics(log_ratio, ratio, mask)


def geo_mean_policy_loss(old_log_probs: torch.Tensor, log_probs: torch.Tensor, advantages: torch.Tensor,
                         mask: torch.Tensor, clip_low: float = 0.4, clip_high: float = 0.4,
                         weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """GMPO (Zhao et al. 2025, arXiv:2507.20673): the geometric mean of a sequence's token ratios in place of their
    arithmetic mean, so one outlying token moves it less; each token's log-ratio d is clipped in log space, on the
    side its advantage's sign s makes pessimistic:

        d' = s * min(s * d, s * clip(d, -clip_low, clip_high))
        L  = mean_b  -A_b * exp(mean_t d'_t)                  (A_b: the sequence's mean advantage)

    Sequences, not tokens, are averaged, so lossAgg does not apply; `weights` enter as their geometric mean per
    sequence. clip_frac: the tokens whose log-ratio was clipped.
    """
    advantages = token_advantages(advantages, log_probs)
    m = mask.to(log_probs.dtype)
    lengths = m.sum(dim=-1) + 1e-8
    log_ratio = log_probs - old_log_probs
    clipped = torch.clamp(log_ratio, -clip_low, clip_high)
    sign = torch.sign(advantages)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clipped)
    ratio = torch.exp((pessimistic * m).sum(dim=-1) / lengths)
    losses = -(advantages * m).sum(dim=-1) / lengths * ratio
    if weights is not None:
        losses = losses * torch.exp((torch.log(weights + 1e-10) * m).sum(dim=-1) / lengths)
    with torch.no_grad():
        token_log_ratios, token_ratios = token_log_ratio(log_probs, old_log_probs)
        clip_frac = masked_mean(((log_ratio != clipped) & (sign != 0)).to(m.dtype), mask).item()
    return losses.mean(), {"clip_frac": clip_frac} | ratio_metrics(token_log_ratios, token_ratios, mask)


@torch.no_grad()
def token_covariance(advantages: torch.Tensor, log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """c = (A - mean A) * (log pi - mean log pi) per token, the means over the valid tokens (Cui et al. 2025,
    arXiv:2505.22617: the tokens of largest c drive the entropy down)."""
    return (advantages - masked_mean(advantages, mask)) * (log_probs - masked_mean(log_probs, mask))


def _picked(valid: torch.Tensor, share: float) -> int:
    """How many tokens a covariance rule picks: `share` of the valid ones, at least one."""
    return max(int(share * int(valid.sum())), 1)


def clip_cov_policy_loss(old_log_probs: torch.Tensor, log_probs: torch.Tensor, advantages: torch.Tensor,
                         mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2,
                         share: float = 0.0002, lower: float = 1.0, upper: float = 5.0,
                         generator: torch.Generator | None = None, agg: str = "token-mean",
                         weights: torch.Tensor | None = None,
                         horizon: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Clip-Cov (Cui et al. 2025, arXiv:2505.22617): PPO's clipped surrogate (no dual clip), and the loss of `share`
    of the valid tokens (at least one), drawn with `generator` among those the clip left alone whose covariance c
    (token_covariance) lies strictly between `lower` and `upper`, is cut to 0 with its gradient.

    clip_frac: the tokens where the clipped term wins; cov_frac: the tokens cut.
    """
    advantages = token_advantages(advantages, log_probs)
    log_ratio, ratio = token_log_ratio(log_probs, old_log_probs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    valid = mask > 0
    clip_wins = (clipped > unclipped) & valid
    c = token_covariance(advantages, log_probs, mask)
    candidates = torch.nonzero(valid & ~clip_wins & (c > lower) & (c < upper))
    order = torch.randperm(len(candidates), generator=generator).to(candidates.device)
    cut = candidates[order[:_picked(valid, share)]]
    keep = torch.ones_like(unclipped)
    keep[cut[:, 0], cut[:, 1]] = 0.0
    losses = torch.maximum(unclipped, clipped) * keep
    loss = agg_loss(weighted(losses, weights), mask, agg, horizon)
    with torch.no_grad():
        metrics = {"clip_frac": masked_mean(clip_wins.to(losses.dtype), mask).item(),
                   "cov_frac": masked_mean((keep == 0).to(losses.dtype), mask).item()}
    return loss, metrics | ratio_metrics(log_ratio, ratio, mask)


def kl_cov_policy_loss(old_log_probs: torch.Tensor, log_probs: torch.Tensor, advantages: torch.Tensor,
                       mask: torch.Tensor, share: float = 0.0002, coef: float = 0.1, agg: str = "token-mean",
                       weights: torch.Tensor | None = None,
                       horizon: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-Cov (Cui et al. 2025, arXiv:2505.22617): the unclipped surrogate, and on `share` of the valid tokens (at
    least one), those of largest covariance c (token_covariance), a penalty on their move:

        L = -A * ratio + [token picked] * coef * |log pi - log pi_old|

    cov_frac: the tokens penalised.
    """
    advantages = token_advantages(advantages, log_probs)
    log_ratio, ratio = token_log_ratio(log_probs, old_log_probs)
    losses = -advantages * ratio
    valid = mask > 0
    picked = torch.zeros_like(valid)
    if valid.any():
        c = token_covariance(advantages, log_probs, mask).masked_fill(~valid, -torch.inf)
        top = torch.topk(c.flatten(), _picked(valid, share)).indices
        picked.view(-1)[top] = True
        losses = torch.where(picked, losses + coef * (log_probs - old_log_probs).abs(), losses)
    loss = agg_loss(weighted(losses, weights), mask, agg, horizon)
    with torch.no_grad():
        cov_frac = masked_mean(picked.to(losses.dtype), mask).item()
    return loss, {"cov_frac": cov_frac} | ratio_metrics(log_ratio, ratio, mask)


BINARY_KL_EPS = 1e-8
"""Keeps log(1 - p) finite at p = 1 in the binary KL, as verl's dppo_kl does."""


def dppo_policy_loss(old_log_probs: torch.Tensor, log_probs: torch.Tensor, advantages: torch.Tensor,
                     mask: torch.Tensor, divergence: Literal["tv", "kl"], low: float = 0.2, high: float = 0.2,
                     truncate: float | None = 3.0, agg: str = "token-mean", weights: torch.Tensor | None = None,
                     horizon: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO (arXiv:2602.04879): the trust region bounds how far each sampled token's probability p moved from p_old,
    not the ratio, so rare tokens (small p_old, large ratios for small moves) keep learning:

        L = -A * sg(min(ratio, truncate)) * log pi * valid

    valid where A > 0: p - p_old <= high (`tv`), or KL_bin(p_old || p) <= high or p <= p_old (`kl`); where A <= 0:
    p_old - p <= low, or KL_bin <= low or p >= p_old. KL_bin(q || p) = q log(q/p) + (1-q) log((1-q)/(1-p)) is the
    KL of the two Bernoulli distributions "this token or another". The truncated, stop-gradient ratio stands in for
    PPO's dual clip (None: not truncated). clip_frac: the tokens outside the region.
    """
    advantages = token_advantages(advantages, log_probs)
    log_ratio, ratio = token_log_ratio(log_probs, old_log_probs)
    is_weight = ratio if truncate is None else torch.clamp(ratio, max=truncate)
    with torch.no_grad():
        p, q = log_probs.exp(), old_log_probs.exp()
        if divergence == "tv":
            up, down = p - q <= high, q - p <= low
        else:
            kl = q * (old_log_probs - log_probs) + (1 - q) * torch.log(
                (1 - q + BINARY_KL_EPS) / (1 - p + BINARY_KL_EPS))
            up, down = (kl <= high) | (p <= q), (kl <= low) | (p >= q)
        valid = torch.where(advantages > 0, up, down).to(log_probs.dtype)
    losses = -advantages * is_weight.detach() * log_probs * valid
    loss = agg_loss(weighted(losses, weights), mask, agg, horizon)
    with torch.no_grad():
        clip_frac = masked_mean(1.0 - valid, mask).item()
    return loss, {"clip_frac": clip_frac} | ratio_metrics(log_ratio, ratio, mask)


def dro_policy_loss(old_log_probs: torch.Tensor, log_probs: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, beta: float, agg: str = "token-mean", weights: torch.Tensor | None = None,
                    horizon: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """DRO's loss as verl's `dro` (Richemond et al. 2024, "Offline Regularised Reinforcement Learning for Large
    Language Models Alignment", arXiv:2405.19107): the policy gradient with a quadratic pull back to pi_old,

        L = -(A * log pi - beta / 2 * (log pi - log pi_old)^2)

    no ratio and no clip: the penalty, not a trust region, keeps the update near the policy that sampled.
    """
    advantages = token_advantages(advantages, log_probs)
    log_ratio, ratio = token_log_ratio(log_probs, old_log_probs)
    losses = -(advantages * log_probs - 0.5 * beta * (log_probs - old_log_probs).square())
    return agg_loss(weighted(losses, weights), mask, agg, horizon), ratio_metrics(log_ratio, ratio, mask)
