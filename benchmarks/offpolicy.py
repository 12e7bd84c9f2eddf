"""One-step off-policy pipelining, and the rollout engine's log-probs as the old ones, against the step as shipped,
side by side on a local cluster of several raylets.

Each workload of the runtime benchmark (the tiny GRPO job as shipped, and the wide one) trains with its
policy's control edge `strong` (every rollout waits for the last update) and `eventual` (the next step's
rollout generates during the update, on a copy of the policy one update behind), and `bypass`: strong with
rolloutCorrection.bypass, where no pass scores the old log-probs (the engine's stand in). Each run starts its own
ray.cluster_utils.Cluster: a head raylet with one CPU for the controller and two worker raylets with every
core each, where the actor's bundle (actor, reference and reward in one process, all the cores) lands.
Strong and bypass run with every core per process, their best (benchmarks/README.md); eventual also with one
thread, as its two threads (update and generation) then each hold one core; the faster is reported.

    python -m benchmarks.offpolicy                     # ~5 minutes on 2 cores: results/offpolicy.json, .png,
                                                       # and its section of benchmarks/README.md
    python -m benchmarks.offpolicy --render            # redraw from the JSON
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import grouped_bars, save_figure, write_section
from benchmarks.runtime import (
    README,
    RESULTS,
    ROOT,
    WARMUP,
    WORKLOADS,
    Workload,
    _figures,
    _fmt,
    _median,
    bench_job,
    interleaved,
    torch_threads,
    with_layout,
)
from hybridflow.metrics import pyplot

FORMAT = 2
BEGIN, END = "<!-- offpolicy-bench:begin -->", "<!-- offpolicy-bench:end -->"
SETTINGS = ("strong", "eventual", "bypass")
STEPS = {"tiny": 40, "wide": 16}
"""Steps per run: enough after warm-up for a steady median (a wide step takes about a second)."""
TIMINGS = ("timing/rollout", "timing/generate", "timing/old_log_probs", "timing/update", "timing/sync",
           "timing/pipeline_wait")


def thread_choices(setting: str) -> list[int]:
    cores = torch_threads()
    return sorted({1, cores}) if setting == "eventual" else [cores]


def with_setting(job: Any, setting: str) -> Any:
    """The job's graph (spec.graph, which must be written out) with its control edges eventual for `eventual`,
    strong otherwise; rolloutCorrection.bypass for `bypass`."""
    assert job.spec.graph is not None
    for edge in job.spec.graph.edges:
        if edge.control:
            edge.consistency = "eventual" if setting == "eventual" else "strong"
    job.spec.algorithm.rollout_correction.bypass = setting == "bypass"
    return job


def run_one(setting: str, workload: Workload, steps: int, threads: int, metrics: Path) -> dict[str, Any]:
    """One run in a fresh multi-raylet cluster; the step records, with `tokens` per step."""
    import ray
    from ray.cluster_utils import Cluster

    from hybridflow.driver import run_training

    cores = os.cpu_count() or 1
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=cores)
    cluster.wait_for_nodes()
    try:
        ray.init(address=cluster.address, configure_logging=False,
                 runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
        job = with_setting(with_layout(bench_job(steps, f"offpolicy-{setting}", workload), 1, threads), setting)
        t0 = time.perf_counter()
        run_training(job, str(metrics))
        wall = time.perf_counter() - t0
    finally:
        ray.shutdown()
        cluster.shutdown()
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    for r in records:
        r["tokens"] = r["tokens_per_s"] * r["timing/step"]
    return {"setting": setting, "threads": threads, "records": records, "wall_s": wall}


def launch(setting: str, workload: Workload, steps: int, threads: int, workdir: Path, timeout_s: float,
           tag: str = "") -> dict[str, Any]:
    """run_one in a child process (each run's cluster starts and ends with it); one retry, as Ray's start-up
    can time out on a loaded machine."""
    name = f"{workload.name}-{setting}{tag}-t{threads}"
    result, log = workdir / f"{name}.json", workdir / f"{name}.log"
    cmd = [sys.executable, "-m", "benchmarks.offpolicy", "--worker", setting, "--workload", workload.name,
           "--steps", str(steps), "--threads", str(threads), "--result", str(result)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "runtime"), str(ROOT),
                                                                    os.environ.get("PYTHONPATH")])))
    for attempt in (1, 2):
        result.unlink(missing_ok=True)
        with log.open("w") as out:
            try:
                rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    timeout=timeout_s).returncode
            except subprocess.TimeoutExpired:
                rc = -1
        if rc == 0 and result.is_file():
            return dict(json.loads(result.read_text()))
        tail = "\n".join(log.read_text().splitlines()[-20:])
        if attempt == 2:
            raise RuntimeError(f"{name} failed (exit {rc}); last lines of {log}:\n{tail}")
        print(f"[bench] {name} failed (exit {rc}); trying again", flush=True)
    raise AssertionError("unreachable")


def summary(raws: list[dict[str, Any]]) -> dict[str, Any]:
    """The fastest run (lowest median step after warm-up) of one setting, with where its step goes."""
    measured = [raw["records"][WARMUP:] for raw in raws]
    runs = [_figures(m) | {"threads": raw["threads"], "wall_s": round(raw["wall_s"], 1)}
            for raw, m in zip(raws, measured, strict=True)]
    best = min(range(len(raws)), key=lambda i: runs[i]["median_step_s"])
    recs = measured[best]
    lags = sorted({int(r.get("policy_lag", 0)) for r in recs})
    return {**runs[best], "runs": runs, "policy_lags": lags,
            "median_timings_s": {k: _median([r[k] for r in recs if k in r]) for k in TIMINGS},
            "reward_end": sum(r["reward_mean"] for r in raws[best]["records"][-3:]) / 3}


def bench(workloads: list[Workload], rounds: int, workdir: Path, timeout_s: float) -> dict[str, Any]:
    from hybridflow.data.tiny import ensure_tiny_model

    report: dict[str, Any] = {"format": FORMAT, "machine": {"cores": os.cpu_count()}, "rounds": rounds,
                              "raylets": "head (1 CPU, the controller) + 2 workers (every core each)",
                              "workloads": {}}
    t0 = time.perf_counter()
    for workload in workloads:
        ensure_tiny_model(**workload.model)
        steps = STEPS[workload.name]
        raws: dict[str, list[dict[str, Any]]] = {c: [] for c in SETTINGS}
        for r, setting, threads in interleaved(rounds, SETTINGS, thread_choices):
            print(f"[bench] {workload.name}, round {r}/{rounds}: {setting}, {threads} thread(s), {steps} steps ...",
                  flush=True)
            raws[setting].append(launch(setting, workload, steps, threads, workdir, timeout_s, f"-{r}"))
            s = _figures(raws[setting][-1]["records"][WARMUP:])
            print(f"[bench]   {s['tokens_per_s']:.0f} tokens/s, median step {s['median_step_s']:.3f} s", flush=True)
        sums = {c: summary(raws[c]) for c in SETTINGS}
        report["workloads"][workload.name] = {
            "title": workload.title, "steps": steps, "warmup": WARMUP, **sums,
            "gain": sums["eventual"]["tokens_per_s"] / sums["strong"]["tokens_per_s"],
            "gain_by_step_time": sums["strong"]["median_step_s"] / sums["eventual"]["median_step_s"],
            "bypass_gain_by_step_time": sums["strong"]["median_step_s"] / sums["bypass"]["median_step_s"],
        }
    report["bench_wall_s"] = round(time.perf_counter() - t0, 1)
    return report


def _every_run(report: dict[str, Any]) -> str:
    """Each run's median step, so that the spread between runs of one setting is seen beside the gain."""
    return "; ".join(
        f"{name} {c} " + ", ".join(f"{r['median_step_s']:.3f} s ({r['threads']})" for r in w[c]["runs"])
        for name, w in report["workloads"].items() for c in SETTINGS)


def render(report: dict[str, Any]) -> str:
    lines = [BEGIN, "### One-step off-policy pipelining (`consistency: eventual`) and `rolloutCorrection.bypass`", "",
             f"Generated by `make bench-offpolicy` (benchmarks/offpolicy.py) on {report['machine']['cores']} cores, "
             f"on a local Ray cluster of three raylets ({report['raylets']}), each run in a cluster of its own, "
             f"{report['rounds']} round(s) per setting; the fastest run (lowest median step after "
             f"{WARMUP} warm-up steps) of each is shown. The same job and threads choice rules as the runtime "
             "benchmark; only the control edge's consistency, or rolloutCorrection.bypass, differs.", "",
             "| workload | setting | threads | tokens/s | median step | rollout | old log-probs | update | "
             "sync (wait) | policy lags | reward at end |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, w in report["workloads"].items():
        for c in SETTINGS:
            s, t = w[c], w[c]["median_timings_s"]
            lines.append(f"| {name} | {c} | {s['threads']} | {s['tokens_per_s']:.0f} | {s['median_step_s']:.3f} s | "
                         f"{_seconds(t['timing/rollout'])} | {_seconds(t['timing/old_log_probs'])} | "
                         f"{_seconds(t['timing/update'])} | "
                         f"{_seconds(t['timing/sync'])} ({_seconds(t['timing/pipeline_wait'])}) | "
                         f"{', '.join(map(str, s['policy_lags']))} | {s['reward_end']:.2f} |")
    lines.append("")
    gains = ", ".join(f"{name} {w['gain']:.2f}x ({w['gain_by_step_time']:.2f}x by median step time)"
                      for name, w in report["workloads"].items())
    lines.append(f"Off-policy gain (eventual / strong tokens/s): {gains}. The two runs' policies, and so their "
                 "response lengths, part after the first update; the step time compares the same number of "
                 "sequences. Every run's median step, in the order run, its torch threads in brackets: "
                 f"{_every_run(report)}.")
    side = "; ".join(
        f"{name}: the update took {_fmt(w['eventual']['median_timings_s']['timing/update'], '.3f')} s beside the "
        f"generation thread, against {_fmt(w['strong']['median_timings_s']['timing/rollout'], '.3f')} s of rollout "
        f"and {_fmt(w['strong']['median_timings_s']['timing/update'], '.3f')} s of update in turn"
        for name, w in report["workloads"].items())
    lines += ["", "Where the time goes: with eventual, the rollout phase is only what had to wait for the update; "
              "generation, reward, reference and the behaviour log-probs run in a second thread of the actor's "
              "process during the update, so a step is the update's wall time plus the sync. Both threads share "
              f"the same cores, and a strong step already keeps them busy ({side}). The pipeline gains only what "
              "a strong step leaves idle, as where training and generation hold devices of their own; on "
              "shared CPU cores it costs more than it saves.", "", _bypass_text(report), "",
              "![off-policy](results/offpolicy.png)", END]
    return "\n".join(lines)


def _seconds(v: float | None) -> str:
    """A median time, or "none" where no step ran that phase."""
    return "none" if v is None else f"{v:.3f} s"


def _bypass_text(report: dict[str, Any]) -> str:
    parts = []
    for name, w in report["workloads"].items():
        saved = w["strong"]["median_timings_s"]["timing/old_log_probs"]
        parts.append(f"{name} {w['bypass_gain_by_step_time']:.2f}x by median step time, "
                     + (f"the {saved:.3f} s pass of old log-probs gone" if saved is not None else
                        "with no pass to save: one minibatch a step, whose own forward gives the old log-probs"))
    return ("Bypass (strong / bypass median step): " + "; ".join(parts) + ". It saves a forward pass over the batch "
            "where one runs (several minibatches or PPO epochs a step), and only there.")


def plot(report: dict[str, Any], out: Path) -> Path:
    plt = pyplot()

    names = list(report["workloads"])
    fig, ax = plt.subplots(figsize=(6.5, 4.0))
    series = {c: [report["workloads"][n][c]["tokens_per_s"] for n in names] for c in SETTINGS}
    for bars in grouped_bars(ax, series, 0.26):
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(names)), [
        f"{n}\neventual {w['gain']:.2f}x (tokens/s)\nbypass {w['bypass_gain_by_step_time']:.2f}x (step time)"
        for n, w in ((n, report["workloads"][n]) for n in names)])
    ax.set_ylabel("tokens/s")
    ax.set_title("strong vs eventual consistency, and bypass")
    ax.legend()
    return save_figure(fig, out, dpi=110)


def write_outputs(report: dict[str, Any], out_dir: Path, readme: Path | None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "offpolicy.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out_dir / "offpolicy.png")
    if readme is not None:
        write_section(readme, BEGIN, END, render(report))
    print(f"[bench] wrote {out_dir / 'offpolicy.json'}" + (f", {readme}" if readme else ""), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.offpolicy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="all", choices=("all", *WORKLOADS))
    p.add_argument("--rounds", type=int, default=2, help="runs per setting, interleaved (default 2)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per run")
    p.add_argument("--render", action="store_true", help="only redraw the plot and README section from the JSON")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--worker", choices=SETTINGS, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    workloads = list(WORKLOADS.values()) if args.workload == "all" else [WORKLOADS[args.workload]]
    if args.worker:
        metrics = args.result.with_name(args.result.stem + "-metrics.jsonl")
        raw = run_one(args.worker, workloads[0], args.steps, args.threads, metrics)
        args.result.write_text(json.dumps(raw))
        return 0
    if args.render:
        path = args.out_dir / "offpolicy.json"
        report = json.loads(path.read_text())
        if report.get("format") != FORMAT:
            p.error(f"{path}: results format {report.get('format')!r}, this code reads {FORMAT}")
        write_outputs(report, args.out_dir, README)
        return 0
    workdir = ROOT / "runs" / "bench-offpolicy"
    workdir.mkdir(parents=True, exist_ok=True)
    report = bench(workloads, args.rounds, workdir, args.timeout)
    write_outputs(report, args.out_dir, README)
    print(json.dumps({n: round(w["gain"], 3) for n, w in report["workloads"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
