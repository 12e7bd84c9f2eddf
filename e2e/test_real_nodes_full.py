"""The full real-node tier: the images of `make images` and the chart's operator running from its image, faults.

- `helm test` of the release: the chart's test pod finds the CRD Established and the operator Available;
- tiny PPO from examples/tiny-ppo-job.yaml as written (runtime image, checkpoints on a claim) to Succeeded,
  through these faults:
  - a second job asking for more GPUs than the node has waits Unschedulable without disturbing the first;
  - the operator pod killed mid-run: nothing is duplicated and the status converges;
  - a worker pod deleted mid-training: KubeRay replaces it, the run rolls back to its last checkpoint and ends
    with every step in the metrics exactly once; the recovery time is measured;
- the head pod deleted mid-run: the RayJob's retry resubmits on a new cluster, which resumes from the claim.

Marker `realnodes_full`: `make test-real-nodes` runs it (CI does, after `make test`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.harness import chart, images
from e2e.harness.controlplane import eventually
from e2e.harness.realcluster import (
    OPERATOR_PROGRESS_INTERVAL,
    RELEASE,
    RELEASE_NAMESPACE,
    RealNodeCluster,
    node_images,
    operator_values,
)
from e2e.realnode_runs import MIN_FINAL_REWARD, TINY_GRPO, TINY_PPO, JobRun, require_real_nodes
from hybridflow.k8s import contract
from hybridflow_operator.install_check import PASSED as INSTALL_CHECK_PASSED
from tests.helpers import condition, env_of, templates_of

pytestmark = [pytest.mark.realnodes_full, pytest.mark.timeout(1800)]

FULL_IMAGES = (images.PAUSE, images.OPERATOR, images.RUNTIME_CPU)


@pytest.fixture(scope="module")
def full_cluster_real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealNodeCluster]:
    """The real-node cluster with the runtime and operator images imported and the chart installed from them."""
    require_real_nodes()
    t0 = time.monotonic()
    built = images.build(FULL_IMAGES)
    build_s = time.monotonic() - t0
    cluster = RealNodeCluster(tmp_path_factory.mktemp("real-full") / "run", node_images(built, FULL_IMAGES),
                              built[images.PAUSE].ref)
    cluster.start()
    try:
        chart.install_chart(cluster, RELEASE, RELEASE_NAMESPACE,
                            operator_values(built[images.OPERATOR].ref, built[images.RUNTIME_CPU].ref))
        # The operator is Available (install_chart waits): the chart's own `helm test` must agree, from its image.
        tested = chart.run_helm_test(cluster, RELEASE, RELEASE_NAMESPACE)
        assert "Phase:          Succeeded" in tested and INSTALL_CHECK_PASSED in tested, tested
        print(f"\nhelm test {RELEASE}:\n{tested}")
        sizes = {n: f"{built[n].size / 2**20:.0f} MiB" for n in FULL_IMAGES}
        print(f"\nimages {sizes} (build/cache {build_s:.0f}s); cluster up {cluster.timings}")
        yield cluster
    finally:
        problems = cluster.stop()
        assert problems == [], problems


def _example(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def _operator_pod(cluster: RealNodeCluster) -> str:
    pods = cluster.get_json("pods", "-n", RELEASE_NAMESPACE, "-l", "app.kubernetes.io/name=hybridflow")["items"]
    running = [p["metadata"]["name"] for p in pods
               if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]
    assert running, f"no running operator pod in {RELEASE_NAMESPACE}"
    return running[0]


def _since(stamp: str | None, t: float) -> str:
    """A Kubernetes timestamp as whole seconds after `t` (wall time), or '?' without one. The stamp drops the
    fraction of its second: one within the second of `t` reads 0."""
    if not stamp:
        return "?"
    return f"{max(0.0, datetime.fromisoformat(stamp.replace('Z', '+00:00')).timestamp() - t):.0f}"


def test_tiny_ppo_on_the_runtime_image_through_faults(full_cluster_real: RealNodeCluster) -> None:
    """The example as written (the runtime image, the operator from its image, checkpoints on the claim) trains
    to the end while an oversize job arrives, the operator pod is killed, then a critic worker pod is deleted."""
    cluster = full_cluster_real
    run = JobRun(cluster, _example(TINY_PPO), "full-ppo")
    big = _example(TINY_PPO)
    big["metadata"]["name"] = "too-big"
    big["spec"]["cluster"]["workerGroups"] = [{"name": "actor", "replicas": 2, "gpusPerWorker": 8,
                                               "cpusPerWorker": "250m", "memory": "2Gi"},
                                              {"name": "critic", "replicas": 1, "gpusPerWorker": 8,
                                               "cpusPerWorker": "250m", "memory": "2Gi"}]
    run.apply()
    cluster.kubectl("apply", "-n", run.namespace, "-f", "-", input=json.dumps(big))
    try:
        _faults(cluster, run)
    finally:  # its pods would take the next job's GPUs once this one's are free
        cluster.kubectl("delete", "rltrainingjob", "too-big", "-n", run.namespace, "--wait=true", check=False)


def _faults(cluster: RealNodeCluster, run: JobRun) -> None:

    run.wait_for_step(10)
    killed = _operator_pod(cluster)
    cluster.kubectl("delete", "pod", killed, "-n", RELEASE_NAMESPACE, "--grace-period=0", "--force")
    eventually(lambda: _operator_pod(cluster) != killed, 180, "a new operator pod running")

    step = run.wait_for_step(30)
    critic_selector = f"ray.io/group=critic,hybridflow.io/job={run.name}"  # not too-big's critic group
    pods = cluster.get_json("pods", "-n", run.namespace, "-l", critic_selector)["items"]
    victim = next(p["metadata"]["name"] for p in pods if p["status"].get("phase") == "Running")
    deleted_at, deleted_wall = time.monotonic(), time.time()
    deleted_stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(deleted_wall - 1))
    cluster.kubectl("delete", "pod", victim, "-n", run.namespace, "--grace-period=0", "--force")
    recovered_s = run.seconds_until_step_after_rollback(deleted_at)
    rolled_back_s = next(t for t in run.rollbacks if t > deleted_at) - deleted_at
    # KubeRay replaced the worker: a critic pod made after the deletion runs, the deleted one is gone.
    def critic_pods() -> list[dict[str, Any]]:
        return cluster.get_json("pods", "-n", run.namespace, "-l", critic_selector)["items"]

    def replacement() -> str | None:
        pods = critic_pods()
        fresh = [p["metadata"]["name"] for p in pods if p["metadata"]["name"] != victim
                 and p["metadata"]["creationTimestamp"] >= deleted_stamp and p["status"].get("phase") == "Running"]
        return fresh[0] if fresh and victim not in {p["metadata"]["name"] for p in pods} else None

    replaced_by = eventually(replacement, 120, f"a running critic pod in place of {victim}")
    pod = cluster.get_json("pod", replaced_by, "-n", run.namespace)
    ready = condition(pod, "Ready") or {}
    print(f"\nworker pod {victim} deleted after step {step}: next completed step {recovered_s:.1f}s later; where the "
          f"time went: metrics rolled back at +{rolled_back_s:.1f}s, replacement {replaced_by} created at "
          f"+{_since(pod['metadata']['creationTimestamp'], deleted_wall)}s and ready at "
          f"+{_since(ready.get('lastTransitionTime'), deleted_wall)}s (whole seconds)")
    # While the first job runs, the oversize one waits with a condition that says why; its workers never ran.
    waiting = cluster.get_json("rltrainingjob", "too-big", "-n", run.namespace)
    unschedulable = [c for c in waiting["status"].get("conditions", []) if c.get("reason") == "Unschedulable"]
    assert unschedulable, waiting["status"]
    assert "nvidia.com/gpu" in unschedulable[0]["message"] or "GPU" in unschedulable[0]["message"]
    workers = cluster.get_json("pods", "-n", run.namespace, "-l",
                               "hybridflow.io/job=too-big,ray.io/node-type=worker")["items"]
    assert workers and all(p["status"].get("phase") == "Pending" for p in workers)
    result = run.to_end()
    result.assert_succeeded(MIN_FINAL_REWARD)

    # Every step in the metrics exactly once, although steps after the last checkpoint ran twice.
    steps = [r["step"] for r in result.metrics()]
    assert steps == list(range(1, 81)), steps
    # The operator restart duplicated nothing.
    for kind in ("rayjobs", "configmaps", "serviceaccounts", "roles", "rolebindings"):
        owned = cluster.get_json(kind, "-n", run.namespace, "-l", f"hybridflow.io/job={run.name}")["items"]
        assert len(owned) == 1, (kind, [o["metadata"]["name"] for o in owned])
    # the chart's progressInterval, through the operator's environment, in every Ray pod of the job
    rayjob = cluster.get_json("rayjob", result.job["status"]["rayJobName"], "-n", run.namespace)
    for template in templates_of(rayjob).values():
        assert env_of(template)[contract.ENV_PROGRESS_INTERVAL] == str(OPERATOR_PROGRESS_INTERVAL), env_of(template)
    print(f"\nPPO on the runtime image: apply->first step {result.first_step_s:.1f}s (before any fault), wall "
          f"{result.wall_s:.1f}s with the faults, final reward {result.final_reward:.3f}; replaced by {replaced_by}; "
          f"operator pod {killed} replaced; too-big: {unschedulable[0]['message'][:120]}")


def test_head_pod_deleted_mid_run_resumes_from_the_claim(full_cluster_real: RealNodeCluster) -> None:
    """The driver dies with the head. The RayJob's retry (runPolicy.backoffLimit) submits again on a new Ray
    cluster, and resume=auto continues from the last checkpoint on the claim. The old controller, orphaned on a
    worker, stops once the GCS has been silent for scheduler.head.LOST_AFTER_S; had it not, the new one's claim
    on the checkpoint directory would fence it off at its next write."""
    job = _example(TINY_GRPO)
    job["spec"]["runPolicy"] = {"backoffLimit": 1}
    run = JobRun(full_cluster_real, job, "head-fault")
    run.apply()
    step = run.wait_for_step(12)
    head = full_cluster_real.get_json("pods", "-n", run.namespace, "-l", "ray.io/node-type=head")["items"]
    deleted_at = time.monotonic()
    full_cluster_real.kubectl("delete", "pod", head[0]["metadata"]["name"], "-n", run.namespace,
                              "--grace-period=0", "--force")
    recovered = run.seconds_until_step_after_claim(deleted_at)
    result = run.to_end()
    assert condition(result.job, "Succeeded")["status"] == "True", result.describe()
    steps = [r["step"] for r in result.metrics()]
    assert steps == list(range(1, 81)), steps
    orphan = [(at, n) for at, n in run.steps if deleted_at < at < run.claims[-1]]
    orphan_s = orphan[-1][0] - deleted_at if orphan else 0.0
    print(f"\nhead pod deleted at step {step}: the resubmitted driver's first step {recovered:.1f}s later; "
          f"the orphaned controller wrote {len(orphan)} more steps, the last {orphan_s:.1f}s after the deletion; "
          f"final reward {result.final_reward:.3f}")
