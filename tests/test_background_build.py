"""The control-plane build that runs beside the tests: its lock, its failure report, and the test order.

A stand-in build script (bash, like build.sh) keeps these fast; the lock handling is the real one.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from e2e.conftest import Plan, _start_build, binaries_last, wanted_components
from e2e.harness import binaries

SLOW_BUILD = """#!/usr/bin/env bash
set -euo pipefail
[[ -n ${HYBRIDFLOW_BUILD_LOCK_FD:-} ]] || { echo "no lock handed over" >&2; exit 3; }
echo "nice=$(nice)"
sleep 1.5
mkdir -p "$HYBRIDFLOW_CACHE/bin/out" && echo "$@" > "$HYBRIDFLOW_CACHE/bin/out/built"
"""
FAILING_BUILD = """#!/usr/bin/env bash
echo "compiling"
echo "link: out of memory" >&2
exit 7
"""


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HYBRIDFLOW_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _script(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "build.sh"
    path.write_text(text)
    return path


def test_a_lookup_waits_for_the_build_started_before_it(tmp_path: Path, cache: Path) -> None:
    build = binaries.BackgroundBuild(("etcd", "helm"), tmp_path / "logs" / "b.log",
                                     script=_script(tmp_path, SLOW_BUILD)).start(niceness=5)
    binaries.wait_for_running_build()  # right after start: the child already holds the lock
    assert (cache / "bin" / "out" / "built").read_text().split() == ["etcd", "helm"]
    build.wait()
    assert build.seconds >= 1.4
    log = build.log_path.read_text()
    assert f"nice={os.nice(0) + 5}" in log or "nice=19" in log


def test_waiting_threads_all_see_the_finished_build(tmp_path: Path, cache: Path) -> None:
    binaries.BackgroundBuild(("etcd",), tmp_path / "b.log", script=_script(tmp_path, SLOW_BUILD)).start()
    seen: list[bool] = []

    def look() -> None:
        binaries.wait_for_running_build()
        seen.append((cache / "bin" / "out" / "built").is_file())

    threads = [threading.Thread(target=look) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert seen == [True, True, True]


def test_a_failed_build_reports_its_exit_code_and_log(tmp_path: Path, cache: Path) -> None:
    build = binaries.BackgroundBuild(("kube-apiserver",), tmp_path / "b.log",
                                     script=_script(tmp_path, FAILING_BUILD)).start()
    for _ in range(2):  # every waiter gets the failure, not only the first
        with pytest.raises(binaries.MissingBinariesError, match=r"exit code 7[\s\S]*out of memory"):
            build.wait()


ELSEWHERE_BUILD = """#!/usr/bin/env bash
set -euo pipefail
mkdir -p "$HYBRIDFLOW_CACHE/bin" && exec 9>"$HYBRIDFLOW_CACHE/bin/.build.lock" && flock 9
sleep 1.5
mkdir -p "$1" && printf '#!/bin/sh\\n' > "$1/etcd" && chmod +x "$1/etcd"
"""


def test_a_build_another_process_runs_is_seen_at_once_and_waited_for_before_building(tmp_path: Path,
                                                                                      cache: Path) -> None:
    """As .ci/run's build, started before the session: collection must not block on it, the first test that
    needs a binary waits for it and builds nothing it already built."""
    assert not binaries.build_running()
    other = subprocess.Popen(["bash", str(_script(tmp_path, ELSEWHERE_BUILD)), str(binaries.cached_dir("etcd"))])
    deadline = time.monotonic() + 30
    # The loop ends on a True, which proves the call did not wait: one that waited would take the lock after the
    # build and answer False.
    while not binaries.build_running():
        assert other.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    plan = Plan(wanted=("etcd",), build_elsewhere=True)
    assert _start_build(plan) is None  # waited for the other build: nothing left to build
    assert plan.build is None
    # etcd is written 1.5 s after the other build took its lock, just before it lets the lock go
    assert binaries.find("etcd") == binaries.cached_dir("etcd") / "etcd"
    assert not binaries.build_running()
    # Its lock goes with its open files, a moment before its exit status can be read: wait for that, not poll.
    assert other.wait(timeout=30) == 0


def test_no_lock_file_means_nothing_to_wait_for(cache: Path) -> None:
    started = time.monotonic()
    binaries.wait_for_running_build()
    assert time.monotonic() - started < 1


@dataclass
class Marker:
    name: str


@dataclass
class Item:
    """What the ordering reads from a pytest item."""

    nodeid: str
    module: str
    fixturenames: tuple[str, ...] = ()
    markers: tuple[str, ...] = ()
    extra: dict = field(default_factory=dict)

    def iter_markers(self) -> list[Marker]:
        return [Marker(m) for m in self.markers]


def test_modules_that_run_binaries_go_last_whole_and_in_order() -> None:
    items = [
        Item("a::1", "a"),
        Item("chart::pure", "chart"),
        Item("chart::helm", "chart", fixturenames=("helm",)),
        Item("b::1", "b"),
        Item("e2e::cp", "e2e", markers=("controlplane",)),
        Item("c::1", "c"),
    ]
    ordered = [i.nodeid for i in binaries_last(items)]  # type: ignore[arg-type]
    assert ordered == ["a::1", "b::1", "c::1", "chart::pure", "chart::helm", "e2e::cp"]


def test_the_components_follow_what_the_tests_use() -> None:
    assert wanted_components([Item("a", "a")]) == ()  # type: ignore[list-item]
    only_helm = wanted_components([Item("c", "c", fixturenames=("helm",))])  # type: ignore[list-item]
    assert only_helm == ("helm",)
    minimal = wanted_components([Item("e", "e", fixturenames=("control_plane",))])  # type: ignore[list-item]
    assert minimal == (*binaries.MINIMAL, "kubectl", "kuberay-crds")
    nodes = wanted_components([Item("r", "r", markers=("realnodes",))])  # type: ignore[list-item]
    assert set(binaries.FULL) | set(binaries.NODE) | {"helm", "kubectl"} == set(nodes)
