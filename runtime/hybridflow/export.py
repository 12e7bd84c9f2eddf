"""A trained policy as a Hugging Face model folder: safetensors weights, the tokenizer, a model card.

The job's base model is loaded with transformers, the trained weights go into it, and `save_pretrained`
writes the folder, which `AutoModelForCausalLM.from_pretrained` loads like any other. A LoRA policy's
adapters are merged into the base (`merge_and_unload`: a plain transformers model) or written alone as a
peft adapter folder (`separate`: `PeftModel.from_pretrained(base, folder)`).

The weights come from a checkpoint (`hybridflow export`, which also reads the job saved beside it) or
from the actor when a run ends (spec.trainer.export). No Ray here: the controller calls `export_policy`
with weights it fetched, the CLI calls `export_checkpoint`.

The folder is written aside and renamed into place. An existing destination is replaced only when it is
empty or holds an earlier export (its hybridflow.json), never an unrelated directory.
"""

from __future__ import annotations

import json
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from hybridflow import checkpoint
from hybridflow._version import __version__
from hybridflow.api import RLTrainingJob, SpecError, load_job
from hybridflow.api.spec import AdapterMode, Lora
from hybridflow.checkpoint import CONTROLLER_FILE, JOB_FILE
from hybridflow.workers.lora import LoraTargetError
from hybridflow.workers.modeling import (
    ModelPathError,
    check_model_dir,
    load_policy,
    load_policy_weights,
    load_tokenizer,
    policy_weights,
)

METADATA_FILE = "hybridflow.json"
"""What the folder holds and where it came from; its presence marks a directory an export may replace."""
POLICY_ROLE = "actor_rollout"


class ExportError(ValueError):
    """Why nothing was exported; the message starts with the argument or spec field at fault."""


@dataclass(frozen=True)
class Names:
    """How the caller's inputs are named in messages: the CLI's options, or the spec's fields."""

    to: str = "--to"
    adapters: str = "--adapters"
    config: str = "--config"


CLI = Names()
SPEC = Names(to="spec.trainer.export.path", adapters="spec.trainer.export.adapters", config="the job")


@dataclass(frozen=True)
class Exported:
    path: Path
    step: int
    kind: Literal["full", "merged", "adapter"]
    """full: every weight trained; merged: LoRA folded into the base; adapter: a peft adapter folder."""
    base_model: str
    """spec.model.policy.path as the job wrote it."""

    def summary(self) -> dict[str, Any]:
        return {"exported": str(self.path), "step": self.step, "kind": self.kind, "baseModel": self.base_model}


# -- from a checkpoint ------------------------------------------------------------------------------------------


def find_checkpoint(path: str | Path) -> Path:
    """CHECKPOINT as given, or the newest complete one under it (checkpoint.resolve)."""
    found = checkpoint.resolve(path)
    if found is None:
        raise ExportError(f"CHECKPOINT: {path} is neither a checkpoint directory (one holding {CONTROLLER_FILE}) "
                          "nor a checkpoint root with a complete step_NNNNNNNN directory")
    return found


def checkpoint_job(directory: Path, config: str | None) -> RLTrainingJob:
    """The job file given with --config, else the job saved in the checkpoint (a run writes it there)."""
    if config:
        try:
            return load_job(config)
        except SpecError as e:
            raise ExportError(f"--config: {e.render()}") from None
    saved = directory / JOB_FILE
    if not saved.is_file():
        raise ExportError(f"--config: checkpoint {directory} holds no {JOB_FILE} (it was written before runs saved "
                          "their job); pass the job file it was trained with: --config JOB.yaml")
    try:
        return load_job(saved)
    except SpecError as e:
        raise ExportError(f"CHECKPOINT: the saved job is not valid: {e.render()}") from None


def checkpoint_policy(directory: Path, job: RLTrainingJob,
                      adapters: AdapterMode = "merge") -> tuple[int, dict[str, torch.Tensor]]:
    """(step, the policy's weights as the actor holds them): the job's base policy with the trained weights of
    the checkpoint's policy group (its DCP training state: fp32, cast to the policy's dtype) put into it."""
    from hybridflow import dcp
    from hybridflow.workers.training import MODEL_PREFIX, load_trained

    controller = checkpoint.load_state(directory / CONTROLLER_FILE)
    first_ranks = sorted(n for n in controller["world"] if n.rsplit("_", 1)[-1] == "0")
    for name in first_ranks:
        path = directory / f"{name}.pt"
        if not path.is_file() or POLICY_ROLE not in checkpoint.load_state(path)["roles"]:
            continue
        trained = dcp.read_full(checkpoint.training_dir(directory, name, POLICY_ROLE), MODEL_PREFIX)
        _kind(job.spec.model.policy.lora, adapters, is_adapter_state(trained), CLI)  # refuses a mismatch first
        try:
            model = load_policy(job.spec.model.policy, torch.device("cpu"))
        except (ModelPathError, LoraTargetError) as e:
            raise ExportError(f"{e} (in {CLI.config})") from None
        try:
            load_trained(model, trained)
        except ValueError as e:
            raise ExportError(f"spec.model.policy: the weights do not fit the job's policy ({CLI.config}): "
                              f"{e}") from None
        return int(controller["step"]), policy_weights(model)
    raise ExportError(f"CHECKPOINT: {directory} holds no policy weights (no rank file with the {POLICY_ROLE} role "
                      f"among {', '.join(first_ranks) or 'none'})")


def export_checkpoint(path: str | Path, to: str | Path, adapters: AdapterMode = "merge", config: str | None = None,
                      overwrite: bool = False) -> Exported:
    """`hybridflow export CHECKPOINT --to DIR`: the policy of a checkpoint (or the newest under a root)."""
    directory = find_checkpoint(path)
    job = checkpoint_job(directory, config)
    step, weights = checkpoint_policy(directory, job, adapters)
    return export_policy(job, weights, step, to, adapters, overwrite=overwrite, source=str(directory), names=CLI)


# -- the folder ------------------------------------------------------------------------------------------------


def is_adapter_state(weights: dict[str, torch.Tensor]) -> bool:
    """A LoRA policy's checkpoint holds its adapters only (workers.modeling.policy_weights)."""
    return bool(weights) and all(".lora_" in k for k in weights)


def export_policy(job: RLTrainingJob, weights: dict[str, torch.Tensor], step: int, to: str | Path,
                  adapters: AdapterMode = "merge", *, overwrite: bool = False, source: str = "",
                  names: Names = CLI) -> Exported:
    """Load the job's base policy on the CPU, put `weights` into it, and write the folder at `to`."""
    policy = job.spec.model.policy
    kind = _kind(policy.lora, adapters, is_adapter_state(weights), names)
    dest = Path(to)
    _check_destination(dest, overwrite, names)
    try:
        base = check_model_dir(policy.path, "spec.model.policy.path")
        model = load_policy(policy, torch.device("cpu"))
    except (ModelPathError, LoraTargetError) as e:
        raise ExportError(f"{e} (in {names.config})") from None
    try:
        load_policy_weights(model, weights)
    except (RuntimeError, ValueError) as e:
        raise ExportError(f"spec.model.policy: the weights do not fit the job's policy ({names.config}): "
                          f"{str(e).splitlines()[0]}") from None
    if kind == "merged":
        model = model.merge_and_unload()  # type: ignore[operator]  # PeftModel's, unknown to nn.Module
    staging = dest.parent / f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        if kind == "adapter":  # the adapters alone: the base's (unchanged) embedding weights stay out
            model.save_pretrained(staging, safe_serialization=True,  # type: ignore[operator]
                                  save_embedding_layers=False)
        else:  # transformers 5 writes safetensors only; the flag keeps transformers 4 on them too
            model.save_pretrained(staging, safe_serialization=True)  # type: ignore[operator]
        load_tokenizer(base).save_pretrained(staging)
        meta = metadata(job, step, kind, source)
        (staging / METADATA_FILE).write_text(json.dumps(meta, indent=1) + "\n")
        (staging / "README.md").write_text(model_card(meta))
        _replace(staging, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return Exported(dest, step, kind, policy.path)


def _kind(lora: Lora | None, adapters: str, adapter_state: bool,
          names: Names) -> Literal["full", "merged", "adapter"]:
    if lora is None and adapter_state:
        raise ExportError(f"spec.model.policy.lora: the weights are LoRA adapters but {names.config} sets no lora; "
                          "use the job file the policy was trained with")
    if lora is not None and not adapter_state:
        raise ExportError(f"spec.model.policy.lora: {names.config} sets lora but the weights are a full fine-tune's; "
                          "use the job file the policy was trained with")
    if adapters not in ("merge", "separate"):
        raise ExportError(f"{names.adapters}: got {adapters!r}, allowed: 'merge' or 'separate'")
    if lora is None:
        if adapters == "separate":
            raise ExportError(f"{names.adapters}: 'separate' needs a LoRA policy (spec.model.policy.lora); a full "
                              "fine-tune has no adapters to write apart, use 'merge'")
        return "full"
    return "merged" if adapters == "merge" else "adapter"


def _check_destination(dest: Path, overwrite: bool, names: Names) -> None:
    if not dest.exists():
        return
    if not dest.is_dir():
        raise ExportError(f"{names.to}: {dest} exists and is not a directory")
    if not any(dest.iterdir()):
        return
    if not (dest / METADATA_FILE).is_file():
        raise ExportError(f"{names.to}: {dest} is not empty and holds no earlier export ({METADATA_FILE}); "
                          "choose a new or empty directory")
    if not overwrite:
        raise ExportError(f"{names.to}: {dest} holds an earlier export; pass --overwrite to replace it")


def _replace(staging: Path, dest: Path) -> None:
    """Rename the finished folder into place; an earlier export there is moved aside first, then removed."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    old = None
    if dest.exists():
        old = dest.parent / f".{dest.name}.old-{uuid.uuid4().hex[:8]}"
        dest.rename(old)
    staging.rename(dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# -- what the folder says about itself -------------------------------------------------------------------------


def metadata(job: RLTrainingJob, step: int, kind: str, source: str) -> dict[str, Any]:
    """hybridflow.json: the job, the step and how the weights were written."""
    lora = job.spec.model.policy.lora
    return {
        "job": job.metadata.name, "namespace": job.metadata.namespace, "step": step,
        "algorithm": job.spec.algorithm.name, "baseModel": job.spec.model.policy.path, "kind": kind,
        "lora": lora.to_yaml_dict() if lora is not None else None, "source": source or "the end of the run",
        "hybridflowVersion": __version__,
    }


_LOADING = {
    "full": "AutoModelForCausalLM.from_pretrained(\"{dir}\")",
    "merged": "AutoModelForCausalLM.from_pretrained(\"{dir}\")",
    "adapter": "PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), \"{dir}\")",
}
_WEIGHTS = {
    "full": "every weight fine-tuned",
    "merged": "LoRA adapters (rank {rank}, alpha {alpha:g}, on {targets}) merged into the base weights",
    "adapter": "LoRA adapters alone (rank {rank}, alpha {alpha:g}, on {targets}); the base model is `{base}`",
}


def model_card(meta: dict[str, Any]) -> str:
    """README.md of the folder: Hugging Face front matter, then the job, the step and how to load it."""
    kind = meta["kind"]
    lora = meta["lora"] or {}
    weights = _WEIGHTS[kind].format(rank=lora.get("rank"), alpha=lora.get("alpha", 0.0),
                                    targets=", ".join(lora.get("targetModules", [])), base=meta["baseModel"])
    library = "peft" if kind == "adapter" else "transformers"
    return (
        f"---\nlibrary_name: {library}\ntags:\n- hybridflow\n- reinforcement-learning\n- {meta['algorithm']}\n---\n\n"
        f"# {meta['job']}: policy at step {meta['step']}\n\n"
        f"Trained with hybridflow {meta['hybridflowVersion']} ({meta['algorithm']}) from `{meta['baseModel']}`; "
        f"exported from {meta['source']}.\n\n"
        f"Weights: {weights}.\n\n"
        f"Load it with `{_LOADING[kind].format(dir='.')}` (path of this folder in place of `.`).\n"
    )
