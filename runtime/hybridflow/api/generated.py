"""Files generated from the models and committed (the CRD, the chart's values schema and README).

`stale` is what every `--check` reports, `write` what every generator does: one drift check for all of them.
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

Outputs = Mapping[Path, Callable[[], str]]
"""Each generated file and how to render its content."""

MAX_DIFF_LINES = 40


def stale(outputs: Outputs) -> list[str]:
    """One problem per file that is missing or differs from what its renderer gives (empty: up to date)."""
    problems: list[str] = []
    for path, render in outputs.items():
        want = render()
        have = path.read_text() if path.is_file() else None
        if have is None:
            problems.append(f"{path}: missing")
        elif have != want:
            diff = list(
                difflib.unified_diff(
                    have.splitlines(),
                    want.splitlines(),
                    f"{path} (on disk)",
                    f"{path} (generated)",
                    lineterm="",
                )
            )
            shown = "\n".join(diff[:MAX_DIFF_LINES])
            if len(diff) > MAX_DIFF_LINES:
                shown += f"\n... {len(diff) - MAX_DIFF_LINES} more diff lines"
            problems.append(f"{path}: out of date\n{shown}")
    return problems


def write(outputs: Outputs) -> list[Path]:
    """Regenerate the files; returns the ones whose content changed."""
    changed = []
    for path, render in outputs.items():
        text = render()
        if not path.is_file() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            changed.append(path)
    return changed


def sync(outputs: Outputs, *, check: bool, what: str, make_target: str) -> int:
    """The generators' command line: `check` reports drift (exit 1), otherwise the files are rewritten."""
    if check:
        problems = stale(outputs)
        for p in problems:
            print(p, file=sys.stderr)
        if problems:
            print(f"{what} are stale: run `make {make_target}` and commit the result", file=sys.stderr)
            return 1
        print(f"{what} are up to date")
        return 0
    changed = write(outputs)
    for path in changed:
        print(f"wrote {path}")
    if not changed:
        print(f"{what} already up to date")
    return 0
