"""spec.algorithm.rolloutCorrection as tensors: from the trainer's and the rollout engine's log-probs of the same
tokens, each token's importance weight and the mask less what rejection sampling drops. One rule for the actor's
update and for the advantages that weigh by them (optimal_token_baseline)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridflow import algos
from hybridflow.api.spec import RolloutCorrection

Summed = Callable[[dict[str, float]], dict[str, float]]
"""Numbers added up (or averaged alike) over the ranks that share a batch; the identity where one holds it whole."""


def corrected(rc: RolloutCorrection, trainer_log_probs: torch.Tensor, engine_log_probs: torch.Tensor,
              mask: torch.Tensor, summed: Summed | None = None
              ) -> tuple[torch.Tensor | None, torch.Tensor | None, dict[str, float]]:
    """(weights, kept mask, metrics), [B, T] each; None where rc asks for no importance sampling (weights) or no
    rejection (mask). With batchNormalize the weights are divided by their mean over the batch, whose parts
    `summed` adds up over ranks (the ratio of two averages is the ratio of the two sums)."""
    weights: torch.Tensor | None = None
    kept: torch.Tensor | None = None
    metrics: dict[str, float] = {}
    if rc.importance_sampling != "none":
        weights, metrics = algos.rollout_weights(trainer_log_probs, engine_log_probs, mask, rc.importance_sampling,
                                                 rc.threshold, rc.lower_threshold)
        if rc.batch_normalize:
            total, count = algos.weight_mean_terms(weights, mask, rc.importance_sampling)
            if summed is not None:
                sums = summed({"total": total, "count": count})
                total, count = sums["total"], sums["count"]
            weights, metrics["rollout_weight_norm_factor"] = algos.divided_by_mean(weights, total, count)
    if rc.rejection_sampling:
        kept, rejected = algos.rollout_rejection(trainer_log_probs, engine_log_probs, mask,
                                                 [(r.divergence, *r.band()) for r in rc.rejection_sampling])
        metrics |= rejected
    return weights, kept, metrics
