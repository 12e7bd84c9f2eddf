"""The dashboard in a real headless browser (Debian's chromium driven by playwright), on a real local run.

One PPO job of 80 tiny steps trains in a thread for the whole module, with its reward node in a process of
its own so that a data edge carries batches. The live page is watched while it trains (the step moves, a
manual scale shows up); then the run's report.html is checked against metrics.jsonl and its load timed.
Set DASHBOARD_SCREENSHOT=docs/dashboard.png to save the report's screenshot there.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import yaml

import hybridflow
from hybridflow.api import parse_job
from hybridflow.dashboard.feed import Feed
from hybridflow.dashboard.server import bind, url_of
from hybridflow.driver import init_ray
from tests.conftest import ROOT
from tests.helpers import TrainingThread, pooled_ppo_graph, wait_for

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
NAME = "dash-ppo"
STEPS = 80


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        if os.environ.get("CI") == "true":
            pytest.fail(f"{CHROMIUM} is missing: e2e/toolchain/install-node-packages.sh installs it")
        pytest.skip(f"{CHROMIUM} is missing: run e2e/toolchain/install-node-packages.sh as root")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox"])
        yield b
        b.close()


class Page:
    """A browser tab that remembers every console error and uncaught exception."""

    def __init__(self, browser: Any) -> None:
        self.page = browser.new_page(viewport={"width": 1400, "height": 1000})
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))

    def text(self, selector: str) -> str:
        return str(self.page.locator(selector).first.text_content()).strip()

    def attrs(self, selector: str, name: str) -> list[str]:
        script = f"els => els.map(e => e.getAttribute('{name}'))"
        return [str(v) for v in self.page.eval_on_selector_all(selector, script)]


class Run(TrainingThread):
    scaled = False
    """Whether the live test scaled the reward node up and back (decisions the report must then show)."""


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    init_ray(local=True, num_cpus=8)
    tmp = tmp_path_factory.mktemp("dashboard")
    doc = yaml.safe_load((ROOT / "examples" / "tiny-ppo.yaml").read_text())
    doc["metadata"]["name"] = NAME
    doc["spec"]["graph"] = pooled_ppo_graph()
    doc["spec"]["data"]["batchSize"] = 128
    doc["spec"]["trainer"].update(totalSteps=STEPS, resume="never", checkpoint={"every": 0, "path": str(tmp / "ckpt")})
    r = Run(parse_job(doc), tmp / "metrics.jsonl")
    r.thread.start()
    wait_for(lambda: len(r.records()) >= 1 or r.error is not None, 300, "the first step")
    assert r.error is None, r.error
    yield r
    r.thread.join(timeout=600)
    ray.shutdown()


def test_the_live_page_follows_the_running_job(browser: Any, run: Run) -> None:
    handle = hybridflow.connect(NAME)
    server = bind(Feed(None, handle, str(handle.ref), min_interval_s=0.2), "127.0.0.1", 0, refresh_s=0.5)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    tab = Page(browser)
    try:
        tab.page.goto(url_of(server))
        tab.page.wait_for_selector("body[data-rendered]")
        first = int(tab.text("#step"))
        tab.page.wait_for_function(f"Number(document.getElementById('step').textContent) > {first}", timeout=120_000)
        assert int(tab.text("#step")) > first
        assert run.error is None, run.error

        # the curves agree with metrics.jsonl at the step they show
        at_step = int(tab.text("#curve-reward_mean .head").split("step ", 1)[1].split(":", 1)[0])
        rec = next(r for r in run.records() if r["step"] == at_step)
        value = float(tab.attrs("#curve-reward_mean .last", "data-value")[0])
        assert value == pytest.approx(rec["reward_mean"], rel=1e-12)
        assert tab.text("#curve-reward_mean .last") == shown(rec["reward_mean"], 4)

        # a change from outside appears as a decision and as the node's parallelism
        assert handle.scheduler.adjust_parallelism("reward", 2, "dashboard test") == 2
        tab.page.wait_for_selector('.gnode[data-node="reward"][data-parallelism="2"]', timeout=60_000)
        tab.page.wait_for_selector('tr.decision[data-kind="manual_up"]', timeout=60_000)
        row = tab.page.locator('tr.decision[data-kind="manual_up"]').first.text_content() or ""
        assert "reward" in row and "dashboard test" in row
        assert handle.scheduler.adjust_parallelism("reward", 1, "back") == 1
        run.scaled = True
        assert tab.errors == []
    finally:
        tab.page.close()
        server.shutdown()
        server.server_close()


def shown(v: float, digits: int) -> str:
    """How the page writes a number: fixed digits, or JavaScript's toExponential(2) when tiny or huge."""
    if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
        mantissa, exp = f"{v:.2e}".split("e")
        return f"{mantissa}e{int(exp):+d}"
    return f"{v:.{digits}f}"


def split(r: dict[str, Any]) -> tuple[float, float, float]:
    """compute, communication, scheduling of a record, by the definition the panel states."""
    step = r["timing/step"]
    compute = step * (1 - r["orchestration_overhead_frac"])
    phases = sum(r.get(k, 0.0) for k in ("timing/rollout", "timing/scores", "timing/advantages", "timing/update",
                                       "timing/sync"))
    scheduling = min(step - compute, max(0.0, step - phases))
    return compute, step - compute - scheduling, scheduling


def test_the_report_shows_every_panel_with_the_runs_numbers(browser: Any, run: Run) -> None:
    run.thread.join(timeout=900)
    assert run.error is None, run.error
    assert run.result is not None
    report = Path(run.result["report"])
    assert report == run.metrics.with_name("report.html")
    records = run.records()
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))

    tab = Page(browser)
    t0 = time.perf_counter()
    tab.page.goto(report.as_uri())
    tab.page.wait_for_selector("body[data-rendered]")
    load_ms = (time.perf_counter() - t0) * 1000
    print(f"\nreport page of {STEPS} steps ({report.stat().st_size / 1024:.0f} KiB): loaded and drawn in "
          f"{load_ms:.0f} ms")
    try:
        assert tab.errors == []
        assert int(tab.text("#step")) == STEPS and tab.text("#mode") == "report"
        for panel in ("graph", "memory", "edges", "breakdown", "curves", "decisions"):
            assert not tab.page.locator(f"#panel-{panel} .empty").count(), panel

        last = records[-1]
        for key, digits in (("reward_mean", 4), ("kl", 4), ("tokens_per_s", 1)):
            assert float(tab.attrs(f"#curve-{key} .last", "data-value")[0]) == pytest.approx(last[key], rel=1e-12)
            assert tab.text(f"#curve-{key} .last") == shown(last[key], digits)
        assert tab.page.locator("#curve-reward_mean path").count() == 1

        parts = [split(r) for r in records]
        mean = [sum(p[i] for p in parts) / len(parts) for i in range(3)]
        step_mean = sum(r["timing/step"] for r in records) / len(records)
        for i, name in enumerate(("compute", "communication", "scheduling")):
            fraction = float(tab.attrs(f'tr[data-part="{name}"]', "data-fraction")[0])
            assert fraction == pytest.approx(mean[i] / step_mean, rel=1e-9, abs=1e-12), name
            assert tab.text(f'tr[data-part="{name}"] .share') == f"{100 * mean[i] / step_mean:.1f}%"

        assert sorted(tab.attrs(".gnode", "data-node")) == ["actor_rollout", "critic", "reference", "reward"]
        assert set(tab.attrs(".gnode", "data-parallelism")) == {"1"}
        assert tab.page.locator(".gedge.data").count() == 1 and tab.page.locator(".gedge.control").count() == 1
        assert tab.page.locator(".gnode .placement").count() == 4

        cells = tab.attrs(".heat .cell", "data-bytes")
        assert len(cells) == 3, cells  # actor+reference share a process; reward; critic
        assert all(int(b) > 50 * 2**20 for b in cells), cells  # each holds torch: tens of MiB of RSS

        rows = tab.page.eval_on_selector_all("tr[data-edge]", "els => els.map(e => ({...e.dataset}))")
        edge = next(e for e in rows if e["edge"] == "actor_rollout->reward")
        counts = tab.text('tr[data-edge="actor_rollout->reward"] td:nth-child(2)')
        assert int(counts) == STEPS  # one rollout chunk a step crosses the edge
        assert 0 < float(edge["p50"]) <= float(edge["p95"]) and int(edge["bytes"]) > 0

        kinds = tab.attrs("tr.decision", "data-kind")
        assert {"placement", "colocation", "distributed"} <= set(kinds)
        if run.scaled:
            assert "manual_up" in kinds and "manual_down" in kinds
        if os.environ.get("DASHBOARD_SCREENSHOT"):
            tab.page.screenshot(path=os.environ["DASHBOARD_SCREENSHOT"], full_page=True)
    finally:
        tab.page.close()
