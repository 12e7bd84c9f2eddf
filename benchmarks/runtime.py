"""Runtime benchmark: hybridflow, a naive Ray loop and TRL's GRPOTrainer on one GRPO workload per run.

    python -m benchmarks.runtime                    # the tiny workload: 30 steps per system, 2 rounds
    python -m benchmarks.runtime --workload wide    # hidden 256, 4 layers, 32 response tokens
    python -m benchmarks.runtime --quick            # smoke run: 4 steps, 1 round, written under runs/ only
    python -m benchmarks.runtime --render           # redraw the plot and README section from the JSON

Each system runs in a fresh child process, one after the other (hybridflow, naive Ray, TRL, then again),
so memory and Ray sessions never mix; this process samples the child's whole process tree (driver, Ray's
daemons and workers) for peak RSS. A last child splits hybridflow's step into its parts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psutil

from benchmarks.common import RssSampler, Text, save_figure, write_section
from hybridflow.metrics import pyplot

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "tiny-grpo.yaml"
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "benchmarks" / "README.md"
SYSTEMS = ("hybridflow", "naive_ray", "trl")
LABELS = {"hybridflow": "hybridflow", "naive_ray": "naive Ray", "trl": "TRL GRPOTrainer"}
WARMUP = 2
Choice = TypeVar("Choice")
FORMAT = 3  # the layout of runtime*.json; bump it when the layout changes (no readers for older ones are kept)
TARGETS = {"ratio_vs_naive_ray": 2.0, "ratio_vs_trl": 1.2, "orchestration_overhead_frac": 0.03}
OVERHEAD_DEFINITIONS = {
    "hybridflow": "its own metric orchestration_overhead_frac: 1 - worker compute on the critical path / step time",
    "naive_ray": "1 - (generate + slowest of the parallel reward/reference/old-log-prob calls + advantages "
                 "+ actor update compute) / step time, each compute timed inside its worker as hybridflow does",
    "trl": "1 - (generate + forward passes + loss + backward + optimizer step + reward function) / step time; "
           "the rest is the trainer's own bookkeeping in the same process",
}


@dataclass(frozen=True)
class Workload:
    """examples/tiny-grpo.yaml, reshaped: a model directory made like the built-in one with `model` sizes
    (hybridflow.data.tiny.ensure_tiny_model), and these prompts per step and response tokens."""

    name: str
    title: str
    model: dict[str, int] = field(default_factory=dict)
    batch_size: int | None = None
    max_response_length: int | None = None

    @property
    def stem(self) -> str:
        """runtime.json / runtime.png for the first workload, runtime-<name>.* for the others."""
        return "runtime" if self.name == "tiny" else f"runtime-{self.name}"

    @property
    def markers(self) -> tuple[str, str]:
        key = "runtime-bench" if self.name == "tiny" else f"runtime-bench-{self.name}"
        return f"<!-- {key}:begin -->", f"<!-- {key}:end -->"


WORKLOADS = {w.name: w for w in (
    Workload("tiny", "the built-in tiny model (hidden 64, 2 layers), 4 response tokens: per-step overhead dominates"),
    Workload("wide", "a tiny-task model of hidden 256 and 4 layers, 32 response tokens: compute dominates",
             model={"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4},
             batch_size=16, max_response_length=32),
)}
BEGIN, END = WORKLOADS["tiny"].markers


def torch_threads() -> int:
    """The cores every system gets: $HYBRIDFLOW_TORCH_THREADS, else all of this machine's."""
    from hybridflow.workers.modeling import THREADS_ENV

    return int(os.environ.get(THREADS_ENV) or os.cpu_count() or 1)


def layouts(system: str) -> list[tuple[int, int]]:
    """(data-parallel ranks, torch threads per process) to run `system` with; its fastest round is the one reported.

    hybridflow and TRL run in one process on every core and in two data-parallel ranks on half the cores each:
    hybridflow's co-located actor, reference and reward as two ranks (the graph's parallelism 2; replicated
    training, which on a model this small beats FSDP's per-layer gathers), TRL as `accelerate launch` would run
    two processes (DDP). The naive loop is one actor per role by definition; its processes partly run at once
    (reference and old log-probs), and threads waiting on a core another process holds spin: it runs with one
    thread per process and with every core per process.
    """
    cores = torch_threads()
    if system == "naive_ray":
        return [(1, t) for t in sorted({1, cores})]
    return [(1, cores)] + ([(2, cores // 2)] if cores >= 2 else [])


def interleaved(rounds: int, settings: Sequence[str],
                choices_of: Callable[[str], list[Choice]]) -> Iterator[tuple[int, str, Choice]]:
    """(round from 1, setting, choice): every setting with each of its choices (threads, layouts), once per round,
    in turn; interleaving evens out load from other processes on a shared machine."""
    for r in range(1, rounds + 1):
        for setting in settings:
            for choice in choices_of(setting):
                yield r, setting, choice


def bench_job(steps: int, name: str, workload: Workload) -> Any:
    """The workload's job with `steps` steps and no checkpoints or evaluation (they are not part of a step)."""
    from hybridflow.api import load_job
    from hybridflow.data.tiny import ensure_tiny_model

    job = load_job(CONFIG)
    job.metadata.name = name
    job.spec.trainer.total_steps = steps
    job.spec.trainer.checkpoint.every = 0
    job.spec.trainer.resume = "never"
    job.spec.trainer.eval_every = 0
    job.spec.data.val = None
    if workload.model:
        job.spec.model.policy.path = str(ensure_tiny_model(**workload.model))
    if workload.batch_size:
        job.spec.data.batch_size = workload.batch_size
    if workload.max_response_length:
        job.spec.data.max_response_length = workload.max_response_length
    return job


def with_layout(job: Any, ranks: int, threads: int) -> Any:
    """The job's built-in graph with its co-located group (one process a rank: actor, reference and reward) in
    `ranks` ranks whose bundles hold `threads` CPUs each, which their torch then uses
    (scheduler.placement.torch_threads); several ranks train replicated."""
    from hybridflow.graph import builtin_graph

    graph = builtin_graph(job.spec, "CPU")
    graph.get("actor_rollout").resources["CPU"] = float(threads)
    for node in graph.group_of("actor_rollout").nodes:
        node.parallelism = ranks
    job.spec.graph = graph.to_spec()
    if ranks > 1:
        job.spec.trainer.training.shard = False
    return job


def start_local_ray(threads: int | None = None) -> None:
    """A fresh local Ray, started as hybridflow's init_ray(local=True) starts it; `threads`, when given, fixes
    every worker's torch threads (the naive loop's role actors), else each takes its bundle's CPUs.

    address="local" so that a cluster someone else left running (ray start, or a test's Cluster, found
    through /tmp/ray/ray_current_cluster) is never joined instead.
    """
    import ray

    from hybridflow.workers.modeling import THREADS_ENV

    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", "")} | ({THREADS_ENV: str(threads)} if threads else {})
    ray.init(address="local", num_cpus=max(8, os.cpu_count() or 1), include_dashboard=False, log_to_driver=True,
             configure_logging=False, runtime_env={"env_vars": env})


# -- one system, in its own process -------------------------------------------------------------------


def run_system(system: str, steps: int, result: Path, workload: Workload, layout: tuple[int, int]) -> dict[str, Any]:
    """Train `steps` steps with one system in `layout` (data-parallel ranks, torch threads per process); records
    use hybridflow's metric names plus `tokens`."""
    job = bench_job(steps, f"bench-{system.replace('_', '-')}", workload)
    t0 = time.perf_counter()
    ranks, threads = layout
    extra: dict[str, Any] = {"ranks": ranks, "torch_threads": threads}
    if system == "trl":
        from benchmarks.trl_grpo import run_trl

        out = run_trl(job.spec, steps, threads, ranks)
        records = out.pop("records")
        extra |= out
    else:
        import ray

        start_local_ray(threads if system == "naive_ray" else None)
        try:
            if system == "hybridflow":
                from hybridflow.driver import run_training

                metrics = result.with_name(f"{result.stem}-metrics.jsonl")
                run_training(with_layout(job, ranks, threads), str(metrics))
                records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
                for r in records:
                    r["tokens"] = r["tokens_per_s"] * r["timing/step"]
                extra["metrics_jsonl"] = str(metrics)
            elif system == "profile":
                from benchmarks.profile_hybridflow import profile_hybridflow

                return {"system": system, "profile": profile_hybridflow(with_layout(job, ranks, threads), steps,
                                                                         WARMUP),
                        "wall_s": time.perf_counter() - t0}
            elif system == "naive_ray":
                from benchmarks.naive_ray import run_naive

                naive = run_naive(job.spec, steps)
                records = naive.records
                extra["batch_shape"] = list(naive.batch_shape)
            else:
                raise ValueError(f"unknown system {system!r}")
        finally:
            ray.shutdown()
    return {"system": system, "records": records, "wall_s": time.perf_counter() - t0, **extra}


# -- the parent: launch, sample memory, summarise -----------------------------------------------------


def process_label(proc: psutil.Process) -> str:
    """A Ray worker's class (`ray::WorkerHost`, `ray::IDLE`), a daemon's name or a Python script's name."""
    cmd = proc.cmdline()
    if cmd and cmd[0].startswith("ray::"):
        return cmd[0].split()[0].split(".")[0]
    name = proc.name()
    scripts = [Path(a).name for a in cmd[1:] if a.endswith(".py")]
    return f"{name} {scripts[0]}" if name.startswith("python") and scripts else name


def launch(system: str, steps: int, workdir: Path, timeout_s: float, workload: Workload, layout: tuple[int, int],
           tag: str = "", tries: int = 2) -> dict[str, Any]:
    """`launch_once`, tried again when it fails (Ray's start-up can time out on a loaded machine)."""
    for attempt in range(1, tries + 1):
        try:
            return launch_once(system, steps, workdir, timeout_s, workload, layout, tag)
        except RuntimeError as e:
            if attempt == tries:
                raise
            print(f"[bench]   {e.args[0].splitlines()[-1]}; trying again", flush=True)
    raise AssertionError("unreachable")


def launch_once(system: str, steps: int, workdir: Path, timeout_s: float, workload: Workload,
                layout: tuple[int, int], tag: str = "") -> dict[str, Any]:
    """Run one system in a child process; returns its raw result plus peak RSS and load averages."""
    ranks, threads = layout
    name = f"{workload.name}-{system}{tag}-r{ranks}t{threads}"
    result_path = workdir / f"{name}.json"
    log_path = workdir / f"{name}.log"
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.runtime", "--worker", system, "--steps", str(steps),
           "--workload", workload.name, "--ranks", str(ranks), "--threads", str(threads), "--result", str(result_path)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    load_before = os.getloadavg()
    with log_path.open("w") as log:
        child = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        sampler = RssSampler(child.pid, interval=0.25,
                             label=lambda p: "driver" if p.pid == child.pid else process_label(p)).start()
        try:
            rc = child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            child.kill()
            rc = child.wait()
        finally:
            sampler.stop()
    if rc != 0 or not result_path.is_file():
        tail = "\n".join(log_path.read_text().splitlines()[-30:])
        raise RuntimeError(f"{system} failed (exit {rc}); last lines of {log_path}:\n{tail}")
    raw = json.loads(result_path.read_text())
    raw.update(peak_rss_bytes=sampler.peak_bytes, peak_processes=sampler.peak_processes,
               peak_rss_by_process_mib=sampler.peak_by_process, load_avg_before=list(load_before),
               load_avg_after=list(os.getloadavg()))
    return raw


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _figures(records: list[dict[str, Any]]) -> dict[str, Any]:
    """tokens/s (total tokens / total step time), step-time median and p90, overhead median."""
    steps_s = [r["timing/step"] for r in records]
    overhead = [r["orchestration_overhead_frac"] for r in records if r.get("orchestration_overhead_frac") is not None]
    return {
        "tokens_per_s": sum(r["tokens"] for r in records) / sum(steps_s),
        "tokens_per_s_median": _median([r["tokens"] / r["timing/step"] for r in records]),
        "median_step_s": _median(steps_s),
        "p90_step_s": sorted(steps_s)[math.ceil(0.9 * len(steps_s)) - 1],
        "orchestration_overhead_frac": _median(overhead),
        "measured_steps": len(records),
    }


def summarise(raws: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Headline figures from the least-disturbed round (lowest median step time), after warm-up.

    Other processes on a shared machine only ever add time, and every system gets the same number of
    rounds; each round's figures and the figures pooled over all rounds with that round's layout (ranks and
    threads) are kept beside the headline.
    """
    measured = [raw["records"][warmup:] or raw["records"] for raw in raws]
    per_round = [_figures(m) | {"load_avg_1min_at_start": raw["load_avg_before"][0], "wall_s": raw["wall_s"],
                                "peak_rss_mib": raw["peak_rss_bytes"] / 2**20, "ranks": raw["ranks"],
                                "torch_threads": raw["torch_threads"]}
                 for raw, m in zip(raws, measured, strict=True)]
    best = min(range(len(raws)), key=lambda i: per_round[i]["median_step_s"])
    raw, recs = raws[best], measured[best]
    rewards = [r["reward_mean"] for r in raw["records"]]
    head = min(3, len(rewards))
    timing_keys = sorted({k for r in recs for k in r if k.startswith("timing/") and k != "timing/step"})
    peak = max(range(len(raws)), key=lambda i: raws[i]["peak_rss_bytes"])
    return {
        **_figures(recs),
        "round_used": best + 1,
        "overhead_definition": OVERHEAD_DEFINITIONS[raw["system"]],
        "peak_rss_mib": raws[peak]["peak_rss_bytes"] / 2**20,
        "peak_processes": max(r["peak_processes"] for r in raws),
        "peak_rss_by_process_mib": raws[peak]["peak_rss_by_process_mib"],
        "response_tokens_per_step": _median([r["tokens"] for r in recs]),
        "reward_start": sum(rewards[:head]) / head,
        "reward_end": sum(rewards[-head:]) / head,
        "median_timings_s": {k: _median([r[k] for r in recs if k in r]) for k in timing_keys},
        "rounds": per_round,
        "pooled": _figures([r for x, m in zip(raws, measured, strict=True) for r in m
                            if (x["ranks"], x["torch_threads"]) == (raw["ranks"], raw["torch_threads"])]),
        "curves": {"step_s": [[r["timing/step"] for r in x["records"]] for x in raws],
                   "reward_mean": rewards,
                   "tokens_per_s": [[r["tokens"] / r["timing/step"] for r in x["records"]] for x in raws]},
        **{k: raw[k] for k in ("batch_shape", "ranks", "torch_threads", "optimizer_steps_per_rl_step") if k in raw},
    }


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("hybridflow", "torch", "ray", "transformers", "trl", "accelerate", "datasets"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def machine() -> dict[str, Any]:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "gpu": "none (CPU run)"}


def bench_config(steps: int, warmup: int, workload: Workload) -> dict[str, Any]:
    spec = bench_job(steps, "bench", workload).spec
    return {
        "job": str(CONFIG.relative_to(ROOT)), "workload": workload.name, "workload_title": workload.title,
        "model_sizes": workload.model or "built-in", "algorithm": spec.algorithm.name,
        "model": Path(spec.model.policy.path).name,
        "task": spec.data.train, "prompts_per_step": spec.data.batch_size,
        "samples_per_prompt": spec.rollout.samples_per_prompt,
        "sequences_per_step": spec.data.batch_size * spec.rollout.samples_per_prompt,
        "max_prompt_length": spec.data.max_prompt_length, "max_response_length": spec.data.max_response_length,
        "mini_batch_size": spec.algorithm.mini_batch_size, "ppo_epochs": spec.algorithm.ppo_epochs,
        "lr": spec.trainer.actor_lr, "kl_coef": spec.algorithm.kl_penalty.coef, "temperature": spec.rollout.temperature,
        "steps": steps, "warmup_steps_excluded": warmup, "cores": torch_threads(),
        "rollout_engine": spec.rollout.engine, "trl_use_vllm": False,
    }


def build_report(summaries: dict[str, dict[str, Any]], steps: int, warmup: int, workload: Workload) -> dict[str, Any]:
    """Top-level ratios and targets beside the per-system details."""

    def ratio(a: str, b: str, key: str = "tokens_per_s") -> float | None:
        if a in summaries and b in summaries and summaries[b][key]:
            return summaries[a][key] / summaries[b][key]
        return None

    def pooled_ratio(a: str, b: str) -> float | None:
        if a in summaries and b in summaries:
            return summaries[a]["pooled"]["tokens_per_s"] / summaries[b]["pooled"]["tokens_per_s"]
        return None

    hf = summaries.get("hybridflow", {})
    report: dict[str, Any] = {
        "ratio_vs_naive_ray": ratio("hybridflow", "naive_ray"),
        "ratio_vs_trl": ratio("hybridflow", "trl"),
        "orchestration_overhead_frac": hf.get("orchestration_overhead_frac"),
        "ratio_vs_naive_ray_median": ratio("hybridflow", "naive_ray", "tokens_per_s_median"),
        "ratio_vs_trl_median": ratio("hybridflow", "trl", "tokens_per_s_median"),
        "ratio_vs_naive_ray_pooled": pooled_ratio("hybridflow", "naive_ray"),
        "ratio_vs_trl_pooled": pooled_ratio("hybridflow", "trl"),
    }
    met = {}
    for key, target in TARGETS.items():
        value = report[key]
        if value is None:
            continue
        ok = value <= target if key == "orchestration_overhead_frac" else value >= target
        met[key] = {"target": target, "value": round(value, 4), "met": ok}
    report.update(
        targets=met,
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        config=bench_config(steps, warmup, workload),
        versions=versions(),
        machine=machine(),
        systems=summaries,
    )
    return report


# -- outputs: JSON, Markdown table, PNG ---------------------------------------------------------------


def _fmt(v: Any, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def _response_tokens(summary: dict[str, Any], warmup: int) -> str:
    """Mean (fewest-most) response tokens per measured step of the round reported, from its curves."""
    curves, i = summary["curves"], summary["round_used"] - 1
    tokens = [t * s for t, s in zip(curves["tokens_per_s"][i], curves["step_s"][i], strict=True)][warmup:]
    return f"{sum(tokens) / len(tokens):.0f} ({min(tokens):.0f}-{max(tokens):.0f})"


def markdown(report: dict[str, Any], text: Text | None = None) -> str:
    """The workload's runtime section of README.md, markers included: table, ratios against targets,
    configuration; the first workload's section also explains the benchmark."""
    text = text or Text("runtime.md")
    workload = WORKLOADS[report["config"]["workload"]]
    rows = []
    for name, s in report["systems"].items():
        each = " / ".join(f"{r['median_step_s']:.3f} ({r['ranks']} x {r['torch_threads']})" for r in s["rounds"])
        rows.append(
            f"| {LABELS[name]} | {s['ranks']} x {s['torch_threads']} | {s['tokens_per_s']:.0f} "
            f"| {s['median_step_s']:.3f} | {s['p90_step_s']:.3f} "
            f"| {_fmt(s['orchestration_overhead_frac'], '.1%')} | {s['peak_rss_mib']:.0f} | {s['peak_processes']} "
            f"| {s['reward_start']:.3f} → {s['reward_end']:.3f} | {each} |"
        )
    checks = []
    for key, t in report["targets"].items():
        frac = key == "orchestration_overhead_frac"
        checks.append(text(f"check_{key}", value=f"{t['value']:.1%}" if frac else f"{t['value']:.2f}",
                           target=f"{t['target']:.0%}" if frac else f"{t['target']:.1f}",
                           verdict="met" if t["met"] else "missed"))
    c, m, v = report["config"], report["machine"], report["versions"]
    loads = "; ".join(f"{LABELS[n]} " + ", ".join(f"{r['load_avg_1min_at_start']:.1f}" for r in s["rounds"])
                      for n, s in report["systems"].items())
    paragraphs = []
    per = {n: (s["median_step_s"] * 1e3, s["orchestration_overhead_frac"]) for n, s in report["systems"].items()}
    if all(f is not None for _, f in per.values()):
        reading = text("reading", parts="; ".join(
            f"{LABELS[n]} {t * (1 - f):.1f} + {t * f:.1f} ms" for n, (t, f) in per.items()))
        if "hybridflow" in per and "naive_ray" in per:
            bound = per["naive_ray"][0] / (per["hybridflow"][0] * (1 - per["hybridflow"][1]))
            reading += "\n" + text("reading_bound", bound=f"{bound:.2f}")
        paragraphs.append(reading)
    systems = report["systems"]
    if "hybridflow" in systems and len(systems) > 1:
        step = systems["hybridflow"]["median_step_s"]
        paragraphs.append(text(
            "step_rate", tokens="; ".join(f"{LABELS[n]} {_response_tokens(s, c['warmup_steps_excluded'])}"
                                          for n, s in systems.items()),
            ratios=", ".join(f"hybridflow / {LABELS[n]} {s['median_step_s'] / step:.2f}x"
                             for n, s in systems.items() if n != "hybridflow")))
    parts = {n: {k.removeprefix("timing/"): t for k, t in s["median_timings_s"].items()
                 if t is not None and k != "timing/rollout"} for n, s in report["systems"].items()}
    paragraphs.append(text("compute", parts="; ".join(
        f"{LABELS[n]}: " + ", ".join(f"{k} {t * 1e3:.0f}" for k, t in ts.items()) for n, ts in parts.items())))
    prof = report.get("hybridflow_step_breakdown")
    if prof:
        hf = report["systems"]["hybridflow"]
        paragraphs.append(text(
            "breakdown", steps=prof["measured_steps"], layout=f"{hf['ranks']} x {hf['torch_threads']}",
            queued=text("breakdown_queued") if prof["one_call_per_step"] else "",
            ranks_note=text("breakdown_ranks") if hf["ranks"] > 1 else "",
            step_ms=f"{prof['median_step_ms']:.1f}", compute_ms=f"{prof['median_compute_ms']:.1f}",
            advantages_ms=f"{prof['median_advantages_ms']:.1f}",
            call_ms=f"{prof['actor_call_round_trip_ms']:.2f}", sum_ms=f"{prof['segments_sum_ms']:.2f}",
            rows="\n".join(f"| {k} | {v:.2f} |" for k, v in prof["segments_ms"].items())))
    body = text(
        "readme", intro=text("intro") + "\n\n" if workload.name == "tiny" else "", workload=workload.name,
        workload_title=workload.title, model=c["model"], created=report["created"], steps=c["steps"],
        rounds=c["rounds"], warmup=c["warmup_steps_excluded"],
        prompts=c["prompts_per_step"], samples=c["samples_per_prompt"], sequences=c["sequences_per_step"],
        max_response=c["max_response_length"], minibatch=c["mini_batch_size"], lr=f"{c['lr']:g}",
        cores=c["cores"], cpus=m["cpus"], memory=m["memory_gib"], gpu=m["gpu"], loads=loads,
        torch=v["torch"], ray=v["ray"], transformers=v["transformers"], trl=v["trl"], rows="\n".join(rows),
        checks="\n".join(checks), pooled_naive=_fmt(report["ratio_vs_naive_ray_pooled"], ".2f"),
        pooled_trl=_fmt(report["ratio_vs_trl_pooled"], ".2f"), paragraphs="".join("\n\n" + p for p in paragraphs),
        png=f"{workload.stem}.png")
    begin, end = workload.markers
    return f"{begin}\n{body}\n{end}"


def plot(report: dict[str, Any], out: Path) -> Path:
    """Step time per step, tokens/s, reward per step, and where a median step's time goes."""
    plt = pyplot()

    systems = report["systems"]
    warmup = report["config"]["warmup_steps_excluded"]
    colors = {"hybridflow": "tab:blue", "naive_ray": "tab:orange", "trl": "tab:green"}
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ax = axes[0][0]
    for name, s in systems.items():
        for i, ys in enumerate(s["curves"]["step_s"], start=1):
            used = i == s["round_used"]
            ax.plot(range(1, len(ys) + 1), ys, marker=".", color=colors[name], alpha=1.0 if used else 0.35,
                    label=LABELS[name] if used else None)
    ax.axvspan(0.5, warmup + 0.5, color="grey", alpha=0.15, label="warm-up (excluded)")
    ax.set(title="step time (solid: the round used, faint: other rounds)", xlabel="step", ylabel="seconds")
    ax.legend()
    ax.grid(alpha=0.3)
    ax = axes[0][1]
    names = list(systems)
    vals = [systems[n]["tokens_per_s"] for n in names]
    bars = ax.bar([LABELS[n] for n in names], vals, color=[colors[n] for n in names])
    ax.bar_label(bars, fmt="%.0f")
    ax.set_ylim(0, 1.12 * max(vals))
    ax.set(title="response tokens/s (after warm-up)", ylabel="tokens/s")
    ax.grid(alpha=0.3, axis="y")
    ax = axes[1][0]
    for name, s in systems.items():
        ys = s["curves"]["reward_mean"]
        ax.plot(range(1, len(ys) + 1), ys, marker=".", label=LABELS[name], color=colors[name],
                linestyle="--" if name == "naive_ray" else "-")
    ax.set(title="reward_mean (hybridflow and naive Ray run the same compute)", xlabel="step")
    ax.legend()
    ax.grid(alpha=0.3)
    ax = axes[1][1]
    for i, name in enumerate(names):
        s = systems[name]
        frac = s["orchestration_overhead_frac"] or 0.0
        compute = s["median_step_s"] * (1 - frac)
        ax.bar(i, compute, color=colors[name], label="compute" if i == 0 else None)
        ax.bar(i, s["median_step_s"] - compute, bottom=compute, color="lightgrey", hatch="//",
               label="orchestration" if i == 0 else None)
        ax.text(i, s["median_step_s"], f"{frac:.0%}", ha="center", va="bottom")
    ax.set_xticks(range(len(names)), [LABELS[n] for n in names])
    ax.set(title="median step: compute vs orchestration", ylabel="seconds")
    ax.set_ylim(0, 1.3 * max(systems[n]["median_step_s"] for n in names))
    ax.legend(loc="upper left", ncols=2)
    ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"{report['config']['workload']} workload: {report['config']['sequences_per_step']} sequences/step, "
                 f"{report['config']['max_response_length']} response tokens max, {report['machine']['cpus']} CPUs")
    return save_figure(fig, out, dpi=90)


# -- command line -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.runtime", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="all", choices=("all", *WORKLOADS),
                   help="which workload (default: all, one after the other)")
    p.add_argument("--steps", type=int, default=30, help="RL steps per system and round (default 30)")
    p.add_argument("--rounds", type=int, default=2,
                   help="run the systems in turn this many times and pool the steps (default 2): "
                        "interleaving evens out load from other processes on a shared machine")
    p.add_argument("--quick", action="store_true", help="smoke run: 4 steps, 1 round, outputs under runs/ only")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--no-profile", action="store_true", help="skip the breakdown of hybridflow's step")
    p.add_argument("--out-dir", type=Path, help="where runtime*.json and runtime*.png go (default benchmarks/results)")
    p.add_argument("--readme", type=Path, help="Markdown file whose generated blocks are updated")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per system and round")
    p.add_argument("--render", action="store_true", help="only redraw the plots and README sections from the JSON")
    p.add_argument("--worker", choices=(*SYSTEMS, "profile"), help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--ranks", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    steps, rounds = (4, 1) if args.quick else (args.steps, args.rounds)
    if steps <= WARMUP:
        p.error(f"--steps must exceed the {WARMUP} warm-up steps")
    workloads = list(WORKLOADS.values()) if args.workload == "all" else [WORKLOADS[args.workload]]
    if args.worker:
        raw = run_system(args.worker, steps, args.result, workloads[0], (args.ranks, args.threads))
        args.result.write_text(json.dumps(raw))
        return 0
    out_dir = args.out_dir or (ROOT / "runs" / "bench-runtime-quick" if args.quick else RESULTS)
    readme = args.readme or (None if args.quick else README)
    if args.render:
        for workload in workloads:
            path = out_dir / f"{workload.stem}.json"
            report = json.loads(path.read_text())
            if report.get("format") != FORMAT:
                p.error(f"{path}: results format {report.get('format')!r}, this code reads {FORMAT}")
            write_outputs(report, out_dir, readme)
        return 0
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        p.error(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    workdir = ROOT / "runs" / ("bench-runtime-quick" if args.quick else "bench-runtime")
    workdir.mkdir(parents=True, exist_ok=True)
    for workload in workloads:
        report = bench_workload(workload, systems, steps, rounds, workdir, args.timeout, not args.no_profile)
        write_outputs(report, out_dir, readme)
        print(json.dumps({k: report[k] for k in ("ratio_vs_naive_ray", "ratio_vs_trl", "orchestration_overhead_frac")}))
        print(f"[bench] {workload.name} done in {report['bench_wall_s']:.0f} s")
    return 0


def bench_workload(workload: Workload, systems: list[str], steps: int, rounds: int, workdir: Path,
                   timeout_s: float, profile: bool) -> dict[str, Any]:
    """Every system on one workload, `rounds` times in turn; the report of that workload."""
    from hybridflow.data.tiny import ensure_tiny_model

    ensure_tiny_model(**workload.model)  # made once here, not inside a timed run
    t_start = time.perf_counter()
    raws: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    for r, system, (ranks, threads) in interleaved(rounds, systems, layouts):
        print(f"[bench] {workload.name}, round {r}/{rounds}: {LABELS[system]}, {ranks} rank(s) x {threads} "
              f"thread(s), {steps} steps ...", flush=True)
        raws[system].append(launch(system, steps, workdir, timeout_s, workload, (ranks, threads), f"-{r}"))
        s = summarise(raws[system][-1:], WARMUP)
        print(f"[bench]   {s['tokens_per_s']:.0f} tokens/s, median step {s['median_step_s']:.3f} s, "
              f"overhead {_fmt(s['orchestration_overhead_frac'], '.1%')}, "
              f"peak RSS {s['peak_rss_mib']:.0f} MiB, wall {s['rounds'][0]['wall_s']:.0f} s", flush=True)
    summaries = {s: summarise(raws[s], WARMUP) for s in systems}
    report = {"format": FORMAT, **build_report(summaries, steps, WARMUP, workload)}
    report["config"]["rounds"] = rounds
    if "hybridflow" in systems and profile:
        print(f"[bench] breakdown of hybridflow's step, {max(steps, 12)} steps ...", flush=True)
        try:
            best = summaries["hybridflow"]
            report["hybridflow_step_breakdown"] = launch("profile", max(steps, 12), workdir, timeout_s, workload,
                                                         (best["ranks"], best["torch_threads"]))["profile"]
        except RuntimeError as e:
            print(f"[bench] the breakdown failed, writing the rest: {e}", flush=True)
    report["bench_wall_s"] = round(time.perf_counter() - t_start, 1)
    return report


def write_outputs(report: dict[str, Any], out_dir: Path, readme: Path | None) -> None:
    workload = WORKLOADS[report["config"]["workload"]]
    out_dir.mkdir(parents=True, exist_ok=True)
    data, png = out_dir / f"{workload.stem}.json", out_dir / f"{workload.stem}.png"
    data.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, png)
    if readme is not None:
        write_section(readme, *workload.markers, markdown(report))
    print(f"[bench] wrote {data}, {png}" + (f", {readme}" if readme else ""))


if __name__ == "__main__":
    sys.exit(main())
