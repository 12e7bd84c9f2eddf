"""Whether the controller still reaches its Ray cluster's head.

Calls between actors go straight from worker to worker, so a controller on a worker pod keeps training after
the head (and with it the GCS and the driver) is gone, until its raylet gives up. Without GCS fault tolerance
the head's loss ends the Ray cluster: KubeRay resubmits the job on a new one, which resumes from the
checkpoint. The orphaned controller must stop rather than race it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import ray

PROBE_TIMEOUT_S = 2.0
PROBE_EVERY_S = 1.0  # at most one GCS round trip per second, however short the steps
LOST_AFTER_S = 10.0  # a GCS silent this long is gone; a busy one answers well within it


class HeadLost(RuntimeError):
    """The GCS has not answered for longer than the watch allows."""


def gcs_answers(timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """One read from the GCS's key-value store, which only the GCS can answer."""
    client = ray._private.worker.global_worker.gcs_client  # type: ignore[attr-defined]
    try:
        client.internal_kv_get(b"hybridflow-head-probe", b"hybridflow", timeout=timeout_s)
    except Exception:  # ray raises its RpcError (not exported) for a timeout or an unreachable GCS
        return False
    return True


class HeadWatch:
    """Raises HeadLost once the GCS has not answered for `lost_after_s` since its last answer."""

    def __init__(self, probe: Callable[[], bool] = gcs_answers, lost_after_s: float = LOST_AFTER_S,
                 every_s: float = PROBE_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.probe = probe
        self.lost_after_s = lost_after_s
        self.every_s = every_s
        self.clock = clock
        self.answered_at = clock()
        self.probed_at = float("-inf")

    def check(self) -> None:
        now = self.clock()
        if now - self.probed_at < self.every_s:
            return
        self.probed_at = now
        if self.probe():
            self.answered_at = self.clock()
            return
        silent = self.clock() - self.answered_at
        if silent >= self.lost_after_s:
            raise HeadLost(f"the Ray head (GCS) has not answered for {silent:.0f}s: the Ray cluster is lost, so "
                           "this controller stops; a resubmitted job resumes from the newest checkpoint")
