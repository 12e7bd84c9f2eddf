"""Live control without Ray: the controller's name, job references, the stored targets, the status text."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hybridflow.control import RAY_NAMESPACE, JobRef, controller_name, job_ref
from hybridflow.control.cli import render_status
from hybridflow.control.errors import ControlError
from hybridflow.control.steering import Steering
from hybridflow.control.store import TargetStore
from hybridflow.scheduler.edges import PolicySyncs
from hybridflow.scheduler.hybrid import NAMESPACE


def test_one_name_per_job_in_the_namespace_of_the_host_actors() -> None:
    assert controller_name(job_ref("tiny-ppo")) == "controller/default/tiny-ppo"
    assert controller_name(job_ref("team-a/tiny-ppo")) == "controller/team-a/tiny-ppo"
    assert job_ref("tiny-ppo", "team-a") == job_ref("team-a/tiny-ppo") == JobRef("team-a", "tiny-ppo")
    assert RAY_NAMESPACE == NAMESPACE == "hybridflow"


@pytest.mark.parametrize(("job", "namespace", "says"), [
    ("a/b/c", None, "job 'a/b/c': expected NAME or NAMESPACE/NAME"),
    ("/x", None, "expected NAME or NAMESPACE/NAME"),
    ("team-a/x", "team-b", "job 'team-a/x' names namespace 'team-a', but namespace 'team-b' was given"),
])
def test_bad_job_references_say_why(job: str, namespace: str | None, says: str) -> None:
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
        job_ref(job, namespace)


def test_the_store_keeps_one_target_per_group_and_can_be_put_back(tmp_path: Path) -> None:
    store = TargetStore(tmp_path / "ckpt" / "control.json")
    assert store.targets() == {}
    empty = store.record("reward", [], 1, 3, "slow scoring")
    store.record("critic", [], 1, 2, "values")
    before = store.record("reference", ["actor_rollout"], 1, 2, "")
    store.record("actor_rollout", ["reference"], 2, 4, "grow")
    assert store.targets() == {"reward": 3, "critic": 2, "actor_rollout": 4}
    assert [h["node"] for h in store.read()["history"]] == ["reward", "critic", "reference", "actor_rollout"]
    store.write(before)
    assert store.targets() == {"reward": 3, "critic": 2}
    store.write(empty)
    assert json.loads((tmp_path / "ckpt" / "control.json").read_text())["targets"] == {}
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["control.json"], "a temporary file was left"
    store.clear()
    assert store.read() == {"targets": {}, "sequence_parallel_off": [], "history": []}


def test_the_store_keeps_sequence_parallelism_off_beside_the_targets(tmp_path: Path) -> None:
    store = TargetStore(tmp_path / "control.json")
    store.record("critic", [], 2, 4, "grow")
    before = store.record_sequence_parallel_off("critic", 2, "short prompts")
    assert store.read()["sequence_parallel_off"] == ["critic"] and store.targets() == {"critic": 4}
    last = store.read()["history"][-1]
    assert (last["node"], last["kind"], last["old"], last["new"], last["reason"]) == (
        "critic", "sequence_parallel", 2, 1, "short prompts")
    store.write(before)  # a change that failed is put back
    assert store.read()["sequence_parallel_off"] == [] and store.targets() == {"critic": 4}


def test_status_text_shows_step_nodes_edges_and_the_last_decisions() -> None:
    syncs = PolicySyncs("actor_rollout->actor_rollout", "eventual")
    syncs.record(2, 4096, 0.25, 0)
    syncs.record(3, 1024, 0.75, 1)
    status = {
        "job": "default/tiny", "step": 3, "total_steps": 10,
        "nodes": {
            "actor_rollout": {"parallelism": 1, "planned_parallelism": 1, "queue_len": 0, "group": "actor_rollout"},
            "reward": {"parallelism": 2, "planned_parallelism": 1, "queue_len": 1, "group": "reward"},
        },
        "edges": {"actor_rollout->reward": {"queue_len": 1, "high_watermark": 4,
                                            "latency": {"count": 7, "mean_s": 0.25, "p95_s": 0.5, "max_s": 0.6}}},
        "control_edges": {"actor_rollout->actor_rollout": syncs.status()},
        "decisions": [f"decision {i}" for i in range(12)],
        "manual": {"targets": {"reward": 2}, "history": []},
    }
    text = render_status(status).splitlines()
    assert text[0] == "job default/tiny  step 3/10"
    assert text[2].split() == ["NODE", "PARALLELISM", "PLANNED", "QUEUE", "GROUP"]
    assert text[4].split() == ["reward", "2", "1", "1", "reward", "(manual", "2)"]
    assert text[6] == "  actor_rollout->reward  queue 1/4  transfers 7  latency mean 0.250s p95 0.500s"
    assert text[7] == ("  actor_rollout->actor_rollout  control, eventual  weight syncs 2  policy version 3  lag 1 "
                       "(max 1)  sync mean 0.500s  1024 bytes")
    assert text[8] == "decisions (last 10 of 12):"
    assert text[9:] == [f"  decision {i}" for i in range(2, 12)]


def test_importing_hybridflow_and_its_ctl_command_loads_no_ray() -> None:
    code = ("import sys, hybridflow, hybridflow.cli\nhybridflow.cli.build_parser()\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'torch')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


class _Ranks:
    """The part of HybridScheduler that Steering calls; `adjust_parallelism` fails with `error` when set."""

    def __init__(self, error: BaseException | None) -> None:
        self.error, self.count = error, 2
        self.decisions: list[str] = []

    def parallelism_problem(self, node: str, target: int) -> str | None:
        return None

    def colocated_with(self, node: str) -> tuple[str, ...]:
        return (node,)

    def instance_count(self, node: str) -> int:
        return self.count

    def adjust_parallelism(self, node: str, n: int, reason: str, source: str = "Backpressure") -> int:
        if self.error is not None:
            raise self.error
        self.count = n
        return n


@pytest.mark.parametrize("error", [RuntimeError("a rank died while the ranks were rebuilt"), None])
def test_a_change_that_fails_at_a_safe_point_is_reported_to_the_loop(tmp_path: Path,
                                                                     error: BaseException | None) -> None:
    """The caller gets a ControlError; the loop's hook gets the original error, so it can recover the ranks."""
    told: list[BaseException] = []
    steering = Steering(_Ranks(error), TargetStore(tmp_path / "control.json"),  # type: ignore[arg-type]
                        on_error=told.append)
    steering.open()
    outcome: list[object] = []

    def ask() -> None:
        try:
            outcome.append(steering.request("critic", 3, "grow", wait_s=30))
        except ControlError as e:
            outcome.append(e)

    caller = threading.Thread(target=ask)
    caller.start()
    deadline = time.monotonic() + 30
    while steering.status()["pending"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    steering.serve()
    caller.join(30)
    if error is None:
        assert outcome == [{"node": "critic", "old": 2, "parallelism": 3, "colocated": []}] and told == []
        assert steering.store.targets() == {"critic": 3}
    else:
        assert isinstance(outcome[0], ControlError) and "a rank died" in str(outcome[0])
        assert told == [error]
        assert steering.store.targets() == {}, "a failed change must not stay stored"
