"""The dashboard's view model: metrics records and a scheduler status in, plain JSON-ready data out.

Pure functions only (no Ray, no I/O), so every number a panel shows is computed, and tested, here; the
page's script only draws them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, get_args

from hybridflow.plan import Phase

CURVES = ("reward_mean", "kl", "tokens_per_s")
"""The metrics drawn as curves against step."""
PHASE_KEYS = tuple(f"timing/{phase}" for phase in get_args(Phase))
"""The wall time of each phase of a step, as the controller timed it (step.run_step)."""
MAX_POINTS = 600
"""Curves longer than this are thinned for the page; the last point is always kept."""
MAX_DECISIONS = 300


@dataclass(frozen=True)
class StepSplit:
    """One step's wall time in three parts that add up to it.

    compute: worker compute on the critical path (the slowest rank of each phase) plus the controller's own
        advantage math: timing/step * (1 - orchestration_overhead_frac).
    communication: the rest of the time inside the phases: Ray calls, object-store transfers and the waits
        on edge queues: the phases' wall time (timing/rollout, values, advantages, update, sync) minus compute.
    scheduling: the controller's time outside the phases: sampling prompts, dispatching the step, the KL
        controller and the step's record: timing/step minus the phases' wall time.
    """

    step_s: float
    compute_s: float
    communication_s: float
    scheduling_s: float


def step_split(record: Mapping[str, Any]) -> StepSplit | None:
    """The split of one record (see StepSplit), or None when the record lacks the step's timing."""
    step = _number(record.get("timing/step"))
    frac = _number(record.get("orchestration_overhead_frac"))
    if step is None or frac is None or step <= 0:
        return None
    phases = sum(v for k in PHASE_KEYS if (v := _number(record.get(k))) is not None)
    compute = min(step, step * (1.0 - frac))
    scheduling = min(step - compute, max(0.0, step - phases))
    return StepSplit(step, compute, step - compute - scheduling, scheduling)


def breakdown(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Mean seconds per step of each part over the run, their fractions of the mean step, and the per-step
    series (thinned like the curves)."""
    rows = [(r["step"], s) for r in records if (s := step_split(r)) is not None]
    if not rows:
        return {"steps": 0}
    n = len(rows)
    mean = {part: sum(getattr(s, f"{part}_s") for _, s in rows) / n
            for part in ("step", "compute", "communication", "scheduling")}
    series = thin([[step, s.compute_s, s.communication_s, s.scheduling_s] for step, s in rows])
    return {
        "steps": n,
        "mean_s": mean,
        "fraction": {p: mean[p] / mean["step"] for p in ("compute", "communication", "scheduling")},
        "last": asdict(rows[-1][1]),
        "series": series,
    }


def thin(points: Sequence[list[Any]], limit: int = MAX_POINTS) -> list[list[Any]]:
    """At most `limit` points, evenly spaced, first and last kept."""
    if len(points) <= limit:
        return [list(p) for p in points]
    stride = (len(points) - 1) / (limit - 1)
    return [list(points[round(i * stride)]) for i in range(limit)]


def curves(records: Sequence[Mapping[str, Any]], keys: Iterable[str] = CURVES) -> dict[str, dict[str, Any]]:
    """[step, value] points of each metric, and its last value (non-finite values are left out)."""
    out: dict[str, dict[str, Any]] = {}
    for key in keys:
        pts = [[r["step"], v] for r in records if (v := _number(r.get(key))) is not None]
        out[key] = {"points": thin(pts), "last": pts[-1][1] if pts else None,
                    "last_step": pts[-1][0] if pts else None}
    return out


def graph(status: Mapping[str, Any]) -> dict[str, Any]:
    """Nodes with their parallelism and placement, laid out in layers along the data and co-location edges
    (control edges point back and would make a cycle), and every edge with its kind."""
    nodes: Mapping[str, Any] = status.get("nodes", {})
    edges = [_edge(e) for e in status.get("graph", {}).get("edges", [])]
    layer = {name: 0 for name in nodes}
    forward = [(e["src"], e["dst"]) for e in edges if e["kind"] != "control" and e["src"] in layer
               and e["dst"] in layer]
    for _ in range(len(layer)):
        changed = False
        for src, dst in forward:
            if layer[dst] < layer[src] + 1 <= len(layer):
                layer[dst] = layer[src] + 1
                changed = True
        if not changed:
            break
    row: dict[int, int] = {}
    out = []
    for name, node in nodes.items():
        workers = [{"instance": w.get("instance"), "node_id": w.get("node_id"), "pid": w.get("pid"),
                    "gpu_ids": list(w.get("gpu_ids") or []), "actor": w.get("actor")}
                   for w in node.get("workers", [])]
        out.append({"name": name, "role": node.get("role", ""), "group": node.get("group"),
                    "parallelism": node.get("parallelism", 0), "planned": node.get("planned_parallelism"),
                    "target": node.get("target_parallelism"), "data_parallel": bool(node.get("data_parallel")),
                    "queue_len": node.get("queue_len", 0), "workers": workers,
                    "layer": layer[name], "row": row.setdefault(layer[name], 0)})
        row[layer[name]] += 1
    return {"nodes": out, "edges": edges}


def _edge(e: Mapping[str, Any]) -> dict[str, Any]:
    kind = "control" if e.get("control") else "colocated" if e.get("co_locate") else "data"
    return {"src": e["src"], "dst": e["dst"], "kind": kind, "data_type": e.get("data_type", ""),
            "consistency": e.get("consistency", "strong")}


def memory(status: Mapping[str, Any]) -> dict[str, Any]:
    """The heatmap: one row per Ray node, one cell per worker process on it (co-located graph nodes share
    one), valued with the worker's last memory sample (GPU memory reserved by torch, else RSS)."""
    rows: dict[str, list[dict[str, Any]]] = {}
    seen: set[str] = set()
    for node in status.get("nodes", {}).values():
        for w in node.get("workers", []):
            key = w.get("actor") or f"{node.get('group')}_{w.get('instance')}"
            if key in seen:
                continue
            seen.add(key)
            sample = w.get("memory") or {}
            rows.setdefault(str(w.get("node_id") or "unplaced"), []).append({
                "worker": f"{node.get('group')}[{w.get('instance')}]", "pid": w.get("pid"),
                "bytes": sample.get("bytes"), "kind": sample.get("kind"), "gpu_ids": list(w.get("gpu_ids") or [])})
    values = [c["bytes"] for cells in rows.values() for c in cells if c["bytes"] is not None]
    return {"rows": [{"node_id": k, "cells": v} for k, v in rows.items()],
            "max_bytes": max(values, default=0), "total_bytes": sum(values), "sampled": len(values)}


def edges(status: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each data edge's latency (submit to result, queueing included) and bandwidth: the bytes it carried
    divided by the seconds its batches were in flight (so a lower bound on the link's speed). A co-located
    edge is marked: its data stays in one process and never crosses the object store."""
    local = {f"{e['src']}->{e['dst']}" for e in status.get("graph", {}).get("edges", []) if e.get("co_locate")}
    out = []
    for key, e in status.get("edges", {}).items():
        lat = e.get("latency", {})
        count, mean = int(lat.get("count", 0)), float(lat.get("mean_s", 0.0))
        in_flight = count * mean
        out.append({"key": key, "count": count, "p50_s": lat.get("p50_s"), "p95_s": lat.get("p95_s"),
                    "mean_s": mean, "max_s": lat.get("max_s"), "bytes_total": int(e.get("bytes_total", 0)),
                    "bandwidth_Bps": e.get("bytes_total", 0) / in_flight if in_flight > 0 else None,
                    "queue_len": e.get("queue_len", 0), "high_watermark": e.get("high_watermark"),
                    "colocated": key in local})
    return out


def decisions(status: Mapping[str, Any], limit: int = MAX_DECISIONS) -> dict[str, Any]:
    """The last `limit` decisions with time, kind, node and reason; from the plain strings (no time, kind
    from the first word) when the status predates the structured log."""
    log = status.get("decision_log")
    if log is None:
        log = [{"time": None, "kind": _kind_of(d), "node": None, "reason": d.split(": ", 1)[-1], "message": d}
               for d in status.get("decisions", [])]
    return {"total": len(log), "items": [dict(d) for d in log[-limit:]]}


def _kind_of(message: str) -> str:
    head = message.split(":", 1)[0]
    return "scheduling" if head == "Scheduling decision" else head.lower()


def build_view(records: Sequence[Mapping[str, Any]], status: Mapping[str, Any] | None, title: str = "",
               now: float | None = None, error: str | None = None) -> dict[str, Any]:
    """Everything the page draws. `status` is a controller's control_status (None without a live job: the
    panels that need it say so); `error` is shown above the panels (e.g. the job stopped answering)."""
    last = records[-1] if records else {}
    st = status or {}
    view = {
        "title": title or str(st.get("job") or "hybridflow run"),
        "job": st.get("job"),
        "step": st.get("step", last.get("step", 0)),
        "total_steps": st.get("total_steps"),
        "generated_at": time.time() if now is None else now,
        "error": error,
        "has_status": status is not None,
        "records": len(records),
        "curves": curves(records),
        "breakdown": breakdown(records),
        "graph": graph(st),
        "memory": memory(st),
        "edges": edges(st),
        "decisions": decisions(st),
    }
    return finite(view)


def finite(value: Any) -> Any:
    """NaN and infinities become None: JSON has no spelling for them and the page's JSON.parse would fail."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v) if math.isfinite(v) else None
