"""What a run's metrics.jsonl says about one fault: pure bookkeeping, fed the records as they are polled.

At the kill, `trained_before` is the last step the metrics show trained. A restore cuts the file back to
the checkpoint it loaded (Trainer._restore truncates past it) and training goes on from there, so
the first record that was not in the file at the kill (each record holds its own timings, so a replayed
step never equals the original) follows the checkpoint resumed from: resumed_from = its step - 1, and
redone = trained_before - resumed_from, the steps trained again. Recovery time runs from the kill to the
poll that first saw that record: the next completed step. A step that finished just before the kill but
was written after it is superseded when the restore cuts it away; the truncation itself (an empty or
partial file for a moment) ends nothing, as it holds no new record.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

Record = dict[str, Any]


def _key(record: Record) -> str:
    return json.dumps(record, sort_keys=True)


def last_step(records: Sequence[Record]) -> int:
    return int(records[-1]["step"]) if records else 0


@dataclass
class RecoveryTracker:
    """Feed it (time, records) at every poll; `kill(t)` marks the fault."""

    kill_t: float | None = None
    trained_before: int | None = None
    resumed_from: int | None = None
    recovered_t: float | None = None
    cuts: int = 0
    """Times a record written after the kill was cut away again (a later restore)."""
    _last: tuple[Record, ...] = ()
    _before: frozenset[str] = field(default_factory=frozenset)
    _first_new: str | None = None

    def feed(self, t: float, records: Sequence[Record]) -> None:
        self._last = tuple(records)
        if self.kill_t is None:
            return
        first = next((r for r in records if _key(r) not in self._before), None)
        key = None if first is None else _key(first)
        if key == self._first_new:
            return
        if self._first_new is not None:
            self.cuts += 1
        self._first_new = key
        if first is None:
            self.recovered_t = None
        else:
            self.recovered_t, self.resumed_from = t, int(first["step"]) - 1

    def kill(self, t: float) -> None:
        self.kill_t = t
        self.trained_before = last_step(self._last)
        self._before = frozenset(_key(r) for r in self._last)
        self.resumed_from = self.recovered_t = self._first_new = None

    @property
    def redone(self) -> int | None:
        if self.trained_before is None or self.resumed_from is None:
            return None
        return self.trained_before - self.resumed_from

    @property
    def recovery_s(self) -> float | None:
        if self.kill_t is None or self.recovered_t is None:
            return None
        return self.recovered_t - self.kill_t


def step_counts(records: Sequence[Record], total: int) -> tuple[int, int]:
    """(duplicates, losses) of steps 1..total in a finished run's records: extra copies, and steps absent."""
    seen = Counter(int(r["step"]) for r in records)
    duplicates = sum(n - 1 for n in seen.values() if n > 1)
    losses = sum(1 for s in range(1, total + 1) if s not in seen)
    return duplicates, losses
