"""A checkpoint file system that fills up mid-write: the run must stop with one clear message, keep the
previous checkpoint intact, and resume from it once there is room.

The checkpoint path is a tmpfs of its own (mounting needs root). A first run writes step 2 on a roomy
tmpfs; the tmpfs is then shrunk to what is used plus half a checkpoint, so `hybridflow run` (the CLI, as a
user runs it) fails halfway through writing step 4; the tmpfs is then grown and the job rerun.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from benchmarks.chaos.recovery import step_counts
from benchmarks.chaos.report import recovery
from benchmarks.chaos.watch import MetricsWatch
from benchmarks.operator.summarise import rounded

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
EVERY = 2
ROOMY = 64 * 1024 * 1024
CLI_TIMEOUT_S = 600


@dataclass
class WriteFailure:
    """What each stage of the case showed."""

    checkpoint_bytes: int = 0
    """Size of one complete checkpoint directory (step 2)."""
    tight_size: int = 0
    """The tmpfs size while step 4 was written: used + half a checkpoint."""
    rc: int | None = None
    message: str = ""
    """The last line `hybridflow run` printed on stderr."""
    output_lines: int = 0
    error_lines: int = 0
    """Lines starting with `error:`: one clear message, not a cascade."""
    traceback: bool = False
    previous_intact: bool = False
    latest_after_failure: int | None = None
    leftover_staging: list[str] = field(default_factory=list)
    rerun_completed: bool = False
    resumed_from: int | None = None
    recovery_s: float | None = None
    duplicates: int = 0
    losses: int = 0
    checkpoints: list[int] = field(default_factory=list)
    unloadable: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def injected(self) -> bool:
        return self.rc not in (None, 0)

    @property
    def ok(self) -> bool:
        return (self.injected and self.message.startswith("error: checkpoint of step 4 not written")
                and self.error_lines == 1 and not self.traceback
                and self.previous_intact and self.latest_after_failure == EVERY
                and not self.leftover_staging and self.rerun_completed and self.resumed_from == EVERY
                and self.duplicates == 0 and self.losses == 0 and not self.unloadable)


def job_doc(name: str, checkpoint_path: Path, steps: int) -> dict[str, Any]:
    """The tiny GRPO job (one host per step), without evaluation, checkpointing every 2 steps."""
    doc = yaml.safe_load((ROOT / "examples" / "tiny-grpo.yaml").read_text())
    doc["metadata"]["name"] = name
    spec = doc["spec"]
    spec["data"].pop("val", None)
    spec["data"]["batchSize"] = 16
    spec["trainer"].pop("evalEvery", None)
    spec["trainer"].update(totalSteps=steps, resume="auto", checkpoint={"every": EVERY, "path": str(checkpoint_path)})
    return doc


@contextlib.contextmanager
def tmpfs(path: Path, size: int) -> Iterator[Path]:
    """A tmpfs of `size` bytes at `path`, unmounted on the way out."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True,
                   capture_output=True, text=True)
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def resize(path: Path, size: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], check=True, capture_output=True, text=True)


def used_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def digests(directory: Path) -> dict[str, str]:
    """Every file under `directory` (the sharded training state sits in subdirectories)."""
    return {str(f.relative_to(directory)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(directory.rglob("*")) if f.is_file()}


def run_cli(job_file: Path, metrics: Path) -> subprocess.CompletedProcess[str]:
    """`hybridflow run` in a process of its own (its own local Ray), as a user starts it."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "runtime"), str(ROOT)]))
    cmd = [sys.executable, "-m", "hybridflow", "run", str(job_file), "--metrics-out", str(metrics), "--quiet",
           "--num-cpus", "4"]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=CLI_TIMEOUT_S, cwd=ROOT)


def write_failure_case(work: Path, name: str = "chaos-ckpt-full") -> WriteFailure:
    """Needs a connected Ray cluster for the first run and the rerun (the failing run starts its own)."""
    from benchmarks.chaos.runtime_faults import load_all
    from hybridflow.api import parse_job
    from hybridflow.checkpoint import complete_steps, step_dir
    from hybridflow.driver import run_training

    work.mkdir(parents=True, exist_ok=True)
    out = WriteFailure()
    metrics = work / "metrics.jsonl"
    with tmpfs(work / "tmpfs", ROOMY) as mount:
        root = mount / "ckpt"
        try:
            run_training(parse_job(job_doc(name, root, EVERY)), str(metrics))
            first = step_dir(root, EVERY)
            before = digests(first)
            out.checkpoint_bytes = sum(f.stat().st_size for f in first.rglob("*") if f.is_file())
            out.tight_size = used_bytes(mount) + out.checkpoint_bytes // 2
            resize(mount, out.tight_size)

            job_file = work / "job.yaml"
            job_file.write_text(yaml.safe_dump(job_doc(name, root, STEPS)))
            done = run_cli(job_file, metrics)
            lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
            out.rc, out.message, out.output_lines = done.returncode, lines[-1] if lines else "", len(lines)
            out.error_lines = sum(ln.startswith("error:") for ln in lines)
            out.traceback = "Traceback" in done.stderr or "Traceback" in done.stdout
            out.previous_intact = first.is_dir() and digests(first) == before
            found = complete_steps(root)
            out.latest_after_failure = found[-1] if found else None
            out.leftover_staging = sorted(p.name for p in root.glob(".tmp-step_*"))

            resize(mount, used_bytes(mount) + 4 * out.checkpoint_bytes)
            watch = MetricsWatch(metrics).start()
            watch.mark_kill()  # the rerun starts now: recovery is the time to its first step
            result = run_training(parse_job(job_doc(name, root, STEPS)), str(metrics))
            watch.stop()
            out.rerun_completed = result.get("steps") == STEPS
            out.resumed_from, out.recovery_s = watch.tracker.resumed_from, watch.tracker.recovery_s
            out.duplicates, out.losses = step_counts(watch.records, STEPS)
            out.checkpoints = complete_steps(root)
            _, out.unloadable = load_all(root)
        except Exception as e:
            out.error = f"{type(e).__name__}: {e}"
    return out


def checkpoint_write_failure(work: Path) -> dict[str, Any]:
    """The campaign's row for the case (recovery: from the rerun's start to its first completed step)."""
    case = write_failure_case(work)
    samples = [round(case.recovery_s, 3)] if case.recovery_s is not None else []
    detail = asdict(case) | {"ok": case.ok, "recovery_s": rounded(case.recovery_s)}
    return {
        "kind": "checkpoint_write_failure",
        "injected": int(case.injected),
        "survived": int(case.ok),
        "duplicates": case.duplicates,
        "losses": case.losses,
        "recovery_s": recovery(samples),
        "detail": detail,
    }
