"""Dispatch overlaps compute: a remote step's next micro-batch moves to its host while the current one computes.

On a local cluster of three raylets, chunks made on one raylet go to a consumer on another through
HostGroup.next, as the rollout phase streams them. Each call holds until the next call's chunk is in the
consumer's object store, so the test sees the transfer land during a compute or not at all.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import ray

from benchmarks.dispatch import Consumer, OneHost, Producer, start_cluster, streamed
from hybridflow.scheduler.group import HostGroup

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

HOLD_S = 120.0
"""How long a call waits for the next chunk: far above a transfer of a few MB on a busy machine."""


@pytest.fixture(scope="module")
def ends() -> Iterator[tuple[Any, HostGroup]]:
    cluster = start_cluster()
    try:
        producer, consumer = Producer.remote(), Consumer.remote()
        ray.get(consumer.node_id.remote())
        yield producer, HostGroup("consumer", OneHost(consumer))
    finally:
        ray.shutdown()
        cluster.shutdown()


def chunks(producer: Any, base: int, n: int = 4) -> list[ray.ObjectRef]:
    refs = [producer.make.remote(16, 2048, base + i) for i in range(n)]
    ray.wait(refs, num_returns=n)
    return refs


def test_streamed_chunks_arrive_while_the_call_before_them_computes(ends: tuple[Any, HostGroup]) -> None:
    producer, group = ends
    calls = streamed(group, chunks(producer, 0), seconds=0.05, hold_s=HOLD_S)
    assert [c["bytes"] for c in calls] == [calls[0]["bytes"]] * 4 and calls[0]["bytes"] > 2**20
    arrived = [c["next_arrived_s"] for c in calls[:-1]]
    assert all(a is not None and a < HOLD_S for a in arrived), arrived
    assert calls[-1]["next_arrived_s"] is None  # nothing after the last


def test_a_serial_dispatch_moves_no_chunk_during_a_compute(ends: tuple[Any, HostGroup]) -> None:
    """The contrast that shows the probe can fail: the next call (and its chunk) leaves only after a return."""
    producer, group = ends
    calls = streamed(group, chunks(producer, 100, 3), seconds=0.05, hold_s=1.0, window=1)
    assert [c["next_arrived_s"] for c in calls] == [None, None, None]
