"""What training a model costs in memory: trainable parameters, optimizer state, and the weights a rank holds."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from hybridflow.workers.training import held_bytes, parameter_counts


@dataclass(frozen=True)
class TrainingFootprint:
    """Measured on a live model and optimizer (Adam's state exists once it has taken a step).

    Adam keeps two moments per trainable value, so optimizer_state_bytes ~= 2 * trainable_params * 4 for float32
    moments, plus one step counter per parameter tensor.
    """

    trainable_params: int
    total_params: int
    optimizer_state_bytes: int
    model_bytes: int
    """The model's parameters as this rank holds them now: a sharded role's released copy counts nothing."""

    def record(self, prefix: str) -> dict[str, float]:
        """As metrics: `{prefix}_trainable_params`, `{prefix}_total_params`, ... one for each field."""
        return {f"{prefix}_{k}": float(v) for k, v in asdict(self).items()}


def training_footprint(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                       counts: tuple[int, int] | None = None) -> TrainingFootprint:
    """Counts parameters that require grad, all parameters, and the bytes of every tensor in the optimizer's state
    that this rank holds (its shard of a sharded tensor). `counts` gives the first two where the model's tensors
    do not show them (a released copy: RoleTraining.parameter_counts)."""
    trainable, total = counts or parameter_counts(model)
    state = held_bytes(v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    return TrainingFootprint(trainable, total, state, held_bytes(model.parameters()))
