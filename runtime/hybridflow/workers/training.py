"""The training layout of a role (actor or critic): which tensors the optimizer steps, where, in what precision.

    sharded   several ranks and spec.trainer.training.shard: FSDP2 `fully_shard` over an fp32 copy of the
              model; each rank holds 1/W of the fp32 parameters, gradients and Adam moments, computes in the
              role's dtype (MixedPrecisionPolicy) and reduces gradients in fp32.
    masters   otherwise, with a 16-bit model: forward and backward run on the model itself; AdamW steps fp32
              master copies of its trainable parameters, which are rounded back into it after each step.
              (bf16 holds 8 significant bits: at lr 1e-6 most updates of bf16 weights round to nothing.)
    plain     otherwise, with an fp32 model: AdamW steps the model's own parameters.

Unsharded ranks all-reduce their gradients (distributed.average_gradients). The role's `model` is a full
copy for generation and log-probs in every layout. Under the sharded layout an update reads only the shards, so
the copy's trainable weights give their memory back for it (`release`) and `sync()` gathers them again after
it: a rank holds the whole policy only while generation and scoring need it. A role that reads nothing from the
copy between updates (`keep_copy` False: generation runs elsewhere and nothing is scored by it) leaves it
released after the first update; its weights are then read from the shards (`current`), and `hold_copy`
gathers them before the ranks change.

The layout is built lazily, on the first update after the ranks changed (`invalidate`, called when the
process group is rebuilt). A rebuild starts from the full copy, so rescaling a group resets Adam's moments
and, for a 16-bit model, rounds the fp32 masters to the model's dtype: a rescale costs the optimizer its
history, which a checkpoint (DCP, `save`/`load`) keeps exactly.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from hybridflow.api.spec import Training
from hybridflow.plan import shards_training
from hybridflow.workers import distributed
from hybridflow.workers.lora import is_lora

LayoutKind = Literal["sharded", "masters", "plain"]

MODEL_PREFIX = "model."
OPTIM_PREFIX = "optim."


def layout_kind(world: int, shard: bool, dtype: torch.dtype, lora: bool) -> LayoutKind:
    """Sharded where plan.shards_training says so; else masters for a 16-bit model."""
    if shards_training(world, shard, lora):
        return "sharded"
    return "plain" if dtype == torch.float32 else "masters"


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each block in the backward pass (non-reentrant: works with frozen inputs and FSDP)."""
    names = ("activation_checkpointing_enable", "gradient_checkpointing_enable")  # transformers >= 5.x, before
    hf = next((m for m in model.modules() if any(hasattr(m, n) for n in names)), None)
    if hf is None:
        raise ValueError("spec.trainer.training.gradientCheckpointing: the model has no Hugging Face module to "
                         "checkpoint")
    kwargs = {"use_reentrant": False}
    if hasattr(hf, names[0]):
        getattr(hf, names[0])(activation_checkpointing_kwargs=kwargs)
    else:
        getattr(hf, names[1])(gradient_checkpointing_kwargs=kwargs)


def checkpoints_activations(model: torch.nn.Module) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def _fully_shard() -> tuple[Any, Any]:
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    return fully_shard, MixedPrecisionPolicy


def shard_model(model: torch.nn.Module, compute: torch.dtype, device: torch.device) -> torch.nn.Module:
    """An fp32 copy of `model`, sharded over the default process group: each transformer block (the HF model's
    `_no_split_modules`) is one FSDP unit, the rest (embeddings, head) the root's."""
    from torch.distributed.device_mesh import init_device_mesh

    fully_shard, policy_cls = _fully_shard()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = policy_cls(param_dtype=None if compute == torch.float32 else compute, reduce_dtype=torch.float32)
    train = copy.deepcopy(model).float()
    blocks: set[str] = set()
    for m in train.modules():
        blocks |= set(getattr(m, "_no_split_modules", None) or ())
    for m in train.modules():
        if type(m).__name__ in blocks:
            fully_shard(m, mesh=mesh, mp_policy=policy)
    fully_shard(train, mesh=mesh, mp_policy=policy)
    return train


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's shard, or the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def held_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """The bytes this rank holds of `tensors` (a DTensor's shard; None counts nothing)."""
    return sum(local(t).numel() * local(t).element_size() for t in tensors if t is not None)


def parameter_counts(model: torch.nn.Module, shapes: Mapping[str, torch.Size] | None = None) -> tuple[int, int]:
    """(trainable, all) parameters of `model`; one named in `shapes` counts at that shape (a released copy's
    parameter, whose tensor is empty until it is gathered again)."""
    shapes = shapes or {}
    trainable = total = 0
    for name, p in model.named_parameters():
        n = shapes[name].numel() if name in shapes else p.numel()
        total += n
        trainable += n if p.requires_grad else 0
    return trainable, total


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective for a DTensor: every rank must ask)."""
    full_tensor = getattr(t, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else t


def load_trained(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy a checkpoint's trained weights (`RoleTraining.tensors`' `model.` part, prefix removed) into the
    trainable parameters of a freshly loaded `model`, cast to their dtype: the weights the role's inference
    copy held when the checkpoint was written. Both sides must name the same parameters."""
    own = {n: p for n, p in model.named_parameters() if p.requires_grad}
    missing, unknown = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
    if missing or unknown:
        raise ValueError(f"the checkpoint's trained weights do not fit the model: missing {missing[:3]}, "
                         f"unknown {unknown[:3]}")
    with torch.no_grad():
        for name, p in own.items():
            p.copy_(tensors[name])


@dataclass
class Layout:
    """One built layout: `module` runs forward and backward, `optimizer` steps `params` (named as in the model)."""

    kind: LayoutKind
    world: int
    module: torch.nn.Module
    names: list[str]
    params: list[torch.Tensor]
    optimizer: torch.optim.Optimizer
    compute: list[torch.Tensor] = field(default_factory=list)
    """masters: the model's own parameters, in `params`' order."""


class RoleTraining:
    """The optimizer side of a role whose `model` is its full inference copy."""

    def __init__(self, model: torch.nn.Module, *, lr: float, options: Training, device: torch.device,
                 keep_copy: bool = True, weight_decay: float = 0.0) -> None:
        self.model, self.lr, self.options, self.device = model, lr, options, device
        self.weight_decay = weight_decay
        self.keep_copy = keep_copy
        """Whether the copy gets the trained weights back after each update (something reads it in between)."""
        self._layout: Layout | None = None
        self._checkpointing = False
        self._released: dict[str, torch.Size] = {}
        """The shapes of the copy's weights while `release` holds their memory back."""

    # -- building --------------------------------------------------------------------------------

    def invalidate(self) -> None:
        """The ranks changed: the next update rebuilds the layout from `model` (Adam's moments start over).

        A copy still released here belongs to an update that never finished (a rank was lost in it): it gets its
        memory back, unset, for the recovery's checkpoint load or fresh weights to fill."""
        self._layout = None
        self._materialize()

    @property
    def layout(self) -> Layout:
        world = distributed.world_size()
        if self._layout is None or self._layout.world != world:
            self._layout = self._build(world)
        return self._layout

    def _build(self, world: int) -> Layout:
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        dtype = named[0][1].dtype if named else torch.float32
        kind = layout_kind(world, self.options.shard, dtype, is_lora(self.model))
        if self.options.gradient_checkpointing and not self._checkpointing:
            enable_gradient_checkpointing(self.model)  # before a copy, so the sharded copy has it too
            self._checkpointing = True
        names = [n for n, _ in named]
        compute: list[torch.Tensor] = []
        params: list[torch.Tensor]
        if kind == "sharded":
            module = shard_model(self.model, dtype, self.device)
            by_name = dict(module.named_parameters())
            params = [by_name[n] for n in names]
        elif kind == "masters":
            module = self.model
            compute = [p for _, p in named]
            params = [p.detach().float().clone().requires_grad_(True) for p in compute]
        else:
            module = self.model
            params = [p for _, p in named]
        optimizer = torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay)
        return Layout(kind, world, module, names, params, optimizer, compute)

    # -- one optimiser step ------------------------------------------------------------------------

    @property
    def module(self) -> torch.nn.Module:
        return self.layout.module

    @property
    def sharded(self) -> bool:
        return self.layout.kind == "sharded"

    def set_lr(self, lr: float) -> None:
        """The learning rate of the steps from now on (the schedule's, set before each update)."""
        self.lr = lr
        if self._layout is not None:
            for group in self._layout.optimizer.param_groups:
                group["lr"] = lr

    def zero_grad(self) -> None:
        lay = self.layout
        lay.optimizer.zero_grad(set_to_none=False)
        for p in lay.compute:
            p.grad = None

    def step(self, max_grad_norm: float) -> float:
        """Average the gradients over unsharded ranks, clip them to `max_grad_norm` (global L2 norm), step
        AdamW; returns the pre-clip norm."""
        lay = self.layout
        if lay.kind == "masters":
            for master, p in zip(lay.params, lay.compute, strict=True):
                master.grad = p.grad.float() if p.grad is not None else torch.zeros_like(master)
        if lay.kind != "sharded":
            distributed.average_gradients(lay.params)
        norm = float(full(torch.nn.utils.clip_grad_norm_(lay.params, max_grad_norm)))
        lay.optimizer.step()
        if lay.kind == "masters":
            with torch.no_grad():
                for master, p in zip(lay.params, lay.compute, strict=True):
                    p.copy_(master)
        return norm

    def release(self) -> None:
        """Sharded layout: the inference copy's trained weights give their memory back until `sync`."""
        lay = self.layout
        if lay.kind != "sharded" or self._released:
            return
        own = dict(self.model.named_parameters())
        for name in lay.names:
            self._released[name] = own[name].shape
            own[name].data = own[name].new_empty(0)

    def finish_update(self) -> None:
        """After an update's last step: the copy holds the trained weights again, unless nobody reads it."""
        if self.keep_copy:
            self.sync()

    def hold_copy(self) -> None:
        """The copy holds the trained weights (a collective while it is released): asked before the ranks
        change, since a new layout is built from the copy."""
        if self.released:
            self.sync()

    @property
    def released(self) -> bool:
        """Whether the copy's trained weights have given their memory back (in an update, or after it where
        the copy is not kept)."""
        return bool(self._released)

    @property
    def current(self) -> torch.nn.Module:
        """The module whose state dict holds the trained weights under the copy's names: the copy, or while it
        is released the sharded module (DTensors: every rank must read them, and run it, in step)."""
        return self.layout.module if self.released else self.model

    def parameter_counts(self) -> tuple[int, int]:
        """(trainable, all) parameters of the model, those of a released copy counted at their full shapes."""
        return parameter_counts(self.model, self._released)

    def held_copy(self) -> torch.nn.Module:
        """The copy, which must hold the trained weights: read on one rank, a released copy would give empty
        tensors, and gathering it is a collective that every rank must join (`hold_copy`)."""
        if self.released:
            raise RuntimeError("the inference copy is released: gather it on every rank first (hold_copy)")
        return self.model

    def _materialize(self) -> None:
        own = dict(self.model.named_parameters())
        for name, shape in self._released.items():
            own[name].data = own[name].new_empty(shape)
        self._released = {}

    @torch.no_grad()
    def sync(self) -> None:
        """Copy the trained weights into the full inference copy (sharded: an all-gather per parameter, into the
        memory `release` gave back)."""
        lay = self.layout
        if lay.kind != "sharded":
            return
        self._materialize()
        own = dict(self.model.named_parameters())
        for name, p in zip(lay.names, lay.params, strict=True):
            own[name].copy_(full(p.detach()))

    def inference_copy_bytes(self) -> int:
        """What the inference copy holds now: its parameters' bytes (0 for the trained ones while released)."""
        return held_bytes(self.model.parameters())

    # -- checkpoints -----------------------------------------------------------------------------

    def _init_optimizer_state(self) -> None:
        """Adam's state as it is after a step, zeroed, so a checkpoint can load into it in place."""
        lay = self.layout
        for p in lay.params:
            if not lay.optimizer.state.get(p):
                lay.optimizer.state[p] = {"step": torch.zeros((), dtype=torch.float32),
                                          "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}

    def tensors(self) -> dict[str, torch.Tensor]:
        """The training state as flat named tensors: fp32 weights (`model.NAME`) and Adam's state
        (`optim.NAME.exp_avg`, ...), DTensor shards under the sharded layout."""
        lay = self.layout
        self._init_optimizer_state()
        out: dict[str, torch.Tensor] = {}
        for name, p in zip(lay.names, lay.params, strict=True):
            out[MODEL_PREFIX + name] = p.detach()
            for key, value in lay.optimizer.state[p].items():
                if isinstance(value, torch.Tensor):
                    out[f"{OPTIM_PREFIX}{name}.{key}"] = value
        return out

    def save(self, directory: str | Path) -> None:
        """Every rank of the group writes its part (a collective); see hybridflow.dcp."""
        from hybridflow import dcp

        dcp.save(self.tensors(), directory)

    def load(self, directory: str | Path) -> None:
        """Read a checkpoint written by any number of ranks into this layout (DCP reshards), then refresh
        the inference copy."""
        from hybridflow import dcp

        state = self.tensors()
        dcp.load(state, directory)
        lay = self.layout
        if lay.kind == "masters":
            with torch.no_grad():
                for master, p in zip(lay.params, lay.compute, strict=True):
                    p.copy_(master)
        self.sync()

    # -- measuring -------------------------------------------------------------------------------

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for training: the stepped parameters, their gradients (and, for masters, the
        16-bit gradients of the model), and the optimizer state. The inference copy is not counted, except
        where it is the stepped parameters (plain) or holds the gradients (masters)."""
        lay = self.layout
        state = [v for s in lay.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        grads = [p.grad for p in lay.params] + [p.grad for p in lay.compute]
        return {"params": held_bytes(lay.params), "grads": held_bytes(grads), "optimizer": held_bytes(state)}
