"""LoRA adapters on the policy with peft: applying them, their weights, and the merged view of them.

A LoRA policy is a `peft.PeftModel` over the frozen base model. Its trainable state (what a checkpoint
holds) is the adapter weights alone; the base weights never change, so the initial policy, and the
reference model, is that same module with the adapters switched off (`disable_adapter()`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from hybridflow.api.spec import Lora

TARGETS_FIELD = "spec.model.policy.lora.targetModules"
ADAPTER = "default"
"""peft's name of the one adapter a policy carries."""
ADAPTABLE = (torch.nn.Linear, torch.nn.Embedding)
"""Layer types listed as candidates when no target matches (peft adapts these and a few others)."""


class LoraTargetError(ValueError):
    """targetModules names no layer of the model; the message names the field and the layers there are."""


def matches(module_name: str, target: str) -> bool:
    """peft's rule for a list of names: the full name, or its last dotted parts."""
    return module_name == target or module_name.endswith(f".{target}")


def targets_problem(module_names: Iterable[tuple[str, torch.nn.Module]], targets: list[str]) -> str | None:
    """Why `targets` adapt nothing in a model with these (name, module) pairs; None when one matches."""
    named = list(module_names)
    if any(matches(name, t) for name, _ in named for t in targets):
        return None
    candidates = sorted({name.rsplit(".", 1)[-1] for name, m in named if name and isinstance(m, ADAPTABLE)})
    return (f"{TARGETS_FIELD}: none of {', '.join(map(repr, targets))} names a layer of the model; its linear and "
            f"embedding layers are {', '.join(candidates) or '(none)'}")


def check_targets(model: torch.nn.Module, lora: Lora) -> None:
    problem = targets_problem(model.named_modules(), lora.target_modules)
    if problem:
        raise LoraTargetError(problem)


def apply_lora(model: torch.nn.Module, lora: Lora) -> torch.nn.Module:
    """Wrap `model` in trainable adapters (the base weights are frozen); raises LoraTargetError first when
    targetModules adapts nothing, and names the field for any target peft refuses."""
    from peft import LoraConfig, get_peft_model

    check_targets(model, lora)
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha,  # type: ignore[arg-type]  # a float works: alpha / r
                        lora_dropout=lora.dropout,
                        target_modules=list(lora.target_modules), bias="none", task_type="CAUSAL_LM")
    try:
        peft_model: torch.nn.Module = get_peft_model(model, config, adapter_name=ADAPTER)
    except ValueError as e:
        raise LoraTargetError(f"{TARGETS_FIELD}: {e}") from None
    return peft_model


def is_lora(model: torch.nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def adapter_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors only (peft's names, without the adapter name); an adapted lm_head or embedding
    keeps its base weights out too, as the base never changes (the vocabulary is the base model's)."""
    from peft import get_peft_model_state_dict

    return dict(get_peft_model_state_dict(model, adapter_name=ADAPTER, save_embedding_layers=False))


def load_adapter_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Inverse of `adapter_weights`; every adapter tensor must be there (a full-model state is refused)."""
    from peft import set_peft_model_state_dict

    result: Any = set_peft_model_state_dict(model, weights, adapter_name=ADAPTER)
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise ValueError(f"these weights are not the policy's adapters: missing {missing[:3]}, unexpected "
                         f"{list(result.unexpected_keys)[:3]} (was the checkpoint written with another "
                         "spec.model.policy.lora?)")


@torch.no_grad()
def merged_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base model's state dict with every adapted weight replaced by W + (alpha/r) * B A, under the base
    model's own names; the module is left as it is (no merge and unmerge that would round the base weights)."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()  # type: ignore[operator]  # PeftModel's, unknown to nn.Module
    layers: list[tuple[str, Any]] = [
        (name, module) for name, module in base.named_modules()
        if isinstance(module, LoraLayer) and (ADAPTER in module.lora_A or ADAPTER in module.lora_embedding_A)
    ]
    deltas = {name: module.get_delta_weight(ADAPTER) for name, module in layers}
    out: dict[str, torch.Tensor] = {}
    for key, value in base.state_dict().items():
        if ".lora_" in key:
            continue
        out[key.replace(".base_layer.", ".")] = value
    for name, delta in deltas.items():
        key = f"{name}.weight"
        out[key] = out[key] + delta.to(out[key].dtype)
    return out
