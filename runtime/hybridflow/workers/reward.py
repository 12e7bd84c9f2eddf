"""Reward: built-in rule functions, a user `module:function`, or a sequence-classification reward model."""

from __future__ import annotations

import importlib
import math
import numbers
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from hybridflow.api.spec import OverlongBuffer, RLTrainingJobSpec
from hybridflow.data.tiny import tiny_task_reward
from hybridflow.workers.batch import EXTRA_PREFIX, RolloutBatch, first_of_each_group
from hybridflow.workers.modeling import DTYPES, check_model_dir, in_micro_batches

RewardFn = Callable[..., Any]
"""(prompt, response, answer) -> a number, or a mapping with a number under "score" and any others to log; with
spec.reward.batched (prompts, responses, answers) -> a list of those, one per response."""
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


class RewardFunctionError(ValueError):
    """spec.reward.function cannot be imported or is not callable."""


def _last_number(text: str) -> str | None:
    """The answer after '####' when present (GSM8K convention), else the last number in the text."""
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    found = _NUMBER.findall(text)
    if not found:
        return None
    value = found[-1].replace(",", "").rstrip(".")
    return value[:-2] if value.endswith(".0") else value


def gsm8k_reward(prompt: str, response: str, answer: str) -> float:
    """1.0 when the response's final number equals the reference answer's, else 0.0."""
    got, want = _last_number(response), _last_number(answer)
    return float(got is not None and got == want)


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "builtin:tiny_task": tiny_task_reward,
    "builtin:gsm8k": gsm8k_reward,
}


def resolve_reward_function(name: str) -> RewardFn:
    """`builtin:<name>` or `module:function`; the error names spec.reward.function and the cause."""
    if name.startswith("builtin:"):
        if name not in BUILTIN_REWARDS:
            raise RewardFunctionError(
                f"spec.reward.function: unknown built-in {name!r}, allowed: {', '.join(sorted(BUILTIN_REWARDS))}"
            )
        return BUILTIN_REWARDS[name]
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # any import-time failure of user code is a user error
        raise RewardFunctionError(f"spec.reward.function: cannot import module {module_name!r}: {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardFunctionError(f"spec.reward.function: {module_name!r} has no callable {attr!r}")
    return fn


def score_value(value: Any, function: str) -> tuple[float, dict[str, float]]:
    """A reward function's return as (score, the other numbers it returned): a number, or a mapping with a number
    under "score" (verl's compute_score may return either); anything else names spec.reward.function."""
    if isinstance(value, Mapping):
        extras = {str(k): float(v) for k, v in value.items() if k != "score" and _is_number(v)}
        if "score" in value and _is_number(value["score"]):
            return float(value["score"]), extras
        got = f"{_kind(value['score'])} under 'score'" if "score" in value else \
            f"a mapping without 'score' (keys: {', '.join(map(str, value)) or 'none'})"
    elif _is_number(value):
        return float(value), {}
    else:
        got = _kind(value)
    raise RewardFunctionError(f"spec.reward.function {function!r} returned {got}: it must return a number, or a "
                              "mapping with a number under 'score' (and any other numbers to log)")


def batched_values(values: Any, rows: int, function: str) -> list[Any]:
    """A batched reward function's return: a list (or tuple, array, tensor) of one value per response, which
    score_value reads each of."""
    if hasattr(values, "tolist"):
        values = values.tolist()
    if not isinstance(values, list | tuple):
        got = _kind(values)
    elif len(values) != rows:
        got = f"{len(values)} values"
    else:
        return list(values)
    raise RewardFunctionError(f"spec.reward.function {function!r} (reward.batched) returned {got} for {rows} "
                              "responses: it must return a list with a number or a mapping for each")


def _is_number(v: Any) -> bool:
    """A real number (numpy's too), bools included (1 and 0), NaN not: a NaN score would poison the advantages."""
    return isinstance(v, numbers.Real) and not math.isnan(float(v))


def _kind(v: Any) -> str:
    return "NaN" if isinstance(v, numbers.Real) and math.isnan(float(v)) else f"a {type(v).__name__}"


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: OverlongBuffer) -> torch.Tensor:
    """DAPO's soft overlong punishment of responses of `lengths` tokens, [B] (0 or below):

        -penaltyFactor * max(0, |y| - (max_length - length)) / length
    """
    excess = (lengths.double() - (max_length - buffer.length)).clamp(min=0.0)
    return -buffer.penalty_factor * excess / buffer.length


class RewardWorker:
    """Scores whole sequences; the score lands on the last response token downstream."""

    def __init__(self, spec: RLTrainingJobSpec, device: torch.device) -> None:
        self.device = device
        self.function = spec.reward.function
        self.batched = spec.reward.batched
        self.overlong = spec.reward.overlong_buffer
        self.max_response_length = spec.data.max_response_length
        self.limits = spec.trainer.training
        self.fn: RewardFn | None = None
        self.model: torch.nn.Module | None = None
        if spec.reward.model is not None and spec.reward.type == "model":
            from transformers import AutoModelForSequenceClassification, AutoTokenizer

            path = check_model_dir(spec.reward.model.path, "spec.reward.model.path")
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            self.model = AutoModelForSequenceClassification.from_pretrained(
                path, num_labels=1, dtype=DTYPES[spec.reward.model.dtype]).to(device).eval()
        else:
            self.fn = resolve_reward_function(spec.reward.function)

    @torch.no_grad()
    def score(self, batch: RolloutBatch) -> RolloutBatch:
        """`scores` [B], and under EXTRA_PREFIX each other number the reward function returned [B] (NaN on a row
        without it); with remax's greedy responses also `reward_baselines` [B], scored once per prompt. With
        spec.reward.overlongBuffer every score, the greedy responses' too, takes `overlong_penalty`, logged as the
        extras overlong_reward and overlong (1 where it took some)."""
        t0 = time.perf_counter()
        batch.tensors["scores"], extras = self._scores(batch, batch.response_mask.sum(-1))
        batch.tensors |= {EXTRA_PREFIX + k: v for k, v in extras.items()}
        if batch.baselines:
            first = first_of_each_group(batch.group_ids)
            greedy = batch.slice_index(torch.tensor(list(first.values())))
            greedy.responses = greedy.baselines
            greedy_scores = self._scores(greedy, greedy.tensors.get("baseline_lengths"))[0]
            of_group = dict(zip(first, greedy_scores.tolist(), strict=True))
            batch.tensors["reward_baselines"] = torch.tensor([of_group[g] for g in batch.group_ids])
        batch.add_timing("reward", time.perf_counter() - t0)
        return batch

    def _scores(self, batch: RolloutBatch,
                lengths: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The batch's responses (of `lengths` tokens) scored, with the overlong penalty where the spec sets one,
        and the other numbers to log. The lengths are read only for the penalty (the actor records the greedy
        baselines' for remax)."""
        scores, extras = self._raw_scores(batch)
        if self.overlong is None:
            return scores, extras
        if lengths is None:
            raise ValueError("spec.reward.overlongBuffer needs each response's length; the rollout recorded none for "
                             "these responses")
        penalty = overlong_penalty(lengths, self.max_response_length, self.overlong)
        return scores + penalty.to(scores.dtype), extras | {"overlong_reward": penalty.float(),
                                                            "overlong": (penalty < 0).float()}

    def _raw_scores(self, batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if self.fn is None:
            return in_micro_batches(batch, self.limits, self._model_scores), {}
        if self.batched:
            values = batched_values(self.fn(list(batch.prompts), list(batch.responses), list(batch.answers)),
                                    len(batch), self.function)
        else:
            values = [self.fn(p, r, a) for p, r, a in zip(batch.prompts, batch.responses, batch.answers, strict=True)]
        rows = [score_value(v, self.function) for v in values]
        keys = dict.fromkeys(k for _, extra in rows for k in extra)
        return torch.tensor([score for score, _ in rows]), {
            k: torch.tensor([extra.get(k, math.nan) for _, extra in rows]) for k in keys}

    def _model_scores(self, batch: RolloutBatch) -> torch.Tensor:
        assert self.model is not None
        texts = [p + r for p, r in zip(batch.prompts, batch.responses, strict=True)]
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, truncation=True).to(self.device)
        return self.model(**enc).logits[:, 0].float().cpu()
