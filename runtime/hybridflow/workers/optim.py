"""The epoch/minibatch loop every trained role shares; each role brings its own loss."""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridflow.api.spec import Training
from hybridflow.workers import distributed
from hybridflow.workers.batch import RolloutBatch
from hybridflow.workers.modeling import minibatch_chunks
from hybridflow.workers.training import RoleTraining

MinibatchLoss = Callable[[RolloutBatch], tuple[torch.Tensor, dict[str, float]]]
"""A minibatch -> (loss to minimise, scalar metrics of it)."""


def micro_weight(mask: torch.Tensor, whole: torch.Tensor, agg: str) -> float:
    """A micro-batch's share of its minibatch's loss, so that sum_k w_k * loss_k is the minibatch's loss:
    token-mean weighs by valid tokens, the seq-mean modes by sequences with a valid token (algos.agg_loss)."""
    if agg == "token-mean":
        num, den = float(mask.sum()), float(whole.sum())
    else:
        num, den = float((mask.sum(-1) > 0).sum()), float((whole.sum(-1) > 0).sum())
    return num / den if den > 0 else 0.0


def train_epochs(training: RoleTraining, batch: RolloutBatch, loss_fn: MinibatchLoss, *, epochs: int,
                 steps_per_epoch: int, shuffle: torch.Generator, max_grad_norm: float, device: torch.device,
                 limits: Training | None = None, agg: str = "token-mean") -> dict[str, float]:
    """`epochs` passes of `steps_per_epoch` optimiser steps over shuffled minibatches of this rank's shard.

    A minibatch runs in micro-batches whose gradients add up, each loss weighted by its share (`micro_weight`),
    to the minibatch's gradient: passes of at most `limits.micro_batch_size` rows and `limits.micro_batch_tokens`
    tokens, taken in length order (RolloutBatch.passes), each on its rows `trimmed` of their shared padding.
    Every rank takes the same number of steps, so collectives always match. Returns each metric's mean over the
    non-empty minibatches plus `grad_norm`, the mean pre-clip gradient norm over all steps, averaged over ranks.
    The inference copy is released for the steps (RoleTraining.release) and holds the trained weights again
    when this returns, where the role keeps it (RoleTraining.finish_update).
    """
    limits = limits or Training()
    training.release()
    training.module.train()
    sums: dict[str, float] = {}
    count = 0
    grad_norm = 0.0
    for _ in range(epochs):
        for idx in minibatch_chunks(len(batch), steps_per_epoch, shuffle):
            training.zero_grad()
            whole = batch.slice_index(idx).response_mask if len(idx) else None
            parts: list[torch.Tensor | None] = list(batch.passes(idx, limits.micro_batch_size,
                                                                 limits.micro_batch_tokens))
            if training.sharded:
                parts += [None] * (distributed.most_passes(len(parts), device) - len(parts))
            for part in parts:
                if part is None or whole is None:  # a pass for the collectives alone
                    loss, _ = loss_fn(batch.slice_index(torch.arange(1)).trimmed())
                    (loss * 0.0).backward()
                    continue
                mb = batch.slice_index(part).trimmed()
                w = micro_weight(mb.response_mask, whole, agg)
                loss, metrics = loss_fn(mb)
                (loss * w).backward()
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + w * v
            count += int(len(idx) > 0)
            grad_norm += training.step(max_grad_norm)
    training.finish_update()
    out = {k: v / max(count, 1) for k, v in sums.items()}
    out["grad_norm"] = grad_norm / max(1, epochs * steps_per_epoch)
    return distributed.average_scalars(out, device)
