"""A token bucket for asyncio: at most `rate` acquisitions a second on average, `burst` at once.

Status writes go through one, so a thousand jobs changing at once spread their writes out instead of
crowding the API server that KubeRay and the scheduler need; a job that waits for a token writes the
status as it is by then, so the wait also merges changes.
"""

from __future__ import annotations

import asyncio
import time


class TokenBucket:
    """FIFO waiters; tokens refill continuously."""

    def __init__(self, rate: float, burst: float) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError(f"rate must be > 0 and burst >= 1, got rate={rate} burst={burst}")
        self.rate = rate
        self.burst = burst
        self._tokens = burst
        self._updated = time.monotonic()
        self._lock = asyncio.Lock()

    def set_rate(self, rate: float) -> None:
        """Change the rate from now on (tokens earned so far stay)."""
        if rate <= 0:
            raise ValueError(f"rate must be > 0, got {rate}")
        self._refill()
        self.rate = rate

    def _refill(self) -> None:
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._updated) * self.rate)
        self._updated = now

    async def acquire(self) -> None:
        async with self._lock:  # one waiter at a time: first come, first served
            self._refill()
            if self._tokens < 1:
                await asyncio.sleep((1 - self._tokens) / self.rate)
                self._refill()
            self._tokens -= 1
