"""`python -m hybridflow_operator`: its command line and process set-up, in fresh interpreters."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml


def python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_tune_gc_freezes_what_the_imports_made_and_widens_the_young_generation() -> None:
    done = python(
        "import gc\n"
        "from hybridflow_operator.__main__ import YOUNG_GENERATION, tune_gc\n"
        "import hybridflow_operator.lifecycle\n"
        "before = gc.get_threshold()\n"
        "tune_gc()\n"
        "after = gc.get_threshold()\n"
        "print(gc.get_freeze_count(), len(gc.get_objects()), after[0] == YOUNG_GENERATION, after[1:] == before[1:])\n"
    )
    assert done.returncode == 0, done.stderr
    frozen, tracked, young, older_unchanged = done.stdout.split()
    assert int(frozen) > 10 * int(tracked)  # the modules' objects are out of every collection's way
    assert young == older_unchanged == "True"


def test_a_bad_setting_is_one_line_naming_it_and_exit_2() -> None:
    done = subprocess.run([sys.executable, "-m", "hybridflow_operator", "--status-interval", "soon"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "HYBRIDFLOW_STATUS_INTERVAL" in done.stderr and done.stderr.startswith("hybridflow-operator: ")


# -- liveness: the process's own health, not the API server's ----------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again when the block ends: nothing listens there


def _healthz(url: str, deadline: float) -> tuple[int, dict]:
    """The first answer of the liveness endpoint before `deadline` (monotonic); (0, {}) if none came."""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                return resp.status, json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as e:
            return e.code, {}
        except OSError:
            time.sleep(0.2)
    return 0, {}


def test_liveness_holds_while_the_api_server_is_unreachable(tmp_path: Path) -> None:
    """An API-server outage must not restart the operator: its informers retry, its liveness stays 200."""
    api = f"https://127.0.0.1:{_closed_port()}"
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "gone",
        "clusters": [{"name": "gone", "cluster": {"server": api, "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": "not-a-real-token"}}],
        "contexts": [{"name": "gone", "context": {"cluster": "gone", "user": "u"}}],
    }))
    port = _closed_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBERNETES_", "HYBRIDFLOW_"))}
    env |= {"KUBECONFIG": str(kubeconfig), "HYBRIDFLOW_METRICS_PORT": "0", "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "operator.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "hybridflow_operator", "--liveness",
                                 f"http://127.0.0.1:{port}/healthz"], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        status, body = _healthz(f"http://127.0.0.1:{port}/healthz", time.monotonic() + 90)
        assert (status, body) == (200, {"operator": True}), log.read_text()[-3000:]
        # the informers have met the outage by now (and keep retrying); the process stays live
        deadline = time.monotonic() + 60
        while "watching" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "retrying" in log.read_text(), log.read_text()[-3000:]
        time.sleep(11)  # past kopf's 10 s cache of probe results: this answer is a fresh probe
        status, body = _healthz(f"http://127.0.0.1:{port}/healthz", time.monotonic() + 20)
        assert (status, body) == (200, {"operator": True}), log.read_text()[-3000:]
        assert proc.poll() is None, log.read_text()[-3000:]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def test_liveness_fails_once_an_operator_task_has_ended() -> None:
    """A long-running task that ended met a bug (API errors are retried inside it): fail, do not retry."""
    import kopf

    from hybridflow_operator.lifecycle import alive

    async def probe(tasks: list[asyncio.Task[None]]) -> bool:
        return await alive(memo=kopf.Memo(tasks=tasks))

    async def scenario() -> None:
        running = asyncio.get_running_loop().create_task(asyncio.sleep(60), name="RayJobs in all namespaces")
        ended = asyncio.get_running_loop().create_task(asyncio.sleep(0), name="resync")
        await asyncio.sleep(0.01)
        assert await probe([running]) is True
        assert await alive(memo=kopf.Memo()) is True  # before start-up made any
        with pytest.raises(kopf.PermanentError, match="resync"):
            await probe([running, ended])
        running.cancel()

    asyncio.run(scenario())
