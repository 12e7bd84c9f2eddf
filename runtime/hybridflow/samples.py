"""The responses a step trained on, or an evaluation scored, as JSON lines: spec.trainer.rolloutDataDir and
spec.trainer.validationDataDir, where a reward that pays for the wrong thing shows first.

`sample_rows` is pure; the controller writes the file (`write_samples`), one per step, replaced when a resumed
or rolled-back run trains that step again.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hybridflow.workers.batch import EXTRA_PREFIX, RolloutBatch


def sample_rows(batch: RolloutBatch, scored: Mapping[str, torch.Tensor] | None = None) -> list[dict[str, Any]]:
    """One record per response: prompt (after the chat template), response, answer, score, the reward function's
    other numbers (`reward_extra`, those it returned for the row), response_length, the prompt's `group`, the
    `policy_version` that answered and, once computed, `advantage`, the mean of its tokens' advantages.
    `scored`: the tensors that hold the scores when they are not the batch's own (a remote reward's)."""
    tensors = batch.tensors if scored is None else scored
    mask = batch.response_mask.float()
    lengths = mask.sum(-1)
    scores = tensors["scores"].tolist()
    advantages = batch.tensors.get("advantages")
    per_row = None if advantages is None else ((advantages * mask).sum(-1) / lengths.clamp(min=1)).tolist()
    extras = {k.removeprefix(EXTRA_PREFIX): v.tolist() for k, v in tensors.items() if k.startswith(EXTRA_PREFIX)}
    rows = []
    for i in range(len(batch)):
        row: dict[str, Any] = {"prompt": batch.prompts[i], "response": batch.responses[i], "answer": batch.answers[i],
                               "score": scores[i], "response_length": int(lengths[i]), "group": batch.group_ids[i],
                               "policy_version": batch.policy_version}
        extra = {k: v[i] for k, v in extras.items() if not math.isnan(v[i])}
        if extra:
            row["reward_extra"] = extra
        if per_row is not None:
            row["advantage"] = per_row[i]
        rows.append(row)
    return rows


def samples_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step_{step:08d}.jsonl"


def write_samples(directory: str | Path, step: int, rows: list[dict[str, Any]]) -> Path:
    """directory/step_N.jsonl with each record as a line, `step` added; written aside and renamed into place, so a
    reader never sees half a file."""
    path = samples_path(directory, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(f".{path.name}.tmp")
    with open(staged, "w") as f:
        for row in rows:
            f.write(json.dumps({"step": step} | row) + "\n")
    os.replace(staged, path)
    return path
