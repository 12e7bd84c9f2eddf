"""The operator under faults, on a real control plane: the quick part of the chaos campaign
(benchmarks/chaos/operator_faults.py, which has the full one and explains the set-up).

The operator runs as a subprocess against a kube-apiserver of its own over the session's etcd, so that API
server can be stopped and restarted, and etcd compacted under it, while the tests keep writing through the
control plane's API server. Each test asserts on the campaign's row for its fault; the timeouts are generous
(a busy two-core machine), and nothing is asserted about how fast recovery is, only that it happens.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from benchmarks.chaos import operator_faults as faults
from e2e.harness.controlplane import ControlPlane

pytestmark = pytest.mark.controlplane

JOBS = 10


@pytest.fixture(scope="module")
def rig(control_plane: ControlPlane, crd: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[faults.Rig]:
    """The operator behind an API server of its own, one per module."""
    if not control_plane.install_kuberay_crds:
        pytest.skip("KubeRay's CRDs are not installed")
    # These tests play KubeRay's part; a KubeRay operator in the same control plane would race them.
    assert "kuberay-operator" not in control_plane.processes, "control_plane must run no KubeRay operator"
    rig = faults.Rig(control_plane, tmp_path_factory.mktemp("operator-faults"))
    try:
        rig.start()
        yield rig
    finally:
        rig.stop()


def explain(rig: faults.Rig, row: dict[str, Any]) -> str:
    return f"{json.dumps(row, indent=1)}\noperator log:\n{rig.operator.tail(60)}"


def test_a_killed_operator_restarts_without_duplicates_and_every_job_converges(rig: faults.Rig) -> None:
    row = faults.operator_kill(rig, rounds=1, jobs=JOBS)
    assert (row["injected"], row["survived"], row["duplicates"], row["losses"]) == (1, 1, 0, 0), explain(rig, row)
    assert len(row["recovery_s"]["samples"]) == 1


def test_an_api_server_restart_mid_burst_needs_no_operator_restart(rig: faults.Rig) -> None:
    row = faults.apiserver_restart(rig, JOBS)
    detail = row["detail"]
    assert detail["same_pid"], explain(rig, row)
    assert detail["liveness_ok"] == detail["liveness_probes"] > 0, explain(rig, row)  # alive while cut off
    assert detail["created_while_down"] > 0  # and those jobs, which it learnt of only afterwards, converged too
    assert (row["survived"], row["duplicates"], row["losses"]) == (1, 0, 0), explain(rig, row)


def test_an_expired_watch_relists_and_catches_up_with_what_changed_meanwhile(rig: faults.Rig) -> None:
    row = faults.watch_expired(rig, JOBS)
    detail = row["detail"]
    assert detail["expired_watches"] >= 1, explain(rig, row)  # a real 410 Gone, not a resumed watch
    assert detail["relists"] >= detail["expired_watches"], explain(rig, row)
    assert detail["same_pid"], explain(rig, row)
    # deleted jobs left nothing behind, new ones got their children, the lost RayJob came back
    assert (row["survived"], row["duplicates"], row["losses"]) == (1, 0, 0), explain(rig, row)


def test_foreign_edits_are_undone_and_a_deleted_namespace_is_let_go_quietly(rig: faults.Rig) -> None:
    row = faults.foreign_edit(rig, JOBS)
    detail = row["detail"]
    for outcome in ("ttl_restored_s", "label_restored_s", "rayjob_recreated_s"):
        assert detail[outcome] is not None, f"{outcome}: {explain(rig, row)}"
    quiet = detail["namespace_deletion"]
    assert quiet["children_left"] == 0, explain(rig, row)  # nothing created in a terminating namespace
    assert quiet["refused_in_second_half"] == 0 and quiet["warning_lines_in_second_half"] == 0, explain(rig, row)
    assert quiet["ok"], explain(rig, row)
    assert (row["survived"], row["duplicates"], row["losses"]) == (row["injected"], 0, 0), explain(rig, row)
