"""Evaluation on spec.data.val without Ray: when it runs, its metrics, its spec rules, its plot, and a worker
answering val prompts without disturbing training."""

from __future__ import annotations

import pytest
import torch
import yaml

from hybridflow.api import SpecError, parse_job
from hybridflow.api.spec import Evaluation, Rollout
from hybridflow.data.prompts import load_prompts
from hybridflow.evaluation import eval_due, eval_seed, last_val_reward, val_metrics
from hybridflow.metrics import metrics_figure, panels
from hybridflow.workers.decoding import Sampling
from hybridflow.workers.host import WorkerHost
from tests.conftest import ROOT

ROLES = {"actor_rollout": "actor_rollout", "reward_score": "reward"}


def test_eval_runs_every_n_steps_and_after_the_last() -> None:
    assert [s for s in range(1, 11) if eval_due(s, 10, 4)] == [4, 8, 10]
    assert [s for s in range(1, 9) if eval_due(s, 8, 4)] == [4, 8]
    assert [s for s in range(1, 11) if eval_due(s, 10, 0)] == [10]


def test_eval_seeds_differ_by_step_and_chunk_and_repeat_across_runs() -> None:
    seeds = {eval_seed(0, step, chunk) for step in range(1, 50) for chunk in range(8)}
    assert len(seeds) == 49 * 8
    assert eval_seed(3, 10, 1) == eval_seed(3, 10, 1) != eval_seed(4, 10, 1)
    assert 0 <= eval_seed(-5, 1, 0) < 2**63


def test_val_metrics_of_partial_credit_count_full_marks_as_right() -> None:
    """builtin:tiny_task gives 0, 0.25, ..., 1: accuracy is the share of responses scoring 1."""
    out = val_metrics([1.0, 0.25, 0.0, 1.0], [4, 4, 2, 4], [0, 1, 2, 3], verifier=True)
    assert out == {"val/reward_mean": pytest.approx(0.5625), "val/response_length_mean": 3.5, "val/samples": 4.0,
                   "val/accuracy": 0.5}


def test_val_metrics_with_several_samples_add_the_pass_rate() -> None:
    """Prompt 0 solved by one of its two samples, prompt 1 by none: pass@2 = 1/2, accuracy = 1/4."""
    out = val_metrics([0.0, 1.0, 0.0, 0.0], [1, 2, 3, 4], [0, 0, 1, 1], verifier=True)
    assert out["val/accuracy"] == 0.25 and out["val/pass_rate"] == 0.5 and out["val/samples"] == 4.0


def test_a_reward_models_scores_get_no_accuracy() -> None:
    out = val_metrics([2.5, -1.0], [3, 3], [0, 0], verifier=False)
    assert out == {"val/reward_mean": 0.75, "val/response_length_mean": 3.0, "val/samples": 2.0}


def test_progress_carries_the_newest_val_reward() -> None:
    records = [{"step": 1}, {"step": 2, "val/reward_mean": 0.25}, {"step": 3}, {"step": 4, "val/reward_mean": 0.5},
               {"step": 5}]
    assert last_val_reward(records) == {"val/reward_mean": 0.5}
    assert last_val_reward(records[:3]) == {"val/reward_mean": 0.25}
    assert last_val_reward(records[:1]) == {}


def test_val_metrics_refuse_mismatched_inputs() -> None:
    with pytest.raises(ValueError, match="one length and prompt per score"):
        val_metrics([1.0], [1, 2], [0], verifier=True)
    with pytest.raises(ValueError):
        val_metrics([], [], [], verifier=True)


def test_eval_sampling_is_greedy_unless_asked() -> None:
    rollout = Rollout(temperature=0.7, top_p=0.9)
    assert Sampling.for_eval(Evaluation(), rollout) == Sampling(0.0)
    assert Sampling.for_eval(Evaluation(greedy=False), rollout) == Sampling(0.7, 0.9)
    assert Sampling.for_eval(Evaluation(greedy=False, temperature=1.2), rollout) == Sampling(1.2, 0.9)


@pytest.mark.parametrize(("trainer", "data", "message"), [
    ({"evalEvery": 5}, {}, "spec: trainer.evalEvery needs data.val, the prompts to evaluate on (set data.val, or "
                           "evalEvery to 0)"),
    ({"evalBeforeTrain": True}, {}, "spec: trainer.evalBeforeTrain needs data.val, the prompts to evaluate on (set "
                                    "data.val, or evalBeforeTrain to false)"),
    ({"eval": {"temperature": 0.5}}, {"val": "builtin:tiny_task"},
     "spec.trainer.eval: eval.temperature and eval.samplesPerPrompt above 1 need eval.greedy false"),
    ({"eval": {"samplesPerPrompt": 4}}, {"val": "builtin:tiny_task"},
     "spec.trainer.eval: eval.temperature and eval.samplesPerPrompt above 1 need eval.greedy false"),
    ({"evalEvery": -1}, {"val": "builtin:tiny_task"}, "spec.trainer.evalEvery: Input should be greater than or equal"),
    ({}, {"promptFormat": "template"}, "spec.data.promptFormat: got 'template', allowed: 'auto', 'chat' or 'raw'"),
    ({}, {"val": ""}, "spec.data.val: String should have at least 1 character"),
])
def test_eval_settings_that_cannot_work_name_their_field(example_doc, trainer: dict, data: dict,
                                                         message: str) -> None:
    doc = example_doc("tiny-ppo.yaml")
    doc["spec"]["trainer"].update(trainer)
    doc["spec"]["data"].update(data)
    with pytest.raises(SpecError) as info:
        parse_job(doc)
    (problem,) = info.value.problems
    assert problem.startswith(message), problem


def test_eval_settings_that_work(example_doc) -> None:
    doc = example_doc("tiny-ppo.yaml")
    doc["spec"]["data"]["val"] = "builtin:tiny_task"
    doc["spec"]["trainer"].update(evalEvery=5, eval={"greedy": False, "temperature": 0.5, "samplesPerPrompt": 4})
    trainer = parse_job(doc).spec.trainer
    assert (trainer.eval_every, trainer.eval.samples_per_prompt, trainer.eval.temperature) == (5, 4, 0.5)


# -- the plot ----------------------------------------------------------------------------------------


RECORDS = [{"step": s, "reward_mean": 0.1 * s, "response_length": 4.0, "kl": 0.01} for s in range(1, 7)]
for r in RECORDS:
    if r["step"] % 3 == 0:
        r.update({"val/reward_mean": 0.2 * r["step"], "val/response_length_mean": 3.0, "val/accuracy": 0.5})


def test_the_val_curves_share_their_training_metrics_panels() -> None:
    shown = dict(panels(RECORDS))
    assert list(shown) == ["reward_mean", "kl", "response_length", "val/accuracy"]
    assert shown["reward_mean"] == {"train": [(s, pytest.approx(0.1 * s)) for s in range(1, 7)],
                                    "val": [(3, pytest.approx(0.6)), (6, pytest.approx(1.2))]}
    assert shown["response_length"]["val"] == [(3, 3.0), (6, 3.0)]
    assert shown["kl"] == {"kl": [(s, 0.01) for s in range(1, 7)]}
    assert dict(panels([{k: v for k, v in r.items() if not k.startswith("val/")} for r in RECORDS]))[
        "reward_mean"].keys() == {"reward_mean"}


def test_the_figure_draws_the_val_series() -> None:
    import matplotlib.pyplot as plt

    fig = metrics_figure(RECORDS, "t")
    try:
        axes = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
        lines = {line.get_label(): line.get_xydata().tolist() for line in axes["reward_mean"].get_lines()}
        assert lines["val"] == [[3.0, pytest.approx(0.6)], [6.0, pytest.approx(1.2)]]
        assert len(lines["train"]) == 6
        assert axes["reward_mean"].get_legend() is not None
        assert axes["val/accuracy"].get_lines()[0].get_xydata().tolist() == [[3.0, 0.5], [6.0, 0.5]]
    finally:
        plt.close(fig)


# -- a worker answering val prompts ---------------------------------------------------------------------


@pytest.fixture
def eval_spec(example_doc):
    def make(**ev):
        doc = example_doc("tiny-grpo.yaml")
        doc["spec"]["data"]["val"] = "builtin:tiny_task"
        doc["spec"]["trainer"]["eval"] = ev
        return parse_job(doc).spec
    return make


def test_greedy_eval_is_deterministic_and_leaves_training_as_it_was(eval_spec) -> None:
    spec = eval_spec()
    val = load_prompts(spec, "val")[:64]
    train = load_prompts(spec, "train")[:16]
    host = WorkerHost(spec.model_dump(mode="json"), ROLES, instance=0, use_gpu=False)
    weights = {k: v.clone() for k, v in host.workers["actor_rollout"].model.state_dict().items()}
    state = torch.get_rng_state()
    expected = host.rollout(train, list(range(16)), []).responses
    torch.set_rng_state(state)
    first = host.evaluate(val, list(range(64)), True, seed=1)
    second = host.evaluate(val, list(range(64)), True, seed=2)
    assert first.responses == second.responses
    assert torch.equal(first.tensors["scores"], second.tensors["scores"])
    assert torch.equal(torch.get_rng_state(), state)
    assert host.rollout(train, list(range(16)), []).responses == expected
    assert host.policy_version() == 0
    after = host.workers["actor_rollout"].model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in weights.items())


def test_sampled_eval_repeats_with_its_seed_and_leaves_training_as_it_was(eval_spec) -> None:
    spec = eval_spec(greedy=False, temperature=1.0, samplesPerPrompt=2)
    val = load_prompts(spec, "val")[:64]
    host = WorkerHost(spec.model_dump(mode="json"), ROLES, instance=0, use_gpu=False)
    state = torch.get_rng_state()
    a = host.evaluate(val, list(range(64)), True, seed=11).responses
    assert torch.equal(torch.get_rng_state(), state)
    assert host.evaluate(val, list(range(64)), True, seed=11).responses == a
    assert host.evaluate(val, list(range(64)), True, seed=12).responses != a


def test_the_readme_example_is_a_valid_job() -> None:
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- evaluation example -->", 1)[1].split("```yaml", 1)[1].split("```", 1)[0]
    spec = parse_job(yaml.safe_load(block)).spec
    assert spec.data.val == "/data/val.parquet" and spec.trainer.eval_every == 20
    assert Sampling.for_eval(spec.trainer.eval, spec.rollout) == Sampling(0.6, 1.0)
