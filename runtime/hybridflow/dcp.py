"""Sharded checkpoints with torch.distributed.checkpoint (DCP), read without unpickling.

Every rank of a process group writes its own shards (`__RANK_0.distcp`) into one directory and the
coordinator writes the index (`.metadata`); a load with any number of ranks reads the parts of each tensor it
holds, so a checkpoint written by 2 ranks loads into 1 and the other way round.

DCP's own index is a pickle, and it reads non-tensor values with a full unpickle. Here the index is JSON
and only tensors are accepted (read back with `torch.load(..., weights_only=True)` by DCP's reader), so a
checkpoint directory on shared storage cannot run code (see hybridflow.checkpoint).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dist_cp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    FileSystemReader,
    FileSystemWriter,
    _StorageInfo,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from hybridflow.checkpoint import CheckpointWriteError, write_problem

INDEX_FILE = ".metadata"


class CheckpointFormatError(ValueError):
    """A DCP index that is not this module's JSON (or holds something other than tensors)."""


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointFormatError(f"unknown dtype {name!r} in a checkpoint index")
    return dtype


def index_to_json(md: Metadata) -> dict[str, Any]:
    """The index as plain JSON: each tensor's dtype, size and chunks, and where each chunk's bytes are."""
    tensors: dict[str, Any] = {}
    for fqn, item in md.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            raise CheckpointFormatError(f"{fqn}: only tensors are checkpointed here, got {type(item).__name__}")
        tensors[fqn] = {"dtype": str(item.properties.dtype).removeprefix("torch."), "size": list(item.size),
                        "chunks": [[list(c.offsets), list(c.sizes)] for c in item.chunks]}
    storage = [{"fqn": i.fqn, "offset": None if i.offset is None else list(i.offset), "index": i.index,
                "file": s.relative_path, "at": s.offset, "length": s.length,
                "transforms": list(s.transform_descriptors or ())}
               for i, s in (md.storage_data or {}).items()]
    planner = {k: list(v) for k, v in (md.planner_data or {}).items()}
    return {"version": md.version, "tensors": tensors, "planner": planner, "storage": storage}


def index_from_json(doc: dict[str, Any]) -> Metadata:
    try:
        tensors: dict[str, Any] = {
            fqn: TensorStorageMetadata(TensorProperties(dtype=_dtype(t["dtype"])), torch.Size(t["size"]),
                                       [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in t["chunks"]])
            for fqn, t in doc["tensors"].items()
        }
        storage = {MetadataIndex(s["fqn"], s["offset"], s["index"]):
                   _StorageInfo(str(s["file"]), int(s["at"]), int(s["length"]), tuple(s["transforms"]))
                   for s in doc["storage"]}
        planner = {k: tuple(v) for k, v in doc["planner"].items()}
        return Metadata(tensors, planner, storage, StorageMeta(), doc["version"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointFormatError(f"not a checkpoint index: {type(e).__name__}: {e}") from None


class JsonIndexWriter(FileSystemWriter):
    """DCP's file-system writer with the index written as JSON."""

    def finish(self, metadata: Metadata, results: list[list[Any]]) -> None:
        metadata.storage_data = {wr.index: wr.storage_data for rank in results for wr in rank}
        metadata.version = CURRENT_DCP_VERSION
        target = Path(self.path) / INDEX_FILE
        staged = target.with_name(f"{INDEX_FILE}.tmp")
        with open(staged, "w") as f:
            json.dump(index_to_json(metadata), f)
            f.flush()
            os.fsync(f.fileno())
        staged.replace(target)


class JsonIndexReader(FileSystemReader):
    """DCP's file-system reader of a JSON index."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / INDEX_FILE
        try:
            doc = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointFormatError(f"{path}: not a JSON checkpoint index ({e})") from None
        md = index_from_json(doc)
        if md.storage_meta is not None:
            md.storage_meta.load_id = self.load_id
        return md


@contextmanager
def _alone_is_fine() -> Iterator[None]:
    """DCP warns whenever it runs without a process group; one rank alone is a layout we use on purpose."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _tensors_only(state: dict[str, Any]) -> None:
    bad = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise TypeError(f"only tensors go into a sharded checkpoint; not {', '.join(bad[:3])}")


def save(state: dict[str, torch.Tensor], directory: str | Path) -> None:
    """Write `state` (plain tensors or DTensors) into `directory`; every rank of the default group calls it."""
    _tensors_only(state)
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        with _alone_is_fine():
            dist_cp.save(state, storage_writer=JsonIndexWriter(str(directory)), no_dist=not dist.is_initialized())
    except (OSError, RuntimeError, CheckpointException) as e:
        raise CheckpointWriteError(f"cannot write checkpoint files in {directory}: "
                                   f"{write_problem(_first_failure(e), Path(directory))}") from None


def _first_failure(error: BaseException) -> BaseException:
    """DCP gathers each rank's exception into one CheckpointException; the first rank's tells the cause."""
    if isinstance(error, CheckpointException) and error.failures:
        return error.failures[min(error.failures)][0]
    return error


def load(state: dict[str, torch.Tensor], directory: str | Path) -> None:
    """Fill `state`'s tensors in place from `directory`, whatever the ranks that wrote it."""
    _tensors_only(state)
    JsonIndexReader(str(directory)).read_metadata()  # a bad index raises here, not wrapped by DCP's collectives
    with _alone_is_fine():
        dist_cp.load(state, storage_reader=JsonIndexReader(str(directory)), no_dist=not dist.is_initialized())


def read_full(directory: str | Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor under `prefix`, whole, in this process alone (no process group): for inspection and export."""
    md = JsonIndexReader(str(directory)).read_metadata()
    state = {fqn: torch.empty(tuple(item.size), dtype=item.properties.dtype)
             for fqn, item in md.state_dict_metadata.items()
             if fqn.startswith(prefix) and isinstance(item, TensorStorageMetadata)}
    with _alone_is_fine():
        dist_cp.load(state, storage_reader=JsonIndexReader(str(directory)), no_dist=True)
    return {k.removeprefix(prefix): v for k, v in state.items()}
