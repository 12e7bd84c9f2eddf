"""Dispatch against compute: the next micro-batch's transfer runs while the current one computes.

A remote step's host, on a raylet of its own, gets rollout micro-batches made on another raylet. Streamed,
as the trainer's rollout phase sends them: each chunk's call is queued on the consumer (HostGroup.next) as
soon as the chunk exists, so Ray pulls a queued call's argument into the consumer's object store while the
call before it runs. Serial, the alternative: the next call goes out when the previous one returns, so each
transfer sits between two computes. Both get the same cluster, chunks and compute.

The compute is a sleep of fixed length: it stands for a GPU kernel, which leaves the CPU to the transfer
(on CPU the two would share the cores and the comparison would measure contention instead).

    python -m benchmarks.dispatch            # ~1 minute: results/dispatch.json, .png, and its README section
    python -m benchmarks.dispatch --render   # redraw from the JSON
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch

from benchmarks.common import grouped_bars, measure_or_render, save_figure
from hybridflow.metrics import pyplot
from hybridflow.scheduler.group import HostGroup
from hybridflow.workers.batch import RolloutBatch

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- dispatch-bench:begin -->", "<!-- dispatch-bench:end -->"
FORMAT = 1
STORE_BYTES = 1 << 30
"""Each worker raylet's object store: room for every chunk of the largest size at once."""
RESPONSE_SHARE = 0.75
"""Of each sequence's tokens, the response's; the rest is prompt."""
SIZES = ((16, 8192), (64, 8192), (128, 12288))
"""(sequences, tokens) of a micro-batch: long-context rollouts of 5 to 58 MB once scored."""
CHUNKS = 6
COMPUTE_S = 0.25
MODES = {"serial": 1, "window 2": 2, "streamed": 0}
"""Calls out at once: one (serial), the current and the next, or every chunk's (the rollout phase's)."""


def rollout_chunk(rows: int, tokens: int, seed: int) -> RolloutBatch:
    """A scored micro-batch as remote steps receive it: ids and masks of the whole sequences, and the per-token
    tensors of the response (log-probs, reference log-probs, values, advantages, returns)."""
    g = torch.Generator().manual_seed(seed)
    response = int(tokens * RESPONSE_SHARE)
    prompt = tokens - response
    ids = torch.randint(0, 32000, (rows, tokens), generator=g)
    mask = torch.ones_like(ids)
    batch = RolloutBatch(ids, mask, mask[:, prompt:].clone(), prompt, 0, [""] * rows, [""] * rows, [""] * rows,
                         list(range(rows)))
    for name in ("old_log_probs", "ref_log_probs", "values", "advantages", "returns"):
        batch.tensors[name] = torch.randn(rows, response, generator=g)
    return batch


@ray.remote(num_cpus=0, resources={"producer": 1})
class Producer:
    """Where chunks are made: the actor's raylet."""

    def make(self, rows: int, tokens: int, seed: int) -> RolloutBatch:
        return rollout_chunk(rows, tokens, seed)


@ray.remote(num_cpus=0, resources={"consumer": 1})
class Consumer:
    """A remote step's host: `run` computes on a chunk, watching whether the next one is already here."""

    def node_id(self) -> str:
        return str(ray.get_runtime_context().get_node_id())

    def run(self, batch: RolloutBatch, seconds: float, after: list[ray.ObjectRef],
            hold_s: float = 0.0) -> dict[str, Any]:
        """`seconds` of compute; `after` holds the next call's chunk (unresolved, inside a list), and its
        arrival here is timed from this call's start. With `hold_s` the call goes on past its compute until
        that chunk arrives, for at most hold_s: a test's way to see it arrive during the call or never."""
        from ray.experimental import get_object_locations

        start = time.time()
        me = self.node_id()
        arrived = None
        while True:
            now = time.time()
            if after and arrived is None and me in get_object_locations(after, timeout_ms=5000)[after[0]]["node_ids"]:
                arrived = now - start
            if now - start >= seconds and (arrived is not None or not after or now - start >= seconds + hold_s):
                break
            time.sleep(0.005)
        return {"start": start, "end": time.time(), "next_arrived_s": arrived, "bytes": batch.nbytes()}

    def fetch(self, wrapped: list[ray.ObjectRef]) -> float:
        """Seconds to pull one chunk that is not here yet: the transfer a serial dispatch waits for."""
        t0 = time.perf_counter()
        ray.get(wrapped[0])
        return time.perf_counter() - t0


@dataclass
class OneHost:
    """The HostSource of a group of one consumer."""

    handle: Any

    def hosts(self, node_name: str) -> list[Any]:
        return [self.handle]


def streamed(group: HostGroup, chunks: list[ray.ObjectRef], seconds: float, hold_s: float = 0.0,
             window: int = 0) -> list[dict[str, Any]]:
    """The rollout phase's dispatch: each chunk's call queued as soon as the chunk exists. With `window`, at
    most that many calls are out at once (the next goes out when the oldest returns)."""
    calls: list[ray.ObjectRef] = []
    for i, chunk in enumerate(chunks):
        ray.wait([chunk])
        if window and len(calls) >= window:
            ray.wait([calls[-window]])
        after = [chunks[i + 1]] if i + 1 < len(chunks) else []
        calls.append(group.next("run", chunk, seconds, after, hold_s))
    return list(ray.get(calls))


def gaps(calls: list[dict[str, Any]]) -> list[float]:
    """The consumer's idle time between one call's end and the next one's start (its own clock)."""
    return [b["start"] - a["end"] for a, b in itertools.pairwise(calls)]


def start_cluster() -> Any:
    """A head raylet (the driver) and two worker raylets: the producer's and the consumer's."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1, resources={"producer": 1}, object_store_memory=STORE_BYTES)
    cluster.add_node(num_cpus=1, resources={"consumer": 1}, object_store_memory=STORE_BYTES)
    cluster.wait_for_nodes()
    path = os.pathsep.join([str(ROOT / "runtime"), str(ROOT)])
    ray.init(address=cluster.address, configure_logging=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
    return cluster


def measure(rows: int, tokens: int, producer: Any, group: HostGroup, consumer: Any, seed: int) -> dict[str, Any]:
    """Both dispatches on fresh chunks of one size, and one chunk's transfer alone."""
    def made(base: int, n: int = CHUNKS) -> list[ray.ObjectRef]:
        refs = [producer.make.remote(rows, tokens, base + i) for i in range(n)]
        ray.wait(refs, num_returns=len(refs))
        return refs

    transfer = ray.get(consumer.fetch.remote(made(seed, 1)))
    result: dict[str, Any] = {"rows": rows, "tokens": tokens, "transfer_s": transfer}
    for k, (mode, window) in enumerate(MODES.items()):
        chunks = made(seed + 100 * (k + 1))
        t0, wall0 = time.perf_counter(), time.time()
        calls = streamed(group, chunks, COMPUTE_S, window=window)
        result[mode] = {"wall_s": time.perf_counter() - t0, "gaps_s": gaps(calls),
                        "first_start_s": calls[0]["start"] - wall0,
                        "next_arrived_s": [c["next_arrived_s"] for c in calls[:-1]]}
        result["chunk_bytes"] = calls[0]["bytes"]
        del chunks
    s, t = result["serial"], result["streamed"]
    result["speedup"] = s["wall_s"] / t["wall_s"]
    result["hidden_share"] = 1 - _mean(t["gaps_s"]) / _mean(s["gaps_s"])
    return result


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def bench() -> dict[str, Any]:
    cluster = start_cluster()
    try:
        producer, consumer = Producer.remote(), Consumer.remote()
        ray.get(consumer.fetch.remote([producer.make.remote(1, 64, 0)]))  # connections up before timing
        group = HostGroup("consumer", OneHost(consumer))
        cases = []
        for i, (rows, tokens) in enumerate(SIZES):
            print(f"[bench] {rows} x {tokens} tokens ...", flush=True)
            cases.append(measure(rows, tokens, producer, group, consumer, 1000 * i))
            c = cases[-1]
            gap = ", ".join(f"{mode} {_mean(c[mode]['gaps_s']) * 1000:.1f} ms" for mode in MODES)
        print(f"[bench]   {c['chunk_bytes'] / 2**20:.0f} MB: transfer {c['transfer_s']:.3f} s; idle between computes "
              f"{gap}", flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
    return {"format": FORMAT, "machine": {"cores": os.cpu_count()}, "chunks": CHUNKS, "compute_s": COMPUTE_S,
            "object_store_bytes": STORE_BYTES, "cases": cases}


def render(report: dict[str, Any]) -> str:
    lines = [BEGIN, "### Dispatch against compute", "",
             f"Generated by `make bench-dispatch` (benchmarks/dispatch.py) on {report['machine']['cores']} cores: a "
             "local Ray cluster of three raylets (the driver's; the producer's, where chunks are made as on the "
             "actor's hosts; a remote step's host), object stores of "
             f"{report['object_store_bytes'] / 2**30:.0f} GiB. {report['chunks']} scored rollout micro-batches per "
             f"run, each followed by {report['compute_s']:.2f} s of compute on the consumer (a sleep: a GPU kernel "
             "leaves the CPU to the transfer). Streamed is the rollout phase's dispatch (every chunk's call "
             "queued as the chunk exists), serial the alternative (the next call once the last returns), window 2 "
             "between them (the current call and the next).", "",
             "| micro-batch | bytes | one transfer | dispatch | first compute starts | idle between computes | "
             "next call's chunk on the consumer during a compute (already at its start) | wall |",
             "|---|---|---|---|---|---|---|---|"]
    for c in report["cases"]:
        for mode in MODES:
            m = c[mode]
            during = sum(a is not None for a in m["next_arrived_s"])
            there = sum(a is not None and a < 0.001 for a in m["next_arrived_s"])
            lines.append(f"| {c['rows']} x {c['tokens']} tokens | {c['chunk_bytes'] / 2**20:.0f} MB | "
                         f"{c['transfer_s'] * 1000:.0f} ms | {mode} | {m['first_start_s'] * 1000:.0f} ms | "
                         f"{_mean(m['gaps_s']) * 1000:.1f} ms | {during}/{len(m['next_arrived_s'])} ({there}) | "
                         f"{m['wall_s']:.2f} s |")
    hidden = ", ".join(f"{c['chunk_bytes'] / 2**20:.0f} MB {c['hidden_share']:.0%} ({c['speedup']:.2f}x by wall "
                       "time)" for c in report["cases"])
    lines += ["", f"Share of the serial idle time between computes that streaming hides: {hidden}.", "",
              "Where the time goes. Serial, each call waits for its chunk's pull across raylets (about one "
              "transfer) plus a round trip to the controller. Streamed, a call is queued while the one before it "
              "runs and Ray pulls a queued call's argument meanwhile: the next chunk is already on the consumer "
              "when its call starts, and what is left between computes is unpickling it out of the store (torch "
              "tensors are copied, about 0.7 ms per MB here). The price is at the start: every queued chunk is "
              "pulled at once, so the first compute waits for a share of all of them; a window of two spreads "
              "that out but, on these 2 cores, its pulls then contend with the unpickling.", "",
              "![dispatch](results/dispatch.png)", END]
    return "\n".join(lines)


def plot(report: dict[str, Any], out: Path) -> Path:
    plt = pyplot()

    labels = [f"{c['chunk_bytes'] / 2**20:.0f} MB" for c in report["cases"]]
    x = range(len(labels))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    grouped_bars(ax, {mode: [_mean(c[mode]["gaps_s"]) * 1000 for c in report["cases"]] for mode in MODES},
                 0.8 / len(MODES), color=dict(zip(MODES, ("tab:gray", "tab:orange", "tab:blue"), strict=True)))
    ax.plot(list(x), [c["transfer_s"] * 1000 for c in report["cases"]], "k_", markersize=30, label="one transfer")
    ax.set_xticks(list(x), labels)
    ax.set_xlabel("micro-batch")
    ax.set_ylabel("consumer idle between computes (ms)")
    ax.set_title("Dispatch against compute")
    ax.legend()
    return save_figure(fig, out, dpi=120)


def main() -> None:
    measure_or_render(__doc__.splitlines()[0], "dispatch", bench, render, plot, BEGIN, END)


if __name__ == "__main__":
    main()
