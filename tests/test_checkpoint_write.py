"""Checkpoint files that cannot be written: one line naming the file and the reason, nothing half-kept."""

from __future__ import annotations

import pytest
import torch

from hybridflow.checkpoint import CheckpointWriteError, load_state, save_state


def test_a_full_device_gives_one_line_naming_the_file_and_the_reason() -> None:
    with pytest.raises(CheckpointWriteError) as info:
        save_state({"w": torch.zeros(100_000)}, "/dev/full")
    message = str(info.value)
    assert message == "cannot write checkpoint file /dev/full: No space left on device"
    assert "\n" not in message


def test_a_missing_directory_is_named_too(tmp_path) -> None:
    with pytest.raises(CheckpointWriteError, match="No such file or directory"):
        save_state({"w": torch.zeros(3)}, tmp_path / "absent" / "x.pt")


def test_a_written_file_loads_back(tmp_path) -> None:
    save_state({"w": torch.arange(4), "step": 3}, tmp_path / "x.pt")
    back = load_state(tmp_path / "x.pt")
    assert back["step"] == 3 and torch.equal(back["w"], torch.arange(4))


def test_the_trainer_names_what_failed_in_a_checkpoint_write() -> None:
    """A worker's CheckpointWriteError and the controller's own OSError read the same; a lost worker is no
    write failure (the loop recovers from it)."""
    import errno

    import ray

    from hybridflow.trainer import _write_failure

    worker = CheckpointWriteError("cannot write checkpoint file /c/.tmp/actor_rollout_0.pt: No space left on device")
    assert _write_failure(worker) == str(worker)
    assert _write_failure(ray.exceptions.RayTaskError("save", "tb", worker)) == str(worker)
    own = OSError(errno.ENOSPC, "No space left on device", "/c/.tmp/job.json")
    assert _write_failure(own) == "cannot write /c/.tmp/job.json: No space left on device"
    assert _write_failure(ray.exceptions.ActorDiedError()) is None


def test_a_sharded_write_that_fails_gives_one_line_naming_the_directory(tmp_path) -> None:
    """DCP gathers each rank's failure into an exception of its own; it reads as the other write failures."""
    from hybridflow import dcp

    (tmp_path / "ck" / "__0_0.distcp").mkdir(parents=True)  # where the rank's file must go
    with pytest.raises(CheckpointWriteError) as info:
        dcp.save({"w": torch.zeros(8)}, tmp_path / "ck")
    assert str(info.value) == f"cannot write checkpoint files in {tmp_path / 'ck'}: Is a directory"
