"""A limit on requests in flight, with two queues: a waiting urgent request goes before every normal one.

In a burst of new jobs the operator has many more requests to send than it lets fly at once. The ones
that start KubeRay's work (a job's ServiceAccount and RayJob) should not wait behind every other job's
ConfigMap, Role and RoleBinding, which are needed only once containers run.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator


class PrioritySlots:
    """At most `limit` holders at once; a freed slot goes to the oldest urgent waiter, else the oldest other."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self.in_use = 0
        self._waiting: tuple[deque[asyncio.Future[None]], deque[asyncio.Future[None]]] = (deque(), deque())

    @contextlib.asynccontextmanager
    async def slot(self, urgent: bool = False) -> AsyncIterator[None]:
        await self._acquire(urgent)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, urgent: bool) -> None:
        if self.in_use < self.limit and not any(self._waiting):
            self.in_use += 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._waiting[0 if urgent else 1]
        queue.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release()  # handed a slot just as it was cancelled: pass it on
            else:
                with contextlib.suppress(ValueError):  # already passed over by a release
                    queue.remove(waiter)
            raise

    def _release(self) -> None:
        """Hand the slot straight to the next waiter (so no newcomer can take it first), or free it."""
        for queue in self._waiting:
            while queue:
                waiter = queue.popleft()
                if not waiter.done():
                    waiter.set_result(None)
                    return
        self.in_use -= 1
