"""Resharding the trained policy into the generation layout: cut rules, bucket plans, TP slices, and the
torch rollout's weight sync with its policy-version guard."""

from __future__ import annotations

import pytest
import torch

from hybridflow.api import parse_job
from hybridflow.data.prompts import load_rows
from hybridflow.data.tiny import ensure_tiny_model
from hybridflow.workers.batch import PolicyVersionError
from hybridflow.workers.modeling import load_causal_lm, load_tokenizer
from hybridflow.workers.reshard import (
    Bucket,
    ReshardError,
    WeightInfo,
    copy_into,
    cut_dim,
    pack,
    plan_buckets,
    slice_bytes,
    stream_buckets,
    tp_slice,
    unpack,
    weight_infos,
)
from hybridflow.workers.rollout import TorchRollout

LAYER = "model.layers.3."


@pytest.mark.parametrize(("name", "dim"), [
    (LAYER + "self_attn.q_proj.weight", 0), (LAYER + "self_attn.k_proj.weight", 0),
    (LAYER + "self_attn.v_proj.weight", 0), (LAYER + "self_attn.q_proj.bias", 0),  # qwen2's q/k/v biases
    (LAYER + "mlp.gate_proj.weight", 0), (LAYER + "mlp.up_proj.weight", 0),
    (LAYER + "self_attn.o_proj.weight", 1), (LAYER + "mlp.down_proj.weight", 1),
    ("model.embed_tokens.weight", 0), ("lm_head.weight", 0),
    (LAYER + "input_layernorm.weight", None), (LAYER + "post_attention_layernorm.weight", None),
    ("model.norm.weight", None), (LAYER + "self_attn.q_norm.weight", None),  # qwen3's per-head norms
    (LAYER + "self_attn.k_norm.weight", None),
])
def test_cut_rules_for_the_decoder_families(name: str, dim: int | None) -> None:
    assert cut_dim(name) == dim


def test_an_unknown_weight_is_refused_by_name() -> None:
    with pytest.raises(ReshardError, match=r"'transformer.h.0.attn.c_attn.weight'.*llama, mistral, qwen2, qwen3"):
        cut_dim("transformer.h.0.attn.c_attn.weight")


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden, inter, vocab, kv = 16, 24, 10, 8

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    state = {"model.embed_tokens.weight": r(vocab, hidden)}
    for i in range(2):
        p = f"model.layers.{i}."
        state |= {p + "self_attn.q_proj.weight": r(hidden, hidden), p + "self_attn.q_proj.bias": r(hidden),
                  p + "self_attn.k_proj.weight": r(kv, hidden), p + "self_attn.v_proj.weight": r(kv, hidden),
                  p + "self_attn.o_proj.weight": r(hidden, hidden), p + "mlp.gate_proj.weight": r(inter, hidden),
                  p + "mlp.up_proj.weight": r(inter, hidden), p + "mlp.down_proj.weight": r(hidden, inter),
                  p + "input_layernorm.weight": r(hidden), p + "post_attention_layernorm.weight": r(hidden)}
    return state | {"model.norm.weight": r(hidden), "lm_head.weight": r(vocab, hidden)}


@pytest.mark.parametrize("tp", [1, 2])
def test_the_ranks_slices_concatenate_back_to_each_full_tensor(tp: int) -> None:
    state = _state()
    for name, t in state.items():
        parts = [tp_slice(name, t, rank, tp) for rank in range(tp)]
        dim = cut_dim(name)
        if dim is None or tp == 1:
            assert all(p is t for p in parts)
        else:
            assert all(p.shape[dim] == t.shape[dim] // tp for p in parts)
            assert torch.equal(torch.cat(parts, dim=dim), t)


def test_a_weight_that_does_not_split_evenly_is_refused() -> None:
    with pytest.raises(ReshardError, match=r"'lm_head.weight' of shape \[10, 16\] does not split into 4"):
        tp_slice("lm_head.weight", torch.zeros(10, 16), 0, 4)
    with pytest.raises(ReshardError, match=r"rank 2 is outside 0\.\.1"):
        tp_slice("lm_head.weight", torch.zeros(10, 16), 2, 2)


def test_bucket_plan_keeps_order_and_size() -> None:
    infos = [WeightInfo(f"model.layers.0.mlp.{k}_proj.weight", (8, 8), torch.float32) for k in ("gate", "up")]
    infos += [WeightInfo("model.norm.weight", (8,), torch.float32), WeightInfo("lm_head.weight", (64, 8),
                                                                                 torch.float32)]
    # per-rank bytes at tp=2: 128, 128, 32 (replicated), 1024 (larger than a bucket: travels alone)
    assert [slice_bytes(w, 2) for w in infos] == [128, 128, 32, 1024]
    assert plan_buckets(infos, 256, tp_size=2) == [[infos[0].name, infos[1].name], [infos[2].name],
                                                   [infos[3].name]]
    assert plan_buckets(infos, 10_000, tp_size=1) == [[w.name for w in infos]]
    assert [n for b in plan_buckets(infos, 1, tp_size=1) for n in b] == [w.name for w in infos]
    with pytest.raises(ReshardError, match="at least 1 byte"):
        plan_buckets(infos, 0)


@pytest.mark.parametrize("tp", [1, 2])
def test_each_ranks_stream_rebuilds_the_model_one_bucket_at_a_time(tp: int) -> None:
    state = _state()
    bucket_bytes = 2048
    largest = max(slice_bytes(w, tp) for w in weight_infos(state))
    got: dict[int, dict[str, torch.Tensor]] = {}
    for rank in range(tp):
        got[rank] = {}
        for bucket in stream_buckets(state, bucket_bytes, rank, tp):
            # a rank never holds more than one bucket: the larger of the bucket size and one weight's slice
            assert bucket.nbytes <= max(bucket_bytes, largest)
            for name, t in zip(bucket.names, bucket.tensors, strict=True):
                assert t.untyped_storage().data_ptr() != state[name].untyped_storage().data_ptr()  # a copy
                got[rank][name] = t
    assert list(got[0]) == list(state)
    for name, t in state.items():
        dim = cut_dim(name)
        parts = [got[r][name] for r in range(tp)]
        assert torch.equal(t if dim is None or tp == 1 else torch.cat(parts, dim=dim), t)
        if dim is None:
            assert all(torch.equal(p, t) for p in parts)


def test_pack_and_unpack_round_trip_mixed_dtypes() -> None:
    bucket = Bucket(["a", "b", "c"], [torch.randn(3, 4), torch.randn(5).to(torch.bfloat16),
                                      torch.arange(6, dtype=torch.int64).view(2, 3)])
    names, shapes, dtypes, buffer = pack(bucket)
    assert buffer.dtype == torch.uint8 and bucket.nbytes <= buffer.numel() < bucket.nbytes + 3 * 16
    assert (names, shapes, dtypes) == (["a", "b", "c"], [[3, 4], [5], [2, 3]], ["float32", "bfloat16", "int64"])
    back = unpack(names, shapes, dtypes, buffer)
    assert [n for n, _ in back] == names
    assert all(torch.equal(t, want) for (_, t), want in zip(back, bucket.tensors, strict=True))
    with pytest.raises(ReshardError, match="beyond its weights"):
        unpack(names[:2], shapes[:2], dtypes[:2], buffer)
    with pytest.raises(ReshardError, match="unknown dtype 'float7'"):
        unpack(["a"], [[1]], ["float7"], buffer)


def test_copy_into_names_a_missing_weight() -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ReshardError, match=r"no weight named 'lm_head\.weight'"):
        copy_into(model, [("lm_head.weight", torch.zeros(2, 2))])
    with pytest.raises(ReshardError, match=r"'weight': generation expects shape \[2, 2\], got \[3\]"):
        copy_into(model, [("weight", torch.zeros(3))])


@pytest.fixture
def tiny_rollout(example_doc):
    """A TorchRollout generating with a module of its own, and a trained policy of different weights."""
    spec = parse_job(example_doc("tiny-grpo.yaml")).spec
    path = str(ensure_tiny_model())
    trained = load_causal_lm(path, "float32", torch.device("cpu"))
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p))
    generation = load_causal_lm(path, "float32", torch.device("cpu"))
    rollout = TorchRollout(trained, load_tokenizer(path), spec.rollout, 8, 4, torch.device("cpu"),
                           generation=generation, bucket_bytes=4096)
    return rollout, trained, generation


def test_sync_makes_the_generation_weights_equal_and_the_versions_agree(tiny_rollout) -> None:
    rollout, trained, generation = tiny_rollout
    rows = load_rows("builtin:tiny_task", "prompt", "answer")[:4]
    assert not all(torch.equal(a, b) for a, b in zip(trained.state_dict().values(),
                                                     generation.state_dict().values(), strict=True))
    rollout.generate(rows, [0, 1, 2, 3], policy_version=0)
    with pytest.raises(PolicyVersionError, match="holds policy version 0 but was asked to generate for version 1"):
        rollout.generate(rows, [0, 1, 2, 3], policy_version=1)
    rollout.sync_weights(trained, 1)
    want, have = trained.state_dict(), generation.state_dict()
    assert list(want) == list(have)
    assert all(torch.equal(want[k], have[k]) for k in want)
    assert all(want[k].data_ptr() != have[k].data_ptr() for k in want)  # copied, not shared
    assert rollout.generate(rows, [0, 1, 2, 3], policy_version=1).policy_version == 1
    with pytest.raises(PolicyVersionError):
        rollout.generate(rows, [0, 1, 2, 3], policy_version=0)


def test_sync_onto_the_trained_module_itself_only_moves_the_version(tiny_rollout) -> None:
    rollout, trained, _ = tiny_rollout
    own = TorchRollout(trained, rollout.tok, rollout.cfg, 8, 4, torch.device("cpu"))
    before = {k: v.clone() for k, v in trained.state_dict().items()}
    own.sync_weights(trained, 3)
    assert own.version == 3 and all(torch.equal(before[k], v) for k, v in trained.state_dict().items())
