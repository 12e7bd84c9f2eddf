"""The operator against a real kube-apiserver with KubeRay's real CRDs and ours.

The operator runs as a subprocess (`python -m hybridflow_operator`), exactly as in its pod, so a
restart is a real restart. These tests use `control_plane`, which runs no controllers at all (not
KubeRay, not the scheduler), so they can move a RayJob's status or a pod's scheduling verdict the way
KubeRay and kube-scheduler would (status subresource) without racing them, in the same pytest
session as the cluster tests (e2e/test_cluster_e2e.py), which use the separate `full_cluster`.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.harness.controlplane import ControlPlane, eventually
from e2e.harness.operator import OperatorProcess
from hybridflow.k8s import names
from hybridflow.k8s.render import render_children
from hybridflow.k8s.settings import RenderSettings
from tests.helpers import condition, kuberay_resources, without_pod_storage

pytestmark = pytest.mark.controlplane

ROOT = Path(__file__).resolve().parents[1]
WAIT_S = 60.0
CHILD_KINDS = (
    "configmap",
    "serviceaccount",
    "role.rbac.authorization.k8s.io",
    "rolebinding.rbac.authorization.k8s.io",
    "rayjob.ray.io",
)


# -- helpers ------------------------------------------------------------------------------------------------


def example(namespace: str, name: str | None = None, file: str = "ppo-job.yaml") -> dict:
    doc = without_pod_storage(yaml.safe_load((ROOT / "examples" / file).read_text()))
    doc["metadata"]["namespace"] = namespace
    if name:
        doc["metadata"]["name"] = name
    return doc


def apply(cp: ControlPlane, doc: dict, check: bool = True) -> subprocess.CompletedProcess[str]:
    return cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc), check=check)


def get(cp: ControlPlane, kind: str, namespace: str, name: str) -> dict | None:
    result = cp.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def job_of(cp: ControlPlane, namespace: str, name: str) -> dict:
    found = get(cp, "rltrainingjob", namespace, name)
    assert found is not None
    return found


def wait_job(
    cp: ControlPlane, op: OperatorProcess, namespace: str, name: str, check: Callable[[dict], bool], what: str
) -> dict:
    def ready() -> dict | None:
        job = job_of(cp, namespace, name)
        return job if check(job) else None

    try:
        return eventually(ready, WAIT_S, what)
    except AssertionError as e:
        status = (get(cp, "rltrainingjob", namespace, name) or {}).get("status")
        raise AssertionError(f"{e}\nstatus: {json.dumps(status, indent=1)}\noperator log:\n{op.tail()}") from None


def wait_rayjob(
    cp: ControlPlane, op: OperatorProcess, namespace: str, name: str, check: Callable[[dict], bool] = bool
) -> dict:
    rayjob = names.rayjob_name(name)

    def ready() -> dict | None:
        found = get(cp, "rayjob", namespace, rayjob)
        return found if found and check(found) else None

    try:
        return eventually(ready, WAIT_S, f"RayJob {namespace}/{rayjob}")
    except AssertionError as e:
        raise AssertionError(
            f"{e}\njob status: {json.dumps(job_of(cp, namespace, name).get('status'))}\noperator log:\n{op.tail()}"
        ) from None


def children(cp: ControlPlane, namespace: str, name: str) -> dict[str, list[dict]]:
    out = {}
    for kind in CHILD_KINDS:
        found = cp.get_json(kind, "-n", namespace, "-l", f"{names.JOB_LABEL}={name}")
        out[kind] = found["items"]
    return out


def patch_rayjob_status(cp: ControlPlane, namespace: str, rayjob: str, status: dict[str, Any]) -> None:
    """What KubeRay's controller does: write the status subresource."""
    cp.kubectl(
        "patch",
        "rayjob",
        rayjob,
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": status}),
    )


def events(cp: ControlPlane, namespace: str, name: str, reason: str) -> list[dict]:
    found = cp.get_json(
        "events",
        "-n",
        namespace,
        "--field-selector",
        f"involvedObject.name={name},involvedObject.kind=RLTrainingJob,reason={reason}",
    )
    return found["items"]


def groups(rayjob: dict) -> dict[str, dict]:
    return {g["groupName"]: g for g in rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]}


# -- tests ------------------------------------------------------------------------------------------------------


def test_liveness_endpoint_reports_the_probe(running: OperatorProcess) -> None:
    with urllib.request.urlopen(running.liveness, timeout=5) as resp:
        body = json.loads(resp.read() or b"{}")
    assert resp.status == 200
    assert body == {"operator": True}  # the process's own health: no API request behind it


def test_example_job_gets_its_owned_children_and_a_rayjob_kuberay_accepts(
    control_plane: ControlPlane, running: OperatorProcess, namespace: str
) -> None:
    cp = control_plane
    doc = example(namespace)
    apply(cp, doc)
    rayjob = wait_rayjob(cp, running, namespace, doc["metadata"]["name"])
    job = job_of(cp, namespace, doc["metadata"]["name"])
    uid = job["metadata"]["uid"]

    found = children(cp, namespace, doc["metadata"]["name"])
    assert {k: len(v) for k, v in found.items()} == dict.fromkeys(CHILD_KINDS, 1)
    for kind, (obj,) in found.items():
        refs = obj["metadata"].get("ownerReferences") or []
        assert [(r["uid"], r.get("controller"), r.get("blockOwnerDeletion")) for r in refs] == [(uid, True, True)], kind

    # exactly what `hybridflow render` prints for this job (as the API server stored it)
    expected = {c["kind"]: c for c in render_children(job, RenderSettings())}
    (cm,) = found["configmap"]
    assert cm["data"] == expected["ConfigMap"]["data"]
    assert rayjob["spec"]["entrypoint"] == expected["RayJob"]["spec"]["entrypoint"]
    assert rayjob["metadata"]["annotations"][names.GENERATION_ANNOTATION] == str(job["metadata"]["generation"])

    # the layout the issue asks for, as stored by the API server under KubeRay's schema
    spec = rayjob["spec"]
    assert spec["shutdownAfterJobFinishes"] is True and spec["suspend"] is False
    assert spec["backoffLimit"] == 1 and spec["ttlSecondsAfterFinished"] == 3600
    head = spec["rayClusterSpec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert list(groups(rayjob)) == ["actor", "critic"]
    actor = groups(rayjob)["actor"]
    pod = actor["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert pod["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] == "8"
    assert pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
        "matchExpressions"
    ][0]["values"] == ["NVIDIA-A100-SXM4-80GB", "NVIDIA-A100-80GB-PCIe"]
    assert kuberay_resources(actor["rayStartParams"]["resources"]) == {"pool_actor": 8}

    # the status says what is happening, in kstatus terms
    job = wait_job(
        cp,
        running,
        namespace,
        doc["metadata"]["name"],
        lambda j: (j.get("status") or {}).get("observedGeneration") == j["metadata"]["generation"],
        "observedGeneration reaches the generation",
    )
    status = job["status"]
    assert status["rayJobName"] == rayjob["metadata"]["name"]
    assert status["phase"] == "Pending"
    assert condition(job, "Reconciling")["status"] == "True"
    assert condition(job, "Ready")["status"] == "False"
    assert condition(job, "Stalled")["status"] == "False"
    assert all(c["observedGeneration"] == job["metadata"]["generation"] for c in status["conditions"])
    eventually(lambda: events(cp, namespace, doc["metadata"]["name"], "Created"), WAIT_S, "Created events")


def test_status_follows_the_rayjob_as_kuberay_moves_it(
    control_plane: ControlPlane, running: OperatorProcess, namespace: str
) -> None:
    cp = control_plane
    doc = example(namespace, "follow")
    apply(cp, doc)
    rayjob = wait_rayjob(cp, running, namespace, "follow")["metadata"]["name"]

    patch_rayjob_status(
        cp,
        namespace,
        rayjob,
        {
            "jobDeploymentStatus": "Initializing",
            "jobStatus": "",
            "rayClusterName": f"{rayjob}-x7k2p",
            "startTime": "2025-01-01T00:00:00Z",
        },
    )
    job = wait_job(
        cp,
        running,
        namespace,
        "follow",
        lambda j: (j.get("status") or {}).get("rayClusterName") == f"{rayjob}-x7k2p",
        "rayClusterName mirrored",
    )
    assert job["status"]["jobDeploymentStatus"] == "Initializing"
    assert condition(job, "Reconciling")["reason"] == "Initializing"

    patch_rayjob_status(
        cp,
        namespace,
        rayjob,
        {
            "jobDeploymentStatus": "Running",
            "jobStatus": "RUNNING",
            "dashboardURL": f"{rayjob}-head-svc.{namespace}.svc:8265",
        },
    )
    job = wait_job(
        cp,
        running,
        namespace,
        "follow",
        lambda j: condition(j, "Ready").get("status") == "True",
        "Ready=True once running",
    )
    ready_since = condition(job, "Ready")["lastTransitionTime"]
    assert job["status"]["phase"] == "Running"
    assert job["status"]["dashboardUrl"] == f"{rayjob}-head-svc.{namespace}.svc:8265"
    assert condition(job, "Reconciling")["status"] == "False"
    assert job["status"]["startTime"] == "2025-01-01T00:00:00Z"

    patch_rayjob_status(
        cp,
        namespace,
        rayjob,
        {
            "jobDeploymentStatus": "Complete",
            "jobStatus": "SUCCEEDED",
            "endTime": "2025-01-01T02:00:00Z",
            "succeeded": 1,
        },
    )
    job = wait_job(
        cp,
        running,
        namespace,
        "follow",
        lambda j: condition(j, "Succeeded").get("status") == "True",
        "Succeeded=True on completion",
    )
    assert job["status"]["phase"] == "Succeeded"
    assert job["status"]["completionTime"] == "2025-01-01T02:00:00Z"
    assert job["status"]["jobStatus"] == "SUCCEEDED"
    assert condition(job, "Ready") == {**condition(job, "Ready"), "status": "True", "lastTransitionTime": ready_since}
    assert condition(job, "Failed")["status"] == "False"
    assert job["status"]["observedGeneration"] == job["metadata"]["generation"]
    assert all(c["observedGeneration"] == job["metadata"]["generation"] for c in job["status"]["conditions"])


def test_failed_rayjob_fails_the_job_with_kuberays_reason(
    control_plane: ControlPlane, running: OperatorProcess, namespace: str
) -> None:
    cp = control_plane
    apply(cp, example(namespace, "fails"))
    rayjob = wait_rayjob(cp, running, namespace, "fails")["metadata"]["name"]
    patch_rayjob_status(
        cp,
        namespace,
        rayjob,
        {
            "jobDeploymentStatus": "Failed",
            "jobStatus": "FAILED",
            "reason": "AppFailed",
            "message": "driver exited with 1",
            "failed": 2,
        },
    )
    job = wait_job(
        cp, running, namespace, "fails", lambda j: condition(j, "Failed").get("status") == "True", "Failed=True"
    )
    assert condition(job, "Failed")["reason"] == "AppFailed"
    assert condition(job, "Stalled")["status"] == "True"
    assert job["status"]["restarts"] == 1
    eventually(lambda: events(cp, namespace, "fails", "AppFailed"), WAIT_S, "a Warning event for the failure")


def test_unschedulable_ray_pod_is_surfaced(
    control_plane: ControlPlane, running: OperatorProcess, namespace: str
) -> None:
    cp = control_plane
    apply(cp, example(namespace, "pending"))
    rayjob = wait_rayjob(cp, running, namespace, "pending")["metadata"]["name"]
    patch_rayjob_status(cp, namespace, rayjob, {"jobDeploymentStatus": "Initializing"})
    # a Ray worker pod as KubeRay would create it, and the scheduler's verdict on it
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{rayjob}-actor-worker-abcde",
            "namespace": namespace,
            "labels": {names.JOB_LABEL: "pending", "ray.io/group": "actor"},
        },
        "spec": {"containers": [{"name": "ray-worker", "image": "docker.io/hybridflow/runtime:0.1.0"}]},
    }
    cp.kubectl("create", "-f", "-", input=json.dumps(pod))
    message = "0/4 nodes are available: 4 Insufficient nvidia.com/gpu. preemption: 0/4 nodes are available."
    cp.kubectl(
        "patch",
        "pod",
        pod["metadata"]["name"],
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps(
            {
                "status": {
                    "phase": "Pending",
                    "conditions": [
                        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}
                    ],
                }
            }
        ),
    )
    job = wait_job(
        cp,
        running,
        namespace,
        "pending",
        lambda j: condition(j, "Ready").get("reason") == "Unschedulable",
        "Unschedulable surfaced",
    )
    assert message in condition(job, "Ready")["message"]
    assert condition(job, "Reconciling") == {
        **condition(job, "Reconciling"),
        "status": "True",
        "reason": "Unschedulable",
    }


def test_suspend_and_resume_reach_the_rayjob(
    control_plane: ControlPlane, running: OperatorProcess, namespace: str
) -> None:
    cp = control_plane
    apply(cp, example(namespace, "pause"))
    wait_rayjob(cp, running, namespace, "pause")
    suspend = [{"op": "add", "path": "/spec/runPolicy/suspend", "value": True}]
    cp.kubectl("patch", "rltrainingjob", "pause", "-n", namespace, "--type=json", "-p", json.dumps(suspend))
    wait_rayjob(cp, running, namespace, "pause", lambda r: r["spec"].get("suspend") is True)
    job = wait_job(
        cp, running, namespace, "pause", lambda j: condition(j, "Suspended").get("status") == "True", "Suspended=True"
    )
    assert job["status"]["observedGeneration"] == job["metadata"]["generation"]
    rayjob = names.rayjob_name("pause")
    patch_rayjob_status(cp, namespace, rayjob, {"jobDeploymentStatus": "Suspended"})
    job = wait_job(
        cp,
        running,
        namespace,
        "pause",
        lambda j: condition(j, "Suspended").get("reason") == "Suspended",
        "Suspended settles",
    )
    assert job["status"]["phase"] == "Suspended" and condition(job, "Reconciling")["status"] == "False"

    resume = [{"op": "replace", "path": "/spec/runPolicy/suspend", "value": False}]
    cp.kubectl("patch", "rltrainingjob", "pause", "-n", namespace, "--type=json", "-p", json.dumps(resume))
    wait_rayjob(cp, running, namespace, "pause", lambda r: r["spec"].get("suspend") is False)
    job = wait_job(
        cp, running, namespace, "pause", lambda j: condition(j, "Suspended").get("reason") == "Resuming", "Resuming"
    )
    assert condition(job, "Suspended")["status"] == "False"


def test_rollout_replicas_and_ttl_updates_reach_the_rayjob(
    control_plane: ControlPlane, running: OperatorProcess, namespace: str
) -> None:
    cp = control_plane
    apply(cp, example(namespace, "elastic"))
    before = wait_rayjob(cp, running, namespace, "elastic")
    ops = [
        {"op": "replace", "path": "/spec/cluster/workerGroups/0/replicas", "value": 3},
        {"op": "replace", "path": "/spec/runPolicy/ttlSecondsAfterFinished", "value": 120},
    ]
    cp.kubectl("patch", "rltrainingjob", "elastic", "-n", namespace, "--type=json", "-p", json.dumps(ops))
    after = wait_rayjob(cp, running, namespace, "elastic", lambda r: groups(r)["actor"]["replicas"] == 3)
    assert after["metadata"]["uid"] == before["metadata"]["uid"]  # patched in place, not recreated
    assert after["spec"]["ttlSecondsAfterFinished"] == 120
    assert groups(after)["actor"]["maxReplicas"] == 3
    assert groups(after)["critic"] == groups(before)["critic"]
    job = wait_job(
        cp,
        running,
        namespace,
        "elastic",
        lambda j: (j.get("status") or {}).get("observedGeneration") == j["metadata"]["generation"],
        "observedGeneration follows the update",
    )
    assert job["metadata"]["generation"] == 2
    # the runtime config follows too: 3 pods x 8 GPUs -> 24 actor instances
    cm = get(cp, "configmap", namespace, names.config_map_name("elastic"))
    assert cm is not None
    nodes = {n["name"]: n for n in json.loads(cm["data"]["job.json"])["spec"]["graph"]["nodes"]}
    assert nodes["actor_rollout"]["parallelism"] == 24


def test_immutable_field_is_refused_by_the_api_server(
    control_plane: ControlPlane, running: OperatorProcess, namespace: str, crd: str
) -> None:
    if "spec.algorithm is immutable" not in crd:
        pytest.skip("the CRD has no CEL rule making spec.algorithm immutable")
    cp = control_plane
    apply(cp, example(namespace, "fixed"))
    ops = [{"op": "replace", "path": "/spec/algorithm/name", "value": "grpo"}]
    result = cp.kubectl(
        "patch", "rltrainingjob", "fixed", "-n", namespace, "--type=json", "-p", json.dumps(ops), check=False
    )
    assert result.returncode != 0
    assert "spec.algorithm is immutable" in result.stderr


def test_invalid_spec_is_rejected_by_the_schema(control_plane: ControlPlane, crd: str, namespace: str) -> None:
    doc = example(namespace, "invalid")
    doc["spec"]["algorithm"]["name"] = "dpo"
    result = apply(control_plane, doc, check=False)
    assert result.returncode != 0
    assert "spec.algorithm.name" in result.stderr and "dpo" in result.stderr


def test_graph_needing_more_gpus_stalls_with_an_event_and_no_retry_storm(
    control_plane: ControlPlane, running: OperatorProcess, namespace: str
) -> None:
    cp = control_plane
    doc = example(namespace, "too-big")
    doc["spec"]["graph"] = {
        "nodes": [
            {"name": "actor", "role": "actor_rollout", "resources": {"GPU": 1}, "parallelism": 32, "pool": "actor"},
            {"name": "reward", "role": "reward", "parallelism": 32, "pool": "actor"},
            {"name": "critic", "role": "critic", "resources": {"GPU": 1}, "parallelism": 8, "pool": "critic"},
        ],
        "edges": [{"src": "actor", "dst": "reward", "coLocate": True}, {"src": "actor", "dst": "critic"},
                  {"src": "critic", "dst": "actor", "control": True}],
    }
    apply(cp, doc)
    job = wait_job(
        cp, running, namespace, "too-big", lambda j: condition(j, "Stalled").get("status") == "True", "Stalled=True"
    )
    stalled = condition(job, "Stalled")
    assert stalled["reason"] == "InsufficientGPUs"
    assert "32" in stalled["message"] and "16" in stalled["message"]
    assert job["status"]["observedGeneration"] == job["metadata"]["generation"]
    assert job["status"]["phase"] == "Stalled"
    eventually(lambda: events(cp, namespace, "too-big", "InsufficientGPUs"), WAIT_S, "a Warning event")
    assert get(cp, "rayjob", namespace, names.rayjob_name("too-big")) is None

    # no retries: once kopf has recorded the outcome, nothing writes the job again
    def settled() -> str | None:
        before = job_of(cp, namespace, "too-big")["metadata"]["resourceVersion"]
        time.sleep(2)
        return before if job_of(cp, namespace, "too-big")["metadata"]["resourceVersion"] == before else None

    resource_version = eventually(settled, WAIT_S, "the job stops changing")
    time.sleep(5)
    assert running.alive()
    assert job_of(cp, namespace, "too-big")["metadata"]["resourceVersion"] == resource_version
    (event,) = events(cp, namespace, "too-big", "InsufficientGPUs")
    assert event["type"] == "Warning" and event.get("count", 1) == 1

    # a fixed spec recovers (the graph is immutable; the worker group can grow to 4 x 8 GPUs)
    ops = [{"op": "replace", "path": "/spec/cluster/workerGroups/0/replicas", "value": 4}]
    cp.kubectl("patch", "rltrainingjob", "too-big", "-n", namespace, "--type=json", "-p", json.dumps(ops))
    wait_rayjob(cp, running, namespace, "too-big")
    job = wait_job(
        cp, running, namespace, "too-big", lambda j: condition(j, "Stalled").get("status") == "False", "Stalled clears"
    )
    assert job["status"]["phase"] == "Pending"


def test_a_graph_that_cannot_train_stalls_before_any_child_exists(
    control_plane: ControlPlane, running: OperatorProcess, namespace: str
) -> None:
    cp = control_plane
    doc = example(namespace, "no-reward")
    doc["spec"]["graph"] = {  # PPO without a reward node: the schema accepts it, the training rules do not
        "nodes": [
            {"name": "actor", "role": "actor_rollout", "resources": {"GPU": 1}, "pool": "actor"},
            {"name": "critic", "role": "critic", "resources": {"GPU": 1}, "pool": "critic"},
        ],
        "edges": [{"src": "actor", "dst": "critic"}, {"src": "critic", "dst": "actor", "control": True}],
    }
    apply(cp, doc)
    job = wait_job(
        cp, running, namespace, "no-reward", lambda j: condition(j, "Stalled").get("status") == "True", "Stalled=True"
    )
    stalled = condition(job, "Stalled")
    assert stalled["reason"] == "InvalidGraph"
    assert stalled["message"].startswith("spec.graph: ") and "needs a node with role reward" in stalled["message"]
    assert job["status"]["phase"] == "Stalled"
    assert get(cp, "rayjob", namespace, names.rayjob_name("no-reward")) is None
    assert not any(children(cp, namespace, "no-reward").values())


def test_operator_restart_creates_no_duplicates(
    control_plane: ControlPlane, running: OperatorProcess, namespace: str
) -> None:
    cp = control_plane
    first = example(namespace, "restart-a")
    apply(cp, first)
    running.stop(hard=True)  # whatever it was doing
    second = example(namespace, "restart-b")  # created while the operator is down
    apply(cp, second)
    running.start()
    for name in ("restart-a", "restart-b"):
        wait_rayjob(cp, running, namespace, name)
        wait_job(
            cp,
            running,
            namespace,
            name,
            lambda j: (j.get("status") or {}).get("observedGeneration") == j["metadata"]["generation"],
            f"{name} reconciled",
        )
    uid = get(cp, "rayjob", namespace, names.rayjob_name("restart-a"))["metadata"]["uid"]

    running.stop()  # and once more, cleanly, with everything in place
    running.start()
    time.sleep(3)
    for name in ("restart-a", "restart-b"):
        assert {k: len(v) for k, v in children(cp, namespace, name).items()} == dict.fromkeys(CHILD_KINDS, 1)
    assert get(cp, "rayjob", namespace, names.rayjob_name("restart-a"))["metadata"]["uid"] == uid
    all_rayjobs = cp.get_json("rayjobs", "-n", namespace)["items"]
    assert sorted(r["metadata"]["name"] for r in all_rayjobs) == ["restart-a", "restart-b"]


def test_a_lost_rayjob_is_recreated(control_plane: ControlPlane, running: OperatorProcess, namespace: str) -> None:
    cp = control_plane
    apply(cp, example(namespace, "lost"))
    before = wait_rayjob(cp, running, namespace, "lost")
    cp.kubectl("delete", "rayjob", before["metadata"]["name"], "-n", namespace, "--wait=false")
    after = wait_rayjob(cp, running, namespace, "lost", lambda r: r["metadata"]["uid"] != before["metadata"]["uid"])
    assert after["metadata"]["name"] == before["metadata"]["name"]


def test_deleting_a_job_is_not_blocked_by_the_operator(
    control_plane: ControlPlane, running: OperatorProcess, namespace: str
) -> None:
    cp = control_plane
    apply(cp, example(namespace, "gone"))
    wait_rayjob(cp, running, namespace, "gone")
    # the children are garbage-collected through their owner references: nothing to block deletion for
    assert not job_of(cp, namespace, "gone")["metadata"].get("finalizers")
    cp.kubectl("delete", "rltrainingjob", "gone", "-n", namespace, "--timeout=30s")
    assert get(cp, "rltrainingjob", namespace, "gone") is None


def test_jobs_with_long_names_get_kuberay_sized_rayjobs(
    control_plane: ControlPlane, running: OperatorProcess, namespace: str
) -> None:
    name = "qwen2-5-7b-instruct-gsm8k-ppo-with-a-long-experiment-name"
    apply(control_plane, example(namespace, name))
    rayjob = wait_rayjob(control_plane, running, namespace, name)
    assert len(rayjob["metadata"]["name"]) <= names.MAX_RAYJOB_NAME
    job = wait_job(
        control_plane, running, namespace, name, lambda j: bool((j.get("status") or {}).get("rayJobName")), "rayJobName"
    )
    assert job["status"]["rayJobName"] == rayjob["metadata"]["name"]


def test_grpo_example_is_accepted(control_plane: ControlPlane, running: OperatorProcess, namespace: str) -> None:
    doc = example(namespace, file="grpo-job.yaml")
    apply(control_plane, doc)
    rayjob = wait_rayjob(control_plane, running, namespace, doc["metadata"]["name"])
    assert list(groups(rayjob)) == ["actor"]
