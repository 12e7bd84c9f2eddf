"""Experiment trackers: each step's record, under verl's metric names, to the console, tensorboard, mlflow or wandb.

The step record (metrics.jsonl) keeps its flat keys; `tracker_name` is the one mapping from those keys to the
namespaced names every tracker shows (`kl` -> `actor/kl`, `critic_loss` -> `critic/value_loss`), so a
researcher coming from verl finds the same panels. The tracker packages are optional extras, imported only by
the backend that needs them; `missing_extras` names the extra to install before a run starts.
"""

from __future__ import annotations

import importlib.util
import logging
import netrc
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from hybridflow.api.spec import RLTrainingJob

log = logging.getLogger(__name__)

# backend -> (module it imports, hybridflow extra that installs it)
EXTRAS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "mlflow": ("mlflow", "mlflow"),
    "wandb": ("wandb", "wandb"),
}
# The backends the Trainer feeds (console is the driver's progress bar, jsonl the Trainer's MetricsLog).
TRACKERS = tuple(EXTRAS)

NAMES: dict[str, str] = {
    "reward_mean": "rollout/reward_mean",
    "reward_max": "rollout/reward_max",
    "reward_baseline_mean": "rollout/reward_baseline_mean",
    "response_length": "rollout/response_length",
    "kl": "actor/kl",
    "kl_coef": "actor/kl_coef",
    "actor_loss": "actor/pg_loss",
    "entropy": "actor/entropy",
    "clip_frac": "actor/pg_clipfrac",
    "cov_frac": "actor/cov_frac",
    "behaviour_weight_mean": "actor/behaviour_weight_mean",
    "rollout_kl": "rollout_corr/kl",
    "rollout_weight_mean": "rollout_corr/weight_mean",
    "rollout_weight_cut_frac": "rollout_corr/weight_cut_frac",
    "rollout_weight_norm_factor": "rollout_corr/weight_norm_factor",
    "rollout_rejected_frac": "rollout_corr/rs_masked_fraction",
    "rollout_rejected_seq_frac": "rollout_corr/rs_seq_masked_fraction",
    "kl_loss": "actor/kl_loss",
    "actor_grad_norm": "actor/grad_norm",
    "actor_lr": "actor/lr",
    "actor_trainable_params": "actor/trainable_params",
    "actor_total_params": "actor/total_params",
    "actor_optimizer_state_bytes": "actor/optimizer_state_bytes",
    "actor_model_bytes": "actor/model_bytes",
    "critic_loss": "critic/value_loss",
    "critic_grad_norm": "critic/grad_norm",
    "critic_lr": "critic/lr",
    "critic_model_bytes": "critic/model_bytes",
    "value_mean": "critic/value_mean",
    "advantage_abs_mean": "critic/advantage_abs_mean",
    "tokens_per_s": "perf/tokens_per_s",
    "orchestration_overhead_frac": "perf/orchestration_overhead_frac",
    "shard_tokens_max_over_mean": "perf/shard_tokens_max_over_mean",
    "policy_version": "training/policy_version",
    "policy_lag": "training/policy_lag",
    "weight_sync_bytes": "perf/weight_sync_bytes",
}
"""Flat record keys and their tracker names; verl puts advantages and values under critic/ for GRPO too."""


def tracker_name(key: str) -> str:
    """The namespaced name of a record key: keys that already have a namespace keep it, unknown ones go to train/."""
    if "/" in key:
        return key
    return NAMES.get(key, f"train/{key}")


def namespaced(record: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a step record under tracker names; `step` is the x-axis, not a metric."""
    return {tracker_name(k): float(v) for k, v in record.items()
            if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)}


class Tracker(Protocol):
    """One destination of the per-step metrics, and of spec.trainer.loggers.valGenerations' tables."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...
    def log_samples(self, step: int, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None: ...
    def close(self) -> None: ...


GENERATIONS = "val/generations"
"""The tracker name of the table of an evaluation's first responses."""
SAMPLE_COLUMNS = ("prompt", "response", "answer", "score")


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (tensorboard renders its text as Markdown); pipes and newlines in a cell are escaped."""
    def cell(v: Any) -> str:
        return str(v).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows])


class TrackerUnavailable(RuntimeError):
    """A chosen backend's package is not installed; the message names the extra."""


def missing_extras(backends: Iterable[str]) -> list[str]:
    """A problem line for each chosen backend whose package is absent (found without importing it)."""
    problems = []
    for backend in backends:
        if backend in EXTRAS:
            module, extra = EXTRAS[backend]
            if importlib.util.find_spec(module) is None:
                problems.append(f"spec.trainer.loggers.backends: {backend!r} needs the {module} package: "
                                f"pip install 'hybridflow[{extra}]' (or 'hybridflow[trackers]' for all)")
    return problems


def tracker_dir(job: RLTrainingJob, metrics_out: str | Path | None) -> Path:
    """spec.trainer.loggers.dir, else the metrics file's directory, else runs/<job name>."""
    chosen = job.spec.trainer.loggers.dir
    if chosen:
        return Path(chosen)
    if metrics_out:
        return Path(metrics_out).parent
    return Path("runs") / job.metadata.name


def experiment_name(job: RLTrainingJob) -> str:
    return job.spec.trainer.loggers.experiment or job.metadata.name


class ConsoleTracker:
    """The progress bar of `hybridflow run`, with the live reward and KL; a step back (a rollback) resets it."""

    def __init__(self, total_steps: int | None) -> None:
        """`total_steps` None: not known yet (trainer.totalEpochs), until the first progress gives it."""
        from tqdm import tqdm

        self.bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        total = metrics.get(tracker_name("total_steps"))
        if total is not None and int(total) != self.bar.total:  # totalEpochs: counted as the data loads
            self.bar.total = int(total)
        if step > self.bar.n:
            self.bar.update(step - self.bar.n)
        elif step < self.bar.n:
            self.bar.reset(total=self.bar.total)
            self.bar.update(step)
        shown = {"reward": "rollout/reward_mean", "kl": "actor/kl", "val": "val/reward_mean"}
        post = {label: f"{metrics[name]:.3f}" for label, name in shown.items() if name in metrics}
        if post:
            self.bar.set_postfix(post, refresh=False)

    def log_samples(self, step: int, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        """Not on the progress bar: validationDataDir writes them where a terminal can read them."""

    def close(self) -> None:
        self.bar.close()


class TensorBoardTracker:
    """Event files under <dir>/tb/<project>/<experiment>; `first_step` purges what an earlier run left past it."""

    def __init__(self, log_dir: Path, first_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=first_step)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def log_samples(self, step: int, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        self.writer.add_text(GENERATIONS, markdown_table(columns, rows), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class MlflowTracker:
    """One mlflow run (named after the experiment) in the experiment named after the project.

    The store is MLFLOW_TRACKING_URI when set (a server, a database), else a file store under <dir>/mlruns.
    MLflow 3 refuses a file store unless MLFLOW_ALLOW_FILE_STORE is set, so it is set for that default.
    """

    def __init__(self, tracking_uri: str | None, project: str, experiment: str, config: Mapping[str, Any],
                 store_dir: Path) -> None:
        if not tracking_uri:
            store_dir.mkdir(parents=True, exist_ok=True)
            tracking_uri = store_dir.resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        self.tracking_uri = tracking_uri
        self.client = MlflowClient(tracking_uri=tracking_uri)
        found = self.client.get_experiment_by_name(project)
        experiment_id = found.experiment_id if found else self.client.create_experiment(project)
        self.run_id: str = self.client.create_run(experiment_id, run_name=experiment).info.run_id
        self.client.log_dict(self.run_id, dict(config), "spec.json")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self._metric(k, v, now, step) for k, v in metrics.items()])

    def log_samples(self, step: int, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        """An artifact per evaluation, in the shape mlflow's log_table writes (columns, data)."""
        self.client.log_dict(self.run_id, {"columns": list(columns), "data": [list(r) for r in rows]},
                             f"{GENERATIONS}/step_{step:08d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class WandbTracker:
    """A wandb run; offline (files under <dir>/wandb, for `wandb sync`) when WANDB_MODE=offline or no API key."""

    def __init__(self, project: str, experiment: str, config: Mapping[str, Any], run_dir: Path) -> None:
        import wandb

        run_dir.mkdir(parents=True, exist_ok=True)
        mode = os.environ.get("WANDB_MODE") or ("online" if wandb_api_key_present() else "offline")
        if mode == "offline" and not os.environ.get("WANDB_MODE"):
            log.warning("wandb: no API key (WANDB_API_KEY or `wandb login`), logging offline to %s", run_dir)
        options: dict[str, Any] = {"project": project, "name": experiment, "dir": str(run_dir), "config": dict(config),
                                   "mode": mode, "reinit": "create_new"}
        self.run = wandb.init(**options, settings=wandb.Settings(console="off", silent=True, x_disable_stats=True))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def log_samples(self, step: int, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        import wandb

        self.run.log({GENERATIONS: wandb.Table(columns=list(columns), data=[list(r) for r in rows])}, step=step)

    def close(self) -> None:
        self.run.finish()


def wandb_api_key_present() -> bool:
    """WANDB_API_KEY, or the credentials `wandb login` wrote to ~/.netrc for the wandb host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


class TrackerSet:
    """Every open tracker, fed the namespaced record of each step; a failing tracker never stops training.

    A tracker that raises is warned about once and still called on later steps (a network tracker may recover).
    After a rollback the Trainer sends the replayed steps again: tensorboard and mlflow then hold two values for
    those steps (a restarted controller purges tensorboard's), wandb drops steps below its last one.
    """

    def __init__(self, trackers: Mapping[str, Tracker]) -> None:
        self.trackers = dict(trackers)
        self.failed: set[str] = set()

    def __bool__(self) -> bool:
        return bool(self.trackers)

    def log_record(self, record: Mapping[str, Any]) -> None:
        self.log(int(record["step"]), namespaced(record))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for name, tracker in self.trackers.items():
            self._guard(name, "log", lambda t=tracker: t.log(step, metrics))

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        """The SAMPLE_COLUMNS of `samples` (samples.sample_rows) as a table, to every tracker."""
        rows = [[s[c] for c in SAMPLE_COLUMNS] for s in samples]
        for name, tracker in self.trackers.items():
            self._guard(name, "log samples", lambda t=tracker: t.log_samples(step, SAMPLE_COLUMNS, rows))

    def close(self) -> None:
        for name, tracker in self.trackers.items():
            self._guard(name, "close", tracker.close)
        self.trackers = {}

    def _guard(self, name: str, action: str, call: Any) -> None:
        try:
            call()
        except Exception as e:
            if name not in self.failed:
                self.failed.add(name)
                log.warning("tracker %s failed to %s (training goes on; warned once): %s: %s", name, action,
                            type(e).__name__, e)


def open_trackers(job: RLTrainingJob, backends: Iterable[str], metrics_out: str | Path | None = None,
                  first_step: int = 1) -> TrackerSet:
    """The trackers of spec.trainer.loggers that are among `backends` (the Trainer opens TRACKERS, the CLI
    console). An absent package raises TrackerUnavailable naming the extra, before anything is opened; a
    tracker that fails to open (a server down) is warned about and left out, and training goes on."""
    loggers = job.spec.trainer.loggers
    chosen = [b for b in loggers.backends if b in set(backends)]
    missing = missing_extras(chosen)
    if missing:
        raise TrackerUnavailable("; ".join(missing))
    root, experiment = tracker_dir(job, metrics_out), experiment_name(job)
    config = job.spec.model_dump(by_alias=True, mode="json")
    opened: dict[str, Tracker] = {}
    for backend in chosen:
        try:
            opened[backend] = _open(backend, job, root, experiment, config, first_step)
        except Exception as e:
            log.warning("tracker %s could not start (training goes on without it): %s: %s", backend,
                        type(e).__name__, e)
    return TrackerSet(opened)


def _open(backend: str, job: RLTrainingJob, root: Path, experiment: str, config: dict[str, Any],
          first_step: int) -> Tracker:
    project = job.spec.trainer.loggers.project
    if backend == "console":
        return ConsoleTracker(None if job.spec.trainer.total_epochs else job.spec.trainer.total_steps)
    if backend == "tensorboard":
        return TensorBoardTracker(root / "tb" / project / experiment, first_step)
    if backend == "mlflow":
        return MlflowTracker(os.environ.get("MLFLOW_TRACKING_URI"), project, experiment, config, root / "mlruns")
    if backend == "wandb":
        return WandbTracker(project, experiment, config, root)
    raise ValueError(f"no tracker for backend {backend!r}")
