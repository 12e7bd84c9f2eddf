"""Sharded and mixed-precision training (workers.training) on real torch.distributed ranks over gloo.

Two processes train the tiny model with FSDP2 and are compared with one process training on the whole
batch (every response has all its tokens, so each rank's token-mean loss weighs the same): the same
update, within float32 rounding. The ranks also write and read sharded checkpoints (DCP) across a change
of parallelism, and measure what each holds for training.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridflow import algos, checkpoint, dcp
from hybridflow.api import parse_job
from hybridflow.workers.modeling import response_log_probs
from hybridflow.workers.training import checkpoints_activations, layout_kind
from tests.graph_rules import ppo_graph, set_parallelism
from tests.helpers import train_in_fresh_ray
from tests.sharded_ranks import CPU, make_batch, new_training, padded_batch, spawn_ranks, train, weights

TOL = 1e-6
"""Largest difference of a float32 weight between layouts after a few AdamW steps at lr 1e-4."""


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    print(f"max |w_a - w_b| = {worst:.3g}")
    return worst


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One process on the whole batch (3 steps, a checkpoint, 1 more step), then 2 ranks on halves."""
    out = tmp_path_factory.mktemp("sharded")
    full = make_batch(8, seed=1)
    one = new_training()
    assert one.layout.kind == "plain"
    grad_norm = train(one, full, 3)["grad_norm"]
    w3 = weights(one)
    one.save(out / "from_one")
    train(one, full, 1)
    w4 = weights(one)
    ranks = spawn_ranks(2, out, out / "from_one")
    back = new_training()
    back.load(out / "from_two")
    train(back, full, 1)
    grouped = new_training()
    train(grouped, make_batch(8, seed=3, samples=4), 3)
    return {"out": out, "w3": w3, "w4": w4, "grad_norm": grad_norm, "ranks": ranks, "w4_from_two": weights(back),
            "w3_grouped": weights(grouped)}


def test_a_sharded_update_equals_one_process_on_the_whole_batch(runs: dict[str, Any]) -> None:
    ranks = runs["ranks"]
    assert max_diff(ranks["w3"], runs["w3"]) < TOL
    assert max_diff(ranks["w3_replicated"], runs["w3"]) < TOL
    assert ranks["grad_norm"] == pytest.approx(runs["grad_norm"], rel=1e-5)
    assert max_diff(runs["w3"], weights(new_training())) > 100 * TOL, "the steps moved the weights"


def test_a_sharded_update_over_shared_prompts_equals_one_process(runs: dict[str, Any]) -> None:
    """Rows that share a prompt run it once a pass (modeling.shared_prompt_logits): two forward calls of the
    sharded module before its backward pass, which must reduce the same gradients as one process's."""
    assert max_diff(runs["ranks"]["w3_grouped"], runs["w3_grouped"]) < TOL
    assert max_diff(runs["w3_grouped"], weights(new_training())) > 100 * TOL, "the steps moved the weights"


def test_micro_batches_on_uneven_shards_give_the_whole_minibatchs_update(runs: dict[str, Any]) -> None:
    """5 and 4 rows in micro-batches of 2: 3 passes on one rank, 2 (and one that counts for nothing) on the other."""
    ranks = runs["ranks"]
    for agg in ("token-mean", "seq-mean-token-mean"):
        assert max_diff(ranks[f"ragged_micro_{agg}"], ranks[f"ragged_{agg}"]) < TOL, agg


def test_forward_only_passes_of_a_sharded_module_on_uneven_shards_score_as_the_full_model(
        runs: dict[str, Any]) -> None:
    """As the update, scoring by the sharded module (the off-policy actor's proximal log-probs) runs the same
    number of passes on every rank: a rank that ran fewer would leave the other waiting in a parameter gather."""
    assert runs["ranks"]["sharded_scoring_gap"] < 1e-5


@pytest.mark.parametrize("agg", algos.AGG_MODES)
def test_micro_batches_give_the_gradients_of_one_batch(agg: str) -> None:
    batch = make_batch(7, seed=3, ragged=True)
    grads = []
    for micro in (None, 3):
        t = new_training()
        train(t, batch, 1, micro=micro, agg=agg)
        grads.append([p.grad.clone() for p in t.layout.params])
    scale = max(float(g.abs().max()) for g in grads[0])
    assert scale > 0
    worst = max(float((a - b).abs().max()) for a, b in zip(*grads, strict=True))
    assert worst < 1e-4 * scale, f"{agg}: {worst} vs gradients up to {scale}"


@pytest.mark.parametrize(("micro", "tokens", "passes"), [
    (3, None, [(3, 6), (3, 8), (2, 7)]),  # 56 tokens where the padded rows hold 8 x 14
    (None, 16, [(2, 5), (2, 5), (2, 8), (2, 7)]),
])
def test_trimmed_length_ordered_micro_batches_give_the_gradients_of_the_padded_batch(
        micro: int | None, tokens: int | None, passes: list[tuple[int, int]]) -> None:
    """The update's passes run on rows cut in length order and trimmed of their shared padding; the gradient is
    the one a single pass over the padded rows gives."""
    batch = padded_batch()
    t = new_training()
    shapes: list[tuple[int, int]] = []
    t.module.register_forward_pre_hook(lambda _m, _a, kw: shapes.append(tuple(kw["input_ids"].shape)),
                                       with_kwargs=True)
    train(t, batch, 1, micro=micro, tokens=tokens)
    assert shapes == passes
    trained = [p.grad.clone() for p in t.layout.params]
    plain = new_training()
    plain.module.train()
    logp, _ = response_log_probs(plain.module, batch, CPU)
    algos.agg_loss(-logp, batch.response_mask.float(), "token-mean").backward()
    expected = [p.grad for p in plain.layout.params]
    scale = max(float(g.abs().max()) for g in expected)
    worst = max(float((a - b).abs().max()) for a, b in zip(trained, expected, strict=True))
    assert scale > 0 and worst < 1e-4 * scale, f"{worst} vs gradients up to {scale}"


def test_gradient_checkpointing_gives_the_same_update(runs: dict[str, Any]) -> None:
    assert runs["ranks"]["checkpointing_on"]
    assert max_diff(runs["ranks"]["w3_checkpointed"], runs["ranks"]["w3"]) < TOL
    plain, checkpointed = new_training(), new_training(gradientCheckpointing=True)
    batch = make_batch(8, seed=1)
    train(plain, batch, 2)
    train(checkpointed, batch, 2)
    assert checkpoints_activations(checkpointed.module) and not checkpoints_activations(plain.module)
    assert max_diff(weights(checkpointed), weights(plain)) < TOL


def test_a_checkpoint_resumes_on_another_number_of_ranks(runs: dict[str, Any]) -> None:
    """Written by 1 process, read by 2 ranks (and 2 -> 1): the next step is the one the writer would take."""
    ranks = runs["ranks"]
    assert max_diff(ranks["w4_from_one"], runs["w4"]) < TOL
    assert max_diff(runs["w4_from_two"], ranks["w4"]) < TOL
    two = runs["out"] / "from_two"
    assert sorted(p.name for p in two.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    index = json.loads((two / dcp.INDEX_FILE).read_text())
    exp_avg = next(k for k in index["tensors"] if k.endswith(".exp_avg"))
    assert index["tensors"][exp_avg]["dtype"] == "float32"
    whole = dcp.read_full(two, "model.")
    assert max_diff({k: whole[k] for k in ranks["w3"]}, ranks["w3"]) < TOL


def test_each_rank_holds_half_the_training_state(runs: dict[str, Any]) -> None:
    """Parameters, gradients and Adam's moments per rank: FSDP2 over 2 ranks vs a full replica on each."""
    sharded, replicated = runs["ranks"]["memory_sharded"], runs["ranks"]["memory_replicated"]
    print(f"\nper-rank training bytes, 2 ranks: sharded {sharded} (total {sum(sharded.values())}); "
          f"replicated {replicated} (total {sum(replicated.values())})")
    ratio = sum(sharded.values()) / sum(replicated.values())
    assert 0.45 < ratio < 0.56, ratio
    for part in ("params", "grads", "optimizer"):
        assert 0.45 < sharded[part] / replicated[part] < 0.56, part


def test_the_inference_copy_gives_its_memory_to_the_update_and_holds_the_trained_weights_after(
        runs: dict[str, Any]) -> None:
    """During a sharded update a rank holds its shards and nothing of the full copy; after it, the copy holds
    every trained weight (the update's equality with one process is read from it)."""
    ranks = runs["ranks"]
    print(f"\ninference copy per rank: {ranks['copy_bytes_before']} bytes before the update, "
          f"{ranks['copy_bytes_in_update']:.0f} during it, {ranks['copy_bytes_after']} after it")
    assert ranks["copy_bytes_before"] > 0
    assert ranks["copy_bytes_in_update"] == 0
    assert ranks["copy_bytes_after"] == ranks["copy_bytes_before"]


def test_a_copy_nothing_reads_stays_released_and_generation_gets_the_weights_from_the_shards(
        runs: dict[str, Any]) -> None:
    """keep_copy False (generation on a module of its own): after the update a rank holds its shards alone; the
    generation module, synced from them weight by weight, holds the update's weights, and so does the copy once
    gathered (as the ranks do before their number changes)."""
    ranks = runs["ranks"]
    print(f"\ninference copy per rank after the update: {ranks['released_copy_bytes']} bytes released, "
          f"{ranks['released_copy_bytes_held']} gathered; {ranks['released_sync_bytes']} bytes synced from shards")
    assert ranks["released_copy_bytes"] == 0 and ranks["released_counts_kept"]
    assert ranks["released_sync_bytes"] >= ranks["copy_bytes_before"]
    assert max_diff(ranks["w3_generation"], runs["w3"]) < TOL
    assert ranks["released_copy_bytes_held"] == ranks["copy_bytes_before"]
    assert max_diff(ranks["w3_held"], runs["w3"]) < TOL


def test_a_critic_scoring_in_a_phase_of_its_own_keeps_only_its_shards_and_scores_as_its_full_copy(
        runs: dict[str, Any]) -> None:
    """Two critic ranks, each scoring its shard in one call: after an update they hold no full copy, and the
    values scored by the shards equal those of the copy gathered from them."""
    ranks = runs["ranks"]
    print(f"\ncritic copy per rank: {ranks['critic_copy_bytes']} bytes after an update, "
          f"{ranks['critic_copy_bytes_held']} gathered; values gap {ranks['critic_values_gap']:.3g} "
          f"at scale {ranks['critic_values_scale']:.3g}")
    assert ranks["critic_copy_bytes"] == 0 < ranks["critic_copy_bytes_held"]
    assert ranks["critic_values_scale"] > 1e-3  # the head moved: there is something to compare
    assert ranks["critic_values_gap"] < 1e-5


def test_old_log_probs_scored_by_every_rank_at_once_come_from_the_shards_as_from_the_full_copy(
        runs: dict[str, Any]) -> None:
    """The actor's old log-probs in the scores phase (a sharded vLLM actor, plan.scored_steps): after an update
    its ranks hold no full copy and score their uneven parts (5 and 4 rows, micro-batches of 2) with the shards,
    as the copy gathered from them scores them."""
    ranks = runs["ranks"]
    print(f"\nactor copy per rank: {ranks['actor_copy_bytes']} bytes after an update; old log-probs gap "
          f"{ranks['old_log_probs_gap']:.3g} at scale {ranks['old_log_probs_scale']:.3g}")
    assert ranks["actor_copy_bytes"] == 0
    assert ranks["old_log_probs_scale"] > 0.1
    assert ranks["old_log_probs_gap"] < 1e-5


def test_a_rank_lost_in_an_update_recovers_from_the_checkpoint(runs: dict[str, Any]) -> None:
    """An update that never finished leaves the copy released; forming the ranks again and loading the
    checkpoint gives back exactly its weights."""
    assert max_diff(runs["ranks"]["w3_recovered"], runs["ranks"]["w3"]) < TOL


def test_bf16_weights_move_at_a_small_learning_rate_with_fp32_masters() -> None:
    """bf16 keeps 8 significant bits: an AdamW step of 1e-6 on a weight of size 1e-2 rounds away. The masters
    layout steps fp32 copies; stepping the bf16 weights themselves (the old way) leaves most unchanged."""
    batch = make_batch(8, seed=1)
    masters = new_training("bfloat16", lr=1e-6)
    assert masters.layout.kind == "masters"
    before = [p.detach().clone() for p in masters.layout.params]
    train(masters, batch, 10)
    changed = sum(int((p.detach() != b).sum()) for p, b in zip(masters.layout.params, before, strict=True))
    total = sum(b.numel() for b in before)

    pure = new_training("bfloat16", lr=1e-6)
    model = pure.model
    start = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    for _ in range(10):
        optimizer.zero_grad()
        logp, _ = response_log_probs(model, batch, CPU)
        algos.agg_loss(-logp, batch.response_mask.float(), "token-mean").backward()
        optimizer.step()
    pure_changed = sum(int((p.detach() != s).sum()) for p, s in zip(model.parameters(), start, strict=True))
    print(f"\nbf16, lr 1e-6, 10 steps: fp32 masters changed {changed}/{total} ({changed / total:.2%}); "
          f"pure bf16 AdamW changed {pure_changed}/{total} ({pure_changed / total:.2%})")
    assert changed / total > 0.99
    assert pure_changed / total < 0.2


def test_sharded_bf16_training_steps_fp32_weights(runs: dict[str, Any]) -> None:
    """FSDP2 with a bf16 model: bf16 compute, fp32 sharded weights that a step of 1e-6 moves."""
    ranks = runs["ranks"]
    assert ranks["bf16_kind"] == "sharded" and ranks["bf16_master_dtype"] == "torch.float32"
    changed = ranks["bf16_masters_changed"] / ranks["bf16_total"]
    print(f"\nbf16 on 2 sharded ranks, lr 1e-6, 10 steps: fp32 weights changed {changed:.2%}")
    assert changed > 0.99


def test_the_layout_follows_ranks_shard_and_dtype() -> None:
    assert layout_kind(2, True, torch.bfloat16, lora=False) == "sharded"
    assert layout_kind(2, False, torch.bfloat16, lora=False) == "masters"
    assert layout_kind(1, True, torch.float32, lora=False) == "plain"
    assert layout_kind(4, True, torch.float32, lora=True) == "plain"


def test_the_training_state_is_weights_and_adams_moments_as_tensors(tmp_path: Path) -> None:
    t = new_training()
    train(t, make_batch(4, seed=5), 1)
    t.save(tmp_path)
    state = dcp.read_full(tmp_path)
    assert {k.rsplit(".", 1)[-1] for k in state if k.startswith("optim.")} == {"step", "exp_avg", "exp_avg_sq"}
    assert all(isinstance(v, torch.Tensor) for v in state.values())


# -- through the trainer, on local Ray ---------------------------------------------------------------------------


@pytest.mark.slow
def test_a_run_resumes_with_another_number_of_critic_ranks(example_doc, tmp_path: Path) -> None:
    """2 critic ranks checkpoint step 2, 1 rank resumes it to step 3, 2 ranks again to step 4."""

    def job(ranks: int, steps: int) -> Any:
        doc = example_doc("tiny-ppo.yaml")
        doc["metadata"]["name"] = f"sharded-resume-{abs(hash(tmp_path)) % 10_000}"
        doc["spec"]["graph"] = set_parallelism(ppo_graph(), "critic", ranks)
        doc["spec"]["data"]["batchSize"] = 32
        doc["spec"]["algorithm"]["miniBatchSize"] = 16
        doc["spec"]["trainer"].update(totalSteps=steps, resume="auto",
                                      checkpoint={"every": 1, "keep": 5, "path": str(tmp_path / "ckpt")})
        return parse_job(doc)

    metrics = tmp_path / "m.jsonl"
    for ranks, steps in ((2, 2), (1, 3), (2, 4)):
        result = train_in_fresh_ray(job(ranks, steps), metrics)
        assert result["last_checkpoint"].endswith(f"step_{steps:08d}")
        shards = checkpoint.training_dir(result["last_checkpoint"], "critic_0", "critic").glob("*.distcp")
        assert len(list(shards)) == ranks
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(math.isfinite(r["critic_loss"]) for r in records)
