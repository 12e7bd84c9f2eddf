"""The torch engine's sampling loop, with a KV cache.

Two things Hugging Face's `generate` does not do, which vLLM does by prefix caching and continuous batching:
- a prompt repeated in a batch (a GRPO group's samples) is prefilled once, and its cache copied to each sample;
- sequences that have written EOS leave the batch (`compacts`), so later decoding steps compute only
  unfinished ones.
Each sequence's tokens are drawn as `generate` draws them: argmax at temperature 0, else from
softmax(logits / T) restricted to the top-k most probable tokens, then to the top-p nucleus of those.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridflow.algos import logprobs_from_logits
from hybridflow.api.spec import Evaluation, Rollout
from hybridflow.workers.modeling import cache_keyword, distinct_prompts, position_ids, returned_cache


@dataclass(frozen=True)
class Sampling:
    """How responses are drawn: temperature 0 is greedy (argmax) decoding."""

    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    """0: every token."""

    @staticmethod
    def of(cfg: Rollout) -> Sampling:
        return Sampling(cfg.temperature, cfg.top_p, cfg.top_k)

    @staticmethod
    def for_eval(ev: Evaluation, cfg: Rollout) -> Sampling:
        """Greedy, or eval.temperature (else the rollout's) with the rollout's topP and topK."""
        if ev.greedy:
            return Sampling(0.0)
        return Sampling(ev.temperature if ev.temperature is not None else cfg.temperature, cfg.top_p, cfg.top_k)


def top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """`logits` with -inf below each row's k-th largest (ties with it stay); k 0 keeps every token."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = logits.topk(k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """`logits` with -inf outside each row's nucleus: the smallest set of its most probable tokens whose
    probabilities reach `top_p` together (the most probable token always stays)."""
    if top_p >= 1.0:
        return logits
    ordered, order = logits.sort(dim=-1, descending=True)
    probs = ordered.softmax(-1)
    outside = probs.cumsum(-1) - probs >= top_p  # the more probable tokens reach top_p already
    drop = torch.zeros_like(outside).scatter(-1, order, outside)
    return logits.masked_fill(drop, float("-inf"))


def next_tokens(logits: torch.Tensor, how: Sampling) -> torch.Tensor:
    """One token per row of [B, vocab] `logits`, drawn from torch's global generator."""
    if how.temperature <= 0:
        return logits.argmax(-1)
    probs = nucleus(top_k(logits.float() / how.temperature, how.top_k), how.top_p).softmax(-1)
    return torch.multinomial(probs, 1).squeeze(-1)


def compacts(finished: int, batch: int) -> bool:
    """Whether the finished rows leave the batch now: once they are an eighth of it (at least one). Leaving
    copies the whole KV cache; a finished row that stays costs its share of each step until then."""
    return finished >= max(1, batch // 8)


@torch.no_grad()
def sample(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, how: Sampling,
           eos_id: int | None, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, max_new_tokens] responses to the left-padded prompts `ids` (`mask` 1 on their tokens): each stops
    after its EOS, and `pad_id` fills the rest; and the log-probs of their tokens, 0 after the EOS: the raw
    model's, before temperature, top-k or top-p (vLLM's raw_logprobs), by the trainer's own
    algos.logprobs_from_logits."""
    rows = ids.shape[0]
    out_tokens = ids.new_full((rows, max_new_tokens), pad_id)
    out_log_probs = torch.zeros(rows, max_new_tokens, device=ids.device)
    if rows == 0 or max_new_tokens == 0:
        return out_tokens, out_log_probs
    key = cache_keyword(model)
    first_ids, first_mask, copy_of = distinct_prompts(ids, mask)
    pos = position_ids(first_mask)
    out = model(input_ids=first_ids, attention_mask=first_mask, position_ids=pos, use_cache=True, logits_to_keep=1)
    cache = returned_cache(out)
    cache.batch_select_indices(copy_of)  # each sample gets its prompt's cache
    logits = out.logits[copy_of, -1]
    pos = pos[copy_of, -1:]
    alive = torch.arange(rows, device=ids.device)  # the response each row of the batch writes
    done = torch.zeros(rows, dtype=torch.bool, device=ids.device)
    for t in range(max_new_tokens):
        token = next_tokens(logits, how)
        out_tokens[alive[~done], t] = token[~done]
        out_log_probs[alive[~done], t] = logprobs_from_logits(logits[~done], token[~done]).float()
        if eos_id is not None:
            done |= token == eos_id
        finished = int(done.sum())
        if t == max_new_tokens - 1 or finished == len(done):
            break
        if compacts(finished, len(done)):
            keep = (~done).nonzero().squeeze(-1)
            alive, token, mask, pos, done = alive[keep], token[keep], mask[keep], pos[keep], done[keep]
            cache.batch_select_indices(keep)
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        pos = pos + 1
        out = model(input_ids=token.unsqueeze(-1), attention_mask=mask, position_ids=pos, use_cache=True,
                    **{key: cache})
        logits = out.logits[:, -1]
    return out_tokens, out_log_probs
