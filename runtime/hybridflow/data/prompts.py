"""Prompt datasets: the built-in task, parquet or JSONL files, Hub datasets; a resumable shuffled sampler."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridflow.data.tiny import TINY_TASK, tiny_task_rows
from hybridflow.hub import SCHEME

TINY_TASK_SIZE = 1000


class DataError(ValueError):
    """A data source that cannot be read; the message names its spec field (spec.data.train)."""


def load_rows(source: str, prompt_key: str, answer_key: str, seed: int = 0,
              field: str = "spec.data.train") -> list[dict[str, str]]:
    """Rows with `prompt` and `answer` (answer may be empty) from a builtin, a .parquet or .jsonl file, or a Hub
    dataset (hf://datasets/...); `field` is the spec field that names `source`, for the messages."""
    if source == TINY_TASK:
        return tiny_task_rows(TINY_TASK_SIZE, seed)
    if source.startswith("builtin:"):
        raise DataError(f"{field}: unknown built-in dataset {source!r}, allowed: {TINY_TASK}")
    records = _hub_records(source, field) if source.startswith(SCHEME) else _file_records(source, field)
    if not records:
        raise DataError(f"{field}: {source} has no rows")
    if prompt_key not in records[0]:
        raise DataError(f"spec.data.promptKey: column {prompt_key!r} not in {source} (has {sorted(records[0])})")
    return [{"prompt": _as_text(r[prompt_key]), "answer": str(r.get(answer_key, "") or "")} for r in records]


def _file_records(source: str, field: str) -> list[dict[str, Any]]:
    path = Path(source)
    if not path.is_file():
        raise DataError(f"{field}: file not found: {source}")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix in (".jsonl", ".json"):
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    raise DataError(f"{field}: unsupported file type {path.suffix!r}, allowed: .parquet, .jsonl, hf://datasets/...")


def _hub_records(source: str, field: str) -> list[dict[str, Any]]:
    """The split of a Hub dataset, read by the datasets library from its snapshot in the Hub cache.

    The snapshot (hybridflow.hub) is what makes a revision pin and HF_HUB_OFFLINE work: the datasets library
    itself resolves a Hub name offline only from Arrow files it prepared before, never from the Hub cache.
    """
    from hybridflow.hub import HubError, HubRefError, datasets_cache, parse_hub_ref, snapshot

    try:
        ref = parse_hub_ref(source, "dataset")
        assert ref is not None
        path = snapshot(ref, field)
    except HubRefError as e:
        raise DataError(f"{field}: {e}") from None
    except HubError as e:
        raise DataError(str(e)) from None
    try:
        import datasets
    except ImportError:
        raise DataError(f"{field}: Hub datasets need the datasets package: pip install 'hybridflow[runtime]'") from None
    datasets.disable_progress_bars()
    try:
        rows = datasets.load_dataset(str(path), ref.config, split=ref.split, cache_dir=str(datasets_cache()))
    except (ValueError, OSError) as e:  # an unknown config or split, no data files
        raise DataError(f"{field}: {ref.uri}: {str(e).strip().splitlines()[0]}") from None
    return rows.to_list()


def _as_text(value: object) -> str:
    """Chat-style prompts (a list of {role, content}) are joined; plain strings pass through."""
    if isinstance(value, list):
        return "\n".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in value)
    return str(value)


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

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._reorder()
