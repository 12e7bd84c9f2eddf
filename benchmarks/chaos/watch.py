"""Threads beside a run: one polls its metrics.jsonl, one waits for a phase and kills a process in it."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.chaos import procs
from benchmarks.chaos.recovery import RecoveryTracker
from hybridflow.metrics import parse_records


class MetricsWatch:
    """Polls metrics.jsonl every `poll_s` and feeds a RecoveryTracker; the file's records are `records`."""

    def __init__(self, path: Path, poll_s: float = 0.02) -> None:
        self.path, self.poll_s = path, poll_s
        self.tracker = RecoveryTracker()
        self.records: list[dict[str, Any]] = []
        self._text: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-watch", daemon=True)

    def start(self) -> MetricsWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.poll()

    def last_step(self) -> int:
        with self._lock:
            return int(self.records[-1]["step"]) if self.records else 0

    def poll(self) -> None:
        try:
            text = self.path.read_text()
        except OSError:
            text = ""
        now = time.monotonic()
        with self._lock:
            if text == self._text:
                return
            self._text = text
            self.records = parse_records(text)
            self.tracker.feed(now, self.records)

    def mark_kill(self) -> None:
        """Read the file once more, then mark the fault (called right before the signal is sent)."""
        self.poll()
        with self._lock:
            self.tracker.kill(time.monotonic())

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self.poll_s)


@dataclass(frozen=True)
class Phase:
    """Where a fault lands: WorkerHost methods whose title marks the phase, on the hosts of `nodes` (any
    host when empty); `staging`: also while a checkpoint's staging directory exists; `new_host`: a host
    that appeared after arming (a parallelism change starting it)."""

    name: str
    methods: frozenset[str] = frozenset()
    nodes: tuple[str, ...] = ()
    staging: bool = False
    new_host: bool = False


@dataclass
class Kill:
    """What the killer did: the victim, its title when the signal went out, and whether the phase held then."""

    pid: int | None = None
    title: str | None = None
    trigger: str | None = None
    in_phase: bool = False
    notes: list[str] = field(default_factory=list)


StatusFn = Callable[[], dict[str, Any] | None]


class PhaseKiller:
    """Arms once the job's hosts are up and its metrics reach `after_step`, then SIGKILLs one process at
    the first moment the phase is seen: the host in it (`victim="worker"`) or the controller.

    Host titles are read every `poll_s` from /proc; the set of this cluster's hosts is rescanned every
    `scan_s` and the job's status (which host serves which node, the controller's pid) every `status_s`.
    """

    def __init__(self, phase: Phase, victim: str, after_step: int, watch: MetricsWatch, status: StatusFn,
                 checkpoint_root: Path, on_arm: Callable[[], None] | None = None, poll_s: float = 0.002,
                 scan_s: float = 0.25, status_s: float = 0.5) -> None:
        if victim not in ("worker", "controller"):
            raise ValueError(f"victim must be worker or controller, got {victim!r}")
        self.phase, self.victim, self.after_step = phase, victim, after_step
        self.watch, self.status, self.root, self.on_arm = watch, status, checkpoint_root, on_arm
        self.poll_s, self.scan_s, self.status_s = poll_s, scan_s, status_s
        self.kill = Kill()
        self.armed_at: float | None = None
        self._pids: dict[str, set[int]] = {}
        self._controller: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="phase-killer", daemon=True)

    def start(self) -> PhaseKiller:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    @property
    def killed(self) -> bool:
        return self.kill.pid is not None

    def _refresh(self) -> bool:
        """The job's hosts by node and its controller; False while the job is not up (or restarting)."""
        try:
            status = self.status()
        except Exception:
            return False
        if not status:
            return False
        nodes = status.get("nodes", {})
        pids = {name: {int(w["pid"]) for w in node.get("workers", []) if w.get("pid")} for name, node in nodes.items()}
        if not pids or not all(pids.values()):
            return False
        self._pids = pids
        self._controller = int(status["controller"]["pid"])
        return True

    def _hosts_of(self, nodes: tuple[str, ...] | None = None) -> set[int]:
        """The pids serving `nodes` (every node when None)."""
        out: set[int] = set()
        for name, pids in self._pids.items():
            if nodes is None or name in nodes:
                out |= pids
        return out

    def _run(self) -> None:
        next_status = next_scan = 0.0
        hosts: dict[int, str] = {}
        known: set[int] = set()
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_status:  # the hosts change only as the fault lands: look less often once armed
                next_status = now + self.status_s * (1 if self.armed_at is None else 4)
                up = self._refresh()
                if self.armed_at is None and up and self.watch.last_step() >= self.after_step:
                    self.armed_at = now
                    known = self._hosts_of()
                    if self.on_arm is not None:
                        self.on_arm()
            if self.armed_at is None:
                self._stop.wait(0.05)
                continue
            if now >= next_scan:
                next_scan = now + self.scan_s
                hosts = procs.own_processes(procs.HOST_TITLE)
            hit = self._find(hosts, known)
            if hit is not None and self._strike(*hit):
                return
            self._stop.wait(self.poll_s)

    def _find(self, hosts: dict[int, str], known: set[int]) -> tuple[int, str] | None:
        """(host pid in the phase, what showed it), or None."""
        ph = self.phase
        wanted = self._hosts_of(ph.nodes) if ph.nodes else None
        for pid in hosts:
            t = procs.title(pid)
            if t is None:
                continue
            if ph.new_host and pid not in known and t.startswith(procs.HOST_TITLE):
                return pid, f"new host: {t}"
            if procs.method_of(t) in ph.methods and (wanted is None or pid in wanted):
                return pid, t
        if ph.staging and any(p.name.startswith(".tmp-step_") for p in _entries(self.root)):
            actor = sorted(self._pids.get("actor_rollout", set()))
            if actor:
                return actor[0], "checkpoint staging directory"
        return None

    def _strike(self, host: int, trigger: str) -> bool:
        """SIGKILL the victim; False (and a note) when it is not this campaign's process of the expected kind."""
        pid = host if self.victim == "worker" else self._controller
        expected = procs.HOST_TITLE if self.victim == "worker" else procs.CONTROLLER_TITLE
        victim_title = procs.title(pid) if pid is not None else None
        if pid is None or not victim_title or not victim_title.startswith(expected) or not procs.is_own(pid):
            note = f"pid {pid} is not this campaign's {expected} ({victim_title!r})"
            if note not in self.kill.notes:
                self.kill.notes.append(note)
            return False
        still = self._still_in_phase(host, trigger)
        self.watch.mark_kill()
        os.kill(pid, signal.SIGKILL)
        self.kill = Kill(pid, victim_title, trigger, still, self.kill.notes)
        return True

    def _still_in_phase(self, host: int, trigger: str) -> bool:
        """The phase read again right before the signal (a method may end between the read and the kill)."""
        if trigger == "checkpoint staging directory":
            return any(p.name.startswith(".tmp-step_") for p in _entries(self.root))
        if trigger.startswith("new host"):
            return procs.title(host) is not None
        return procs.method_of(procs.title(host)) in self.phase.methods


def _entries(root: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(root) as it:
            return list(it)
    except OSError:
        return []
