"""Per-step metrics as JSONL, and a PNG of the curves (training and validation) next to the file."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

PLOTTED = ("reward_mean", "kl", "actor_loss", "critic_loss", "entropy", "response_length", "tokens_per_s",
           "val/accuracy", "val/pass_rate")
OVERLAID = {"reward_mean": "val/reward_mean", "response_length": "val/response_length_mean"}
"""The val/ metric drawn on the panel of each training metric (hybridflow.evaluation)."""


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


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only, no display), imported at first use so that
    nothing else pays for it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def parse_records(text: str) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl's text. A last line without its newline is being written right now
    (a reader such as the dashboard runs beside the writer), so it is left for the next read."""
    lines = text.split("\n")
    return [json.loads(line) for line in lines[:-1] if line.strip()]


def step_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of training steps, without the baseline evaluation's (step 0, val/ metrics alone)."""
    return [r for r in records if r.get("step", 0) > 0]


Series = dict[str, list[tuple[int, float]]]
"""A panel's curves: label -> (step, value) points."""


def panels(records: list[dict[str, Any]]) -> list[tuple[str, Series]]:
    """The plot's panels in PLOTTED order: (title, series) for each metric with a finite value.

    A val/ metric of OVERLAID is drawn as a second curve (`val`) on its training metric's panel (`train`),
    with a point at each evaluated step.
    """
    out: list[tuple[str, Series]] = []
    for key in PLOTTED:
        series = {label: pts for label, k in (("train", key), ("val", OVERLAID.get(key)))
                  if k is not None and (pts := _points(records, k))}
        if not series:
            continue
        if len(series) == 1:
            series = {key: next(iter(series.values()))}
        out.append((key, series))
    return out


def metrics_figure(records: list[dict[str, Any]], title: str = "") -> Figure:
    """One panel per metric against step (see `panels`)."""
    plt = pyplot()

    shown = panels(records)
    cols = 3
    rows = max(1, math.ceil(len(shown) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
    for ax, (key, series) in zip(axes.flat, shown, strict=False):
        for label, pts in series.items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 60 else None, label=label)
        if len(series) > 1:
            ax.legend(fontsize="small")
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(shown):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_metrics(records: list[dict[str, Any]], out: str | Path, title: str = "") -> Path | None:
    """The PNG of `metrics_figure`; returns its path (None without records)."""
    if not records:
        return None
    import matplotlib.pyplot as plt

    fig = metrics_figure(records, title)
    out = Path(out)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def _points(records: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in records if _finite(r.get(key))]


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and math.isfinite(v)
