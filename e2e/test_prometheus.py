"""The metrics, as a real Prometheus server sees them: a live local training run and the operator.

Prometheus (Debian's `prometheus`, installed by e2e/toolchain/install-node-packages.sh) scrapes the
local Ray node's metrics endpoint, renaming `ray_hybridflow_*` to `hybridflow_*` as the chart's
PodMonitor does, and the operator's /metrics while it reconciles jobs on a real kube-apiserver. Every
query of every panel of the chart's Grafana dashboard must return data, and the step counter must agree
with metrics.jsonl. Ray reports each process's metrics to its node's exporter once a report interval
(10 s by default): the test makes it 1 s.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.harness.controlplane import ControlPlane
from e2e.harness.operator import OperatorProcess
from e2e.harness.prometheus import PrometheusServer, find_prometheus
from tests.helpers import unavailable

pytestmark = [pytest.mark.controlplane, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "charts" / "hybridflow" / "dashboards" / "hybridflow.json"
STEPS = 6
EDGE = "actor_rollout->reward"
WAIT_S = 240.0  # a busy 2-core machine: Ray reports each second, Prometheus scrapes each second
RAY_STARTS = 5
PHASES = {"generate", "reward", "reference", "values", "advantages", "update", "orchestration"}


def poll(check: Callable[[], Any], what: str, timeout: float = WAIT_S) -> Any:
    """`check()` until it returns something truthy; AssertionError naming `what` and the last answer."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(1.0)
    raise AssertionError(f"{what}: not within {timeout:.0f} s (last: {last!r})")


WINDOW = "$window"


def panel_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of the dashboard, its variables given values for all jobs; the
    window is left as WINDOW, to span the test when queried (a rate over a window the run's steps have left
    is 0/0)."""
    dashboard = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = (target["expr"].replace("$training_job", ".*").replace("$__rate_interval", WINDOW)
                    .replace("$__range", WINDOW))
            out.append((panel["title"], expr))
    return out


def training_doc(name: str, tmp_path: Path) -> dict[str, Any]:
    """The tiny PPO job with its reward on a node of its own, so a data edge goes through the object store. The
    reward is slowed so that the run spans several scrapes: a counter Prometheus first sees at its final value
    has no rate."""
    doc = yaml.safe_load((ROOT / "examples" / "tiny-ppo-remote-reward.yaml").read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["reward"]["function"] = "tests.slow_reward:score"
    doc["spec"]["scheduling"] = {"microBatchSize": 8}
    doc["spec"]["trainer"].update(totalSteps=STEPS, resume="never",
                                  checkpoint={"every": 0, "path": str(tmp_path / "ckpt")})
    return doc


@pytest.fixture(scope="module")
def prometheus_binary() -> str:
    found = find_prometheus()
    if found is None:
        unavailable("no prometheus binary: run `sudo bash e2e/toolchain/install-node-packages.sh` "
                    "(Debian's prometheus package)")
    return found


@pytest.fixture
def local_ray(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """A fresh local Ray reporting metrics each second; yields its metrics port.

    A second local Ray on the machine may hold the dashboard agent's fixed port (52365) or take the
    metrics port picked here: start again, a few times, until the node's metrics endpoint answers.
    """
    import ray

    from e2e.harness.controlplane import free_port, http_ok
    from hybridflow.driver import init_ray

    monkeypatch.setenv("RAY_metrics_report_interval_ms", "1000")
    monkeypatch.setenv("HYBRIDFLOW_METRICS", "1")
    # a loaded machine starts the node's agents slowly; the raylet gives them this long to report their ports
    monkeypatch.setenv("RAY_raylet_start_wait_time_s", "120")
    monkeypatch.setenv("RAY_agent_register_timeout_ms", "120000")
    if ray.is_initialized():  # an earlier module's Ray, without a metrics port of ours
        ray.shutdown()
    error: Exception | None = None
    for _ in range(RAY_STARTS):
        port = free_port()
        try:
            init_ray(local=True, num_cpus=8, metrics_port=port)
            poll(lambda p=port: http_ok(f"http://127.0.0.1:{p}/metrics"), "Ray's metrics endpoint", timeout=120)
        except Exception as e:
            error = e
            ray.shutdown()
            time.sleep(10)
            continue
        try:
            yield port
        finally:
            ray.shutdown()
        return
    pytest.fail(f"local Ray with a metrics endpoint did not start in {RAY_STARTS} attempts: {error}")


@pytest.fixture
def operator(kuberay_crds: ControlPlane, tmp_path: Path) -> Iterator[OperatorProcess]:
    env = {**kuberay_crds.env, "HYBRIDFLOW_STATUS_INTERVAL": "600", "PYTHONUNBUFFERED": "1"}
    op = OperatorProcess(tmp_path / "operator.log", env)
    op.start()
    try:
        yield op
    finally:
        op.stop()


def apply_job(cp: ControlPlane, namespace: str, name: str) -> None:
    doc = yaml.safe_load((ROOT / "examples" / "ppo-job.yaml").read_text())
    doc["metadata"].update(name=name, namespace=namespace)
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))


def value(samples: list[dict[str, Any]]) -> float:
    return float(samples[0]["value"][1])


def finite(samples: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(s["value"][1])) for s in samples)


def test_every_dashboard_query_returns_data_from_a_live_run_and_the_operator(
    prometheus_binary: str, local_ray: int, operator: OperatorProcess, kuberay_crds: ControlPlane,
    namespace: str, tmp_path: Path,
) -> None:
    from hybridflow import telemetry
    from hybridflow.api import parse_job
    from hybridflow.trainer import Trainer

    rename = {"source_labels": ["__name__"], "regex": f"{telemetry.RAY_PREFIX}({telemetry.PREFIX}.*)",
              "target_label": "__name__", "replacement": "$1"}
    prom = PrometheusServer(prometheus_binary, tmp_path / "prometheus", {
        "ray": {"targets": [f"127.0.0.1:{local_ray}"], "metric_relabel_configs": [rename]},
        "operator": {"targets": [f"127.0.0.1:{operator.metrics_port}"]},
    }).start()
    trainer = None
    started = time.monotonic()
    try:
        poll(lambda: all(prom.targets_up().values()) and len(prom.targets_up()) == 2, "both targets up")
        apply_job(kuberay_crds, namespace, "metrics-a")

        job = parse_job(training_doc("metrics-run", tmp_path))
        metrics_path = tmp_path / "metrics.jsonl"
        trainer = Trainer(job.model_dump(by_alias=True, mode="json"), str(metrics_path))
        result = trainer.fit()
        apply_job(kuberay_crds, namespace, "metrics-b")  # more reconciles, later in the window
        records = result["records"]
        assert [r["step"] for r in records] == list(range(1, STEPS + 1))

        # the step counter and the last step agree with metrics.jsonl
        run = 'training_job="metrics-run"'
        poll(lambda: (s := prom.query(f"max(hybridflow_steps_total{{{run}}})")) and value(s) == len(records),
             "hybridflow_steps_total equal to the records of metrics.jsonl")
        assert value(prom.query(f"max(hybridflow_step{{{run}}})")) == records[-1]["step"]
        # the edge histogram holds every transfer the channel measured, and the bytes it counted
        channel = trainer.scheduler.channel(EDGE)
        edge = f'{run}, edge="{EDGE}"'
        poll(lambda: (s := prom.query(f"max(hybridflow_edge_transfer_seconds_count{{{edge}}})"))
             and value(s) == channel.latency.count, "edge transfer count equal to the channel's")
        assert channel.bytes_total > 0
        assert value(prom.query(f"max(hybridflow_edge_transfer_bytes_total{{{edge}}})")) == channel.bytes_total
        phases = {s["metric"]["phase"] for s in prom.query(f"hybridflow_step_phase_seconds_total{{{run}}}")}
        assert phases >= PHASES, phases
        # every job the operator reconciled is counted by condition; its requests and writes are counted
        poll(lambda: (s := prom.query('sum(hybridflow_operator_status_writes_total{result="written"})'))
             and value(s) >= 2, "two status writes")
        assert value(prom.query('sum(hybridflow_operator_api_requests_total{verb="create"})')) >= 2

        missing: dict[str, str] = {}
        def since_start(expr: str) -> str:
            return expr.replace(WINDOW, f"{math.ceil(time.monotonic() - started) + 60}s")

        for title, expr in panel_queries():
            try:
                poll(lambda e=expr: finite(prom.query(since_start(e))), f"panel {title!r}", timeout=120)
            except AssertionError as e:
                missing[title] = f"{expr}: {e}"
        assert not missing, "dashboard queries without data:\n" + "\n".join(missing.values())
    finally:
        if trainer is not None:
            trainer.shutdown()
        prom.stop()
