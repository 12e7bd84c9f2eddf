"""Checks that need the filesystem or Python imports, run in the driver before any worker starts,
so a wrong path or reward function is one clear message instead of a dead Ray actor.

Resolving a Hub name here fetches it into the Hub cache: the driver fetches each model and dataset once,
before the workers load them (hybridflow.hub)."""

from __future__ import annotations

from typing import Any

from hybridflow.api.spec import RLTrainingJobSpec
from hybridflow.checkpoint import NoCheckpoint, find_resume_from
from hybridflow.data.prompts import DataError, load_prompts
from hybridflow.plan import graph_problems
from hybridflow.trackers import missing_extras
from hybridflow.workers.lora import targets_problem
from hybridflow.workers.modeling import ModelPathError, check_model_dir, model_skeleton
from hybridflow.workers.reward import RewardFunctionError, resolve_reward_function
from hybridflow.workers.rollout import vllm_build, vllm_problem


def preflight(spec: RLTrainingJobSpec, accelerator: str = "CPU") -> list[str]:
    """Every problem found, each naming its spec field; empty when the job can start."""
    problems: list[str] = []
    for field, path in spec.model_paths():
        try:
            check_model_dir(path, field)
        except ModelPathError as e:
            problems.append(str(e))
    problems += lora_problems(spec)
    problems += tensor_parallel_problems(spec)
    if spec.reward.type == "function":
        try:
            resolve_reward_function(spec.reward.function)
        except RewardFunctionError as e:
            problems.append(str(e))
    for split in ("train", "val"):
        try:
            load_prompts(spec, split)
        except DataError as e:
            problems.append(str(e))
    problems += graph_problems(spec, "GPU" if accelerator == "GPU" else "CPU")
    if spec.rollout.engine == "vllm" and (problem := vllm_problem(accelerator == "GPU")):
        problems.append(problem)
    problems += vllm_cpu_problems(spec, accelerator)
    problems += missing_extras(spec.trainer.loggers.backends)
    if spec.trainer.resume_from is not None:
        try:
            find_resume_from(spec.trainer.resume_from)
        except NoCheckpoint as e:
            problems.append(str(e))
    return problems


def tensor_parallel_problems(spec: RLTrainingJobSpec) -> list[str]:
    """vLLM gives each tensor-parallel rank heads / tensorParallelSize attention heads: it must divide them
    (read from the policy's config.json; nothing to say when it cannot be read, which is reported above)."""
    tp = spec.rollout.tensor_parallel_size
    if spec.rollout.engine != "vllm" or tp == 1 or (config := policy_config(spec)) is None:
        return []
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int) or heads % tp == 0:
        return []
    fits = [d for d in range(1, heads + 1) if heads % d == 0]
    return [f"spec.rollout.tensorParallelSize: {tp} does not divide the policy's {heads} attention heads "
            f"(spec.model.policy.path's config.json); each tensor-parallel rank takes an equal share, so use one "
            f"of {', '.join(map(str, fits))}"]


def vllm_cpu_problems(spec: RLTrainingJobSpec, accelerator: str) -> list[str]:
    """vLLM's CPU build has attention kernels for some head sizes only; another fails at the first generate, deep
    in vLLM's engine."""
    if (spec.rollout.engine != "vllm" or accelerator == "GPU" or vllm_build() != "cpu"
            or (config := policy_config(spec)) is None):
        return []
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head in sizes:
        return []
    return [f"spec.model.policy.path: vLLM's CPU build runs attention heads of size {', '.join(map(str, sizes))}; "
            f"this policy's are {head} (its config.json); use rollout.engine torch for it"]


def policy_config(spec: RLTrainingJobSpec) -> Any:
    """The policy's text config (transformers' PretrainedConfig), or None when it cannot be read (reported by
    preflight's model check)."""
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(check_model_dir(spec.model.policy.path, "spec.model.policy.path"))
    except (ModelPathError, OSError, ValueError):
        return None
    return config.get_text_config()


def lora_problems(spec: RLTrainingJobSpec) -> list[str]:
    """spec.model.policy.lora.targetModules must name a layer of the policy (checked on a weightless skeleton)."""
    lora = spec.model.policy.lora
    if lora is None:
        return []
    try:
        skeleton = model_skeleton(check_model_dir(spec.model.policy.path, "spec.model.policy.path"))
    except ModelPathError:
        return []  # reported above
    except (OSError, ValueError) as e:
        return [f"spec.model.policy.path: transformers cannot build the model from its config.json: {e}"]
    problem = targets_problem(skeleton.named_modules(), lora.target_modules)
    return [problem] if problem else []
