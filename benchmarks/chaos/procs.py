"""This campaign's own Ray processes by their title: Ray shows `ray::Class.method` while a method runs.

Only descendants of the calling process are considered (the Ray cluster it started), so a campaign never
touches another Ray cluster on the same machine.
"""

from __future__ import annotations

import os
from pathlib import Path

import psutil

HOST_TITLE = "ray::WorkerHost"
CONTROLLER_TITLE = "ray::Trainer"


def title(pid: int) -> str | None:
    """The process title (its rewritten command line), None once the process is gone."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def method_of(process_title: str | None, cls_title: str = HOST_TITLE) -> str | None:
    """`ray::WorkerHost.update ...` -> `update`; an idle actor (`ray::WorkerHost`) or another class -> None."""
    if not process_title:
        return None
    head = process_title.split()[0]
    prefix = cls_title + "."
    return head[len(prefix):] if head.startswith(prefix) else None


def own_processes(prefix: str) -> dict[int, str]:
    """pid -> title of every descendant of this process whose title starts with `prefix`."""
    found: dict[int, str] = {}
    try:
        children = psutil.Process(os.getpid()).children(recursive=True)
    except psutil.Error:
        return found
    for child in children:
        t = title(child.pid)
        if t and t.startswith(prefix):
            found[child.pid] = t
    return found


def is_own(pid: int) -> bool:
    """Whether `pid` is a descendant of this process (checked again right before a kill)."""
    try:
        return any(p.pid == os.getpid() for p in psutil.Process(pid).parents())
    except psutil.Error:
        return False
