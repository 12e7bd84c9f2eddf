"""Worker roles as plain Python objects (no Ray): rollout, scoring, PPO/critic steps, version checks."""

from __future__ import annotations

import copy

import pytest
import torch

from benchmarks.common import embedded_tokens
from hybridflow import algos
from hybridflow.advantages import compute_advantages
from hybridflow.api import parse_job
from hybridflow.checkpoint import OWNER_FILE, Superseded, check_owner, claim, commit, latest, prune, staging_dir
from hybridflow.data.prompts import PromptSampler, load_rows
from hybridflow.data.tiny import TINY_CONFIG, ensure_tiny_model, tiny_task_reward
from hybridflow.metrics import MetricsLog
from hybridflow.workers.batch import PolicyVersionError, RolloutBatch
from hybridflow.workers.decoding import Sampling
from hybridflow.workers.host import WorkerHost
from hybridflow.workers.modeling import load_causal_lm, position_ids, response_log_probs
from hybridflow.workers.reward import RewardFunctionError, RewardWorker, gsm8k_reward, resolve_reward_function
from tests.sharded_ranks import padded_batch

ROLES = {"actor_rollout": "actor_rollout", "reward_score": "reward", "reference": "reference"}


@pytest.fixture
def ppo_spec(example_doc):
    doc = example_doc("tiny-ppo.yaml")
    doc["spec"]["data"]["batchSize"] = 16
    doc["spec"]["algorithm"]["miniBatchSize"] = 8
    return parse_job(doc).spec


def rows(n: int) -> tuple[list[dict], list[int]]:
    return load_rows("builtin:tiny_task", "prompt", "answer")[:n], list(range(n))


def test_one_ppo_step_in_process(ppo_spec) -> None:
    spec_json = ppo_spec.model_dump(mode="json")
    actor = WorkerHost(spec_json, ROLES, instance=0, use_gpu=False)
    critic = WorkerHost(spec_json, {"critic": "critic"}, instance=0, use_gpu=False)
    r, g = rows(16)
    batch = actor.rollout(r, g, ["reward", "reference", "old_log_probs"])
    assert batch.input_ids.shape == (16, batch.prompt_length + 4)
    assert set(batch.tensors) == {"rollout_log_probs", "scores", "ref_log_probs", "old_log_probs"}
    assert torch.allclose(batch.tensors["old_log_probs"], batch.tensors["ref_log_probs"], atol=1e-5)
    expected = [tiny_task_reward(p, resp, a) for p, resp, a in zip(batch.prompts, batch.responses, batch.answers,
                                                                     strict=True)]
    assert batch.tensors["scores"].tolist() == pytest.approx(expected)
    batch.tensors.update(critic.run(batch, "values").tensors)
    metrics = compute_advantages(batch, ppo_spec, kl_coef=0.001)
    assert {"advantages", "returns"} <= set(batch.tensors) and "kl" in metrics
    before = [p.detach().clone() for p in actor.workers["actor_rollout"].model.parameters()]
    out = actor.update(batch, 0.001).metrics
    assert {"actor_loss", "entropy", "clip_frac", "approx_kl"} <= set(out)
    after = list(actor.workers["actor_rollout"].model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert actor.policy_version() == 1
    assert "critic_loss" in critic.update(batch, 0.001).metrics


@pytest.mark.parametrize(("name", "policy_loss"), [("rloo", "vanilla"), ("reinforce_plus_plus", "vanilla"),
                                                  ("reinforce_plus_plus_baseline", "vanilla"), ("grpo", "gspo"),
                                                  ("opo", "vanilla"), ("grpo_passk", "vanilla"), ("remax", "vanilla")])
def test_one_critic_free_step_in_process(example_doc, name: str, policy_loss: str) -> None:
    doc = example_doc("tiny-grpo.yaml")
    doc["spec"]["data"]["batchSize"] = 4
    doc["spec"]["rollout"]["samplesPerPrompt"] = 4
    doc["spec"]["algorithm"].update(name=name, policyLoss=policy_loss, miniBatchSize=8,
                                    klPenalty={"type": "low_var_kl", "coef": 0.01, "mode": "reward"})
    spec = parse_job(doc).spec
    actor = WorkerHost(spec.model_dump(mode="json"), ROLES, instance=0, use_gpu=False)
    r, _ = rows(4)
    batch = actor.rollout([row for row in r for _ in range(4)], [i for i in range(4) for _ in range(4)],
                          ["reward", "reference", "old_log_probs"])
    compute_advantages(batch, spec, kl_coef=0.01)
    mask = batch.response_mask.float()
    rewards, _ = algos.apply_kl_to_rewards(algos.scores_to_token_rewards(batch.tensors["scores"], mask),
                                           batch.tensors["old_log_probs"], batch.tensors["ref_log_probs"], mask,
                                           0.01, "low_var_kl")
    seq = (rewards * mask).sum(-1)
    expected = {
        "rloo": lambda: algos.compute_rloo_advantages(seq, batch.group_ids).unsqueeze(-1) * mask,
        "reinforce_plus_plus": lambda: algos.compute_reinforce_plus_plus_advantages(rewards, mask, 1.0)[0],
        "reinforce_plus_plus_baseline": lambda: algos.compute_reinforce_plus_plus_baseline_advantages(
            seq, batch.group_ids, mask),
        "grpo": lambda: algos.compute_grpo_advantages(seq, batch.group_ids).unsqueeze(-1) * mask,
        "opo": lambda: algos.compute_opo_advantages(seq, batch.group_ids, mask.sum(-1)).unsqueeze(-1) * mask,
        "grpo_passk": lambda: algos.compute_grpo_passk_advantages(seq, batch.group_ids).unsqueeze(-1) * mask,
        "remax": lambda: algos.compute_remax_advantages(rewards, batch.tensors["reward_baselines"], mask)[0],
    }[name]()
    assert torch.allclose(batch.tensors["advantages"], expected)
    before = [p.detach().clone() for p in actor.workers["actor_rollout"].model.parameters()]
    out = actor.update(batch, 0.01).metrics
    assert {"actor_loss", "clip_frac", "approx_kl", "ratio_mean"} <= set(out)
    after = list(actor.workers["actor_rollout"].model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_remax_rollout_carries_each_prompts_greedy_answer_and_its_score(example_doc) -> None:
    """The baseline is the answer greedy decoding gives (the same as a greedy evaluation's), once per prompt for
    all its samples, scored by the job's reward; the samples themselves stay sampled."""
    doc = example_doc("tiny-grpo.yaml")
    doc["spec"]["algorithm"]["name"] = "remax"
    spec = parse_job(doc).spec
    host = WorkerHost(spec.model_dump(mode="json"), ROLES, instance=0, use_gpu=False)
    r, _ = rows(3)
    groups = [7, 7, 7, 2, 2, 9]
    batch = host.rollout([r[0]] * 3 + [r[1]] * 2 + [r[2]], groups, ["reward"])
    actor = host.workers["actor_rollout"]
    greedy = actor.rollout.generate(r, [0, 1, 2], actor.generating_version(), Sampling(0.0)).responses
    assert batch.baselines == [greedy[0]] * 3 + [greedy[1]] * 2 + [greedy[2]]
    assert len(set(batch.responses[:3])) > 1  # sampled, unlike the baseline
    want = [tiny_task_reward(p, b, a) for p, b, a in zip(batch.prompts, batch.baselines, batch.answers, strict=True)]
    assert batch.tensors["reward_baselines"].tolist() == want
    assert "generate_baseline" in batch.timings
    shard = batch.balanced(2).shard(2)[1]
    assert shard.baselines == [batch.baselines[batch.prompts.index(p)] for p in shard.prompts]


def test_one_on_policy_step_takes_its_old_log_probs_from_its_own_forward_pass(example_doc) -> None:
    """One optimiser step per batch: the update's forward, detached, stands in for the pass of old log-probs,
    and gives the same loss, step and KL to the reference as a separate pass."""
    doc = example_doc("tiny-grpo.yaml")
    doc["spec"]["data"]["batchSize"] = 4
    doc["spec"]["rollout"]["samplesPerPrompt"] = 4
    doc["spec"]["algorithm"]["miniBatchSize"] = 16
    spec = parse_job(doc).spec
    fused, separate = (WorkerHost(spec.model_dump(mode="json"), ROLES, instance=0, use_gpu=False) for _ in range(2))
    assert fused.workers["actor_rollout"].old_from_update
    separate.workers["actor_rollout"].old_from_update = False
    r, _ = rows(4)
    batch = fused.rollout([row for row in r for _ in range(4)], [i for i in range(4) for _ in range(4)],
                          ["reward", "reference"])
    scored = separate.workers["actor_rollout"].old_log_probs(copy.deepcopy(batch))
    by_pass = compute_advantages(scored, spec, kl_coef=0.001)
    assert "kl" not in compute_advantages(batch, spec, kl_coef=0.001)
    mine, theirs = fused.update(batch, 0.001).metrics, separate.update(scored, 0.001).metrics
    assert mine["kl"] == pytest.approx(by_pass["kl"], rel=1e-5, abs=1e-8)
    for key in ("actor_loss", "kl_loss", "entropy", "ratio_mean", "actor_grad_norm"):
        assert mine[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-7), key
    assert mine["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    for a, b in zip(fused.workers["actor_rollout"].model.parameters(),
                    separate.workers["actor_rollout"].model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_entropy_joins_the_graph_only_as_a_term_of_the_loss(example_doc) -> None:
    """At entropyCoef 0 the entropy is a metric computed off the graph (the backward pass skips the softmax
    over the vocabulary); with a coefficient it is a term of the loss and moves the gradient."""
    doc = example_doc("tiny-grpo.yaml")
    doc["spec"]["data"]["batchSize"] = 4
    doc["spec"]["rollout"]["samplesPerPrompt"] = 4
    doc["spec"]["algorithm"]["miniBatchSize"] = 16
    hosts = []
    for coef in (0.0, 0.5):
        doc["spec"]["algorithm"]["entropyCoef"] = coef
        hosts.append(WorkerHost(parse_job(doc).spec.model_dump(mode="json"), ROLES, instance=0, use_gpu=False))
    r, _ = rows(4)
    batch = hosts[0].rollout([row for row in r for _ in range(4)], [i for i in range(4) for _ in range(4)],
                             ["reward", "reference"])
    model = hosts[0].workers["actor_rollout"].model
    logp, metric = response_log_probs(model, batch, torch.device("cpu"), "entropy")
    _, term = response_log_probs(model, batch, torch.device("cpu"), "entropy_loss")
    assert metric is not None and term is not None
    assert logp.requires_grad and term.requires_grad and not metric.requires_grad
    torch.testing.assert_close(metric, term.detach())
    compute_advantages(batch, parse_job(doc).spec, kl_coef=0.001)
    without, with_bonus = (h.update(copy.deepcopy(batch), 0.001).metrics for h in hosts)
    assert without["entropy"] == pytest.approx(with_bonus["entropy"], rel=1e-6)
    assert without["actor_loss"] == pytest.approx(with_bonus["actor_loss"], rel=1e-6, abs=1e-8)
    assert abs(without["actor_grad_norm"] - with_bonus["actor_grad_norm"]) > 1e-4


def test_scoring_passes_run_in_micro_batches_and_score_as_one_pass(ppo_spec) -> None:
    """With microBatchSize, the old-log-prob, reference and value passes put at most that many sequences
    through a model at once, and give what one pass over the whole batch gives."""
    micro_spec = ppo_spec.model_copy(deep=True)
    micro_spec.trainer.training.micro_batch_size = 3
    roles = ROLES | {"critic": "critic"}
    whole, micro = (WorkerHost(s.model_dump(mode="json"), roles, instance=0, use_gpu=False)
                    for s in (ppo_spec, micro_spec))
    head = {k: torch.randn_like(v) for k, v in whole.workers["critic"].model.value_head.state_dict().items()}
    for host in (whole, micro):  # a zero head would make every value 0
        host.workers["critic"].model.value_head.load_state_dict(head)
    seen: list[int] = []
    models = (micro.workers["actor_rollout"].behaviour, micro.workers["reference"].model,
              micro.workers["critic"].model)
    hooks = [m.register_forward_pre_hook(lambda _m, args, kwargs: seen.append(
        (kwargs.get("input_ids") if "input_ids" in kwargs else args[0]).shape[0]), with_kwargs=True) for m in models]
    r, g = rows(16)
    batch = whole.rollout(r, g, ["reward"])
    scored = {}
    for host in (whole, micro):
        b = copy.deepcopy(batch)
        host.workers["actor_rollout"].old_log_probs(b)
        host.workers["reference"].ref_log_probs(b)
        host.workers["critic"].values(b)
        scored[host is micro] = b.tensors
    for h in hooks:
        h.remove()
    assert len(seen) == 3 * 6 and max(seen) == 3  # 16 rows: five passes of 3 and one of 1, per model
    for key in ("old_log_probs", "ref_log_probs", "values"):
        assert scored[True][key].shape == (16, batch.responses_ids.shape[1])
        torch.testing.assert_close(scored[True][key], scored[False][key], rtol=1e-5, atol=1e-6)
    assert scored[True]["values"].abs().sum() > 0


def test_trimming_drops_the_padding_every_row_shares_and_orders_rows_by_length() -> None:
    batch = padded_batch()
    cut = batch.trimmed()
    assert (cut.prompt_length, cut.response_mask.shape[1], cut.input_ids.shape) == (4, 5, (8, 9))
    torch.testing.assert_close(cut.input_ids, batch.input_ids[:, 2:11])
    torch.testing.assert_close(cut.tensors["advantages"], batch.tensors["advantages"][:, :5])
    torch.testing.assert_close(cut.tensors["scores"], batch.tensors["scores"])  # one per row: as it was
    assert cut.trimmed() is cut
    order = batch.by_length()
    assert order.tolist() == [5, 1, 3, 7, 2, 4, 0, 6]  # responses 1, 1, 2, 2, 3, 4, 5, 5; ties by prompt
    assert batch.by_length(torch.tensor([0, 1, 2])).tolist() == [1, 2, 0]
    short = batch.slice_index(order[:4]).trimmed()
    assert (short.prompt_length, short.response_mask.shape[1]) == (4, 2)


def test_balanced_shards_hold_about_the_same_tokens() -> None:
    """Rows sorted by length shard badly (17 and 26 tokens); balanced, each shard keeps 4 rows and gets 23 and 20,
    every row moving with its tensors."""
    by_length = padded_batch()
    by_length = by_length.slice_index(by_length.by_length())
    by_length.timings = {"generate": 1.0}
    assert [int(p.attention_mask.sum()) for p in by_length.shard(2)] == [17, 26]
    balanced = by_length.balanced(2)
    assert [len(p) for p in balanced.shard(2)] == [4, 4]
    assert [int(p.attention_mask.sum()) for p in balanced.shard(2)] == [23, 20]
    assert sorted(balanced.group_ids) == list(range(8)) and balanced.timings == {"generate": 1.0}
    rows = {g: i for i, g in enumerate(by_length.group_ids)}
    for i, g in enumerate(balanced.group_ids):
        torch.testing.assert_close(balanced.input_ids[i], by_length.input_ids[rows[g]])
        torch.testing.assert_close(balanced.tensors["advantages"][i], by_length.tensors["advantages"][rows[g]])
    assert by_length.balanced(1) is by_length and by_length.slice(0, 2).balanced(4).group_ids == [5, 1]


def test_passes_fill_with_rows_of_like_length_up_to_the_token_limit() -> None:
    batch = padded_batch()

    def split(**limits) -> list[list[int]]:
        return [p.tolist() for p in batch.passes(**limits)]

    assert split() == [[5, 1, 3, 7, 2, 4, 0, 6]]
    assert split(size=3) == [[5, 1, 3], [7, 2, 4], [0, 6]]
    assert split(tokens=12) == [[5, 1], [3, 7], [2], [4], [0], [6]]  # 2 x (4 + 1), 2 x (3 + 2), then one row each
    assert split(tokens=16) == [[5, 1], [3, 7], [2, 4], [0, 6]]  # ... 2 x (4 + 4), 2 x (2 + 5)
    assert split(tokens=16, size=1) == [[5], [1], [3], [7], [2], [4], [0], [6]]
    assert split(tokens=1) == [[5], [1], [3], [7], [2], [4], [0], [6]]  # each over the limit: alone
    assert split(rows=torch.tensor([4, 6, 0])) == [[4, 0, 6]]
    assert split(rows=torch.tensor([], dtype=torch.long)) == []


@pytest.mark.parametrize("limit", [{"micro_batch_size": 2}, {"micro_batch_tokens": 16}])
def test_scoring_passes_take_rows_in_length_order_trimmed_and_give_the_padded_batchs_scores(
        ppo_spec, limit: dict[str, int]) -> None:
    """Passes of 2 rows, or of at most 16 tokens, cut in length order and trimmed put 50 tokens through the model
    instead of the padded batch's 112, and score what one pass over the padded batch scores at every response
    token (0 at padding)."""
    spec = ppo_spec.model_copy(deep=True)
    spec.trainer.training = spec.trainer.training.model_copy(update=limit)
    host = WorkerHost(spec.model_dump(mode="json"), ROLES, instance=0, use_gpu=False)
    actor = host.workers["actor_rollout"]
    batch = padded_batch()
    with torch.no_grad():
        expected = response_log_probs(actor.model.eval(), batch, torch.device("cpu"))[0] * batch.response_mask
    shapes: list[tuple[int, int]] = []
    hook = actor.behaviour.register_forward_pre_hook(
        lambda _m, _args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    actor.old_log_probs(batch)
    hook.remove()
    assert shapes == [(2, 5), (2, 5), (2, 8), (2, 7)]  # (prompt 4 + response 1), (3 + 2), (4 + 4), (2 + 5)
    assert sum(r * w for r, w in shapes) == 50 < 8 * 14
    torch.testing.assert_close(batch.tensors["old_log_probs"], expected, rtol=1e-5, atol=1e-6)
    assert (batch.tensors["old_log_probs"][batch.response_mask == 0] == 0).all()


def test_training_on_another_policy_version_is_an_error(ppo_spec) -> None:
    host = WorkerHost(ppo_spec.model_dump(mode="json"), ROLES, instance=0, use_gpu=False)
    r, g = rows(8)
    batch = host.rollout(r, g, ["reward", "old_log_probs"])
    batch.policy_version = 5
    batch.tensors["advantages"] = torch.zeros_like(batch.tensors["old_log_probs"])
    with pytest.raises(PolicyVersionError, match="generated by policy version 5, actor is at version 0"):
        host.update(batch, 0.0)
    with pytest.raises(PolicyVersionError):
        RolloutBatch.concat([batch, host.rollout(r, g, [])])


def test_an_update_reaches_rollout_only_through_the_control_edge(ppo_spec) -> None:
    """With strong consistency rollout refuses to generate until sync_policy (the control edge) has run."""
    host = WorkerHost(ppo_spec.model_dump(mode="json"), ROLES, instance=0, use_gpu=False)
    r, g = rows(8)
    batch = host.rollout(r, g, ["reward", "old_log_probs"])
    batch.tensors["advantages"] = torch.randn_like(batch.tensors["old_log_probs"])
    host.update(batch, 0.0)
    actor = host.workers["actor_rollout"]
    assert actor.version == 1 and actor.rollout.version == 0
    with pytest.raises(PolicyVersionError, match="holds policy version 0 and the actor is at version 1; consistency "
                                                 "allows a lag of 0: the control edge's weight sync must come first"):
        host.rollout(r, g, [])
    synced = host.sync_policy()
    assert (synced.version, synced.bytes) == (1, 0)  # generation runs on the trained module: nothing to copy
    assert host.rollout(r, g, []).policy_version == 1


def test_a_pipelined_rollout_runs_one_version_behind_and_the_sync_makes_the_copies_equal(ppo_spec) -> None:
    """consistency eventual (lag 1): the next step's rollout generates on a copy of the policy during the update;
    it carries the version before it, the next update takes it (lag 1) weighed against its behaviour policy,
    and after each sync the copy holds exactly the trained weights. Two versions behind is refused."""
    spec_json = ppo_spec.model_dump(mode="json")
    host = WorkerHost(spec_json, ROLES | {"critic": "critic"}, instance=0, use_gpu=False, lag=1)
    actor = host.workers["actor_rollout"]
    assert actor.behaviour is not actor.model
    chain, phases = ["reward", "reference", "old_log_probs"], ["rollout", "advantages", "update"]
    r1, r2, r3 = rows(24)[0][:8], rows(24)[0][8:16], rows(24)[0][16:]
    g = list(range(8))
    lags, synced = [], []
    for now, ahead in ((r1, r2), (r2, r3)):
        out = host.run_step(phases, now, g, chain, 0.001, (ahead, g), ("values",))
        lags.append(out.update["policy_lag"])
        synced.append(out.sync)
        copy, trained = dict(actor.behaviour.named_parameters()), dict(actor.model.named_parameters())
        assert all(torch.equal(copy[k], v) for k, v in trained.items())
    assert lags == [0.0, 1.0]
    assert [s.version for s in synced] == [1, 2] and all(s.bytes > 0 for s in synced)
    pipelined = host.take_ahead(r3)
    assert pipelined is not None and [b.policy_version for b in pipelined] == [1]
    assert {"scores", "ref_log_probs", "old_log_probs"} <= set(pipelined[0].tensors)
    assert "values" not in pipelined[0].tensors  # the critic's values wait for its update (plan.late)

    stale = pipelined[0]
    stale.policy_version = 0
    stale.tensors["advantages"] = torch.zeros_like(stale.tensors["old_log_probs"])
    with pytest.raises(PolicyVersionError, match="actor is at version 2; consistency allows at most 1 versions behind"):
        host.update(stale, 0.0)


def test_state_round_trip_restores_weights_and_sampling(ppo_spec, tmp_path) -> None:
    spec_json = ppo_spec.model_dump(mode="json")
    a = WorkerHost(spec_json, ROLES, instance=0, seed=1, use_gpu=False)
    path = a.save(str(tmp_path), "actor_rollout_0")
    r, g = rows(8)
    first = a.rollout(r, g, []).responses
    b = WorkerHost(spec_json, ROLES, instance=0, seed=99, use_gpu=False)
    b.load(str(tmp_path), "actor_rollout_0")
    assert path.endswith("actor_rollout_0.pt")
    assert b.rollout(r, g, []).responses == first


def test_concat_pads_prompts_left_and_responses_right(ppo_spec) -> None:
    host = WorkerHost(ppo_spec.model_dump(mode="json"), ROLES, instance=0, use_gpu=False)
    short = host.rollout([{"prompt": "1 2", "answer": "2"}], [0], ["reward"])
    long = host.rollout([{"prompt": "1 2 3 4", "answer": "4"}], [1], ["reward"])
    both = RolloutBatch.concat([short, long])
    assert both.prompt_length == long.prompt_length
    assert both.attention_mask[0, : long.prompt_length - short.prompt_length].sum() == 0
    assert both.input_ids.shape[1] == long.input_ids.shape[1]
    assert [len(s) for s in both.shard(2)] == [1, 1]


def test_reward_functions() -> None:
    assert gsm8k_reward("q", "so the answer is 1,234.", "#### 1234") == 1.0
    assert gsm8k_reward("q", "#### 12", "steps... #### 13") == 0.0
    assert gsm8k_reward("q", "no number", "#### 3") == 0.0
    assert resolve_reward_function("tests.slow_reward:score")("1 2 3", "3 3 3 3", "3") == 1.0
    with pytest.raises(RewardFunctionError, match="unknown built-in 'builtin:nope', allowed: builtin:gsm8k"):
        resolve_reward_function("builtin:nope")
    with pytest.raises(RewardFunctionError, match="has no callable 'missing'"):
        resolve_reward_function("tests.slow_reward:missing")


def test_reward_model_with_a_sequence_classification_head(example_doc, tmp_path) -> None:
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    tiny = ensure_tiny_model()
    cfg = AutoConfig.for_model(**TINY_CONFIG, num_labels=1, pad_token_id=0)
    AutoModelForSequenceClassification.from_config(cfg).save_pretrained(tmp_path / "rm")
    AutoTokenizer.from_pretrained(tiny).save_pretrained(tmp_path / "rm")
    doc = example_doc("tiny-ppo.yaml")
    doc["spec"]["reward"] = {"type": "model", "model": {"path": str(tmp_path / "rm")}}
    spec = parse_job(doc).spec
    host = WorkerHost(spec.model_dump(mode="json"), {"actor_rollout": "actor_rollout"}, 0, use_gpu=False)
    r, g = rows(8)
    batch = host.rollout(r, g, [])
    RewardWorker(spec, torch.device("cpu")).score(batch)
    scores = batch.tensors["scores"]
    assert scores.shape == (8,) and torch.isfinite(scores).all() and scores.std() > 0
    # microBatchSize scores 3 sequences per pass, each pass padded to its own longest: the same scores
    doc["spec"]["trainer"]["training"] = {"microBatchSize": 3}
    micro = RewardWorker(parse_job(doc).spec, torch.device("cpu"))
    seen: list[int] = []
    micro.model.register_forward_pre_hook(lambda _m, _a, kw: seen.append(kw["input_ids"].shape[0]), with_kwargs=True)
    torch.testing.assert_close(micro.score(copy.deepcopy(batch)).tensors["scores"], scores, rtol=1e-5, atol=1e-6)
    assert seen == [3, 3, 2]
    # remax: the greedy answer of each prompt scored once (the prompt's first row carries it), for all its rows
    greedy = copy.deepcopy(batch)
    greedy.group_ids = [0, 0, 1, 1, 1, 2, 3, 3]
    first = [0, 0, 2, 2, 2, 5, 6, 6]
    greedy.baselines = [greedy.responses[f] for f in first]
    seen.clear()
    micro.score(greedy)
    torch.testing.assert_close(greedy.tensors["reward_baselines"], scores[first], rtol=1e-5, atol=1e-6)
    assert seen == [3, 3, 2, 3, 1]
    doc["spec"]["reward"]["model"]["dtype"] = "bfloat16"
    assert next(RewardWorker(parse_job(doc).spec, torch.device("cpu")).model.parameters()).dtype == torch.bfloat16


def test_sampler_resumes_at_the_same_prompt() -> None:
    data = load_rows("builtin:tiny_task", "prompt", "answer")
    a = PromptSampler(data, batch_size=300, seed=3)
    a.next_batch()
    a.next_batch()
    state = a.state_dict()
    b = PromptSampler(data, batch_size=300, seed=3)
    b.load_state_dict(state)
    assert a.next_batch() == b.next_batch()
    assert state["epoch"] == 0 and a.epoch == 0 and a.next_batch() and a.epoch == 1


def test_checkpoints_are_atomic_and_pruned(tmp_path) -> None:
    for step in (2, 4, 6):
        stage = staging_dir(tmp_path, step)
        (stage / "controller.pt").write_text("x")
        commit(stage, tmp_path, step)
    half = staging_dir(tmp_path, 8)  # a writer that died before the rename
    (half / "controller.pt").write_text("partial")
    assert latest(tmp_path)[0] == 6
    prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004", "step_00000006"]


def test_a_newer_claim_supersedes_the_older_controller(tmp_path) -> None:
    first = claim(tmp_path)
    check_owner(tmp_path, first)
    second = claim(tmp_path)
    check_owner(tmp_path, second)
    with pytest.raises(Superseded, match="another controller took over"):
        check_owner(tmp_path, first)
    (tmp_path / OWNER_FILE).unlink()
    with pytest.raises(Superseded, match="owner removed"):
        check_owner(tmp_path, second)
    prune(tmp_path, keep=1)
    assert not list(tmp_path.glob(".owner-*"))


def test_metrics_log_truncates_after_a_rollback(tmp_path) -> None:
    log = MetricsLog(tmp_path / "m.jsonl")
    for s in range(1, 6):
        log.write({"step": s})
    log.truncate_after(3)
    assert [r["step"] for r in log.read()] == [1, 2, 3]


def test_metrics_log_without_a_file_keeps_the_run_in_memory(tmp_path) -> None:
    log = MetricsLog(None)
    for s in range(1, 6):
        log.write({"step": s})
    log.truncate_after(3)
    log.write({"step": 4})
    assert [r["step"] for r in log.read()] == [1, 2, 3, 4]
    log.reset()
    assert log.read() == [] and list(tmp_path.iterdir()) == []


def test_creating_the_tiny_model_leaves_the_callers_random_state_alone(tmp_path, monkeypatch) -> None:
    """A fresh pod creates the built-in model, a laptop finds it cached: both must then sample alike."""
    monkeypatch.setenv("HYBRIDFLOW_CACHE", str(tmp_path))
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    ensure_tiny_model()
    assert torch.equal(torch.rand(4), expected)


def test_every_critic_rank_starts_from_the_same_weights(ppo_spec) -> None:
    """Data-parallel ranks average gradients, never weights: they must start equal, whatever each process
    drew from its random state before."""
    spec_json = ppo_spec.model_dump(mode="json")
    ranks = [WorkerHost(spec_json, {"critic": "critic"}, instance=i, use_gpu=False) for i in range(2)]
    first, second = (dict(h.workers["critic"].model.state_dict()) for h in ranks)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_the_lm_head_scores_response_positions_only() -> None:
    """The log-probs are a full forward pass's, but the LM head sees the R+1 last positions, not the prompt's."""
    model = load_causal_lm(str(ensure_tiny_model()), "float32", torch.device("cpu")).eval()
    batch = padded_batch()
    seen: list[int] = []
    hook = model.get_output_embeddings().register_forward_hook(lambda _m, args, _out: seen.append(args[0].shape[1]))
    with torch.no_grad():
        logp, _ = response_log_probs(model, batch, torch.device("cpu"))
        hook.remove()
        mask = batch.attention_mask
        every = model(input_ids=batch.input_ids, attention_mask=mask, position_ids=position_ids(mask)).logits
    response = batch.response_mask.shape[1]
    assert seen == [response + 1] and batch.input_ids.shape[1] > response + 1
    expected = algos.logprobs_from_logits(every[:, batch.prompt_length - 1:-1], batch.responses_ids)
    torch.testing.assert_close(logp, expected, rtol=1e-5, atol=1e-6)


def grouped_batch() -> RolloutBatch:
    """Three prompts (of 2, 4 and 3 tokens, left-padded to 4) with three sampled responses each (1 to 6 tokens,
    right-padded to 6): a GRPO batch."""
    g = torch.Generator().manual_seed(3)
    prompt_lens = torch.tensor([2, 4, 3]).repeat_interleave(3)
    response_lens = torch.tensor([6, 1, 3, 2, 5, 6, 4, 1, 2])
    prompt = (torch.arange(4) >= 4 - prompt_lens[:, None]).long()
    response = (torch.arange(6) < response_lens[:, None]).long()
    ids = torch.cat([torch.randint(3, 14, (3, 4), generator=g).repeat_interleave(3, 0),
                     torch.randint(3, 14, (9, 6), generator=g)], dim=1)
    mask = torch.cat([prompt, response], dim=1)
    return RolloutBatch(input_ids=ids * mask, attention_mask=mask, response_mask=response, prompt_length=4,
                        policy_version=0, prompts=[""] * 9, responses=[""] * 9, answers=[""] * 9,
                        group_ids=[0, 0, 0, 1, 1, 1, 2, 2, 2])


def test_rows_that_share_a_prompt_run_it_once() -> None:
    """A GRPO batch's 3 prompts run once each and its 9 responses on their KV cache: 3 x 4 + 9 x 5 tokens instead
    of 9 x 10. The log-probs are a full forward pass's, and so are the gradients, which the rows of a prompt
    add up."""
    model = load_causal_lm(str(ensure_tiny_model()), "float32", torch.device("cpu")).train()
    batch = grouped_batch()
    with embedded_tokens(model) as tokens:
        logp, _ = response_log_probs(model, batch, torch.device("cpu"))
    assert tokens == [3 * 4, 9 * 5]
    mask = batch.attention_mask
    every = model(input_ids=batch.input_ids, attention_mask=mask, position_ids=position_ids(mask)).logits
    expected = algos.logprobs_from_logits(every[:, 3:-1].float(), batch.responses_ids)
    response = batch.response_mask.bool()
    torch.testing.assert_close(logp[response], expected[response], rtol=1e-5, atol=1e-6)
    params = [p for p in model.parameters() if p.requires_grad]
    shared = torch.autograd.grad(logp[response].sum(), params)
    full = torch.autograd.grad(expected[response].sum(), params)
    for a, b in zip(shared, full, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_prompts_are_not_shared_where_training_recomputes_blocks() -> None:
    """With gradient checkpointing a training pass runs every row whole (a recomputed block would extend the
    cache twice); a scoring pass of the same model still shares. Rows with distinct prompts run whole, and so do
    rows of which too few share one to pay for a second forward call (3 of 8 here)."""
    from hybridflow.workers.training import enable_gradient_checkpointing

    model = load_causal_lm(str(ensure_tiny_model()), "float32", torch.device("cpu"))
    enable_gradient_checkpointing(model)
    batch = grouped_batch()
    with embedded_tokens(model) as tokens:
        logp, _ = response_log_probs(model.train(), batch, torch.device("cpu"))
        with torch.no_grad():
            scored, _ = response_log_probs(model.eval(), batch, torch.device("cpu"))
            response_log_probs(model, padded_batch(), torch.device("cpu"))
            few = padded_batch()
            few.input_ids[:3, :6], few.attention_mask[:3, :6] = few.input_ids[0, :6], few.attention_mask[0, :6]
            response_log_probs(model, few, torch.device("cpu"))
    assert tokens == [9 * 10, 3 * 4, 9 * 5, 8 * 14, 8 * 14]
    response = batch.response_mask.bool()
    torch.testing.assert_close(scored[response], logp.detach()[response], rtol=1e-5, atol=1e-6)


def test_vocabulary_reductions_without_gradient_run_in_chunks(monkeypatch) -> None:
    """The entropy as a metric, sum_v pi_v^2, and log-probs that need no gradient, reduce chunks of CHUNK_ELEMENTS
    logits (4 tokens of 11 here) and equal the reduction of the whole tensor; log-probs that train reduce it whole,
    on the graph."""
    from hybridflow.workers import modeling

    tokens: list[int] = []

    def counted(reduce):
        def run(chunk: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
            tokens.append(chunk.numel() // chunk.shape[-1])
            return reduce(chunk, *rest)
        return run

    monkeypatch.setattr(modeling, "CHUNK_ELEMENTS", 4 * 11 + 3)
    monkeypatch.setattr(modeling, "entropy_from_logits", counted(algos.entropy_from_logits))
    monkeypatch.setattr(modeling, "logprobs_from_logits", counted(algos.logprobs_from_logits))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g)
    logits[0, 0, 3] = float("-inf")
    labels = torch.randint(0, 11, (3, 5), generator=g)
    torch.testing.assert_close(modeling.token_stat(logits, "entropy"), algos.entropy_from_logits(logits))
    assert tokens == [4, 4, 4, 3]
    tokens.clear()
    monkeypatch.setattr(modeling, "sum_pi_squared_from_logits", counted(algos.sum_pi_squared_from_logits))
    torch.testing.assert_close(modeling.token_stat(logits, "sum_pi_squared"),
                               torch.softmax(logits, -1).square().sum(-1))
    assert tokens == [4, 4, 4, 3]
    tokens.clear()
    torch.testing.assert_close(modeling.token_log_probs(logits, labels), algos.logprobs_from_logits(logits, labels))
    assert tokens == [4, 4, 4, 3]
    tokens.clear()
    trained = modeling.token_log_probs(logits.requires_grad_(), labels)
    assert trained.requires_grad and tokens == [15]
    assert modeling.token_stat(logits[:, :0], "entropy").shape == (3, 0)


def test_16_bit_logits_are_upcast_whole_only_where_they_train(monkeypatch) -> None:
    """A bf16 policy's scoring pass hands its logits to the reductions in bf16 (each chunk is upcast on its own: no
    fp32 copy of the whole), with the log-probs of logits upcast whole; logits that train arrive in fp32."""
    from hybridflow.workers import modeling

    cpu = torch.device("cpu")
    model = load_causal_lm(str(ensure_tiny_model()), "bfloat16", cpu)
    batch = padded_batch()
    dtypes: list[torch.dtype] = []

    def reduce(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        dtypes.append(z.dtype)
        return algos.logprobs_from_logits(z, y)

    monkeypatch.setattr(modeling, "logprobs_from_logits", reduce)
    with torch.no_grad():
        logp, _ = response_log_probs(model, batch, cpu)
        whole = algos.logprobs_from_logits(modeling.response_logits(model, batch, cpu).float(), batch.responses_ids)
    assert dtypes == [torch.bfloat16] and logp.dtype == torch.float32
    torch.testing.assert_close(logp, whole)
    dtypes.clear()
    trained, _ = response_log_probs(model, batch, cpu)
    assert dtypes == [torch.float32] and trained.requires_grad
