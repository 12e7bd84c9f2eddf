"""Status of an RLTrainingJob: metav1.Condition-shaped conditions (kstatus) plus mirrored KubeRay state."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from hybridflow.api.base import ApiModel

ConditionType = Literal["Ready", "Reconciling", "Stalled", "Succeeded", "Failed", "Suspended"]
CONDITION_TYPES: tuple[str, ...] = ("Ready", "Reconciling", "Stalled", "Succeeded", "Failed", "Suspended")


class Condition(ApiModel):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", max_length=1024)
    message: str = Field("", max_length=32768)
    last_transition_time: str
    observed_generation: int | None = Field(None, ge=0)


class Progress(ApiModel):
    """Written by the runtime while it trains."""

    step: int = Field(0, ge=0)
    total_steps: int = Field(0, ge=0)
    reward_mean: float | None = None
    kl: float | None = None
    tokens_per_second: float | None = None
    val_reward_mean: float | None = None
    """Mean reward on spec.data.val at the last evaluation."""
    last_checkpoint: str | None = None
    updated_at: str | None = None


class RLTrainingJobStatus(ApiModel):
    observed_generation: int = Field(0, ge=0)
    """The generation the operator last applied. The API server shows a job nobody has observed yet with
    0, so kstatus and Argo CD read it as in progress from the moment it is created."""
    conditions: list[Condition] = Field(default_factory=list)
    phase: str | None = None
    """Short summary for `kubectl get`: Pending, Running, Suspended, Succeeded, Failed, Stalled."""
    ray_job_name: str | None = None
    ray_cluster_name: str | None = None
    dashboard_url: str | None = None
    """Ray's dashboard (the RayJob's dashboardURL)."""
    scheduler_dashboard_url: str | None = None
    """hybridflow's live scheduler dashboard, served by the driver on the Ray head while the job runs."""
    job_deployment_status: str | None = None
    job_status: str | None = None
    start_time: str | None = None
    completion_time: str | None = None
    restarts: int = 0
    progress: Progress | None = None
