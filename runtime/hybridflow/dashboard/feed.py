"""Where a live dashboard gets its data: the metrics file, the running job's controller, or both.

A failed read keeps the last good data and says what failed, so the page keeps its panels when the job
ends or the file is rewritten by a rollback.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Protocol

from hybridflow.dashboard.view import build_view
from hybridflow.metrics import parse_records


class Controller(Protocol):
    """What the feed needs of a running job (control.client.JobHandle)."""

    def call(self, method: str, *args: Any, timeout_s: float) -> Any: ...


class Feed:
    """Builds the view on request, at most once every `min_interval_s` (page reloads share one read)."""

    def __init__(self, metrics: Path | None, job: Controller | None, title: str = "",
                 min_interval_s: float = 0.5) -> None:
        if metrics is None and job is None:
            raise ValueError("a feed needs a metrics file, a job, or both")
        self.metrics, self.job, self.title = metrics, job, title
        self.min_interval_s = min_interval_s
        self._lock = threading.Lock()
        self._records: list[dict[str, Any]] = []
        self._status: dict[str, Any] | None = None
        self._view: dict[str, Any] | None = None
        self._at = 0.0

    def view(self) -> dict[str, Any]:
        with self._lock:
            if self._view is None or time.monotonic() - self._at >= self.min_interval_s:
                errors = dict.fromkeys(e for e in (self._read_status(), self._read_records()) if e)
                self._view = build_view(self._records, self._status, self.title, error="; ".join(errors) or None)
                self._at = time.monotonic()
            return self._view

    def _read_status(self) -> str | None:
        if self.job is None:
            return None
        from hybridflow.control.errors import ControlError

        try:
            self._status = dict(self.job.call("control_status", timeout_s=30.0))
        except ControlError as e:
            return str(e)
        return None

    def _read_records(self) -> str | None:
        if self.metrics is not None:
            try:
                self._records = parse_records(self.metrics.read_text())
            except (OSError, ValueError) as e:
                return f"cannot read {self.metrics}: {e}"
            return None
        assert self.job is not None
        return self._fetch_records(self.job)

    def _fetch_records(self, job: Controller) -> str | None:
        """Only the steps after the last one held; all of them again when the job rolled back past it."""
        from hybridflow.control.errors import ControlError

        last = self._records[-1]["step"] if self._records else -1  # step 0: a baseline evaluation's record
        if self._status is not None and int(self._status.get("step", last)) < last:
            self._records, last = [], -1
        try:
            new = list(job.call("dashboard_records", last, timeout_s=30.0))
        except ControlError as e:
            return str(e)
        self._records += new
        return None
