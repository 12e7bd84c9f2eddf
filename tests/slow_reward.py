"""A deliberately slow reward function (module:function form) used to exercise backpressure."""

from __future__ import annotations

import time

from hybridflow.data.tiny import tiny_task_reward

DELAY_S = 0.03


def score(prompt: str, response: str, answer: str) -> float:
    time.sleep(DELAY_S)
    return tiny_task_reward(prompt, response, answer)


SLOWER_DELAY_S = 0.1
"""Slow enough that a 16-sequence micro-batch (1.6 s to score) outlasts its generation even on a busy machine."""


def slower_score(prompt: str, response: str, answer: str) -> float:
    time.sleep(SLOWER_DELAY_S)
    return tiny_task_reward(prompt, response, answer)
