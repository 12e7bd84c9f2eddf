"""Helpers shared by the suites in tests/ and e2e/ (import them as `tests.helpers`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def unavailable(message: str) -> NoReturn:
    """Skip a test that needs something absent, except under CI=true, where it must run: fail it."""
    if in_ci():
        pytest.fail(message)
    pytest.skip(message)


@contextlib.contextmanager
def minimal_apiserver(tmp_path_factory: pytest.TempPathFactory, crd_files: Sequence[Path] = ()) -> Iterator[Any]:
    """etcd + kube-apiserver of the e2e harness (RBAC on, no controllers) with `crd_files` installed."""
    from e2e.harness import binaries
    from e2e.harness.controlplane import ControlPlane

    absent = binaries.missing(binaries.MINIMAL)
    if absent:
        unavailable(f"kube-apiserver/etcd not built ({', '.join(absent)}): run `bash e2e/toolchain/build.sh "
                    "etcd kube-apiserver` (Go >= 1.24) or set KUBEBUILDER_ASSETS")
    cp = ControlPlane(work_dir=tmp_path_factory.mktemp("apiserver"), install_kuberay_crds=False, allow_build=False)
    cp.start()
    try:
        cp.install_crds(crd_files)
        yield cp
    finally:
        cp.stop()


def condition(job: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """The job's status condition of this type, {} when it has none."""
    return next((c for c in (job.get("status") or {}).get("conditions") or [] if c["type"] == kind), {})


def reward_pool_graph(reward_resources: Mapping[str, float]) -> dict[str, Any]:
    """A custom PPO graph whose reward function runs in a pool of its own, fed by the actor (so placed next
    to it); actor and reference share the `actor` pool, the critic has its own."""
    return {
        "nodes": [
            {"name": "actor", "role": "actor_rollout", "resources": {"GPU": 1}, "parallelism": 16, "pool": "actor"},
            {"name": "ref", "role": "reference", "resources": {}, "parallelism": 16, "pool": "actor"},
            {"name": "score", "role": "reward", "resources": dict(reward_resources), "parallelism": 4,
             "pool": "reward"},
            {"name": "critic", "role": "critic", "resources": {"GPU": 1}, "parallelism": 8, "pool": "critic"},
        ],
        "edges": [
            {"src": "actor", "dst": "ref", "coLocate": True},
            {"src": "actor", "dst": "score", "dataType": "rollout_batch"},
            {"src": "score", "dst": "critic", "dataType": "rewarded_batch"},
            {"src": "critic", "dst": "actor", "control": True},
        ],
    }
