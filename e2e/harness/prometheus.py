"""A real Prometheus server (Debian's `prometheus`) scraping local targets, for the metrics tests.

It runs with its storage and config in a directory of the caller's, on a free loopback port (moved
when another process takes the port first), and is asked through its HTTP API.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from .controlplane import PORT_TAKEN, StartupError, free_port, http_ok, tail

START_S = 60.0
BIND_ATTEMPTS = 5


def find_prometheus() -> str | None:
    return shutil.which("prometheus")


class PrometheusServer:
    """`prometheus` scraping `jobs` (scrape job name -> {"targets": [...], "metric_relabel_configs": [...]})
    every `interval`; its log is work_dir/prometheus.log."""

    def __init__(self, binary: str, work_dir: Path, jobs: Mapping[str, Mapping[str, Any]],
                 interval: str = "1s") -> None:
        self.binary = binary
        self.work_dir = work_dir
        self.jobs = jobs
        self.interval = interval
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.work_dir / "prometheus.log"

    def config(self) -> dict[str, Any]:
        return {
            "global": {"scrape_interval": self.interval, "evaluation_interval": self.interval},
            "scrape_configs": [
                {"job_name": name, "scrape_timeout": self.interval,
                 "static_configs": [{"targets": list(job["targets"])}],
                 **({"metric_relabel_configs": list(job["metric_relabel_configs"])}
                    if job.get("metric_relabel_configs") else {})}
                for name, job in self.jobs.items()
            ],
        }

    def start(self, timeout: float = START_S) -> PrometheusServer:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        config = self.work_dir / "prometheus.yml"
        config.write_text(yaml.safe_dump(self.config()))
        for attempt in range(1, BIND_ATTEMPTS + 1):
            self.port = free_port()
            argv = [self.binary, f"--config.file={config}", f"--storage.tsdb.path={self.work_dir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1d"]
            with self.log_path.open("ab") as out:
                offset = out.tell()
                self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             start_new_session=True)
            deadline = time.monotonic() + timeout
            while not http_ok(f"{self.url}/-/ready"):
                if self.proc.poll() is not None:
                    since = self.log_path.read_bytes()[offset:].decode(errors="replace")
                    if attempt < BIND_ATTEMPTS and PORT_TAKEN.search(since):
                        break
                    raise StartupError(f"prometheus exited ({self.proc.returncode}):\n{tail(self.log_path, 30)}")
                if time.monotonic() > deadline:
                    self.stop()
                    raise StartupError(f"prometheus not ready in {timeout:.0f} s:\n{tail(self.log_path, 30)}")
                time.sleep(0.2)
            else:
                return self
        raise StartupError(f"prometheus found no free port in {BIND_ATTEMPTS} attempts")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path>; the `data` of a successful answer (RuntimeError with Prometheus' error else)."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                body = json.load(response)
        except urllib.error.HTTPError as e:
            body = json.load(e)
        if body.get("status") != "success":
            raise RuntimeError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query now: the result vector (scalars come back as one sample without labels)."""
        data = self.api("query", query=expr)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def targets_up(self) -> dict[str, bool]:
        """Scrape job name -> whether its last scrape succeeded."""
        active: Sequence[dict[str, Any]] = self.api("targets")["activeTargets"]
        return {t["labels"]["job"]: t["health"] == "up" for t in active}
