"""Adaptive backpressure as pure policy: when a queue stays long, what should change, in which order.

A queue is measured in sequences: the backlog a batch finds on its edge when it arrives (EdgeChannel),
so the watermark means the same whatever the micro-batch size. The scheduler feeds in those backlogs and
parallelism and applies the first candidate that works:
a queue above the high watermark for `window` observations first raises the consumer (when the
cluster has room) and otherwise slows the producer; a queue below half the watermark for `window`
observations walks changed parallelism back, one step at a time, toward the plan.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

Action = Literal["raise_downstream", "lower_upstream", "relax_downstream", "relax_upstream"]
SignalKind = Literal["high", "low"]


def high_watermark(configured: int | None, step_sequences: int) -> int:
    """scheduling.queueHighWatermark, else half the sequences of one step (at least 1).

    A consumer that keeps up leaves each new batch an empty queue; one still holding half a step of
    sequences when the next batch arrives is the step's bottleneck. Without scheduling.microBatchSize a
    step is one batch per producer instance, so n instances leave at most (n - 1) / n of a step queued:
    with one or two it never fires, as more consumers would have no more batches to share.
    """
    return configured if configured is not None else max(1, step_sequences // 2)


@dataclass(frozen=True)
class BackpressureDecision:
    """One proposed (and, once tried, possibly `applied`) parallelism change of `node`."""

    edge: str
    action: Action
    node: str
    old: int
    new: int
    reason: str
    applied: bool = False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class QueueSignal:
    """A queue that stayed on one side of the watermarks for a whole window."""

    edge: str
    kind: SignalKind
    pending: int


class BackpressurePolicy:
    """Counts consecutive observations per edge and proposes changes.

    high: pending > high_watermark; low: pending < high_watermark / 2. A signal fires after `window`
    consecutive observations on that side and resets the count, so every change gets a full window to
    take effect before the next one.
    """

    def __init__(self, high_watermark: int, window: int) -> None:
        if high_watermark < 1 or window < 1:
            raise ValueError("high_watermark and window must be >= 1")
        self.high_watermark = high_watermark
        self.window = window
        self._high: dict[str, int] = {}
        self._low: dict[str, int] = {}

    @property
    def low_watermark(self) -> float:
        return self.high_watermark / 2

    def observe(self, edge: str, pending: int) -> QueueSignal | None:
        high = self._high[edge] = self._high.get(edge, 0) + 1 if pending > self.high_watermark else 0
        low = self._low[edge] = self._low.get(edge, 0) + 1 if pending < self.low_watermark else 0
        if high >= self.window:
            self._high[edge] = 0
            return QueueSignal(edge, "high", pending)
        if low >= self.window:
            self._low[edge] = 0
            return QueueSignal(edge, "low", pending)
        return None

    def reason(self, signal: QueueSignal) -> str:
        if signal.kind == "high":
            return (f"queue {signal.edge} at {signal.pending} > {self.high_watermark} "
                    f"for {self.window} observations")
        return (f"queue {signal.edge} at {signal.pending} < {self.low_watermark:g} "
                f"for {self.window} observations")

    def candidates(self, signal: QueueSignal, src: str, dst: str, current: Mapping[str, int],
                   planned: Mapping[str, int], can_raise: Callable[[str], bool]) -> list[BackpressureDecision]:
        """Changes to try in order; the scheduler applies the first that succeeds.

        high: raise dst by one if `can_raise(dst)`, else lower src by one (never below 1).
        low:  lower dst by one while above its plan, else raise src by one while below its plan.
        """
        why = self.reason(signal)
        out: list[BackpressureDecision] = []
        if signal.kind == "high":
            if can_raise(dst):
                out.append(BackpressureDecision(signal.edge, "raise_downstream", dst, current[dst],
                                                current[dst] + 1, why))
            if current[src] > 1:
                suffix = "" if out else f"; no room to raise {dst}"
                out.append(BackpressureDecision(signal.edge, "lower_upstream", src, current[src],
                                                current[src] - 1, why + suffix))
            return out
        if current[dst] > planned[dst]:
            out.append(BackpressureDecision(signal.edge, "relax_downstream", dst, current[dst], current[dst] - 1,
                                            f"{why}; back toward planned {planned[dst]}"))
        elif current[src] < planned[src] and can_raise(src):
            out.append(BackpressureDecision(signal.edge, "relax_upstream", src, current[src], current[src] + 1,
                                            f"{why}; back toward planned {planned[src]}"))
        return out
