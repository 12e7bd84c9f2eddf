"""The epoch/minibatch loop every trained role shares; each role brings its own loss."""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridflow.workers import distributed
from hybridflow.workers.batch import RolloutBatch
from hybridflow.workers.modeling import minibatch_chunks

MinibatchLoss = Callable[[RolloutBatch], tuple[torch.Tensor, dict[str, float]]]
"""A minibatch -> (loss to minimise, scalar metrics of it)."""


def train_epochs(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: RolloutBatch,
                 loss_fn: MinibatchLoss, *, epochs: int, steps_per_epoch: int, shuffle: torch.Generator,
                 max_grad_norm: float, device: torch.device) -> dict[str, float]:
    """`epochs` passes of `steps_per_epoch` optimiser steps over shuffled minibatches of this rank's shard.

    Every rank takes the same number of steps (an empty minibatch still joins the gradient all-reduce),
    so collectives always match. Returns each metric's mean over the non-empty minibatches plus
    `grad_norm`, the mean pre-clip gradient norm over all steps, averaged over ranks.
    """
    model.train()
    sums: dict[str, float] = {}
    count = 0
    grad_norm = 0.0
    for _ in range(epochs):
        for idx in minibatch_chunks(len(batch), steps_per_epoch, shuffle):
            optimizer.zero_grad(set_to_none=False)
            if len(idx) > 0:
                loss, metrics = loss_fn(batch.slice_index(idx))
                loss.backward()
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + v
                count += 1
            distributed.average_gradients(model)
            grad_norm += float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm))
            optimizer.step()
    out = {k: v / max(count, 1) for k, v in sums.items()}
    out["grad_norm"] = grad_norm / max(1, epochs * steps_per_epoch)
    return distributed.average_scalars(out, device)
