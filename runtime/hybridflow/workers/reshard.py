"""Resharding the trained policy into the generation layout, one bounded bucket at a time.

Training holds the policy as plain tensors or as DTensors (FSDP2 shards); generation wants, on each of its
tensor-parallel ranks, that rank's slice of every weight. Copying a whole state dict at once costs a second
model's worth of memory; streaming it in fixed-size buckets costs one bucket (plus the one full parameter
being cut). The planning and cutting here are pure; `stream_buckets` is the only place that materialises.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from hybridflow.workers.training import full

DEFAULT_BUCKET_BYTES = 256 << 20
"""Big enough that per-bucket overhead (one RPC, one copy launch) is small next to the copy itself."""

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
"""Model families whose parameter names the cut rules know; they share the HF decoder naming."""

COLUMN, ROW, VOCAB, REPLICATED = "column", "row", "vocab", "replicated"

_RULES: tuple[tuple[re.Pattern[str], str], ...] = tuple((re.compile(p), kind) for p, kind in (
    # column-parallel: each rank keeps a block of output features (rows of W, and the bias)
    (r"(^|\.)self_attn\.(q|k|v)_proj\.(weight|bias)$", COLUMN),
    (r"(^|\.)mlp\.(gate|up)_proj\.weight$", COLUMN),
    # row-parallel: each rank keeps a block of input features (columns of W); the output is all-reduced
    (r"(^|\.)self_attn\.o_proj\.weight$", ROW),
    (r"(^|\.)mlp\.down_proj\.weight$", ROW),
    # vocabulary-parallel: rows of the [vocab, hidden] tables
    (r"(^|\.)embed_tokens\.weight$", VOCAB),
    (r"(^|\.)lm_head\.weight$", VOCAB),
    # every rank holds the whole tensor: RMSNorm scales (qwen3's per-head q/k norms too), rotary tables
    (r"(^|\.)(input_layernorm|post_attention_layernorm|norm|q_norm|k_norm)\.weight$", REPLICATED),
    (r"(^|\.)rotary_emb\.inv_freq$", REPLICATED),
))

_DIM = {COLUMN: 0, ROW: 1, VOCAB: 0, REPLICATED: None}


class ReshardError(ValueError):
    """A weight the cut rules cannot place, or a shape that does not split evenly over the ranks."""


def cut_kind(name: str) -> str:
    """column | row | vocab | replicated, from the parameter's name (llama, mistral, qwen2, qwen3 naming)."""
    for pattern, kind in _RULES:
        if pattern.search(name):
            return kind
    raise ReshardError(f"no tensor-parallel cut rule for weight {name!r} (known families: {', '.join(FAMILIES)})")


def cut_dim(name: str) -> int | None:
    """The dimension split over tensor-parallel ranks: 0 for column and vocab, 1 for row, None if replicated."""
    return _DIM[cut_kind(name)]


def slice_shape(name: str, shape: Sequence[int], tp_size: int) -> tuple[int, ...]:
    """One rank's shape of the weight: the cut dimension divided by tp_size (it must divide evenly)."""
    out = tuple(int(s) for s in shape)
    if tp_size == 1:
        return out
    dim = cut_dim(name)
    if dim is None:
        return out
    if dim >= len(out) or out[dim] % tp_size:
        raise ReshardError(f"weight {name!r} of shape {list(out)} does not split into {tp_size} equal parts "
                           f"along dimension {dim}")
    return (*out[:dim], out[dim] // tp_size, *out[dim + 1:])


def tp_slice(name: str, tensor: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Rank `tp_rank`'s block of the full tensor (a view; the whole tensor when replicated or tp_size is 1)."""
    if not 0 <= tp_rank < tp_size:
        raise ReshardError(f"tensor-parallel rank {tp_rank} is outside 0..{tp_size - 1}")
    shape = slice_shape(name, tensor.shape, tp_size)
    dim = cut_dim(name) if tp_size > 1 else None
    if dim is None:
        return tensor
    return tensor.narrow(dim, tp_rank * shape[dim], shape[dim])


@dataclass(frozen=True)
class WeightInfo:
    """What the planner needs of a weight: no data."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


def slice_bytes(w: WeightInfo, tp_size: int) -> int:
    """Bytes of one rank's slice: prod(slice shape) * itemsize."""
    n = 1
    for s in slice_shape(w.name, w.shape, tp_size):
        n *= s
    return n * w.itemsize


def plan_buckets(weights: Iterable[WeightInfo], bucket_bytes: int, tp_size: int = 1) -> list[list[str]]:
    """Weight names in order, cut into consecutive buckets of at most `bucket_bytes` per rank.

    A slice larger than the bucket travels alone: a bucket is the larger of bucket_bytes and its one slice.
    """
    if bucket_bytes < 1:
        raise ReshardError(f"bucket size must be at least 1 byte, got {bucket_bytes}")
    buckets: list[list[str]] = []
    current: list[str] = []
    used = 0
    for w in weights:
        size = slice_bytes(w, tp_size)
        if current and used + size > bucket_bytes:
            buckets.append(current)
            current, used = [], 0
        current.append(w.name)
        used += size
    if current:
        buckets.append(current)
    return buckets


def weight_infos(state: Mapping[str, torch.Tensor]) -> list[WeightInfo]:
    """Names, global shapes and dtypes (a DTensor reports its full shape without gathering anything)."""
    return [WeightInfo(name, tuple(t.shape), t.dtype) for name, t in state.items()]


@dataclass
class Bucket:
    """One rank's slices of a run of weights, contiguous, ready to copy or send."""

    names: list[str]
    tensors: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


def stream_buckets(state: Mapping[str, torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                   tp_rank: int = 0, tp_size: int = 1, device: torch.device | None = None,
                   dtype: torch.dtype | None = None) -> Iterator[Bucket]:
    """Buckets of `plan_buckets`, in order; each weight gathered, cut and copied one at a time, cast to `dtype`
    (the generation side's: fp32 shards bound for a bf16 engine travel at half the bytes).

    Peak extra memory: the bucket being filled plus one gathered parameter, which is dropped as soon as its
    slice is copied out. With FSDP2 every training rank must iterate in step (each gather is a collective).
    """
    infos = weight_infos(state)
    if dtype is not None:
        infos = [WeightInfo(w.name, w.shape, dtype if w.dtype.is_floating_point else w.dtype) for w in infos]
    for names in plan_buckets(infos, bucket_bytes, tp_size):
        tensors = []
        for name in names:
            whole = full(state[name].detach())
            part = tp_slice(name, whole, tp_rank, tp_size)
            cast = dtype if dtype is not None and part.is_floating_point() else part.dtype
            tensors.append(part.to(device=device or part.device, dtype=cast, copy=True).contiguous())
            del whole, part
        yield Bucket(names, tensors)


# -- a bucket on the wire: one flat byte buffer plus what it holds --------------------------------------------


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def to_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ReshardError(f"unknown dtype {name!r} in a weight bucket")
    return dtype


ALIGN = 16
"""Every tensor starts at a multiple of this in a packed buffer, so each can be viewed as its dtype."""


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def pack(bucket: Bucket) -> tuple[list[str], list[list[int]], list[str], torch.Tensor]:
    """(names, shapes, dtypes, uint8 buffer): plain values and one tensor, which Ray carries as is (vLLM's
    engine, its bytes)."""
    sizes = [t.numel() * t.element_size() for t in bucket.tensors]
    buffer = torch.zeros(sum(_aligned(n) for n in sizes), dtype=torch.uint8)
    offset = 0
    for t, n in zip(bucket.tensors, sizes, strict=True):
        buffer[offset:offset + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        offset += _aligned(n)
    return (list(bucket.names), [list(t.shape) for t in bucket.tensors], [dtype_name(t.dtype) for t in bucket.tensors],
            buffer)


def unpack(names: Sequence[str], shapes: Sequence[Sequence[int]], dtypes: Sequence[str],
           buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Inverse of `pack`: views into `buffer` (each at an ALIGN-byte offset), no copy."""
    if not len(names) == len(shapes) == len(dtypes):
        raise ReshardError(f"a weight bucket lists {len(names)} names, {len(shapes)} shapes and {len(dtypes)} dtypes")
    out, offset = [], 0
    for name, shape, dt in zip(names, shapes, dtypes, strict=True):
        dtype = to_dtype(dt)
        n = 1
        for s in shape:
            n *= int(s)
        size = n * torch.empty((), dtype=dtype).element_size()
        if offset + size > buffer.numel():
            raise ReshardError(f"a weight bucket's buffer ends before weight {name!r}")
        out.append((name, buffer[offset:offset + size].view(dtype).view(*shape)))
        offset += _aligned(size)
    if offset != buffer.numel():
        raise ReshardError(f"a weight bucket's buffer holds {buffer.numel() - offset} bytes beyond its weights")
    return out


@torch.no_grad()
def copy_into(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy named tensors into the module's parameters and buffers of the same names; returns how many."""
    targets = dict(model.named_parameters()) | dict(model.named_buffers())
    count = 0
    for name, value in weights:
        target = targets.get(name)
        if target is None:
            raise ReshardError(f"the generation model has no weight named {name!r}")
        if tuple(target.shape) != tuple(value.shape):
            raise ReshardError(f"weight {name!r}: generation expects shape {list(target.shape)}, "
                               f"got {list(value.shape)}")
        target.copy_(value)
        count += 1
    return count
