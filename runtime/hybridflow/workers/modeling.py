"""Loading HF models and the forward passes every role shares (log-probs, values)."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch

from hybridflow.algos import entropy_from_logits, logprobs_from_logits, sum_pi_squared_from_logits
from hybridflow.api.spec import ModelRef, Training
from hybridflow.hub import HubError, resolve_model_path
from hybridflow.workers import distributed
from hybridflow.workers.batch import RolloutBatch
from hybridflow.workers.lora import adapter_weights, apply_lora, is_lora, load_adapter_weights
from hybridflow.workers.training import checkpoints_activations

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelPathError(ValueError):
    """A model directory that does not exist or is not an HF model, or a Hub name that cannot be resolved;
    names the spec field."""


def pick_device(want_gpu: bool = True) -> torch.device:
    return torch.device("cuda") if want_gpu and torch.cuda.is_available() else torch.device("cpu")


THREADS_ENV = "HYBRIDFLOW_TORCH_THREADS"
"""Set, it fixes every worker's torch threads whatever its bundle holds (tests on a busy machine, benchmarks)."""


def prepare_process(threads: int = 1) -> int:
    """torch's intra-op threads: `threads` (the CPUs of the worker's bundle) unless $HYBRIDFLOW_TORCH_THREADS
    says otherwise; and no per-load progress bars or load reports from transformers in the training log.
    Returns the threads in force."""
    torch.set_num_threads(int(os.environ.get(THREADS_ENV) or threads))
    quiet_transformers()
    return torch.get_num_threads()


def quiet_transformers() -> None:
    """No per-load progress bars or load reports from transformers."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def check_model_dir(path: str, field: str) -> str:
    """Resolve builtin and Hub names (hybridflow.hub) and fail with the spec field when the directory is not a
    model."""
    try:
        resolved = resolve_model_path(path, field)
    except HubError as e:
        raise ModelPathError(str(e)) from None
    if not (Path(resolved) / "config.json").is_file():
        raise ModelPathError(f"{field}: no HF model at {path!r} (expected a directory with config.json)")
    return resolved


def load_tokenizer(path: str):  # -> PreTrainedTokenizerBase
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(path: str, dtype: str, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    return model.to(device)


def load_policy(ref: ModelRef, device: torch.device) -> torch.nn.Module:
    """The policy's module: the model at spec.model.policy.path, under LoRA adapters when its lora is set."""
    model = load_causal_lm(check_model_dir(ref.path, "spec.model.policy.path"), ref.dtype, device)
    return apply_lora(model, ref.lora) if ref.lora is not None else model


def policy_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint keeps of the policy: the adapters of a LoRA policy, else every weight."""
    return adapter_weights(model) if is_lora(model) else model.state_dict()


def load_policy_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    if is_lora(model):
        load_adapter_weights(model, weights)
    else:
        model.load_state_dict(weights)


def model_skeleton(path: str) -> torch.nn.Module:
    """The model's modules on the meta device: its layer names without loading (or allocating) a weight."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model: torch.nn.Module = AutoModelForCausalLM.from_config(config)
    return model


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: cumsum(mask) - 1, clamped at 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def response_logits(model: torch.nn.Module, batch: RolloutBatch, device: torch.device) -> torch.Tensor:
    """Logits that predict each response token: positions P-1 .. P+R-2 of the full sequence.

    The LM head runs on the last R+1 positions only (`logits_to_keep`): a prompt position's [vocab] logits would
    be computed, kept for the backward pass, and thrown away. Where rows share a prompt (a GRPO group's samples),
    each distinct prompt runs once (`shared_prompt_logits`). They come in the model's dtype (see `for_reduction`)."""
    ids = batch.input_ids.to(device)
    mask = batch.attention_mask.to(device)
    prompt, response = batch.prompt_length, ids.shape[1] - batch.prompt_length
    if response > 1 and shares_prompts(model):
        distinct, distinct_mask, copy_of = distinct_prompts(ids[:, :prompt], mask[:, :prompt])
        if sharing_pays(len(distinct), len(ids)):
            return for_reduction(shared_prompt_logits(model, ids, mask, prompt, (distinct, distinct_mask, copy_of)))
    out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=False,
                logits_to_keep=response + 1)
    return for_reduction(out.logits[:, :-1])


def shares_prompts(model: torch.nn.Module) -> bool:
    """Whether a pass may run a shared prompt once and its rows' responses on its KV cache: not where training
    recomputes blocks in the backward pass (checkpointing drops the cache, and a recomputed block would extend it
    twice)."""
    return not (model.training and checkpoints_activations(model))


def sharing_pays(distinct: int, rows: int) -> bool:
    """Whether rows / distinct >= 2: a shared pass makes a second forward call, whose fixed cost a few repeated
    prompts do not earn back. On the tiny model, a PPO batch of 256 rows, 12% of them repeating a prompt, scores in
    13.3 ms shared against 10.2 ms whole; a GRPO batch of 32 prompts x 8 samples scores in 11.3 against 10.7 ms
    and updates in 27.3 against 30.9 ms."""
    return rows >= 2 * distinct


def distinct_prompts(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct rows of left-padded prompts `ids` (`mask` 1 on their tokens): (ids, mask, copy_of), where
    row i of the batch is distinct row copy_of[i]."""
    distinct, copy_of = torch.unique(torch.cat([ids, mask], dim=1), dim=0, return_inverse=True)
    width = ids.shape[1]
    return distinct[:, :width], distinct[:, width:], copy_of


def shared_prompt_logits(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, prompt: int,
                         prompts: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """`response_logits` of [B, P + R] rows whose prompts are `prompts` (`distinct_prompts`), each prompt run once.

    Causal attention makes a prompt's keys and values the same in every row that holds it: the distinct prompts
    run first and keep their KV cache, which is indexed out to the rows (in the backward pass their rows'
    gradients add up), and the responses run on it. A prompt token costs once per group instead of once per
    sample; the logits equal a full forward's. The last prompt position's logits predict the first response
    token; the last response token predicts nothing, so it does not run."""
    distinct, distinct_mask, copy_of = prompts
    response = ids.shape[1] - prompt
    first = model(input_ids=distinct, attention_mask=distinct_mask, position_ids=position_ids(distinct_mask),
                  use_cache=True, logits_to_keep=1)
    cache = returned_cache(first)
    cache.batch_select_indices(copy_of)
    seen = mask[:, :prompt + response - 1]
    rest = model(input_ids=ids[:, prompt:prompt + response - 1], attention_mask=seen,
                 position_ids=position_ids(seen)[:, prompt:], use_cache=True, **{cache_keyword(model): cache})
    return torch.cat([first.logits[copy_of], rest.logits], dim=1)


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword the model's forward takes its KV cache by: `cache` in newer transformers, else
    `past_key_values`."""
    base_of = getattr(model, "get_base_model", None)  # a PEFT model's own
    base = base_of() if callable(base_of) else model
    return "cache" if "cache" in inspect.signature(type(base).forward).parameters else "past_key_values"


def returned_cache(out: Any) -> Any:
    return out["cache"] if "cache" in out else out["past_key_values"]


def for_reduction(logits: torch.Tensor) -> torch.Tensor:
    """Logits that train are upcast to fp32 once, here, so the log-probs and an entropy term share one copy; others
    keep the model's dtype, and the chunked reductions upcast them a chunk at a time (no whole fp32 copy)."""
    return logits.float() if logits.requires_grad else logits


TokenStat = Literal["entropy", "entropy_loss", "sum_pi_squared"]
"""What a pass wants of the logits besides the log-probs, per token: the entropy as a logged metric or as a term of
the loss, or sum_v pi_v^2 (the optimal token baseline's)."""

CHUNK_ELEMENTS = 2**26
"""A reduction over the vocabulary that needs no gradient runs on chunks of tokens of at most this many logits
(256 MiB in fp32; at least one token). Over the whole [B, R, vocab] its temporaries would take copies of the
logits: three for the entropy (softmax, masked logits, their product), one for the log-probs (exp)."""


@torch.no_grad()
def per_token_in_chunks(reduce: Callable[..., torch.Tensor], logits: torch.Tensor,
                        *aligned: torch.Tensor) -> torch.Tensor:
    """`reduce` of [..., vocab] `logits` (with `aligned` [...] tensors) to [...], a chunk of tokens at a time."""
    tokens = max(1, CHUNK_ELEMENTS // logits.shape[-1])
    flat = logits.detach().reshape(-1, logits.shape[-1])
    cut = [t.reshape(-1).split(tokens) for t in aligned]
    parts = [reduce(chunk, *(c[i] for c in cut)) for i, chunk in enumerate(flat.split(tokens))]
    if not parts:
        return torch.zeros(logits.shape[:-1], device=logits.device)
    return torch.cat(parts).view(logits.shape[:-1])


def token_stat(logits: torch.Tensor, stat: TokenStat) -> torch.Tensor:
    """`stat` per token. Only the loss's entropy stays on the graph; the others are taken off it, so the backward
    pass skips their softmax over the vocabulary (and autograd keeps no [B, T, V] tensor for them), and computed in
    chunks of tokens."""
    reductions = {"entropy": entropy_from_logits, "sum_pi_squared": sum_pi_squared_from_logits}
    if stat == "entropy_loss":
        return entropy_from_logits(logits)
    if stat not in reductions:
        raise ValueError(f"no per-token {stat!r}: one of entropy, entropy_loss, sum_pi_squared")
    return per_token_in_chunks(reductions[stat], logits)


def token_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(label) per token; in chunks of tokens where no gradient is wanted (the scoring passes)."""
    if logits.requires_grad:
        return logprobs_from_logits(logits, labels)
    return per_token_in_chunks(logprobs_from_logits, logits, labels)


def response_log_probs(model: torch.nn.Module, batch: RolloutBatch, device: torch.device,
                       stat: TokenStat | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi of the response tokens, and `token_stat` of their logits where `stat` asks for it."""
    logits = response_logits(model, batch, device)
    logp = token_log_probs(logits, batch.responses_ids.to(device))
    return logp, (token_stat(logits, stat) if stat else None)


def in_micro_batches(batch: RolloutBatch, limits: Training, score: Callable[[RolloutBatch], torch.Tensor],
                     sharded_on: torch.device | None = None) -> torch.Tensor:
    """`score` of the batch's rows, in the batch's row order, by passes of at most `limits.micro_batch_size` rows
    and `limits.micro_batch_tokens` tokens (`RolloutBatch.passes`; no limit: one pass). A forward-only pass holds
    one pass's activations and logits at once, and runs on its rows `trimmed`. Per-token results ([B, R]) are 0
    outside the response tokens, however the rows were padded.

    `sharded_on`: `score` runs a module sharded over the ranks (on that device), whose every pass gathers its
    parameters with the other ranks': each rank runs `distributed.most_passes`, the extra ones on its first row,
    their scores dropped."""
    parts = batch.passes(None, limits.micro_batch_size, limits.micro_batch_tokens)
    runs = max(len(parts), 1)
    extra = 0 if sharded_on is None else distributed.most_passes(runs, sharded_on) - runs
    if len(parts) <= 1:
        out = _per_row(score(batch.trimmed()), batch)
    else:
        rows = [batch.slice_index(idx) for idx in parts]
        scores = [_per_row(score(mb.trimmed()), mb) for mb in rows]
        out = torch.cat(scores)[torch.cat(parts).argsort()]
    for _ in range(extra):
        score(batch.slice_index(torch.arange(1)).trimmed())
    return out


def _per_row(scores: torch.Tensor, batch: RolloutBatch) -> torch.Tensor:
    """A trimmed pass's scores for `batch`'s rows: per-token ones ([B, R], or [B, R, k] for k numbers a token)
    widened to its responses (0 past the pass's longest) and masked to them."""
    if scores.dim() == 1:
        return scores
    mask = batch.response_mask.to(scores.device)
    columns = scores.dim() - 2
    wide = torch.nn.functional.pad(scores, (0, 0) * columns + (0, mask.shape[1] - scores.shape[1]))
    return wide * mask.view(*mask.shape, *(1,) * columns)


def minibatch_chunks(n: int, chunks: int, generator: torch.Generator) -> list[torch.Tensor]:
    """A shuffled permutation of range(n) cut into exactly `chunks` pieces (some may be empty).

    Every data-parallel rank takes the same number of optimiser steps, so collectives always match.
    """
    return list(torch.randperm(n, generator=generator).tensor_split(chunks))
