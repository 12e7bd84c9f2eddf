"""The reliability figures: one JSON document, a README table and a plot, from the campaign's parts (pure)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.operator.summarise import percentile, rounded
from hybridflow.metrics import pyplot

BEGIN, END = "<!-- reliability:start -->", "<!-- reliability:end -->"
ROW_KEYS = ("kind", "injected", "survived", "duplicates", "losses", "recovery_s", "detail")


class FormatError(ValueError):
    """A part of the campaign returned a row that is not the agreed shape; names the part and the key."""


def recovery(samples: Sequence[float]) -> dict[str, Any]:
    """A row's recovery_s: p50/p95 of the recovery times in seconds, with the samples (every part's rows)."""
    return {"p50": rounded(percentile(samples, 50)), "p95": rounded(percentile(samples, 95)),
            "samples": [round(s, 3) for s in samples]}


def check_rows(part: str, rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for row in rows:
        missing = [k for k in ROW_KEYS if k not in row]
        if missing:
            raise FormatError(f"{part}: a row lacks {', '.join(missing)}")
        if row["survived"] > row["injected"]:
            raise FormatError(f"{part}/{row['kind']}: survived {row['survived']} > injected {row['injected']}")
        out.append({**row, "part": part})
    return out


def summarise(rows: Sequence[Mapping[str, Any]], fuzz: Mapping[str, Any], security: Mapping[str, Any],
              meta: Mapping[str, Any]) -> dict[str, Any]:
    """reliability.json: faults by kind, their totals, fuzz examples and security checks.

    `ok` holds when every injected fault was survived, nothing was duplicated or lost, every fuzz property
    passed and every security check passed.
    """
    injected = sum(r["injected"] for r in rows)
    survived = sum(r["survived"] for r in rows)
    duplicates = sum(r["duplicates"] for r in rows)
    losses = sum(r["losses"] for r in rows)
    ok = (injected == survived and duplicates == 0 and losses == 0 and bool(fuzz.get("passed"))
          and security.get("failed", 1) == 0)
    return {
        **meta,
        "faults": list(rows),
        "totals": {"injected": injected, "survived": survived, "duplicates": duplicates, "losses": losses},
        "fuzz": dict(fuzz),
        "security": dict(security),
        "ok": ok,
    }


def _seconds(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f} s"


def table(doc: Mapping[str, Any]) -> str:
    """The README section: a table of faults by kind, then fuzzing and security lines."""
    lines = [BEGIN, "",
             f"Measured {doc['date']} on {doc['machine']} (`make chaos`: "
             + ", ".join(f"{part} {s / 60:.0f} min" for part, s in doc.get("part_wall_s", {}).items())
             + (f"; {', '.join(doc['reused'])} as measured by the run before (`--reuse`)" if doc.get("reused") else "")
             + f"; `{doc.get('results', 'benchmarks/results/reliability.json')}`).", "",
             "| fault | part | injected | survived | duplicates | losses | recovery p50 | recovery p95 |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in doc["faults"]:
        rec = r["recovery_s"]
        lines.append(f"| {r['kind']} | {r['part']} | {r['injected']} | {r['survived']} | {r['duplicates']} | "
                     f"{r['losses']} | {_seconds(rec['p50'])} | {_seconds(rec['p95'])} |")
    t = doc["totals"]
    lines.append(f"| **all** | | **{t['injected']}** | **{t['survived']}** | **{t['duplicates']}** | "
                 f"**{t['losses']}** | | |")
    fuzz = doc["fuzz"]
    examples = fuzz.get("examples", {})
    lines += ["", "Fuzzed specs (hypothesis, `tests/test_fuzz_spec.py`): "
              + ", ".join(f"{name} {count:,}" for name, count in examples.items())
              + f" examples; {'all properties held' if fuzz.get('passed') else '**a property failed**'}.",
              "", f"Security checks: {doc['security'].get('passed', 0)} passed, {doc['security'].get('failed', 0)} "
              f"failed ({', '.join(doc['security'].get('files', []))}).", "", END]
    return "\n".join(lines)


def plot(doc: Mapping[str, Any], path: Path) -> None:
    """Recovery time by fault kind: every sample as a dot, p50 and p95 as ticks."""
    plt = pyplot()

    rows = [r for r in doc["faults"] if r["recovery_s"]["samples"]]
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.5 * max(1, len(rows))))
    for i, r in enumerate(rows):
        samples = r["recovery_s"]["samples"]
        ax.scatter(samples, [i] * len(samples), s=14, alpha=0.6)
        for q, marker in (("p50", "|"), ("p95", "x")):
            if r["recovery_s"][q] is not None:
                ax.scatter([r["recovery_s"][q]], [i], marker=marker, s=160, color="black")
    ax.set_yticks(range(len(rows)), [f"{r['kind']} ({r['survived']}/{r['injected']})" for r in rows])
    ax.set_xlabel("seconds from the fault to recovery (| p50, x p95)")
    ax.set_title("hybridflow: recovery from injected faults")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
