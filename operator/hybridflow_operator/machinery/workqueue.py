"""Keyed work on one asyncio loop: one run at a time per key, bursts coalesced, retries delayed.

The shape of a Kubernetes controller's work queue. However many events arrive for a job while it
is being reconciled, they cost one more run; runs of one key start at least `min_interval` apart,
so a burst of pod events becomes at most one status write a second.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, Literal, Protocol, TypeVar

K = TypeVar("K", bound=Hashable)

log = logging.getLogger(__name__)
RunResult = Literal["done", "retry", "error"]


class QueueObserver(Protocol):
    """Told how long each key waited for its run, and how long the run took and how it ended."""

    def waited(self, seconds: float) -> None: ...
    def ran(self, seconds: float, result: RunResult) -> None: ...


class WorkQueue(Generic[K]):
    """`add(key)` runs `work(key)` soon; `work` may return seconds after which to run it again."""

    def __init__(self, work: Callable[[K], Awaitable[float | None]], *, min_interval: float,
                 error_delay: float, observer: QueueObserver | None = None) -> None:
        self._work = work
        self._min_interval = min_interval
        self._error_delay = error_delay
        self._observer = observer
        self._dirty: set[K] = set()
        self._queued_at: dict[K, float] = {}  # when each dirty key became dirty
        self._running: dict[K, asyncio.Task[None]] = {}
        self._later: dict[K, tuple[float, asyncio.TimerHandle]] = {}

    def add(self, key: K, after: float = 0.0) -> None:
        """Run `work(key)` now (or once the current run of this key ends), or in `after` seconds."""
        loop = asyncio.get_running_loop()
        if after > 0:
            due = loop.time() + after
            pending = self._later.get(key)
            if pending is None or due < pending[0]:  # the earliest retry wins
                if pending is not None:
                    pending[1].cancel()
                self._later[key] = (due, loop.call_at(due, self._due, key))
            return
        if key not in self._dirty:
            self._queued_at[key] = loop.time()
            self._dirty.add(key)
        if key not in self._running:
            self._running[key] = loop.create_task(self._drain(key), name=f"work {key}")

    @property
    def depth(self) -> int:
        """Keys waiting for a run that has not started yet."""
        return len(self._dirty)

    @property
    def idle(self) -> bool:
        """Nothing is queued, running or waiting for its delay."""
        return not self._running and not self._later

    def close(self) -> None:
        for _, handle in self._later.values():
            handle.cancel()
        self._later.clear()
        for task in self._running.values():
            task.cancel()

    def _due(self, key: K) -> None:
        self._later.pop(key, None)
        self.add(key)

    async def _drain(self, key: K) -> None:
        loop = asyncio.get_running_loop()
        try:
            while key in self._dirty:
                self._dirty.discard(key)
                started = loop.time()
                queued = self._queued_at.pop(key, started)
                if self._observer is not None:
                    self._observer.waited(started - queued)
                result: RunResult
                try:
                    again = await self._work(key)
                    result = "done" if again is None else "retry"
                except Exception:  # a bug must not stop the job's queue for good
                    log.exception("reconciling %s failed; retrying in %.0f s", key, self._error_delay)
                    again, result = self._error_delay, "error"
                if self._observer is not None:
                    self._observer.ran(loop.time() - started, result)
                if again is not None:
                    self.add(key, again)
                # stay for the rest of the interval, so that what arrives meanwhile waits for it
                await asyncio.sleep(max(0.0, started + self._min_interval - loop.time()))
        finally:
            self._running.pop(key, None)
