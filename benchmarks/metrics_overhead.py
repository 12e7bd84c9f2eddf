"""What exporting Prometheus metrics costs the tiny PPO run's step time: with against without.

    python -m benchmarks.metrics_overhead [--steps 30] [--pairs 2]

Each run is a fresh process and a fresh local Ray, the same job (examples/tiny-ppo.yaml, with the reward
on a node of its own so that a data edge is measured too), once with HYBRIDFLOW_METRICS=0 and once with
metrics exported every second (RAY_metrics_report_interval_ms=1000, ten times Ray's default rate); the
order alternates per pair. The figure is the median `timing/step` of the steps after the first two
(warm-up), and the ratio with / without.
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
    doc = yaml.safe_load((ROOT / "examples" / "tiny-ppo.yaml").read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["graph"] = {
        "nodes": [{"name": "actor_rollout", "role": "actor_rollout", "resources": {"CPU": 1}},
                  {"name": "reference", "role": "reference"},
                  {"name": "reward", "role": "reward", "resources": {"CPU": 1}},
                  {"name": "critic", "role": "critic", "resources": {"CPU": 1}}],
        "edges": [{"src": "actor_rollout", "dst": "reference", "coLocate": True},
                  {"src": "actor_rollout", "dst": "reward"},
                  {"src": "actor_rollout", "dst": "critic"},
                  {"src": "critic", "dst": "actor_rollout", "control": True}],
    }
    doc["spec"]["data"]["batchSize"] = 64
    doc["spec"]["scheduling"] = {"microBatchSize": 16}
    doc["spec"]["trainer"].update(totalSteps=steps, resume="never", checkpoint={"every": 0, "path": "/tmp/unused"})
    return doc


def run_once(steps: int, metrics: bool, out: Path) -> list[float]:
    """One training run in its own process; the step times it recorded."""
    env = {**os.environ, "HYBRIDFLOW_METRICS": "1" if metrics else "0", "RAY_metrics_report_interval_ms": "1000",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "runtime"), str(ROOT / "operator"), str(ROOT)])}
    doc = out.with_suffix(".yaml")
    doc.write_text(yaml.safe_dump(job_doc(steps, f"overhead-{'on' if metrics else 'off'}")))
    code = ("import sys, yaml; from hybridflow.api import parse_job; from hybridflow.driver import init_ray, "
            "run_training; init_ray(local=True, num_cpus=8); "
            "run_training(parse_job(yaml.safe_load(open(sys.argv[1]))), sys.argv[2])")
    for attempt in range(1, RAY_STARTS + 1):  # Ray's start can time out on a loaded machine: start again
        out.unlink(missing_ok=True)
        done = subprocess.run([sys.executable, "-c", code, str(doc), str(out)], env=env, cwd=ROOT, timeout=1800)
        if done.returncode == 0:
            break
        if attempt == RAY_STARTS:
            raise RuntimeError(f"the {'with' if metrics else 'without'} run failed {RAY_STARTS} times")
    records = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    return [r["timing/step"] for r in records[WARMUP_STEPS:]]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here too")
    args = p.parse_args()
    times: dict[str, list[float]] = {"with": [], "without": []}
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            order = (True, False) if pair % 2 == 0 else (False, True)
            for metrics in order:
                key = "with" if metrics else "without"
                got = run_once(args.steps, metrics, Path(tmp) / f"{key}-{pair}.jsonl")
                times[key] += got
                print(f"pair {pair + 1} {key:>7} metrics: median step {statistics.median(got):.4f} s", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"steps_per_run": args.steps, "pairs": args.pairs, "median_step_s": med,
              "ratio_with_over_without": med["with"] / med["without"],
              "stdev_step_s": {k: statistics.stdev(v) for k, v in times.items()}}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
