"""`hybridflow.connect`: a handle on a running job's controller, found by name in a Ray cluster.

Ray is imported when connecting, not when this module is: the operator and the CLI's other commands
import hybridflow without it.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from hybridflow.control.errors import ControlError
from hybridflow.control.names import RAY_NAMESPACE, JobRef, controller_name, job_ref

DEFAULT_TIMEOUT_S = 600.0


def default_address() -> str:
    return os.environ.get("RAY_ADDRESS") or "auto"


class SchedulerHandle:
    """The running job's scheduler, as seen from outside: status and parallelism."""

    def __init__(self, job: JobHandle) -> None:
        self._job = job

    def get_status(self) -> dict[str, Any]:
        """Step, nodes (parallelism, workers), edges, decisions, and what was asked for (`manual`)."""
        return dict(self._job.call("control_status", timeout_s=60.0))

    def adjust_parallelism(self, node: str, n: int, reason: str = "") -> int:
        """Set `node`'s parallelism at the job's next step boundary; returns the parallelism now in effect.

        Raises ControlError, with nothing changed, for an unknown node, a node whose parallelism cannot
        change, or resources the cluster lacks.
        """
        return int(self._job.scale(node, n, reason)["parallelism"])

    def disable_ulysses(self, reason: str = "") -> dict[str, Any]:
        """Turn sequence parallelism off at the next step boundary, without a restart: the ranks of every trained
        node that had it (actor, critic) go on as plain data parallelism over whole sequences. Returns
        {changes: [{node, old, sequence_parallel, ranks}, ...]}; raises ControlError when it is not on."""
        return self._job.disable_ulysses(reason)


class JobHandle:
    """A running job's controller actor; `scheduler` is what the design's live API names."""

    def __init__(self, ref: JobRef, address: str, actor: Any, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.ref = ref
        self.address = address
        self.timeout_s = timeout_s
        self._actor = actor
        self.scheduler = SchedulerHandle(self)

    def __repr__(self) -> str:
        return f"JobHandle({str(self.ref)!r}, address={self.address!r})"

    def scale(self, node: str, n: int, reason: str = "") -> dict[str, Any]:
        """`scheduler.adjust_parallelism` with the whole outcome: {node, old, parallelism, colocated}."""
        return dict(self.call("control_scale", node, int(n), reason, self.timeout_s, timeout_s=self.timeout_s + 60.0))

    def disable_ulysses(self, reason: str = "") -> dict[str, Any]:
        """`scheduler.disable_ulysses`."""
        return dict(self.call("control_disable_ulysses", reason, self.timeout_s, timeout_s=self.timeout_s + 60.0))

    def call(self, method: str, *args: Any, timeout_s: float) -> Any:
        """One remote call; Ray's errors become a ControlError naming the job."""
        import ray

        try:
            return ray.get(getattr(self._actor, method).remote(*args), timeout=timeout_s)
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if isinstance(e.cause, BaseException) else None
            if isinstance(cause, ControlError):
                raise ControlError(str(cause)) from None
            raise ControlError(f"job {self.ref}: {_last_line(cause or e)}") from None
        except ray.exceptions.GetTimeoutError:
            raise ControlError(f"job {self.ref} did not answer {method} within {timeout_s:g}s") from None
        except ray.exceptions.RayActorError as e:
            raise ControlError(f"the controller of job {self.ref} is gone or restarting "
                               f"({_last_line(e)}); try again") from None


def connect(job: str, address: str | None = None, namespace: str | None = None,
            timeout_s: float = DEFAULT_TIMEOUT_S) -> JobHandle:
    """A handle on the running job `job` (NAME or NAMESPACE/NAME) in the Ray cluster at `address`.

    Joins that cluster unless this process is already connected to one. Raises ControlError naming
    the job and the address when the cluster cannot be reached or the job does not run there.
    """
    try:
        ref = job_ref(job, namespace)
    except ValueError as e:
        raise ControlError(str(e)) from None
    import ray

    address = address or default_address()
    if not ray.is_initialized():
        unreachable = _unreachable(address)
        if unreachable:
            raise ControlError(f"cannot reach a Ray cluster at {address}: {unreachable}")
        try:
            ray.init(address=address, namespace=RAY_NAMESPACE, logging_level=logging.ERROR,
                     log_to_driver=False, configure_logging=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise ControlError(f"cannot reach a Ray cluster at {address}: {_last_line(e)}") from None
    name = controller_name(ref)
    try:
        actor = ray.get_actor(name, namespace=RAY_NAMESPACE)
    except ValueError:
        raise ControlError(f"job {ref} is not running in the Ray cluster at {address} "
                           f"(no actor {name!r} in Ray namespace {RAY_NAMESPACE!r})") from None
    return JobHandle(ref, address, actor, timeout_s)


def _unreachable(address: str, timeout_s: float = 5.0) -> str | None:
    """Why a HOST:PORT address refuses a TCP connection, or None; Ray itself would retry for minutes."""
    host, sep, port = address.rpartition(":")
    if not sep or "://" in address or not port.isdigit():
        return None
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        return e.strerror or str(e)
    return None


def _last_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return lines[-1] if lines else type(e).__name__
