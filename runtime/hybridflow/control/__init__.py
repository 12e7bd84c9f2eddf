"""Live control of a running job from outside it: its named controller, `connect`, and the CLI's `ctl`."""

from hybridflow.control.client import JobHandle, SchedulerHandle, connect
from hybridflow.control.errors import ControlError
from hybridflow.control.names import RAY_NAMESPACE, JobRef, controller_name, job_ref

__all__ = ["RAY_NAMESPACE", "ControlError", "JobHandle", "JobRef", "SchedulerHandle", "connect", "controller_name",
           "job_ref"]
