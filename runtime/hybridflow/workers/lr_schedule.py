"""The learning rate of each training step (spec.trainer.optimizer): a linear warm-up, then constant or a cosine."""

from __future__ import annotations

import math

from hybridflow.api.spec import Optimizer, Trainer


def lr_factor(step: int, total_steps: int, optimizer: Optimizer) -> float:
    """The share of the base learning rate that training step `step` (from 0) trains at.

    Warm-up, the first W steps: (step + 1) / W. After it, constant: 1; cosine: r + (1 - r) * (1 + cos(pi * p)) / 2,
    p = (step - W) / (total_steps - W) the share of the steps after the warm-up already taken, r = minLrRatio.
    """
    warmup = optimizer.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    if optimizer.schedule == "constant":
        return 1.0
    p = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    r = optimizer.min_lr_ratio
    return r + (1.0 - r) * 0.5 * (1.0 + math.cos(math.pi * p))


def learning_rate(base: float, step: int, trainer: Trainer, start: int = 0) -> float:
    """The learning rate of training step `step` (from 0) for a role whose spec'd rate is `base` and whose schedule
    runs over steps [start, totalSteps): the actor's starts after the critic's warm-up (trainer.criticWarmupSteps)."""
    return base * lr_factor(step - start, trainer.total_steps - start, trainer.optimizer)
