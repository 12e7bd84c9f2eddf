"""`python -m benchmarks.operator.launch [operator flags]`: the operator's own entry point, instrumented for
the `--trace-memory` what-if of the operator benchmark. Not a way to run hybridflow.

BENCH_TRACEMALLOC_OUT=FILE: trace Python allocations; whenever the traced heap has grown by 25%, write its
largest allocation sites and the live objects by type to FILE (so FILE describes the largest heap seen).
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import threading
import time
import tracemalloc
from collections import Counter
from pathlib import Path

from hybridflow_operator.__main__ import main

POLL_S = 2.0
GROWTH = 1.25  # a new snapshot only when traced memory grew 25% past the last one: snapshots are costly
FLOOR = 48 * 2**20  # and none below this
FRAMES = 4
TOP = 25


class PeakSnapshot:
    """Writes the allocation sites and live object types of the largest traced heap seen so far."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.best_bytes = FLOOR
        self.started = time.time()
        tracemalloc.start(FRAMES)
        threading.Thread(target=self._poll, name="tracemalloc-poll", daemon=True).start()

    def _poll(self) -> None:
        while True:
            time.sleep(POLL_S)
            current, _ = tracemalloc.get_traced_memory()
            if current > self.best_bytes * GROWTH:
                self.best_bytes = current
                self.write(tracemalloc.take_snapshot(), current)

    def write(self, snapshot: tracemalloc.Snapshot, traced: int) -> None:
        snapshot = snapshot.filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
        types = Counter(type(o).__qualname__ for o in gc.get_objects())
        tasks = sum(1 for o in gc.get_objects() if isinstance(o, asyncio.Task) and not o.done())
        lines = [f"traced {traced / 2**20:.1f} MiB at {time.time() - self.started:.0f} s after start; "
                 f"{tasks} pending asyncio tasks; {threading.active_count()} threads", "",
                 "by file (allocating frame):"]
        lines += [f"  {st.size / 2**20:8.2f} MiB {st.count:8d} blocks  {st.traceback[0]}"
                  for st in snapshot.statistics("filename")[:TOP]]
        lines += ["", "gc-tracked objects by type:"]
        lines += [f"  {count:8d}  {name}" for name, count in types.most_common(TOP)]
        lines += ["", f"by call path ({FRAMES} frames, largest 10):"]
        for st in snapshot.statistics("traceback")[:10]:
            lines.append(f"  {st.size / 2**20:.2f} MiB in {st.count} blocks")
            lines += [f"      {frame.filename}:{frame.lineno}" for frame in st.traceback]
        self.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    if os.environ.get("BENCH_TRACEMALLOC_OUT"):
        PeakSnapshot(Path(os.environ["BENCH_TRACEMALLOC_OUT"]))
    sys.exit(main(sys.argv[1:]))
