"""Which checkpoint a run resumes from, and where a run that starts from the spec puts the ones it finds: pure
directory logic (tests/test_training.py runs both on real Ray)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.api import parse_job
from hybridflow.api.load import SpecError
from hybridflow.api.spec import RESUME_FROM_NEEDS_AUTO
from hybridflow.checkpoint import (
    CONTROLLER_FILE,
    PREVIOUS_DIR,
    NoCheckpoint,
    complete_steps,
    prune,
    resume_source,
    retire,
    step_dir,
)
from hybridflow.preflight import preflight


def write_steps(root: Path, *steps: int, mark: str = "") -> None:
    for step in steps:
        d = step_dir(root, step)
        d.mkdir(parents=True)
        (d / CONTROLLER_FILE).write_text(f"{mark}{step}")


def test_retire_moves_every_step_into_previous_replacing_what_it_held(tmp_path: Path) -> None:
    write_steps(tmp_path / PREVIOUS_DIR, 1, mark="oldest ")
    write_steps(tmp_path, 40, 60)
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    assert retire(tmp_path) == tmp_path / PREVIOUS_DIR
    assert complete_steps(tmp_path) == []
    assert complete_steps(tmp_path / PREVIOUS_DIR) == [40, 60]
    assert (step_dir(tmp_path / PREVIOUS_DIR, 60) / CONTROLLER_FILE).read_text() == "60"
    assert (tmp_path / "metrics.jsonl").is_file()  # only checkpoints move
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    assert retire(tmp_path) is None  # nothing left to move: previous/ stays
    assert complete_steps(tmp_path / PREVIOUS_DIR) == [40, 60]
    assert retire(tmp_path / "absent") is None


def test_after_retire_a_new_run_keeps_its_own_checkpoints(tmp_path: Path) -> None:
    """The bug retire fixes: an earlier run's steps 40 and 60 beside a new run's step 20 made prune (keep 2)
    delete the new one as it was written."""
    write_steps(tmp_path, 40, 60)
    retire(tmp_path)
    write_steps(tmp_path, 20)
    prune(tmp_path, keep=2)
    assert complete_steps(tmp_path) == [20]


def test_own_checkpoints_come_before_resume_from(tmp_path: Path) -> None:
    own, other = tmp_path / "own", tmp_path / "other"
    write_steps(other, 2, 4)
    assert resume_source(own, None) is None
    assert resume_source(own, str(other)) == (step_dir(other, 4), False)  # a checkpoint root: its newest
    assert resume_source(own, str(step_dir(other, 2))) == (step_dir(other, 2), False)  # a step: that one
    write_steps(own, 6)
    assert resume_source(own, str(step_dir(other, 2))) == (step_dir(own, 6), True)


def test_a_resume_from_without_a_checkpoint_names_the_field(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for missing in (tmp_path / "empty", tmp_path / "absent", step_dir(tmp_path, 3)):
        with pytest.raises(NoCheckpoint, match=r"^spec\.trainer\.resumeFrom: no checkpoint at "):
            resume_source(tmp_path / "own", str(missing))


def test_preflight_names_a_resume_from_that_holds_no_checkpoint(example_doc, tmp_path: Path) -> None:
    doc = example_doc("tiny-grpo.yaml")
    doc["spec"]["trainer"] |= {"resume": "auto", "resumeFrom": str(tmp_path / "nothing")}
    (problem,) = [p for p in preflight(parse_job(doc).spec, "CPU") if "resumeFrom" in p]
    assert problem.startswith(f"spec.trainer.resumeFrom: no checkpoint at {tmp_path / 'nothing'} ")
    write_steps(tmp_path / "nothing", 2)
    assert [p for p in preflight(parse_job(doc).spec, "CPU") if "resumeFrom" in p] == []


def test_resume_from_needs_resume_auto(example_doc) -> None:
    doc = example_doc("tiny-grpo.yaml")
    doc["spec"]["trainer"] |= {"resume": "never", "resumeFrom": "/mnt/checkpoints/other"}
    with pytest.raises(SpecError, match=f"spec.trainer: {RESUME_FROM_NEEDS_AUTO}"):
        parse_job(doc)
    doc["spec"]["trainer"]["resume"] = "auto"
    assert parse_job(doc).spec.trainer.resume_from == "/mnt/checkpoints/other"
