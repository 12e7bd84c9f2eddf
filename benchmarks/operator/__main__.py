"""Operator benchmark.

    python -m benchmarks.operator                  # N = 100 and 500: results/operator.json, .png, README.md
    python -m benchmarks.operator --quick          # N = 10 and 20, written under runs/ only
    python -m benchmarks.operator --sizes 50       # any sizes, written under runs/ only
    python -m benchmarks.operator --render --attach "run 2=runs/x"   # redraw; add another run's summary

What-ifs (written under runs/ only): --trace-memory runs the operator under tracemalloc, --no-baseline skips
the KubeRay-alone phases.

An official run (N = 100 and 500, nothing else asked) also keeps `previous_design`: the figures of the operator
design measured before the current one, carried over from the results file it replaces (or taken from that
file's own figures when it has none). `--render --previous FILE` takes them from another results file.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import write_section
from benchmarks.operator import report
from benchmarks.operator.summarise import (
    FormatError,
    check_format,
    previous_design,
    results_file,
    run_summary,
    summarise,
)

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "benchmarks" / "README.md"
QUICK_OUT = ROOT / "runs" / "bench-operator"
SIZES = (100, 500)
QUICK_SIZES = (10, 20)
# Nine pairs: the N = 100 ratio of single pairs moved between 0.87 and 1.51 on the shared 2-core machine
# (benchmarks/README.md, "Every run"); two nine-pair runs of the same operator had medians 1.09 and 1.07.
REPEATS = 9
# Larger N run once: one N = 500 pair took about four minutes (operator.json: windows of 101 s and 55 s, 60 s to
# delete a namespace of 500 jobs).
REPEAT_UP_TO = 100


def load(path: Path) -> dict[str, Any]:
    return dict(check_format(json.loads(path.read_text()), path))


def write_outputs(raw: Mapping[str, Any], out: Path, official: bool) -> None:
    """operator.json, operator.png, and the README section (official runs) or a README fragment beside them."""
    doc = summarise(raw)
    (out / "operator.json").write_text(json.dumps(results_file(raw), indent=2) + "\n")
    report.plot(doc, out / "operator.png")
    block = report.readme_block(doc)
    if official:
        write_section(README, report.BEGIN, report.END, block)
    else:
        (out / "README-operator.md").write_text(block + "\n")
    print(f"wrote {out / 'operator.json'} and {out / 'operator.png'}" + (f" and {README}" if official else ""))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.operator", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", help="comma-separated N (default 100,500)")
    p.add_argument("--quick", action="store_true", help=f"N = {','.join(map(str, QUICK_SIZES))}, outputs under runs/")
    p.add_argument("--out", type=Path, help="directory for operator.json / .png (default: benchmarks/results)")
    p.add_argument("--keep", action="store_true", help="keep the control plane's work dir and logs")
    p.add_argument("--repeats", type=int, default=REPEATS,
                   help=f"pairs of phases per N up to {REPEAT_UP_TO} (default {REPEATS}); larger N run once")
    p.add_argument("--no-baseline", action="store_true", help="what-if: skip the KubeRay-alone phases")
    p.add_argument("--trace-memory", action="store_true",
                   help="what-if: trace the operator's Python allocations (slows it down; outputs under runs/)")
    p.add_argument("--render", action="store_true",
                   help="only redraw the plot and the README section from an existing operator.json")
    p.add_argument("--attach", action="append", default=[], metavar="NAME=DIR",
                   help="with --render: add the summary of the run in DIR/operator.json (a repeat, a what-if) "
                        "as what_if.NAME")
    p.add_argument("--previous", type=Path, metavar="FILE",
                   help="with --render: take previous_design from this older operator.json (its own "
                        "previous_design when it has one, else its figures)")
    args = p.parse_args(argv)
    sizes = tuple(int(s) for s in args.sizes.split(",")) if args.sizes else (QUICK_SIZES if args.quick else SIZES)
    what_if = args.no_baseline or args.trace_memory
    official = not args.quick and not args.sizes and args.out is None and not what_if
    out = args.out or (RESULTS if official else QUICK_OUT)
    if args.render:
        try:
            raw = load(out / "operator.json")
            for item in args.attach:
                name, _, where = item.rpartition("=")  # a name may hold "=": the path comes last
                raw.setdefault("what_if", {})[name] = run_summary(summarise(load(Path(where) / "operator.json")))
            if args.previous:
                raw["previous_design"] = previous_design(load(args.previous))
        except FormatError as e:
            p.error(str(e))
        write_outputs(raw, out, official)
        return 0

    from benchmarks.operator import measure  # needs the operator and the Kubernetes client; --render does not

    out.mkdir(parents=True, exist_ok=True)
    (ROOT / "runs").mkdir(exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix="bench-operator-", dir=ROOT / "runs"))
    try:
        raw = measure.run(sizes, work_dir, keep=args.keep, baseline=not args.no_baseline,
                          trace_memory=args.trace_memory, repeats=max(1, args.repeats), repeat_up_to=REPEAT_UP_TO)
    except KeyboardInterrupt:
        return 130
    replaced = out / "operator.json"
    if official and replaced.exists():
        raw["previous_design"] = previous_design(load(replaced))
    write_outputs(raw, out, official)
    for key, value in summarise(raw)["headline"].items():
        print(f"  {key} = {value}")
    if args.keep:
        print(f"logs kept in {work_dir}")
    else:
        shutil.rmtree(work_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
