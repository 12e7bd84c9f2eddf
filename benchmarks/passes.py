"""Padding in the training passes: rows in length order and trimmed, against passes over padded rows; the LM head
on the response positions only, against every position; and a group's prompt run once, against every row whole.

One GRPO-shaped batch whose responses are as long as an RL policy writes them (most far shorter than the cap, a
tail that reaches it) goes through the two passes every step pays for: the reference log-probs (forward only)
and the actor's update (forward, backward, one AdamW step). The alternative is what a trainer does that pads
every row to the batch's longest and cuts micro-batches in batch order (TRL's GRPOTrainer, and hybridflow before
`RolloutBatch.passes`). Both run the same model, loss and rows on the same cores, one after the other, repeated.

The second comparison runs the same passes (length order, trimmed) on the same body with a vocabulary of 4,096,
so that the LM head is about the share of a token's matmul work it is in Qwen2.5-0.5B: logits for every position
and then the response's, against logits for the response positions only (`modeling.response_logits`).

The third runs each row whole, against a prompt that rows of a pass share run once (`modeling.shared_prompt_logits`),
in one pass over the batch and in length order. The first two comparisons run every row whole, so that each
measures its own effect.

    python -m benchmarks.passes            # ~3 minutes: results/passes.json, passes.png and its README section
    python -m benchmarks.passes --render   # redraw from the JSON
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import embedded_tokens, grouped_bars, measure_or_render, measured, save_figure
from hybridflow import algos
from hybridflow.api.spec import Training
from hybridflow.metrics import pyplot
from hybridflow.workers.batch import RolloutBatch
from hybridflow.workers.modeling import (
    in_micro_batches,
    load_causal_lm,
    position_ids,
    prepare_process,
    response_log_probs,
)
from hybridflow.workers.optim import micro_weight, train_epochs
from hybridflow.workers.training import RoleTraining

BEGIN, END = "<!-- passes-bench:begin -->", "<!-- passes-bench:end -->"
FORMAT = 4
MODEL = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "max_position_embeddings": 512}
"""The runtime benchmark's wide model, with room for longer sequences."""
HEAD_MODEL = MODEL | {"vocab_size": 4096}
"""The same body with a vocabulary that gives the LM head 29% of a token's matmul work (256 x 4,096 of 3.67M
weights), as in Qwen2.5-0.5B (896 x 151,936 of 494M: 28%)."""
ROWS, PROMPT, RESPONSE = 128, 64, 256
"""16 prompts x 8 samples; prompts of 16..64 tokens, responses capped at 256."""
RESPONSE_MEDIAN, RESPONSE_SIGMA = 80, 0.8
"""Response lengths ~ lognormal(log median, sigma), capped: about 8% of the rows reach the cap."""
ROWS_PER_PASS, TOKENS_PER_PASS = 32, 8192
REPEATS = 3
CPU = torch.device("cpu")

Score = Callable[[RolloutBatch], torch.Tensor]
LogProbs = Callable[[torch.nn.Module, RolloutBatch], torch.Tensor]


def response_only(module: torch.nn.Module, mb: RolloutBatch) -> torch.Tensor:
    """hybridflow's log-probs: the LM head on the response positions (and one more) only, a prompt that rows of
    the pass share run once."""
    return response_log_probs(module, mb, CPU)[0]


def whole_rows(module: torch.nn.Module, mb: RolloutBatch, every_position: bool = False) -> torch.Tensor:
    """The alternative: every row run whole, its prompt included; the LM head on the response positions (and one
    more) as TRL's GRPOTrainer runs it, or (`every_position`) on every position, the prompt's logits thrown away."""
    mask, response = mb.attention_mask, mb.responses_ids.shape[1]
    logits = module(input_ids=mb.input_ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=False,
                    logits_to_keep=0 if every_position else response + 1).logits
    return algos.logprobs_from_logits(logits[:, -response - 1:-1].float(), mb.responses_ids)


HEADS: dict[str, LogProbs] = {"every position": partial(whole_rows, every_position=True),
                              "response positions only": whole_rows}
SHARING: dict[str, LogProbs] = {"every row whole": whole_rows, "a group's prompt once": response_only}
LAYOUTS: dict[str, Training] = {"one pass over the batch": Training(),
                                f"length order, {ROWS_PER_PASS} rows a pass": Training(micro_batch_size=ROWS_PER_PASS)}
"""How the prompt-sharing comparison cuts the batch: as a job with no micro-batch limits does, and in passes that
split a group's samples by their response lengths."""

REDUCED = (2, 1024, 151_936)
"""Logits of one pass for the vocabulary reductions: 2 rows of 1,024 response tokens over Qwen2.5's vocabulary
(1.16 GiB in fp32)."""
REDUCTIONS = ("entropy (metric)", "log-probs (scoring)", "log-probs (scoring), bf16 logits")
"""The last: a bf16 policy's logits, upcast whole to fp32 and then reduced, against upcast a chunk at a time."""
REDUCE_WAYS = ("whole", "chunked")


def reduction_peak(reduction: str, way: str) -> dict[str, float]:
    """In a fresh process: how far its resident memory rises above what it holds with the logits made, while
    `reduction` runs over them `way` (the whole tensor at once, or hybridflow's chunks of tokens). Before it runs,
    the C heap gives back what it freed (malloc_trim) and the kernel's high-water mark is reset to the resident
    size (clear_refs 5), so the mark measures this reduction alone."""
    import ctypes

    from hybridflow.workers import modeling

    prepare_process(os.cpu_count() or 1)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(REDUCED, generator=g)
    if reduction == REDUCTIONS[2]:
        logits = logits.bfloat16()
    labels = torch.randint(0, REDUCED[-1], REDUCED[:-1], generator=g)
    result: list[torch.Tensor] = []

    @torch.no_grad()
    def reduce() -> None:
        if reduction == REDUCTIONS[0]:
            result.append(algos.entropy_from_logits(logits) if way == "whole"
                          else modeling.token_stat(logits, "entropy"))
        else:
            result.append(algos.logprobs_from_logits(logits.float(), labels) if way == "whole"
                          else modeling.token_log_probs(logits, labels))

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    seconds, extra = measured(reduce)
    return {"extra_peak_bytes": float(extra), "seconds": seconds, "sum": float(result[0].double().sum())}


def bench_reductions() -> dict[str, Any]:
    """Each reduction both ways, each run in a process of its own (a high-water mark only rises)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from hybridflow.workers.modeling import CHUNK_ELEMENTS

    out: dict[str, Any] = {"logits_shape": list(REDUCED), "logits_bytes": math.prod(REDUCED) * 4,
                           "chunk_elements": CHUNK_ELEMENTS, "runs": {}}
    for reduction in REDUCTIONS:
        for way in REDUCE_WAYS:
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                out["runs"][f"{reduction}, {way}"] = pool.submit(reduction_peak, reduction, way).result()
    return out


def rollout_batch(seed: int = 0) -> RolloutBatch:
    """Random tokens at rollout lengths: a group's 8 samples share their prompt, prompts left-padded to PROMPT,
    responses right-padded to RESPONSE."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(16, PROMPT + 1, (ROWS // 8,), generator=g).repeat_interleave(8)
    normal = torch.randn(ROWS, generator=g)
    response_lens = (RESPONSE_MEDIAN * torch.exp(RESPONSE_SIGMA * normal)).long().clamp(1, RESPONSE)
    prompt = (torch.arange(PROMPT) >= PROMPT - prompt_lens[:, None]).long()
    response = (torch.arange(RESPONSE) < response_lens[:, None]).long()
    mask = torch.cat([prompt, response], dim=1)
    prompt_ids = torch.randint(3, 14, (ROWS // 8, PROMPT), generator=g).repeat_interleave(8, 0)
    ids = torch.cat([prompt_ids, torch.randint(3, 14, (ROWS, RESPONSE), generator=g)], dim=1) * mask
    return RolloutBatch(ids, mask, response, PROMPT, 0, [""] * ROWS, [""] * ROWS, [""] * ROWS,
                        [i // 8 for i in range(ROWS)], tensors={"advantages": torch.randn(ROWS, generator=g)})


def grpo_loss(module: torch.nn.Module,
              log_probs: LogProbs) -> Callable[[RolloutBatch], tuple[torch.Tensor, dict[str, float]]]:
    def loss_fn(mb: RolloutBatch) -> tuple[torch.Tensor, dict[str, float]]:
        logp = log_probs(module, mb)
        surrogate = -mb.tensors["advantages"][:, None] * torch.exp(logp - logp.detach())
        return algos.agg_loss(surrogate, mb.response_mask.float(), "token-mean"), {}
    return loss_fn


def padded_scores(batch: RolloutBatch, score: Score) -> torch.Tensor:
    """The alternative's scoring: ROWS_PER_PASS rows at a time in batch order, each pass as wide as the batch."""
    return torch.cat([score(batch.slice_index(idx)) for idx in torch.arange(len(batch)).split(ROWS_PER_PASS)])


def padded_update(training: RoleTraining, batch: RolloutBatch) -> None:
    """The alternative's update: the same micro-batches, padded, gradients added up, one AdamW step."""
    loss_fn = grpo_loss(training.module, whole_rows)
    training.zero_grad()
    training.module.train()
    for idx in torch.arange(len(batch)).split(ROWS_PER_PASS):
        mb = batch.slice_index(idx)
        loss, _ = loss_fn(mb)
        (loss * micro_weight(mb.response_mask, batch.response_mask, "token-mean")).backward()
    training.step(1e9)


def ordered_update(training: RoleTraining, batch: RolloutBatch, limits: Training, log_probs: LogProbs) -> None:
    train_epochs(training, batch, grpo_loss(training.module, log_probs), epochs=1, steps_per_epoch=1,
                 shuffle=torch.Generator().manual_seed(0), max_grad_norm=1e9, device=CPU, limits=limits)


MODES: dict[str, Training | None] = {
    f"padded, {ROWS_PER_PASS} rows a pass (batch order)": None,
    f"length order, {ROWS_PER_PASS} rows a pass": Training(micro_batch_size=ROWS_PER_PASS),
    f"length order, {TOKENS_PER_PASS} tokens a pass": Training(micro_batch_tokens=TOKENS_PER_PASS),
}


def tokens_through(batch: RolloutBatch, limits: Training | None) -> int:
    if limits is None:
        return batch.input_ids.numel()
    parts = batch.passes(None, limits.micro_batch_size, limits.micro_batch_tokens)
    return sum(len(p) * batch.slice_index(p).trimmed().input_ids.shape[1] for p in parts)


def pass_count(batch: RolloutBatch, limits: Training | None) -> int:
    if limits is None:
        return -(-len(batch) // ROWS_PER_PASS)
    return len(batch.passes(None, limits.micro_batch_size, limits.micro_batch_tokens))


def bench() -> dict[str, Any]:
    from hybridflow.data.tiny import ensure_tiny_model

    threads = prepare_process(os.cpu_count() or 1)
    model = load_causal_lm(str(ensure_tiny_model(**MODEL)), "float32", CPU)
    reference = load_causal_lm(str(ensure_tiny_model(**MODEL)), "float32", CPU).eval()
    training = RoleTraining(model, lr=1e-6, options=Training(), device=CPU)
    batch = rollout_batch()

    def score(mb: RolloutBatch) -> torch.Tensor:
        return whole_rows(reference, mb)

    times: dict[str, dict[str, list[float]]] = {m: {"score_s": [], "update_s": []} for m in MODES}
    results: dict[str, torch.Tensor] = {}
    for r in range(REPEATS + 1):  # the first round warms up
        for mode, limits in MODES.items():
            t0 = time.perf_counter()
            with torch.no_grad():
                out = padded_scores(batch, score) if limits is None else in_micro_batches(batch, limits, score)
            t1 = time.perf_counter()
            if limits is None:
                padded_update(training, batch)
            else:
                ordered_update(training, batch, limits, whole_rows)
            t2 = time.perf_counter()
            results[mode] = out * batch.response_mask
            if r:
                times[mode]["score_s"].append(t1 - t0)
                times[mode]["update_s"].append(t2 - t1)
        print(f"[bench] round {r}/{REPEATS}", flush=True)
    base = next(iter(MODES))
    agree = max(float((results[m] - results[base]).abs().max()) for m in MODES)
    modes = {m: {"tokens": tokens_through(batch, limits), "passes": pass_count(batch, limits),
                 "score_s": statistics.median(times[m]["score_s"]),
                 "update_s": statistics.median(times[m]["update_s"]),
                 "score_runs_s": times[m]["score_s"], "update_runs_s": times[m]["update_s"]}
             for m, limits in MODES.items()}
    lengths = batch.response_mask.sum(-1).float()
    return {"format": FORMAT, "machine": {"cores": os.cpu_count(), "torch_threads": threads},
            "model": MODEL, "rows": ROWS, "prompt": PROMPT, "response": RESPONSE, "repeats": REPEATS,
            "response_tokens": {"mean": float(lengths.mean()), "median": float(lengths.median()),
                                "at_cap": int((lengths == RESPONSE).sum())},
            "real_tokens": int(batch.attention_mask.sum()), "max_log_prob_difference": agree, "modes": modes,
            "heads": bench_heads(batch), "sharing": bench_sharing(batch), "reductions": bench_reductions()}


def bench_heads(batch: RolloutBatch) -> dict[str, Any]:
    """Both LM-head modes over the same passes (length order, ROWS_PER_PASS rows): times, the largest logits
    tensor the head returned in a pass (a forward hook measures it), and how far their log-probs differ."""
    from hybridflow.data.tiny import ensure_tiny_model

    path = str(ensure_tiny_model(**HEAD_MODEL))
    training = RoleTraining(load_causal_lm(path, "float32", CPU), lr=1e-6, options=Training(), device=CPU)
    reference = load_causal_lm(path, "float32", CPU).eval()
    limits = Training(micro_batch_size=ROWS_PER_PASS)
    largest: list[int] = [0]

    def measure(_m: torch.nn.Module, _args: Any, out: torch.Tensor) -> None:
        largest[0] = max(largest[0], out.numel() * out.element_size())

    for module in (training.module, reference):
        module.get_output_embeddings().register_forward_hook(measure)
    logits_bytes: dict[str, int] = {}

    def before(_head: str) -> None:
        largest[0] = 0

    def after(head: str) -> None:
        logits_bytes[head] = largest[0]

    out = compared(training, reference, batch, {"": limits}, HEADS, "LM head", before, after)[""]
    for head, m in out["modes"].items():
        m["largest_logits_bytes"] = logits_bytes[head]
    return {"model": HEAD_MODEL} | out


def compared(training: RoleTraining, reference: torch.nn.Module, batch: RolloutBatch, layouts: dict[str, Training],
             ways: dict[str, LogProbs], what: str, before: Callable[[str], None] = lambda _w: None,
             after: Callable[[str], None] = lambda _w: None) -> dict[str, dict[str, Any]]:
    """Per layout, each way's scoring pass (the reference) and update (the actor) over the same passes, in turn,
    REPEATS times after one to warm up: median times, every run's, and how far the ways' log-probs differ."""
    runs = {(lay, w): {"score_s": [], "update_s": []} for lay in layouts for w in ways}
    results: dict[tuple[str, str], torch.Tensor] = {}
    for r in range(REPEATS + 1):
        for lay, limits in layouts.items():
            for way, log_probs in ways.items():
                before(way)
                t0 = time.perf_counter()
                with torch.no_grad():
                    results[lay, way] = in_micro_batches(batch, limits, lambda mb, f=log_probs: f(reference, mb))
                t1 = time.perf_counter()
                ordered_update(training, batch, limits, log_probs)
                t2 = time.perf_counter()
                after(way)
                if r:
                    runs[lay, way]["score_s"].append(t1 - t0)
                    runs[lay, way]["update_s"].append(t2 - t1)
        print(f"[bench] {what}, round {r}/{REPEATS}", flush=True)
    first = next(iter(ways))
    return {lay: {"max_log_prob_difference": max(float((results[lay, w] - results[lay, first]).abs().max())
                                                 for w in ways),
                  "modes": {w: {"score_s": statistics.median(runs[lay, w]["score_s"]),
                                "update_s": statistics.median(runs[lay, w]["update_s"]),
                                "score_runs_s": runs[lay, w]["score_s"], "update_runs_s": runs[lay, w]["update_s"]}
                            for w in ways}}
            for lay in layouts}


def bench_sharing(batch: RolloutBatch) -> dict[str, Any]:
    """Every row whole against a group's prompt run once, in each of LAYOUTS; the tokens a scoring pass embeds
    are counted by a hook on the reference's embedding."""
    from hybridflow.data.tiny import ensure_tiny_model

    path = str(ensure_tiny_model(**MODEL))
    training = RoleTraining(load_causal_lm(path, "float32", CPU), lr=1e-6, options=Training(), device=CPU)
    reference = load_causal_lm(path, "float32", CPU).eval()
    out = compared(training, reference, batch, LAYOUTS, SHARING, "prompt sharing")
    for lay, limits in LAYOUTS.items():
        for way, log_probs in SHARING.items():
            with torch.no_grad(), embedded_tokens(reference) as tokens:
                in_micro_batches(batch, limits, lambda mb, f=log_probs: f(reference, mb))
            out[lay]["modes"][way]["tokens"] = sum(tokens)
    return out


def reduction_agreement(red: dict[str, Any]) -> float:
    """The largest relative difference between a reduction's sums over its two ways."""
    sums = [[red["runs"][f"{r}, {w}"]["sum"] for w in REDUCE_WAYS] for r in REDUCTIONS]
    return max(abs(a - b) / abs(a) for a, b in sums)


def render(report: dict[str, Any]) -> str:
    modes = report["modes"]
    base = modes[next(iter(MODES))]
    rt = report["response_tokens"]
    lines = [BEGIN, "## Padding in the training passes (`make bench-passes`)", "",
             f"Generated by `python -m benchmarks.passes` on {report['machine']['cores']} cores "
             f"({report['machine']['torch_threads']} torch threads): the runtime benchmark's wide model "
             f"(hidden 256, 4 layers), one batch of {report['rows']} rows (16 prompts x 8 samples) with prompts of "
             f"16 to {report['prompt']} tokens and responses as long as a policy writes them: lognormal, median "
             f"{rt['median']:.0f} and mean {rt['mean']:.0f} tokens, {rt['at_cap']} rows at the cap of "
             f"{report['response']}. Of the padded batch's {report['rows'] * (report['prompt'] + report['response'])} "
             f"tokens, {report['real_tokens']} are real. Each pass's time is the median of {report['repeats']} runs "
             "(after one to warm up); a scoring pass is the reference log-probs (forward only), an update is the "
             "actor's forward, backward and one AdamW step over the whole batch.", "",
             "| how rows are cut into passes | tokens through the model | passes | scoring | update | "
             "scoring, update vs padded |",
             "|---|---:|---:|---:|---:|---|"]
    for name, m in modes.items():
        lines.append(f"| {name} | {m['tokens']} | {m['passes']} | {m['score_s'] * 1000:.0f} ms | "
                     f"{m['update_s'] * 1000:.0f} ms | **{base['score_s'] / m['score_s']:.2f}x**, "
                     f"**{base['update_s'] / m['update_s']:.2f}x** |")
    lines += ["", "Where the time goes: a pass costs about its tokens, padding included, so the gain follows the "
              "tokens column. Padded, every row is as wide as the longest prompt plus the longest response; in "
              "length order each pass is as wide as its own rows' longest, and a token limit lets passes of short "
              "rows take more of them. The log-probs of every mode agree to "
              f"{report['max_log_prob_difference']:.1e} at every response token.", ""]
    heads = report["heads"]
    every, *_ = heads["modes"].values()
    lines += ["### The LM head on the response positions only", "",
              f"The same batch and passes (length order, {ROWS_PER_PASS} rows a pass), on the same body with a "
              f"vocabulary of {heads['model']['vocab_size']}: the LM head is then 29% of a token's matmul work, as "
              "in Qwen2.5-0.5B (28%). The largest logits tensor is the biggest the LM head returned in one pass, "
              "measured by a hook on it; the backward pass keeps it.", "",
              "| the LM head runs on | scoring | update | largest logits tensor | scoring, update vs every position |",
              "|---|---:|---:|---:|---|"]
    for name, m in heads["modes"].items():
        lines.append(f"| {name} | {m['score_s'] * 1000:.0f} ms | {m['update_s'] * 1000:.0f} ms | "
                     f"{m['largest_logits_bytes'] / 2**20:.0f} MiB | **{every['score_s'] / m['score_s']:.2f}x**, "
                     f"**{every['update_s'] / m['update_s']:.2f}x** |")
    lines += ["", "Where the time goes: the head's matmul and the log-softmax over the vocabulary run on the response "
              "positions only, so the saving is the prompt's share of each pass's positions times the head's share "
              "of a token's work; the logits shrink by the prompt's share. With Qwen's full vocabulary of 151,936, "
              "the logits of a prompt position are 594 KiB in fp32. The two modes' log-probs agree to "
              f"{heads['max_log_prob_difference']:.1e}.", ""]
    sharing = report["sharing"]
    lines += ["### A group's prompt run once", "",
              f"The same batch on the wide model: its {report['rows'] // 8} prompts have 8 samples each. Every row "
              "run whole, against each distinct prompt of a pass run once and the pass's responses on its KV cache "
              "(`modeling.shared_prompt_logits`; TRL's GRPOTrainer runs every row whole). Tokens are those a scoring "
              "pass embeds, counted by a hook on the embedding.", "",
              "| passes | each row | tokens through the model | scoring | update | scoring, update vs whole |",
              "|---|---|---:|---:|---:|---|"]
    for layout, out in sharing.items():
        whole, *_ = out["modes"].values()
        for name, m in out["modes"].items():
            lines.append(f"| {layout} | {name} | {m['tokens']} | {m['score_s'] * 1000:.0f} ms | "
                         f"{m['update_s'] * 1000:.0f} ms | **{whole['score_s'] / m['score_s']:.2f}x**, "
                         f"**{whole['update_s'] / m['update_s']:.2f}x** |")
    agree = max(out["max_log_prob_difference"] for out in sharing.values())
    lines += ["", "Where the time goes: causal attention makes a prompt's keys and values the same in each of its "
              "samples, so a prompt token is computed once per group and its gradient is the sum of its samples'. "
              "In one pass every group's samples are together; in length order a pass holds the samples of like "
              "response length, and a prompt runs once per pass that holds one of its samples. The log-probs of "
              f"both ways agree to {agree:.1e}.", ""]
    red = report["reductions"]
    rows, tokens, vocab = red["logits_shape"]
    lines += ["### Reductions over the vocabulary, in chunks of tokens", "",
              f"The per-token entropy logged as a metric and the log-probs of a scoring pass need no gradient, so "
              f"they run on chunks of at most {red['chunk_elements']} logits (`modeling.CHUNK_ELEMENTS`: "
              f"{red['chunk_elements'] // vocab} tokens at this vocabulary). Measured on the logits of one pass "
              f"of {rows} rows x {tokens} response tokens over Qwen2.5's vocabulary of {vocab} "
              f"({red['logits_bytes'] / 2**30:.2f} GiB in fp32), each run in a fresh process: the rise of its "
              "resident memory's high-water mark (VmHWM, reset first) above what it held with the logits made.",
              "",
              "| reduction | whole tensor: extra peak | chunked: extra peak | whole : chunked | time, whole / "
              "chunked |", "|---|---:|---:|---:|---|"]
    for reduction in REDUCTIONS:
        whole, chunked = (red["runs"][f"{reduction}, {way}"] for way in REDUCE_WAYS)
        lines.append(f"| {reduction} | {whole['extra_peak_bytes'] / 2**20:.0f} MiB | "
                     f"{chunked['extra_peak_bytes'] / 2**20:.0f} MiB | "
                     f"**{whole['extra_peak_bytes'] / chunked['extra_peak_bytes']:.1f}x** | "
                     f"{whole['seconds']:.2f} / {chunked['seconds']:.2f} s |")
    lines += ["", "Where the memory goes: over the whole tensor the entropy holds three temporaries the size of the "
              "logits at once (the softmax, the logits with -inf masked, their product) and the log-probs one (the "
              "exponentials inside logsumexp); chunked, each is one chunk's. A bf16 policy's logits (half the "
              "bytes) were upcast whole to fp32 before the reduction, a copy twice their size; now each chunk is "
              "upcast on its own. In an update the logits that train "
              "stay whole: autograd keeps them for the backward pass. Both ways sum to the same to "
              f"{reduction_agreement(red):.1e} (relative).", "",
              "![passes](results/passes.png)", END]
    return "\n".join(lines)


def plot(report: dict[str, Any], out: Path) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.5), width_ratios=[3, 2, 4])
    shared = {f"{lay}, {way}": m for lay, out in report["sharing"].items() for way, m in out["modes"].items()}
    panels = [(report["modes"], f"{report['rows']} rows, responses up to {report['response']} tokens"),
              (report["heads"]["modes"], f"LM head, vocabulary {report['heads']['model']['vocab_size']}"),
              (shared, "a group's prompt once")]
    for ax, (modes, title) in zip(axes, panels, strict=True):
        names = list(modes)
        grouped_bars(ax, {"scoring": [modes[n]["score_s"] * 1000 for n in names],
                          "update": [modes[n]["update_s"] * 1000 for n in names]}, 0.4)
        ax.set_xticks(range(len(names)), [n.replace(", ", "\n") for n in names], fontsize=7)
        ax.set_ylabel("ms per batch")
        ax.set_title(title)
        ax.legend()
    return save_figure(fig, out, dpi=120)


def main() -> None:
    measure_or_render(__doc__.splitlines()[0], "passes", bench, render, plot, BEGIN, END)


if __name__ == "__main__":
    main()
