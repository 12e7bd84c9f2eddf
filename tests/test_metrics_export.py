"""What the Prometheus metrics are made of, without Ray or an API server: the step record's phases, the
edge counts an exporter reads once, the operator's queue observer and its /metrics endpoint.

A real Prometheus server scrapes a live run and the operator in e2e/test_prometheus.py.
"""

from __future__ import annotations

import asyncio
import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hybridflow import telemetry
from hybridflow.scheduler.edges import EdgeChannel, LatencyStats
from hybridflow_operator.machinery.workqueue import RunResult, WorkQueue
from hybridflow_operator.metrics import CONDITIONS, OperatorMetrics, jobs_by_condition
from hybridflow_operator.settings import SettingsError, from_env


def test_every_phase_of_a_step_record_has_its_label_and_orchestration_is_derived() -> None:
    record = {"timing/generate": 0.5, "timing/reward": 0.1, "timing/ref_log_probs": 0.2,
              "timing/old_log_probs": 0.05, "timing/values": 0.3, "timing/advantages": 0.01,
              "timing/update": 0.9, "timing/rollout": 1.0, "timing/step": 2.0, "orchestration_overhead_frac": 0.25}
    assert telemetry.phase_seconds(record) == {
        "generate": 0.5, "reward": 0.1, "reference": 0.2, "old_log_probs": 0.05, "values": 0.3,
        "advantages": 0.01, "update": 0.9, "orchestration": 0.5}
    assert telemetry.phase_seconds({"timing/step": 1.0}) == {}


def test_latency_samples_since_a_count_are_the_new_ones_up_to_the_window() -> None:
    s = LatencyStats(window=4)
    for x in (1.0, 2.0, 3.0):
        s.add(x)
    assert s.since(0) == [1.0, 2.0, 3.0]
    assert s.since(2) == [3.0]
    assert s.since(3) == []
    for x in (4.0, 5.0, 6.0):
        s.add(x)
    assert s.since(3) == [4.0, 5.0, 6.0]
    assert s.since(0) == [3.0, 4.0, 5.0, 6.0]  # older samples left the window


def test_queue_peak_counts_sequences_since_the_last_look_and_bytes_are_counted_per_batch() -> None:
    ch = EdgeChannel("a->b", high_watermark=2, max_size_bytes=200, finished=lambda refs: set())
    for ref, sequences in (("r1", 8), ("r2", 8), ("r3", 4)):
        ch.put(ref, sequences)  # type: ignore[arg-type]
    assert ch.take_peak() == 20
    assert ch.take_peak() == 20  # still twenty queued
    ch._items.clear()  # as a drain leaves it
    assert ch.take_peak() == 20 and ch.take_peak() == 0
    ch.record_bytes(60)
    ch.record_bytes(160)
    assert ch.bytes_total == 220 and ch.sizes.count == 2


def test_jobs_are_counted_by_each_true_condition() -> None:
    statuses = [
        {"conditions": [{"type": "Ready", "status": "True"}, {"type": "Reconciling", "status": "False"}]},
        {"conditions": [{"type": "Ready", "status": "True"}, {"type": "Succeeded", "status": "True"}]},
        {},
    ]
    counts = jobs_by_condition(statuses)
    assert counts == {**dict.fromkeys(CONDITIONS, 0), "Ready": 2, "Succeeded": 1}


class Recorder:
    def __init__(self) -> None:
        self.waits: list[float] = []
        self.runs: list[RunResult] = []

    def waited(self, seconds: float) -> None:
        self.waits.append(seconds)

    def ran(self, seconds: float, result: RunResult) -> None:
        self.runs.append(result)


def test_the_queue_reports_each_runs_wait_and_result() -> None:
    async def scenario() -> tuple[Recorder, list[int]]:
        rec = Recorder()
        depths: list[int] = []
        outcomes = iter([None, 0.01, RuntimeError("bug")])

        async def work(key: str) -> float | None:
            depths.append(queue.depth)
            outcome = next(outcomes)
            if isinstance(outcome, Exception):
                raise outcome
            return outcome

        queue: WorkQueue[str] = WorkQueue(work, min_interval=0.2, error_delay=30.0, observer=rec)
        queue.add("a")
        queue.add("a")  # coalesced into the same run
        await asyncio.sleep(0.05)
        queue.add("a")  # during the run's interval: waits for it
        assert queue.depth == 1
        await asyncio.sleep(0.6)
        queue.close()
        return rec, depths

    rec, depths = asyncio.run(scenario())
    assert rec.runs == ["done", "retry", "error"]
    assert rec.waits[0] < 0.1 and rec.waits[1] >= 0.1  # the second waited out the interval
    assert depths == [0, 0, 0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_operator_serves_its_metrics_with_prometheus_names() -> None:
    metrics = OperatorMetrics()
    metrics.request("create", 201)
    metrics.request("get", None)
    metrics.status_write("written")
    metrics.ran(0.02, "done")
    metrics.waited(0.5)
    metrics.observe(lambda: 3, lambda: [{"conditions": [{"type": "Failed", "status": "True"}]}])
    port = free_port()
    metrics.serve(port, "127.0.0.1")
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("hybridflow_operator_api_requests_total", (("code", "201"), ("verb", "create")))] == 1
    assert samples[("hybridflow_operator_api_requests_total", (("code", "error"), ("verb", "get")))] == 1
    assert samples[("hybridflow_operator_status_writes_total", (("result", "written"),))] == 1
    assert samples[("hybridflow_operator_reconcile_duration_seconds_count", (("result", "done"),))] == 1
    assert samples[("hybridflow_operator_workqueue_wait_seconds_count", ())] == 1
    assert samples[("hybridflow_operator_workqueue_depth", ())] == 3
    assert samples[("hybridflow_operator_jobs", (("condition", "Failed"),))] == 1
    assert samples[("hybridflow_operator_jobs", (("condition", "Ready"),))] == 0
    assert not any(name.startswith("python_") or name.startswith("process_") for name, _ in samples)


def test_metrics_port_setting() -> None:
    assert from_env({}).metrics_port == 8081
    assert from_env({"HYBRIDFLOW_METRICS_PORT": "0"}).metrics_port == 0
    with pytest.raises(SettingsError, match="HYBRIDFLOW_METRICS_PORT"):
        from_env({"HYBRIDFLOW_METRICS_PORT": "http"})
