"""What exporting Prometheus metrics costs the tiny PPO run's step time: with against without.

    python -m benchmarks.metrics_overhead [--steps 30] [--pairs 2]

Each run is a fresh process and a fresh local Ray, the same job (examples/tiny-ppo.yaml, with the reward
on a node of its own so that a data edge is measured too), once with HYBRIDFLOW_METRICS=0 and once with
metrics exported every second (RAY_metrics_report_interval_ms=1000, ten times Ray's default rate); the
order alternates per pair. Figures: the median `timing/step` of the steps after the first two (warm-up)
and the ratio with / without; the wall time of a run's steps per step (the export runs between steps,
outside `timing/step`); and the median time of one step's export, timed in the controller itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
WARMUP_STEPS = 2
RAY_STARTS = 3


def job_doc(steps: int, name: str) -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "examples" / "tiny-ppo-remote-reward.yaml").read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["trainer"].update(totalSteps=steps, resume="never", checkpoint={"every": 0, "path": "/tmp/unused"})
    return doc


RUN = """
import json, sys, time, yaml
from hybridflow import telemetry
from hybridflow.api import parse_job
from hybridflow.driver import init_ray
from hybridflow.trainer import Trainer

spent = []
export = telemetry.StepExporter.export

def timed(self, record, scheduler):
    t0 = time.perf_counter()
    export(self, record, scheduler)
    spent.append(time.perf_counter() - t0)

telemetry.StepExporter.export = timed
init_ray(local=True, num_cpus=8)
job = parse_job(yaml.safe_load(open(sys.argv[1])))
trainer = Trainer(job.model_dump(by_alias=True, mode="json"), sys.argv[2])
trainer.start()
t0 = time.perf_counter()
try:
    trainer.fit()
finally:
    wall = time.perf_counter() - t0
    trainer.shutdown()
json.dump({"wall_s": wall, "export_s": spent}, open(sys.argv[3], "w"))
"""


def run_once(steps: int, metrics: bool, out: Path) -> dict[str, Any]:
    """One training run in its own process (the controller in that process, so its exports can be timed):
    the step times it recorded, its wall time per step and the seconds each export took."""
    env = {**os.environ, "HYBRIDFLOW_METRICS": "1" if metrics else "0", "RAY_metrics_report_interval_ms": "1000",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "runtime"), str(ROOT / "operator"), str(ROOT)])}
    doc = out.with_suffix(".yaml")
    doc.write_text(yaml.safe_dump(job_doc(steps, f"overhead-{'on' if metrics else 'off'}")))
    timing = out.with_suffix(".timing.json")
    for attempt in range(1, RAY_STARTS + 1):  # Ray's start can time out on a loaded machine: start again
        out.unlink(missing_ok=True)
        done = subprocess.run([sys.executable, "-c", RUN, str(doc), str(out), str(timing)], env=env, cwd=ROOT,
                              timeout=1800)
        if done.returncode == 0:
            break
        if attempt == RAY_STARTS:
            raise RuntimeError(f"the {'with' if metrics else 'without'} run failed {RAY_STARTS} times")
    records = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    timed = json.loads(timing.read_text())
    return {"step_s": [r["timing/step"] for r in records[WARMUP_STEPS:]], "wall_per_step_s": timed["wall_s"] / steps,
            "export_s": timed["export_s"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here too")
    args = p.parse_args()
    times: dict[str, list[float]] = {"with": [], "without": []}
    walls: dict[str, list[float]] = {"with": [], "without": []}
    exports: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            order = (True, False) if pair % 2 == 0 else (False, True)
            for metrics in order:
                key = "with" if metrics else "without"
                got = run_once(args.steps, metrics, Path(tmp) / f"{key}-{pair}.jsonl")
                times[key] += got["step_s"]
                walls[key].append(got["wall_per_step_s"])
                exports += got["export_s"]
                print(f"pair {pair + 1} {key:>7} metrics: median step {statistics.median(got['step_s']):.4f} s, "
                      f"wall per step {got['wall_per_step_s']:.4f} s", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    wall = {k: statistics.median(v) for k, v in walls.items()}
    export = statistics.median(exports)
    result = {"steps_per_run": args.steps, "pairs": args.pairs,
              "median_step_s": med, "ratio_with_over_without": med["with"] / med["without"],
              "wall_per_step_s": wall, "wall_ratio_with_over_without": wall["with"] / wall["without"],
              "export_per_step_s": export, "export_share_of_step": export / med["with"],
              "step_s_quartiles": {k: statistics.quantiles(v, n=4) for k, v in times.items()}}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
