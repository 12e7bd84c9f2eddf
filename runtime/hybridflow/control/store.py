"""What was asked for from outside, kept in a small JSON file next to the job's checkpoints: each node's
parallelism, and the nodes whose sequence parallelism was turned off.

The file outlives the controller's process, so a controller that Ray restarts puts the same
parallelism back before it loads a checkpoint, and leaves sequence parallelism off where it was turned
off; it is written before a change is applied and put back when the change fails, so it never names a
parallelism the job did not get.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

FILE_NAME = "control.json"
HISTORY = 100


class TargetStore:
    """{node: parallelism}, the nodes with sequence parallelism off, and the recent requests, read and written
    whole (atomic rename)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def read(self) -> dict[str, Any]:
        if not self.path.is_file():
            return {"targets": {}, "sequence_parallel_off": [], "history": []}
        data = json.loads(self.path.read_text())
        return {"targets": {str(k): int(v) for k, v in data.get("targets", {}).items()},
                "sequence_parallel_off": sorted(str(n) for n in data.get("sequence_parallel_off", [])),
                "history": list(data.get("history", []))}

    def targets(self) -> dict[str, int]:
        return dict(self.read()["targets"])

    def write(self, data: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, self.path)

    def record(self, node: str, replaces: list[str], old: int, new: int, reason: str) -> dict[str, Any]:
        """Set `node`'s target (dropping the co-located `replaces`, which share its hosts) and log the
        request; returns the previous content so a failed change can put it back."""
        before = self.read()
        targets = {k: v for k, v in before["targets"].items() if k not in replaces}
        targets[node] = new
        self.write(before | {"targets": targets, "history": _logged(before, node, old, new, reason)})
        return before

    def record_sequence_parallel_off(self, node: str, old: int, reason: str) -> dict[str, Any]:
        """`node`'s sequence parallelism is off from now on (`old` -> 1); returns the previous content."""
        before = self.read()
        off = sorted({*before["sequence_parallel_off"], node})
        self.write(before | {"sequence_parallel_off": off,
                             "history": _logged(before, node, old, 1, reason, "sequence_parallel")})
        return before

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)


def _logged(before: dict[str, Any], node: str, old: int, new: int, reason: str,
            kind: str = "parallelism") -> list[dict[str, Any]]:
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "node": node, "kind": kind, "old": old,
             "new": new, "reason": reason}
    return (before["history"] + [entry])[-HISTORY:]
