"""Operator CPU seconds per 1,000 watch events: kopf's per-event machinery against the informer.

    python -m benchmarks.operator.watch_cost [--jobs 300] [--updates 4] [--rounds 3] [--json FILE]

Starts a minimal control plane (etcd + kube-apiserver with our CRD; `bash e2e/toolchain/build.sh`
builds the binaries), then, for each watcher and round, a fresh process that watches RLTrainingJobs
cluster-wide with a handler that only counts:

- `kopf`: `@kopf.on.event`, configured as the operator configured kopf before (stateless storages, no
  log-line Events, standalone, uvloop, kopf's per-event log line silenced);
- `kopf-index`: the same plus a `@kopf.index` of (namespace, name) -> generation, what kopf's indexing
  would cost on top to keep the operator's in-memory view;
- `informer`: the operator's own list+watch (`hybridflow_operator.machinery.informer`) on the same loop.

The driver creates one sentinel job (a watcher reports `ready` once it saw it: its watch is up), then N
jobs and U status patches of each: N * (1 + U) events. Each watcher measures its own CPU
(`time.process_time`, every thread) from `ready` until it has seen them all; CPU while idle for the
same time is measured the same way and subtracted. Everything shares the machine's cores with the API
server, so wall times mean little here; CPU seconds per event do not depend on the wait.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WATCHERS = ("kopf", "kopf-index", "informer")
NAMESPACE = "watch-cost"
SENTINEL = "sentinel"
JOB_SPEC = {
    "algorithm": {"name": "grpo"},
    "model": {"policy": {"path": "builtin:tiny"}},
    "reward": {"type": "function", "function": "builtin:tiny_task"},
    "data": {"train": "builtin:tiny_task", "batchSize": 32},
    "rollout": {"engine": "torch", "samplesPerPrompt": 8},
    "trainer": {"totalSteps": 80},
}


# -- the watcher process ----------------------------------------------------------------------------


class Counter:
    """Counts events after the sentinel; prints `ready`, then `done <cpu seconds> <events>`."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.seen = 0
        self.started: float | None = None
        self.finished = asyncio.Event()

    def event(self, name: str) -> None:
        if self.started is None:
            if name == SENTINEL:
                self.started = time.process_time()
                print("ready", flush=True)
            return
        self.seen += 1
        if self.seen == self.expected:
            print(f"done {time.process_time() - self.started:.4f} {self.seen}", flush=True)
            self.finished.set()


def watch_with_kopf(counter: Counter, index: bool) -> None:
    import kopf
    import uvloop

    from hybridflow.api import API_GROUP, API_VERSION, PLURAL
    from hybridflow_operator.__main__ import tune_gc

    @kopf.on.startup()
    async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.posting.loggers = False
        no_diff_base, no_progress = _storages()
        settings.persistence.diffbase_storage = no_diff_base()
        settings.persistence.progress_storage = no_progress()

    @kopf.on.event(API_GROUP, API_VERSION, PLURAL)
    async def changed(name: str, **_: Any) -> None:
        counter.event(name)

    if index:
        @kopf.index(API_GROUP, API_VERSION, PLURAL)
        async def generations(namespace: str | None, name: str, meta: kopf.Meta, **_: Any) -> dict:
            return {(namespace, name): meta.get("generation")}

    import logging

    logging.getLogger().setLevel(logging.WARNING)
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    tune_gc()
    stop = asyncio.Event()

    async def main() -> None:
        operator = asyncio.ensure_future(kopf.operator(clusterwide=True, standalone=True, stop_flag=stop))
        await counter.finished.wait()
        stop.set()
        await asyncio.wait([operator], timeout=10)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())


def _storages() -> tuple[type, type]:
    """kopf storages that keep nothing (the operator's `stateless.py` before kopf stopped watching)."""
    import kopf

    class NoDiffBase(kopf.DiffBaseStorage):
        def build(self, *, body: Any, extra_fields: Any = None) -> Any:
            return None

        def fetch(self, *, body: Any) -> Any:
            return None

        def store(self, *, body: Any, patch: Any, essence: Any) -> None:
            return None

    class NoProgress(kopf.ProgressStorage):
        def fetch(self, *, key: Any, body: Any) -> Any:
            return None

        def store(self, *, key: Any, record: Any, body: Any, patch: Any) -> None:
            return None

        def purge(self, *, key: Any, body: Any, patch: Any) -> None:
            return None

        def touch(self, *, body: Any, patch: Any, value: str | None) -> None:
            return None

        def clear(self, *, essence: Any) -> Any:
            return essence

    return NoDiffBase, NoProgress


def watch_with_informer(counter: Counter) -> None:
    import uvloop

    from hybridflow.api import KIND, PLURAL
    from hybridflow.k8s.names import JOB_API_VERSION
    from hybridflow_operator.__main__ import tune_gc
    from hybridflow_operator.machinery.client import Kube, load_configuration
    from hybridflow_operator.machinery.informer import Informer, Source, collection_path

    tune_gc()

    async def main() -> None:
        kube = Kube(load_configuration())
        source = Source(collection_path(JOB_API_VERSION, PLURAL), KIND)
        informer = Informer(kube, source, lambda obj, _: counter.event(obj["metadata"]["name"]), name="jobs")
        task = asyncio.get_running_loop().create_task(informer.run())
        await counter.finished.wait()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await kube.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())


def watcher_main(kind: str, expected: int) -> None:
    counter = Counter(expected)
    if kind == "informer":
        watch_with_informer(counter)
    else:
        watch_with_kopf(counter, index=kind == "kopf-index")


# -- the driver -------------------------------------------------------------------------------------


def _job(name: str) -> dict:
    return {"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLTrainingJob",
            "metadata": {"name": name, "namespace": NAMESPACE}, "spec": JOB_SPEC}


def _events(api: Any, names: list[str], updates: int, threads: int = 8) -> None:
    """Create the jobs, then patch each one's status `updates` times (one MODIFIED event each)."""
    from kubernetes import client

    custom = client.CustomObjectsApi(api)
    args = ("hybridflow.io", "v1alpha1", NAMESPACE, "rltrainingjobs")
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda n: custom.create_namespaced_custom_object(*args, _job(n)), names))
        for step in range(1, updates + 1):
            body = {"status": {"progress": {"step": step, "totalSteps": 80}}}
            list(pool.map(lambda n, b=body: custom.patch_namespaced_custom_object_status(*args, n, b), names))


def _clean(api: Any) -> None:
    from kubernetes import client

    client.CustomObjectsApi(api).delete_collection_namespaced_custom_object(
        "hybridflow.io", "v1alpha1", NAMESPACE, "rltrainingjobs")


def _idle_cpu(proc: subprocess.Popen[str], seconds: float) -> float:
    """CPU seconds the process spends over `seconds` of wall time with nothing to watch."""
    def cpu() -> float:
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    before = cpu()
    time.sleep(seconds)
    return cpu() - before


def measure(api: Any, kubeconfig: Path, kind: str, jobs: int, updates: int, round_no: int) -> dict:
    from kubernetes import client

    expected = jobs * (1 + updates)
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "runtime"), str(ROOT / "operator"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.operator.watch_cost", "--watcher", kind,
                             "--expected", str(expected)], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    custom = client.CustomObjectsApi(api)
    args = ("hybridflow.io", "v1alpha1", NAMESPACE, "rltrainingjobs")
    try:
        time.sleep(3.0)  # kopf's start-up scan, the informer's first list
        custom.create_namespaced_custom_object(*args, _job(SENTINEL))
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"{kind}: expected 'ready', got {line!r}")
        idle_s = 5.0
        idle = _idle_cpu(proc, idle_s)
        t0 = time.monotonic()
        _events(api, [f"job-{round_no}-{i:04d}" for i in range(jobs)], updates)
        line = proc.stdout.readline().strip()
        wall = time.monotonic() - t0
        if not line.startswith("done"):
            raise RuntimeError(f"{kind}: expected 'done', got {line!r}")
        _, cpu_s, seen = line.split()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _clean(api)
        time.sleep(2.0)
    busy = float(cpu_s) - idle * wall / idle_s
    return {"watcher": kind, "round": round_no, "events": int(seen), "wall_s": round(wall, 2),
            "cpu_s": round(float(cpu_s), 3), "idle_cpu_s_per_s": round(idle / idle_s, 4),
            "cpu_ms_per_event": round(1000 * busy / int(seen), 4),
            "cpu_s_per_1000_events": round(1000 * busy / int(seen), 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=300)
    p.add_argument("--updates", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--watchers", default=",".join(WATCHERS))
    p.add_argument("--json", type=Path, help="write every measurement here")
    p.add_argument("--watcher", choices=WATCHERS, help=argparse.SUPPRESS)
    p.add_argument("--expected", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.watcher:
        watcher_main(args.watcher, args.expected)
        return 0

    from kubernetes import client, config

    from e2e.harness.controlplane import ControlPlane

    results: list[dict] = []
    with ControlPlane(crd_dirs=[ROOT / "crds"], install_kuberay_crds=False) as cp:
        cp.kubectl("create", "namespace", NAMESPACE)
        api = config.new_client_from_config(config_file=str(cp.kubeconfig))
        api.configuration.connection_pool_maxsize = 16
        kinds = args.watchers.split(",")
        for round_no in range(args.rounds):
            for kind in kinds if round_no % 2 == 0 else reversed(kinds):  # alternate the order
                result = measure(api, cp.kubeconfig, kind, args.jobs, args.updates, round_no)
                results.append(result)
                print(json.dumps(result), flush=True)
        client.ApiClient.close(api)
    summary = {kind: statistics.median(r["cpu_s_per_1000_events"] for r in results if r["watcher"] == kind)
               for kind in args.watchers.split(",")}
    print("median CPU s per 1,000 watch events:", json.dumps(summary))
    if args.json:
        args.json.write_text(json.dumps({"jobs": args.jobs, "updates": args.updates, "results": results,
                                         "median_cpu_s_per_1000_events": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
