"""One rank of the sequence-parallel tests: `python ulysses_ranks.py CASE RANK WORLD PORT OUT_DIR`.

Joins a gloo group on 127.0.0.1:PORT and writes what it measured to OUT_DIR/rank<RANK>.json. The
reference (SP off) is computed in the same processes, on the same weights and rows.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import torch
import yaml

from hybridflow import algos
from hybridflow.api import parse_job
from hybridflow.api.spec import RLTrainingJobSpec
from hybridflow.workers import distributed, ulysses
from hybridflow.workers.actor import ActorRolloutWorker, policy_log_probs
from hybridflow.workers.batch import RolloutBatch
from hybridflow.workers.critic import CriticWorker
from hybridflow.workers.modeling import position_ids, response_log_probs

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny-ppo.yaml"
SP = 2


def critic_spec(sp: int, policy_sp: int = 1) -> RLTrainingJobSpec:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["model"]["critic"] = {"sequenceParallel": sp}
    doc["spec"]["model"]["policy"]["sequenceParallel"] = policy_sp
    doc["spec"]["algorithm"]["klPenalty"]["mode"] = "loss"
    doc["spec"]["data"]["batchSize"] = 6
    doc["spec"]["algorithm"]["miniBatchSize"] = 3
    return parse_job(doc).spec


def rollout_batch(rows: int, prompt: int, response: int, seed: int = 0) -> RolloutBatch:
    """Tokens of the tiny vocabulary; left-padded prompts, right-padded responses of varied lengths; the
    advantage-phase tensors filled in."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 14, (rows, prompt + response), generator=g)
    mask = torch.ones_like(ids)
    for r in range(rows):
        mask[r, : r % prompt] = 0  # left padding
        mask[r, prompt + response - (r % response):] = 0  # responses that ended early
    ids = ids * mask
    resp = mask[:, prompt:].clone()
    n = rows
    batch = RolloutBatch(ids, mask, resp, prompt, 0, [""] * n, [""] * n, [""] * n, list(range(n)))
    batch.tensors["values"] = torch.randn(rows, response, generator=g) * resp
    batch.tensors["returns"] = torch.randn(rows, response, generator=g) * resp
    return batch


def same_weights(workers: list[CriticWorker]) -> None:
    """A value head that is not zero (else the backbone gets no gradient), the same on every worker."""
    torch.manual_seed(1234)
    head = torch.nn.Linear(workers[0].model.value_head.in_features, 1)
    for w in workers:
        w.model.value_head.load_state_dict(head.state_dict())


def flat_grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def case_equal(rank: int) -> dict[str, Any]:
    """SP=2 against SP=1 on the same weights and rows: values, loss and gradients of one minibatch, then
    a whole update, then SP turned off."""
    sp_worker, plain = CriticWorker(critic_spec(SP), torch.device("cpu")), CriticWorker(critic_spec(1),
                                                                                      torch.device("cpu"))
    same_weights([sp_worker, plain])
    batch = rollout_batch(rows=6, prompt=5, response=6)  # 11 tokens: padded to 12 under SP
    out: dict[str, Any] = {"sp_group_size": torch.distributed.get_world_size(sp_worker.sp.group())}

    with torch.no_grad():
        v_sp, v_plain = sp_worker._values(batch), plain._values(batch)
    m = batch.response_mask.float()
    out["values_max_abs_diff"] = max_diff(v_sp * m, v_plain * m)
    out["values_scale"] = float(v_plain.abs().max())

    losses, grads = [], []
    for w in (sp_worker, plain):
        w.model.zero_grad()
        loss, _ = algos.value_loss(w._values(batch), batch.tensors["returns"], batch.tensors["values"], m,
                                   clip=0.2, agg="token-mean")
        loss.backward()
        distributed.average_gradients(w.model.parameters())  # as train_epochs does before every step
        losses.append(float(loss))
        grads.append(flat_grads(w.model))
    out["loss_sp"], out["loss_plain"] = losses
    out["loss_abs_diff"] = abs(losses[0] - losses[1])
    out["grad_max_abs_diff"] = max_diff(*grads)
    out["grad_scale"] = float(grads[1].abs().max())

    metrics_sp, metrics_plain = sp_worker.update(copy.deepcopy(batch)), plain.update(copy.deepcopy(batch))
    out["update_loss_abs_diff"] = abs(metrics_sp["critic_loss"] - metrics_plain["critic_loss"])
    out["update_grad_norm_rel_diff"] = (abs(metrics_sp["critic_grad_norm"] - metrics_plain["critic_grad_norm"])
                                        / metrics_plain["critic_grad_norm"])
    out["update_param_max_abs_diff"] = max(
        max_diff(a, b) for a, b in zip(sp_worker.model.parameters(), plain.model.parameters(), strict=True))

    out["was_on"] = sp_worker.sp.disable()
    state = plain.state_dict()  # the same weights, and a fresh optimizer on both, from here on
    sp_worker.load_state_dict(copy.deepcopy(state))
    plain.load_state_dict(copy.deepcopy(state))
    out["group_after_disable"] = sp_worker.sp.group() is not None
    with torch.no_grad():
        out["disabled_values_max_abs_diff"] = max_diff(sp_worker._values(batch) * m, plain._values(batch) * m)
    metrics_sp, metrics_plain = sp_worker.update(copy.deepcopy(batch)), plain.update(copy.deepcopy(batch))
    out["disabled_update_loss_abs_diff"] = abs(metrics_sp["critic_loss"] - metrics_plain["critic_loss"])
    out["disabled_param_max_abs_diff"] = max(
        max_diff(a, b) for a, b in zip(sp_worker.model.parameters(), plain.model.parameters(), strict=True))
    return out


def params_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(max_diff(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def scored(batch: RolloutBatch, worker: ActorRolloutWorker) -> RolloutBatch:
    """The batch as an update gets it: old log-probs of the generating policy, advantages, reference log-probs."""
    g = torch.Generator().manual_seed(5)
    m = batch.response_mask
    with torch.no_grad():
        batch.tensors["old_log_probs"] = response_log_probs(worker.model, batch, torch.device("cpu"))[0]
    batch.tensors["advantages"] = torch.randn(m.shape, generator=g) * m
    batch.tensors["ref_log_probs"] = batch.tensors["old_log_probs"] + 0.05 * torch.randn(m.shape, generator=g) * m
    return batch


def case_actor(rank: int) -> dict[str, Any]:
    """The policy's training passes with SP=2 against SP=1 on the same weights and rows: log-probs, entropy,
    sum_v pi_v^2, the PPO loss and its gradients on one minibatch, then two whole updates (KL in the loss), then SP
    off."""
    sp_worker = ActorRolloutWorker(critic_spec(1, SP), torch.device("cpu"))
    plain = ActorRolloutWorker(critic_spec(1, 1), torch.device("cpu"))
    batch = scored(rollout_batch(rows=6, prompt=5, response=6), plain)  # 11 tokens: padded to 12 under SP
    m = batch.response_mask.float()
    out: dict[str, Any] = {"sp_group_size": torch.distributed.get_world_size(sp_worker.sp.group())}
    head: list[int] = []
    hook = sp_worker.model.get_output_embeddings().register_forward_hook(
        lambda _m, args, _out: head.append(args[0].shape[1]))
    with torch.no_grad():
        (lp_sp, ent_sp), (lp, ent) = (policy_log_probs(w.model, w.sp, batch, torch.device("cpu"), "entropy_loss")
                                      for w in (sp_worker, plain))
    hook.remove()
    out["lm_head_positions"] = head
    assert ent_sp is not None and ent is not None
    out["log_probs_max_abs_diff"] = max_diff(lp_sp * m, lp * m)
    out["entropy_max_abs_diff"] = max_diff(ent_sp * m, ent * m)
    out["log_probs_scale"] = float((lp * m).abs().max())
    with torch.no_grad():  # the optimal token baseline's sum_v pi_v^2, gathered the same way
        (_, spp_sp), (_, spp) = (policy_log_probs(w.model, w.sp, batch, torch.device("cpu"), "sum_pi_squared")
                                 for w in (sp_worker, plain))
    assert spp_sp is not None and spp is not None
    out["sum_pi_squared_max_abs_diff"] = max_diff(spp_sp * m, spp * m)

    losses, grads = [], []
    for w in (sp_worker, plain):
        w.model.zero_grad()
        logp, entropy = policy_log_probs(w.model, w.sp, batch, torch.device("cpu"), "entropy_loss")
        assert entropy is not None
        loss, _ = algos.ppo_policy_loss(batch.tensors["old_log_probs"], logp, batch.tensors["advantages"], m,
                                        clip_low=0.2, clip_high=0.2, dual_clip_c=None, agg="token-mean")
        (loss - 0.01 * algos.agg_loss(entropy, m, "token-mean")).backward()
        distributed.average_gradients(w.model.parameters())
        losses.append(loss.item())
        grads.append(flat_grads(w.model))
    out["loss_abs_diff"] = abs(losses[0] - losses[1])
    out["grad_max_abs_diff"] = max_diff(*grads)
    out["grad_scale"] = float(grads[1].abs().max())

    for step in range(2):  # the second update starts from the first's weights and Adam moments
        metrics_sp, metrics_plain = sp_worker.update(copy.deepcopy(batch), 0.1), plain.update(copy.deepcopy(batch), 0.1)
        batch.policy_version += 1
        out[f"update{step}_loss_abs_diff"] = abs(metrics_sp["actor_loss"] - metrics_plain["actor_loss"])
        out[f"update{step}_kl_abs_diff"] = abs(metrics_sp["kl_loss"] - metrics_plain["kl_loss"])
        out[f"update{step}_grad_norm_rel_diff"] = (abs(metrics_sp["actor_grad_norm"] - metrics_plain["actor_grad_norm"])
                                                   / metrics_plain["actor_grad_norm"])
    out["update_param_max_abs_diff"] = params_diff(sp_worker.model, plain.model)
    out["update_param_moved"] = params_diff(plain.model, ActorRolloutWorker(critic_spec(1, 1),
                                                                            torch.device("cpu")).model)

    out |= actor_memory(sp_worker, plain, seq=1024)

    out["was_on"] = sp_worker.sp.disable()
    out["group_after_disable"] = sp_worker.sp.group() is not None
    metrics_sp, metrics_plain = sp_worker.update(copy.deepcopy(batch), 0.1), plain.update(copy.deepcopy(batch), 0.1)
    out["disabled_update_loss_abs_diff"] = abs(metrics_sp["actor_loss"] - metrics_plain["actor_loss"])
    out["disabled_param_max_abs_diff"] = params_diff(sp_worker.model, plain.model)
    return out


def actor_memory(sp_worker: ActorRolloutWorker, plain: ActorRolloutWorker, seq: int) -> dict[str, Any]:
    """Saved activations of the policy's log-prob forward+backward over one unpadded row of `seq` tokens (a
    4-token prompt), SP=2 against SP=1, less the weights."""
    ids = torch.randint(4, 14, (1, seq), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    resp = mask[:, 4:].clone()
    batch = RolloutBatch(ids, mask, resp, 4, sp_worker.version, [""], [""], [""], [0])
    weights = sum(p.numel() * p.element_size() for p in plain.model.parameters())
    out: dict[str, Any] = {}
    logp: dict[str, torch.Tensor] = {}
    for name, w in (("sp", sp_worker), ("plain", plain)):
        def run(w: ActorRolloutWorker = w, name: str = name) -> None:
            lp, _ = policy_log_probs(w.model, w.sp, batch, torch.device("cpu"))
            logp[name] = lp.detach()
            lp.sum().backward()
        out[f"actor_saved_bytes_{name}"] = saved_bytes(run) - weights
    out["actor_memory_log_probs_max_abs_diff"] = max_diff(logp["sp"], logp["plain"])
    return out


def saved_bytes(fn: Any) -> int:
    """Bytes of the distinct tensors autograd saves for backward while `fn` runs (the activations)."""
    seen: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta" and t.numel():
            storage = t.untyped_storage()
            seen[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def forward_backward(w: CriticWorker, ids: torch.Tensor, mask: torch.Tensor, values: dict[str, torch.Tensor],
                     name: str) -> None:
    v = ulysses.forward_tokens(w.model, w.sp, ids * mask, mask)
    values[name] = (v * mask).detach()
    v.sum().backward()


def case_memory(rank: int, seq: int) -> dict[str, Any]:
    """Saved activations of one forward+backward over `seq` tokens, SP=2 against SP=1, for a row without
    padding (causal attention, no mask) and one with left padding (a mask, so SDPA keeps the scores)."""
    sp_worker, plain = CriticWorker(critic_spec(SP), torch.device("cpu")), CriticWorker(critic_spec(1),
                                                                                      torch.device("cpu"))
    same_weights([sp_worker, plain])
    ids = torch.randint(4, 14, (1, seq), generator=torch.Generator().manual_seed(0))
    weights = sum(p.numel() * p.element_size() for p in plain.model.parameters())
    out: dict[str, Any] = {"seq": seq, "weights_bytes": weights}
    for variant, pad in (("full", 0), ("padded", seq // 8)):
        mask = torch.ones_like(ids)
        mask[:, :pad] = 0
        values: dict[str, torch.Tensor] = {}
        for name, w in (("sp", sp_worker), ("plain", plain)):
            out[f"{variant}_saved_bytes_{name}"] = saved_bytes(lambda w=w, name=name, mask=mask, values=values:
                                                               forward_backward(w, ids, mask, values, name))
        out[f"{variant}_values_max_abs_diff"] = max_diff(values["sp"], values["plain"])
    heads = plain.model.backbone.config.num_attention_heads
    out["score_bytes_sp"] = 1 * (heads // SP) * seq * seq * 4
    out["score_bytes_plain"] = 1 * heads * seq * seq * 4
    return out


def case_gqa(rank: int) -> dict[str, Any]:
    """A Llama with fewer key/value heads than query heads: 2 KV heads split over the ranks, 1 is repeated.
    Output and gradients of SP=2 against the plain forward, on a left-padded batch of odd length."""
    from transformers import LlamaConfig, LlamaModel

    out: dict[str, Any] = {}
    ids = torch.randint(4, 14, (2, 13), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    for kv in (2, 1):
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=14, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=kv, max_position_embeddings=64)
        config._attn_implementation = "sdpa"
        model = LlamaModel(config)
        ulysses.check_heads(*ulysses.model_heads(config), SP, "model.sequenceParallel")
        ulysses.register()
        results = []
        for sp in (True, False):
            model.zero_grad()
            if sp:
                h = ulysses.sequence_parallel_forward(
                    model, lambda i, p, m=model: m(input_ids=i, position_ids=p, use_cache=False).last_hidden_state,
                    ids, mask, torch.distributed.group.WORLD)
            else:
                h = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask),
                          use_cache=False).last_hidden_state
            (h * mask[..., None]).square().sum().backward()
            if sp:
                distributed.average_gradients(model.parameters())  # each rank's loss counts once in the sum
            results.append(((h * mask[..., None]).detach(), flat_grads(model)))
        out[f"kv{kv}_output_max_abs_diff"] = max_diff(results[0][0], results[1][0])
        out[f"kv{kv}_grad_max_rel_diff"] = max_diff(results[0][1], results[1][1]) / float(results[1][1].abs().max())
    return out


CASES = {"equal": case_equal, "gqa": case_gqa, "actor": case_actor}


def main() -> None:
    case, rank, world, port, out_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    torch.set_num_threads(1)
    distributed.setup("127.0.0.1", port, rank, world, "gloo", timeout_s=600.0, rendezvous_s=120.0)
    result = CASES[case](rank) if case in CASES else case_memory(rank, int(case.split(":")[1]))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.barrier()  # no rank tears its group down while a peer's gloo threads still talk to it
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
