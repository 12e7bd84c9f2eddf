"""Live control of a running job from outside it, on several real raylets: `connect`, `hybridflow ctl`.

One job trains in a background thread for the whole module (the driver, as `hybridflow train` runs it);
the tests reach it only through its named controller, as another process would. They run in order:
the last one kills the controller's process and checks that the manual parallelism came back.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import yaml
from ray.cluster_utils import Cluster

import hybridflow
from hybridflow.api import parse_job
from hybridflow.control import ControlError, JobHandle
from hybridflow.driver import TrainingFailed, run_training
from tests.conftest import ROOT
from tests.helpers import TrainingThread, pooled_ppo_graph, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

NAMESPACE, NAME = "team-a", "ctl-ppo"
JOB = f"{NAMESPACE}/{NAME}"
PYTHONPATH = os.pathsep.join([str(ROOT / "runtime"), str(ROOT)])


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for _ in range(2):
        c.add_node(num_cpus=3)
    c.wait_for_nodes()
    ray.init(address=c.address, runtime_env={"env_vars": {"PYTHONPATH": PYTHONPATH,
                                                          "HYBRIDFLOW_TORCH_THREADS": "1"}})
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def run(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TrainingThread]:
    tmp = tmp_path_factory.mktemp("control")
    doc = yaml.safe_load((ROOT / "examples" / "tiny-ppo.yaml").read_text())
    doc["metadata"].update(name=NAME, namespace=NAMESPACE)
    doc["spec"]["graph"] = pooled_ppo_graph()
    doc["spec"]["reward"]["function"] = "tests.slow_reward:score"  # ~0.5 s a step: the machine stays usable
    doc["spec"]["data"]["batchSize"] = 16
    doc["spec"]["algorithm"]["miniBatchSize"] = 8
    doc["spec"]["trainer"].update(totalSteps=100_000, resume="auto", workerMaxRestarts=1,
                                  checkpoint={"every": 2, "path": str(tmp / "ckpt")})
    # every observation of the reward queue (one chunk a step) is "low": backpressure would walk a raised
    # reward node back at once, unless a manual change moved the level it relaxes toward
    doc["spec"]["scheduling"] = {"placementTimeoutSeconds": 60, "queueHighWatermark": 4, "backpressureWindow": 1}
    r = TrainingThread(parse_job(doc), tmp / "metrics.jsonl")
    r.thread.start()
    wait_for(lambda: len(r.steps()) >= 1 or r.error is not None, 300, "the first step")
    assert r.error is None, r.error
    yield r
    # the end: a controller killed for good fails the run (one restart was allowed and used)
    ray.kill(ray.get_actor(f"controller/{JOB}", namespace="hybridflow"), no_restart=True)
    r.thread.join(timeout=240)
    assert isinstance(r.error, TrainingFailed), r.error


@pytest.fixture
def handle(run: TrainingThread) -> JobHandle:
    return hybridflow.connect(JOB)


def parallelism(status: dict[str, Any]) -> dict[str, int]:
    return {n: v["parallelism"] for n, v in status["nodes"].items()}


def manual(status: dict[str, Any]) -> list[str]:
    return [d for d in status["decisions"] if d.startswith("Manual:")]


def ctl(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([sys.executable, "-m", "hybridflow", "ctl", *args, "--address", cluster.address],
                          capture_output=True, text=True, timeout=180, env=env)


def test_status_from_outside_while_it_trains(run: TrainingThread) -> None:
    handle = hybridflow.connect(NAME, namespace=NAMESPACE)
    first = handle.scheduler.get_status()
    assert first["job"] == JOB and first["total_steps"] == 100_000
    assert parallelism(first) == {"actor_rollout": 1, "reference": 1, "reward": 1, "critic": 1}
    assert first["nodes"]["critic"]["data_parallel"] and not first["nodes"]["actor_rollout"]["data_parallel"]
    assert first["nodes"]["reward"]["workers"][0]["pid"] > 0
    assert "actor_rollout->reward" in first["edges"]
    assert any(d.startswith("Scheduling decision: co-located actor_rollout_0 and reference_0")
               for d in first["decisions"])
    wait_for(lambda: handle.scheduler.get_status()["step"] > first["step"], 120, "the step to advance")


def test_scale_a_reward_node_up_and_down(run: TrainingThread, handle: JobHandle) -> None:
    assert handle.scheduler.adjust_parallelism("reward", 2, "more scoring") == 2
    status = handle.scheduler.get_status()
    assert parallelism(status)["reward"] == 2 and len(status["nodes"]["reward"]["workers"]) == 2
    assert "Manual: reward parallelism 1 -> 2 (more scoring)" in status["decisions"]
    assert status["manual"]["targets"] == {"reward": 2}
    assert status["manual"]["history"][-1] | {"time": ""} == {"time": "", "kind": "parallelism", "node": "reward",
                                                              "old": 1, "new": 2, "reason": "more scoring"}
    at = status["step"]
    wait_for(lambda: handle.scheduler.get_status()["step"] >= at + 2, 120, "two steps with two scorers")
    status = handle.scheduler.get_status()
    assert parallelism(status)["reward"] == 2 and status["nodes"]["reward"]["target_parallelism"] == 2
    assert not [d for d in status["decisions"] if d.startswith("Backpressure: reward parallelism 2 -> 1")]
    assert handle.scheduler.adjust_parallelism("reward", 1, "enough") == 1
    status = handle.scheduler.get_status()
    assert parallelism(status)["reward"] == 1
    assert manual(status)[-1] == "Manual: reward parallelism 2 -> 1 (enough)"
    assert status["manual"]["targets"] == {"reward": 1}


def test_scale_the_data_parallel_critic_while_it_trains(run: TrainingThread, handle: JobHandle) -> None:
    assert handle.scheduler.adjust_parallelism("critic", 2, "faster values") == 2
    status = handle.scheduler.get_status()
    assert parallelism(status)["critic"] == 2
    at = status["decisions"].index("Manual: critic parallelism 1 -> 2 (faster values)")
    assert any(d.startswith("Scheduling decision: data-parallel critic: world size 2, master ")
               for d in status["decisions"][at:])
    at = status["step"]
    wait_for(lambda: handle.scheduler.get_status()["step"] >= at + 2, 120, "two steps with two critic ranks")
    assert run.error is None


@pytest.mark.parametrize(("node", "n", "says"), [
    ("nope", 2, "unknown node 'nope'; the graph has actor_rollout, reference, reward, critic"),
    ("reward", 40, "the cluster lacks the resources for 40 instances of reward (39 more bundles): CPU: need 19.5"),
    ("actor_rollout", 2, "actor_rollout cannot change parallelism: its group actor_rollout+reference trains "
                         "(actor_rollout) without data-parallel ranks"),
    ("reference", 2, "reference cannot change parallelism: its group actor_rollout+reference trains"),
    ("critic", 17, "17 ranks of critic need at least one sequence each, but a step has 16"),
    ("reward", 0, "parallelism must be at least 1, got 0"),
])
def test_a_request_that_cannot_be_met_changes_nothing(handle: JobHandle, node: str, n: int, says: str) -> None:
    before = handle.scheduler.get_status()
    with pytest.raises(ControlError) as err:
        handle.scheduler.adjust_parallelism(node, n, "too much")
    assert says in str(err.value)
    after = handle.scheduler.get_status()
    assert parallelism(after) == parallelism(before)
    assert manual(after) == manual(before) and after["manual"] == before["manual"]


def test_connecting_to_a_job_that_does_not_run_names_it_and_the_cluster(run: TrainingThread, cluster: Cluster) -> None:
    with pytest.raises(ControlError) as err:
        hybridflow.connect("team-a/other", address=cluster.address)
    assert str(err.value) == (f"job team-a/other is not running in the Ray cluster at {cluster.address} "
                              "(no actor 'controller/team-a/other' in Ray namespace 'hybridflow')")


def test_a_second_run_of_the_same_job_is_refused(run: TrainingThread) -> None:
    with pytest.raises(TrainingFailed, match=f"job {JOB} is already running in this Ray cluster"):
        run_training(run.job, None)
    assert run.thread.is_alive() and run.error is None


def test_cli_status_and_scale(run: TrainingThread, cluster: Cluster) -> None:
    shown = ctl(cluster, "status", JOB)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith(f"job {JOB}  step ")
    assert any(line.split()[:2] == ["critic", "2"] for line in shown.stdout.splitlines())
    assert "actor_rollout->reward  queue " in shown.stdout and "Manual: critic parallelism 1 -> 2" in shown.stdout

    as_json = ctl(cluster, "status", NAME, "-n", NAMESPACE, "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout)["nodes"]["critic"]["parallelism"] == 2

    scaled = ctl(cluster, "scale", JOB, "reward", "2", "--reason", "from the shell")
    assert scaled.returncode == 0, scaled.stderr
    assert scaled.stdout.strip() == f"{JOB}: reward parallelism 1 -> 2"
    status = hybridflow.connect(JOB).scheduler.get_status()
    assert parallelism(status)["reward"] == 2
    assert manual(status)[-1] == "Manual: reward parallelism 1 -> 2 (from the shell)"


@pytest.mark.parametrize(("args", "says"), [
    (("scale", JOB, "nope", "2"), "error: unknown node 'nope'"),
    (("scale", JOB, "actor_rollout", "3"), "error: actor_rollout cannot change parallelism"),
    (("status", "team-a/other"), "error: job team-a/other is not running in the Ray cluster at "),
    (("status", "a/b/c"), "error: job 'a/b/c': expected NAME or NAMESPACE/NAME"),
])
def test_cli_refusals_are_one_line_and_exit_1(run: TrainingThread, cluster: Cluster, args: tuple[str, ...],
                                              says: str) -> None:
    done = ctl(cluster, *args)
    assert done.returncode == 1
    assert done.stderr.startswith(says) and "Traceback" not in done.stderr, done.stderr
    assert done.stdout == ""


def test_a_restarted_controller_puts_the_manual_parallelism_back(run: TrainingThread, handle: JobHandle) -> None:
    before = handle.scheduler.get_status()
    assert parallelism(before)["critic"] == 2 and parallelism(before)["reward"] == 2
    os.kill(before["controller"]["pid"], signal.SIGKILL)

    def restarted() -> bool:
        try:
            status = handle.scheduler.get_status()
        except ControlError:
            return False
        return status["controller"]["pid"] != before["controller"]["pid"] and status["step"] > before["step"] + 1

    wait_for(restarted, 300, "the restarted controller to train again")
    after = handle.scheduler.get_status()
    assert parallelism(after) == parallelism(before)
    assert after["manual"]["targets"] == {"critic": 2, "reward": 2}
    again = [d for d in manual(after) if "re-applied after a controller restart" in d]
    assert sorted(again) == [
        "Manual: critic parallelism 1 -> 2 (re-applied after a controller restart: faster values)",
        "Manual: reward parallelism 1 -> 2 (re-applied after a controller restart: from the shell)",
    ]
    steps = run.steps()
    assert steps == list(range(1, len(steps) + 1)), "a step was skipped or repeated across the restart"
    assert run.error is None
