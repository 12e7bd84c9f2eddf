"""The operator's Prometheus metrics, in a registry of its own, served on `/metrics`.

A registry of its own, so a process that imports prometheus_client for something else (Ray does)
never mixes its series into the operator's. The queue metrics describe the operator's own work queue
(machinery/workqueue.py): the informers feed it, not kopf, so wait time is measured from the event
that marked a job dirty to the start of the run that handles it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from hybridflow_operator.machinery.workqueue import RunResult

PREFIX = "hybridflow_operator_"
CONDITIONS = ("Ready", "Reconciling", "Stalled", "Succeeded", "Failed", "Suspended")
RECONCILE_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
WAIT_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class OperatorMetrics:
    """Every metric of the operator; the client, the queue and the reconciler each record their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.reconcile_seconds = Histogram(
            f"{PREFIX}reconcile_duration_seconds",
            "Seconds one reconciliation of one RLTrainingJob took, by result: done, retry (it asked to run "
            "again later) or error (it raised).", ["result"], buckets=RECONCILE_BUCKETS_S, registry=self.registry)
        self.queue_wait_seconds = Histogram(
            f"{PREFIX}workqueue_wait_seconds",
            "Seconds from the watch event (or due retry) that queued a job to the start of the run handling it, "
            "the queue's pacing of one run per job per interval included.", buckets=WAIT_BUCKETS_S,
            registry=self.registry)
        self.api_requests = Counter(
            f"{PREFIX}api_requests_total",
            "Requests to the Kubernetes API server by verb and HTTP status code (\"error\" when no answer came).",
            ["verb", "code"], registry=self.registry)
        self.status_writes = Counter(
            f"{PREFIX}status_writes_total",
            "Status writes of RLTrainingJobs by result: written, conflict (someone wrote first; read and redo), "
            "gone (the job was deleted) or error.", ["result"], registry=self.registry)

    def waited(self, seconds: float) -> None:
        self.queue_wait_seconds.observe(seconds)

    def ran(self, seconds: float, result: RunResult) -> None:
        self.reconcile_seconds.labels(result).observe(seconds)

    def request(self, verb: str, code: int | None) -> None:
        """One API request; `code` None when it got no answer (connection error, timeout)."""
        self.api_requests.labels(verb, "error" if code is None else str(code)).inc()

    def status_write(self, result: str) -> None:
        self.status_writes.labels(result).inc()

    def observe(self, depth: Callable[[], int], jobs: Callable[[], Iterable[Mapping[str, Any]]]) -> None:
        """Read the queue depth and the jobs' statuses when scraped: `depth()` and the statuses `jobs()`."""
        self.registry.register(_LiveCollector(depth, jobs))

    def serve(self, port: int, address: str = "0.0.0.0") -> None:
        """`/metrics` on `port`, from a daemon thread (OSError when the port is taken)."""
        start_http_server(port, address, registry=self.registry)


def jobs_by_condition(statuses: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """How many jobs have each condition True; every condition appears, with 0 when none has it."""
    counts = dict.fromkeys(CONDITIONS, 0)
    for status in statuses:
        for c in status.get("conditions") or []:
            if c.get("status") == "True" and c.get("type") in counts:
                counts[c["type"]] += 1
    return counts


class _LiveCollector(Collector):
    def __init__(self, depth: Callable[[], int], jobs: Callable[[], Iterable[Mapping[str, Any]]]) -> None:
        self._depth = depth
        self._jobs = jobs

    def collect(self) -> Iterable[GaugeMetricFamily]:
        depth = GaugeMetricFamily(f"{PREFIX}workqueue_depth",
                                  "RLTrainingJobs queued for a reconciliation that has not started yet.")
        depth.add_metric([], self._depth())
        yield depth
        jobs = GaugeMetricFamily(f"{PREFIX}jobs", "RLTrainingJobs seen by the operator with the condition True.",
                                 labels=["condition"])
        for condition, n in jobs_by_condition(self._jobs()).items():
            jobs.add_metric([condition], n)
        yield jobs
