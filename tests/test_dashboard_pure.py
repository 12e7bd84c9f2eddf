"""The dashboard without a browser: the view model's numbers, the page, the feed, the server, the CLI, and the
page `hybridflow train` serves on the Ray head (one slow test trains for real)."""

from __future__ import annotations

import json
import math
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from hybridflow.control.errors import ControlError
from hybridflow.control.names import JobRef
from hybridflow.dashboard import build_view, render_page, report_path, step_split, write_report
from hybridflow.dashboard.feed import Feed
from hybridflow.dashboard.head import serve_on_head
from hybridflow.dashboard.server import DashboardError, bind, url_of
from hybridflow.dashboard.view import breakdown, curves, decisions, edges, graph, memory, thin
from hybridflow.metrics import MetricsLog, parse_records
from tests.conftest import ROOT
from tests.helpers import wait_for


def record(step: int, **over: Any) -> dict[str, Any]:
    r = {"step": step, "reward_mean": 0.1 * step, "kl": 0.01 * step, "tokens_per_s": 100.0 + step,
         "timing/step": 2.0, "orchestration_overhead_frac": 0.25, "timing/rollout": 1.2,
         "timing/advantages": 0.1, "timing/update": 0.5, "timing/generate": 0.9}
    return {**r, **over}


def status() -> dict[str, Any]:
    """A control_status of PPO: actor and reference share hosts, reward has its own, critic trains apart."""
    def worker(i: int, node: str, actor: str, mem: int | None) -> dict[str, Any]:
        return {"instance": i, "node_id": node, "pid": 100 + i, "gpu_ids": [], "actor": actor,
                "memory": None if mem is None else {"kind": "rss", "bytes": mem}}

    return {
        "job": "default/tiny", "step": 7, "total_steps": 10,
        "nodes": {
            "actor_rollout": {"role": "actor_rollout", "group": "actor_rollout+reference", "parallelism": 1,
                              "planned_parallelism": 1, "target_parallelism": 1, "queue_len": 0,
                              "workers": [worker(0, "n1", "hf-a-1", 300)]},
            "reference": {"role": "reference", "group": "actor_rollout+reference", "parallelism": 1,
                          "planned_parallelism": 1, "target_parallelism": 1, "queue_len": 0,
                          "workers": [worker(0, "n1", "hf-a-1", 300)]},
            "reward": {"role": "reward", "group": "reward", "parallelism": 2, "planned_parallelism": 1,
                       "target_parallelism": 2, "queue_len": 1,
                       "workers": [worker(0, "n2", "hf-r-2", 100), worker(1, "n1", "hf-r-3", None)]},
            "critic": {"role": "critic", "group": "critic", "parallelism": 1, "planned_parallelism": 1,
                       "data_parallel": True, "queue_len": 0, "workers": [worker(0, "n2", "hf-c-4", 200)]},
        },
        "graph": {"name": "ppo", "edges": [
            {"src": "actor_rollout", "dst": "reference", "co_locate": True, "control": False},
            {"src": "actor_rollout", "dst": "reward", "co_locate": False, "control": False,
             "data_type": "rollout_batch"},
            {"src": "critic", "dst": "actor_rollout", "co_locate": False, "control": True},
        ]},
        "edges": {"actor_rollout->reward": {"queue_len": 1, "high_watermark": 4, "bytes_total": 6000,
                                            "latency": {"count": 3, "mean_s": 0.5, "p50_s": 0.4, "p95_s": 0.9,
                                                        "max_s": 0.9}}},
        "decisions": ["Scheduling decision: placement group reward x1", "Manual: reward parallelism 1 -> 2 (busy)"],
        "decision_log": [
            {"time": 1000.0, "kind": "placement", "node": "reward", "reason": "placement group reward x1",
             "message": "Scheduling decision: placement group reward x1"},
            {"time": 1010.0, "kind": "manual_up", "node": "reward", "reason": "busy",
             "message": "Manual: reward parallelism 1 -> 2 (busy)"},
        ],
    }


# -- the view model ------------------------------------------------------------------------------


def test_the_step_splits_into_compute_communication_and_scheduling_that_add_up() -> None:
    s = step_split(record(1))
    assert s is not None
    assert s.compute_s == pytest.approx(1.5)  # 2.0 * (1 - 0.25)
    assert s.scheduling_s == pytest.approx(0.2)  # 2.0 - (1.2 + 0.1 + 0.5)
    assert s.communication_s == pytest.approx(0.3)  # 1.8 in the phases - 1.5 of compute
    assert s.compute_s + s.communication_s + s.scheduling_s == pytest.approx(s.step_s)


def test_the_split_never_goes_negative_and_needs_the_step_time() -> None:
    fused = step_split(record(1, **{"timing/rollout": 2.5}))  # phases timed in a host: longer than the step
    assert fused is not None and fused.scheduling_s == 0.0 and fused.communication_s == pytest.approx(0.5)
    idle = step_split(record(1, orchestration_overhead_frac=0.0))
    assert idle is not None and idle.compute_s == 2.0 and idle.communication_s == idle.scheduling_s == 0.0
    assert step_split({"step": 1, "reward_mean": 0.5}) is None
    assert step_split(record(1, **{"timing/step": float("nan")})) is None


def test_the_breakdown_averages_over_steps() -> None:
    b = breakdown([record(1), record(2, **{"timing/step": 4.0, "timing/update": 2.5})])
    assert b["steps"] == 2
    assert b["mean_s"]["step"] == pytest.approx(3.0)
    assert b["mean_s"]["compute"] == pytest.approx((1.5 + 3.0) / 2)
    assert b["mean_s"]["scheduling"] == pytest.approx((0.2 + 0.2) / 2)
    assert sum(b["fraction"].values()) == pytest.approx(1.0)
    assert b["last"]["step_s"] == 4.0 and [p[0] for p in b["series"]] == [1, 2]
    assert breakdown([]) == {"steps": 0}


def test_curves_keep_the_last_value_and_drop_what_is_not_finite() -> None:
    recs = [record(1), record(2, kl=float("nan")), record(3)]
    c = curves(recs)
    assert c["reward_mean"]["last"] == pytest.approx(0.3) and c["reward_mean"]["last_step"] == 3
    assert [p[0] for p in c["kl"]["points"]] == [1, 3]
    assert curves([])["tokens_per_s"] == {"points": [], "last": None, "last_step": None}


def test_thinning_keeps_the_ends() -> None:
    pts = [[i, i] for i in range(1, 1001)]
    out = thin(pts, 100)
    assert len(out) == 100 and out[0] == [1, 1] and out[-1] == [1000, 1000]
    assert thin(pts[:5], 100) == pts[:5]


def test_the_graph_is_laid_out_along_data_edges_with_placement() -> None:
    g = graph(status())
    by = {n["name"]: n for n in g["nodes"]}
    assert by["actor_rollout"]["layer"] == 0 and by["critic"]["layer"] == 0  # the control edge points back
    assert by["reward"]["layer"] == by["reference"]["layer"] == 1
    assert {by["reward"]["row"], by["reference"]["row"]} == {0, 1}
    assert by["reward"]["parallelism"] == 2 and [w["node_id"] for w in by["reward"]["workers"]] == ["n2", "n1"]
    assert {e["kind"] for e in g["edges"]} == {"colocated", "data", "control"}


def test_the_memory_heatmap_has_a_row_per_ray_node_and_a_cell_per_process() -> None:
    m = memory(status())
    rows = {r["node_id"]: r["cells"] for r in m["rows"]}
    assert [c["worker"] for c in rows["n1"]] == ["actor_rollout+reference[0]", "reward[1]"]  # shared host once
    assert [c["bytes"] for c in rows["n2"]] == [100, 200]
    assert m["max_bytes"] == 300 and m["total_bytes"] == 600 and m["sampled"] == 3


def test_edges_give_percentiles_and_bandwidth_over_time_in_flight() -> None:
    (e,) = edges(status())
    assert (e["p50_s"], e["p95_s"], e["count"]) == (0.4, 0.9, 3)
    assert e["bandwidth_Bps"] == pytest.approx(6000 / 1.5)
    assert not e["colocated"]
    st = status()
    st["edges"]["actor_rollout->reference"] = {"latency": {"count": 0, "mean_s": 0.0}}
    assert [(x["key"], x["colocated"], x["bandwidth_Bps"]) for x in edges(st)][1] == (
        "actor_rollout->reference", True, None)


def test_decisions_come_structured_or_from_the_plain_strings() -> None:
    d = decisions(status())
    assert d["total"] == 2 and d["items"][-1]["kind"] == "manual_up" and d["items"][-1]["time"] == 1010.0
    old = decisions({"decisions": status()["decisions"]})
    assert [(x["kind"], x["reason"]) for x in old["items"]] == [
        ("scheduling", "placement group reward x1"), ("manual", "reward parallelism 1 -> 2 (busy)")]
    assert len(decisions({"decisions": [f"Manual: {i}" for i in range(50)]}, limit=10)["items"]) == 10


def test_the_view_is_valid_json_without_a_status_too() -> None:
    view = build_view([record(1, kl=float("inf"))], None, "tiny", now=5.0)
    json.dumps(view, allow_nan=False)
    assert view["step"] == 1 and not view["has_status"] and view["graph"] == {"nodes": [], "edges": []}
    live = build_view([record(1)], status())
    assert live["step"] == 7 and live["total_steps"] == 10 and live["title"] == "default/tiny"


# -- the page ------------------------------------------------------------------------------------


def test_the_page_is_self_contained_and_escapes_its_data(tmp_path: Path) -> None:
    st = status()
    st["decision_log"][0]["reason"] = "</script><script>alert(1)</script>"
    page = render_page(build_view([record(1)], st, "tiny"))
    assert "</script><script>alert" not in page
    assert "https://" not in page and "http://" not in page.replace("http://www.w3.org/2000/svg", "")
    assert re.findall(r'(?:src|href)="(?!data:)', page) == [], "the page loads something from elsewhere"
    assert '"live": null' in page
    data = page.split('<script id="hf-data" type="application/json">', 1)[1].split("</script>", 1)[0]
    assert json.loads(data)["decisions"]["items"][0]["reason"].startswith("</script>")
    out = write_report([record(1)], st, report_path(tmp_path / "metrics.jsonl"), "tiny")
    assert out == tmp_path / "report.html"
    text = out.read_text()
    assert "<title>tiny · hybridflow</title>" in text and '"live": null' in text and '"job":"default/tiny"' in text
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"], "a temporary file was left"


# -- the feed, the server, the CLI ---------------------------------------------------------------


def test_a_line_still_being_written_is_left_for_the_next_read(tmp_path: Path) -> None:
    assert parse_records('{"step": 1}\n{"step": 2}\n{"st') == [{"step": 1}, {"step": 2}]
    log = MetricsLog(tmp_path / "m.jsonl")
    log.write({"step": 1})
    assert log.read() == [{"step": 1}]


BASELINE = {"step": 0, "val/reward_mean": 0.05, "timing/eval": 0.1}
"""trainer.evalBeforeTrain's record of the starting policy."""


class FakeJob:
    """A controller: a status that advances, records after a step, and an ending."""

    def __init__(self) -> None:
        self.step, self.gone = 2, False
        self.asked: list[int] = []
        self.records = [BASELINE] + [record(i) for i in range(1, 3)]

    def call(self, method: str, *args: Any, timeout_s: float) -> Any:
        if self.gone:
            raise ControlError("job default/tiny is not running")
        if method == "control_status":
            return {**status(), "step": self.step}
        self.asked.append(args[0])
        return [r for r in self.records if r["step"] > args[0]]


def test_the_feed_fetches_new_steps_only_and_all_again_after_a_rollback() -> None:
    job = FakeJob()
    feed = Feed(None, job, min_interval_s=0.0)
    assert feed.view()["curves"]["reward_mean"]["last_step"] == 2
    job.records.append(record(3))
    job.step = 3
    assert feed.view()["curves"]["reward_mean"]["last_step"] == 3
    job.records, job.step = [BASELINE, record(1)], 1  # rolled back to step 1
    v = feed.view()
    assert v["records"] == 2 and job.asked == [-1, 2, -1]  # from before the baseline evaluation's step 0
    job.gone = True
    v = feed.view()
    assert v["error"] == "job default/tiny is not running" and v["step"] == 1 and v["has_status"]


def test_the_server_serves_the_page_and_the_view_and_moves_off_a_busy_port(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(record(i)) + "\n" for i in range(1, 4)))
    feed = Feed(metrics, None, "tiny")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        server = bind(feed, "127.0.0.1", port)
        assert server.server_address[1] != port
        with pytest.raises(DashboardError, match="all in use"):
            bind(feed, "127.0.0.1", port, tries=1)
    import threading

    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        page = urllib.request.urlopen(url_of(server), timeout=10).read().decode()
        assert '"live": "api/view"' in page  # relative: the page also works behind the API server's proxy
        view = json.loads(urllib.request.urlopen(url_of(server) + "api/view", timeout=10).read())
        assert view["curves"]["reward_mean"]["last"] == pytest.approx(0.3) and view["step"] == 3
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(url_of(server) + "nope", timeout=10)
    finally:
        server.shutdown()
        server.server_close()


def dashboard(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hybridflow", "dashboard", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=_env())


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "runtime"), str(ROOT)])}


@pytest.mark.parametrize(("args", "says"), [
    ((), "error: nothing to show: pass JOB (a running job), --metrics PATH"),
    (("--metrics", "/nonexistent/metrics.jsonl"), "error: no metrics file at /nonexistent/metrics.jsonl"),
    (("tiny", "--address", "127.0.0.1:1"), "error: cannot reach a Ray cluster at 127.0.0.1:1"),
    (("a/b/c",), "error: job 'a/b/c': expected NAME or NAMESPACE/NAME"),
])
def test_bad_input_gets_one_clear_line_and_a_nonzero_exit(args: tuple[str, ...], says: str) -> None:
    done = dashboard(*args)
    assert done.returncode == 1
    assert done.stderr.startswith(says), done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_the_cli_serves_a_metrics_file_on_any_free_port(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps(record(1)) + "\n")
    proc = subprocess.Popen([sys.executable, "-m", "hybridflow", "dashboard", "--metrics", str(metrics),
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=_env())
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith(f"dashboard of {tmp_path.name} at http://127.0.0.1:"), line
        url = line.split(" at ", 1)[1].split()[0]
        view = json.loads(urllib.request.urlopen(url + "api/view", timeout=30).read())
        assert view["step"] == 1 and not view["has_status"]
        with metrics.open("a") as f:
            f.write(json.dumps(record(2)) + "\n")
        time.sleep(0.6)  # the feed reads at most every 0.5 s
        view = json.loads(urllib.request.urlopen(url + "api/view", timeout=30).read())
        assert view["curves"]["reward_mean"]["last"] == pytest.approx(0.2)
        assert math.isclose(view["breakdown"]["fraction"]["compute"], 0.75)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _get(url: str) -> str:
    return str(urllib.request.urlopen(url, timeout=30).read().decode())


def test_the_head_serves_the_live_page_from_a_daemon_thread() -> None:
    server = serve_on_head(JobRef("team-a", "tiny"), 0, "127.0.0.1", job=FakeJob())
    assert server is not None
    try:
        page = _get(url_of(server))
        assert "<title>team-a/tiny · hybridflow</title>" in page and '"live": "api/view"' in page
        view = json.loads(_get(url_of(server) + "api/view"))
        assert view["has_status"] and view["step"] == 2 and view["title"] == "team-a/tiny"
    finally:
        server.shutdown()
        server.server_close()


def test_a_head_port_that_cannot_be_bound_is_a_warning_not_an_error(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert serve_on_head(JobRef("team-a", "tiny"), port, "127.0.0.1", job=FakeJob()) is None
    assert any(r.levelname == "WARNING" and "training goes on" in r.getMessage() for r in caplog.records)


def test_before_the_controller_exists_the_head_page_says_what_it_waits_for() -> None:
    server = serve_on_head(JobRef("team-a", "not-started"), 0, "127.0.0.1")
    assert server is not None
    try:
        assert "team-a/not-started" in _get(url_of(server))
        view = json.loads(_get(url_of(server) + "api/view"))
        assert "team-a/not-started" in view["error"] and not view["has_status"]
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.slow
def test_train_in_a_pod_of_the_job_serves_the_live_page_while_it_trains(tmp_path: Path) -> None:
    """`hybridflow train` with the variables the operator sets in every Ray pod: the driver serves the page (here
    on any free port, in a cluster on the head's named one) with the controller's status, and trains to the end."""
    import os
    import signal

    doc = yaml.safe_load((ROOT / "examples" / "tiny-ppo.yaml").read_text())
    doc["metadata"]["namespace"] = "team-a"  # as in the job's ConfigMap
    doc["spec"]["data"]["batchSize"] = 64
    doc["spec"]["trainer"].update(totalSteps=8, checkpoint={"every": 0, "path": str(tmp_path / "ckpt")})
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(doc))
    env = {**_env(), "HYBRIDFLOW_JOB_NAME": "tiny-ppo", "HYBRIDFLOW_JOB_NAMESPACE": "team-a",
           "KUBECONFIG": str(tmp_path / "no-kubeconfig")}  # status reports: a warning, and training goes on
    proc = subprocess.Popen([sys.executable, "-m", "hybridflow", "train", "--local", "--config", str(config),
                             "--metrics-out", str(tmp_path / "metrics.jsonl"), "--quiet", "--dashboard-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("scheduler dashboard of team-a/tiny-ppo on port "), (line, proc.poll())
        url = f"http://127.0.0.1:{int(line.split()[-1])}/"
        assert "<title>team-a/tiny-ppo · hybridflow</title>" in _get(url)
        views: list[dict[str, Any]] = []

        def stepped() -> bool:
            views.append(json.loads(_get(url + "api/view")))
            return bool(views[-1]["has_status"]) and int(views[-1]["step"]) >= 1

        wait_for(stepped, 300, "a step in the live view")
        assert views[-1]["graph"]["nodes"], views[-1]
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        assert json.loads(out.strip().splitlines()[-1])["steps"] == 8
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
