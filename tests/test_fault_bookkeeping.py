"""The fault campaign's bookkeeping (benchmarks/chaos/recovery.py): what a run's metrics say about a kill."""

from __future__ import annotations

from benchmarks.chaos.procs import method_of
from benchmarks.chaos.recovery import RecoveryTracker, step_counts


def recs(*steps: int, tag: str = "a") -> list[dict]:
    return [{"step": s, "timing/step": f"{tag}{s}"} for s in steps]


def test_a_restore_cuts_the_file_back_and_the_next_record_ends_the_recovery() -> None:
    t = RecoveryTracker()
    t.feed(1.0, recs(1, 2, 3))
    t.feed(2.0, recs(1, 2, 3, 4, 5))
    t.kill(2.5)
    t.feed(3.0, recs(1, 2, 3, 4, 5))  # nothing yet
    t.feed(3.5, [])  # truncated, being rewritten
    t.feed(3.6, recs(1, 2))  # partly rewritten
    t.feed(4.0, recs(1, 2, 3, 4))  # restored from step 4
    assert t.recovered_t is None and t.resumed_from is None
    t.feed(6.0, recs(1, 2, 3, 4) + recs(5, tag="b"))
    t.feed(7.0, recs(1, 2, 3, 4) + recs(5, 6, tag="b"))
    assert (t.trained_before, t.resumed_from, t.redone, t.cuts) == (5, 4, 1, 0)
    assert t.recovery_s == 3.5


def test_a_cut_and_a_new_record_between_two_polls_are_both_seen() -> None:
    t = RecoveryTracker()
    t.feed(1.0, recs(1, 2, 3))
    t.kill(1.5)
    t.feed(5.0, recs(1, 2) + recs(3, tag="b"))
    assert (t.resumed_from, t.redone, t.recovery_s) == (2, 1, 3.5)


def test_a_step_written_after_the_kill_then_cut_away_is_superseded() -> None:
    t = RecoveryTracker()
    t.feed(1.0, recs(1, 2, 3, 4))
    t.kill(2.0)
    t.feed(3.0, recs(1, 2, 3, 4) + recs(5, tag="late"))  # finished before the kill, written after
    assert (t.resumed_from, t.recovery_s) == (4, 1.0)
    t.feed(4.0, recs(1, 2))
    assert t.recovered_t is None
    t.feed(5.0, recs(1, 2) + recs(3, tag="c"))
    t.feed(6.0, recs(1, 2) + recs(3, 4, tag="c"))
    assert (t.trained_before, t.resumed_from, t.redone, t.cuts, t.recovery_s) == (4, 2, 2, 1, 3.0)


def test_without_a_rollback_the_next_step_ends_the_recovery() -> None:
    t = RecoveryTracker()
    t.feed(1.0, recs(1, 2))
    t.kill(1.5)
    t.feed(2.0, recs(1, 2, 3))
    assert (t.redone, t.recovery_s, t.cuts) == (0, 0.5, 0)


def test_no_kill_means_no_recovery() -> None:
    t = RecoveryTracker()
    t.feed(1.0, recs(1))
    t.feed(2.0, recs(1, 2))
    assert t.redone is None and t.recovery_s is None


def test_step_counts_counts_extra_copies_and_absent_steps() -> None:
    assert step_counts(recs(1, 2, 3), 3) == (0, 0)
    assert step_counts(recs(1, 2, 2, 2, 4), 4) == (2, 1)
    assert step_counts([], 2) == (0, 2)


def test_method_of_reads_a_ray_process_title() -> None:
    assert method_of("ray::WorkerHost.update") == "update"
    assert method_of("ray::WorkerHost.save  ") == "save"
    assert method_of("ray::WorkerHost") is None
    assert method_of("ray::Trainer.fit") is None
    assert method_of("ray::Trainer.fit", "ray::Trainer") == "fit"
    assert method_of(None) is None
