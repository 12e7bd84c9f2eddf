"""Rollout backends: `torch` (HF generate with KV cache, any device) and `vllm` (offline LLM on GPUs)."""

from __future__ import annotations

import time
from typing import Protocol

import torch

from hybridflow.api.spec import Rollout
from hybridflow.workers.batch import RolloutBatch
from hybridflow.workers.lora import is_lora, merged_weights


class RolloutBackend(Protocol):
    def generate(self, rows: list[dict[str, str]], group_ids: list[int], policy_version: int) -> RolloutBatch: ...

    def sync_weights(self, model: torch.nn.Module) -> None: ...


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
                   eos_id: int | None, pad_id: int, rows: list[dict[str, str]], responses: list[str],
                   group_ids: list[int], policy_version: int) -> RolloutBatch:
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
    )


class TorchRollout:
    """HF generate on the policy module itself: the update is visible at once, no weight copy needed."""

    def __init__(self, model: torch.nn.Module, tokenizer, cfg: Rollout, max_prompt_length: int,
                 max_response_length: int, device: torch.device) -> None:
        self.model, self.tok, self.cfg, self.device = model, tokenizer, cfg, device
        self.max_prompt_length, self.max_response_length = max_prompt_length, max_response_length

    def encode(self, rows: list[dict[str, str]]) -> tuple[torch.Tensor, torch.Tensor]:
        enc = self.tok([r["prompt"] for r in rows], return_tensors="pt", padding=True, truncation=True,
                       max_length=self.max_prompt_length)
        return enc["input_ids"], enc["attention_mask"]

    @torch.no_grad()
    def generate(self, rows: list[dict[str, str]], group_ids: list[int], policy_version: int) -> RolloutBatch:
        t0 = time.perf_counter()
        ids, mask = self.encode(rows)
        was_training = self.model.training
        self.model.eval()
        sample = self.cfg.temperature > 0
        out = self.model.generate(  # type: ignore[operator]  # HF's GenerationMixin, unknown to nn.Module
            input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
            max_new_tokens=self.max_response_length, do_sample=sample,
            temperature=self.cfg.temperature if sample else None, top_p=self.cfg.top_p if sample else None,
            top_k=0 if sample else None,
            pad_token_id=self.tok.pad_token_id, eos_token_id=self.tok.eos_token_id, use_cache=True,
        )
        self.model.train(was_training)
        resp = out[:, ids.shape[1]:].cpu()
        if resp.shape[1] < self.max_response_length:
            resp = torch.nn.functional.pad(resp, (0, self.max_response_length - resp.shape[1]),
                                           value=self.tok.pad_token_id)
        texts = self.tok.batch_decode(resp, skip_special_tokens=True)
        batch = assemble_batch(ids, mask, resp, self.tok.eos_token_id, self.tok.pad_token_id, rows, texts,
                               group_ids, policy_version)
        batch.add_timing("generate", time.perf_counter() - t0)
        return batch

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Nothing to push: generation runs on the trained module."""


class VllmRollout:
    """vLLM's offline `LLM` engine; after each update the trained weights are loaded into it."""

    def __init__(self, model_path: str, tokenizer, cfg: Rollout, max_prompt_length: int, max_response_length: int,
                 dtype: str, seed: int) -> None:
        from vllm import LLM, SamplingParams

        self.tok, self.cfg = tokenizer, cfg
        self.max_prompt_length = max_prompt_length
        self.llm = LLM(
            model=model_path, tensor_parallel_size=cfg.tensor_parallel_size,
            gpu_memory_utilization=cfg.gpu_memory_utilization, dtype=dtype, seed=seed,
            max_model_len=max_prompt_length + max_response_length, enable_prefix_caching=True,
        )
        self.params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=max_response_length,
                                     seed=None)

    def generate(self, rows: list[dict[str, str]], group_ids: list[int], policy_version: int) -> RolloutBatch:
        from vllm.inputs import TokensPrompt

        t0 = time.perf_counter()
        enc = self.tok([r["prompt"] for r in rows], return_tensors="pt", padding=True, truncation=True,
                       max_length=self.max_prompt_length)
        prompts = [TokensPrompt(prompt_token_ids=ids[m.bool()].tolist())
                   for ids, m in zip(enc["input_ids"], enc["attention_mask"], strict=True)]
        outs = self.llm.generate(prompts, self.params, use_tqdm=False)
        width = self.params.max_tokens
        pad = self.tok.pad_token_id
        resp = torch.full((len(rows), width), pad, dtype=torch.long)
        for i, o in enumerate(outs):
            toks = list(o.outputs[0].token_ids)[:width]
            resp[i, :len(toks)] = torch.tensor(toks, dtype=torch.long)
        texts = [o.outputs[0].text for o in outs]
        batch = assemble_batch(enc["input_ids"], enc["attention_mask"], resp, self.tok.eos_token_id, pad, rows,
                               texts, group_ids, policy_version)
        batch.add_timing("generate", time.perf_counter() - t0)
        return batch

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Push the trained parameters into every vLLM worker through its public collective RPC (a LoRA
        policy's adapters merged into its base weights, under the base model's names)."""
        state = merged_weights(model) if is_lora(model) else model.state_dict()
        weights = [(name, p.detach()) for name, p in state.items()]
        self.llm.collective_rpc(_load_weights, args=(weights,))


def _load_weights(worker, weights) -> None:  # runs inside each vLLM worker
    worker.model_runner.model.load_weights(weights=weights)


def make_rollout(engine: str, model: torch.nn.Module, model_path: str, tokenizer, cfg: Rollout,
                 max_prompt_length: int, max_response_length: int, device: torch.device, dtype: str,
                 seed: int) -> RolloutBackend:
    """`vllm` needs the package and a GPU; the error says which is missing."""
    if engine == "vllm":
        if not torch.cuda.is_available():
            raise RuntimeError("spec.rollout.engine: 'vllm' needs a GPU; use 'torch' on CPU-only machines")
        try:
            import vllm  # noqa: F401
        except ImportError:
            raise RuntimeError(
                "spec.rollout.engine: 'vllm' is not installed (pip install 'hybridflow[vllm]')"
            ) from None
        return VllmRollout(model_path, tokenizer, cfg, max_prompt_length, max_response_length, dtype, seed)
    return TorchRollout(model, tokenizer, cfg, max_prompt_length, max_response_length, device)
