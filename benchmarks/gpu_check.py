"""One prepared run of the GPU-only paths, for a machine with a GPU (scripts/gpu-check.sh runs it):

    python -m benchmarks.gpu_check --out $OUT/gpu-check.json [--cpu] [--install-vllm SECONDS]

Checks, each recorded as ok | failed | skipped | absent with its detail and time:

- fsdp2_mixed_precision: a few optimiser steps of the tiny policy under FSDP2 (bf16 compute, fp32 master
  weights and gradient reduction) in a one-rank process group; the loss must fall and the weights stay fp32.
- reshard_torch_rollout: a trained policy streamed in buckets into a torch rollout's own generation module;
  the weights must match exactly and the policy version must follow.
- process_group: a one-rank NCCL group (gloo with --cpu) and an all-reduce.
- ulysses: hybridflow.workers.ulysses.gpu_check(device) when that module exists, else absent.
- vllm_weight_load: the vLLM rollout (worker extension, sleep/wake, bucketed load) on a small Llama; vLLM
  installed by pip first when --install-vllm allows it and it is missing. Needs a GPU: skipped with --cpu.

--cpu runs what a CPU can (gloo for NCCL, the CPU for CUDA). Exit status 1 when any check failed.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

OK, FAILED, SKIPPED, ABSENT = "ok", "failed", "skipped", "absent"


class Skip(Exception):
    """The check cannot run here; the message says why."""


class Absent(Exception):
    """What the check exercises is not part of this tree."""


def one_rank_group(backend: str) -> None:
    import torch.distributed as dist

    from hybridflow.workers.distributed import free_port

    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                                timeout=timedelta(seconds=120))


def tiny_policy(device: torch.device) -> tuple[torch.nn.Module, Any, str]:
    from hybridflow.data.tiny import ensure_tiny_model
    from hybridflow.workers.modeling import load_causal_lm, load_tokenizer

    path = str(ensure_tiny_model())
    return load_causal_lm(path, "float32", device), load_tokenizer(path), path


def check_fsdp(device: torch.device, backend: str) -> dict[str, Any]:
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError as e:
        raise Absent(f"torch.distributed.fsdp has no FSDP2 here: {e}") from None
    one_rank_group(backend)
    model, _, _ = tiny_policy(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    decoder: Any = model
    for layer in decoder.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 14, (8, 12), generator=g).to(device)
    losses = []
    for _ in range(8):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.item())
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    if not losses[-1] < losses[0]:
        raise AssertionError(f"the loss did not fall: {losses}")
    if dtypes != ["torch.float32"]:
        raise AssertionError(f"master weights are {dtypes}, not float32")
    module = importlib.util.find_spec("hybridflow.workers.fsdp")
    return {"losses": [round(x, 4) for x in losses], "param_dtypes": dtypes, "compute_dtype": "bfloat16",
            "hybridflow_fsdp_module": "present" if module else "absent"}


def check_reshard(device: torch.device) -> dict[str, Any]:
    from hybridflow.api.spec import Rollout
    from hybridflow.data.prompts import load_rows
    from hybridflow.workers.batch import PolicyVersionError
    from hybridflow.workers.rollout import TorchRollout

    trained, tok, _ = tiny_policy(device)
    generation, _, _ = tiny_policy(device)
    with torch.no_grad():
        for p in trained.parameters():
            p.mul_(1.5)
    rollout = TorchRollout(trained, tok, Rollout(), 8, 4, device, generation=generation, bucket_bytes=16 << 10)
    t0 = time.perf_counter()
    rollout.sync_weights(trained, 1)
    seconds = time.perf_counter() - t0
    want, have = trained.state_dict(), generation.state_dict()
    if not all(torch.equal(want[k], have[k]) for k in want):
        raise AssertionError("the generation weights differ from the trained ones after a sync")
    rows = load_rows("builtin:tiny_task", "prompt", "answer")[:4]
    batch = rollout.generate(rows, [0, 1, 2, 3], policy_version=1)
    try:
        rollout.generate(rows, [0, 1, 2, 3], policy_version=0)
        raise AssertionError("generating for a stale policy version was allowed")
    except PolicyVersionError:
        pass
    return {"weights": len(want), "sync_seconds": round(seconds, 4), "version": batch.policy_version}


def check_process_group(device: torch.device, backend: str) -> dict[str, Any]:
    import torch.distributed as dist

    one_rank_group(backend)
    t = torch.arange(4, dtype=torch.float32, device=device)
    dist.all_reduce(t)
    if t.tolist() != [0.0, 1.0, 2.0, 3.0]:
        raise AssertionError(f"all-reduce over one rank changed the tensor: {t.tolist()}")
    return {"backend": dist.get_backend(), "world_size": dist.get_world_size()}


def check_ulysses(device: torch.device) -> dict[str, Any]:
    if importlib.util.find_spec("hybridflow.workers.ulysses") is None:
        raise Absent("hybridflow.workers.ulysses is not in this tree")
    module = importlib.import_module("hybridflow.workers.ulysses")
    result = module.gpu_check(device)
    return result if isinstance(result, dict) else {"result": repr(result)}


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

    from hybridflow.data.tiny import TINY_CONFIG, ensure_tiny_model
    from hybridflow.workers.modeling import load_tokenizer

    cfg: dict[str, Any] = {k: v for k, v in TINY_CONFIG.items() if k != "model_type"}
    cfg |= {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 4,
            "max_position_embeddings": 128}
    config = LlamaConfig(**cfg, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    load_tokenizer(str(ensure_tiny_model())).save_pretrained(directory)
    return str(directory)


def check_vllm(device: torch.device, install_seconds: int) -> dict[str, Any]:
    if device.type != "cuda":
        raise Skip("vLLM needs a GPU")
    version = ensure_vllm(install_seconds)
    from transformers import AutoModelForCausalLM

    from hybridflow.api.spec import Rollout
    from hybridflow.data.prompts import load_rows
    from hybridflow.workers.modeling import load_tokenizer
    from hybridflow.workers.rollout import VllmRollout

    with tempfile.TemporaryDirectory() as tmp:
        path = small_llama(Path(tmp))
        tok = load_tokenizer(path)
        cfg = Rollout(engine="vllm", temperature=0.0, gpu_memory_utilization=0.3)
        rollout = VllmRollout(path, tok, cfg, 8, 4, "bfloat16", seed=0, bucket_bytes=256 << 10)
        rows = load_rows("builtin:tiny_task", "prompt", "answer")[:4]
        rollout.generate(rows, [0, 1, 2, 3], policy_version=0)  # sleeps afterwards, as before training
        before = rollout.weight_sums()
        trained: torch.nn.Module = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        trained = trained.to(device)
        with torch.no_grad():
            for p in trained.parameters():
                p.mul_(2)  # exact in bf16: every sum must double
        t0 = time.perf_counter()
        rollout.sync_weights(trained, 1)
        seconds = time.perf_counter() - t0
        after = rollout.weight_sums()
        off = [name for b, a in zip(before, after, strict=True) for name in b
               if abs(a[name] - 2 * b[name]) > 1e-3 * max(1.0, abs(b[name]))]
        if off:
            raise AssertionError(f"{len(off)} vLLM parameters did not take the new weights, e.g. {off[:3]}")
        batch = rollout.generate(rows, [0, 1, 2, 3], policy_version=1)
        return {"vllm": version, "workers": len(after), "parameters": len(after[0]),
                "sync_seconds": round(seconds, 4), "version": batch.policy_version}


def run(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        out: dict[str, Any] = {"status": OK, "detail": fn()}
    except Absent as e:
        out = {"status": ABSENT, "detail": str(e)}
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
    ap.add_argument("--cpu", action="store_true", help="run the CPU-possible parts: gloo, the CPU, no vLLM")
    ap.add_argument("--install-vllm", type=int, default=0, metavar="SECONDS",
                    help="pip install vllm when missing, for at most this long (0: never)")
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
    checks = {
        "fsdp2_mixed_precision": run("fsdp2_mixed_precision", lambda: check_fsdp(device, backend)),
        "reshard_torch_rollout": run("reshard_torch_rollout", lambda: check_reshard(device)),
        "process_group": run("process_group", lambda: check_process_group(device, backend)),
        "ulysses": run("ulysses", lambda: check_ulysses(device)),
        "vllm_weight_load": run("vllm_weight_load", lambda: check_vllm(device, args.install_vllm)),
    }
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
