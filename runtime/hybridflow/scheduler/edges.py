"""Edge queues: the object refs in flight on each data edge, how long they took, how big they were; and the
control edge's record of the weight syncs it carried.

LatencyStats, SizeStats, PolicySyncs and size_problem are pure; EdgeChannel is the thin Ray layer (ray.wait /
ray.get) over them.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import ray


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest rank: sorted(samples)[ceil(q/100 * n) - 1]; 0.0 for no samples."""
    if not samples:
        return 0.0
    ordered = sorted(samples)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


class LatencyStats:
    """count and mean over every sample; p50 and p95 over the last `window` so they follow the current load."""

    def __init__(self, window: int = 1024) -> None:
        self.count = 0
        self.total_s = 0.0
        self.max_s = 0.0
        self._recent: deque[float] = deque(maxlen=window)

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total_s += seconds
        self.max_s = max(self.max_s, seconds)
        self._recent.append(seconds)

    def since(self, count: int) -> list[float]:
        """The samples added after the first `count` (at most the window's), oldest first: what an exporter
        that saw `count` of them has not seen yet."""
        new = min(self.count - count, len(self._recent))
        return list(self._recent)[-new:] if new > 0 else []

    @property
    def mean_s(self) -> float:
        return self.total_s / self.count if self.count else 0.0

    @property
    def p50_s(self) -> float:
        return percentile(list(self._recent), 50.0)

    @property
    def p95_s(self) -> float:
        return percentile(list(self._recent), 95.0)

    def as_dict(self) -> dict[str, float | int]:
        return {"count": self.count, "mean_s": self.mean_s, "p50_s": self.p50_s, "p95_s": self.p95_s,
                "max_s": self.max_s}


Transport = Literal["in_process", "object_store"]
"""How a batch crosses an edge: handed over inside the producer's process (a coLocate edge: nothing is
copied), or through Ray's object store (stored once by the producer, read by the consumer's process)."""


class EdgeSizeError(ValueError):
    """A batch larger than its edge's max_size_bytes was about to leave the producer's process."""


def size_problem(edge: str, size_bytes: int, limit: int | None, transport: Transport) -> str | None:
    """Why a batch of `size_bytes` may not cross `edge`, or None.

    The limit bounds what is copied between processes; an in-process hand-off copies nothing, so only
    object-store batches are held to it.
    """
    if limit is None or transport == "in_process" or size_bytes <= limit:
        return None
    return (f"edge {edge}: a batch of {size_bytes} bytes is over its maxSizeBytes {limit}; raise "
            f"maxSizeBytes, lower scheduling.microBatchSize, or co-locate the two nodes (coLocate: true)")


class SizeStats:
    """Sizes of the batches that crossed one edge: count, total, last and largest, in bytes."""

    def __init__(self) -> None:
        self.count = 0
        self.total = 0
        self.last = 0
        self.max = 0

    def add(self, size_bytes: int) -> None:
        self.count += 1
        self.total += size_bytes
        self.last = size_bytes
        self.max = max(self.max, size_bytes)

    def as_dict(self) -> dict[str, int]:
        return {"batches": self.count, "bytes_total": self.total, "bytes_last": self.last, "bytes_max": self.max}


class PolicySyncs:
    """The control edge that brings each update to rollout: every weight sync crosses it and is counted here,
    with its bytes, its seconds, the version it delivered and the policy lag the updates trained at."""

    def __init__(self, key: str, consistency: str) -> None:
        self.key, self.consistency = key, consistency
        self.sizes = SizeStats()
        self.latency = LatencyStats()
        self.version = 0
        self.lag_last = 0
        self.lag_max = 0

    def record(self, version: int, size_bytes: int, seconds: float, lag: int) -> None:
        """One sync: rollout now holds policy `version`; the update before it trained `lag` versions behind."""
        self.sizes.add(size_bytes)
        self.latency.add(seconds)
        self.version = version
        self.lag_last, self.lag_max = lag, max(self.lag_max, lag)

    @property
    def syncs(self) -> int:
        return self.sizes.count

    def status(self) -> dict[str, Any]:
        return {"consistency": self.consistency, "syncs": self.syncs, "policy_version": self.version,
                "policy_lag": self.lag_last, "policy_lag_max": self.lag_max, "latency": self.latency.as_dict(),
                **self.sizes.as_dict()}


def _finished_now(refs: list[ray.ObjectRef]) -> set[ray.ObjectRef]:
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    return set(ready)


@dataclass
class _Item:
    ref: ray.ObjectRef
    submitted: float
    sequences: int


class EdgeChannel:
    """The refs submitted on one edge and not yet taken by the consumer; latency = submit to take.

    The controller puts each ref it dispatches to the edge's consumer, with the sequences it carries, and
    takes the results. What backpressure watches is the backlog a new batch finds: the sequences put
    before it whose consumer task has not finished (`take_backlog`). A batch taken at once by an idle
    consumer finds none, however many batches a step has or how late the controller collects them.
    """

    def __init__(self, key: str, high_watermark: int, max_size_bytes: int | None = None,
                 transport: Transport = "object_store", clock: Callable[[], float] = time.monotonic,
                 finished: Callable[[list[ray.ObjectRef]], set[ray.ObjectRef]] = _finished_now) -> None:
        self.key = key
        self.high_watermark = high_watermark
        self.max_size_bytes = max_size_bytes
        self.transport: Transport = transport
        self.latency = LatencyStats()
        self.sizes = SizeStats()
        self._clock = clock
        self._finished = finished
        self._items: list[_Item] = []
        self._peak = 0
        self._backlog = 0
        self.last_backlog = 0
        """What the last observation saw, for status."""

    @property
    def bytes_total(self) -> int:
        return self.sizes.total

    def check(self, size_bytes: int) -> None:
        """Raise EdgeSizeError when a batch of `size_bytes` may not cross this edge (see size_problem)."""
        problem = size_problem(self.key, size_bytes, self.max_size_bytes, self.transport)
        if problem:
            raise EdgeSizeError(problem)

    def record_bytes(self, size_bytes: int) -> None:
        """Check and count a batch sent on the edge (an in-process hand-off is counted, never stopped)."""
        self.check(size_bytes)
        self.sizes.add(size_bytes)

    def put(self, ref: ray.ObjectRef, sequences: int = 1) -> None:
        """Queue a consumer task's result; `sequences` is the unit backpressure counts (1 for plain items)."""
        if self._items:
            done = self._finished([it.ref for it in self._items])
            self._backlog = max(self._backlog, sum(it.sequences for it in self._items if it.ref not in done))
        self._items.append(_Item(ref, self._clock(), sequences))
        self._peak = max(self._peak, self.queued())

    def take_backlog(self) -> int:
        """The most sequences a batch put since the last call found still waiting for the consumer."""
        self.last_backlog, self._backlog = self._backlog, 0
        return self.last_backlog

    def pending(self) -> int:
        return len(self._items)

    def queued(self) -> int:
        """Sequences put and not yet taken: the unit backpressure counts."""
        return sum(it.sequences for it in self._items)

    def take_peak(self) -> int:
        """The most sequences queued at once since the last call; the queue drains within a step, so a look
        at `queued()` between steps would always see 0."""
        peak, self._peak = self._peak, self.queued()
        return peak

    def drain(self) -> list[Any]:
        """Every pending value, in submission order; blocks until all are finished.

        Each item's latency is stamped when it finishes, not when the last one does.
        """
        taken, self._items = self._items, []
        if not taken:
            return []
        left = [it.ref for it in taken]
        finished: dict[ray.ObjectRef, float] = {}
        while left:
            ray.wait(left, num_returns=1)
            ready, left = ray.wait(left, num_returns=len(left), timeout=0)
            now = self._clock()
            finished.update((r, now) for r in ready)
        for it in taken:
            self.latency.add(finished[it.ref] - it.submitted)
        return ray.get([it.ref for it in taken])

    def discard(self) -> int:
        """Forget every pending ref (a step that failed midway left them; their batches are redone), so the
        next step's `drain` returns only its own results. Returns how many were dropped."""
        dropped, self._items = len(self._items), []
        return dropped

    def status(self) -> dict[str, Any]:
        return {
            "queue_len": self.pending(),
            "backlog": self.last_backlog,
            "high_watermark": self.high_watermark,
            "latency": self.latency.as_dict(),
            "transport": self.transport,
            "max_size_bytes": self.max_size_bytes,
            **self.sizes.as_dict(),
        }
