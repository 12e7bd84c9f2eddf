"""Methods vLLM mixes into each of its workers (LLM(worker_extension_cls=...)), called by name through
`LLM.collective_rpc`: the arguments are plain lists and bytes, so nothing executable is sent.

Imports vLLM only inside its methods: the worker process that loads this class has it already.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from hybridflow.workers.reshard import unpack


class WeightLoader:
    """`self` is a vLLM worker: `self.model_runner.model` is the model it generates with.

    One update is `begin_load`, a `load_bucket` per bucket, then `end_load`: vLLM's in-place reload
    (`reload_weights`) split across calls. Its begin puts back each layer's loaders, which vLLM drops once it has
    processed the weights it loaded (repacked for its kernels on the CPU); a layer is processed again as its last
    weight arrives, and the end finishes the layers that need every weight (attention)."""

    model_runner: Any

    def begin_load(self) -> None:
        reload = _layerwise_reload()
        if reload is not None:
            reload[0](self.model_runner.model)

    @torch.no_grad()
    def load_bucket(self, names: Sequence[str], shapes: Sequence[Sequence[int]], dtypes: Sequence[str],
                    buffer: bytes) -> int:
        """Load one bucket of whole tensors (HF names, reshard.pack's layout); vLLM's loaders copy this worker's
        block. Returns the number of tensors loaded."""
        weights = unpack(names, shapes, dtypes, torch.frombuffer(bytearray(buffer), dtype=torch.uint8))
        self.model_runner.model.load_weights(weights=weights)
        return len(weights)

    def end_load(self) -> None:
        reload = _layerwise_reload()
        if reload is not None:
            reload[1](self.model_runner.model, self.model_runner.model_config)

    @torch.no_grad()
    def weight_sums(self) -> dict[str, float]:
        """Sum of every parameter this worker holds, in float64 (vLLM's names, so fused q/k/v count once)."""
        return {name: float(p.detach().double().sum()) for name, p in self.model_runner.model.named_parameters()}


@functools.cache
def _layerwise_reload() -> tuple[Any, Any] | None:
    """vLLM's (initialize_layerwise_reload, finalize_layerwise_reload); None before vLLM had them, when a model's
    loaders stayed in place after loading."""
    try:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )
    except ImportError:
        return None
    return initialize_layerwise_reload, finalize_layerwise_reload
