"""Operator fault injection on a real control plane: what the operator must survive, counted and timed.

`python -m benchmarks.chaos.operator_faults --out DIR [--quick]` prints one row per fault kind:

- operator_kill: bursts of jobs, the operator SIGKILLed at a seeded random moment of each and started again;
  meanwhile the test plays KubeRay and moves every RayJob that exists to Running.
- apiserver_restart: the operator's kube-apiserver stopped mid-burst and started again; the burst goes on.
- etcd_restart: etcd stopped and started again while the operator works through a burst.
- watch_expired: while the operator's API server is down, jobs are deleted and created, a RayJob is lost, and
  etcd is compacted; back up, every watch must relist (410 Gone) and what changed meanwhile must be caught up.
- foreign_edit: someone edits an owned RayJob (its TTL, its job label), deletes one, and deletes a namespace
  whose jobs are still being reconciled.

The operator talks to an API server of its own over the control plane's etcd, so that API server can be
stopped while the campaign keeps writing through the control plane's. The operator's serves watches from
etcd (--watch-cache=false): a resourceVersion etcd has compacted is then a 410 for certain. No controllers
run (as in e2e/test_operator.py): the campaign plays KubeRay's part, and the namespace controller's and the
garbage collector's (it deletes what they would). A job has converged when every one of its five children
exists exactly once and its status is what the operator would write for its RayJob as it stands.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import contextlib
import json
import random
import re
import sys
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes.client.exceptions import ApiException
from prometheus_client.parser import text_string_to_metric_families
from urllib3.exceptions import HTTPError

from benchmarks.chaos.report import recovery
from benchmarks.operator.measure import CHILD_RESOURCES, _api_client, bench_job
from benchmarks.operator.summarise import rounded
from e2e.harness.controlplane import (
    BIND_ATTEMPTS,
    ControlPlane,
    PortTakenError,
    Process,
    free_port,
    http_ok,
    insecure_context,
    wait_healthy,
    write_kubeconfig,
)
from e2e.harness.operator import OperatorProcess
from hybridflow.k8s import names
from hybridflow_operator.apply import status_patch
from hybridflow_operator.observed import JobView
from hybridflow_operator.status import status_changed

ROOT = Path(__file__).resolve().parents[2]
SEED = 20261202
ROUNDS = {True: 20, False: 2}  # operator kills, by `full`
JOBS = {True: 50, False: 10}  # jobs per burst
FOREIGN_JOBS = 3
CONVERGE_S = 240.0  # generous: the campaign shares two cores with the whole control plane
POLL_S = 0.5
KILL_WINDOW_S = 6.0  # the kill falls in [0, this) after the burst starts: while jobs are created and reconciled
OUTAGE_S = 5.0  # how long an API server or etcd stays down
QUIET_S = 25.0  # watched after a namespace deletion: what the operator does must stop in the first half (12.5 s,
# more than its 10 s retry delay, so a retry loop would show in the second)
PROBE_TRIES = 3  # a liveness probe fails after this many unanswered tries in a row (Kubernetes' failureThreshold)
REFUSED_PER_JOB = 2 * len(CHILD_RESOURCES)  # creates a deleted namespace may refuse per job: its children, Events
CREATE_THREADS = 8
JOB_API = f"/apis/{names.JOB_API_VERSION}"
RAYJOB_API = "/apis/ray.io/v1"
PATHS = {  # CHILD_RESOURCES' plurals -> their API group's path
    "configmaps": "/api/v1", "serviceaccounts": "/api/v1", "roles": "/apis/rbac.authorization.k8s.io/v1",
    "rolebindings": "/apis/rbac.authorization.k8s.io/v1", "rayjobs": RAYJOB_API,
}
OPERATOR_ENV = {"HYBRIDFLOW_STATUS_INTERVAL": "600", "HYBRIDFLOW_LOG_LEVEL": "INFO", "PYTHONUNBUFFERED": "1"}
EXPIRED = re.compile(r"expired \(410 Gone\)")
PROBLEM = re.compile(r"\b(WARNING|ERROR|CRITICAL)\b|retrying in")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def took(seconds: float | None) -> str:
    return "NEVER" if seconds is None else f"in {seconds:.1f}s"


# -- what converged means (pure) ----------------------------------------------------------------------------


def status_converged(job: Mapping[str, Any], rayjob: Mapping[str, Any] | None) -> bool:
    """The job's status is what the operator writes for its RayJob as it stands (no pods are pending here)."""
    status = job.get("status") or {}
    if rayjob is None or status.get("observedGeneration") != job["metadata"].get("generation"):
        return False
    return not status_changed(status, status_patch(JobView.parse(job), rayjob, [], None))


@dataclass(frozen=True)
class Assessment:
    """One look at a namespace: which expected jobs converged, and children beyond or short of one each."""

    converged: frozenset[str]
    duplicates: int  # children beyond one per kind and job
    missing: int  # (job, kind) with no child, plus expected jobs that are gone
    strays: int  # children of jobs that should not exist (deleted ones)

    def done(self, expected: Iterable[str]) -> bool:
        return self.converged >= frozenset(expected) and self.duplicates == 0 and self.strays == 0

    @property
    def children_complete(self) -> bool:
        """Every expected job has each child exactly once (its status may still be on its way)."""
        return self.missing == 0 and self.duplicates == 0 and self.strays == 0


def assess(expected: Iterable[str], jobs: Mapping[str, Mapping[str, Any]],
           children: Mapping[str, Sequence[Mapping[str, Any]]]) -> Assessment:
    """Judge a namespace from its jobs (by name) and its children (by plural, each carrying the job label)."""
    wanted = set(expected)
    counts = {plural: Counter((c["metadata"].get("labels") or {}).get(names.JOB_LABEL) for c in items)
              for plural, items in children.items()}
    rayjobs = {(r["metadata"].get("labels") or {}).get(names.JOB_LABEL): r for r in children.get("rayjobs", ())}
    duplicates = sum(n - 1 for per_kind in counts.values() for n in per_kind.values() if n > 1)
    missing = sum(1 for name in wanted for per_kind in counts.values() if per_kind.get(name, 0) == 0)
    strays = sum(n for per_kind in counts.values() for name, n in per_kind.items() if name not in jobs)
    converged = frozenset(
        name for name in wanted
        if name in jobs and all(per_kind.get(name) == 1 for per_kind in counts.values())
        and status_converged(jobs[name], rayjobs.get(name)))
    return Assessment(converged, duplicates, missing, strays)


def row(kind: str, injected: int, survived: int, duplicates: int, losses: int, samples: Sequence[float],
        detail: Mapping[str, Any]) -> dict[str, Any]:
    return {"kind": kind, "injected": injected, "survived": survived, "duplicates": duplicates, "losses": losses,
            "recovery_s": recovery(samples), "detail": dict(detail)}


def replace_flags(argv: Sequence[str], flags: Mapping[str, str]) -> list[str]:
    """`--name=value` arguments with the given names set to new values (added when absent)."""
    out = [a for a in argv if a.split("=", 1)[0].removeprefix("--") not in flags]
    return out + [f"--{k}={v}" for k, v in flags.items()]


def lines_since(text: str, mark: int, pattern: re.Pattern[str], needle: str = "") -> int:
    """Lines of `text` past offset `mark` that match `pattern` (and contain `needle`)."""
    return sum(1 for line in text[mark:].splitlines() if pattern.search(line) and needle in line)


# -- the rig ------------------------------------------------------------------------------------------------


class OperatorApiServer:
    """A kube-apiserver of the operator's own over the control plane's etcd (same flags and certificates,
    another port, watches from etcd); stopping it cuts the operator off and nobody else."""

    def __init__(self, cp: ControlPlane, work_dir: Path) -> None:
        self.cp = cp
        self.work_dir = work_dir
        self.port = free_port()
        self.proc: Process | None = None
        self.kubeconfig = work_dir / "operator.kubeconfig"
        self.log = work_dir / "logs" / "operator-apiserver.log"

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        return replace_flags(self.cp.processes["kube-apiserver"].argv, {
            "secure-port": str(self.port), "cert-dir": str(self.work_dir / "operator-apiserver-certs"),
            "watch-cache": "false"})

    def start(self) -> None:
        """Start and wait until ready. A first start moves to another port if its own was taken; a restart keeps
        the port the operator knows, and tries again."""
        first = self.proc is None
        for attempt in range(1, BIND_ATTEMPTS + 1):
            offset = self.log.stat().st_size if self.log.exists() else 0
            self.proc = Process.start("operator-apiserver", self.argv(), self.log)
            try:
                wait_healthy(self.proc, f"{self.url}/readyz", self.cp.timeout, insecure_context(), offset)
                break
            except PortTakenError:
                self.proc.stop()
                if attempt == BIND_ATTEMPTS:
                    raise
                if first:
                    self.port = free_port()
                else:
                    time.sleep(1.0)
        if first:
            assert self.cp.pki is not None
            write_kubeconfig(self.kubeconfig, self.url, self.cp.pki.serving_ca.cert, self.cp.pki.admin, "admin")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


@dataclass
class Burst:
    """Jobs being created in the background."""

    namespace: str
    names: list[str]
    future: concurrent.futures.Future[list[str]]
    started: float = field(default_factory=time.monotonic)

    def wait(self) -> list[str]:
        """The errors of the creates (none expected)."""
        return self.future.result(timeout=CONVERGE_S)


class Rig:
    """The control plane, the operator's API server, the operator, and a client of the control plane's own."""

    def __init__(self, cp: ControlPlane, work_dir: Path, seed: int = SEED) -> None:
        self.cp = cp
        self.work_dir = work_dir
        self.rng = random.Random(seed)
        self.apiserver = OperatorApiServer(cp, work_dir)
        self.api = _api_client(cp.kubeconfig, pool=CREATE_THREADS + 4)
        self.bursts = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="burst")
        self.creates = concurrent.futures.ThreadPoolExecutor(CREATE_THREADS, thread_name_prefix="create")
        self.op: OperatorProcess | None = None
        self.children_s: float | None = None  # of the last converge()

    def start(self) -> Rig:
        self.apiserver.start()
        env = {**self.cp.env, **OPERATOR_ENV, "KUBECONFIG": str(self.apiserver.kubeconfig)}
        self.op = OperatorProcess(self.work_dir / "operator.log", env)
        self.op.start()
        return self

    def stop(self) -> None:
        if self.op is not None:
            self.op.stop()
        self.apiserver.stop()
        for pool in (self.bursts, self.creates):
            pool.shutdown(wait=False, cancel_futures=True)

    @property
    def operator(self) -> OperatorProcess:
        assert self.op is not None, "start() first"
        return self.op

    # -- requests through the control plane's own API server --

    def rest(self, method: str, path: str, body: Any = None, query: Mapping[str, str] | None = None,
             content_type: str = "application/json") -> Any:
        """One request; the parsed answer, None for 404; ApiException otherwise."""
        response = self.api.call_api(*self.api.param_serialize(
            method, path, query_params=list((query or {}).items()), body=body, auth_settings=["BearerToken"],
            header_params={"Content-Type": content_type, "Accept": "application/json"}), _request_timeout=30)
        response.read()
        if response.status == 404:
            return None
        if not 200 <= response.status <= 299:
            raise ApiException(status=response.status, reason=(response.data or b"").decode(errors="replace")[:300])
        return json.loads(response.data or b"null")

    def namespace(self, purpose: str) -> str:
        ns = f"chaos-{purpose}-{uuid.uuid4().hex[:5]}"
        self.rest("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        return ns

    def burst(self, namespace: str, count: int, prefix: str = "job") -> Burst:
        """Create `count` jobs at once, in the background."""
        job_names = [f"{prefix}-{i:03d}" for i in range(count)]

        path = f"{JOB_API}/namespaces/{namespace}/rltrainingjobs"

        def create_all() -> list[str]:
            creates = [self.creates.submit(self.rest, "POST", path, bench_job(name, namespace)) for name in job_names]
            return [str(e)[:200] for e in (f.exception() for f in creates) if e is not None]

        return Burst(namespace, job_names, self.bursts.submit(create_all))

    def jobs(self, namespace: str) -> dict[str, dict]:
        found = self.rest("GET", f"{JOB_API}/namespaces/{namespace}/rltrainingjobs") or {"items": []}
        return {j["metadata"]["name"]: j for j in found["items"]}

    def children(self, namespace: str) -> dict[str, list[dict]]:
        return {plural: (self.rest("GET", f"{PATHS[plural]}/namespaces/{namespace}/{plural}",
                                   query={"labelSelector": names.JOB_LABEL}) or {"items": []})["items"]
                for plural in CHILD_RESOURCES}

    def look(self, namespace: str, expected: Iterable[str]) -> Assessment:
        return assess(expected, self.jobs(namespace), self.children(namespace))

    def converge(self, namespace: str, expected: Sequence[str], since: float,
                 until: Callable[[], bool] = lambda: True, timeout: float = CONVERGE_S) -> tuple[float | None,
                                                                                                  Assessment]:
        """Seconds from `since` (monotonic) until every expected job converged (and `until()`), with the last
        look; None for the seconds if that never happened within `timeout`. `children_s` keeps when the children
        were complete: the statuses follow at the operator's pace for status writes."""
        deadline = time.monotonic() + timeout
        self.children_s = None
        while True:
            seen: Assessment | None = None
            with contextlib.suppress(ApiException, HTTPError, OSError):  # etcd may still be coming back
                seen = self.look(namespace, expected)
                if self.children_s is None and seen.children_complete:
                    self.children_s = time.monotonic() - since
                if seen.done(expected) and until():
                    return time.monotonic() - since, seen
            if time.monotonic() > deadline:
                return None, seen or Assessment(frozenset(), 0, len(expected) * len(CHILD_RESOURCES), 0)
            time.sleep(POLL_S)

    def settled(self, namespace: str, expected: Sequence[str]) -> Assessment:
        """A second look a moment after convergence: nothing late (a duplicate, a lost child) may follow."""
        time.sleep(2.0)
        return self.look(namespace, expected)

    def play_kuberay(self, namespace: str) -> int:
        """Move every RayJob of the namespace to Running, as KubeRay would; how many there were."""
        rayjobs = self.children(namespace)["rayjobs"]
        for rayjob in rayjobs:
            name = rayjob["metadata"]["name"]
            status = {"status": {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING",
                                 "rayClusterName": f"{name}-abcde", "startTime": "2026-01-01T00:00:00Z"}}
            self.rest("PATCH", f"{RAYJOB_API}/namespaces/{namespace}/rayjobs/{name}/status", status,
                      content_type="application/merge-patch+json")
        return len(rayjobs)

    def clear(self, namespace: str, children_first: bool = False) -> None:
        """Delete every job of the namespace and every child, as the garbage collector (or the namespace
        controller, `children_first`) would."""
        jobs: list[tuple[str, str, dict[str, str]]] = [(JOB_API, "rltrainingjobs", {})]
        kids = [(PATHS[p], p, {"labelSelector": names.JOB_LABEL}) for p in CHILD_RESOURCES]
        for api, plural, query in (kids + jobs) if children_first else (jobs + kids):
            self.rest("DELETE", f"{api}/namespaces/{namespace}/{plural}", query=query)

    # -- the operator --

    def metric(self, name: str, **labels: str) -> float:
        """Sum of an operator counter's samples with these labels (since its last start)."""
        with urllib.request.urlopen(self.operator.metrics, timeout=10) as response:
            text = response.read().decode()
        return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                   if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()))

    def lists(self) -> float:
        return self.metric("hybridflow_operator_api_requests_total", verb="list")

    def log_text(self) -> str:
        return self.operator.log()

    def stop_etcd(self) -> Process:
        etcd = self.cp.processes["etcd"]
        etcd.stop()
        return etcd

    def start_etcd(self, stopped: Process) -> None:
        """The same etcd again: same data, same ports, which both API servers reconnect to."""
        health = f"http://127.0.0.1:{self.cp.ports.etcd_client}/health"
        for attempt in range(1, BIND_ATTEMPTS + 1):
            offset = stopped.log.stat().st_size if stopped.log.exists() else 0
            proc = Process.start("etcd", stopped.argv, stopped.log)
            self.cp.processes["etcd"] = proc
            try:
                wait_healthy(proc, health, self.cp.timeout, None, offset)
                return
            except PortTakenError:
                proc.stop()
                if attempt == BIND_ATTEMPTS:
                    raise
                time.sleep(1.0)

    def compact_etcd(self) -> int:
        """Compact etcd's history up to now (through its JSON gateway); the revision compacted at."""
        base = f"http://127.0.0.1:{self.cp.ports.etcd_client}/v3/kv"

        def post(path: str, body: Mapping[str, Any]) -> Any:
            request = urllib.request.Request(f"{base}/{path}", json.dumps(body).encode(), method="POST",
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as response:
                return json.loads(response.read())

        revision = int(post("range", {"key": base64.b64encode(b"/registry/namespaces").decode()})["header"]
                       ["revision"])
        post("compaction", {"revision": str(revision), "physical": True})
        return revision


# -- the faults ---------------------------------------------------------------------------------------------


def operator_kill(rig: Rig, rounds: int, jobs: int) -> dict[str, Any]:
    """Each round: a burst, a SIGKILL at a random moment, a restart; converged from the restart."""
    samples: list[float] = []
    rounds_out: list[dict[str, Any]] = []
    survived = duplicates = losses = 0
    for i in range(rounds):
        ns = rig.namespace(f"kill{i}")
        burst = rig.burst(ns, jobs)
        delay = rig.rng.uniform(0.0, KILL_WINDOW_S)
        time.sleep(max(0.0, burst.started + delay - time.monotonic()))
        rig.operator.stop(hard=True)
        errors = burst.wait()
        moved = rig.play_kuberay(ns)  # what KubeRay did while the operator was down
        restarted = time.monotonic()
        rig.operator.start()
        seconds, seen = rig.converge(ns, burst.names, restarted)
        after = rig.settled(ns, burst.names)
        ok = seconds is not None and after.done(burst.names) and not errors
        survived += ok
        duplicates += max(seen.duplicates, after.duplicates)
        losses += len(burst.names) - len(after.converged & frozenset(burst.names))
        if seconds is not None:
            samples.append(seconds)
        rounds_out.append({"kill_after_s": round(delay, 2), "rayjobs_at_kill": moved, "converged_s": rounded(seconds),
                           "children_complete_s": rounded(rig.children_s), "create_errors": errors[:3]})
        log(f"operator_kill round {i + 1}/{rounds}: killed {delay:.1f}s into the burst ({moved} RayJobs by then), "
            f"converged {took(seconds)}")
        rig.clear(ns)
    return row("operator_kill", rounds, survived, duplicates, losses, samples,
               {"jobs_per_round": jobs, "seed": SEED, "rounds": rounds_out})


def _outage(rig: Rig, kind: str, jobs: int, stop: Callable[[], Any], start: Callable[[Any], None],
            writable: bool) -> dict[str, Any]:
    """A burst, and the component stopped a moment into it, while the operator works through the jobs; down for
    OUTAGE_S (when the control plane stays `writable`, the second half of the burst is created meanwhile);
    converged from the moment it is back. The operator must keep its PID and answer its liveness probe
    throughout."""
    ns = rig.namespace(kind.split("_")[0])
    pid = rig.operator.proc.pid if rig.operator.proc else None
    lists_before = rig.lists()
    mark = len(rig.log_text())
    first = rig.burst(ns, jobs // 2 if writable else jobs)
    if not writable:
        first.wait()  # etcd down refuses every write: the burst is in, the operator still working on it
    time.sleep(rig.rng.uniform(0.1, 0.6))
    stopped = stop()
    down_from = time.monotonic()
    second = rig.burst(ns, jobs - jobs // 2, prefix="late") if writable else None
    probes = answered = 0
    while time.monotonic() < down_from + OUTAGE_S:
        probes += 1
        answered += any(http_ok(rig.operator.liveness) for _ in range(PROBE_TRIES))
        time.sleep(0.5)
    start(stopped)
    back = time.monotonic()
    errors = first.wait() + (second.wait() if second else [])
    expected = first.names + (second.names if second else [])
    seconds, seen = rig.converge(ns, expected, back)
    after = rig.settled(ns, expected)
    same_pid = rig.operator.alive() and rig.operator.proc is not None and rig.operator.proc.pid == pid
    ok = seconds is not None and after.done(expected) and same_pid and answered == probes and not errors
    log(f"{kind}: converged {took(seconds)} after it came back; liveness {answered}/{probes}; same PID {same_pid}")
    detail = {"jobs": jobs, "children_complete_s": rounded(rig.children_s),
              "created_while_down": len(second.names) if second else 0, "outage_s": OUTAGE_S,
              "same_pid": same_pid, "liveness_ok": answered, "liveness_probes": probes,
              "relists": rig.lists() - lists_before if same_pid else None,
              "expired_watches": lines_since(rig.log_text(), mark, EXPIRED), "create_errors": errors[:3]}
    rig.clear(ns)
    return row(kind, 1, int(ok), max(seen.duplicates, after.duplicates),
               len(expected) - len(after.converged & frozenset(expected)),
               [seconds] if seconds is not None else [], detail)


def apiserver_restart(rig: Rig, jobs: int) -> dict[str, Any]:
    return _outage(rig, "apiserver_restart", jobs, lambda: rig.apiserver.stop(), lambda _: rig.apiserver.start(),
                   writable=True)


def etcd_restart(rig: Rig, jobs: int) -> dict[str, Any]:
    return _outage(rig, "etcd_restart", jobs, rig.stop_etcd, rig.start_etcd, writable=False)


def watch_expired(rig: Rig, jobs: int) -> dict[str, Any]:
    """Converged jobs; the operator's API server down while some jobs go, others come and a RayJob is lost;
    etcd compacted past every resourceVersion the operator holds; its API server back."""
    ns = rig.namespace("expired")
    first = rig.burst(ns, jobs)
    first.wait()
    rig.converge(ns, first.names, time.monotonic())
    pid = rig.operator.proc.pid if rig.operator.proc else None
    lists_before = rig.lists()
    mark = len(rig.log_text())
    rig.apiserver.stop()
    gone, kept = first.names[: jobs // 3], first.names[jobs // 3:]
    for name in gone:  # the job, then its children, as the garbage collector would
        rig.rest("DELETE", f"{JOB_API}/namespaces/{ns}/rltrainingjobs/{name}")
        for plural, child_name in CHILD_RESOURCES.items():
            rig.rest("DELETE", f"{PATHS[plural]}/namespaces/{ns}/{plural}/{child_name(name)}")
    lost = kept[0]
    rig.rest("DELETE", f"{RAYJOB_API}/namespaces/{ns}/rayjobs/{names.rayjob_name(lost)}")
    second = rig.burst(ns, max(1, jobs // 3), prefix="late")
    errors = second.wait()
    revision = rig.compact_etcd()
    rig.apiserver.start()
    back = time.monotonic()
    expected = kept + second.names
    seconds, seen = rig.converge(ns, expected, back)
    after = rig.settled(ns, expected)
    expired = lines_since(rig.log_text(), mark, EXPIRED)
    same_pid = rig.operator.alive() and rig.operator.proc is not None and rig.operator.proc.pid == pid
    relists = rig.lists() - lists_before if same_pid else 0
    ok = seconds is not None and after.done(expected) and same_pid and expired >= 1 and not errors
    log(f"watch_expired: {expired} watches expired, {relists:.0f} lists; converged "
        f"{took(seconds)}")
    rig.clear(ns)
    return row("watch_expired", 1, int(ok), max(seen.duplicates, after.duplicates),
               len(expected) - len(after.converged & frozenset(expected)) + after.strays,
               [seconds] if seconds is not None else [],
               {"jobs": jobs, "children_complete_s": rounded(rig.children_s), "deleted_meanwhile": len(gone),
                "created_meanwhile": len(second.names),
                "rayjob_lost_meanwhile": lost, "compacted_at_revision": revision, "expired_watches": expired,
                "relists": relists, "same_pid": same_pid, "create_errors": errors[:3]})


def foreign_edit(rig: Rig, jobs: int) -> dict[str, Any]:
    """An owned RayJob's TTL edited and another's job label removed (both restored), a RayJob deleted
    (recreated), and a namespace deleted while its jobs are being reconciled (the operator lets go, quietly)."""
    ns = rig.namespace("foreign")
    burst = rig.burst(ns, FOREIGN_JOBS)
    burst.wait()
    rig.converge(ns, burst.names, time.monotonic())
    edited, unlabelled, deleted = burst.names
    samples: list[float] = []
    outcomes: dict[str, Any] = {}

    def rayjob(job: str) -> dict[str, Any]:
        return rig.rest("GET", f"{RAYJOB_API}/namespaces/{ns}/rayjobs/{names.rayjob_name(job)}") or {}

    def patch_rayjob(job: str, ops: list[dict[str, Any]]) -> None:
        rig.rest("PATCH", f"{RAYJOB_API}/namespaces/{ns}/rayjobs/{names.rayjob_name(job)}", ops,
                 content_type="application/json-patch+json")

    def timed(what: str, until: Callable[[], bool]) -> None:
        t0 = time.monotonic()
        seconds, _ = rig.converge(ns, burst.names, t0, until)
        outcomes[what] = rounded(seconds)
        if seconds is not None:
            samples.append(seconds)

    ttl = rayjob(edited)["spec"]["ttlSecondsAfterFinished"]
    patch_rayjob(edited, [{"op": "replace", "path": "/spec/ttlSecondsAfterFinished", "value": ttl + 1000}])
    timed("ttl_restored_s", lambda: rayjob(edited)["spec"].get("ttlSecondsAfterFinished") == ttl)
    patch_rayjob(unlabelled, [{"op": "remove", "path": "/metadata/labels/" + names.JOB_LABEL.replace("/", "~1")}])
    timed("label_restored_s", lambda: (rayjob(unlabelled)["metadata"].get("labels") or {}).get(names.JOB_LABEL)
          == unlabelled)
    uid = rayjob(deleted)["metadata"]["uid"]
    rig.rest("DELETE", f"{RAYJOB_API}/namespaces/{ns}/rayjobs/{names.rayjob_name(deleted)}")
    timed("rayjob_recreated_s", lambda: rayjob(deleted).get("metadata", {}).get("uid") not in (None, uid))
    after = rig.settled(ns, burst.names)
    rig.clear(ns)

    quiet = namespace_deletion(rig, jobs)
    restored = sum(v is not None for v in outcomes.values())
    return row("foreign_edit", len(outcomes) + 1, restored + int(quiet["ok"]), after.duplicates,
               len(outcomes) - restored + after.missing, samples, {**outcomes, "namespace_deletion": quiet})


def namespace_deletion(rig: Rig, jobs: int) -> dict[str, Any]:
    """A burst, and its namespace deleted the moment the last job is in, while the operator still works on them;
    then the namespace's content goes the way the namespace controller takes it: the children first, the jobs a
    moment later (the operator sees RayJobs vanish under live jobs). What the operator does about the namespace
    must stay bounded and stop within QUIET_S / 2."""
    ns = rig.namespace("nsdel")
    before_403 = rig.metric("hybridflow_operator_api_requests_total", code="403")
    mark = len(rig.log_text())
    burst = rig.burst(ns, jobs)
    burst.wait()
    rig.rest("DELETE", f"/api/v1/namespaces/{ns}")
    deleted, since = time.monotonic(), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    rayjobs = len(rig.children(ns)["rayjobs"])
    time.sleep(1.0)
    for plural in CHILD_RESOURCES:
        rig.rest("DELETE", f"{PATHS[plural]}/namespaces/{ns}/{plural}", query={"labelSelector": names.JOB_LABEL})
    time.sleep(3.0)
    rig.clear(ns, children_first=True)  # the jobs, and whatever is left: the controller goes on until it is empty
    time.sleep(max(0.0, deleted + QUIET_S / 2 - time.monotonic()))
    half_403 = rig.metric("hybridflow_operator_api_requests_total", code="403")
    half_lines = lines_since(rig.log_text(), mark, PROBLEM, ns)
    time.sleep(max(0.0, deleted + QUIET_S - time.monotonic()))
    end_403 = rig.metric("hybridflow_operator_api_requests_total", code="403")
    problem_lines = lines_since(rig.log_text(), mark, PROBLEM, ns)
    let_go = lines_since(rig.log_text(), mark, re.compile("is being deleted"), ns)
    left = sum(len(items) for items in rig.children(ns).values())
    events = (rig.rest("GET", f"/api/v1/namespaces/{ns}/events") or {"items": []})["items"]
    late_events = [e for e in events if e.get("reportingComponent") == "hybridflow-operator"
                   and (e.get("lastTimestamp") or "") >= since]
    refused = end_403 - before_403
    ok = (left == 0 and end_403 == half_403 and problem_lines == half_lines and refused <= REFUSED_PER_JOB * jobs
          and problem_lines <= jobs and rig.operator.alive())
    log(f"namespace deletion: {rayjobs} RayJobs when it was deleted, {refused:.0f} creates refused, {problem_lines} "
        f"warnings about it, {left} children left; quiet in the second half: "
        f"{end_403 == half_403 and problem_lines == half_lines}")
    return {"ok": ok, "jobs": jobs, "rayjobs_at_deletion": rayjobs, "refused_creates": refused,
            "refused_in_second_half": end_403 - half_403, "warning_lines": problem_lines,
            "warning_lines_in_second_half": problem_lines - half_lines, "noted_terminating": let_go,
            "children_left": left, "operator_events_after_deletion": len(late_events), "window_s": QUIET_S}


# -- the campaign -------------------------------------------------------------------------------------------


def start_control_plane(work_dir: Path) -> ControlPlane:
    """etcd + kube-apiserver with KubeRay's CRDs and ours; no controllers (the campaign plays them)."""
    cp = ControlPlane(work_dir=work_dir / "cp", crd_dirs=[ROOT / "crds"], install_kuberay_crds=True,
                      allow_build=False)
    return cp.start()


def campaign(rig: Rig, full: bool) -> list[dict]:
    """Every fault kind against a started rig, in order."""
    jobs = JOBS[full]
    rows = [operator_kill(rig, ROUNDS[full], jobs), apiserver_restart(rig, jobs), etcd_restart(rig, jobs),
            watch_expired(rig, jobs), foreign_edit(rig, jobs)]
    return rows


def run(out_dir: Path, full: bool) -> list[dict]:
    """The whole campaign on a control plane of its own (logs under out_dir); one row per fault kind."""
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    cp = start_control_plane(out_dir)
    rig = Rig(cp, out_dir)
    try:
        rig.start()
        rows = campaign(rig, full)
    finally:
        rig.stop()
        cp.stop()
    elapsed = time.monotonic() - t0
    for r in rows:
        r["detail"]["campaign_wall_s"] = round(elapsed, 1)
    (out_dir / "operator_faults.json").write_text(json.dumps(rows, indent=1) + "\n")
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.chaos.operator_faults",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for logs and operator_faults.json")
    parser.add_argument("--quick", action="store_true", help=f"{ROUNDS[False]} kill rounds of {JOBS[False]} jobs "
                        f"instead of {ROUNDS[True]} of {JOBS[True]}")
    args = parser.parse_args(argv)
    rows = run(args.out, full=not args.quick)
    print(json.dumps(rows, indent=1))
    return 0 if all(r["survived"] == r["injected"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
