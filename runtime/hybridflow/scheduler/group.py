"""A node's hosts called as one: `map` shards a batch over them, `call` broadcasts, `deal` spreads work.

The hosts are looked up on every call, so a group follows the parallelism backpressure sets.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, Self, TypeVar

import ray
from ray.actor import ActorHandle

T = TypeVar("T")


class Shardable(Protocol):
    def shard(self, n: int) -> Sequence[Self]: ...


class HostSource(Protocol):
    """Where a group finds its hosts: the HybridScheduler."""

    def hosts(self, node_name: str) -> list[ActorHandle]: ...


class HostGroup:
    """The host actors serving one graph node (shared with its co-located nodes), in rank order."""

    def __init__(self, node: str, hosts: HostSource) -> None:
        self.node = node
        self._source = hosts
        self._turn = 0

    @property
    def hosts(self) -> list[ActorHandle]:
        return list(self._source.hosts(self.node))

    def __len__(self) -> int:
        return len(self.hosts)

    def submit(self, method: str, batch: Shardable, *args: Any, shard: bool = True,
               replicas: int = 1) -> list[ray.ObjectRef]:
        """`method(part, *args)` on every host: part i is shard i of `batch`, or all of it when shard=False.

        With replicas=P the batch is cut into len(hosts)/P shards and hosts P*i .. P*i+P-1 all get shard i
        (a sequence-parallel group shares its rows). A batch with fewer rows than shards leaves the last
        hosts without a call (the plan keeps trained nodes at most as wide as a step's batch, so every
        data-parallel rank gets rows).
        """
        hosts = self.hosts
        if shard:
            shards: list[Any] = list(batch.shard(max(1, len(hosts) // replicas)))
            if replicas > 1:  # one copy in the object store per shard, not one per host
                shards = [ray.put(part) for part in shards]
            parts = [part for part in shards for _ in range(replicas)]
            return [getattr(h, method).remote(part, *args) for h, part in zip(hosts, parts, strict=False)]
        whole = ray.put(batch)
        return [getattr(h, method).remote(whole, *args) for h in hosts]

    def map(self, method: str, batch: Shardable, *args: Any, shard: bool = True, replicas: int = 1) -> list[Any]:
        """`submit`, then wait: one result per host that got a part, in rank order."""
        return ray.get(self.submit(method, batch, *args, shard=shard, replicas=replicas))

    def call(self, method: str, *args: Any) -> list[Any]:
        """`method(*args)` on every host; one result per host, in rank order."""
        return ray.get([getattr(h, method).remote(*args) for h in self.hosts])

    def deal(self, method: str, calls: Sequence[tuple[Any, ...]]) -> list[tuple[int, ray.ObjectRef]]:
        """Call i goes to host i mod n (more calls than hosts queue up on each); returns (host, ref) pairs."""
        hosts = self.hosts
        dealt = []
        for i, args in enumerate(calls):
            host = _host_of(i, len(hosts))
            dealt.append((host, getattr(hosts[host], method).remote(*args)))
        return dealt

    def deal_lists(self, method: str, calls: Sequence[T]) -> list[Any]:
        """`method(list)` once on each host that gets calls, with the calls `deal` would give it, in order;
        waits, and returns the answers in host order."""
        hosts = self.hosts
        mine: list[list[T]] = [[] for _ in hosts]
        for i, call in enumerate(calls):
            mine[_host_of(i, len(hosts))].append(call)
        return ray.get([getattr(h, method).remote(part) for h, part in zip(hosts, mine, strict=True) if part])

    @staticmethod
    def in_call_order(per_host: Sequence[Sequence[T]]) -> list[T]:
        """Results each host returned for its calls under `deal`'s rule, back in the order of the calls."""
        left = [list(results) for results in per_host]
        return [left[_host_of(i, len(left))].pop(0) for i in range(sum(len(r) for r in left))]

    def next(self, method: str, *args: Any) -> ray.ObjectRef:
        """`method(*args)` on the next host in turn: chunks streamed to a node spread over its instances."""
        hosts = self.hosts
        host = hosts[self._turn % len(hosts)]
        self._turn += 1
        return getattr(host, method).remote(*args)


def _host_of(call: int, hosts: int) -> int:
    """The host call `call` goes to among `hosts`: one rule for `deal`, `deal_lists` and `in_call_order`."""
    return call % hosts
