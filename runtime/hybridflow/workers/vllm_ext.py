"""Methods vLLM mixes into each of its workers (LLM(worker_extension_cls=...)), called by name through
`LLM.collective_rpc`: the arguments are plain lists and one byte tensor, so nothing executable is sent.

Imports no vLLM: the worker process that loads this class has it already.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hybridflow.workers.reshard import unpack


class WeightLoader:
    """`self` is a vLLM worker: `self.model_runner.model` is the model it generates with."""

    model_runner: Any

    @torch.no_grad()
    def load_bucket(self, names: Sequence[str], shapes: Sequence[Sequence[int]], dtypes: Sequence[str],
                    buffer: torch.Tensor) -> int:
        """Load one bucket of whole tensors (HF names); vLLM's loaders copy this worker's block. Returns the
        number of tensors loaded."""
        weights = unpack(names, shapes, dtypes, buffer)
        self.model_runner.model.load_weights(weights=weights)
        return len(weights)

    @torch.no_grad()
    def weight_sums(self) -> dict[str, float]:
        """Sum of every parameter this worker holds, in float64 (vLLM's names, so fused q/k/v count once)."""
        return {name: float(p.detach().double().sum()) for name, p in self.model_runner.model.named_parameters()}
