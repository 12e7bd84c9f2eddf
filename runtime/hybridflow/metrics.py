"""Per-step metrics as JSONL, and a PNG of the curves next to the file."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

PLOTTED = ("reward_mean", "kl", "actor_loss", "critic_loss", "entropy", "response_length", "tokens_per_s")


class MetricsLog:
    """Append-only within a run; after a rollback the steps past the restored one are dropped.

    Without a path (spec.trainer.loggers without jsonl) the records are kept in memory, for the run's result.
    """

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path else None
        self._memory: list[dict[str, Any]] = []
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        if self.path:
            with self.path.open("a") as f:
                f.write(json.dumps(record, sort_keys=True) + "\n")
        else:
            self._memory.append(dict(record))

    def read(self) -> list[dict[str, Any]]:
        if not self.path:
            return list(self._memory)
        if not self.path.is_file():
            return []
        return parse_records(self.path.read_text())

    def truncate_after(self, step: int) -> None:
        self._memory = [r for r in self._memory if r.get("step", 0) <= step]
        if not self.path or not self.path.is_file():
            return
        kept = [r for r in self.read() if r.get("step", 0) <= step]
        self.path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))

    def reset(self) -> None:
        self._memory = []
        if self.path and self.path.is_file():
            self.path.unlink()


def parse_records(text: str) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl's text. A last line without its newline is being written right now
    (a reader such as the dashboard runs beside the writer), so it is left for the next read."""
    lines = text.split("\n")
    return [json.loads(line) for line in lines[:-1] if line.strip()]


def plot_metrics(records: list[dict[str, Any]], out: str | Path, title: str = "") -> Path | None:
    """One panel per metric against step; returns the PNG path."""
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in PLOTTED if any(_finite(r.get(k)) for r in records)]
    cols = 3
    rows = max(1, math.ceil(len(keys) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys, strict=False):
        pts = [(r["step"], r[key]) for r in records if _finite(r.get(key))]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 60 else None)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and math.isfinite(v)
