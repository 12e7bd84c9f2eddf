"""What the benchmarks share: a process-tree memory sampler, a count of the tokens a model embeds, their README
sections between markers, the command line of those that render from their JSON, and prose templates."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from string import Template
from typing import Any

import psutil

TEMPLATES = Path(__file__).resolve().parent / "templates"
RESULTS = Path(__file__).resolve().parent / "results"
README = Path(__file__).resolve().parent / "README.md"


@contextmanager
def embedded_tokens(model: Any) -> Iterator[list[int]]:
    """The tokens each forward call of `model` embeds while the block runs, one count a call: a hook on its input
    embedding, removed on the way out."""
    tokens: list[int] = []
    hook = model.get_input_embeddings().register_forward_hook(lambda _m, args, _out: tokens.append(args[0].numel()))
    try:
        yield tokens
    finally:
        hook.remove()


def status_bytes(key: str) -> int:
    """A memory line of /proc/self/status (VmRSS, VmHWM), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def measured(fn: Callable[[], None]) -> tuple[float, int]:
    """(seconds, peak extra bytes) of one call: VmHWM after it minus VmRSS before it, the peak reset first."""
    import gc

    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    base = status_bytes("VmRSS")
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    return seconds, max(0, status_bytes("VmHWM") - base)


class RssSampler:
    """Polls the summed RSS of a process and all its descendants (pages shared between processes count in
    each): the peak, the most processes seen, a time series and, given `label`, the peak split by process."""

    def __init__(self, pid: int, interval: float = 0.1, label: Callable[[psutil.Process], str] | None = None) -> None:
        self.pid, self.interval, self.label = pid, interval, label
        self.peak_bytes = 0
        self.peak_processes = 0
        self.peak_by_process: dict[str, float] = {}
        self.series: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def sample(self) -> int:
        """The tree's RSS now, in bytes (0 once the process is gone); recorded."""
        try:
            root = psutil.Process(self.pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            return 0
        rss: list[tuple[psutil.Process, int]] = []
        for proc in tree:
            try:
                rss.append((proc, proc.memory_info().rss))
            except psutil.Error:
                continue
        total = sum(r for _, r in rss)
        if total:
            self.series.append((time.time(), total))
        self.peak_processes = max(self.peak_processes, len(rss))
        if total > self.peak_bytes:
            self.peak_bytes = total
            if self.label:
                self.peak_by_process = self._by_process(rss)
        return total

    def _by_process(self, rss: list[tuple[psutil.Process, int]]) -> dict[str, float]:
        assert self.label is not None
        by: dict[str, float] = {}
        for proc, r in rss:
            try:
                name = self.label(proc)
            except psutil.Error:
                name = "exited"
            by[name] = by.get(name, 0.0) + r / 2**20
        return {k: round(v, 1) for k, v in sorted(by.items(), key=lambda kv: -kv[1])}

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)


def write_section(path: Path, begin: str, end: str, block: str) -> None:
    """Replace the section between the markers `begin` and `end` (`block` includes them), or append it;
    the rest of the file stays."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def grouped_bars(ax: Any, series: dict[str, list[float]], width: float, **style: Any) -> list[Any]:
    """One bar per series at each x position 0, 1, ..., the series side by side, `width` each and centred on
    the position; style keys map a series' label to its bar keyword (`color={"a": "tab:gray"}`). Returns the
    bar containers, in series order."""
    bars = []
    for k, (label, values) in enumerate(series.items()):
        offset = (k - (len(series) - 1) / 2) * width
        bars.append(ax.bar([i + offset for i in range(len(values))], values, width=width, label=label,
                           **{key: by_label[label] for key, by_label in style.items()}))
    return bars


def save_figure(fig: Any, out: Path, dpi: int) -> Path:
    """Lay out, write and close a matplotlib figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out


def measure_or_render(description: str, name: str, bench: Callable[[], dict[str, Any]],
                      render: Callable[[dict[str, Any]], str], plot: Callable[[dict[str, Any], Path], Path],
                      begin: str, end: str) -> None:
    """A benchmark's command line: run `bench` and keep its report as results/NAME.json, or (--render) read it
    back; then draw results/NAME.png and write its README section between `begin` and `end`."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--render", action="store_true", help="redraw the plot and README section from the JSON")
    args = parser.parse_args()
    path = RESULTS / f"{name}.json"
    if args.render:
        report = json.loads(path.read_text())
    else:
        report = bench()
        RESULTS.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1) + "\n")
    plot(report, RESULTS / f"{name}.png")
    write_section(README, begin, end, render(report))
    print(render(report))


class Text:
    """The sections of a prose template in benchmarks/templates, filled in by name (string.Template).

    In the file, a line `%% name` opens a section, which runs to the next one; its last newline is dropped
    and nothing above the first section is used (that is where the file explains itself).
    """

    def __init__(self, name: str) -> None:
        sections: dict[str, list[str]] = {}
        current: list[str] | None = None
        for line in (TEMPLATES / name).read_text().splitlines(keepends=True):
            if line.startswith("%% "):
                current = sections.setdefault(line[3:].strip(), [])
            elif current is not None:
                current.append(line)
        self.sections = {key: Template("".join(lines).removesuffix("\n")) for key, lines in sections.items()}

    def __call__(self, section: str, **values: Any) -> str:
        return self.sections[section].substitute(values)
