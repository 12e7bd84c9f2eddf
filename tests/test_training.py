"""Training on real local Ray: learning, checkpoint/resume, and recovery from killed processes."""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import ray
from ray.util.placement_group import placement_group_table

from benchmarks.chaos.procs import own_processes
from hybridflow.api import parse_job
from hybridflow.api.spec import FilterGroups, PolicyFiltration
from hybridflow.checkpoint import CONTROLLER_FILE, PREVIOUS_DIR, Superseded, claim, load_state, step_dir
from hybridflow.checkpoint import complete_steps as checkpoint_steps
from hybridflow.data.prompts import PromptSampler, load_prompts
from hybridflow.driver import TrainingFailed, init_ray, run_training
from hybridflow.trainer import Trainer
from hybridflow.workers.modeling import THREADS_ENV

pytestmark = pytest.mark.slow

COMPARED = ("reward_mean", "kl", "actor_loss", "critic_loss", "entropy", "response_length")


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    init_ray(local=True, num_cpus=8)
    yield
    ray.shutdown()


def tiny_job(example_doc, name: str, tmp_path: Path, steps: int, every: int = 0, **trainer):
    doc = example_doc(name)
    doc["metadata"]["name"] = f"t-{name.split('.')[0]}-{abs(hash(tmp_path)) % 10_000}"
    doc["spec"]["trainer"].update({"totalSteps": steps, "resume": "auto"} | trainer)
    doc["spec"]["trainer"]["checkpoint"] = {"every": every, "path": str(tmp_path / "ckpt")}
    return parse_job(doc)


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_ppo_improves_and_writes_metrics_and_plot(example_doc, tmp_path) -> None:
    job = tiny_job(example_doc, "tiny-ppo.yaml", tmp_path, steps=24)
    seen: list[dict] = []
    result = run_training(job, str(tmp_path / "m.jsonl"), seen.append)
    recs = read_metrics(tmp_path / "m.jsonl")
    assert [r["step"] for r in recs] == list(range(1, 25))
    assert recs[0]["reward_mean"] < 0.2
    assert recs[-1]["reward_mean"] > recs[0]["reward_mean"] + 0.15
    for key in ("reward_mean", "kl", "actor_loss", "critic_loss", "entropy", "response_length", "tokens_per_s",
                "timing/generate", "timing/update", "orchestration_overhead_frac"):
        assert all(key in r and math.isfinite(r[key]) for r in recs), key
    assert 0.0 <= recs[-1]["orchestration_overhead_frac"] < 1.0
    assert Path(result["plot"]).stat().st_size > 10_000
    assert seen and seen[-1]["step"] == 24


def test_grpo_improves_without_a_critic(example_doc, tmp_path) -> None:
    job = tiny_job(example_doc, "tiny-grpo.yaml", tmp_path, steps=32)
    run_training(job, str(tmp_path / "m.jsonl"))
    recs = read_metrics(tmp_path / "m.jsonl")
    assert "critic_loss" not in recs[-1]
    end = sum(r["reward_mean"] for r in recs[-3:]) / 3
    assert end > recs[0]["reward_mean"] + 0.15


# The tiny GRPO job with only the algorithm changed, 96 steps for GSPO, 48 for the others. Measured on 2 cores,
# mean reward of the last 5 steps at 48 / 80 steps (from 0.06 at step 1), before the torch engine had its own
# sampling loop (which draws another random stream):
#   grpo 0.76 / 0.99 (>= 0.9 from step 51); grpo + policyLoss gspo 0.62 / 0.99 (>= 0.9 from step 59);
#   rloo 0.55 / 0.69; reinforce_plus_plus 0.60 / 0.69; reinforce_plus_plus_baseline 0.37 / 0.69.
# With that loop, GSPO over trainer.seed 0-3 first reaches a 5-step mean of 0.9 at step 53 to 84 (seed 0, this
# job's: 84).
# rloo and both REINFORCE++ learn but do not reach 0.9 within the job's 80 steps at its actorLr (best step
# 0.84-0.86): unlike GRPO their advantages are not divided by each group's std, which on this binary reward
# makes GRPO's steps on nearly solved prompts several times larger.
# opo, grpo_passk and remax, measured the same way with the sampling loop (last-5 mean at 48 / 64 / 80 steps):
#   opo 0.45 / 0.52 / 0.55; grpo_passk 0.44 / 0.64 / 0.68 (its greedy val reward 1.0 at 80: Pass@k training
#   lifts the best of a prompt's samples, which greedy decoding finds); remax 0.29 / 0.41 / 0.32.
# gpg (with policyLoss gpg) 0.46 / 0.52 / 0.44, greedy val 0.50 at 80; optimal_token_baseline 0.70 / 0.79 / 0.79,
# greedy val 0.81 at 80.
LEARNS = [("grpo", "gspo", 96, 0.9), ("rloo", "vanilla", 48, 0.2), ("reinforce_plus_plus", "vanilla", 48, 0.2),
          ("reinforce_plus_plus_baseline", "vanilla", 48, 0.2), ("opo", "vanilla", 48, 0.2),
          ("grpo_passk", "vanilla", 48, 0.2), ("remax", "vanilla", 64, 0.2), ("gpg", "gpg", 48, 0.2),
          ("optimal_token_baseline", "vanilla", 48, 0.2)]


@pytest.mark.parametrize(("name", "policy_loss", "steps", "bar"), LEARNS, ids=[f"{n}-{p}" for n, p, _, _ in LEARNS])
def test_each_critic_free_algorithm_learns_the_tiny_task(example_doc, tmp_path, name: str, policy_loss: str,
                                                         steps: int, bar: float) -> None:
    """GSPO reaches a mean reward of 0.9; the others gain `bar` over the first step's reward."""
    job = tiny_job(example_doc, "tiny-grpo.yaml", tmp_path, steps=steps)
    job.spec.algorithm.name = name
    job.spec.algorithm.policy_loss = policy_loss
    run_training(job, str(tmp_path / "m.jsonl"))
    recs = read_metrics(tmp_path / "m.jsonl")
    assert "critic_loss" not in recs[-1]
    rewards = [r["reward_mean"] for r in recs]
    best = max(sum(rewards[i - 5:i]) / 5 for i in range(5, len(rewards) + 1))
    if bar >= 0.9:
        assert best >= bar, rewards
    else:
        assert sum(rewards[-5:]) / 5 > rewards[0] + bar, rewards


def test_dynamic_sampling_rolls_out_more_prompts_as_the_policy_solves_more_of_them(example_doc, tmp_path) -> None:
    """GRPO with algorithm.filterGroups: every step trains on 32 groups whose scores differ, and takes more
    rollouts as groups that all scored the same (solved, mostly) grow. Measured on 2 cores over 80 steps: one
    rollout a step until about step 20, two by step 25 (kept groups 0.95), four at step 49 (0.25); at step 65
    87 rollouts of 32 prompts found 32 (0.011), and at step 66 100 did not: the job stopped, naming
    maxGenBatches."""
    job = tiny_job(example_doc, "tiny-grpo.yaml", tmp_path, steps=40)
    job.spec.algorithm.filter_groups = FilterGroups(maxGenBatches=20)
    run_training(job, str(tmp_path / "m.jsonl"))
    recs = read_metrics(tmp_path / "m.jsonl")
    rollouts = [r["dynamic_sampling/gen_batches"] for r in recs]
    kept = [r["dynamic_sampling/kept_group_frac"] for r in recs]
    assert all(1 <= n <= 20 for n in rollouts) and max(rollouts) >= 2, rollouts
    assert all(0 < f <= 1 for f in kept) and min(kept) < 1, kept
    assert sum(r["reward_mean"] for r in recs[-5:]) / 5 > recs[0]["reward_mean"] + 0.3


def test_dynamic_sampling_resumes_as_a_straight_run_with_the_reward_on_a_node_of_its_own(example_doc,
                                                                                        tmp_path) -> None:
    """PPO with filterGroups and the reward remote: each rollout streams its chunks to the reward node, the filled
    batch then gets its reference and old log-probs on the actor's host and its values from the critic. A run
    resumed from step 2 draws the same further prompts as the straight run, so its records are the same."""

    def job(path: Path, steps: int):
        j = tiny_job(example_doc, "tiny-ppo-remote-reward.yaml", path, steps=steps, every=2)
        j.spec.rollout.samples_per_prompt, j.spec.data.batch_size = 4, 16
        j.spec.algorithm.filter_groups = FilterGroups(maxGenBatches=20)
        return j

    run_training(job(tmp_path / "a", 4), str(tmp_path / "a.jsonl"))
    run_training(job(tmp_path / "b", 2), str(tmp_path / "b.jsonl"))
    run_training(job(tmp_path / "b", 4), str(tmp_path / "b.jsonl"))
    a, b = read_metrics(tmp_path / "a.jsonl"), read_metrics(tmp_path / "b.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert max(r["dynamic_sampling/gen_batches"] for r in a) >= 2, a
    for ra, rb in zip(a, b, strict=True):
        assert ra["dynamic_sampling/gen_batches"] == rb["dynamic_sampling/gen_batches"]
        assert ra["timing/ref_log_probs"] > 0 and ra["timing/values"] > 0
        for key in COMPARED:
            assert ra[key] == pytest.approx(rb[key], rel=1e-5, abs=1e-6), (ra["step"], key)


def test_ppo_learns_on_the_batch_policy_filtration_redraws(example_doc, tmp_path) -> None:
    """PF-PPO (max_random) on the tiny PPO job. Measured on 2 cores, the mean reward of the last 5 steps at 24 / 48
    / 80 steps (from 0.08): max_random 0.35 / 0.64 / 0.71; pow (weightPow 2) 0.18 / 0.18 / 0.15 and max_min 0.14 /
    0.10 / 0.21, which on this 0-to-1 score draw almost only the few rewarded responses at first; plain PPO 0.43 /
    0.96 / 0.99."""
    job = tiny_job(example_doc, "tiny-ppo.yaml", tmp_path, steps=48)
    job.spec.algorithm.policy_filtration = PolicyFiltration(reweightMethod="max_random")
    run_training(job, str(tmp_path / "m.jsonl"))
    rewards = [r["reward_mean"] for r in read_metrics(tmp_path / "m.jsonl")]
    assert sum(rewards[-5:]) / 5 > rewards[0] + 0.3, rewards


def test_resume_gives_the_same_metrics_as_a_straight_run(example_doc, tmp_path) -> None:
    straight = tiny_job(example_doc, "tiny-ppo.yaml", tmp_path / "a", steps=6, every=3)
    run_training(straight, str(tmp_path / "a.jsonl"))
    first = tiny_job(example_doc, "tiny-ppo.yaml", tmp_path / "b", steps=3, every=3)
    run_training(first, str(tmp_path / "b.jsonl"))
    assert [r["step"] for r in read_metrics(tmp_path / "b.jsonl")] == [1, 2, 3]
    second = tiny_job(example_doc, "tiny-ppo.yaml", tmp_path / "b", steps=6, every=3)
    result = run_training(second, str(tmp_path / "b.jsonl"))
    assert result["last_checkpoint"].endswith("step_00000006")
    a, b = read_metrics(tmp_path / "a.jsonl"), read_metrics(tmp_path / "b.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    for ra, rb in zip(a, b, strict=True):
        for key in COMPARED:
            assert ra[key] == pytest.approx(rb[key], rel=1e-5, abs=1e-6), (ra["step"], key)


def files_under(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_run_started_from_another_runs_checkpoint_goes_on_as_that_run(example_doc, tmp_path) -> None:
    """Run A: tiny-grpo, 4 steps, a checkpoint every 2. Run B starts from A's step 2 (spec.trainer.resumeFrom) and
    writes its own: its steps 3 and 4 are A's, and A's files are untouched. B run again to step 6 goes on from
    its own step 4, not from A's step 2. Then a run with resume never in A's directory moves A's checkpoints into
    previous/ and keeps its own (an earlier run's newer steps made it prune its own as it wrote them)."""
    a_root = tmp_path / "a" / "ckpt"
    a = tiny_job(example_doc, "tiny-grpo.yaml", tmp_path / "a", steps=4, every=2)
    run_training(a, str(tmp_path / "a.jsonl"))
    a_files = files_under(a_root)
    start = str(step_dir(a_root, 2))
    b = tiny_job(example_doc, "tiny-grpo.yaml", tmp_path / "b", steps=4, every=2, resumeFrom=start)
    run_training(b, str(tmp_path / "b.jsonl"))
    ra, rb = read_metrics(tmp_path / "a.jsonl"), read_metrics(tmp_path / "b.jsonl")
    assert [r["step"] for r in rb] == [3, 4]
    for x, y in zip(ra[2:], rb, strict=True):
        for key in ("reward_mean", "kl", "actor_loss", "entropy", "response_length"):
            assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-6), (x["step"], key)
    assert checkpoint_steps(tmp_path / "b" / "ckpt") == [4]
    assert files_under(a_root) == a_files

    again = tiny_job(example_doc, "tiny-grpo.yaml", tmp_path / "b", steps=6, every=2, resumeFrom=start)
    run_training(again, str(tmp_path / "b.jsonl"))
    assert [r["step"] for r in read_metrics(tmp_path / "b.jsonl")] == [3, 4, 5, 6]

    ppo = tiny_job(example_doc, "tiny-ppo.yaml", tmp_path / "c", steps=4, resumeFrom=start)  # a critic A lacks
    with pytest.raises(TrainingFailed, match=rf"^spec\.trainer\.resumeFrom: checkpoint {start} does not load into "
                                             r"this job: .* has no state for critic_0: resume needs the same graph$"):
        run_training(ppo, str(tmp_path / "c.jsonl"))

    fresh = tiny_job(example_doc, "tiny-grpo.yaml", tmp_path / "a", steps=2, every=1, resume="never")
    run_training(fresh, str(tmp_path / "fresh.jsonl"))
    assert checkpoint_steps(a_root) == [1, 2]
    assert files_under(a_root / PREVIOUS_DIR) == {k: v for k, v in a_files.items() if k.startswith("step_")}


def _kill_when(metrics: Path, step: int, title: str, killed: list[int], stop: threading.Event) -> None:
    """SIGKILL the first process of this test's own Ray whose title starts with `title` once `metrics` reaches
    `step` (never another Ray's on the same machine)."""
    while not stop.is_set():
        if metrics.is_file() and any(r["step"] >= step for r in read_metrics(metrics)):
            for pid in sorted(own_processes(title)):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
        time.sleep(0.05)


def _run_with_kill(job, metrics: Path, step: int, title: str) -> tuple[dict, list[int]]:
    killed: list[int] = []
    stop = threading.Event()
    killer = threading.Thread(target=_kill_when, args=(metrics, step, title, killed, stop), daemon=True)
    killer.start()
    try:
        result = run_training(job, str(metrics))
    finally:
        stop.set()
        killer.join(timeout=5)
    return result, killed


def test_a_killed_worker_is_rebuilt_and_the_run_completes(example_doc, tmp_path) -> None:
    job = tiny_job(example_doc, "tiny-ppo.yaml", tmp_path, steps=10, every=2)
    result, killed = _run_with_kill(job, tmp_path / "m.jsonl", step=3, title="ray::WorkerHost")
    assert killed, "no worker process was found to kill"
    assert result["recoveries"] >= 1
    steps = [r["step"] for r in read_metrics(tmp_path / "m.jsonl")]
    assert steps == list(range(1, 11)), "a step after the checkpoint was skipped or repeated"


def test_a_worker_lost_before_the_runs_first_checkpoint_goes_back_to_resume_from(example_doc, tmp_path) -> None:
    """A run started from another's step 2 that saves nothing of its own rolls back to that step when a worker
    dies (not to the initial weights at step 0)."""
    first = tiny_job(example_doc, "tiny-grpo.yaml", tmp_path / "a", steps=2, every=2)
    run_training(first, str(tmp_path / "a.jsonl"))
    job = tiny_job(example_doc, "tiny-grpo.yaml", tmp_path / "b", steps=6, every=0,
                   resumeFrom=str(tmp_path / "a" / "ckpt"))
    result, killed = _run_with_kill(job, tmp_path / "m.jsonl", step=4, title="ray::WorkerHost")
    assert killed, "no worker process was found to kill"
    assert result["recoveries"] >= 1 and result["steps"] == 6
    assert [r["step"] for r in read_metrics(tmp_path / "m.jsonl")] == [3, 4, 5, 6]


def test_a_killed_controller_is_restarted_and_resumes(example_doc, tmp_path) -> None:
    job = tiny_job(example_doc, "tiny-ppo.yaml", tmp_path, steps=10, every=2)
    result, killed = _run_with_kill(job, tmp_path / "m.jsonl", step=3, title="ray::Trainer")
    assert killed, "no controller process was found to kill"
    assert result["steps"] == 10
    steps = [r["step"] for r in read_metrics(tmp_path / "m.jsonl")]
    assert steps == list(range(1, 11))
    left = [pg["name"] for pg in placement_group_table().values()
            if pg["name"].startswith(job.metadata.name) and pg["state"] != "REMOVED"]
    assert left == [], "the first controller's placement groups still hold their resources"


def test_a_controller_whose_directory_was_claimed_stops_before_writing(example_doc, tmp_path) -> None:
    """An orphaned controller (its Ray head lost) must not write beside the resubmitted job's controller."""
    job = tiny_job(example_doc, "tiny-grpo.yaml", tmp_path, steps=4, every=2)
    orphan = Trainer(job.model_dump(by_alias=True, mode="json"), str(tmp_path / "m.jsonl"))
    try:
        orphan.start()
        claim(job.spec.trainer.checkpoint.path)  # the new submission's controller
        with pytest.raises(Superseded):
            orphan.fit()
    finally:
        orphan.shutdown()
    assert not (tmp_path / "m.jsonl").exists() or read_metrics(tmp_path / "m.jsonl") == []
    assert checkpoint_steps(job.spec.trainer.checkpoint.path) == []


def test_trainer_runs_in_process_and_reports_scheduler_status(example_doc, tmp_path) -> None:
    job = tiny_job(example_doc, "tiny-grpo.yaml", tmp_path, steps=2)
    trainer = Trainer(job.model_dump(by_alias=True, mode="json"), str(tmp_path / "m.jsonl"))
    try:
        trainer.fit()
        status = trainer.scheduler.get_status()
        actor = status["nodes"]["actor_rollout"]
        assert actor["parallelism"] == 1 and actor["workers"][0]["pid"] > 0
        assert any(d.startswith("Scheduling decision: co-located actor_rollout_0 and") for d in status["decisions"])
        assert status["edges"] == {} or all("latency" in e for e in status["edges"].values())
    finally:
        trainer.shutdown()


def test_a_fused_step_is_queued_while_the_one_before_runs_and_the_run_is_the_same(example_doc, tmp_path) -> None:
    """The tiny GRPO step is one call on one host, so the next one can wait on the host while this one's result
    comes back and is recorded. Never past a checkpoint (5, 10), an evaluation (4, 8, 10) or the end, and a
    memory sample (step 1, then every few seconds) waits for an idle host: the run is the one that waits."""
    runs = {}
    for ahead in (True, False):
        job = tiny_job(example_doc, "tiny-grpo.yaml", tmp_path / str(ahead), steps=10, every=5, evalEvery=4)
        trainer = Trainer(job.model_dump(by_alias=True, mode="json"), str(tmp_path / f"{ahead}.jsonl"))
        trainer.queue_ahead = ahead
        try:
            runs[ahead] = trainer.fit()["records"], trainer.queued_steps, trainer.last_checkpoint
        finally:
            trainer.shutdown()
    (queued, which, ckpt), (waited, none, _) = runs[True], runs[False]
    assert none == [] and set(which) <= {3, 4, 7, 8, 10} and len(which) >= 3, which
    assert [r["step"] for r in queued] == list(range(1, 11)) and ckpt is not None and ckpt.endswith("step_00000010")
    for a, b in zip(queued, waited, strict=True):
        for key in (*COMPARED, "val/reward_mean"):
            assert a.get(key) == b.get(key), (a["step"], key)
    assert all(0.0 <= r["orchestration_overhead_frac"] < 1.0 for r in queued)


def test_ppo_with_the_critic_in_the_actors_process_runs_each_step_in_one_call(example_doc, tmp_path) -> None:
    doc = example_doc("tiny-ppo.yaml")
    doc["spec"]["graph"] = {
        "nodes": [{"name": "actor", "role": "actor_rollout", "resources": {"CPU": 1}},
                  {"name": "score", "role": "reward"}, {"name": "ref", "role": "reference"},
                  {"name": "critic", "role": "critic", "resources": {"CPU": 1}}],
        "edges": [{"src": "actor", "dst": n, "coLocate": True} for n in ("score", "ref", "critic")],
    }
    job = tiny_job(lambda _: doc, "tiny-ppo.yaml", tmp_path, steps=2)
    trainer = Trainer(job.model_dump(by_alias=True, mode="json"), str(tmp_path / "m.jsonl"))
    try:
        assert trainer.plan.fused and trainer.plan.colocated == ("reward", "reference", "values", "old_log_probs")
        result = trainer.fit()
        (worker,) = trainer.scheduler.get_status()["nodes"]["actor"]["workers"]
        assert worker["torch_threads"] == int(os.environ.get(THREADS_ENV) or 2)  # actor's CPU + critic's
    finally:
        trainer.shutdown()
    recs = result["records"]
    assert [r["step"] for r in recs] == [1, 2]
    assert all(math.isfinite(r["critic_loss"]) and math.isfinite(r["actor_loss"]) for r in recs)


def test_one_step_off_policy_still_learns_and_every_update_crosses_the_control_edge(example_doc, tmp_path) -> None:
    """scheduling.consistency eventual on the tiny GRPO job: each rollout but the first overlaps the update before
    it (lag 1), the task is still learned, every step's weights reach rollout over the control edge, and a
    checkpoint keeps the data position of the prompts not yet trained on, not of those drawn ahead."""
    job = tiny_job(example_doc, "tiny-grpo.yaml", tmp_path, steps=80, every=40)
    job.spec.scheduling.consistency = "eventual"
    trainer = Trainer(job.model_dump(by_alias=True, mode="json"), str(tmp_path / "m.jsonl"))
    try:
        assert trainer.plan.lag == 1 and trainer.plan.fused
        result = trainer.fit()
        edge = trainer.scheduler.get_status()["control_edges"]["actor_rollout->actor_rollout"]
    finally:
        trainer.shutdown()
    recs = result["records"]
    assert [r["policy_lag"] for r in recs] == [0] + [1] * 79
    assert [r["policy_version"] for r in recs] == list(range(1, 81))
    assert "behaviour_weight_mean" not in recs[0]  # on-policy: nothing to weigh
    assert all(0 < r["behaviour_weight_mean"] <= job.spec.algorithm.behaviour_weight_cap for r in recs[1:])
    assert all(r["timing/rollout"] < r["timing/update"] for r in recs[1:])  # generated during the last update
    rewards = [r["reward_mean"] for r in recs]
    assert sum(rewards[-5:]) / 5 >= 0.9, rewards
    assert edge["consistency"] == "eventual" and edge["syncs"] == 80 and edge["policy_version"] == 80
    assert edge["policy_lag_max"] == 1 and edge["bytes_last"] > 0

    sampler = PromptSampler(load_prompts(job.spec, "train"), job.spec.data.batch_size, job.spec.trainer.seed,
                            job.spec.data.shuffle)
    for _ in range(40):
        sampler.next_batch()
    saved = load_state(step_dir(tmp_path / "ckpt", 40) / CONTROLLER_FILE)
    assert saved["data"] == sampler.state_dict()


def test_one_step_off_policy_ppo_learns_as_shipped(example_doc, tmp_path) -> None:
    """The tiny PPO job under eventual consistency, as shipped (actorLr 5e-4, clipRatio 0.2, entropyCoef 0.01), on
    three seeds: each reaches 0.9 over ten steps in a row, and the median seed averages 0.9 over its last 20.
    Samples one update old let the reward dip now and then, and a seed may not climb back within 80 steps; which
    seed does not depends on the CPU's float kernels. Measured on 2 cores, last 20 steps: seed 0 averaged 0.92 on
    one machine and 0.875 on another (a dip at step 52 from which it stayed near 0.87), seeds 1 to 3 0.97 to 0.98;
    with actorLr 1e-3 and no entropy bonus, a step too large for samples one update old, it peaked at 0.92 and
    ended at 0.71."""
    last20, best10 = [], []
    for seed in (0, 1, 2):
        job = tiny_job(example_doc, "tiny-ppo.yaml", tmp_path / f"seed{seed}", steps=80, seed=seed)
        job.spec.scheduling.consistency = "eventual"
        recs = run_training(job, str(tmp_path / f"m{seed}.jsonl"))["records"]
        assert [r["policy_lag"] for r in recs] == [0] + [1] * 79
        rewards = [r["reward_mean"] for r in recs]
        last20.append(sum(rewards[-20:]) / 20)
        best10.append(max(sum(rewards[i:i + 10]) / 10 for i in range(len(rewards) - 9)))
    assert min(best10) >= 0.9, best10
    assert sorted(last20)[1] >= 0.9, last20
