"""Checkpoint directories: written aside and renamed into place, so a directory that exists is complete.

One controller writes a directory at a time: `claim` hands it a token and every write first checks it
(`check_owner`). A controller orphaned by a lost Ray head keeps running until its raylet gives up on the
GCS; the resubmitted job's controller claims the directory and the orphan stops at its next write.

Checkpoint files hold tensors, numbers, strings, lists, tuples and dicts only, and are read back with
`torch.load(..., weights_only=True)` (`load_state`): a checkpoint directory may be on shared storage that
others can write, and a full unpickle of a planted file would run its code. The trained roles' sharded
state (fp32 weights and optimizer moments) goes through hybridflow.dcp, whose index is JSON.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

_STEP_DIR = re.compile(r"^step_(\d{8})$")
OWNER_FILE = "owner"
CONTROLLER_FILE = "controller.pt"
"""The controller's state in each checkpoint directory: step, data position, RNG, and the rank files beside it."""
PREVIOUS_DIR = "previous"
"""Where a run that starts from the spec moves the checkpoints it finds (`retire`)."""
JOB_FILE = "job.json"
"""The job that wrote the checkpoint, as JSON: what `hybridflow export` needs to rebuild the policy."""


class Superseded(RuntimeError):
    """Another controller claimed the checkpoint directory; this one must stop writing."""


class NoCheckpoint(ValueError):
    """spec.trainer.resumeFrom names no checkpoint; one line naming the field."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint file could not be written (a full or read-only file system); one line naming the file."""


def save_state(state: dict[str, Any], path: str | Path) -> None:
    """Write one checkpoint file: plain containers of tensors and primitives, nothing that needs unpickling.

    torch writes through the open file, so a failed write surfaces as the OSError of the file system
    (ENOSPC, EROFS, ...), raised here as a CheckpointWriteError naming the file.
    """
    import torch

    try:
        with open(path, "wb") as f:
            torch.save(state, f)
    except (OSError, RuntimeError) as e:
        raise CheckpointWriteError(f"cannot write checkpoint file {path}: {write_problem(e, path)}") from None


def write_problem(error: BaseException, path: str | Path) -> str:
    """Why a write to `path` failed, in words: the OS message, or a full file system torch reported in its own."""
    if isinstance(error, OSError) and error.errno is not None:
        return os.strerror(error.errno)
    try:
        if shutil.disk_usage(Path(path).parent).free == 0:
            return os.strerror(errno.ENOSPC)
    except OSError:
        pass
    lines = [ln for ln in str(error).strip().splitlines() if ln.strip()]
    return lines[-1] if lines else type(error).__name__


def load_state(path: str | Path) -> Any:
    """Read a checkpoint file without running pickled code (weights_only: tensors and primitives only)."""
    import torch

    return torch.load(path, weights_only=True)


def training_dir(directory: str | Path, rank_name: str, role: str) -> Path:
    """Where the ranks of `rank_name`'s group (`critic_3` -> `critic`) write `role`'s training state together
    (hybridflow.dcp): one directory per group and role, whatever the number of ranks."""
    return Path(directory) / "training" / rank_name.rsplit("_", 1)[0] / role


def claim(root: str | Path) -> str:
    """Make the caller the directory's writer; returns its token (written by an atomic rename)."""
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    staged = path / f".owner-{token}"
    staged.write_text(token)
    staged.rename(path / OWNER_FILE)
    return token


def check_owner(root: str | Path, token: str) -> None:
    """Raise Superseded unless `token` still holds the directory."""
    owner = Path(root) / OWNER_FILE
    found = owner.read_text().strip() if owner.is_file() else None
    if found != token:
        raise Superseded(f"another controller took over {root} (owner {found or 'removed'}); this one stops "
                         "so that two never write the same checkpoints and metrics")


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def staging_dir(root: str | Path, step: int) -> Path:
    """A fresh hidden directory beside the final one; never mistaken for a complete checkpoint."""
    path = Path(root) / f".tmp-step_{step:08d}-{uuid.uuid4().hex[:8]}"
    path.mkdir(parents=True)
    return path


def commit(staging: Path, root: str | Path, step: int) -> Path:
    """Atomic publish: rename(2) of the staged directory onto step_N."""
    final = step_dir(root, step)
    if final.exists():
        shutil.rmtree(final)
    staging.rename(final)
    return final


def complete_steps(root: str | Path) -> list[int]:
    path = Path(root)
    if not path.is_dir():
        return []
    return sorted(int(m.group(1)) for p in path.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name)))


def latest(root: str | Path) -> tuple[int, Path] | None:
    steps = complete_steps(root)
    return (steps[-1], step_dir(root, steps[-1])) if steps else None


def resolve(path: str | Path) -> Path | None:
    """A checkpoint directory as given, or the newest complete one under a checkpoint root; None when neither."""
    p = Path(path)
    if (p / CONTROLLER_FILE).is_file():
        return p
    found = latest(p)
    return found[1] if found else None


def retire(root: str | Path) -> Path | None:
    """Move root's complete checkpoints into root/previous, replacing what it held; returns it, None when there
    were none.

    A run that starts from the spec would otherwise count an earlier run's checkpoints as its own: `prune` keeps
    the newest steps, theirs, and drops its own as it writes them, and a recovery restores theirs.
    """
    steps = complete_steps(root)
    if not steps:
        return None
    staging = Path(root) / f".tmp-{PREVIOUS_DIR}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    for step in steps:
        step_dir(root, step).rename(staging / step_dir(root, step).name)
    previous = Path(root) / PREVIOUS_DIR
    if previous.exists():
        shutil.rmtree(previous)
    staging.rename(previous)
    return previous


def resume_source(own: str | Path, resume_from: str | None) -> tuple[Path, bool] | None:
    """Where a run (re)starts when it resumes: its own newest checkpoint (True), else resume_from's (False).

    Its own come first so that a restart goes on from what the run trained, not from where it began; a
    resume_from that holds no checkpoint is a NoCheckpoint naming spec.trainer.resumeFrom.
    """
    found = latest(own)
    if found is not None:
        return found[1], True
    return None if resume_from is None else (find_resume_from(resume_from), False)


def find_resume_from(resume_from: str) -> Path:
    """spec.trainer.resumeFrom's checkpoint (checkpoint.resolve), or a NoCheckpoint naming the field."""
    source = resolve(resume_from)
    if source is None:
        raise NoCheckpoint(f"spec.trainer.resumeFrom: no checkpoint at {resume_from} (give a step_N directory "
                           f"holding {CONTROLLER_FILE}, or a checkpoint.path holding step_N directories)")
    return source


def prune(root: str | Path, keep: int) -> None:
    """Keep the newest `keep` checkpoints and drop abandoned staging directories."""
    for step in complete_steps(root)[:-keep]:
        shutil.rmtree(step_dir(root, step), ignore_errors=True)
    for p in Path(root).glob(".tmp-step_*"):
        shutil.rmtree(p, ignore_errors=True)
