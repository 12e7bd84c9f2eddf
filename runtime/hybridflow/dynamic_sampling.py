"""DAPO's dynamic sampling (spec.algorithm.filterGroups) on scored rollouts: which groups teach something, and a
step's batch from the groups kept over its rollouts. Pure: the trainer draws the prompts and runs the rollouts."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from hybridflow.api.spec import FilterGroups
from hybridflow.workers.batch import RolloutBatch, reward_number

FIELD = "algorithm.filterGroups"
PREFIX = "dynamic_sampling/"
"""The step record's keys of dynamic sampling."""


def varied_rows(values: torch.Tensor, group_ids: Sequence[int]) -> torch.Tensor:
    """The rows, in order, of the groups whose `values` [B] are not all equal; a group of one sample is kept (as
    verl keeps it)."""
    low: dict[int, float] = {}
    high: dict[int, float] = {}
    count: dict[int, int] = {}
    for g, v in zip(group_ids, values.tolist(), strict=True):
        low[g], high[g] = min(low.get(g, v), v), max(high.get(g, v), v)
        count[g] = count.get(g, 0) + 1
    keep = [i for i, g in enumerate(group_ids) if count[g] == 1 or high[g] > low[g]]
    return torch.tensor(keep, dtype=torch.long)


def first_groups(group_ids: Sequence[int], n: int) -> torch.Tensor:
    """The rows, in order, of the first `n` distinct groups."""
    seen: dict[int, None] = {}
    rows = []
    for i, g in enumerate(group_ids):
        if g not in seen and len(seen) == n:
            continue
        seen.setdefault(g)
        rows.append(i)
    return torch.tensor(rows, dtype=torch.long)


def fill_with_varied_groups(first: RolloutBatch, more: Callable[[int], RolloutBatch], groups: int,
                            rule: FilterGroups) -> tuple[RolloutBatch, dict[str, float]]:
    """`groups` groups whose rule.metric differs, from `first` and, while short, `more(k)` (the k-th further rollout
    of as many prompts, its group ids distinct from every earlier one's), at most rule.maxGenBatches rollouts in all.
    The result's timings add up every rollout's. Stats: dynamic_sampling/gen_batches (rollouts taken) and
    dynamic_sampling/kept_group_frac (of the groups rolled out, the share that differed)."""
    kept: list[RolloutBatch] = []
    spent: dict[str, float] = {}
    have = rolled = 0
    batch = first
    for k in range(rule.max_gen_batches):
        if k:
            batch = more(k)
        for phase, seconds in batch.timings.items():
            spent[phase] = spent.get(phase, 0.0) + seconds
        rows = varied_rows(reward_number(batch.tensors, rule.metric, f"{FIELD}.metric"), batch.group_ids)
        rolled += len(set(batch.group_ids))
        if len(rows):
            part = batch.slice_index(rows)
            kept.append(part)
            have += len(set(part.group_ids))
        if have >= groups:
            whole = RolloutBatch.concat(kept)
            out = whole.slice_index(first_groups(whole.group_ids, groups))
            out.timings = spent
            return out, {PREFIX + "gen_batches": float(k + 1), PREFIX + "kept_group_frac": have / rolled}
    raise ValueError(f"{FIELD}.maxGenBatches: {rule.max_gen_batches} rollouts of {groups} prompts gave {have} groups "
                     f"whose {rule.metric} differs, short of the {groups} a step trains on: the prompts are too easy "
                     f"or too hard for the policy; raise maxGenBatches, or change the data")
