"""Data-parallel ranks: torch.distributed over NCCL on GPUs, gloo on CPUs."""

from __future__ import annotations

import socket
from collections.abc import Iterable
from datetime import timedelta

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def resolve_backend(backend: str) -> str:
    """`auto` means NCCL when this process sees CUDA, gloo otherwise."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


RENDEZVOUS_S = 30.0
"""How long forming the group may take. Every rank is called at once on an idle host, so this is seconds even on
a busy machine; a rank that dies meanwhile (rank 0 holds the store) fails the others within it, not within the
collectives' timeout, and the controller forms the group again."""


def setup(master_addr: str, master_port: int, rank: int, world_size: int, backend: str = "auto",
          timeout_s: float = 120.0, rendezvous_s: float = RENDEZVOUS_S) -> str:
    """(Re)join the process group; a restarted worker calls this again with the same rank."""
    if dist.is_initialized():
        dist.destroy_process_group()
    chosen = resolve_backend(backend)
    store = dist.TCPStore(master_addr, master_port, world_size, is_master=rank == 0,
                          timeout=timedelta(seconds=rendezvous_s))
    dist.init_process_group(chosen, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    return chosen


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def most_passes(count: int, device: torch.device) -> int:
    """The most passes any rank runs, this one running `count`; with other ranks at least one (a collective):
    ranks of a sharded module run that many, each pass's parameter gathers matched on every rank, a rank short of
    data running passes that count for nothing. A lone rank has nothing to match: `count`."""
    if world_size() == 1:
        return count
    t = torch.tensor([max(count, 1)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def average_gradients(params: Iterable[torch.Tensor]) -> None:
    """g <- (1/W) * sum_r g_r, one all-reduce over the flattened gradients of `params`."""
    n = world_size()
    if n == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= n
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def average_scalars(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Mean of each metric over ranks, so every rank reports the same numbers."""
    if world_size() == 1 or not values:
        return values
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    t /= world_size()
    return dict(zip(keys, t.tolist(), strict=True))
