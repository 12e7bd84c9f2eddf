"""The hybridflow operator as a local process, for the e2e suites and the operator benchmark."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from .controlplane import POLL_S, PORT_TAKEN, StartupError, free_port, http_ok, tail

ROOT = Path(__file__).resolve().parents[2]
START_S = 60.0
BIND_ATTEMPTS = 5  # the liveness port is picked, then bound by the operator: the race of ControlPlane._launch


class OperatorProcess:
    """`python -m hybridflow_operator` with its liveness and metrics endpoints on free loopback ports and its
    output appended to `log_path`; subclasses change `argv()` or hook into `start`/`stop`."""

    def __init__(self, log_path: Path, env: Mapping[str, str], cwd: Path = ROOT) -> None:
        self.log_path = log_path
        self.env = dict(env)
        self.cwd = cwd
        self.port = free_port()
        self.metrics_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def liveness(self) -> str:
        return f"http://127.0.0.1:{self.port}/healthz"

    @property
    def metrics(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "hybridflow_operator", "--liveness", self.liveness]

    def start(self, timeout: float = START_S) -> None:
        """Start and wait until live (StartupError otherwise); a liveness port taken meanwhile moves."""
        for attempt in range(1, BIND_ATTEMPTS + 1):
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with self.log_path.open("ab") as out:
                out.write(f"\n===== start {self.starts + 1} =====\n".encode())
                out.flush()
                offset = out.tell()
                env = {**self.env, "HYBRIDFLOW_METRICS_PORT": str(self.metrics_port)}
                self.proc = subprocess.Popen(self.argv(), env=env, stdout=out, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, cwd=self.cwd, start_new_session=True)
            self.starts += 1
            deadline = time.monotonic() + timeout
            while not http_ok(self.liveness):
                if not self.alive():
                    since = self.log_path.read_bytes()[offset:].decode(errors="replace")
                    if attempt < BIND_ATTEMPTS and PORT_TAKEN.search(since):
                        self.port, self.metrics_port = free_port(), free_port()
                        break
                    raise StartupError(f"the operator exited before {self.liveness} answered: {self.describe()}")
                if time.monotonic() > deadline:
                    raise StartupError(f"the operator did not answer {self.liveness} in {timeout:.0f} s: "
                                       f"{self.describe()}")
                time.sleep(POLL_S)
            else:
                return

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, *, hard: bool = False) -> None:
        """SIGTERM (kopf exits cleanly) or SIGKILL; SIGKILL after 20 s."""
        if self.proc is None or not self.alive():
            return
        self.proc.send_signal(signal.SIGKILL if hard else signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def tail(self, lines: int = 40) -> str:
        return tail(self.log_path, lines) if self.log_path.exists() else ""

    def describe(self) -> str:
        state = "running" if self.alive() else f"exited ({self.proc.returncode if self.proc else 'never started'})"
        return f"operator {state}; log {self.log_path}:\n{self.tail()}"
