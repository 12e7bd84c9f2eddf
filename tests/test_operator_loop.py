"""The operator's control loop as logic: which requests it makes for which events, and when it waits.

The Kubernetes side is an in-memory store (allowed for logic around the client); the real API server,
KubeRay and the operator process are exercised in e2e/test_operator.py and e2e/test_cluster_e2e.py.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from hybridflow.k8s import names
from hybridflow_operator.events import EventPoster, event_body
from hybridflow_operator.machinery.client import ApiException
from hybridflow_operator.machinery.ratelimit import TokenBucket
from hybridflow_operator.machinery.workqueue import WorkQueue
from hybridflow_operator.observed import JobView, Observed, newer
from hybridflow_operator.reconciler import RETRY_DELAY_S
from tests.memory_kube import NS, Loop, MemoryKube, api_error, run, settle

ROOT = Path(__file__).resolve().parent.parent


def new_job(kube: MemoryKube, name: str = "ppo", **spec_changes: Any) -> dict:
    doc = yaml.safe_load((ROOT / "examples" / "ppo-job.yaml").read_text())
    doc["metadata"].update(name=name, namespace=NS, generation=1)
    doc["spec"].update(spec_changes)
    doc["status"] = {"observedGeneration": 0, "restarts": 0}  # the CRD's default: nobody has observed it yet
    return kube.put(doc)


def condition(job: Mapping[str, Any], kind: str) -> dict:
    return next(c for c in job["status"]["conditions"] if c["type"] == kind)


# -- the work queue ---------------------------------------------------------------------------------------


def test_events_during_a_run_coalesce_into_one_more_run() -> None:
    async def scenario() -> list[str]:
        runs: list[str] = []
        gate = asyncio.Event()

        async def work(key: str) -> None:
            runs.append(key)
            await gate.wait()

        queue: WorkQueue[str] = WorkQueue(work, min_interval=0.0, error_delay=1.0)
        queue.add("a")
        await asyncio.sleep(0)
        for _ in range(20):
            queue.add("a")  # while the first run is in progress
        queue.add("b")
        gate.set()
        await settle(queue)
        return runs

    runs = run(scenario())
    assert sorted(runs) == ["a", "a", "b"]


def test_runs_of_one_key_are_spaced_by_the_minimum_interval() -> None:
    async def scenario() -> list[float]:
        loop = asyncio.get_running_loop()
        starts: list[float] = []

        async def work(key: str) -> None:
            starts.append(loop.time())
            if len(starts) < 3:
                queue.add(key)  # something new arrived during the run

        queue: WorkQueue[str] = WorkQueue(work, min_interval=0.2, error_delay=1.0)
        queue.add("a")
        await settle(queue)
        return starts

    starts = run(scenario())
    assert len(starts) == 3
    assert all(later - earlier >= 0.19 for earlier, later in itertools.pairwise(starts))


def test_a_delayed_retry_is_replaced_by_an_earlier_one_and_a_failure_retries() -> None:
    async def scenario() -> tuple[list[float], float]:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        starts: list[float] = []

        async def work(key: str) -> float | None:
            starts.append(loop.time() - t0)
            if len(starts) == 1:
                raise RuntimeError("a bug")  # retried after error_delay
            return None

        queue: WorkQueue[str] = WorkQueue(work, min_interval=0.0, error_delay=0.1)
        queue.add("a", after=5.0)
        queue.add("a", after=0.05)  # earlier: wins
        await asyncio.sleep(0.4)
        await settle(queue)
        queue.close()
        return starts, loop.time() - t0

    starts, _ = run(scenario())
    assert len(starts) == 2
    assert 0.04 <= starts[0] < 1.0 and starts[1] - starts[0] >= 0.09


def test_the_token_bucket_allows_a_burst_then_its_rate() -> None:
    async def scenario() -> list[float]:
        loop = asyncio.get_running_loop()
        bucket = TokenBucket(rate=20.0, burst=5)
        t0 = loop.time()
        times = []
        for _ in range(15):
            await bucket.acquire()
            times.append(loop.time() - t0)
        return times

    times = run(scenario())
    assert times[4] < 0.05  # the burst
    assert 0.45 <= times[-1] < 1.0  # then 10 more at 20 a second


# -- what the watches saw ----------------------------------------------------------------------------------


def test_an_older_event_never_replaces_a_newer_object() -> None:
    observed = Observed()
    meta = {"name": "ppo", "namespace": NS, "uid": "u1"}
    observed.job(JobView.parse({"metadata": {**meta, "resourceVersion": "12", "managedFields": [{"manager": "x"}]}}))
    observed.job(JobView.parse({"metadata": {**meta, "resourceVersion": "9"}}))
    assert observed.jobs[(NS, "ppo")].resource_version == 12
    assert "managedFields" not in observed.jobs[(NS, "ppo")].body["metadata"]
    # a job recreated under the same name is a new object, whatever its resourceVersion
    assert JobView.parse({"metadata": {**meta, "uid": "u2", "resourceVersion": "3"}}).newer_than(
        observed.jobs[(NS, "ppo")])
    rayjob = {"metadata": {**meta, "resourceVersion": "12"}}
    assert not newer({"metadata": {**meta, "resourceVersion": "9"}}, rayjob)


def test_pods_are_kept_by_their_job_and_forgotten_when_deleted() -> None:
    observed = Observed()
    pod = {"metadata": {"name": "ppo-head", "namespace": NS, "labels": {names.JOB_LABEL: "ppo"}},
           "spec": {"containers": [{"name": "ray-head"}]}, "status": {"phase": "Pending"}}
    assert observed.pod(pod) == (NS, "ppo")
    assert observed.pods[(NS, "ppo")]["ppo-head"] == {"metadata": {"name": "ppo-head"},
                                                       "status": {"phase": "Pending", "conditions": []}}
    observed.pod(pod, deleted=True)
    assert (NS, "ppo") not in observed.pods
    assert observed.pod({"metadata": {"name": "other", "namespace": NS}}) is None  # not a job's pod


# -- the reconciler ---------------------------------------------------------------------------------------


def test_a_new_job_costs_five_creates_and_one_status_write_its_rayjob_urgent() -> None:
    async def scenario() -> Loop:
        loop = Loop(MemoryKube())
        loop.job_event(new_job(loop.kube), "ADDED")
        await loop.settle()
        return loop

    loop = run(scenario())
    assert sorted(loop.kube.verbs()) == sorted([
        ("create", "ConfigMap"), ("create", "ServiceAccount"), ("create", "Role"), ("create", "RoleBinding"),
        ("create", "RayJob"), ("patch-status", "RLTrainingJob"),
    ])
    job = loop.stored_job()
    assert job["status"]["rayJobName"] == names.rayjob_name("ppo")
    assert job["status"]["observedGeneration"] == 1
    assert condition(job, "Reconciling")["status"] == "True"
    (created,) = [e for e in loop.events if e[1] == "Created"]
    assert created[0] == "Normal" and "RayJob/" in created[2] and "ConfigMap/" in created[2]
    # the ServiceAccount, then the RayJob, as urgent requests: ahead of any job's other children
    assert loop.kube.urgent == [("create", "ServiceAccount"), ("create", "RayJob")]
    creates = [kind for verb, kind in loop.kube.verbs() if verb == "create"]
    assert creates.index("ServiceAccount") < creates.index("RayJob")


def test_no_rayjob_before_its_service_account_exists() -> None:
    """KubeRay would create pods that the ServiceAccount admission refuses."""
    async def scenario() -> tuple[Loop, float | None]:
        loop = Loop(MemoryKube())
        loop.kube.refuse[("create", "ServiceAccount")] = api_error(500)
        key = loop.observe_job(new_job(loop.kube))
        return loop, await loop.reconciler.process(key)

    loop, retry = run(scenario())
    assert retry == RETRY_DELAY_S
    assert ("create", "RayJob") not in loop.kube.verbs()
    assert {("create", "ConfigMap"), ("create", "Role"), ("create", "RoleBinding")} <= set(loop.kube.verbs())


def test_a_jobs_events_wait_for_its_status_write_slot() -> None:
    async def scenario() -> tuple[Loop, list[tuple[str, int]]]:
        loop = Loop(MemoryKube(), status_writes_per_s=2.0, spin_up_jobs=1)
        for i in range(30):  # clusters starting: reports go at 1 a second after a burst of two
            loop.reconciler.observed.rayjob({"metadata": {"name": f"other-{i}", "namespace": NS, "uid": f"o{i}",
                                                          "resourceVersion": "1",
                                                          "labels": {names.JOB_LABEL: f"other-{i}"}}})
        posted: list[tuple[str, int]] = []  # (Event reason, status writes of that job when it was posted)

        def post(ref: Mapping[str, Any], kind: str, reason: str, message: str) -> None:
            job = ref["metadata"]["name"]
            posted.append((reason, sum(1 for v, k, n in loop.kube.requests if v == "patch-status" and n == job)))

        loop.reconciler.post_event = post
        for i in range(3):
            loop.job_event(new_job(loop.kube, f"job-{i}"), "ADDED")
        await loop.settle()
        return loop, posted

    loop, posted = run(scenario())
    assert loop.kube.verbs().count(("create", "RayJob")) == 3
    assert posted == [("Created", 1)] * 3  # each job's Created Event comes with its first status, not before


def test_events_after_the_job_was_applied_cost_no_requests() -> None:
    async def scenario() -> Loop:
        loop = Loop(MemoryKube())
        loop.job_event(new_job(loop.kube), "ADDED")
        await loop.settle()
        loop.kube.requests.clear()
        loop.job_event(loop.stored_job(), "MODIFIED")  # its own status write coming back
        loop.reconciler.rayjob_event(loop.rayjob(), "ADDED")
        await loop.settle()
        return loop

    loop = run(scenario())
    assert loop.kube.requests == []


def test_status_writes_of_many_jobs_are_rate_limited_and_merge_changes() -> None:
    async def scenario() -> tuple[Loop, float]:
        loop = Loop(MemoryKube(), status_writes_per_s=10.0)
        t0 = asyncio.get_running_loop().time()
        for i in range(20):
            loop.job_event(new_job(loop.kube, f"job-{i}"), "ADDED")
        await loop.settle()
        return loop, asyncio.get_running_loop().time() - t0

    loop, elapsed = run(scenario())
    assert loop.kube.verbs().count(("create", "RayJob")) == 20  # creates are never held back
    assert loop.kube.verbs().count(("patch-status", "RLTrainingJob")) == 20
    assert elapsed >= 0.9  # 10 at once, then 10 more at 10 a second


@pytest.mark.parametrize(("starting", "running", "rate"), [(0, 50, 10.0), (10, 0, 10.0), (20, 5, 5.0), (100, 0, 1.0),
                                                            (500, 0, 1.0)])
def test_status_writes_slow_down_while_many_ray_clusters_start(starting: int, running: int, rate: float) -> None:
    loop = Loop(MemoryKube(), status_writes_per_s=10.0, spin_up_jobs=10)
    for i in range(starting + running):
        deployment = "Initializing" if i < starting else "Running"
        loop.reconciler.observed.rayjob({
            "metadata": {"name": f"job-{i}", "namespace": NS, "uid": f"u{i}", "resourceVersion": "1",
                         "labels": {names.JOB_LABEL: f"job-{i}"}},
            "status": {"jobDeploymentStatus": deployment} if i % 2 or deployment == "Running" else {},
        })
    assert loop.reconciler.status_write_rate() == pytest.approx(rate)


def test_first_statuses_too_wait_while_many_clusters_start_and_creates_do_not() -> None:
    async def scenario() -> tuple[Loop, float, float]:
        loop = Loop(MemoryKube(), status_writes_per_s=2.0, spin_up_jobs=1)
        for i in range(30):  # thirty clusters starting: status writes go at 1 a second
            loop.reconciler.observed.rayjob({"metadata": {"name": f"other-{i}", "namespace": NS, "uid": f"o{i}",
                                                          "resourceVersion": "1",
                                                          "labels": {names.JOB_LABEL: f"other-{i}"}}})
        clock = asyncio.get_running_loop().time
        t0 = clock()
        for i in range(4):
            loop.job_event(new_job(loop.kube, f"job-{i}"), "ADDED")
        while loop.kube.verbs().count(("create", "RayJob")) < 4:
            await asyncio.sleep(0.005)
        created = clock() - t0
        await loop.settle()
        return loop, created, clock() - t0

    loop, created, elapsed = run(scenario())
    verbs = loop.kube.verbs()
    creates = [i for i, v in enumerate(verbs) if v == ("create", "RayJob")]
    statuses = [i for i, v in enumerate(verbs) if v == ("patch-status", "RLTrainingJob")]
    # every job's children at once: all four RayJobs before the statuses that wait for the rate (a burst of two)
    assert len(creates) == 4 and creates[-1] < statuses[2], verbs
    assert created < elapsed - 1.0
    assert len(statuses) == 4
    assert elapsed >= 1.9  # a burst of two, then one a second: the API server shows the others as not yet observed
    assert "get" not in {verb for verb, _ in loop.kube.verbs()}  # the default status is not one the operator wrote


def test_a_burst_of_pod_events_costs_at_most_a_write_per_interval() -> None:
    async def scenario() -> tuple[Loop, int, float]:
        loop = Loop(MemoryKube(), status_min_interval=INTERVAL)
        loop.job_event(new_job(loop.kube), "ADDED")
        await loop.settle()
        loop.kube.requests.clear()
        runs = 0
        process = loop.reconciler.process

        async def counted(key: tuple[str, str]) -> float | None:
            nonlocal runs
            runs += 1
            return await process(key)

        loop.reconciler.queue._work = counted
        unschedulable = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                         "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."}
        t0 = time.monotonic()
        for i in range(30):
            pod = {"metadata": {"name": f"ppo-worker-{i % 3}", "namespace": NS, "labels": {names.JOB_LABEL: "ppo"}},
                   "status": {"phase": "Pending", "conditions": [unschedulable]}}
            loop.reconciler.pod_event(pod, "MODIFIED")
            await asyncio.sleep(0.005)
        burst = time.monotonic() - t0
        await loop.settle()
        return loop, runs, burst

    INTERVAL = 0.2
    loop, runs, burst = run(scenario())
    # 30 events over ~0.15 s: one run, then at most one per interval (more intervals pass on a slow machine)
    assert runs <= 2 + int(burst / INTERVAL)
    assert set(loop.kube.verbs()) == {("patch-status", "RLTrainingJob")} and len(loop.kube.verbs()) <= runs
    reconciling = condition(loop.stored_job(), "Reconciling")
    assert reconciling["reason"] == "Unschedulable" and reconciling["message"].startswith("3 pod(s) unschedulable")


def test_runs_wait_until_every_source_of_children_has_been_listed() -> None:
    """After a restart, the first status already knows the unbound pods the informer lists."""
    async def scenario() -> tuple[Loop, list[tuple[str, str]]]:
        loop = Loop(MemoryKube())
        listed = asyncio.Event()
        loop.reconciler.follows(listed)
        loop.job_event(new_job(loop.kube), "ADDED")
        await asyncio.sleep(0.05)
        before = loop.kube.verbs()
        unschedulable = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                         "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."}
        loop.reconciler.pod_event({"metadata": {"name": "ppo-worker-0", "namespace": NS,
                                                "labels": {names.JOB_LABEL: "ppo"}},
                                   "status": {"phase": "Pending", "conditions": [unschedulable]}}, "ADDED")
        listed.set()
        await loop.settle()
        return loop, before

    loop, before = run(scenario())
    assert before == []  # nothing while the pods were not listed yet
    assert loop.kube.verbs().count(("patch-status", "RLTrainingJob")) == 1
    assert condition(loop.stored_job(), "Reconciling")["reason"] == "Unschedulable"


def test_a_deleted_rayjob_is_recreated_after_reading_the_job_again() -> None:
    async def scenario() -> Loop:
        loop = Loop(MemoryKube())
        loop.job_event(new_job(loop.kube), "ADDED")
        await loop.settle()
        lost = loop.rayjob()
        assert lost is not None
        del loop.kube.objects[("RayJob", NS, lost["metadata"]["name"])]
        loop.kube.requests.clear()
        loop.reconciler.rayjob_event(lost, "DELETED")
        await loop.settle()
        return loop

    loop = run(scenario())
    assert loop.kube.requests[0] == ("get", "RLTrainingJob", "ppo")
    assert ("create", "RayJob", names.rayjob_name("ppo")) in loop.kube.requests
    assert ("create", "ConfigMap", names.config_map_name("ppo")) not in loop.kube.requests  # checked, not recreated
    assert loop.rayjob() is not None


async def edited_rayjob(loop: Loop, path: tuple[str, ...], value: Any) -> None:
    """Someone else edits the job's RayJob after the operator applied it; the watch delivers the change."""
    rayjob = loop.rayjob()
    assert rayjob is not None
    edited = copy.deepcopy(rayjob)
    *parents, last = path
    target = edited
    for part in parents:
        target = target[part]
    target[last] = value
    stored = loop.kube.put(edited)
    loop.kube.requests.clear()
    loop.reconciler.rayjob_event(stored, "MODIFIED")
    await loop.settle()


def test_a_foreign_edit_of_the_rayjobs_ttl_is_restored() -> None:
    async def scenario() -> tuple[Loop, Any]:
        loop = Loop(MemoryKube())
        loop.job_event(new_job(loop.kube), "ADDED")
        await loop.settle()
        rayjob = loop.rayjob()
        assert rayjob is not None
        ttl = rayjob["spec"]["ttlSecondsAfterFinished"]
        await edited_rayjob(loop, ("spec", "ttlSecondsAfterFinished"), ttl + 999)
        return loop, ttl

    loop, ttl = run(scenario())
    assert ("patch", "RayJob", names.rayjob_name("ppo")) in loop.kube.requests
    assert ("create", "RayJob", names.rayjob_name("ppo")) not in loop.kube.requests
    rayjob = loop.rayjob()
    assert rayjob is not None and rayjob["spec"]["ttlSecondsAfterFinished"] == ttl


def test_a_foreign_suspend_of_the_rayjob_stands_and_costs_no_request() -> None:
    async def scenario() -> Loop:
        loop = Loop(MemoryKube())
        loop.job_event(new_job(loop.kube), "ADDED")
        await loop.settle()
        await edited_rayjob(loop, ("spec", "suspend"), True)  # Kueue preempting the workload
        return loop

    loop = run(scenario())
    assert [r for r in loop.kube.requests if r[0] != "patch-status"] == []
    rayjob = loop.rayjob()
    assert rayjob is not None and rayjob["spec"]["suspend"] is True


def test_a_rayjob_that_lost_the_job_label_gets_it_back() -> None:
    async def scenario() -> Loop:
        loop = Loop(MemoryKube())
        loop.job_event(new_job(loop.kube), "ADDED")
        await loop.settle()
        rayjob = loop.rayjob()
        assert rayjob is not None
        unlabelled = copy.deepcopy(rayjob)
        del unlabelled["metadata"]["labels"][names.JOB_LABEL]
        loop.kube.put(unlabelled)
        loop.kube.requests.clear()
        loop.reconciler.rayjob_event(rayjob, "DELETED")  # the label-selected watch no longer sees it
        await loop.settle()
        return loop

    loop = run(scenario())
    assert ("patch", "RayJob", names.rayjob_name("ppo")) in loop.kube.requests
    assert ("create", "RayJob", names.rayjob_name("ppo")) not in loop.kube.requests  # read first: it still exists
    rayjob = loop.rayjob()
    assert rayjob is not None and rayjob["metadata"]["labels"][names.JOB_LABEL] == "ppo"


def test_a_finished_jobs_rayjob_is_not_started_again() -> None:
    async def scenario() -> Loop:
        loop = Loop(MemoryKube())
        loop.job_event(new_job(loop.kube), "ADDED")
        await loop.settle()
        job = loop.stored_job()
        for c in job["status"]["conditions"]:
            if c["type"] == "Succeeded":
                c["status"] = "True"
        finished = loop.kube.put(job)
        loop.job_event(finished, "MODIFIED")
        lost = loop.rayjob()
        assert lost is not None
        del loop.kube.objects[("RayJob", NS, lost["metadata"]["name"])]
        loop.reconciler.rayjob_event(lost, "DELETED")
        await loop.settle()
        return loop

    loop = run(scenario())
    assert loop.rayjob() is None


def test_an_unrenderable_spec_stalls_once_and_is_not_retried() -> None:
    async def scenario() -> Loop:
        loop = Loop(MemoryKube(), gpu_products={"H100-80GB": ("NVIDIA-H100-80GB-HBM3",)})  # no A100 here
        loop.job_event(new_job(loop.kube), "ADDED")
        await loop.settle()
        for _ in range(3):
            loop.job_event(loop.stored_job(), "MODIFIED")
            await loop.settle()
        return loop

    loop = run(scenario())
    assert loop.kube.verbs() == [("patch-status", "RLTrainingJob")]
    job = loop.stored_job()
    assert condition(job, "Stalled")["status"] == "True" and job["status"]["phase"] == "Stalled"
    assert [e[:2] for e in loop.events] == [("Warning", condition(job, "Stalled")["reason"])]


def test_a_graph_that_cannot_train_stalls_on_spec_graph_before_any_child_exists() -> None:
    async def scenario() -> Loop:
        loop = Loop(MemoryKube())
        graph = {"nodes": [{"name": "actor", "role": "actor_rollout", "resources": {"GPU": 1}, "pool": "actor"},
                           {"name": "critic", "role": "critic", "resources": {"GPU": 1}, "pool": "critic"}],
                 "edges": [{"src": "actor", "dst": "critic", "dataType": "rollout_batch"},
                           {"src": "critic", "dst": "actor", "dataType": "updated_policy", "control": True}]}
        loop.job_event(new_job(loop.kube, graph=graph), "ADDED")  # PPO without a reward node
        await loop.settle()
        return loop

    loop = run(scenario())
    assert loop.kube.verbs() == [("patch-status", "RLTrainingJob")]  # no create of any child
    stalled = condition(loop.stored_job(), "Stalled")
    assert (stalled["status"], stalled["reason"]) == ("True", "InvalidGraph")
    assert stalled["message"].startswith("spec.graph: ") and "ppo needs a node with role reward" in stalled["message"]


def test_each_training_rule_stalls_the_job_with_its_message(broken) -> None:
    doc, needle = broken

    async def scenario() -> Loop:
        loop = Loop(MemoryKube())
        doc["metadata"].update(name="ppo", namespace=NS, generation=1)
        doc["status"] = {"observedGeneration": 0, "restarts": 0}
        loop.job_event(loop.kube.put(doc), "ADDED")
        await loop.settle()
        return loop

    loop = run(scenario())
    assert loop.kube.verbs() == [("patch-status", "RLTrainingJob")]  # no child created
    stalled = condition(loop.stored_job(), "Stalled")
    assert (stalled["status"], stalled["reason"]) == ("True", "InvalidGraph")
    assert needle.removeprefix("spec.graph: ") in stalled["message"], stalled["message"]


def terminating_refusal(namespace: str, kind: str, name: str, *, with_cause: bool = True) -> ApiException:
    """The API server's answer to a create in a namespace being deleted (NamespaceLifecycle admission)."""
    body: dict[str, Any] = {
        "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden", "code": 403,
        "message": f'{kind.lower()}s "{name}" is forbidden: unable to create new content in namespace {namespace} '
                   "because it is being terminated",
        "details": {"name": name, "kind": f"{kind.lower()}s"},
    }
    if with_cause:
        body["details"]["causes"] = [{"reason": "NamespaceTerminating", "field": "metadata.namespace",
                                      "message": f"namespace {namespace} is being terminated"}]
    return api_error(403, body)


class NamespacedKube(MemoryKube):
    """A MemoryKube whose `terminating` namespaces refuse every create, as a namespace being deleted does."""

    def __init__(self, *, with_cause: bool = True) -> None:
        super().__init__()
        self.terminating: set[str] = set()
        self.with_cause = with_cause

    async def create(self, obj: Mapping[str, Any], *, urgent: bool = False) -> dict:
        meta = obj["metadata"]
        if meta["namespace"] in self.terminating:
            self._serve("create", obj["kind"], meta["name"], urgent)
            raise terminating_refusal(meta["namespace"], obj["kind"], meta["name"], with_cause=self.with_cause)
        return await super().create(obj, urgent=urgent)

    def creates(self) -> int:
        return sum(1 for verb, _, _ in self.requests if verb == "create")


def new_job_in(kube: MemoryKube, namespace: str, name: str = "ppo") -> dict:
    doc = new_job(MemoryKube(), name)
    doc["metadata"]["namespace"] = namespace
    return kube.put(doc)


@pytest.mark.parametrize("with_cause", [True, False], ids=["cause", "message-only"])
def test_a_terminating_namespace_stops_its_jobs_without_retries(with_cause: bool) -> None:
    """No retry, no status write, no Event; and no further creates, whatever events follow."""

    async def scenario() -> tuple[Loop, float | None, int]:
        loop = Loop(NamespacedKube(with_cause=with_cause))
        loop.kube.terminating.add(NS)
        key = loop.observe_job(new_job(loop.kube))
        retry = await loop.reconciler.process(key)
        first = loop.kube.creates()
        # what follows while the namespace goes: its objects deleted, pods going, the job touched, a resync
        rayjob = {"apiVersion": "ray.io/v1", "kind": "RayJob",
                  "metadata": {"name": names.rayjob_name("ppo"), "namespace": NS, "uid": "r1",
                               "labels": names.labels("ppo")}}
        loop.reconciler.rayjob_event(rayjob, "DELETED")
        loop.reconciler.pod_event({"metadata": {"name": "ppo-head", "namespace": NS, "labels": names.labels("ppo")},
                                   "status": {}}, "MODIFIED")
        loop.job_event(loop.stored_job(), "MODIFIED")
        loop.reconciler._applied.clear()  # as the safety-net resync does
        loop.reconciler.queue.add(key)
        await loop.settle()
        return loop, retry, first

    loop, retry, first = run(scenario())
    assert retry is None
    assert 1 <= first <= 5, "one attempt per child at most"
    assert loop.kube.creates() == first, f"created again after the refusal: {loop.kube.requests}"
    assert ("get", "RLTrainingJob", "ppo") not in loop.kube.requests  # not even read again
    assert ("patch-status", "RLTrainingJob") not in loop.kube.verbs() and loop.events == []


def test_a_terminating_namespace_wins_over_other_errors_of_the_same_run() -> None:
    async def scenario() -> float | None:
        loop = Loop(NamespacedKube())
        loop.kube.refuse[("create", "ServiceAccount")] = terminating_refusal(NS, "ServiceAccount", "ppo-runtime")
        loop.kube.refuse[("create", "RayJob")] = api_error(500)
        key = loop.observe_job(new_job(loop.kube))
        return await loop.reconciler.process(key)

    assert run(scenario()) is None


def test_other_namespaces_and_a_recreated_namespace_are_reconciled() -> None:
    async def scenario() -> tuple[Loop, int, int]:
        loop = Loop(NamespacedKube())
        loop.kube.terminating.add(NS)  # team-a is going, team-b is not
        going = new_job(loop.kube)
        loop.job_event(going, "ADDED")
        loop.job_event(new_job_in(loop.kube, "team-b"), "ADDED")
        await loop.settle()
        other = sum(1 for verb, kind, _ in loop.kube.requests if verb == "create" and kind == "RayJob")
        # the namespace finishes deleting, and a namespace of the same name is created with a new job in it
        loop.job_event(going, "DELETED")
        del loop.kube.objects[("RLTrainingJob", NS, "ppo")]
        loop.kube.terminating.discard(NS)
        loop.kube.requests.clear()
        loop.job_event(new_job(loop.kube), "ADDED")
        await loop.settle()
        again = sum(1 for verb, kind, _ in loop.kube.requests if verb == "create" and kind == "RayJob")
        return loop, other, again

    loop, other, again = run(scenario())
    assert other == 1 and ("RayJob", "team-b", names.rayjob_name("ppo")) in loop.kube.objects
    assert again == 1 and loop.rayjob() is not None


def test_a_job_deleted_while_its_children_were_refused_leaves_no_mark_on_the_namespace() -> None:
    async def scenario() -> Loop:
        loop = Loop(NamespacedKube())
        loop.kube.terminating.add(NS)
        job = new_job(loop.kube)
        key = loop.observe_job(job)
        refuse = loop.kube.create

        async def create_after_the_job_went(obj: Mapping[str, Any], *, urgent: bool = False) -> dict:
            loop.job_event(job, "DELETED")  # the DELETED event lands while the create is in flight
            return await refuse(obj, urgent=urgent)

        loop.kube.create = create_after_the_job_went  # type: ignore[method-assign]
        assert await loop.reconciler.process(key) is None
        loop.kube.create = refuse  # type: ignore[method-assign]
        await loop.settle()
        loop.kube.terminating.discard(NS)  # a new namespace of the same name
        del loop.kube.objects[("RLTrainingJob", NS, "ppo")]
        loop.job_event(new_job(loop.kube), "ADDED")
        await loop.settle()
        return loop

    assert run(scenario()).rayjob() is not None


def test_an_api_error_retries_later() -> None:
    async def scenario() -> float | None:
        loop = Loop(MemoryKube())
        loop.kube.refuse[("create", "RayJob")] = api_error(500)
        key = loop.observe_job(new_job(loop.kube))
        return await loop.reconciler.process(key)

    assert run(scenario()) == RETRY_DELAY_S


def test_an_unreachable_api_server_retries_later_with_one_warning_line(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> float | None:
        loop = Loop(MemoryKube())
        loop.kube.refuse[("create", "RayJob")] = aiohttp.ServerDisconnectedError()
        key = loop.observe_job(new_job(loop.kube))
        return await loop.reconciler.process(key)

    with caplog.at_level(logging.WARNING):
        assert run(scenario()) == RETRY_DELAY_S
    (record,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert record.levelno == logging.WARNING and record.exc_info is None
    assert "no answer: ServerDisconnectedError" in record.getMessage()


def test_a_status_conflict_is_recomputed_from_the_job_read_again() -> None:
    async def scenario() -> Loop:
        loop = Loop(MemoryKube())
        stale = new_job(loop.kube)
        # someone else (the runtime's progress reporter) writes after the event was seen
        loop.kube.put({**stale, "status": {"progress": {"step": 3}}})
        loop.job_event(stale, "ADDED")
        await loop.settle()
        return loop

    loop = run(scenario())
    assert loop.kube.verbs().count(("patch-status", "RLTrainingJob")) == 2
    assert ("get", "RLTrainingJob") in loop.kube.verbs()
    job = loop.stored_job()
    assert job["status"]["progress"] == {"step": 3} and job["status"]["rayJobName"]


@pytest.mark.parametrize("event_type", ["DELETED", None])
def test_a_deleted_or_deleting_job_is_forgotten(event_type: str | None) -> None:
    async def scenario() -> Loop:
        loop = Loop(MemoryKube())
        job = new_job(loop.kube)
        if event_type is None:
            job["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        loop.job_event(job, event_type)
        await loop.settle()
        return loop

    loop = run(scenario())
    assert loop.kube.requests == []
    kept = loop.reconciler.observed.jobs.get((NS, "ppo"))
    assert kept is None or kept.deleting



# -- Events --------------------------------------------------------------------------------------------------


def test_an_event_names_the_job_and_normal_ones_follow_the_event_level() -> None:
    ref = {"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLTrainingJob",
           "metadata": {"name": "ppo", "namespace": NS, "uid": "u1"}}
    body = event_body(ref, "Warning", "InvalidGraph", "x" * 5000, "2026-01-01T00:00:00Z")
    assert body["involvedObject"] == {"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLTrainingJob",
                                      "name": "ppo", "namespace": NS, "uid": "u1"}
    assert body["metadata"] == {"namespace": NS, "generateName": "ppo."} and len(body["message"]) == 1024

    class Recorder:
        def __init__(self) -> None:
            self.created: list[dict] = []

        async def create(self, obj: dict) -> dict:
            self.created.append(obj)
            return obj

    async def scenario() -> list[dict]:
        kube = Recorder()
        poster = EventPoster(kube, logging.WARNING)  # type: ignore[arg-type]
        poster(ref, "Normal", "Created", "created RayJob/ppo")
        poster(ref, "Warning", "InvalidGraph", "spec.graph: ...")
        await poster.close()
        return kube.created

    assert [(e["type"], e["reason"]) for e in run(scenario())] == [("Warning", "InvalidGraph")]


def test_an_event_refused_by_a_terminating_namespace_is_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    ref = {"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLTrainingJob",
           "metadata": {"name": "ppo", "namespace": NS, "uid": "u1"}}

    class Refusing:
        def __init__(self, error: ApiException) -> None:
            self.error = error

        async def create(self, obj: dict) -> dict:
            raise self.error

    async def scenario(error: ApiException) -> None:
        poster = EventPoster(Refusing(error), logging.INFO)  # type: ignore[arg-type]
        poster(ref, "Warning", "InvalidGraph", "spec.graph: ...")
        await poster.close()

    with caplog.at_level(logging.WARNING, logger="hybridflow_operator.events"):
        run(scenario(terminating_refusal(NS, "Event", "ppo.1")))
        assert caplog.records == []
        run(scenario(api_error(500)))
        assert [r.levelname for r in caplog.records] == ["WARNING"]
