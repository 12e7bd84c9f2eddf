"""The driver side: start or join Ray, run the Trainer as a restartable Ray actor, show progress."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import ray

from hybridflow.api.spec import RLTrainingJob
from hybridflow.control.names import RAY_NAMESPACE, controller_name, job_ref
from hybridflow.ray_errors import innermost_message
from hybridflow.workers.modeling import THREADS_ENV

log = logging.getLogger(__name__)
ProgressFn = Callable[[dict[str, Any]], None]


class TrainingFailed(RuntimeError):
    """The run could not finish; the message says why (no traceback for the user)."""


METRICS_PORT_ENV = "HYBRIDFLOW_METRICS_PORT"


def init_ray(local: bool, num_cpus: int | None = None, metrics_port: int | None = None) -> None:
    """Local runs start Ray in-process with enough logical CPUs for every role; cluster runs join it.

    A local run serves its Prometheus metrics (hybridflow.telemetry) on `metrics_port`, or on
    $HYBRIDFLOW_METRICS_PORT, else on a port Ray picks; in a cluster each Ray node serves its own.
    """
    if ray.is_initialized():
        return
    if local:
        cpus = num_cpus or max(8, os.cpu_count() or 1)
        port = metrics_port or int(os.environ.get(METRICS_PORT_ENV) or 0) or None
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=True, configure_logging=False,
                 _metrics_export_port=port,
                 runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")} | (
                     {THREADS_ENV: threads} if (threads := os.environ.get(THREADS_ENV)) else {})})
    else:
        ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), configure_logging=False)


def run_training(job: RLTrainingJob, metrics_out: str | None, on_progress: ProgressFn | None = None,
                 poll_s: float = 0.5, parallelism: int = 1, critic_parallelism: int | None = None) -> dict[str, Any]:
    """Create the controller actor (max_restarts from the spec) and drive it to the end.

    When the controller's process dies, Ray restarts it; `fit` is called again and resumes from the newest
    checkpoint. It asks for a CPU so it is never placed on a head node started with num-cpus 0. Its name
    (control.names.controller_name) lets `hybridflow.connect` find it, and makes a second run of the same
    job in the same Ray cluster fail here instead of training twice. `fit` holds one of its threads; the
    others answer progress polls and live control, so a scale request waiting for a step boundary never
    blocks a status call.
    """
    from hybridflow.trainer import Trainer  # torch is imported by the controller, not by this driver

    restarts = job.spec.trainer.worker_max_restarts
    ref = job_ref(job.metadata.name, job.metadata.namespace)
    name = controller_name(ref)
    controller_cls: Any = ray.remote(Trainer)
    try:
        ctrl = controller_cls.options(
            name=name, namespace=RAY_NAMESPACE, num_cpus=1,
            max_restarts=restarts, max_task_retries=0, max_concurrency=4,
        ).remote(job.model_dump(by_alias=True, mode="json"), metrics_out, "auto", parallelism, critic_parallelism)
    except ray.exceptions.ActorAlreadyExistsError:
        raise TrainingFailed(f"job {ref} is already running in this Ray cluster (its controller {name!r} is "
                             f"alive in Ray namespace {RAY_NAMESPACE!r}); stop it before starting it again") from None
    attempts = 0
    try:
        while True:
            done = ctrl.fit.remote()
            try:
                return _wait(ctrl, done, on_progress, poll_s)
            except ray.exceptions.RayActorError as e:
                attempts += 1
                if attempts > restarts:
                    raise TrainingFailed(f"the controller died {attempts} times: {innermost_message(e)}") from None
                log.warning("controller process lost (%s); Ray restarts it and it resumes from the newest "
                            "checkpoint (%d/%d)", innermost_message(e), attempts, restarts)
                _wait_alive(ctrl, timeout_s=120)
            except ray.exceptions.RayTaskError as e:
                raise TrainingFailed(innermost_message(e)) from None
    finally:
        with contextlib.suppress(Exception):  # already gone: Ray reclaims what it owned
            ray.get(ctrl.shutdown.remote(), timeout=60)
        ray.kill(ctrl, no_restart=True)
        _wait_released(name)


def _wait_released(name: str, timeout_s: float = 30.0) -> None:
    """Until Ray has freed the controller's name, so the same job can run again right away."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=RAY_NAMESPACE)
        except ValueError:
            return
        time.sleep(0.1)
    log.warning("the controller name %s is still taken after %.0fs", name, timeout_s)


def _wait(ctrl: Any, done: ray.ObjectRef, on_progress: ProgressFn | None, poll_s: float) -> dict[str, Any]:
    while True:
        ready, _ = ray.wait([done], timeout=poll_s)
        if ready:
            result = ray.get(done)
            if on_progress:
                on_progress({"step": result["steps"], **(result["records"][-1] if result["records"] else {})})
            return result
        if on_progress:
            with contextlib.suppress(ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
                on_progress(ray.get(ctrl.progress.remote(), timeout=poll_s * 4))


def _wait_alive(ctrl: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(ctrl.progress.remote(), timeout=5)
            return
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            time.sleep(0.5)
    raise TrainingFailed(f"the controller did not come back within {timeout_s:.0f}s")

