"""status.progress of the RLTrainingJob, patched from inside the cluster; reporting never stops training."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from hybridflow.api.spec import API_GROUP, API_VERSION, PLURAL
from hybridflow.api.status import Progress
from hybridflow.k8s import contract
from hybridflow.k8s.settings import SettingsError, progress_interval_from_env

log = logging.getLogger(__name__)
Patcher = Callable[[str, str, dict[str, Any]], None]


def progress_patch(step: int, total_steps: int, metrics: dict[str, Any], last_checkpoint: str | None,
                   now: datetime | None = None) -> dict[str, Any]:
    """The merge patch for the status subresource: only `progress`, so conditions stay the operator's."""
    progress = Progress(
        step=step, total_steps=total_steps, reward_mean=metrics.get("reward_mean"), kl=metrics.get("kl"),
        tokens_per_second=metrics.get("tokens_per_s"), val_reward_mean=metrics.get("val/reward_mean"),
        last_checkpoint=last_checkpoint,
        updated_at=contract.timestamp(now),
    )
    return {"status": {"progress": progress.model_dump(by_alias=True, exclude_none=True)}}


def kubernetes_patcher() -> Patcher:
    """Patch through the in-cluster service account (or KUBECONFIG outside a pod)."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    api = client.CustomObjectsApi()

    def patch(namespace: str, name: str, body: dict[str, Any]) -> None:
        api.patch_namespaced_custom_object_status(API_GROUP, API_VERSION, namespace, PLURAL, name, body)

    return patch


class ProgressReporter:
    """Throttled to one patch per `interval_s`; the last step is always sent."""

    def __init__(self, name: str, namespace: str, patcher: Patcher,
                 interval_s: float = contract.DEFAULT_PROGRESS_INTERVAL) -> None:
        self.name, self.namespace, self.patcher, self.interval_s = name, namespace, patcher, interval_s
        self._last: float | None = None
        self.failures = 0

    @classmethod
    def from_env(cls) -> ProgressReporter | None:
        """Active when HYBRIDFLOW_JOB_NAME is set (the operator sets it in every pod)."""
        found = contract.job_from_env()
        if found is None:
            return None
        namespace, name = found
        try:
            interval = progress_interval_from_env(os.environ)
        except SettingsError as e:  # the operator checked it: a pod edited by hand, say
            log.warning("%s; patching status.progress every %gs", e, contract.DEFAULT_PROGRESS_INTERVAL)
            interval = contract.DEFAULT_PROGRESS_INTERVAL
        try:
            return cls(name, namespace, kubernetes_patcher(), interval)
        except Exception as e:  # no credentials: train anyway
            log.warning("progress reporting disabled: %s", e)
            return None

    def report(self, step: int, total_steps: int, metrics: dict[str, Any], last_checkpoint: str | None,
               force: bool = False) -> bool:
        now = time.monotonic()
        if not force and self._last is not None and now - self._last < self.interval_s:
            return False
        self._last = now
        try:
            self.patcher(self.namespace, self.name, progress_patch(step, total_steps, metrics, last_checkpoint))
            return True
        except Exception as e:  # a failed report must never stop training
            self.failures += 1
            log.warning("could not report progress of %s/%s: %s", self.namespace, self.name, e)
            return False
