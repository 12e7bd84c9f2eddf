"""The live page on the Ray head: `hybridflow train` in a cluster serves it itself, for the life of the run.

On the head's named port (contract.DASHBOARD_PORT), which KubeRay's head Services expose and
status.schedulerDashboardUrl links to. Its data is the job's controller, found by name once it exists: the
page is up before the controller is and says what it waits for. A port that cannot be bound is a warning;
training goes on without the page.
"""

from __future__ import annotations

import logging
from http.server import ThreadingHTTPServer
from typing import Any

from hybridflow.control.errors import ControlError
from hybridflow.control.names import JobRef
from hybridflow.dashboard.feed import Controller, Feed
from hybridflow.dashboard.server import DashboardError, serve_in_background
from hybridflow.k8s.contract import DASHBOARD_PORT

log = logging.getLogger(__name__)
ALL_INTERFACES = "0.0.0.0"


class ControllerByName:
    """The job's controller actor in the Ray cluster this process has joined, looked up until it is found."""

    def __init__(self, ref: JobRef) -> None:
        self.ref = ref
        self._handle: Controller | None = None

    def call(self, method: str, *args: Any, timeout_s: float) -> Any:
        if self._handle is None:
            import ray

            if not ray.is_initialized():
                raise ControlError(f"job {self.ref}: this process has not joined a Ray cluster")
            from hybridflow.control.client import connect

            self._handle = connect(str(self.ref))  # ControlError until run_training has created it
        return self._handle.call(method, *args, timeout_s=timeout_s)


def serve_on_head(ref: JobRef, port: int = DASHBOARD_PORT, host: str = ALL_INTERFACES,
                  job: Controller | None = None) -> ThreadingHTTPServer | None:
    """Serve `ref`'s live page on `port` (0: any free one) from a daemon thread; None when it cannot."""
    feed = Feed(None, job or ControllerByName(ref), str(ref))
    try:
        server = serve_in_background(feed, host, port, tries=1)  # the Service exposes this port, not the next
    except DashboardError as e:
        log.warning("the scheduler dashboard is not served (%s); training goes on without it", e)
        return None
    log.info("scheduler dashboard of %s on port %d", ref, server.server_address[1])
    return server
