"""Operator benchmark, the measurement: the phases on a real control plane, written down as raw results.

One full control plane (etcd, kube-apiserver with an audit log, controller-manager, scheduler, kwok, the
real KubeRay operator) and a fake A100 fleet big enough for every pod. For each N, in fresh namespaces:

1. KubeRay alone: the children the operator would render (ConfigMap, ServiceAccount, Role, RoleBinding,
   RayJob) are created directly, concurrently; measured until every Ray pod is bound to a node.
2. hybridflow: a fresh operator process; N RLTrainingJobs are created concurrently; measured until every
   RayJob exists and every Ray pod is bound, then until the operator falls quiet (its API requests).

Up to N = 100 the two phases run as several pairs, in alternating order (KubeRay alone first, then
hybridflow first, ...); `summarise` reports the pair with the median ratio. Each phase's namespace is deleted,
and gone, before the next one starts (the last one's goes with the control plane). A warm-up of 10 jobs
through KubeRay alone comes first.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import os
import platform
import shutil
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import psutil
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from benchmarks.operator.cluster import (
    BENCH_USER,
    OPERATOR_USER,
    AuditedControlPlane,
    AuditLog,
    OperatorProcess,
    bench_fleet,
    creation_times,
    handler_stages,
    high_water_mark_bytes,
    operator_requests,
    request_latencies,
)
from benchmarks.operator.summarise import FORMAT, latency_summary, percentile, rounded
from benchmarks.operator.watch import NamespaceTracker

# The operator's internals this benchmark uses, all of them: the names of a job's children, the plural of each
# kind, the children as the operator renders them (created directly for KubeRay alone) and its settings.
from hybridflow.k8s import names
from hybridflow.k8s.render import render_children
from hybridflow_operator.machinery.client import PLURALS
from hybridflow_operator.settings import OperatorSettings, from_env

ROOT = Path(__file__).resolve().parents[2]
WARMUP_JOBS = 10
APPLY_THREADS = 16
HEAD_CPUS = 1
HEAD_MEMORY = "2Gi"
PODS_PER_JOB = 2  # a Ray head and one GPU worker
QUIET_S = 3.0  # the operator counts as settled after this long without an API request...
SETTLE_MAX_S = 30.0  # ...or after this long past the last pod binding
DELETE_TIMEOUT_S = 300.0
STAGES_NOTE = (
    "API server clock. react: job created -> the operator's first request for one of its children arrives "
    "(the watch event reaching the operator, its work queue, the render); apply: that request -> the RayJob "
    "created (its ServiceAccount first, then the RayJob, as urgent requests)"
)
OPERATOR_SETTINGS = ("max_requests", "status_min_interval", "status_writes_per_s", "spin_up_jobs",
                     "status_interval")  # recorded with each run: the report quotes them
CHILD_RESOURCES = {"configmaps": names.config_map_name, "serviceaccounts": names.runtime_identity_name,
                   "roles": names.runtime_identity_name, "rolebindings": names.runtime_identity_name,
                   "rayjobs": names.rayjob_name}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# -- the workload -------------------------------------------------------------------------------------------


def bench_job(name: str, namespace: str) -> dict[str, Any]:
    """A small GRPO job: one worker group of 1 replica x 1 GPU on A100s, a 1-CPU head."""
    return {
        "apiVersion": "hybridflow.io/v1alpha1",
        "kind": "RLTrainingJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "algorithm": {"name": "grpo"},
            "model": {"policy": {"path": "builtin:tiny"}},
            "reward": {"type": "function", "function": "builtin:gsm8k"},
            "data": {"train": "builtin:arith"},
            "rollout": {"engine": "torch", "samplesPerPrompt": 4},
            "cluster": {
                "gpuType": "A100-80GB",
                "headCpus": HEAD_CPUS,
                "headMemory": HEAD_MEMORY,
                "workerGroups": [
                    {"name": "actor", "replicas": 1, "gpusPerWorker": 1, "cpusPerWorker": 4, "memory": "16Gi"}
                ],
            },
        },
    }


def job_names(n: int) -> list[str]:
    return [f"bench-{i:04d}" for i in range(n)]


# -- one phase ----------------------------------------------------------------------------------------------


class Bench:
    """State shared by the phases: the control plane, clients, the audit log, where logs go."""

    def __init__(self, cp: AuditedControlPlane, log_dir: Path, trace_memory: bool = False) -> None:
        self.cp = cp
        self.trace_memory = trace_memory
        self.log_dir = log_dir
        self.audit = AuditLog(cp.audit_log)
        self.bench_kubeconfig = cp.user_kubeconfig(BENCH_USER)
        self.operator_kubeconfig = cp.user_kubeconfig(OPERATOR_USER)
        self.api = _api_client(self.bench_kubeconfig, pool=APPLY_THREADS + 4)
        self.watch_api = _api_client(self.bench_kubeconfig, pool=8)
        self.settings = from_env(os.environ)  # the operator process inherits this environment

    # -- helpers --

    def namespace(self, phase: str, n: int) -> str:
        ns = f"opbench-{phase}-n{n}-{uuid.uuid4().hex[:5]}"
        self.cp.create_namespace(ns)
        return ns

    def apply(self, tasks: Sequence[Callable[[], None]]) -> tuple[float, float, list[str]]:
        """Run creates concurrently; (start, end, errors)."""
        errors: list[str] = []
        t0 = time.time()
        with concurrent.futures.ThreadPoolExecutor(APPLY_THREADS) as pool:
            for fut in [pool.submit(task) for task in tasks]:
                try:
                    fut.result()
                except Exception as e:
                    errors.append(repr(e)[:300])
        return t0, time.time(), errors

    def wait_bound(self, tracker: NamespaceTracker, n: int, timeout: float, rayjobs: bool) -> dict[str, bool]:
        """Wait for N RayJobs (when asked) and every Ray pod bound; returns what completed."""
        deadline = time.monotonic() + timeout
        done = {"rayjobs": True, "pods_bound": False}
        if rayjobs:
            done["rayjobs"] = tracker.rayjobs.wait_for(n, max(1.0, deadline - time.monotonic()))
        done["pods_bound"] = tracker.pods_bound.wait_for(n * PODS_PER_JOB, max(1.0, deadline - time.monotonic()))
        return done

    def cpu_snapshot(self, extra: Mapping[str, int] | None = None) -> dict[str, float]:
        """CPU seconds so far of every control-plane component (and the operator, the benchmark), and of
        the whole machine (`machine_busy`): other people's processes share these cores."""
        pids = {name: proc.pid for name, proc in self.cp.processes.items()}
        pids |= {**(extra or {}), "benchmark": os.getpid()}
        out: dict[str, float] = {}
        for name, pid in pids.items():
            with contextlib.suppress(psutil.Error):
                t = psutil.Process(pid).cpu_times()
                out[name] = t.user + t.system + t.children_user + t.children_system
        machine = psutil.cpu_times()
        out["machine_busy"] = sum(machine) - machine.idle - getattr(machine, "iowait", 0.0)
        return out

    def delete_namespace(self, ns: str) -> float:
        """Delete and wait until gone; finalizers KubeRay cannot honour without a dashboard are dropped."""
        t0 = time.monotonic()
        core = client.CoreV1Api(self.api)
        with contextlib.suppress(ApiException):
            core.delete_namespace(ns)
        forced = False
        while time.monotonic() - t0 < DELETE_TIMEOUT_S:
            try:
                core.read_namespace(ns)
            except ApiException as e:
                if e.status == 404:
                    return time.monotonic() - t0
                raise
            if not forced and time.monotonic() - t0 > 60:
                self._drop_finalizers(ns)
                forced = True
            time.sleep(1.0)
        log(f"namespace {ns} still terminating after {DELETE_TIMEOUT_S:.0f}s")
        return time.monotonic() - t0

    def _drop_finalizers(self, ns: str) -> None:
        custom = client.CustomObjectsApi(self.api)
        for group, version, plural in (("ray.io", "v1", "rayjobs"), ("ray.io", "v1", "rayclusters"),
                                       ("hybridflow.io", "v1alpha1", "rltrainingjobs")):
            with contextlib.suppress(ApiException):
                listed = custom.list_namespaced_custom_object(group, version, ns, plural)
                for item in cast(dict[str, Any], listed)["items"]:
                    if item["metadata"].get("finalizers"):
                        with contextlib.suppress(ApiException):
                            custom.patch_namespaced_custom_object(
                                group, version, ns, plural, item["metadata"]["name"], {"metadata": {"finalizers": None}}
                            )
        log(f"dropped finalizers left in {ns}")

    def pod_placement(self, tracker: NamespaceTracker) -> dict[str, int]:
        kinds: Counter[str] = Counter()
        for node in tracker.bound_nodes.values():
            kinds["gpu" if "a100" in node else "cpu"] += 1
        return dict(kinds)

    # -- phases --

    def kuberay_alone(self, n: int, timeout: float, cleanup: bool = True) -> dict[str, Any]:
        """The rendered children applied directly: KubeRay does everything that follows."""
        ns = self.namespace("kuberay", n)
        log(f"KubeRay alone, N={n}: namespace {ns}")
        jobs = [bench_job(name, ns) for name in job_names(n)]
        children = [render_children(job, self.settings.render) for job in jobs]
        for objs in children:
            for obj in objs:
                obj["metadata"].pop("ownerReferences", None)
        tracker = NamespaceTracker(self.watch_api, ns).start()
        cpu0 = self.cpu_snapshot()
        t0, t_applied, errors = self.apply([functools.partial(self._create_all, objs) for objs in children])
        done = self.wait_bound(tracker, n, timeout, rayjobs=True)
        t_end = time.time()
        cpu1 = self.cpu_snapshot()
        tracker.stop()
        self.audit.read()
        result = self._timings(tracker, ns, n, t0, t_applied, done, errors)
        result["cpu_s"] = _cpu_delta(cpu0, cpu1)
        result["window_s"] = round(t_end - t0, 3)
        result["client_creates_per_job"] = len(children[0]) if children else 0
        log(f"  {_brief(result)}")
        if cleanup:
            result["namespace_delete_s"] = round(self.delete_namespace(ns), 1)
        return result

    def hybridflow(self, n: int, timeout: float, cleanup: bool = True) -> dict[str, Any]:
        """A fresh operator; N RLTrainingJobs applied at once."""
        ns = self.namespace("ours", n)
        log(f"hybridflow operator, N={n}: namespace {ns}")
        trace = self.log_dir / f"operator-n{n}-tracemalloc.txt" if self.trace_memory else None
        op = OperatorProcess(self.operator_kubeconfig, self.log_dir / f"operator-n{n}.log", trace)
        started = time.time()
        op.start()
        try:
            self._wait_operator_watching(started)
            tracker = NamespaceTracker(self.watch_api, ns).start()
            idle_rss = op.sampler.sample() if op.sampler else 0
            cpu0 = self.cpu_snapshot({"operator": op.proc.pid} if op.proc else None)
            jobs = [bench_job(name, ns) for name in job_names(n)]
            t0, t_applied, errors = self.apply([functools.partial(create, self.api, job) for job in jobs])
            done = self.wait_bound(tracker, n, timeout, rayjobs=True)
            t_bound = time.time()
            t_quiet = self._wait_quiet(t_bound)
            cpu1 = self.cpu_snapshot({"operator": op.proc.pid} if op.proc else None)
            window_peak = max(op.sampler.peak_bytes if op.sampler else 0,
                              (high_water_mark_bytes(op.proc.pid) if op.proc else None) or 0)
            tracker.stop()
            self.audit.read()
            result = self._timings(tracker, ns, n, t0, t_applied, done, errors)
            result |= self._latencies(tracker, ns, n)
            result["apply_to_rayjob_stages_s"] = self._stages(ns, n)
            op_latency = request_latencies(self.audit, OPERATOR_USER, t0, t_quiet)
            until_bound = operator_requests(self.audit, t0, t_bound)
            until_quiet = operator_requests(self.audit, t0, t_quiet)
            result["api_requests"] = {
                "per_job_until_pods_bound": round(sum(until_bound.values()) / n, 1),
                "per_job_until_quiet": round(sum(until_quiet.values()) / n, 1),
                "quiet_after_s": round(t_quiet - t0, 1),
                "per_job_by_kind_until_quiet": {k: round(v / n, 2) for k, v in until_quiet.most_common()},
                "server_time_ms": {k: rounded(v * 1000 if v is not None else None, 1)
                                   for k, v in latency_summary(op_latency).items() if k != "count"},
                "note": f"requests by the operator's identity ({OPERATOR_USER}) in the API server's audit log, "
                        "from the first apply until the last pod was bound / until it sent nothing for "
                        f"{QUIET_S:.0f} s (at most {SETTLE_MAX_S:.0f} s after the last binding); server_time_ms: "
                        "how long the API server took to answer them",
            }
            result["cpu_s"] = _cpu_delta(cpu0, cpu1)
            result["window_s"] = round(t_quiet - t0, 3)
            result["operator_rss_idle_mb"] = round(idle_rss / 2**20, 1)
            result["operator_peak_rss_mb"] = round(window_peak / 2**20, 1)
            result["rss_series"] = _rss_series(op, t0, t_quiet)
            log(f"  {_brief(result)}")
            if cleanup:
                result["namespace_delete_s"] = round(self.delete_namespace(ns), 1)
        finally:
            op.stop()
        result["operator_peak_rss_incl_cleanup_mb"] = round(op.peak_rss_bytes / 2**20, 1) if cleanup else None
        result["operator_cpu_s_total"] = rounded(op.cpu_seconds, 1)
        if trace and trace.exists():
            result["tracemalloc"] = trace.read_text().splitlines()
        log(f"  operator peak RSS {result['operator_peak_rss_mb']} MB until quiet"
            + (f", {result['operator_peak_rss_incl_cleanup_mb']} MB with the namespace deletion" if cleanup else ""))
        return result

    def _stages(self, ns: str, n: int) -> dict[str, Any]:
        jobs = job_names(n)
        children = {j: {resource: name(j) for resource, name in CHILD_RESOURCES.items()} for j in jobs}
        stages = handler_stages(self.audit, ns, jobs, children)
        out: dict[str, Any] = {k: latency_summary(v) for k, v in stages.items()}
        out["note"] = STAGES_NOTE
        return out

    def _create_all(self, objs: Sequence[Mapping[str, Any]]) -> None:
        for obj in objs:
            create(self.api, obj)

    def _wait_operator_watching(self, since: float, timeout: float = 60.0) -> None:
        """The operator is ready once its watches on jobs, RayJobs and pods (made after `since`) reached the
        API server."""
        wanted = {"rltrainingjobs", "rayjobs", "pods"}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.audit.read()
            started = {
                (ev.get("objectRef") or {}).get("resource")
                for ev in self.audit.events(since, time.time() + 1)
                if ev["user"]["username"] == OPERATOR_USER and ev["verb"] == "watch"
            }
            if wanted <= started:
                time.sleep(0.5)
                return
            time.sleep(0.25)
        raise RuntimeError(f"the operator did not start its watches within {timeout:.0f}s")

    def _wait_quiet(self, since: float) -> float:
        """Until the operator sent no request for QUIET_S seconds; returns that moment (local time)."""
        deadline = since + SETTLE_MAX_S
        while time.time() < deadline:
            time.sleep(0.5)
            self.audit.read()
            last = max((_received(ev) for ev in self.audit.events(since - 60, time.time() + 1)
                        if ev["user"]["username"] == OPERATOR_USER and ev["verb"] != "watch"), default=since)
            if time.time() - max(last, since) >= QUIET_S:
                return max(last, since)
        return deadline

    def _timings(self, tracker: NamespaceTracker, ns: str, n: int, t0: float, t_applied: float,
                 done: Mapping[str, bool], errors: list[str]) -> dict[str, Any]:
        rayjobs = tracker.rayjobs.snapshot()
        bound = tracker.pods_bound.snapshot()
        server_bound = creation_times(self.audit, "pods/binding", ns)
        server_rayjobs = creation_times(self.audit, "rayjobs", ns)
        bound_server = [server_bound[p] for p in bound if p in server_bound]
        return {
            "n": n,
            "namespace": ns,
            "complete": bool(done["rayjobs"] and done["pods_bound"]),
            "apply_s": round(t_applied - t0, 3),
            "apply_errors": errors[:5],
            "rayjobs_seen": len(rayjobs),
            "every_rayjob_exists_s": rounded(max(rayjobs.values()) - t0 if len(rayjobs) >= n else None),
            "every_rayjob_exists_server_s": rounded(
                max(server_rayjobs.values()) - t0 if len(server_rayjobs) >= n else None),
            "ray_pods_bound": len(bound),
            "ray_pods_expected": n * PODS_PER_JOB,
            "pods_bound_s": rounded(max(bound.values()) - t0 if done["pods_bound"] else None),
            "pods_bound_server_s": rounded(
                max(bound_server) - t0 if done["pods_bound"] and len(bound_server) == len(bound) else None),
            "first_pod_bound_s": rounded(min(bound.values()) - t0 if bound else None),
            "pods_bound_by_share_s": {f"{q}%": rounded(percentile([t - t0 for t in bound.values()], q))
                                      for q in (25, 50, 75, 90)} if bound else {},
            "pods_by_node_kind": self.pod_placement(tracker),
            "watch_errors": tracker.errors(),
            "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        }

    def _latencies(self, tracker: NamespaceTracker, ns: str, n: int) -> dict[str, Any]:
        """Apply-to-RayJob per job, on the API server's clock (audit log: the job's create done -> its RayJob's
        create done), and as the benchmark's watches see the two ADDED events."""
        seen_jobs = tracker.jobs.snapshot()
        seen_rayjobs = tracker.rayjobs.snapshot()
        server_jobs = creation_times(self.audit, "rltrainingjobs", ns, BENCH_USER)
        server_rayjobs = creation_times(self.audit, "rayjobs", ns, OPERATOR_USER)
        client_lat, server_lat = [], []
        for job in job_names(n):
            rayjob = names.rayjob_name(job)
            if job in seen_jobs and rayjob in seen_rayjobs:
                client_lat.append(seen_rayjobs[rayjob] - seen_jobs[job])
            if job in server_jobs and rayjob in server_rayjobs:
                server_lat.append(server_rayjobs[rayjob] - server_jobs[job])
        return {
            "apply_to_rayjob_s": latency_summary(server_lat),
            "apply_to_rayjob_watch_s": latency_summary(client_lat),
            "apply_to_rayjob_samples_s": [round(v, 4) for v in sorted(server_lat)],
        }


def create(api: client.ApiClient, obj: Mapping[str, Any]) -> None:
    """POST one object, as `kubectl create` would (the operator's own client is asynchronous)."""
    meta = obj["metadata"]
    prefix = "/api/v1" if obj["apiVersion"] == "v1" else f"/apis/{obj['apiVersion']}"
    path = f"{prefix}/namespaces/{meta['namespace']}/{PLURALS[(obj['apiVersion'], obj['kind'])]}"
    response = api.call_api(*api.param_serialize("POST", path, body=obj, auth_settings=["BearerToken"],
                                                 header_params={"Content-Type": "application/json"}),
                            _request_timeout=30)
    response.read()
    if not 200 <= response.status <= 299:
        raise ApiException(status=response.status, reason=(response.data or b"").decode(errors="replace")[:300])


def _api_client(kubeconfig: Path, pool: int) -> client.ApiClient:
    cfg = client.Configuration()
    config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
    cfg.connection_pool_maxsize = pool
    return client.ApiClient(cfg)


def _received(ev: Mapping[str, Any]) -> float:
    return float(ev["received"])


def _cpu_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """CPU seconds per process over a phase; `other` is what processes outside the benchmark used."""
    delta = {k: round(after[k] - before[k], 2) for k in after if k in before}
    ours = sum(v for k, v in delta.items() if k != "machine_busy")
    # Per-process and machine-wide counters tick differently: clamp the small negative noise.
    delta["other"] = round(max(0.0, delta.get("machine_busy", 0.0) - ours), 2)
    return delta


def _rss_series(op: OperatorProcess, t0: float, t1: float) -> list[list[float]]:
    """The operator's RSS (MB) against seconds from the first apply, thinned to about 200 points."""
    if not op.sampler:
        return []
    points = [(t - t0, rss / 2**20) for t, rss in op.sampler.series if t0 <= t <= t1]
    step = max(1, len(points) // 200)
    return [[round(t, 2), round(m, 1)] for t, m in points[::step]]


def _brief(result: Mapping[str, Any]) -> str:
    parts = [f"applied in {result['apply_s']:.1f}s", f"RayJobs {result['rayjobs_seen']}/{result['n']}",
             f"every RayJob {result['every_rayjob_exists_s']}s",
             f"pods bound {result['ray_pods_bound']}/{result['ray_pods_expected']} at {result['pods_bound_s']}s"]
    lat = result.get("apply_to_rayjob_s")
    if lat:
        parts.append(f"apply->RayJob p50 {lat['p50']}s p99 {lat['p99']}s")
    req = result.get("api_requests")
    if req:
        parts.append(f"{req['per_job_until_quiet']} requests/job")
    return ", ".join(parts)


def environment(cp: AuditedControlPlane, fleet_nodes: int, started: float, commit: str | None,
                settings: OperatorSettings) -> dict[str, Any]:
    from e2e.harness import binaries

    versions = {}
    for component in ("kube-apiserver", "etcd", "kwok", "kuberay"):
        with contextlib.suppress(Exception):
            versions[component] = binaries.version(component)
    kopf_version = _dist_version("kopf")
    return {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB",
        "python": platform.python_version(),
        "kopf": kopf_version,
        "kubernetes_client": _dist_version("kubernetes"),
        "components": versions,
        "fleet_nodes": fleet_nodes,
        "control_plane_start_s": round(cp.timings.get("total", 0.0), 1),
        "run_s": round(time.time() - started, 1),
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "apply_threads": APPLY_THREADS,
        "job": "GRPO, 1 worker group x 1 replica x 1 GPU (A100-80GB), 1-CPU head: 2 Ray pods per job",
        "git_commit_at_start": commit,
        "operator_settings": {key: getattr(settings, key) for key in OPERATOR_SETTINGS},
    }


def _git_commit() -> str | None:
    """HEAD of the checkout the operator ran from, marked when the operator's files differed from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "operator", "runtime/hybridflow/api"],
                               cwd=ROOT, capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + (" (operator files modified)" if dirty else "")


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def run(sizes: Sequence[int], work_dir: Path, keep: bool, baseline: bool = True,
        trace_memory: bool = False, repeats: int = 1, repeat_up_to: int = 100) -> dict[str, Any]:
    """The raw results (`summarise.FORMAT`) of: control plane and fleet up, a warm-up, then per N: KubeRay
    alone (unless not asked) and hybridflow; `repeats` such pairs for each N up to `repeat_up_to`, in
    alternating order (KubeRay alone first in the 1st, 3rd, ... pair), so that a drift over the run, and what
    one phase leaves behind for the next (its namespace's deletion, a larger etcd), fall on both sides alike."""
    started = time.time()
    commit = _git_commit()
    max_n = max(sizes)
    pools = bench_fleet(max_n, HEAD_CPUS)
    cp = AuditedControlPlane(full=True, crd_dirs=[ROOT / "crds"], work_dir=work_dir / "control-plane")
    log(f"starting the control plane in {cp.work_dir}")
    cp.start()
    try:
        nodes = cp.create_gpu_fleet(pools, timeout=300)
        log(f"control plane up in {cp.timings['total']:.0f}s; fleet of {len(nodes)} nodes Ready")
        bench = Bench(cp, work_dir, trace_memory)
        warm = bench.kuberay_alone(WARMUP_JOBS, timeout=120)
        plan = [(n, r) for n in sizes for r in range(repeats if n <= repeat_up_to else 1)]
        pairs: dict[str, list[dict[str, Any]]] = {str(n): [] for n in sizes}
        for i, (n, r) in enumerate(plan):
            timeout = max(180.0, 1.5 * n)
            if r:
                log(f"repeat {r + 1} of N={n}")
            # The last phase's namespace goes with the control plane: no need to wait for its deletion.
            last = i == len(plan) - 1
            ours_first = baseline and r % 2 == 1
            if ours_first:
                ours = bench.hybridflow(n, timeout)
                alone = bench.kuberay_alone(n, timeout, cleanup=not last)
            else:
                alone = bench.kuberay_alone(n, timeout) if baseline else {"skipped": True, "pods_bound_s": None}
                ours = bench.hybridflow(n, timeout, cleanup=not last)
            pairs[str(n)].append({"first": "hybridflow" if ours_first else "kuberay_alone",
                                  "kuberay_alone": alone, "hybridflow": ours})
        return {
            "format": FORMAT,
            "environment": environment(cp, len(nodes), started, commit, bench.settings),
            "warmup": {k: warm[k] for k in ("n", "pods_bound_s", "namespace_delete_s")},
            "sizes": {n: {"pairs": measured} for n, measured in pairs.items()},
        }
    finally:
        cp.stop()
        if not keep:
            shutil.rmtree(cp.work_dir, ignore_errors=True)
