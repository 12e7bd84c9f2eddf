"""The fast part of the runtime fault campaign (benchmarks/chaos): a worker SIGKILLed while a checkpoint is
written or in a sharded critic's update, and a checkpoint file system that fills up mid-write, on a multi-raylet
cluster."""

from __future__ import annotations

import os

import pytest

from benchmarks.chaos import runtime_faults as rf
from benchmarks.chaos.ckpt_full import EVERY, write_failure_case
from tests.helpers import unavailable

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

ATTEMPTS = 3
"""A kill that misses its window (the phase ended between two looks) is retried; the test then still
asserts that one landed."""


@pytest.fixture(scope="module")
def cluster():
    with rf.campaign_cluster() as c:
        yield c


def test_a_worker_killed_while_a_checkpoint_is_written_is_recovered(cluster, tmp_path) -> None:
    plan = rf.FaultPlan("worker_kill", "checkpoint", after_step=1)
    for attempt in range(ATTEMPTS):
        out = rf.fault_run(plan, tmp_path / f"try{attempt}", f"chaos-test-ckpt-{attempt}")
        if out.killed:
            break
    assert out.killed, f"no worker was killed in {ATTEMPTS} runs: {out.notes}"
    assert out.victim and out.victim.startswith("ray::WorkerHost")
    assert out.completed, out.error
    assert out.steps == sorted(set(out.steps)) and (out.duplicates, out.losses) == (0, 0), out.steps
    assert out.redone is not None and out.redone <= rf.EVERY, out.summary()
    assert out.recovery_s is not None and out.recovery_s > 0
    assert out.checkpoint_files > 0 and out.unloadable == []
    assert out.ok


def test_a_critic_rank_killed_in_its_sharded_update_is_recovered(cluster, tmp_path) -> None:
    """Two FSDP2 critic ranks; one dies in the update, while the other's inference copy is released for it: the
    ranks form again, every role rolls back to the last checkpoint, and each step is in the metrics once."""
    plan = rf.FaultPlan("worker_kill", "sharded_update", after_step=2)
    for attempt in range(ATTEMPTS):
        out = rf.fault_run(plan, tmp_path / f"try{attempt}", f"chaos-test-shard-{attempt}")
        if out.killed:
            break
    assert out.killed and out.in_phase, f"no critic rank was killed in its update in {ATTEMPTS} runs: {out.notes}"
    assert out.victim and "WorkerHost" in out.victim
    assert out.completed, out.error
    assert out.steps == sorted(set(out.steps)) and (out.duplicates, out.losses) == (0, 0), out.steps
    assert out.redone is not None and out.redone <= rf.EVERY, out.summary()
    assert out.ok


def test_a_full_checkpoint_file_system_stops_the_run_cleanly_and_a_rerun_resumes(cluster, tmp_path) -> None:
    if os.geteuid() != 0:
        unavailable("mounting a tmpfs needs root")
    case = write_failure_case(tmp_path)
    assert case.error is None, case.error
    assert case.rc not in (None, 0)
    assert case.message.startswith("error: checkpoint of step 4 not written: cannot write checkpoint file"), case
    assert "No space left on device" in case.message and "step_00000002" in case.message
    assert case.error_lines == 1 and not case.traceback
    assert case.previous_intact and case.latest_after_failure == EVERY and case.leftover_staging == []
    assert case.rerun_completed and case.resumed_from == EVERY
    assert (case.duplicates, case.losses) == (0, 0) and case.unloadable == []
    assert case.ok
