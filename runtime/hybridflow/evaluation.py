"""Evaluation on spec.data.val: when it runs, how it is seeded, and the val/ metrics it adds to a step's record.

Pure: the Trainer deals the generation over the actor's hosts and has the reward score it (no critic, no
update); what the numbers mean is decided here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

PREFIX = "val/"
REWARD = f"{PREFIX}reward_mean"


def eval_due(step: int, total_steps: int, every: int) -> bool:
    """After every `every` steps (0: never in between) and after the last one."""
    return step == total_steps or (every > 0 and step % every == 0)


def last_val_reward(records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """{val/reward_mean: x} of the newest record that has one, {} when none: what progress carries between
    evaluations (status.progress.valRewardMean, the progress bar)."""
    for record in reversed(records):
        if REWARD in record:
            return {REWARD: float(record[REWARD])}
    return {}


def eval_seed(seed: int, step: int, chunk: int) -> int:
    """The seed of one chunk of one evaluation: the same in every run of the job, whichever host answers it."""
    return ((seed * 1_000_003 + step) * 65_537 + chunk) % 2**63


def val_metrics(scores: Sequence[float], lengths: Sequence[int], prompt_ids: Sequence[int],
                verifier: bool) -> dict[str, float]:
    """The val/ metrics of one evaluation; `prompt_ids[i]` is the val prompt response i answers.

    reward_mean = mean score; response_length_mean = mean response tokens; samples = responses scored.
    With a `verifier` (a reward function, scoring 1 for a right answer: 0/1 like builtin:gsm8k, or partial
    credit below 1 like builtin:tiny_task): accuracy = share of responses scoring at least 1, and with
    several responses per prompt, pass_rate = share of prompts with at least one of them (pass@k, k =
    eval.samplesPerPrompt). A reward model's scores have no such mark, so it gets neither.
    """
    n = len(scores)
    if n == 0 or len(lengths) != n or len(prompt_ids) != n:
        raise ValueError(f"val_metrics needs one length and prompt per score, got {n}, {len(lengths)}, "
                         f"{len(prompt_ids)}")
    out = {
        REWARD: sum(scores) / n,
        f"{PREFIX}response_length_mean": sum(lengths) / n,
        f"{PREFIX}samples": float(n),
    }
    if verifier:
        right = [s >= 1.0 for s in scores]
        out[f"{PREFIX}accuracy"] = sum(right) / n
        solved: dict[int, bool] = {}
        for pid, ok in zip(prompt_ids, right, strict=True):
            solved[pid] = solved.get(pid, False) or ok
        if len(solved) < n:
            out[f"{PREFIX}pass_rate"] = sum(solved.values()) / len(solved)
    return out
