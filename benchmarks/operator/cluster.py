"""Cluster-side pieces of the operator benchmark: an audited control plane, the bench fleet, the operator
process with its memory sampler, and the audit-log reader that counts the operator's API requests.

The API server writes an audit log (policy below) so that request counts and server-side timestamps
are exact and cost the measured processes nothing: the operator talks to the API server under its own
client-certificate identity, and only its requests plus a few kinds of creates are logged.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from collections import Counter
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import yaml

from benchmarks.common import RssSampler
from e2e.harness import certs
from e2e.harness import operator as harness_operator
from e2e.harness.controlplane import A100, ControlPlane, NodePool, write_kubeconfig
from hybridflow.api.schema import CpuAmount, cpu_cores

ROOT = Path(__file__).resolve().parent.parent
OPERATOR_USER = "hybridflow-operator"
BENCH_USER = "hybridflow-bench"
GPUS_PER_NODE = 8
CPU_NODE_CPUS = 128
CPU_NODE_PODS = 250
GPU_NODE_PODS = 110

# Everything the operator sends, plus the creates whose server-side times the benchmark uses:
# RLTrainingJobs (by the benchmark), RayJobs (by the operator or the benchmark), pod bindings (scheduler).
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "Metadata", "users": [OPERATOR_USER]},
        {
            "level": "Metadata",
            "verbs": ["create"],
            "resources": [
                {"group": "hybridflow.io", "resources": ["rltrainingjobs"]},
                {"group": "ray.io", "resources": ["rayjobs"]},
                {"group": "", "resources": ["pods/binding"]},
            ],
        },
        {"level": "None"},
    ],
}


class AuditedControlPlane(ControlPlane):
    """The harness's full control plane with an API-server audit log."""

    def __init__(self, *, work_dir: Path, **kwargs: Any) -> None:
        work_dir.mkdir(parents=True, exist_ok=True)
        policy = work_dir / "audit-policy.yaml"
        policy.write_text(yaml.safe_dump(AUDIT_POLICY, sort_keys=False))
        super().__init__(work_dir=work_dir, extra_apiserver_args=[
            f"--audit-policy-file={policy}",
            f"--audit-log-path={work_dir / 'audit.log'}",
            "--audit-log-format=json",
            "--audit-log-maxsize=0",  # never rotate: the reader follows one file
        ], **kwargs)

    @property
    def audit_log(self) -> Path:
        return self.work_dir / "audit.log"

    def user_kubeconfig(self, user: str, groups: tuple[str, ...] = ("system:masters",)) -> Path:
        """A kubeconfig for a distinct client-certificate identity (so the audit log can tell clients apart)."""
        assert self.pki is not None
        pair = certs.make_client_cert(self.pki.client_ca, self.pki.directory, user, groups)
        return write_kubeconfig(self.work_dir / f"{user}.kubeconfig", self.server, self.pki.serving_ca.cert, pair, user)


def bench_fleet(max_jobs: int, head_cpus: CpuAmount, submitter_cpus: float = 1.0) -> list[NodePool]:
    """DGX-A100-shaped GPU nodes for one 1-GPU worker per job, and CPU nodes for heads and submitter pods."""
    gpu_nodes = math.ceil(max_jobs / GPUS_PER_NODE)
    cpu_pods = 2 * max_jobs  # a head and KubeRay's submitter pod per job
    cpu_nodes = max(math.ceil(max_jobs * (cpu_cores(head_cpus) + submitter_cpus) / CPU_NODE_CPUS),
                    math.ceil(cpu_pods / CPU_NODE_PODS))
    return [
        NodePool("bench-a100", gpu_nodes, "96", "1152Gi", "p4de.24xlarge", A100, GPUS_PER_NODE, 81920,
                 pods=str(GPU_NODE_PODS)),
        NodePool("bench-cpu", cpu_nodes + 1, str(CPU_NODE_CPUS), "1024Gi", "m6i.32xlarge", pods=str(CPU_NODE_PODS)),
    ]


# -- the operator process ----------------------------------------------------------------------------------


def high_water_mark_bytes(pid: int) -> int | None:
    """The kernel's exact peak RSS of one process (VmHWM), while it still runs."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class OperatorProcess(harness_operator.OperatorProcess):
    """`python -m hybridflow_operator` as deployed (cluster-wide, standalone), under its own identity, its
    memory sampled; with `tracemalloc_out`, under benchmarks.operator.launch (the --trace-memory what-if)."""

    def __init__(self, kubeconfig: Path, log: Path, tracemalloc_out: Path | None = None) -> None:
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1"}
        if tracemalloc_out is not None:
            env["BENCH_TRACEMALLOC_OUT"] = str(tracemalloc_out)
        super().__init__(log, env)
        self.tracemalloc_out = tracemalloc_out
        self.sampler: RssSampler | None = None
        self.hwm_bytes: int | None = None
        self.cpu_seconds: float | None = None

    def argv(self) -> list[str]:
        module = "hybridflow_operator" if self.tracemalloc_out is None else "benchmarks.operator.launch"
        return [sys.executable, "-m", module, "--liveness", self.liveness]

    def start(self, timeout: float = 60.0) -> None:
        super().start(timeout)
        assert self.proc is not None
        self.sampler = RssSampler(self.proc.pid).start()

    @property
    def peak_rss_bytes(self) -> int:
        """The larger of the sampled tree peak and the kernel's high-water mark of the main process."""
        polled = self.sampler.peak_bytes if self.sampler else 0
        return max(polled, self.hwm_bytes or 0)

    def stop(self, *, hard: bool = False) -> None:
        """Records VmHWM and CPU time, then stops it."""
        if self.proc is not None and self.alive():
            self.hwm_bytes = high_water_mark_bytes(self.proc.pid)
            with contextlib.suppress(psutil.Error):
                times = psutil.Process(self.proc.pid).cpu_times()
                self.cpu_seconds = times.user + times.system
        if self.sampler:
            self.sampler.stop()
        super().stop(hard=hard)


# -- the audit log -----------------------------------------------------------------------------------------


def parse_time(stamp: str) -> float:
    """RFC 3339 with microseconds (audit MicroTime) -> seconds since the epoch."""
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


class AuditLog:
    """Incremental reader of the API server's JSON audit log; keeps one record per request (auditID)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""
        self.records: dict[str, dict[str, Any]] = {}

    def read(self) -> None:
        """Read what was appended since the last call."""
        if not self.path.exists():
            return
        with self.path.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            if not line.strip():
                continue
            ev = json.loads(line)
            ev["received"] = parse_time(ev["requestReceivedTimestamp"])
            # A watch logs ResponseStarted and later ResponseComplete: keep the first (its start time).
            self.records.setdefault(ev["auditID"], ev)

    def events(self, since: float, until: float) -> Iterator[dict[str, Any]]:
        """Records whose request arrived in [since, until]."""
        for ev in self.records.values():
            if since <= ev["received"] <= until:
                yield ev


def request_key(ev: dict[str, Any]) -> str:
    """`verb resource[/subresource]`, e.g. `patch rltrainingjobs/status`."""
    ref = ev.get("objectRef") or {}
    resource = ref.get("resource") or ev.get("requestURI", "?").split("?")[0]
    if ref.get("subresource"):
        resource += "/" + ref["subresource"]
    return f"{ev['verb']} {resource}"


def operator_requests(audit: AuditLog, since: float, until: float) -> Counter[str]:
    """The operator's requests in a window, by `verb resource`."""
    return Counter(request_key(ev) for ev in audit.events(since, until) if ev["user"]["username"] == OPERATOR_USER)


def creation_times(audit: AuditLog, resource: str, namespace: str, user: str | None = None) -> dict[str, float]:
    """name -> server time the create of `resource` (e.g. `rayjobs`, `pods/binding`) completed with success."""
    plural, _, sub = resource.partition("/")
    found: dict[str, float] = {}
    for ev in audit.records.values():
        ref = ev.get("objectRef") or {}
        if ev["verb"] != "create" or ref.get("resource") != plural or (ref.get("subresource") or "") != sub:
            continue
        if ref.get("namespace") != namespace or (user and ev["user"]["username"] != user):
            continue
        if (ev.get("responseStatus") or {}).get("code", 0) // 100 != 2:
            continue
        name = ref.get("name") or ""
        if name:
            found[name] = parse_time(ev["stageTimestamp"])
    return found


def first_requests(audit: AuditLog, namespace: str, user: str) -> dict[tuple[str, str, str], tuple[float, float]]:
    """(verb, resource[/sub], name) -> (received, completed) of the first such request by `user`."""
    found: dict[tuple[str, str, str], tuple[float, float]] = {}
    for ev in audit.records.values():
        ref = ev.get("objectRef") or {}
        if ref.get("namespace") != namespace or ev["user"]["username"] != user or not ref.get("name"):
            continue
        resource = ref.get("resource", "") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        key = (ev["verb"], resource, ref["name"])
        times = (parse_time(ev["requestReceivedTimestamp"]), parse_time(ev["stageTimestamp"]))
        if key not in found or times < found[key]:
            found[key] = times
    return found


def handler_stages(audit: AuditLog, namespace: str, jobs: list[str],
                   children: dict[str, dict[str, str]]) -> dict[str, list[float]]:
    """Where apply-to-RayJob goes, per job, on the API server's clock:

    - react: the job is created -> the operator's first request for one of its children arrives (the
      watch event reaching the operator, its work queue, the render);
    - apply: that first request -> the RayJob created (its ServiceAccount first, then the RayJob).

    `children[job]` maps each child's resource (configmaps, rayjobs, ...) to its name.
    """
    bench = first_requests(audit, namespace, BENCH_USER)
    ops = first_requests(audit, namespace, OPERATOR_USER)
    stages: dict[str, list[float]] = {"react": [], "apply": []}
    for job in jobs:
        created = bench.get(("create", "rltrainingjobs", job))
        rayjob = ops.get(("create", "rayjobs", children[job]["rayjobs"]))
        firsts = [t for (verb, resource, name), t in ops.items()
                  if verb in ("create", "get") and children[job].get(resource) == name]
        if not (created and rayjob and firsts):
            continue
        first = min(firsts)
        stages["react"].append(first[0] - created[1])
        stages["apply"].append(rayjob[1] - first[0])
    return stages


def request_latencies(audit: AuditLog, user: str, since: float, until: float) -> list[float]:
    """Server-side durations (received -> response complete) of a user's non-watch requests in a window."""
    return [
        parse_time(ev["stageTimestamp"]) - parse_time(ev["requestReceivedTimestamp"])
        for ev in audit.events(since, until)
        if ev["user"]["username"] == user and ev["verb"] not in ("watch",)
    ]
