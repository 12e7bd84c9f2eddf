"""Ulysses sequence parallelism: the pure pieces, the checks, and two real gloo ranks against SP=1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridflow.api import parse_job
from hybridflow.api.load import SpecError
from hybridflow.data.tiny import ensure_tiny_model
from hybridflow.graph import GraphError
from hybridflow.plan import SP_FIELDS, step_plan, trainable_graph
from hybridflow.workers import ulysses
from hybridflow.workers.distributed import free_port

RANKS = Path(__file__).with_name("ulysses_ranks.py")
RANK_TIMEOUT_S = 900.0
"""One forward/backward of a tiny model per case; far above it on a machine busy with other jobs."""

TOL = 1e-5
PARAM_TOL = 1e-4
"""Weights after four AdamW steps of lr 3e-3 (moves of ~1e-2): Adam divides by sqrt(v), so float noise in
near-zero gradients grows; the gradients themselves are held to TOL (and Adam would hide a scale error)."""


# -- pure ------------------------------------------------------------------------------------------

def test_padding_and_shards_round_trip() -> None:
    x = torch.arange(2 * 7).reshape(2, 7)
    padded = ulysses.pad_sequence(x, 4, value=-1)
    assert padded.shape == (2, 8) and padded[:, 7].tolist() == [-1, -1]
    assert ulysses.padded_length(7, 4) == 8 and ulysses.padded_length(8, 4) == 8
    parts = [ulysses.shard_sequence(padded, r, 4) for r in range(4)]
    assert all(p.shape == (2, 2) for p in parts)
    assert torch.equal(torch.cat(parts, dim=1), padded)


def test_mask_is_causal_over_tokens_and_never_empty() -> None:
    mask = torch.tensor([[0, 0, 1, 1, 1, 0]])
    allowed = ulysses.key_padding_mask(mask)[0, 0]
    assert allowed.shape == (6, 6)
    assert allowed[4].tolist() == [False, False, True, True, True, False]
    assert allowed[0].tolist() == [True, False, False, False, False, False]  # a padding query: itself only
    assert allowed[5].tolist() == [False, False, True, True, True, False]  # right padding: not a key
    assert not torch.triu(allowed, diagonal=1).any()


@pytest.mark.parametrize(("heads", "kv", "size", "expect"), [
    (4, 4, 3, "does not divide the model's 4 attention heads"),
    (6, 4, 2, "key/value heads do not divide"),
    (4, 4, 0, "is not a size"),
])
def test_bad_head_splits_name_the_field(heads: int, kv: int, size: int, expect: str) -> None:
    with pytest.raises(ulysses.SequenceParallelError) as e:
        ulysses.check_heads(heads, kv, size, SP_FIELDS["critic"])
    assert str(e.value).startswith("spec.model.critic.sequenceParallel: ") and expect in str(e.value)


def test_fewer_kv_heads_than_ranks_is_allowed() -> None:
    ulysses.check_heads(8, 2, 4, SP_FIELDS["critic"])  # key/value heads are repeated up to 8 before the all-to-all
    ulysses.check_heads(8, 1, 8, SP_FIELDS["critic"])


def test_world_not_a_multiple() -> None:
    with pytest.raises(ulysses.SequenceParallelError,
                       match=r"^spec.model.policy.sequenceParallel: 2 does not divide the 3 "):
        ulysses.check_world(3, 2, SP_FIELDS["actor_rollout"])


# -- the spec and the plan -------------------------------------------------------------------------

def ppo_doc(example_doc: Any, sp: Any, critic_node: bool = True, critic_parallelism: int = 2,
            critic_with_actor: bool = False) -> dict:
    doc = example_doc("tiny-ppo.yaml")
    doc["spec"]["model"]["critic"] = {"sequenceParallel": sp}
    if critic_node:
        doc["spec"]["graph"] = {
            "nodes": [
                {"name": "actor_rollout", "role": "actor_rollout", "resources": {"CPU": 1}},
                {"name": "reward_score", "role": "reward", "resources": {"CPU": 0}},
                {"name": "reference", "role": "reference", "resources": {"CPU": 0}},
                {"name": "critic", "role": "critic", "resources": {"CPU": 1}, "parallelism": critic_parallelism},
            ],
            "edges": [
                {"src": "actor_rollout", "dst": "reward_score", "dataType": "rollout_batch", "coLocate": True},
                {"src": "actor_rollout", "dst": "reference", "dataType": "rollout_batch", "coLocate": True},
                {"src": "actor_rollout", "dst": "critic", "dataType": "rollout_batch", "coLocate": critic_with_actor},
                {"src": "critic", "dst": "actor_rollout", "dataType": "updated_critic", "control": True},
            ],
        }
    return doc


def grpo_doc(example_doc: Any, sp: Any) -> dict:
    doc = example_doc("tiny-grpo.yaml")
    doc["spec"]["model"]["policy"]["sequenceParallel"] = sp
    return doc


@pytest.mark.parametrize("role", ["critic", "policy"])
def test_spec_takes_a_size_and_rejects_nonsense(example_doc: Any, role: str) -> None:
    def with_size(sp: Any) -> dict:
        return ppo_doc(example_doc, sp) if role == "critic" else grpo_doc(example_doc, sp)

    assert getattr(parse_job(with_size(2)).spec.model, role).sequence_parallel == 2
    assert getattr(parse_job(example_doc("tiny-ppo.yaml")).spec.model, role).sequence_parallel == 1
    for bad in (0, "two", 1000):
        with pytest.raises(SpecError) as e:
            parse_job(with_size(bad))
        assert f"spec.model.{role}.sequenceParallel" in str(e.value)


def test_plan_takes_sp_on_a_separate_critic(example_doc: Any) -> None:
    spec = parse_job(ppo_doc(example_doc, 2)).spec
    plan = step_plan(trainable_graph(spec, "CPU"), spec)
    assert "scores" in plan.phases and plan.critic is not None and plan.critic.parallelism == 2
    builtin = parse_job(ppo_doc(example_doc, 2, critic_node=False)).spec
    plan = step_plan(trainable_graph(builtin, "CPU", parallelism=3), builtin)
    assert "scores" in plan.phases and plan.critic is not None and plan.critic.parallelism == 4  # 3 rounded up


def test_plan_rejects_sp_the_ranks_cannot_take(example_doc: Any) -> None:
    spec = parse_job(ppo_doc(example_doc, 2, critic_parallelism=3)).spec
    with pytest.raises(GraphError) as e:
        trainable_graph(spec, "CPU")
    assert any("3 ranks of 'critic' do not split into groups of spec.model.critic.sequenceParallel = 2" in p
               for p in e.value.problems)
    shared = parse_job(ppo_doc(example_doc, 2, critic_parallelism=1, critic_with_actor=True)).spec
    with pytest.raises(GraphError) as e:
        trainable_graph(shared, "CPU")
    assert any(p.startswith("spec.model.critic.sequenceParallel: 2 needs a critic on hosts of its own")
               for p in e.value.problems)


def test_policy_sp_needs_a_multiple_of_actor_ranks(example_doc: Any) -> None:
    spec = parse_job(grpo_doc(example_doc, 2)).spec
    plan = step_plan(trainable_graph(spec, "CPU", parallelism=4), spec)
    assert not plan.fused and plan.actor.parallelism == 4
    for ranks in (1, 3):  # one rank is the fused plan: a group of 2 cannot form
        with pytest.raises(GraphError) as e:
            trainable_graph(spec, "CPU", parallelism=ranks)
        assert any(f"{ranks} ranks of 'actor_rollout' do not split into groups of "
                   "spec.model.policy.sequenceParallel = 2; allowed: a multiple of 2" in p for p in e.value.problems)


def test_policy_refuses_a_size_its_model_cannot_split(example_doc: Any) -> None:
    from hybridflow.workers.actor import ActorRolloutWorker

    spec = parse_job(grpo_doc(example_doc, 3)).spec  # the tiny model has 4 heads
    with pytest.raises(ulysses.SequenceParallelError,
                       match=r"^spec.model.policy.sequenceParallel: 3 does not divide the model's 4 attention"):
        ActorRolloutWorker(spec, torch.device("cpu"))


def test_critic_refuses_a_size_its_model_cannot_split(example_doc: Any) -> None:
    from hybridflow.workers.critic import CriticWorker

    spec = parse_job(ppo_doc(example_doc, 3, critic_parallelism=3)).spec  # the tiny model has 4 heads
    with pytest.raises(ulysses.SequenceParallelError,
                       match=r"^spec.model.critic.sequenceParallel: 3 does not divide the model's 4 attention"):
        CriticWorker(spec, torch.device("cpu"))


# -- one rank, the SP code path against the stock one -----------------------------------------------

def test_one_rank_matches_the_plain_forward() -> None:
    out = ulysses.gpu_check(torch.device("cpu"), seq=96, batch=2)
    assert out["max_abs_diff_output"] <= TOL and out["max_abs_diff_grad"] <= TOL


# -- two real gloo ranks ---------------------------------------------------------------------------

def aborted_in_teardown(log: str, results: list[Path]) -> bool:
    """Every rank wrote its result and one then died in its exit (std::terminate on a gloo thread still joinable,
    which a busy machine makes rare but possible): the work is done, its exit was not, and the run is worth
    repeating rather than failing."""
    return "terminate called without an active exception" in log and all(r.is_file() for r in results)


def run_ranks(case: str, out_dir: Path, world: int = 2, attempts: int = 3) -> list[dict[str, Any]]:
    """Both ranks as processes on a free port, tried again on a fresh port when the store could not bind, or when
    a rank aborted on its way out after the results were written (`aborted_in_teardown`)."""
    ensure_tiny_model()  # made once here, not raced for by the ranks
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    results = [out_dir / f"rank{r}.json" for r in range(world)]
    for attempt in range(attempts):
        for r in results:
            r.unlink(missing_ok=True)
        port = free_port()
        procs = [subprocess.Popen([sys.executable, str(RANKS), case, str(r), str(world), str(port), str(out_dir)],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in range(world)]
        logs = []
        for p in procs:
            try:
                logs.append(p.communicate(timeout=RANK_TIMEOUT_S)[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise
        if all(p.returncode == 0 for p in procs):
            return [json.loads(r.read_text()) for r in results]
        text = "\n".join(logs)
        transient = "address already in use" in text.lower() or aborted_in_teardown(text, results)
        if not transient or attempt == attempts - 1:
            raise AssertionError(f"ranks failed:\n{text[-6000:]}")
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def equal_case(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks("equal", tmp_path_factory.mktemp("sp_equal"))


def test_sp2_values_losses_and_grads_equal_sp1(equal_case: list[dict[str, Any]]) -> None:
    for out in equal_case:
        print("SP=2 vs SP=1:", {k: v for k, v in out.items() if "diff" in k or "scale" in k})
        assert out["sp_group_size"] == 2
        assert out["values_scale"] > 0.1 and out["grad_scale"] > 1e-3  # something to compare
        assert out["values_max_abs_diff"] <= TOL
        assert out["loss_abs_diff"] <= TOL
        assert out["grad_max_abs_diff"] <= TOL
        assert out["update_loss_abs_diff"] <= TOL
        assert out["update_grad_norm_rel_diff"] <= TOL
        assert out["update_param_max_abs_diff"] <= PARAM_TOL


def test_disabled_sp_falls_back_to_whole_sequences(equal_case: list[dict[str, Any]]) -> None:
    for out in equal_case:
        assert out["was_on"] is True and out["group_after_disable"] is False
        assert out["disabled_values_max_abs_diff"] <= TOL
        assert out["disabled_update_loss_abs_diff"] <= TOL
        assert out["disabled_param_max_abs_diff"] <= TOL


def test_policy_sp2_log_probs_losses_grads_and_updates_equal_sp1(tmp_path: Path) -> None:
    """The actor's training passes under SP=2 (two ranks, one shard) against SP=1: log-probs, entropy, sum_v
    pi_v^2, the clipped loss and its gradients, two whole updates with KL in the loss, and the activations saved per
    rank at 1024 tokens; then SP off. The 11-token rows (prompt 5) run as two slices of 6 positions, and each rank's
    LM head sees only those that predict a response token (4 .. 10): 2 on the first rank, 5 on the second."""
    outs = run_ranks("actor", tmp_path)
    assert [out["lm_head_positions"] for out in outs] == [[2], [5]]
    for out in outs:
        print("policy SP=2 vs SP=1:", out)
        assert out["sp_group_size"] == 2
        assert out["log_probs_scale"] > 0.1 and out["grad_scale"] > 1e-3 and out["update_param_moved"] > 1e-3
        for key in ("log_probs_max_abs_diff", "entropy_max_abs_diff", "sum_pi_squared_max_abs_diff",
                    "loss_abs_diff", "grad_max_abs_diff",
                    "update0_loss_abs_diff", "update0_kl_abs_diff", "update0_grad_norm_rel_diff",
                    "update1_loss_abs_diff", "update1_kl_abs_diff", "update1_grad_norm_rel_diff",
                    "actor_memory_log_probs_max_abs_diff", "disabled_update_loss_abs_diff"):
            assert out[key] <= TOL, key
        assert out["update_param_max_abs_diff"] <= PARAM_TOL
        assert out["disabled_param_max_abs_diff"] <= PARAM_TOL
        assert out["was_on"] is True and out["group_after_disable"] is False
        assert out["actor_saved_bytes_sp"] < 0.6 * out["actor_saved_bytes_plain"]


def test_kv_heads_split_or_repeated_over_the_ranks(tmp_path: Path) -> None:
    """Gradients relative to their largest entry: the loss (a sum of squares of hidden states) makes them
    large."""
    for out in run_ranks("gqa", tmp_path):
        print("grouped-query attention, SP=2 vs plain:", out)
        assert all(v <= TOL for v in out.values()) and len(out) == 4


def test_activation_memory_per_rank_halves(tmp_path: Path) -> None:
    """Per-token activations halve. A padded row adds an [S, S] mask per forward that no rank can split
    (each sees every position of its heads), so there the saving in bytes is what must hold."""
    seq = 1024
    ranks = run_ranks(f"memory:{seq}", tmp_path)
    for out in ranks:
        saved = {}
        for variant in ("full", "padded"):
            sp = saved[f"{variant}_sp"] = out[f"{variant}_saved_bytes_sp"] - out["weights_bytes"]
            plain = saved[f"{variant}_plain"] = out[f"{variant}_saved_bytes_plain"] - out["weights_bytes"]
            print(f"seq {seq} ({variant}): saved activations per rank SP=2 {sp / 2**20:.1f} MiB, SP=1 "
                  f"{plain / 2**20:.1f} MiB (ratio {sp / plain:.2f}); values max abs diff "
                  f"{out[f'{variant}_values_max_abs_diff']:.2e}")
            assert out[f"{variant}_values_max_abs_diff"] <= TOL
        assert saved["full_sp"] < 0.6 * saved["full_plain"]
        assert saved["padded_plain"] - saved["padded_sp"] >= saved["full_plain"] - saved["full_sp"]


# -- a running job ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_disable_ulysses_on_a_running_job(example_doc: Any, tmp_path: Path) -> None:
    """The built-in graph with SP=2 for the policy and the critic gives each two ranks that share each shard;
    disable_ulysses applied at a step boundary turns both into two plain data-parallel ranks, the job trains
    on, a recovery from a lost rank and a controller started again on its checkpoint path leave SP off."""
    import ray

    from hybridflow.driver import init_ray

    doc = ppo_doc(example_doc, 2, critic_node=False)
    doc["spec"]["model"]["policy"]["sequenceParallel"] = 2
    doc["metadata"]["name"] = "sp-off"
    doc["spec"]["data"]["batchSize"] = 8
    doc["spec"]["algorithm"]["miniBatchSize"] = 4
    doc["spec"]["trainer"].update(totalSteps=4, resume="never", checkpoint={"every": 0, "path": str(tmp_path / "c")})
    init_ray(local=True, num_cpus=4)
    try:
        _disable_and_restart(doc, tmp_path)
    finally:
        ray.shutdown()


def _disable_and_restart(doc: dict[str, Any], tmp_path: Path) -> None:
    import threading

    import ray

    from hybridflow.control import ControlError
    from hybridflow.trainer import Trainer

    job = parse_job(doc).model_dump(by_alias=True, mode="json")
    trainer = Trainer(job, str(tmp_path / "m.jsonl"), parallelism=2)
    both = ["actor_rollout", "critic"]
    try:
        assert trainer.critic is not None and trainer.sp == {"actor_rollout": 2, "critic": 2}
        for node, role in (("critic", "critic"), ("actor_rollout", "policy")):
            assert trainer._parallelism_problem(node, 3) == (
                f"3 ranks of {node!r} do not split into groups of spec.model.{role}.sequenceParallel = 2; "
                "allowed: a multiple of 2")
        trainer.start()
        result: dict[str, Any] = {}
        loop = threading.Thread(target=lambda: result.update(trainer.fit()), daemon=True)
        loop.start()
        deadline = 600.0
        waited = 0.0
        while trainer.step < 1 and waited < deadline and loop.is_alive():
            threading.Event().wait(0.5)
            waited += 0.5
        assert trainer.step >= 1, "no step within the deadline"
        out = trainer.control_disable_ulysses("long prompts are gone", wait_s=600.0)
        assert out == {"changes": [{"node": n, "old": 2, "sequence_parallel": 1, "ranks": 2} for n in both]}
        loop.join(timeout=900)
        assert not loop.is_alive()
        records = result["records"]
        assert [r["step"] for r in records] == [1, 2, 3, 4]
        assert all(r["critic_loss"] == r["critic_loss"] and r["actor_loss"] == r["actor_loss"] for r in records)
        for group in (trainer.critic, trainer.actor):  # no NaN before or after; every rank is off
            assert ray.get([h.disable_sequence_parallel.remote() for h in group.hosts]) == [False, False]
        decisions = trainer.scheduler.decision_log[-2:]
        assert [(d["kind"], d["node"]) for d in decisions] == [("sequence_parallel", n) for n in both]
        assert [d["message"] for d in decisions] == [
            f"Manual: {n} sequence parallelism 2 -> off: 2 data-parallel ranks over whole sequences (long prompts "
            "are gone)" for n in both]
        with pytest.raises(ControlError, match="sequence parallelism is not on in this job"):
            trainer.control_disable_ulysses("again")
        assert trainer._parallelism_problem("critic", 3) is None
        assert trainer.control_status()["manual"]["sequence_parallel_off"] == both
        # a rank Ray restarts, and every host reset to the initial weights, comes back at the spec's size: the
        # recovery tells them again (disable_sequence_parallel answers whether SP was still on)
        ray.kill(trainer.critic.hosts[1], no_restart=False)
        trainer._recover(RuntimeError("a critic rank died"))
        for group in (trainer.critic, trainer.actor):
            assert ray.get([h.disable_sequence_parallel.remote() for h in group.hosts]) == [False, False]
    finally:
        trainer.shutdown()
    # a controller started again on the same checkpoint path (as Ray restarts one) keeps it off
    doc["spec"]["trainer"]["resume"] = "auto"
    again = Trainer(parse_job(doc).model_dump(by_alias=True, mode="json"), str(tmp_path / "m2.jsonl"),
                    parallelism=2)
    try:
        again.start()
        assert again.sp == {"actor_rollout": 1, "critic": 1}
        for group in (again.critic, again.actor):
            assert ray.get([h.disable_sequence_parallel.remote() for h in group.hosts]) == [False, False]
        assert [d["message"] for d in again.scheduler.decision_log[-2:]] == [
            f"Manual: {n} sequence parallelism 2 -> off: 2 data-parallel ranks over whole sequences "
            "(re-applied after a controller restart)" for n in both]
    finally:
        again.shutdown()


def test_cli_verb_fails_in_one_line_without_a_cluster() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-m", "hybridflow", "ctl", "disable-ulysses", "team-a/job",
                          "--address", f"127.0.0.1:{free_port()}", "--reason", "r"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert out.stderr.startswith("error: cannot reach a Ray cluster at 127.0.0.1:") and out.stderr.count("\n") == 1
