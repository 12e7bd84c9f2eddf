"""Spec fuzzing for the chaos campaign: tests/test_fuzz_spec.py under pytest, in a process of its own.

2,000 examples per property (`full`) or 200 (quick), against a real kube-apiserver; the test file writes how
many each property ran, and this returns them with the verdict and the wall time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TEST_FILE = "tests/test_fuzz_spec.py"
FULL_EXAMPLES = 2000
QUICK_EXAMPLES = 200
TIMEOUT_S = 3600


def run(out_dir: Path, full: bool) -> dict[str, Any]:
    """{"examples": {property: count}, "passed": bool, "wall_s": float}; pytest's output goes to out_dir/fuzz.log."""
    out_dir.mkdir(parents=True, exist_ok=True)
    report, log = out_dir / "fuzz.json", out_dir / "fuzz.log"
    report.unlink(missing_ok=True)
    env = {
        **os.environ,
        "HYBRIDFLOW_FUZZ_EXAMPLES": str(FULL_EXAMPLES if full else QUICK_EXAMPLES),
        "HYBRIDFLOW_FUZZ_REPORT": str(report),
        "PYTHONPATH": os.pathsep.join([str(ROOT / "runtime"), str(ROOT / "operator"), str(ROOT)]),
    }
    t0 = time.perf_counter()
    with log.open("w") as out:
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", TEST_FILE],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=TIMEOUT_S, check=False)
    wall_s = time.perf_counter() - t0
    counts = json.loads(report.read_text())["examples"] if report.is_file() else {}
    return {"examples": counts, "passed": result.returncode == 0 and bool(counts), "wall_s": round(wall_s, 1)}
