"""PrioritySlots: the limit on requests in flight, urgent waiters first, no slot lost to a cancellation."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from hybridflow_operator.machinery.slots import PrioritySlots

T = TypeVar("T")


def test_no_more_than_the_limit_hold_a_slot_at_once() -> None:
    async def scenario() -> tuple[int, int]:
        slots = PrioritySlots(3)
        holding, most = 0, 0

        async def request(i: int) -> None:
            nonlocal holding, most
            async with slots.slot(urgent=i % 2 == 0):
                holding += 1
                most = max(most, holding)
                await asyncio.sleep(0.001)
                holding -= 1

        await asyncio.gather(*(request(i) for i in range(20)))
        return most, slots.in_use

    assert run(scenario()) == (3, 0)


def test_a_freed_slot_goes_to_the_oldest_urgent_waiter_first() -> None:
    async def scenario() -> list[str]:
        slots = PrioritySlots(1)
        order: list[str] = []
        release = asyncio.Event()

        async def holder() -> None:
            async with slots.slot():
                await release.wait()

        async def request(name: str, urgent: bool) -> None:
            async with slots.slot(urgent):
                order.append(name)

        first = asyncio.create_task(holder())
        await asyncio.sleep(0)
        waiting = []
        for name, urgent in (("configmap-a", False), ("rayjob-a", True), ("role-a", False), ("rayjob-b", True)):
            waiting.append(asyncio.create_task(request(name, urgent)))
            await asyncio.sleep(0)
        release.set()
        await asyncio.gather(first, *waiting)
        return order

    assert run(scenario()) == ["rayjob-a", "rayjob-b", "configmap-a", "role-a"]


def test_a_cancelled_waiter_loses_no_slot() -> None:
    async def scenario() -> tuple[int, bool]:
        slots = PrioritySlots(1)
        release = asyncio.Event()

        async def holder() -> None:
            async with slots.slot():
                await release.wait()

        held = asyncio.create_task(holder())
        await asyncio.sleep(0)
        waiting = asyncio.create_task(slots.slot(urgent=True).__aenter__())
        await asyncio.sleep(0)
        waiting.cancel()
        release.set()
        await held
        with pytest.raises(asyncio.CancelledError):
            await waiting
        in_use = slots.in_use
        async with asyncio.timeout(1):  # a newcomer gets the slot at once
            async with slots.slot():
                pass
        return in_use, slots.in_use == 0

    assert run(scenario()) == (0, True)


def test_a_limit_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="limit must be >= 1"):
        PrioritySlots(0)


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)
