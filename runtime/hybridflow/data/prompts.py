"""Prompt datasets: the built-in task, parquet or JSONL files, Hub datasets; a resumable shuffled sampler."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from hybridflow.api.spec import DEFAULT_ANSWER_KEY, Data, PromptFormat, RLTrainingJobSpec
from hybridflow.data import DataError
from hybridflow.data.chat import ChatTemplate, PromptRenderer, policy_tokenizer, prompt_token_ids
from hybridflow.data.tiny import TINY_TASK, tiny_task_rows
from hybridflow.hub import SCHEME

__all__ = ["DataError", "PromptSampler", "load_prompts", "load_rows", "repeat_samples"]

TINY_TASK_SIZE = 1000
TINY_VAL_SIZE = 200
"""Prompts of `builtin:tiny_task` as spec.data.val: a draw of their own (there are only 1000 distinct prompts,
so some also occur in training; the task is to learn the rule, which either set measures)."""
Split = Literal["train", "val"]
log = logging.getLogger(__name__)


def load_rows(source: str, prompt_key: str, answer_key: str, seed: int = 0, split: Split = "train",
              prompt_format: PromptFormat = "raw", template: Callable[[], ChatTemplate] | None = None,
              ) -> list[dict[str, str]]:
    """Rows with `prompt` and `answer` (answer may be empty) from a builtin, a .parquet or .jsonl file, or a Hub
    dataset (hf://datasets/...).

    Problems name spec.data.<split>; `prompt_format` and `template` render chat prompts (see data.chat).
    """
    where = f"spec.data.{split}"
    if source == TINY_TASK:
        records: list[dict[str, Any]] = (tiny_task_rows(TINY_TASK_SIZE, seed) if split == "train"
                                         else tiny_task_rows(TINY_VAL_SIZE, seed, stream=split))
        prompt_key, answer_key = "prompt", "answer"
    else:
        records = _read_records(source, where)
        if prompt_key not in records[0]:
            raise DataError(f"spec.data.promptKey: column {prompt_key!r} not in {source} (has {sorted(records[0])})")
    answers = [column(r, answer_key) for r in records]
    if answer_key != DEFAULT_ANSWER_KEY and all(a is None for a in answers):
        raise DataError(f"spec.data.answerKey: no row of {source} has {answer_key!r} (columns: {sorted(records[0])}; "
                        "a dotted path reads inside a nested column)")
    render = PromptRenderer(prompt_format, template)
    return [{**render(r[prompt_key]), "answer": "" if a is None else str(a)}
            for r, a in zip(records, answers, strict=True)]


def column(record: Mapping[str, Any], key: str) -> Any:
    """record[key]; for a dotted key that is no column, the value at that path inside nested columns (verl's
    `reward_model.ground_truth`); None where there is none."""
    if key in record:
        return record[key]
    value: Any = record
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


def load_prompts(spec: RLTrainingJobSpec, split: Split) -> list[dict[str, str]]:
    """The rows of spec.data.train or spec.data.val, in spec.data.promptFormat with the policy's chat template,
    fitted to spec.data.maxPromptLength (`fit_prompt_length`)."""
    source = spec.data.train if split == "train" else spec.data.val
    if source is None:
        return []
    rows = load_rows(source, spec.data.prompt_key, spec.data.answer_key, spec.trainer.seed, split,
                     spec.data.prompt_format, lambda: ChatTemplate.of_model(spec.model.policy.path))
    try:
        tokenizer = policy_tokenizer(spec.model.policy.path)
    except (OSError, ValueError):  # reported by preflight's model check (HubError is a ValueError)
        return rows
    lengths = [len(ids) for ids in prompt_token_ids(tokenizer, rows)]
    return fit_prompt_length(rows, lengths, spec.data, split)


def fit_prompt_length(rows: list[dict[str, str]], lengths: list[int], data: Data, split: Split
                      ) -> list[dict[str, str]]:
    """The rows whose prompts (of `lengths` tokens) the rollout takes: all, where none is longer than
    maxPromptLength or truncation cuts them; the others, with filterOverlongPrompts. Else a DataError."""
    limit = data.max_prompt_length
    over = [i for i, n in enumerate(lengths) if n > limit]
    if not over:
        return rows
    if data.filter_overlong_prompts:
        kept = [r for r, n in zip(rows, lengths, strict=True) if n <= limit]
        if not kept:
            raise DataError(f"spec.data.maxPromptLength: every prompt of spec.data.{split} is longer than {limit} "
                            f"tokens (the shortest has {min(lengths)}), and filterOverlongPrompts drops them all")
        log.warning("spec.data.%s: dropped %d of %d prompts longer than maxPromptLength %d tokens", split,
                    len(over), len(rows), limit)
        return kept
    if data.truncation != "error":
        return rows
    longest = max(over, key=lambda i: lengths[i])
    raise DataError(f"spec.data.maxPromptLength: {len(over)} of the {len(rows)} prompts of spec.data.{split} are "
                    f"longer than {limit} tokens (the longest, row {longest}, has {lengths[longest]}); raise "
                    f"maxPromptLength, set data.filterOverlongPrompts to drop them, or data.truncation left, "
                    f"right or middle to cut them")


def repeat_samples(rows: list[dict[str, str]], n: int) -> tuple[list[dict[str, str]], list[int]]:
    """Each row n times in a row, and the index of its prompt (the group id of its samples)."""
    return [r for r in rows for _ in range(n)], [i for i in range(len(rows)) for _ in range(n)]


def _read_records(source: str, where: str) -> list[dict[str, Any]]:
    if source.startswith("builtin:"):
        raise DataError(f"{where}: unknown built-in dataset {source!r}, allowed: {TINY_TASK}")
    records = _hub_records(source, where) if source.startswith(SCHEME) else _file_records(source, where)
    if not records:
        raise DataError(f"{where}: {source} has no rows")
    return records


def _file_records(source: str, where: str) -> list[dict[str, Any]]:
    path = Path(source)
    if not path.is_file():
        raise DataError(f"{where}: file not found: {source}")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix in (".jsonl", ".json"):
        records: list[dict[str, Any]] = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            try:
                records += [json.loads(line)] if line.strip() else []
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: {source} is not JSON lines: line {number}: {e.msg}") from None
        return records
    raise DataError(f"{where}: unsupported file type {path.suffix!r}, allowed: .parquet, .jsonl, hf://datasets/...")


def _hub_records(source: str, where: str) -> list[dict[str, Any]]:
    """The split of a Hub dataset, read by the datasets library from its snapshot in the Hub cache.

    The snapshot (hybridflow.hub) is what makes a revision pin and HF_HUB_OFFLINE work: the datasets library
    itself resolves a Hub name offline only from Arrow files it prepared before, never from the Hub cache.
    """
    from hybridflow.hub import HubError, HubRefError, datasets_cache, parse_hub_ref, snapshot

    try:
        ref = parse_hub_ref(source, "dataset")
        assert ref is not None
        path = snapshot(ref, where)
    except HubRefError as e:
        raise DataError(f"{where}: {e}") from None
    except HubError as e:
        raise DataError(str(e)) from None
    try:
        import datasets
    except ImportError:
        raise DataError(f"{where}: Hub datasets need the datasets package: pip install 'hybridflow[runtime]'") from None
    datasets.disable_progress_bars()
    try:
        rows = datasets.load_dataset(str(path), ref.config, split=ref.split, cache_dir=str(datasets_cache()))
    except (ValueError, OSError) as e:  # an unknown config or split, no data files
        raise DataError(f"{where}: {ref.uri}: {str(e).strip().splitlines()[0]}") from None
    return rows.to_list()


@dataclass
class PromptSampler:
    """Epoch-shuffled batches; `state_dict` makes a resumed run draw exactly the same prompts."""

    rows: list[dict[str, str]]
    batch_size: int
    seed: int = 0
    shuffle: bool = True
    epoch: int = 0
    position: int = 0
    _order: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._reorder()

    def _reorder(self) -> None:
        self._order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(self._order)

    def next_batch(self) -> list[dict[str, str]]:
        out: list[dict[str, str]] = []
        while len(out) < self.batch_size:
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._reorder()
            out.append(self.rows[self._order[self.position]])
            self.position += 1
        return out

    def steps_for(self, epochs: int) -> int:
        """Steps that draw every prompt `epochs` times: ceil(epochs x prompts / batch size)."""
        return -(-epochs * len(self.rows) // self.batch_size)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._reorder()
