"""Ulysses sequence parallelism (SP): P ranks share the sequences of one data-parallel shard.

Every rank holds the same rows and runs its 1/P slice of each sequence through the model. Outside
attention a token needs only itself, so the slices never meet; attention needs the whole sequence, so
there an all-to-all trades the slice of every head for the whole sequence of H/P heads, runs SDPA, and
trades back. Activations per rank fall by P (hidden states [B, S/P, d], scores [B, H/P, S, S]).

The attention is registered with transformers' attention registry under ULYSSES and the model's
config selects it only inside `sequence_parallel_forward`; elsewhere (generation, SP off) the stock
SDPA path runs unchanged.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridflow.workers.modeling import position_ids

ULYSSES = "hybridflow_ulysses"
"""The key of the attention (and its mask) in transformers' registries."""


class SequenceParallelError(ValueError):
    """An SP size the model or the ranks cannot take; names the spec field."""


# -- the collectives, autograd-aware ----------------------------------------------------------------

def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: Any) -> torch.Tensor:
    """Split x in P along scatter_dim, send piece j to rank j, join what arrives along gather_dim
    (in rank order)."""
    p = dist.get_world_size(group)
    if p == 1:
        return x
    send = x.movedim(scatter_dim, 0).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat([piece.movedim(0, scatter_dim) for piece in recv.chunk(p, dim=0)], dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """The gradient of an all-to-all is the all-to-all back: gather_dim and scatter_dim swap roles."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scatter_dim: int, gather_dim: int, group: Any) -> torch.Tensor:
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: Any = None) -> torch.Tensor:
    """[.., n*P (scatter), .., m (gather), ..] -> [.., n, .., m*P, ..] on every rank; differentiable.

    With x = [batch, seq/P, heads, dim], (scatter_dim, gather_dim) = (2, 1) gives [batch, seq, heads/P, dim]
    and (1, 2) turns it back.
    """
    if x.shape[scatter_dim] % dist.get_world_size(group):
        raise ValueError(f"dimension {scatter_dim} of size {x.shape[scatter_dim]} does not split over "
                         f"{dist.get_world_size(group)} ranks")
    out: torch.Tensor = _AllToAll.apply(x, scatter_dim, gather_dim, group)
    return out


class _GatherSequence(torch.autograd.Function):
    """Forward: every rank's slice joined along `dim`. Backward: the objective is the sum of every rank's
    loss, so a slice's gradient is the sum over ranks of the gradient at that slice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad.chunk(dist.get_world_size(ctx.group), dim=ctx.dim)[rank].contiguous(), None, None


def gather_sequence(x: torch.Tensor, dim: int = 1, group: Any = None) -> torch.Tensor:
    """Join the ranks' equal slices of `dim` in rank order (inverse of `shard_sequence`); differentiable."""
    if dist.get_world_size(group) == 1:
        return x
    out: torch.Tensor = _GatherSequence.apply(x, dim, group)
    return out


# -- sequence sharding (pure) -----------------------------------------------------------------------

def padded_length(seq: int, size: int) -> int:
    """seq rounded up to a multiple of the SP size: ceil(seq / P) * P."""
    return -(-seq // size) * size


def pad_sequence(x: torch.Tensor, size: int, value: int | float = 0, dim: int = 1) -> torch.Tensor:
    """x right-padded along `dim` with `value` to a multiple of `size`."""
    extra = padded_length(x.shape[dim], size) - x.shape[dim]
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


def shard_sequence(x: torch.Tensor, rank: int, size: int, dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s contiguous 1/size of `dim` (its length must be a multiple of size)."""
    return x.chunk(size, dim=dim)[rank]


def key_padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Which (query i, key j) pairs attend: j <= i and key j is a token; [B, 1, S, S] bool.

    A query with no such key (left padding) attends to itself, so SDPA never sees an empty row; nothing
    reads a padding position's output.
    """
    s = attention_mask.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=attention_mask.device).tril()
    allowed = causal[None] & attention_mask.bool()[:, None, :]
    empty = ~allowed.any(-1, keepdim=True)
    allowed = allowed | (empty & torch.eye(s, dtype=torch.bool, device=attention_mask.device)[None])
    return allowed[:, None]


# -- checks (pure) ----------------------------------------------------------------------------------

def check_heads(num_heads: int, num_kv_heads: int, size: int, field: str) -> None:
    """Heads split over the SP ranks: H % P == 0; KV heads that do not split are repeated to H."""
    if size < 1:
        raise SequenceParallelError(f"{field}: {size} is not a size; allowed: an integer >= 1")
    if num_heads % size:
        raise SequenceParallelError(
            f"{field}: {size} does not divide the model's {num_heads} attention heads (num_attention_heads); "
            f"allowed: a divisor of {num_heads}")
    if num_heads % num_kv_heads:
        raise SequenceParallelError(f"{field}: the model's {num_kv_heads} key/value heads do not divide its "
                                    f"{num_heads} attention heads")


def check_world(world: int, size: int, field: str) -> None:
    """SP groups are consecutive ranks of the data-parallel group: P must divide its world size."""
    if world % size:
        raise SequenceParallelError(f"{field}: {size} does not divide the {world} data-parallel ranks of the "
                                    f"role; allowed: a divisor of {world}")


def model_heads(config: Any) -> tuple[int, int]:
    """(attention heads, key/value heads) of an HF config."""
    heads = int(config.num_attention_heads)
    return heads, int(getattr(config, "num_key_value_heads", None) or heads)


# -- the attention ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Active:
    group: Any
    size: int
    mask: torch.Tensor | None
    """[B, 1, S, S] bool over the whole (padded) sequence; None: plain causal (no padding to hide)."""
    additive: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)

    def bias(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The mask as an additive bias (0 or the dtype's min), made once for every layer: SDPA would
        otherwise convert the bool mask in each layer and keep each copy for backward."""
        if self.mask is None:
            return None
        if dtype not in self.additive:
            bias = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device)
            self.additive[dtype] = bias.masked_fill_(~self.mask, torch.finfo(dtype).min)
        return self.additive[dtype]


_ACTIVE: ContextVar[_Active | None] = ContextVar("hybridflow_ulysses", default=None)


def _repeat_heads(x: torch.Tensor, times: int) -> torch.Tensor:
    """[B, KV, S, D] -> [B, KV*times, S, D], each KV head repeated for the query heads that share it."""
    return x if times == 1 else x.repeat_interleave(times, dim=1)


def ulysses_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: q [B, H, S/P, D], k/v [B, KV, S/P, D] -> ([B, S/P, H, D], None).

    The model's own mask covers only this rank's slice, so it is ignored; the whole-sequence mask comes
    from `sequence_parallel_forward`. Outside it this is the stock SDPA attention.
    """
    active = _ACTIVE.get()
    if active is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        out: tuple[torch.Tensor, None] = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        return out
    heads, kv_heads = query.shape[1], key.shape[1]
    if kv_heads % active.size:
        key, value = _repeat_heads(key, heads // kv_heads), _repeat_heads(value, heads // kv_heads)
    q, k, v = (all_to_all(t, 1, 2, active.group) for t in (query, key, value))  # [B, heads/P, S, D]
    k, v = _repeat_heads(k, q.shape[1] // k.shape[1]), _repeat_heads(v, q.shape[1] // v.shape[1])
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=active.bias(q.dtype), is_causal=active.mask is None,
                                       scale=scaling, dropout_p=dropout if module.training else 0.0)
    return all_to_all(o, 2, 1, active.group).transpose(1, 2).contiguous(), None


def register() -> None:
    """Make ULYSSES a valid attn_implementation: the attention above and SDPA's mask (which it ignores)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ULYSSES, ulysses_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ULYSSES, sdpa_mask)


@contextlib.contextmanager
def _attention_of(model: torch.nn.Module, implementation: str) -> Iterator[None]:
    """Every sub-config of the model reads `implementation` for the duration."""
    configs: list[Any] = [m.config for m in model.modules() if hasattr(m, "config")]
    old = [c._attn_implementation for c in configs]
    for c in configs:
        c._attn_implementation = implementation
    try:
        yield
    finally:
        for c, o in zip(configs, old, strict=True):
            c._attn_implementation = o


SliceForward = Callable[..., torch.Tensor]
"""(input_ids [B, S/P], position_ids [B, S/P], *aligned slices [B, S/P, ...]) -> per-token output
[B, S/P, ...] of the model."""


def sequence_parallel_forward(model: torch.nn.Module, forward: SliceForward, input_ids: torch.Tensor,
                              attention_mask: torch.Tensor, group: Any,
                              aligned: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
    """The model's per-token output over the whole sequence, computed 1/P per rank; [B, S, ...].

    Every rank of `group` must call this with the same rows. The sequence is right-padded to a multiple
    of P; each rank runs its slice with its global positions (RoPE sees the true offsets), attention goes
    through `ulysses_attention`, and the slices' outputs are gathered and the padding cut off. `aligned`
    tensors ([B, S, ...], e.g. the next-token labels) are cut like the sequence and passed to `forward`.
    """
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    seq = input_ids.shape[1]
    mask = pad_sequence(attention_mask, size)
    ids = pad_sequence(input_ids, size)
    pos = position_ids(mask)  # the plain forward's, so RoPE sees the same offsets
    # Without padding in the rows, plain causal attention is exact (the tail added above comes after every
    # token, so no token sees it) and lets SDPA pick a kernel that keeps no [S, S] scores.
    active = _Active(group, size, None if bool(attention_mask.all()) else key_padding_mask(mask))
    token = _ACTIVE.set(active)
    try:
        with _attention_of(model, ULYSSES):
            local = forward(shard_sequence(ids, rank, size), shard_sequence(pos, rank, size),
                            *(shard_sequence(pad_sequence(t, size), rank, size) for t in aligned))
    finally:
        _ACTIVE.reset(token)
    return gather_sequence(local, 1, group).narrow(1, 0, seq)


def check_same_rows(input_ids: torch.Tensor, group: Any, field: str) -> None:
    """The ranks of an SP group must hold the same rows: compare (rows, length, checksum) over the group."""
    probe = torch.tensor([input_ids.shape[0], input_ids.shape[1], int(input_ids.long().sum())],
                         dtype=torch.long, device=input_ids.device)
    seen = [torch.empty_like(probe) for _ in range(dist.get_world_size(group))]
    dist.all_gather(seen, probe, group=group)
    if any(not torch.equal(s, probe) for s in seen):
        raise SequenceParallelError(f"{field}: the ranks of a sequence-parallel group got different rows "
                                    f"({[s.tolist() for s in seen]}); each group needs one shard")


TokenModel = Callable[..., torch.Tensor]
"""(input_ids, attention_mask or None, positions or None, *aligned) -> a per-token output [B, S, ...]."""


def forward_tokens(model: TokenModel, sp: SequenceParallel, input_ids: torch.Tensor,
                   attention_mask: torch.Tensor, aligned: tuple[torch.Tensor, ...] = (),
                   module: torch.nn.Module | None = None) -> torch.Tensor:
    """`model`'s per-token output: split over this rank's SP group when SP is on, else the plain forward.

    `aligned` per-token tensors are cut as the sequence is; `module` is the network whose attention SP
    replaces, when `model` is a function around it rather than the module itself.
    """
    group = sp.group()
    if group is None:
        return model(input_ids, attention_mask, None, *aligned)
    check_same_rows(input_ids, group, sp.field)
    network = module if module is not None else model
    assert isinstance(network, torch.nn.Module)
    return sequence_parallel_forward(network, lambda ids, pos, *cut: model(ids, None, pos, *cut), input_ids,
                                     attention_mask, group, aligned)


# -- groups -----------------------------------------------------------------------------------------

class SequenceParallel:
    """A role's SP setting on one rank: the size asked for, whether it is on, and its group.

    The groups are consecutive ranks of the data-parallel world ([0..P-1], [P..2P-1], ...), built on first
    use and again whenever the world is rebuilt (a rank joined or left). `disable()` turns SP off for good:
    the rank falls back to the whole sequence.
    """

    def __init__(self, size: int, field: str) -> None:
        self.size, self.field = int(size), field
        self.enabled = self.size > 1
        self._world: Any = None
        self._group: Any = None

    @classmethod
    def for_model(cls, size: int, config: Any, field: str) -> SequenceParallel:
        """Checked against the model's heads; registers the attention when SP is on."""
        sp = cls(size, field)
        if sp.enabled:
            check_heads(*model_heads(config), sp.size, field)
            register()
        return sp

    def disable(self) -> bool:
        """Off from now on; whether it was on."""
        was, self.enabled = self.enabled, False
        return was

    def group(self) -> Any | None:
        """This rank's SP group, or None when SP is off or the ranks are not distributed."""
        if not self.enabled or not dist.is_initialized():
            return None
        world = dist.group.WORLD
        if world is not self._world:
            n = dist.get_world_size()
            check_world(n, self.size, self.field)
            if n == self.size:
                self._group = world
            else:
                self._group, _ = dist.new_subgroups(self.size)
            self._world = world
        return self._group


# -- a device check -----------------------------------------------------------------------------------

def gpu_check(device: torch.device, seq: int = 2048, batch: int = 2) -> dict[str, float]:
    """SP on a one-rank group on `device` against the plain forward of the tiny model's shape.

    Uses the default process group if it has one rank, else creates one (and destroys it after).
    Returns the max |values_SP - values| and |grad_SP - grad|, and the seconds of each forward+backward.
    """
    import os

    from transformers import LlamaConfig, LlamaModel

    from hybridflow.workers.distributed import free_port

    created = False
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
        created = True
    try:
        if dist.get_world_size() != 1:
            raise SequenceParallelError("gpu_check needs a one-rank process group")
        register()
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=seq)
        config._attn_implementation = "sdpa"
        model: torch.nn.Module = LlamaModel(config)
        model = model.to(device)
        ids = torch.randint(0, 256, (batch, seq), device=device)
        mask = torch.ones_like(ids)
        mask[0, : seq // 4] = 0  # one left-padded row

        def run(sp: bool) -> tuple[torch.Tensor, torch.Tensor, float]:
            model.zero_grad()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            if sp:
                out = sequence_parallel_forward(
                    model, lambda i, p: model(input_ids=i, position_ids=p, use_cache=False).last_hidden_state,
                    ids, mask, dist.group.WORLD)
            else:
                out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask),
                            use_cache=False).last_hidden_state
            (out * mask[..., None]).sum().backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            grad = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
            return (out * mask[..., None]).detach(), grad, time.perf_counter() - t0

        plain, g_plain, t_plain = run(False)
        sp, g_sp, t_sp = run(True)
        return {"max_abs_diff_output": float((sp - plain).abs().max()),
                "max_abs_diff_grad": float((g_sp - g_plain).abs().max()),
                "seconds_plain": t_plain, "seconds_sp": t_sp, "seq": float(seq), "batch": float(batch)}
    finally:
        if created:
            dist.destroy_process_group()
