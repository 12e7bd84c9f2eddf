"""Reward functions returning a mapping, as verl's compute_score may (module:function form)."""

from __future__ import annotations

from typing import Any

from hybridflow.data.tiny import tiny_task_reward


def score(prompt: str, response: str, answer: str) -> dict[str, Any]:
    """The tiny task's score, with numbers to log beside it: a bool, a count, one only some rows return, and a
    string, which is not a number and is left out."""
    reward = tiny_task_reward(prompt, response, answer)
    out: dict[str, Any] = {"score": reward, "acc": reward > 0, "words": len(response.split()), "pred": response}
    if reward > 0:
        out["bonus"] = 0.5
    return out


def without_score(prompt: str, response: str, answer: str) -> dict[str, float]:
    return {"acc": 1.0}


def batch_scores(prompts: list[str], responses: list[str], answers: list[str]) -> list[dict[str, Any]]:
    """`score` for a whole batch at once (spec.reward.batched), as a verifier answering many in one call would."""
    return [score(p, r, a) for p, r, a in zip(prompts, responses, answers, strict=True)]


def batch_missing_one(prompts: list[str], responses: list[str], answers: list[str]) -> list[float]:
    return [0.0] * (len(responses) - 1)
