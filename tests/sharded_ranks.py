"""Ranks of the sharded-training tests: the tiny model trained by RoleTraining on a fixed token batch.

`spawn_ranks` starts real processes joined by torch.distributed over gloo; `ranks_main` is what each runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import yaml

from hybridflow import algos
from hybridflow.api import parse_job
from hybridflow.api.spec import Rollout, Training
from hybridflow.data.tiny import VOCAB, ensure_tiny_model
from hybridflow.workers import distributed
from hybridflow.workers.actor import ActorRolloutWorker
from hybridflow.workers.batch import RolloutBatch
from hybridflow.workers.critic import CriticWorker
from hybridflow.workers.modeling import in_micro_batches, load_causal_lm, quiet_transformers, response_log_probs
from hybridflow.workers.optim import train_epochs
from hybridflow.workers.rollout import TorchRollout
from hybridflow.workers.training import RoleTraining, checkpoints_activations, full

CPU = torch.device("cpu")
TINY_PPO = Path(__file__).resolve().parents[1] / "examples" / "tiny-ppo.yaml"
PROMPT, RESPONSE = 4, 6
HORIZON = RESPONSE
"""seq-mean-token-sum-norm's divisor: the longest response, as the actor passes data.maxResponseLength."""
LR = 1e-4
PORT_TRIES = 4


def make_batch(rows: int, seed: int, ragged: bool = False, samples: int = 1) -> RolloutBatch:
    """Random tokens (every token of the vocabulary appears, so every embedding row gets a gradient); `ragged`
    gives responses of 1..RESPONSE valid tokens. With `samples` above 1 each run of that many rows takes its first
    row's prompt (a GRPO group), and some tokens of the vocabulary may then appear nowhere."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, len(VOCAB), (rows, PROMPT + RESPONSE), generator=g)
    flat = ids.view(-1)
    flat[: len(VOCAB)] = torch.arange(len(VOCAB))
    ids[:, :PROMPT] = ids[::samples, :PROMPT].repeat_interleave(samples, 0)
    mask = torch.ones(rows, RESPONSE, dtype=torch.long)
    if ragged:
        lengths = torch.randint(1, RESPONSE + 1, (rows,), generator=g)
        mask = (torch.arange(RESPONSE) < lengths[:, None]).long()
    return RolloutBatch(input_ids=ids, attention_mask=torch.ones_like(ids), response_mask=mask,
                        prompt_length=PROMPT, policy_version=0, prompts=[""] * rows, responses=[""] * rows,
                        answers=[""] * rows, group_ids=list(range(rows)))


def padded_batch(seed: int = 0) -> RolloutBatch:
    """Eight rows of random tokens: prompts of 1..4 tokens left-padded to 6, responses of 1..5 right-padded to 8
    (so two columns on each side are padding in every row)."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.tensor([1, 4, 2, 3, 4, 1, 2, 3])
    response_lens = torch.tensor([5, 1, 3, 2, 4, 1, 5, 2])
    prompt = (torch.arange(6) >= 6 - prompt_lens[:, None]).long()
    response = (torch.arange(8) < response_lens[:, None]).long()
    mask = torch.cat([prompt, response], dim=1)
    ids = torch.randint(3, 14, mask.shape, generator=g) * mask
    return RolloutBatch(input_ids=ids, attention_mask=mask, response_mask=response, prompt_length=6,
                        policy_version=0, prompts=[""] * 8, responses=[""] * 8, answers=[""] * 8,
                        group_ids=list(range(8)), tensors={"scores": torch.arange(8.0), "advantages":
                                                           torch.randn(8, 8, generator=g)})


def new_training(dtype: str = "float32", lr: float = LR, keep_copy: bool = True, **options: Any) -> RoleTraining:
    quiet_transformers()
    model = load_causal_lm(str(ensure_tiny_model()), dtype, CPU)
    return RoleTraining(model, lr=lr, options=Training.model_validate(options), device=CPU, keep_copy=keep_copy)


def train(training: RoleTraining, batch: RolloutBatch, steps: int, micro: int | None = None,
          agg: str = "token-mean", tokens: int | None = None) -> dict[str, float]:
    """`steps` optimiser steps, each on the whole batch (no clipping: max norm 1e9), as train_epochs runs them
    (the inference copy synced at the end); `copy_bytes` is what the copy held in the passes, their mean."""

    def loss_fn(mb: RolloutBatch) -> tuple[torch.Tensor, dict[str, float]]:
        logp, _ = response_log_probs(training.module, mb, CPU)
        loss = algos.agg_loss(-logp, mb.response_mask.float(), agg, HORIZON)
        return loss, {"loss": loss.item(), "copy_bytes": float(training.inference_copy_bytes())}

    return train_epochs(training, batch, loss_fn, epochs=steps, steps_per_epoch=1,
                        shuffle=torch.Generator().manual_seed(0), max_grad_norm=1e9, device=CPU,
                        limits=Training(micro_batch_size=micro, micro_batch_tokens=tokens), agg=agg)


def weights(training: RoleTraining) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in training.model.named_parameters()}


def ranks_main(rank: int, world: int, port: int, out: str, from_one: str) -> None:
    """Every scenario of the tests on `world` ranks; rank 0 writes the full weights and byte counts."""
    torch.set_num_threads(1)
    distributed.setup("127.0.0.1", port, rank, world, "gloo", timeout_s=300)
    shard = make_batch(8, seed=1).shard(world)[rank]
    res: dict[str, Any] = {}

    t = new_training()
    res["copy_bytes_before"] = t.inference_copy_bytes()
    first = train(t, shard, 3)
    res["grad_norm"], res["copy_bytes_in_update"] = first["grad_norm"], first["copy_bytes"]
    res["copy_bytes_after"] = t.inference_copy_bytes()
    res["w3"] = weights(t)
    res["memory_sharded"] = t.memory_bytes()
    t.save(Path(out) / "from_two")
    train(t, shard, 1)
    res["w4"] = weights(t)

    lost = new_training()  # a rank lost in an update: the ranks are formed again and the checkpoint loaded
    train(lost, shard, 1)
    lost.release()
    lost.invalidate()
    lost.load(Path(out) / "from_two")
    res["w3_recovered"] = weights(lost)

    released = new_training(keep_copy=False)  # nothing reads the copy between updates: only shards stay
    counts = released.parameter_counts()
    train(released, shard, 3)
    res["released_copy_bytes"] = released.inference_copy_bytes()
    res["released_counts_kept"] = released.parameter_counts() == counts
    rollout = TorchRollout(released.model, None, Rollout(), PROMPT, RESPONSE, CPU,
                           generation=load_causal_lm(str(ensure_tiny_model()), "float32", CPU))
    res["released_sync_bytes"] = rollout.sync_weights(released.current, 3)
    res["w3_generation"] = {n: p.detach().clone() for n, p in rollout.model.named_parameters()}
    released.hold_copy()  # as before the ranks change
    res["released_copy_bytes_held"] = released.inference_copy_bytes()
    res["w3_held"] = weights(released)

    critic = CriticWorker(parse_job(yaml.safe_load(TINY_PPO.read_text())).spec, CPU, own_phase=True)
    scored = make_batch(8, seed=4).shard(world)[rank]
    g = torch.Generator().manual_seed(rank)
    scored.tensors["values"] = torch.zeros(scored.response_mask.shape)
    scored.tensors["returns"] = torch.randn(scored.response_mask.shape, generator=g)
    critic.update(scored)  # the value head moves off zero; the copy stays released
    res["critic_copy_bytes"] = critic.training.inference_copy_bytes()
    from_shards = critic.values(scored).tensors["values"].clone()
    critic.training.hold_copy()
    res["critic_copy_bytes_held"] = critic.training.inference_copy_bytes()
    from_copy = critic.values(scored).tensors["values"]
    gap = torch.tensor([float((from_shards - from_copy).abs().max()), float(from_copy.abs().max())])
    torch.distributed.all_reduce(gap, op=torch.distributed.ReduceOp.MAX)
    res["critic_values_gap"], res["critic_values_scale"] = float(gap[0]), float(gap[1])

    doc = yaml.safe_load(TINY_PPO.read_text())
    doc["spec"]["trainer"]["training"] = {"microBatchSize": 2}
    actor = ActorRolloutWorker(parse_job(doc).spec, CPU, scored=("old_log_probs",))
    actor.training.keep_copy = False  # as under vLLM, whose engine reads no copy (plan.policy_copy_read_...)
    train(actor.training, shard, 2)
    res["actor_copy_bytes"] = actor.training.inference_copy_bytes()
    ragged = make_batch(9, seed=5, ragged=True).shard(world)[rank]  # 5 and 4 rows: 3 and 2 passes of 2
    from_shards = actor.old_log_probs(ragged).tensors["old_log_probs"].clone()
    actor.training.hold_copy()
    from_copy = actor.old_log_probs(ragged).tensors["old_log_probs"]
    gap = torch.tensor([float((from_shards - from_copy).abs().max()), float(from_copy.abs().max())])
    torch.distributed.all_reduce(gap, op=torch.distributed.ReduceOp.MAX)
    res["old_log_probs_gap"], res["old_log_probs_scale"] = float(gap[0]), float(gap[1])

    resumed = new_training()
    resumed.load(from_one)
    train(resumed, shard, 1)
    res["w4_from_one"] = weights(resumed)

    replicated = new_training(shard=False)
    train(replicated, shard, 3)
    res["w3_replicated"] = weights(replicated)
    res["memory_replicated"] = replicated.memory_bytes()

    ragged = make_batch(9, seed=2, ragged=True).shard(world)[rank]  # 5 and 4 rows: 3 and 2 micro-batches of 2
    for agg in ("token-mean", "seq-mean-token-mean"):
        whole = new_training()
        train(whole, ragged, 2, agg=agg)
        res[f"ragged_{agg}"] = weights(whole)
        micro = new_training(microBatchSize=2)
        train(micro, ragged, 2, micro=2, agg=agg)
        res[f"ragged_micro_{agg}"] = weights(micro)

    scorer = new_training()  # forward only, the shards' 5 and 4 rows in 3 and 2 passes of 2: both ranks run 3
    with torch.no_grad():
        scored = in_micro_batches(ragged, Training(micro_batch_size=2),
                                  lambda mb: response_log_probs(scorer.module, mb, CPU)[0], sharded_on=CPU)
        whole = response_log_probs(scorer.model, ragged, CPU)[0] * ragged.response_mask
    gap = torch.tensor([float((scored - whole).abs().max())])
    torch.distributed.all_reduce(gap, op=torch.distributed.ReduceOp.MAX)
    res["sharded_scoring_gap"] = float(gap)

    grouped = new_training()  # a rank's 4 rows share a prompt: two forward calls of the sharded module a pass
    train(grouped, make_batch(8, seed=3, samples=4).shard(world)[rank], 3)
    res["w3_grouped"] = weights(grouped)

    checkpointed = new_training(gradientCheckpointing=True)
    train(checkpointed, shard, 3)
    res["w3_checkpointed"] = weights(checkpointed)
    res["checkpointing_on"] = checkpoints_activations(checkpointed.module)

    bf16 = new_training("bfloat16", lr=1e-6)
    res["bf16_kind"] = bf16.layout.kind
    before = [full(p.detach()).clone() for p in bf16.layout.params]
    train(bf16, shard, 10)
    after = [full(p.detach()) for p in bf16.layout.params]
    res["bf16_masters_changed"] = sum(int((a != b).sum()) for a, b in zip(after, before, strict=True))
    res["bf16_total"] = sum(b.numel() for b in before)
    res["bf16_master_dtype"] = str(after[0].dtype)
    if rank == 0:
        torch.save(res, Path(out) / "ranks.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def spawn_ranks(world: int, out: Path, from_one: Path) -> dict[str, Any]:
    """Run `ranks_main` on `world` processes; a port taken between picking and binding is picked again."""
    import torch.multiprocessing as mp

    for attempt in range(PORT_TRIES):
        port = distributed.free_port()
        try:
            mp.spawn(ranks_main, args=(world, port, str(out), str(from_one)), nprocs=world, join=True)
            break
        except mp.ProcessRaisedException as e:
            if "address already in use" not in str(e).lower() or attempt == PORT_TRIES - 1:
                raise
    result: dict[str, Any] = torch.load(out / "ranks.pt", weights_only=True)
    return result
