"""The runtime's Prometheus metrics, defined once and recorded through Ray's metrics API.

Ray serves them on every node's metrics endpoint (`ray start --metrics-export-port`, which KubeRay pods
expose; locally `init_ray(metrics_port=...)`), under the name given here with Ray's `ray_` in front:
the chart's PodMonitor and the test's scrape config rename `ray_hybridflow_*` back to `hybridflow_*`,
the names the Grafana dashboard queries. Labels are bounded: the job name, graph node, edge, phase,
decision kind and worker (graph node and instance index, bounded by parallelism); never steps or pids.

The controller records one step at a time (`StepExporter.export`), the scheduler one decision at a time
(`count_decision`), and every worker process its own memory (`watch_memory`), since only that process
knows it. Gauges are set again every period by a daemon thread (_GaugeKeeper): Ray drops a gauge value
not refreshed within two of its report intervals.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from ray.util.metrics import Counter, Gauge, Histogram

    from hybridflow.scheduler.hybrid import HybridScheduler

log = logging.getLogger(__name__)

PREFIX = "hybridflow_"
RAY_PREFIX = "ray_"
"""What Ray's exporter puts before every application metric name."""
JOB_LABEL = "training_job"
"""The RLTrainingJob's name; not `job`, which Prometheus gives every target (a clash renames ours exported_job)."""
ENABLED_ENV = "HYBRIDFLOW_METRICS"
"""Set to 0 to record no metrics at all (benchmarks/metrics_overhead.py compares the two)."""
REPORT_INTERVAL_ENV = "RAY_metrics_report_interval_ms"
"""Ray's setting of how often each process reports its metrics to the node's exporter (tests make it 1 s)."""

PHASES: dict[str, str] = {
    "generate": "timing/generate",
    "reward": "timing/reward",
    "reference": "timing/ref_log_probs",
    "old_log_probs": "timing/old_log_probs",
    "values": "timing/values",
    "advantages": "timing/advantages",
    "update": "timing/update",
    "weight_sync": "timing/sync",
}
"""Phase label -> the step record's key holding its seconds; "orchestration" is derived (see phase_seconds)."""

DecisionKind = Literal["placement", "colocation", "stage", "distributed", "backpressure_up", "backpressure_down",
                       "backpressure_refused", "manual_up", "manual_down", "manual_refused",
                       "sequence_parallel"]

STEP_BUCKETS_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0]
LATENCY_BUCKETS_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]


@dataclass(frozen=True)
class _Metrics:
    steps: Counter
    step: Gauge
    phase_seconds: Counter
    step_seconds: Histogram
    tokens_per_second: Gauge
    reward_mean: Gauge
    val_reward_mean: Gauge
    kl: Gauge
    policy_lag: Gauge
    edge_latency: Histogram
    edge_bytes: Counter
    edge_queue: Gauge
    parallelism: Gauge
    decisions: Counter
    worker_memory: Gauge


@functools.cache
def _metrics() -> _Metrics:
    """The metric objects of this process, made on first use (Ray must be initialized by then)."""
    from ray.util.metrics import Counter, Gauge, Histogram

    job = (JOB_LABEL,)
    return _Metrics(
        steps=Counter(f"{PREFIX}steps_total", "Training steps completed by this controller process.", job),
        step=Gauge(f"{PREFIX}step", "The last completed step number (the `step` of metrics.jsonl).", job),
        phase_seconds=Counter(
            f"{PREFIX}step_phase_seconds_total",
            "Seconds spent in each phase of the steps: worker-timed generate, reward, reference, old_log_probs "
            "and values; advantages, update and weight_sync (the policy crossing its control edge to rollout) "
            "as the controller timed them; orchestration is the steps' wall "
            "time not spent in worker compute on the critical path. Divided by steps_total: seconds per step.",
            (*job, "phase")),
        step_seconds=Histogram(f"{PREFIX}step_duration_seconds", "Wall time of one training step.",
                               STEP_BUCKETS_S, job),
        tokens_per_second=Gauge(f"{PREFIX}tokens_per_second", "Response tokens generated per second of step time.",
                                job),
        reward_mean=Gauge(f"{PREFIX}reward_mean", "Mean reward of the last step's rollouts.", job),
        val_reward_mean=Gauge(f"{PREFIX}val_reward_mean", "Mean reward on spec.data.val at the last evaluation.",
                              job),
        kl=Gauge(f"{PREFIX}kl", "KL divergence of the policy from the reference on the last step's rollouts.", job),
        policy_lag=Gauge(
            f"{PREFIX}policy_version_lag",
            "Policy updates between the weights that generated a step's rollouts and the weights its update "
            "started from: 0 with consistency strong, at most 1 with eventual (one-step off-policy).", job),
        edge_latency=Histogram(
            f"{PREFIX}edge_transfer_seconds",
            "Seconds from putting a batch on a data edge to the consumer having its result (queueing included).",
            LATENCY_BUCKETS_S, (*job, "edge")),
        edge_bytes=Counter(f"{PREFIX}edge_transfer_bytes_total",
                           "Bytes sent over a data edge through the object store.", (*job, "edge")),
        edge_queue=Gauge(f"{PREFIX}edge_queue_depth",
                         "Most sequences queued on a data edge at once during the last step.", (*job, "edge")),
        parallelism=Gauge(f"{PREFIX}node_parallelism", "Instances serving a graph node now.", (*job, "node")),
        decisions=Counter(
            f"{PREFIX}scheduler_decisions_total",
            "Scheduling decisions by kind: placement groups, co-location, stages, data-parallel setup, and "
            "backpressure raising, lowering or refused for lack of resources.", (*job, "kind")),
        worker_memory=Gauge(
            f"{PREFIX}worker_memory_bytes",
            "Memory of a worker process: GPU memory reserved by torch where it runs on a GPU, else its RSS.",
            (*job, "worker", "memory")),
    )


def enabled() -> bool:
    """Ray is up in this process and metrics are not turned off (HYBRIDFLOW_METRICS=0); a process that never
    imported Ray (a host used directly by tests) has no metrics endpoint."""
    ray = sys.modules.get("ray")
    return os.environ.get(ENABLED_ENV, "1") != "0" and ray is not None and bool(ray.is_initialized())


def phase_seconds(record: Mapping[str, Any]) -> dict[str, float]:
    """Seconds per phase label from a step record (see PHASES); absent phases are left out."""
    out = {phase: float(record[key]) for phase, key in PHASES.items() if key in record}
    if "timing/step" in record and "orchestration_overhead_frac" in record:
        out["orchestration"] = float(record["timing/step"]) * float(record["orchestration_overhead_frac"])
    return out


class StepExporter:
    """Records a controller's steps; remembers what it already exported of the cumulative edge counts."""

    def __init__(self, job: str) -> None:
        self.job = job
        self._latency_seen: dict[str, int] = {}
        self._bytes_seen: dict[str, int] = {}

    def export(self, record: Mapping[str, Any], scheduler: HybridScheduler) -> None:
        if not enabled():
            return
        m, keep = _metrics(), _keeper()
        job = {JOB_LABEL: self.job}
        m.steps.inc(1, job)
        keep.set(m.step, record["step"], job)
        m.step_seconds.observe(record["timing/step"], job)
        for phase, seconds in phase_seconds(record).items():
            if seconds > 0:
                m.phase_seconds.inc(seconds, {**job, "phase": phase})
        keep.set(m.tokens_per_second, record["tokens_per_s"], job)
        keep.set(m.reward_mean, record["reward_mean"], job)
        self.export_eval(record)
        keep.set(m.kl, record.get("kl", 0.0), job)
        keep.set(m.policy_lag, record.get("policy_lag", 0), job)
        for node in scheduler.graph.nodes:
            keep.set(m.parallelism, scheduler.instance_count(node.name), {**job, "node": node.name})
        for edge in scheduler.graph.data_edges():
            self._export_edge(m, edge.key, scheduler)

    def export_eval(self, record: Mapping[str, Any]) -> None:
        """The val/ reward of a record that has one: a step's, or the baseline's before training (step 0)."""
        if enabled() and "val/reward_mean" in record:
            _keeper().set(_metrics().val_reward_mean, record["val/reward_mean"], {JOB_LABEL: self.job})

    def _export_edge(self, m: _Metrics, key: str, scheduler: HybridScheduler) -> None:
        channel = scheduler.channel(key)
        tags = {JOB_LABEL: self.job, "edge": key}
        for seconds in channel.latency.since(self._latency_seen.get(key, 0)):
            m.edge_latency.observe(seconds, tags)
        self._latency_seen[key] = channel.latency.count
        sent = channel.bytes_total - self._bytes_seen.get(key, 0)
        if sent > 0:
            m.edge_bytes.inc(sent, tags)
        self._bytes_seen[key] = channel.bytes_total
        _keeper().set(m.edge_queue, channel.take_peak(), tags)


def count_decision(job: str, kind: DecisionKind) -> None:
    """One scheduling decision of `kind` (a no-op outside Ray, e.g. pure unit tests)."""
    if enabled():
        _metrics().decisions.inc(1, {JOB_LABEL: job, "kind": kind})


def memory_bytes(device: Any) -> tuple[str, int]:
    """("gpu", bytes torch reserved on the device) on CUDA, else ("rss", resident set size of this process)."""
    import torch

    if getattr(device, "type", str(device)) == "cuda" and torch.cuda.is_available():
        return "gpu", int(torch.cuda.memory_reserved(device))
    import psutil

    return "rss", int(psutil.Process().memory_info().rss)


def watch_memory(job: str, worker: str, device: Any) -> None:
    """Keep this worker process's memory gauge current (a no-op outside Ray: a host used directly by tests)."""
    if not enabled():
        return
    gauge = _metrics().worker_memory

    def sample() -> None:
        kind, value = memory_bytes(device)
        _keeper().set(gauge, value, {JOB_LABEL: job, "worker": worker, "memory": kind})

    _keeper().every_period(sample)


def refresh_period_s() -> float:
    """Half of Ray's metrics report interval (RAY_metrics_report_interval_ms, 10 s by default), at most 5 s."""
    interval_ms = float(os.environ.get(REPORT_INTERVAL_ENV, "10000"))
    return min(5.0, max(interval_ms, 1000.0) / 2000.0)


class _GaugeKeeper:
    """Sets every gauge of this process again, and runs the samplers, once a period in a daemon thread.

    Ray's exporter forgets a gauge value that was not set again within two report intervals, so a gauge
    set once per step would vanish between slow steps, and one set once (a worker's memory) at once.
    """

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self._lock = threading.Lock()
        self._values: dict[tuple[int, frozenset[tuple[str, str]]], tuple[Gauge, float, dict[str, str]]] = {}
        self._samplers: list[Callable[[], None]] = []
        self._thread: threading.Thread | None = None

    def set(self, gauge: Gauge, value: float, tags: dict[str, str]) -> None:
        gauge.set(value, tags)
        with self._lock:
            self._values[(id(gauge), frozenset(tags.items()))] = (gauge, value, tags)
        self._start()

    def every_period(self, sampler: Callable[[], None]) -> None:
        _quietly(sampler)
        with self._lock:
            self._samplers.append(sampler)
        self._start()

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hybridflow-metrics", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(self.period_s)
            with self._lock:
                values, samplers = list(self._values.values()), list(self._samplers)
            for gauge, value, tags in values:
                _quietly(functools.partial(gauge.set, value, tags))
            for sampler in samplers:
                _quietly(sampler)


@functools.cache
def _keeper() -> _GaugeKeeper:
    return _GaugeKeeper(refresh_period_s())


def _quietly(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as e:  # a metrics hiccup must never take a worker or the controller down
        log.debug("metrics: %s", e)
