"""status.progress reporting: throttled, shaped like the CRD's status, and never fatal."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

import pytest

from hybridflow import reporting
from hybridflow.api import RLTrainingJobStatus
from hybridflow.reporting import ProgressReporter, progress_patch


def test_patch_touches_only_progress_in_camel_case() -> None:
    body = progress_patch(3, 10, {"reward_mean": 0.5, "kl": 0.01, "tokens_per_s": 1200.0}, "/ckpt/step_3",
                          now=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC))
    assert list(body) == ["status"] and list(body["status"]) == ["progress"]
    progress = body["status"]["progress"]
    assert progress == {"step": 3, "totalSteps": 10, "rewardMean": 0.5, "kl": 0.01, "tokensPerSecond": 1200.0,
                        "lastCheckpoint": "/ckpt/step_3", "updatedAt": "2026-01-02T03:04:05Z"}
    assert RLTrainingJobStatus.model_validate(body["status"]).progress.step == 3


def test_the_val_reward_of_the_last_evaluation_is_reported_as_val_reward_mean() -> None:
    body = progress_patch(8, 10, {"reward_mean": 0.5, "val/reward_mean": 0.75, "val/samples": 200.0}, None,
                          now=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC))
    progress = body["status"]["progress"]
    assert progress["valRewardMean"] == 0.75 and progress["rewardMean"] == 0.5
    assert RLTrainingJobStatus.model_validate(body["status"]).progress.val_reward_mean == 0.75
    assert "valRewardMean" not in progress_patch(9, 10, {"reward_mean": 0.5}, None)["status"]["progress"]


def test_reports_are_throttled_but_the_last_one_is_forced() -> None:
    sent = []
    r = ProgressReporter("job", "ns", lambda ns, name, body: sent.append((ns, name, body)), interval_s=3600)
    assert r.report(1, 5, {}, None)
    assert not r.report(2, 5, {}, None)
    assert r.report(5, 5, {}, None, force=True)
    assert [b["status"]["progress"]["step"] for _, _, b in sent] == [1, 5]
    assert sent[0][:2] == ("ns", "job")


def test_a_failing_patch_never_raises() -> None:
    def broken(ns: str, name: str, body: dict) -> None:
        raise ConnectionError("apiserver unreachable")

    r = ProgressReporter("job", "ns", broken, interval_s=0)
    assert not r.report(1, 5, {"reward_mean": 0.1}, None)
    assert not r.report(2, 5, {"reward_mean": 0.1}, None)
    assert r.failures == 2


def test_inactive_outside_a_cluster(monkeypatch) -> None:
    monkeypatch.delenv("HYBRIDFLOW_JOB_NAME", raising=False)
    assert ProgressReporter.from_env() is None


@pytest.mark.parametrize(("value", "interval"), [(None, 5.0), ("0.5", 0.5), ("soon", 5.0)])
def test_the_interval_is_the_one_the_operator_set_in_the_pod(monkeypatch, caplog, value, interval) -> None:
    """A value the operator would have refused (a pod edited by hand) is named in a warning; training goes on at
    the default rate."""
    monkeypatch.setenv("HYBRIDFLOW_JOB_NAME", "job")
    if value is None:
        monkeypatch.delenv("HYBRIDFLOW_PROGRESS_INTERVAL", raising=False)
    else:
        monkeypatch.setenv("HYBRIDFLOW_PROGRESS_INTERVAL", value)
    monkeypatch.setattr(reporting, "kubernetes_patcher", lambda: lambda ns, name, body: None)  # no API server here
    with caplog.at_level(logging.WARNING, logger=reporting.log.name):
        r = ProgressReporter.from_env()
    assert r is not None and r.interval_s == interval
    assert ("HYBRIDFLOW_PROGRESS_INTERVAL must be a positive number, got 'soon'" in caplog.text) == (value == "soon")


def test_the_job_of_a_pod_comes_from_the_variables_the_operator_sets() -> None:
    """What the reporter and the driver's dashboard both read to know they run in a pod of the job."""
    from hybridflow.k8s import contract

    assert contract.job_from_env({}) is None
    assert contract.job_from_env({contract.ENV_JOB_NAME: ""}) is None
    assert contract.job_from_env({contract.ENV_JOB_NAME: "ppo"}) == ("default", "ppo")
    assert contract.job_from_env({contract.ENV_JOB_NAME: "ppo", contract.ENV_JOB_NAMESPACE: "team-a"}) \
        == ("team-a", "ppo")
