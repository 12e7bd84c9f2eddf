"""Where a hybridflow step's time goes: controller-side marks joined with Ray's task timeline.

The Trainer runs in the driver here (in a run it is a Ray actor; the calls it makes are the same), so
every submit and every wait can be timed; the worker side (argument deserialisation, execution, output
serialisation) comes from `ray.timeline()`. Each segment is the median over the measured steps, in ms.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

SEGMENTS = (
    ("controller: sample prompts, submit rollout", "a"),
    ("transit: controller -> worker (rollout)", "b"),
    ("worker: deserialize rollout arguments", "c"),
    ("worker: rollout, outside the timed compute", "d"),
    ("worker: serialize the rollout batch", "e"),
    ("controller: receive batch, concat, prepare update (no advantages)", "f"),
    ("controller: serialize the batch into update", "g"),
    ("transit: controller -> worker (update)", "h"),
    ("worker: deserialize the update batch", "i"),
    ("worker: update, outside the timed compute", "j"),
    ("worker: serialize the update result", "k"),
    ("controller: receive result, build the step record", "l"),
)
# When the plan fuses the step into the actor's process (WorkerHost.run_step) there is one call per step.
FUSED_SEGMENTS = (
    ("controller: sample prompts, submit run_step", "a"),
    ("transit: controller -> worker", "b"),
    ("worker: deserialize arguments", "c"),
    ("worker: run_step, outside the timed compute", "d"),
    ("worker: serialize the step's scalars", "e"),
    ("controller: receive result, build the step record", "l"),
)


def _task_spans(timeline: list[dict[str, Any]], methods: tuple[str, ...]) -> list[dict[str, float]]:
    """Per actor task of `methods`: start/end (s, epoch) and its deserialize/execute/store parts (s)."""
    spans = [e for e in timeline if e.get("ph") == "X"]
    out = []
    for m in spans:
        if m["name"] not in methods:
            continue
        lo, hi = m["ts"], m["ts"] + m["dur"]
        parts = {e["name"]: e["dur"] / 1e6 for e in spans
                 if e["pid"] == m["pid"] and e["tid"] == m["tid"] and e["name"].startswith("task:")
                 and lo <= e["ts"] <= hi}
        out.append({"name": m["name"], "start": lo / 1e6, "end": hi / 1e6,
                    "deserialize": parts.get("task:deserialize_arguments", 0.0),
                    "execute": parts.get("task:execute", 0.0), "store": parts.get("task:store_outputs", 0.0)})
    return out


def profile_hybridflow(job: Any, steps: int, warmup: int = 2) -> dict[str, Any]:
    """Run `steps` steps of `job` and split each measured step into SEGMENTS; Ray must be initialised."""
    import ray
    import ray.actor

    from hybridflow.trainer import Trainer

    trainer = Trainer(job.model_dump(by_alias=True, mode="json"), None)
    trainer.start()
    submits: list[tuple[str, float, float]] = []
    original = ray.actor.ActorMethod.remote

    def timed_remote(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.time()
        ref = original(self, *args, **kwargs)
        submits.append((self._method_name, t0, time.time()))
        return ref

    ray.actor.ActorMethod.remote = timed_remote  # type: ignore[method-assign]
    host = trainer.scheduler.hosts(trainer.plan.actor.name)[0]
    rtt: list[float] = []
    try:
        for _ in range(30):
            t0 = time.perf_counter()
            ray.get(host.policy_version.remote())
            rtt.append(time.perf_counter() - t0)
        marks = []
        for step in range(1, steps + 1):
            t0 = time.time()
            record = trainer.train_step(step)
            marks.append((t0, time.time(), record))
            trainer.step = step
    finally:
        ray.actor.ActorMethod.remote = original  # type: ignore[method-assign]
    time.sleep(2.0)  # task events reach the GCS about once a second
    trainer_fused = trainer.plan.fused
    tasks = _task_spans(ray.timeline(), ("rollout", "update", "run_step"))
    trainer.shutdown()
    rows: dict[str, list[float]] = {}

    def add(key: str, seconds: float) -> None:
        rows.setdefault(key, []).append(seconds * 1e3)

    for t0, t1, rec in marks[warmup:]:
        mine = [t for t in tasks if t0 <= t["start"] <= t1]
        sub = [s for s in submits if t0 <= s[1] <= t1]
        compute = rec["timing/step"] * (1 - rec["orchestration_overhead_frac"])
        add("step", t1 - t0)
        add("compute", compute)
        add("advantages (compute, on the controller)", rec["timing/advantages"])
        fused = next((t for t in mine if t["name"] == "run_step"), None)
        if fused is not None:
            s_fu = next(s for s in sub if s[0] == "run_step")
            add("a", s_fu[2] - t0)
            add("b", fused["start"] - s_fu[2])
            add("c", fused["deserialize"])
            add("d", fused["execute"] - compute)
            add("e", fused["store"])
            add("l", t1 - fused["end"])
            continue
        # with several ranks the step waits for the last one
        ro = max((t for t in mine if t["name"] == "rollout"), key=lambda t: t["end"])
        up = max((t for t in mine if t["name"] == "update"), key=lambda t: t["end"])
        s_ro = next(s for s in sub if s[0] == "rollout")
        s_up = next(s for s in sub if s[0] == "update")
        rollout_compute = sum(rec[f"timing/{k}"] for k in ("generate", "reward", "ref_log_probs", "old_log_probs")
                              if f"timing/{k}" in rec)
        update_compute = compute - rollout_compute - rec["timing/advantages"]
        add("a", s_ro[2] - t0)
        add("b", ro["start"] - s_ro[2])
        add("c", ro["deserialize"])
        add("d", ro["execute"] - rollout_compute)
        add("e", ro["store"])
        add("f", s_up[1] - ro["end"] - rec["timing/advantages"])
        add("g", s_up[2] - s_up[1])
        add("h", up["start"] - s_up[2])
        add("i", up["deserialize"])
        add("j", up["execute"] - update_compute)
        add("k", up["store"])
        add("l", t1 - up["end"])
    med = {k: round(statistics.median(v), 2) for k, v in rows.items()}
    layout = FUSED_SEGMENTS if trainer_fused else SEGMENTS
    segments = {label: med[key] for label, key in layout}
    return {
        "median_step_ms": med["step"],
        "median_compute_ms": med["compute"],
        "median_advantages_ms": med["advantages (compute, on the controller)"],
        "segments_ms": segments,
        "segments_sum_ms": round(sum(segments.values()), 2),
        "actor_call_round_trip_ms": round(statistics.median(rtt) * 1e3, 2),
        "measured_steps": len(marks) - warmup,
        "one_call_per_step": trainer_fused,
        "note": "Trainer run in the driver so its calls can be timed; worker spans from ray.timeline()",
    }
