"""The operator's pure status computation: RayJob + pods + render error -> RLTrainingJob status."""

from __future__ import annotations

import copy

import pytest
import yaml

from hybridflow.api import CONDITION_TYPES, Condition, RLTrainingJobStatus
from hybridflow.k8s import contract
from hybridflow.k8s.names import GENERATION_ANNOTATION
from hybridflow.k8s.render import render_children
from hybridflow.k8s.settings import RenderSettings
from hybridflow_operator.status import compute_status, status_changed, transitions, unschedulable
from tests.conftest import EXAMPLES

T0 = "2025-01-01T00:00:00Z"
T1 = "2025-01-01T00:05:00Z"
T2 = "2025-01-01T00:10:00Z"


def job(generation: int = 1, status: dict | None = None, suspend: bool = False, queue: str | None = None) -> dict:
    cluster = {"queueName": queue} if queue else {}
    return {
        "apiVersion": "hybridflow.io/v1alpha1",
        "kind": "RLTrainingJob",
        "metadata": {"name": "ppo", "namespace": "ns", "generation": generation, "uid": "u1"},
        "spec": {"runPolicy": {"suspend": suspend}, "cluster": cluster},
        **({"status": status} if status is not None else {}),
    }


def rayjob(deployment: str = "", job_status: str = "", applied: int | None = 1, suspend: bool = False,
           **status: object) -> dict:
    annotations = {GENERATION_ANNOTATION: str(applied)} if applied is not None else {}
    body = {"jobDeploymentStatus": deployment, "jobStatus": job_status, **status}
    return {"apiVersion": "ray.io/v1", "kind": "RayJob",
            "metadata": {"name": "ppo", "namespace": "ns", "annotations": annotations},
            "spec": {"suspend": suspend}, "status": {k: v for k, v in body.items() if v}}


def rendered_rayjob(deployment: str, **status: object) -> tuple[dict, dict]:
    """(the job, its RayJob as the operator renders it, with this status): examples/tiny-ppo-job.yaml in team-a."""
    job = yaml.safe_load((EXAMPLES / "tiny-ppo-job.yaml").read_text())
    job["metadata"].update(namespace="team-a", generation=1, uid="u1")
    rj = next(c for c in render_children(job, RenderSettings()) if c["kind"] == "RayJob")
    rj["status"] = {"jobDeploymentStatus": deployment, **status}
    return job, rj


def pod(name: str, phase: str = "Pending", message: str | None = None) -> dict:
    conditions = []
    if message is not None:
        conditions.append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message})
    return {"metadata": {"name": name}, "status": {"phase": phase, "conditions": conditions}}


def conds(status: dict) -> dict[str, dict]:
    return {c["type"]: c for c in status["conditions"]}


def states(status: dict) -> dict[str, str]:
    return {t: c["status"] for t, c in conds(status).items()}


def test_conditions_are_the_whole_list_in_metav1_shape() -> None:
    status = compute_status(job(), rayjob("Running", "RUNNING"), [], T0, None)
    assert [c["type"] for c in status["conditions"]] == list(CONDITION_TYPES)
    for c in status["conditions"]:
        Condition.model_validate(c)  # the API's model of a condition (CamelCase reason, ...)
        assert c["observedGeneration"] == 1 and c["lastTransitionTime"] == T0


@pytest.mark.parametrize("deployment", ["", "Running", "Complete", "Failed", "Suspended"])
def test_the_patch_fits_the_api_status_model(deployment: str) -> None:
    """Field names are the status model's (the CRD schema is generated from it and prunes others)."""
    rj = rayjob(deployment, rayClusterName="c", dashboardURL="d:8265", startTime=T0, failed=1)
    patch = compute_status(job(), rj, [], T1, None)
    RLTrainingJobStatus.model_validate({k: v for k, v in patch.items() if v is not None})
    assert patch["dashboardUrl"] == "d:8265"
    _, rendered = rendered_rayjob(deployment, rayClusterName="c", dashboardURL="d:8265", startTime=T0, failed=1)
    patch = compute_status(job(), rendered, [], T1, None)
    assert RLTrainingJobStatus.model_validate({k: v for k, v in patch.items() if v is not None}) \
        .scheduler_dashboard_url == patch["schedulerDashboardUrl"]


def test_progress_is_never_part_of_the_patch() -> None:
    previous = {"progress": {"step": 3, "totalSteps": 10}}
    assert "progress" not in compute_status(job(status=previous), rayjob("Running"), [], T0, None)


def test_before_the_rayjob_exists_it_is_reconciling() -> None:
    status = compute_status(job(), None, None, T0, None)
    assert states(status) == {"Ready": "False", "Reconciling": "True", "Stalled": "False",
                              "Succeeded": "False", "Failed": "False", "Suspended": "False"}
    assert status["phase"] == "Pending"
    assert status["observedGeneration"] is None and status["rayJobName"] is None


@pytest.mark.parametrize(("deployment", "job_status", "phase", "expected"), [
    ("", "", "Pending", {"Ready": "False", "Reconciling": "True", "Stalled": "False"}),
    ("Initializing", "PENDING", "Pending", {"Ready": "False", "Reconciling": "True", "Stalled": "False"}),
    ("Running", "RUNNING", "Running", {"Ready": "True", "Reconciling": "False", "Stalled": "False",
                                       "Succeeded": "False", "Failed": "False"}),
    ("Complete", "SUCCEEDED", "Succeeded", {"Ready": "True", "Reconciling": "False", "Stalled": "False",
                                            "Succeeded": "True", "Failed": "False"}),
    ("Complete", "STOPPED", "Failed", {"Ready": "False", "Succeeded": "False", "Failed": "True",
                                       "Stalled": "True"}),
    ("Failed", "FAILED", "Failed", {"Ready": "False", "Reconciling": "False", "Stalled": "True",
                                    "Succeeded": "False", "Failed": "True"}),
    ("ValidationFailed", "", "Failed", {"Failed": "True", "Stalled": "True", "Ready": "False"}),
    ("Retrying", "", "Pending", {"Ready": "False", "Reconciling": "True", "Failed": "False"}),
    ("Waiting", "", "Pending", {"Ready": "False", "Reconciling": "True"}),
])
def test_each_job_deployment_status(deployment: str, job_status: str, phase: str, expected: dict) -> None:
    status = compute_status(job(), rayjob(deployment, job_status), [], T0, None)
    assert status["phase"] == phase
    assert {k: states(status)[k] for k in expected} == expected
    assert status["jobDeploymentStatus"] == (deployment or None)
    assert status["jobStatus"] == (job_status or None)
    assert states(status)["Suspended"] == "False"


def test_failure_reason_and_message_come_from_kuberay() -> None:
    rj = rayjob("Failed", "FAILED", reason="DeadlineExceeded", message="the job ran past activeDeadlineSeconds")
    c = conds(compute_status(job(), rj, [], T0, None))
    assert c["Failed"]["reason"] == "DeadlineExceeded"
    assert c["Failed"]["message"] == "the job ran past activeDeadlineSeconds"
    assert c["Stalled"]["reason"] == "DeadlineExceeded"


def test_mirrors_the_rayjob() -> None:
    rj = rayjob("Running", "RUNNING", rayClusterName="ppo-abcde", dashboardURL="ppo-head-svc.ns.svc:8265",
                startTime=T0)
    status = compute_status(job(), rj, [], T1, None)
    assert (status["rayJobName"], status["rayClusterName"], status["dashboardUrl"]) \
        == ("ppo", "ppo-abcde", "ppo-head-svc.ns.svc:8265")
    assert status["startTime"] == T0 and status["completionTime"] is None


def test_the_scheduler_dashboard_is_linked_on_the_clusters_head_service_while_it_runs() -> None:
    """The port the rendered head names, on KubeRay's Service for the RayCluster's head (the one that selects
    the rendered pods), in the domain of KubeRay's own dashboardURL; Ray's dashboard stays in dashboardUrl."""
    ray_url = "tiny-ppo-x7k2p-head-svc.team-a.svc.cluster.local:8265"
    tiny, rj = rendered_rayjob("Running", jobStatus="RUNNING", rayClusterName="tiny-ppo-x7k2p", dashboardURL=ray_url)
    status = compute_status(tiny, rj, [], T0, None)
    assert status["schedulerDashboardUrl"] == \
        f"http://tiny-ppo-x7k2p-head-svc.team-a.svc.cluster.local:{contract.DASHBOARD_PORT}"
    assert status["dashboardUrl"] == ray_url
    rj["status"]["dashboardURL"] = "tiny-ppo-x7k2p-head-svc.team-a.svc.corp.example:8265"
    assert compute_status(tiny, rj, [], T0, None)["schedulerDashboardUrl"] == \
        f"http://tiny-ppo-x7k2p-head-svc.team-a.svc.corp.example:{contract.DASHBOARD_PORT}"
    del rj["status"]["dashboardURL"]
    assert compute_status(tiny, rj, [], T0, None)["schedulerDashboardUrl"].endswith(".svc.cluster.local:8266")
    del rj["status"]["rayClusterName"]  # KubeRay has not named the cluster yet
    assert compute_status(tiny, rj, [], T0, None)["schedulerDashboardUrl"] is None


@pytest.mark.parametrize("deployment", ["", "Initializing", "Retrying", "Complete", "Failed", "Suspended"])
def test_no_scheduler_dashboard_link_while_nothing_serves_it(deployment: str) -> None:
    tiny, rj = rendered_rayjob(deployment, rayClusterName="tiny-ppo-x7k2p")
    assert compute_status(tiny, rj, [], T0, None)["schedulerDashboardUrl"] is None
    assert compute_status(tiny, None, [], T0, None)["schedulerDashboardUrl"] is None


def test_no_scheduler_dashboard_link_when_the_head_does_not_declare_its_port() -> None:
    """A RayJob rendered before the head served the page keeps its old head (a running RayJob is not re-laid)."""
    tiny, rj = rendered_rayjob("Running", jobStatus="RUNNING")
    head = rj["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    head["ports"] = [p for p in head["ports"] if p["name"] != contract.DASHBOARD_PORT_NAME]
    assert compute_status(tiny, rj, [], T0, None)["schedulerDashboardUrl"] is None
    assert compute_status(job(), rayjob("Running", "RUNNING"), [], T0, None)["schedulerDashboardUrl"] is None


def test_completion_time_from_the_rayjob_end_or_now() -> None:
    done = compute_status(job(), rayjob("Complete", "SUCCEEDED", endTime=T1), [], T2, None)
    assert done["completionTime"] == T1
    assert compute_status(job(), rayjob("Failed", "FAILED"), [], T2, None)["completionTime"] == T2


def test_start_time_is_the_first_start() -> None:
    status = compute_status(job(status={"startTime": T0}), rayjob("Running", startTime=T1), [], T2, None)
    assert status["startTime"] == T0


@pytest.mark.parametrize(("deployment", "failed", "restarts"), [
    ("Running", None, 0), ("Retrying", 1, 1), ("Running", 2, 2), ("Failed", 3, 2), ("Complete", 1, 1),
])
def test_restarts_count_retries(deployment: str, failed: int | None, restarts: int) -> None:
    status = compute_status(job(), rayjob(deployment, failed=failed), [], T0, None)
    assert status["restarts"] == restarts


def test_last_transition_time_is_kept_while_the_status_stays() -> None:
    first = compute_status(job(), rayjob("Initializing"), [], T0, None)
    second = compute_status(job(status=first), rayjob("Running", "RUNNING"), [], T1, None)
    assert conds(second)["Ready"]["lastTransitionTime"] == T1       # False -> True
    assert conds(second)["Stalled"]["lastTransitionTime"] == T0     # False -> False
    assert conds(second)["Succeeded"]["lastTransitionTime"] == T0
    third = compute_status(job(status=second), rayjob("Running", "RUNNING", message="x"), [], T2, None)
    assert conds(third)["Ready"]["lastTransitionTime"] == T1


def test_observed_generation_is_the_generation_applied_to_the_rayjob() -> None:
    status = compute_status(job(generation=3), rayjob("Running", applied=3), [], T0, None)
    assert status["observedGeneration"] == 3
    assert states(status)["Reconciling"] == "False"
    lagging = compute_status(job(generation=4), rayjob("Running", applied=3), [], T0, None)
    assert lagging["observedGeneration"] == 3
    assert conds(lagging)["Reconciling"] == {**conds(lagging)["Reconciling"], "status": "True",
                                              "reason": "Progressing"}
    assert all(c["observedGeneration"] == 4 for c in lagging["conditions"])


def test_observed_generation_stays_when_the_rayjob_has_no_record() -> None:
    status = compute_status(job(generation=2, status={"observedGeneration": 1}), rayjob("Running", applied=None),
                            [], T0, None)
    assert status["observedGeneration"] == 1


def test_render_error_stalls_with_reason_and_message() -> None:
    message = "spec.cluster.gpuType: unknown GPU type 'V100'"
    status = compute_status(job(generation=2), None, None, T0, message, error_reason="UnknownGPUType")
    c = conds(status)
    assert c["Stalled"] == {**c["Stalled"], "status": "True", "reason": "UnknownGPUType", "message": message}
    assert c["Ready"]["status"] == "False" and c["Ready"]["reason"] == "UnknownGPUType"
    assert c["Reconciling"]["status"] == "False"
    assert status["phase"] == "Stalled"
    assert status["observedGeneration"] == 2  # the operator has seen this generation: kstatus says Failed


def test_render_error_on_update_keeps_mirroring_the_running_rayjob() -> None:
    status = compute_status(job(generation=2), rayjob("Running", "RUNNING", applied=1), [], T0, "boom",
                            error_reason="InsufficientGPUs")
    assert states(status)["Stalled"] == "True"
    assert status["jobDeploymentStatus"] == "Running" and status["rayJobName"] == "ppo"


def test_error_cleared_by_a_fixed_spec() -> None:
    stalled = compute_status(job(), None, None, T0, "boom", error_reason="UnknownGPUType")
    fixed = compute_status(job(generation=2, status=stalled), rayjob("", applied=2), [], T1, None)
    assert conds(fixed)["Stalled"]["status"] == "False"
    assert conds(fixed)["Stalled"]["lastTransitionTime"] == T1
    assert fixed["phase"] == "Pending"


def test_unschedulable_pods_are_surfaced_with_the_scheduler_message() -> None:
    msg = "0/6 nodes are available: 4 Insufficient nvidia.com/gpu, 2 node(s) didn't match node affinity."
    pods = [pod("ppo-head-x", "Running"), pod("ppo-actor-worker-b", message=msg),
            pod("ppo-actor-worker-a", message=msg)]
    status = compute_status(job(), rayjob("Initializing"), pods, T0, None)
    c = conds(status)
    assert c["Ready"]["reason"] == c["Reconciling"]["reason"] == "Unschedulable"
    assert c["Reconciling"]["status"] == "True"
    assert "2 pod(s) unschedulable" in c["Ready"]["message"]
    assert f"ppo-actor-worker-a: {msg}" in c["Ready"]["message"]
    assert states(status)["Stalled"] == "False"  # the cluster may still grow


def test_unschedulable_pods_while_running_are_noted_but_ready_stays() -> None:
    status = compute_status(job(), rayjob("Running", "RUNNING"), [pod("w", message="no GPUs")], T0, None)
    assert states(status)["Ready"] == "True"
    assert "w: no GPUs" in conds(status)["Ready"]["message"]


def test_pending_pods_without_a_scheduling_problem_are_not_reported() -> None:
    assert unschedulable([pod("a"), pod("b", "Running", message="stale")]) == []


def test_suspend_round_trip() -> None:
    asked = compute_status(job(suspend=True), rayjob("Running", suspend=True), [], T0, None)
    assert conds(asked)["Suspended"]["reason"] == "Suspending"
    assert states(asked)["Suspended"] == "True" and states(asked)["Reconciling"] == "True"
    done = compute_status(job(suspend=True, status=asked), rayjob("Suspended", suspend=True), [], T1, None)
    assert states(done) == {**states(done), "Suspended": "True", "Reconciling": "False", "Ready": "False"}
    assert done["phase"] == "Suspended"
    assert conds(done)["Suspended"]["lastTransitionTime"] == T0
    resumed = compute_status(job(status=done), rayjob("Suspended", suspend=False), [], T2, None)
    assert states(resumed)["Suspended"] == "False" and conds(resumed)["Suspended"]["reason"] == "Resuming"
    assert states(resumed)["Reconciling"] == "True"
    running = compute_status(job(status=resumed), rayjob("Running", "RUNNING"), [], T2, None)
    assert states(running)["Ready"] == "True" and states(running)["Suspended"] == "False"


def test_suspended_before_the_rayjob_exists() -> None:
    status = compute_status(job(suspend=True), None, None, T0, None)
    assert states(status)["Suspended"] == "True"


def test_queued_by_kueue() -> None:
    status = compute_status(job(queue="team-a"), rayjob("Suspended", suspend=True), [], T0, None)
    assert conds(status)["Suspended"]["reason"] == "Queued"
    assert states(status)["Ready"] == "False" and states(status)["Reconciling"] == "False"


def test_long_messages_are_cut_to_the_api_limit() -> None:
    status = compute_status(job(), None, None, T0, "x" * 40000)
    assert len(conds(status)["Stalled"]["message"]) == 32768


def test_status_changed_ignores_an_identical_recompute() -> None:
    first = compute_status(job(), rayjob("Running", "RUNNING"), [], T0, None)
    stored = {k: v for k, v in first.items() if v is not None}
    again = compute_status(job(status=stored), rayjob("Running", "RUNNING"), [], T1, None)
    assert not status_changed(stored, again)
    assert status_changed(stored, compute_status(job(status=stored), rayjob("Complete", "SUCCEEDED"), [], T1, None))


def test_transitions_announce_each_new_outcome_once() -> None:
    running = compute_status(job(), rayjob("Running", "RUNNING"), [], T0, None)
    assert transitions({}, running) == [("Normal", "Running", conds(running)["Ready"]["message"])]
    failed = compute_status(job(status=running), rayjob("Failed", "FAILED", reason="AppFailed"), [], T1, None)
    assert [(k, r) for k, r, _ in transitions(running, failed)] == [("Warning", "AppFailed")]
    assert transitions(failed, copy.deepcopy(failed)) == []


def test_a_new_render_error_is_announced_again() -> None:
    first = compute_status(job(), None, None, T0, "problem one", error_reason="UnknownGPUType")
    second = compute_status(job(status=first), None, None, T1, "problem two", error_reason="InsufficientGPUs")
    assert transitions(first, second) == [("Warning", "InsufficientGPUs", "problem two")]
