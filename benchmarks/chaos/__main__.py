"""The reliability campaign: faults injected into the runtime and the operator, fuzzed specs, security checks.

    python -m benchmarks.chaos            # everything, full size: results/reliability.json, .png, README table
    python -m benchmarks.chaos --quick    # a few of each, written under runs/chaos only
    python -m benchmarks.chaos --parts runtime,fuzz   # some parts (full size), written under runs/chaos only
    python -m benchmarks.chaos --reuse runtime        # take that part from its earlier DIR/runtime.json

Each part's result is kept beside reliability.json (reliability-runtime.json, reliability-operator.json, ...), so
a part that failed can be rerun alone and the figures put together again with --reuse for the others.

Exits 1 when a fault was not survived, anything was duplicated or lost, a fuzz property or a security check
failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from datetime import date
from pathlib import Path
from typing import Any

from benchmarks.chaos import report
from benchmarks.common import write_section

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
QUICK_OUT = ROOT / "runs" / "chaos"
PARTS = ("runtime", "operator", "fuzz", "security")


def machine() -> str:
    gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{platform.machine()}, {os.cpu_count()} cores, {gib:.0f} GiB, no GPU"


def _runtime(out: Path, full: bool) -> Any:
    from benchmarks.chaos import runtime_faults

    return runtime_faults.run(out, full)


def _operator(out: Path, full: bool) -> Any:
    from benchmarks.chaos import operator_faults

    return operator_faults.run(out, full)


def _fuzz(out: Path, full: bool) -> Any:
    from benchmarks.chaos import fuzz

    return fuzz.run(out, full)


def _security(out: Path, full: bool) -> Any:
    from benchmarks.chaos import security

    return security.run()


RUNNERS: dict[str, Callable[[Path, bool], Any]] = {
    "runtime": _runtime, "operator": _operator, "fuzz": _fuzz, "security": _security}
"""Each part, imported when it runs: the runtime part needs torch and Ray, the others a control plane."""


def _shown(path: Path) -> str:
    """A path as the table names it: from the repository root when inside it."""
    return str(path.resolve().relative_to(ROOT)) if path.resolve().is_relative_to(ROOT) else str(path)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.chaos", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a few faults of each kind, 200 fuzz examples")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--reuse", default="", help="comma-separated parts to read from their earlier JSON in the output")
    p.add_argument("--out", type=Path, help="directory for reliability.json / .png")
    args = p.parse_args(argv)
    parts = [x for x in args.parts.split(",") if x]
    reuse = [x for x in args.reuse.split(",") if x]
    unknown = sorted(set(parts + reuse) - set(PARTS))
    if unknown:
        p.error(f"unknown part {', '.join(unknown)}; allowed: {', '.join(PARTS)}")
    parts = list(dict.fromkeys(parts + reuse))
    official = not args.quick and set(parts) == set(PARTS) and args.out is None
    out = args.out or (RESULTS if official else QUICK_OUT)
    out.mkdir(parents=True, exist_ok=True)
    work = QUICK_OUT if official else out  # the runs' own files (checkpoints, logs) stay out of the repository
    results, walls = {}, {}
    for part in parts:
        saved = out / f"reliability-{part}.json"
        if part in reuse:
            if not saved.is_file():
                p.error(f"--reuse {part}: no {saved} from an earlier run")
            kept = json.loads(saved.read_text())
        else:
            start = time.monotonic()
            kept = {"wall_s": 0.0, "result": RUNNERS[part](work / part, not args.quick)}
            kept["wall_s"] = round(time.monotonic() - start, 1)
            saved.write_text(json.dumps(kept, indent=2) + "\n")
        results[part], walls[part] = kept["result"], kept["wall_s"]
    rows = [row for part in ("runtime", "operator") if part in results
            for row in report.check_rows(part, results[part])]
    fuzz = results.get("fuzz", {"passed": True})
    security = results.get("security", {"passed": 0, "failed": 0, "files": []})
    meta = {"date": date.today().isoformat(), "machine": machine(), "full": not args.quick, "parts": parts,
            "reused": reuse, "wall_s": round(sum(walls.values()), 1), "part_wall_s": walls,
            "results": _shown(out / "reliability.json")}
    doc = report.summarise(rows, fuzz, security, meta)
    (out / "reliability.json").write_text(json.dumps(doc, indent=2) + "\n")
    report.plot(doc, out / "reliability.png")
    section = report.table(doc)
    if official:
        write_section(README, report.BEGIN, report.END, section)
    else:
        (out / "README-section.md").write_text(section + "\n")
    print(section)
    print(f"\nwrote {out / 'reliability.json'} and reliability.png", file=sys.stderr)
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
