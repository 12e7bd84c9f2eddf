"""LoRA policies in process (no Ray): the spec's checks, the reference as the adapters-off base, checkpoints that
hold the adapters and resume exactly, the merged weights a serving engine loads, and the training footprint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftModel

from hybridflow import dcp
from hybridflow.api import SpecError, parse_job
from hybridflow.checkpoint import load_state, training_dir
from hybridflow.data.tiny import TINY_CONFIG, VOCAB, ensure_tiny_model
from hybridflow.graph import builtin_graph, reference_in_policy
from hybridflow.plan import step_plan
from hybridflow.preflight import preflight
from hybridflow.workers.footprint import training_footprint
from hybridflow.workers.host import WorkerHost
from hybridflow.workers.lora import TARGETS_FIELD, LoraTargetError, apply_lora, merged_weights, targets_problem
from hybridflow.workers.modeling import load_causal_lm, load_policy, response_log_probs
from hybridflow.workers.training import MODEL_PREFIX

ROLES = {"actor_rollout": "actor_rollout", "reward_score": "reward", "reference": "reference"}
CPU = torch.device("cpu")


def lora_doc(example_doc, **lora) -> dict:
    doc = example_doc("tiny-grpo-lora.yaml")
    doc["spec"]["model"]["policy"]["lora"].update(lora)
    return doc


def host_of(doc: dict, seed: int = 0) -> WorkerHost:
    return WorkerHost(parse_job(doc).spec.model_dump(mode="json"), ROLES, instance=0, seed=seed, use_gpu=False)


def train(host: WorkerHost, steps: int) -> list[dict[str, float]]:
    """`steps` fused GRPO steps on fixed prompts (8 prompts x 8 samples), as the Trainer runs them."""
    spec = host.spec
    plan = step_plan(builtin_graph(spec, "CPU"), spec)
    digits = [(1, 2, 3), (4, 5, 6), (7, 8, 9), (0, 1, 2), (3, 4, 5), (6, 7, 8), (9, 0, 1), (2, 2, 2)]
    prompts = [{"prompt": f"{a} {b} {c}", "answer": str(c)} for a, b, c in digits]
    rows = [r for r in prompts for _ in range(8)]
    gids = [i for i in range(len(prompts)) for _ in range(8)]
    return [host.run_step(list(plan.phases), rows, gids, list(plan.colocated), 0.001).update
            for _ in range(steps)]


# -- the spec ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("lora", "problem"), [
    ({"rank": 0}, "spec.model.policy.lora.rank: Input should be greater than or equal to 1"),
    ({"alpha": 0}, "spec.model.policy.lora.alpha: Input should be greater than 0"),
    ({"targetModules": []}, "spec.model.policy.lora.targetModules: List should have at least 1 item"),
    ({"targetModules": ["q_proj", "q_proj"]}, "spec.model.policy.lora.targetModules: 'q_proj' appears more than once"),
    ({"dropout": 1.0}, "spec.model.policy.lora.dropout: Input should be less than 1"),
])
def test_lora_settings_are_checked_by_field(example_doc, lora: dict, problem: str) -> None:
    with pytest.raises(SpecError) as e:
        parse_job(lora_doc(example_doc, **lora))
    assert any(p.startswith(problem) for p in e.value.problems), e.value.problems


def test_no_lora_is_a_full_fine_tune_and_separate_adapters_need_lora(example_doc) -> None:
    doc = example_doc("tiny-grpo.yaml")
    assert parse_job(doc).spec.model.policy.lora is None
    doc["spec"]["trainer"]["export"] = {"path": "out", "adapters": "separate"}
    with pytest.raises(SpecError, match=r"trainer\.export\.adapters 'separate' needs model\.policy\.lora"):
        parse_job(doc)


def test_targets_that_name_no_layer_are_refused_before_and_at_loading(example_doc) -> None:
    spec = parse_job(lora_doc(example_doc, targetModules=["query", "value"])).spec
    (problem,) = [p for p in preflight(spec, "CPU") if "lora" in p]
    assert problem.startswith(f"{TARGETS_FIELD}: none of 'query', 'value' names a layer of the model")
    assert "down_proj, embed_tokens, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj" in problem
    with pytest.raises(LoraTargetError) as e:
        load_policy(spec.model.policy, CPU)
    assert str(e.value) == problem
    assert preflight(parse_job(lora_doc(example_doc)).spec, "CPU") == []
    assert targets_problem([("model.layers.0.self_attn.q_proj", torch.nn.Linear(2, 2))], ["self_attn.q_proj"]) is None
    assert targets_problem([("model.layers.0.self_attn.q_proj", torch.nn.Linear(2, 2))], ["attn.q_proj"]) is not None


def test_the_reference_shares_the_policys_process_and_asks_for_no_gpu(example_doc) -> None:
    lora = parse_job(example_doc("tiny-grpo-lora.yaml")).spec
    full = parse_job(example_doc("tiny-grpo.yaml")).spec
    assert reference_in_policy(lora) and not reference_in_policy(full)
    assert builtin_graph(lora, "GPU").get("reference").resources == {}
    assert builtin_graph(full, "GPU").get("reference").resources == {"GPU": 0.25}
    separate = example_doc("tiny-grpo-lora.yaml")
    separate["spec"]["model"]["reference"]["path"] = "builtin:tiny"
    assert not reference_in_policy(parse_job(separate).spec)


# -- the reference is the base ----------------------------------------------------------------------------------


def test_reference_log_probs_are_the_base_models_with_one_model_loaded(example_doc) -> None:
    doc = example_doc("tiny-grpo-lora.yaml")
    doc["spec"]["trainer"]["actorLr"] = 0.05  # move the adapters far in a few steps
    host = host_of(doc)
    actor, ref = host.workers["actor_rollout"], host.workers["reference"]
    assert ref.model is actor.model and isinstance(actor.model, PeftModel)
    train(host, 3)
    batch = host.rollout([{"prompt": "1 2 3", "answer": "3"}, {"prompt": "4 5 6", "answer": "6"}] * 8, [0, 1] * 8,
                         ["reward", "reference", "old_log_probs"])
    base = load_causal_lm(str(ensure_tiny_model()), "float32", CPU)
    with torch.no_grad():
        expected, _ = response_log_probs(base, batch, CPU)
    mask = batch.response_mask.bool()
    assert torch.allclose(batch.tensors["ref_log_probs"][mask], expected[mask], atol=1e-6)
    moved = (batch.tensors["old_log_probs"] - batch.tensors["ref_log_probs"])[mask].abs().max().item()
    assert moved > 0.1, "the adapters did not change the policy"
    assert actor.model.active_adapters == ["default"]  # switched back on after scoring


# -- checkpoints ------------------------------------------------------------------------------------------------


def test_a_checkpoint_holds_the_adapters_only_and_resumes_exactly(example_doc, tmp_path: Path) -> None:
    doc = example_doc("tiny-grpo-lora.yaml")
    first = host_of(doc)
    train(first, 2)
    first.save(str(tmp_path), "actor_rollout_0")
    assert "model" not in load_state(tmp_path / "actor_rollout_0.pt")["roles"]["actor_rollout"]
    saved = dcp.read_full(training_dir(tmp_path, "actor_rollout_0", "actor_rollout"), MODEL_PREFIX)
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved)
    trainable = {n for n, p in first.workers["actor_rollout"].model.named_parameters() if p.requires_grad}
    assert set(saved) == trainable and len(trainable) == 2 * 5  # A and B of q_proj, v_proj (2 layers), lm_head
    went_on = train(first, 2)
    resumed = host_of(doc)  # after the first host has trained on: both draw from this process's RNG
    resumed.load(str(tmp_path), "actor_rollout_0")
    assert resumed.policy_version() == 2
    assert train(resumed, 2) == went_on
    for name, tensor in first.workers["actor_rollout"].weights().items():
        assert torch.equal(tensor, resumed.workers["actor_rollout"].weights()[name]), name


def test_a_full_state_does_not_load_into_a_lora_policy(example_doc) -> None:
    model = load_policy(parse_job(example_doc("tiny-grpo-lora.yaml")).spec.model.policy, CPU)
    from hybridflow.workers.modeling import load_policy_weights

    full = load_causal_lm(str(ensure_tiny_model()), "float32", CPU).state_dict()
    with pytest.raises(ValueError, match="not the policy's adapters"):
        load_policy_weights(model, full)


def test_merged_weights_equal_peft_merge_and_leave_the_policy_as_it_was(example_doc) -> None:
    """What a vLLM rollout loads after each update: W + (alpha/r) B A under the base model's names."""
    targets = ["q_proj", "v_proj", "lm_head", "embed_tokens"]
    model = load_policy(parse_job(lora_doc(example_doc, dropout=0.1, targetModules=targets)).spec.model.policy, CPU)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:  # B (and an embedding's A) start at zero
                p.normal_(0, 0.5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    merged = merged_weights(model)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    plain = model.merge_and_unload().state_dict()
    assert merged.keys() == plain.keys()
    for k in plain:
        assert not merged[k].requires_grad and torch.allclose(merged[k], plain[k], atol=1e-6), k
    for key in ("lm_head.weight", "model.embed_tokens.weight", "model.layers.1.self_attn.v_proj.weight"):
        assert not torch.equal(merged[key], before[f"base_model.model.{key}".replace(".weight", ".base_layer.weight")])


# -- what training costs ----------------------------------------------------------------------------------------


def test_footprint_counts_trainable_values_and_optimizer_bytes() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    model[1].requires_grad_(False)
    sgd = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    adam = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    assert training_footprint(model, adam).optimizer_state_bytes == 0  # Adam's state starts at its first step
    for opt in (sgd, adam):
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
    for opt, state in ((sgd, 0), (adam, 2 * 4 * 8 + 2 * 4)):  # two float32 moments per value, a step per tensor
        fp = training_footprint(model, opt)
        assert (fp.trainable_params, fp.total_params, fp.optimizer_state_bytes, fp.model_bytes) == (8, 11, state, 44)
    assert fp.record("actor") == {"actor_trainable_params": 8.0, "actor_total_params": 11.0,
                                  "actor_optimizer_state_bytes": 72.0, "actor_model_bytes": 44.0}


def test_lora_trains_a_fraction_of_the_weights_with_a_fraction_of_the_optimizer_state(example_doc) -> None:
    """Measured after one update on each worker; the figures go into every step's record (and are printed here)."""
    lora = train(host_of(example_doc("tiny-grpo-lora.yaml")), 1)[0]
    full = train(host_of(example_doc("tiny-grpo.yaml")), 1)[0]
    h, v, r = TINY_CONFIG["hidden_size"], len(VOCAB), 16
    adapted = 2 * 2 * r * (h + h) + r * (h + v)  # q_proj and v_proj in 2 layers, and lm_head: r * (in + out) each
    assert lora["actor_trainable_params"] == adapted
    assert full["actor_trainable_params"] == full["actor_total_params"] == lora["actor_total_params"] - adapted
    for fig in (lora, full):
        tensors = 10 if fig is lora else 21
        assert fig["actor_optimizer_state_bytes"] == 2 * 4 * fig["actor_trainable_params"] + 4 * tensors
    share = lora["actor_trainable_params"] / full["actor_trainable_params"]
    print(f"\ntiny model, AdamW float32: full fine-tune {full['actor_trainable_params']:.0f} trainable parameters, "
          f"{full['actor_optimizer_state_bytes']:.0f} optimizer bytes; LoRA r=16 on q_proj, v_proj, lm_head "
          f"{lora['actor_trainable_params']:.0f} ({share:.1%}), {lora['actor_optimizer_state_bytes']:.0f} bytes")


def test_apply_lora_names_the_field_for_targets_peft_refuses(example_doc) -> None:
    spec = parse_job(lora_doc(example_doc, targetModules=["layers"])).spec
    model = load_causal_lm(str(ensure_tiny_model()), "float32", CPU)
    assert spec.model.policy.lora is not None
    with pytest.raises(LoraTargetError, match=f"^{TARGETS_FIELD}: "):
        apply_lora(model, spec.model.policy.lora)
