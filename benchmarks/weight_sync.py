"""Weight sync after an update: a full state-dict copy against bucketed streaming (hybridflow.workers.reshard).

    python -m benchmarks.weight_sync [--repeats 3] [--bucket-mib 16] [--quick]

Three cases on the CPU, each a fresh process so memory figures start clean:

- **plain**: a Llama-shaped policy (plain tensors) synced into a generation copy of itself. *full copy*
  clones every weight first and then loads it (what handing `state_dict()` to an engine costs: one more
  model in flight); *bucketed* streams `stream_buckets` into the copy; *bucketed + packed* also packs each
  bucket into one byte buffer and unpacks it, as the vLLM path sends it.
- **fsdp2**: the same policy sharded by FSDP2 over 2 gloo ranks, each rank loading its tensor-parallel half
  (tp 2) into its own generation slices. *full copy* gathers the whole state dict (`full_tensor()` of every
  weight) and then cuts; *bucketed* gathers one weight at a time.
- **update**: RoleTraining's sharded update of that policy on 2 gloo ranks (a batch of its own), the
  inference copy held through it against released for it and gathered again (the runtime's way): peak memory.

Figures: the median wall time of `--repeats` syncs, and peak extra memory: the process's peak resident set
(Linux VmHWM, reset before each sync through /proc/self/clear_refs) minus its resident set at the start of
the sync; for the update case, the peak resident set itself. tracemalloc would not see torch's tensors, which
are not Python objects' memory.
Writes benchmarks/results/weight_sync.json and the table in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import measured, status_bytes, write_section
from hybridflow.workers.reshard import copy_into, pack, stream_buckets, tp_slice, unpack

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "weight_sync.json"
README = ROOT / "benchmarks" / "README.md"
BEGIN, END = "<!-- weight-sync-bench:begin -->", "<!-- weight-sync-bench:end -->"
MiB = 1 << 20

CONFIG = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1408,
          "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8,
          "max_position_embeddings": 512, "tie_word_embeddings": False}
QUICK_CONFIG = CONFIG | {"vocab_size": 4096, "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 2}


def build(config: dict[str, Any], seed: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(LlamaConfig(**{k: v for k, v in config.items() if k != "model_type"}))


# -- memory ---------------------------------------------------------------------------------------------------


def summary(runs: list[tuple[float, int]]) -> dict[str, float]:
    return {"seconds": statistics.median(s for s, _ in runs), "peak_extra_mib": max(b for _, b in runs) / MiB}


# -- the plain case -------------------------------------------------------------------------------------------


def plain_case(config: dict[str, Any], repeats: int, bucket_bytes: int) -> dict[str, Any]:
    trained, generation = build(config, 1), build(config, 2)
    state = trained.state_dict()

    def full_copy() -> None:
        copied = {k: v.detach().clone() for k, v in state.items()}
        copy_into(generation, copied.items())
        del copied

    def bucketed() -> None:
        for bucket in stream_buckets(state, bucket_bytes):
            copy_into(generation, zip(bucket.names, bucket.tensors, strict=True))

    def packed() -> None:
        for bucket in stream_buckets(state, bucket_bytes):
            copy_into(generation, unpack(*pack(bucket)))

    out: dict[str, Any] = {"model_mib": sum(v.numel() * v.element_size() for v in state.values()) / MiB,
                           "largest_weight_mib": max(v.numel() * v.element_size() for v in state.values()) / MiB}
    for name, fn in (("full_copy", full_copy), ("bucketed", bucketed), ("bucketed_packed", packed)):
        fn()  # warm-up: first-touch page faults of the generation copy are not the method's cost
        out[name] = summary([measured(fn) for _ in range(repeats)])
        assert all(torch.equal(a, b) for a, b in zip(state.values(), generation.state_dict().values(),
                                                     strict=True)), name
    return out


# -- the FSDP2 case: 2 gloo ranks, each the tensor-parallel rank of its own generation engine -----------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fsdp_rank(rank: int, world: int, port: int, config: dict[str, Any], repeats: int, bucket_bytes: int,
              out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = build(config, 1)
    reference = {k: v.detach().clone() for k, v in model.state_dict().items()}
    decoder: Any = model
    for layer in decoder.model.layers:
        fully_shard(layer)
    fully_shard(model)
    state = model.state_dict()
    # this rank's generation engine holds its tensor-parallel slice of every weight
    slices = {k: tp_slice(k, v, rank, world).clone() for k, v in reference.items()}
    del reference
    gc.collect()

    def load(name: str, value: torch.Tensor) -> None:
        slices[name].copy_(value)

    def full_copy() -> None:
        whole = {k: v.full_tensor() for k, v in state.items()}
        for k, v in whole.items():
            load(k, tp_slice(k, v, rank, world))
        del whole

    def bucketed() -> None:
        for bucket in stream_buckets(state, bucket_bytes, tp_rank=rank, tp_size=world):
            for k, v in zip(bucket.names, bucket.tensors, strict=True):
                load(k, v)

    result: dict[str, Any] = {"shard_mib": sum(v.to_local().numel() * v.element_size()
                                               for v in state.values()) / MiB}
    for name, fn in (("full_copy", full_copy), ("bucketed", bucketed)):
        fn()
        runs = []
        for _ in range(repeats):
            dist.barrier()
            runs.append(measured(fn))
        result[name] = summary(runs)
    check = {k: torch.equal(slices[k], tp_slice(k, v.full_tensor(), rank, world)) for k, v in state.items()}
    result["slices_match"] = all(check.values())
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()  # no rank tears its group down while a peer's gloo threads still talk to it
    dist.destroy_process_group()


def two_ranks(rank_main: Callable[..., None], args: tuple[Any, ...], tmp: Path) -> list[dict[str, Any]]:
    """`rank_main(rank, 2, port, *args, tmp)` on 2 processes; each rank's JSON from `tmp`."""
    import torch.multiprocessing as mp

    for attempt in range(3):  # a port another process took between choosing and binding: choose again
        try:
            mp.spawn(rank_main, args=(2, _free_port(), *args, str(tmp)), nprocs=2)
            break
        except Exception:
            if attempt == 2:
                raise
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


def fsdp_case(config: dict[str, Any], repeats: int, bucket_bytes: int, tmp: Path) -> dict[str, Any]:
    ranks = two_ranks(fsdp_rank, (config, repeats, bucket_bytes), tmp)
    out: dict[str, Any] = {"ranks": 2, "tp": 2, "shard_mib": ranks[0]["shard_mib"],
                           "slices_match": all(r["slices_match"] for r in ranks)}
    for name in ("full_copy", "bucketed"):
        out[name] = {"seconds": max(r[name]["seconds"] for r in ranks),
                     "peak_extra_mib": max(r[name]["peak_extra_mib"] for r in ranks)}
    return out


# -- the update case: RoleTraining's sharded update on 2 gloo ranks, the inference copy held or released ---------

UPDATE_ROWS, UPDATE_PROMPT, UPDATE_RESPONSE = 4, 16, 48


def update_batch(vocab: int, rank: int) -> Any:
    from hybridflow.workers.batch import RolloutBatch

    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(3, vocab, (UPDATE_ROWS, UPDATE_PROMPT + UPDATE_RESPONSE), generator=g)
    n = UPDATE_ROWS
    return RolloutBatch(input_ids=ids, attention_mask=torch.ones_like(ids),
                        response_mask=torch.ones(n, UPDATE_RESPONSE, dtype=torch.long), prompt_length=UPDATE_PROMPT,
                        policy_version=0, prompts=[""] * n, responses=[""] * n, answers=[""] * n,
                        group_ids=list(range(n)))


def update_rank(rank: int, world: int, port: int, config: dict[str, Any], repeats: int, keep_copy: bool,
                out_dir: str) -> None:
    """The actor's update loop (train_epochs: release, steps, sync) on this rank's rows; `keep_copy` holds the
    inference copy through it, as the sharded layout did before it released the copy."""
    from unittest import mock

    from hybridflow.api.spec import Training
    from hybridflow.workers import distributed
    from hybridflow.workers.modeling import response_log_probs
    from hybridflow.workers.optim import train_epochs
    from hybridflow.workers.training import RoleTraining

    distributed.setup("127.0.0.1", port, rank, world, "gloo", timeout_s=300)
    role = RoleTraining(build(config, 1), lr=1e-4, options=Training(), device=torch.device("cpu"))
    batch = update_batch(config["vocab_size"], rank)
    seen: list[int] = []

    def loss_fn(mb: Any) -> tuple[torch.Tensor, dict[str, float]]:
        seen.append(role.inference_copy_bytes())
        logp, _ = response_log_probs(role.module, mb, torch.device("cpu"))
        loss = -logp.mean()
        return loss, {"loss": loss.item()}

    def update() -> None:
        train_epochs(role, batch, loss_fn, epochs=1, steps_per_epoch=1, shuffle=torch.Generator().manual_seed(0),
                     max_grad_norm=1.0, device=torch.device("cpu"))

    with mock.patch.object(RoleTraining, "release", lambda self: None) if keep_copy else contextlib.nullcontext():
        update()  # Adam's state and the gradients come to exist: the state every later update starts from
        runs = []
        for _ in range(repeats):
            torch.distributed.barrier()
            before = status_bytes("VmRSS")
            seconds, extra = measured(update)
            runs.append((seconds, before + extra))
    result = {"copy_mib": role.inference_copy_bytes() / MiB, "copy_mib_in_update": seen[-1] / MiB,
              "training_mib": sum(role.memory_bytes().values()) / MiB, "seconds": statistics.median(s for s, _ in runs),
              "peak_rss_mib": max(b for _, b in runs) / MiB}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def update_case(config: dict[str, Any], repeats: int, tmp: Path) -> dict[str, Any]:
    """Each way in a fresh pair of ranks; figures are the worse rank's."""
    out: dict[str, Any] = {"ranks": 2, "rows_per_rank": UPDATE_ROWS, "tokens": UPDATE_PROMPT + UPDATE_RESPONSE}
    for way, keep in (("copy_held", True), ("copy_released", False)):
        ranks = two_ranks(update_rank, (config, repeats, keep), tmp)
        out[way] = {k: max(r[k] for r in ranks) for k in ranks[0]}
    return out


# -- the run --------------------------------------------------------------------------------------------------


def one_case(case: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one case in a fresh interpreter (clean memory), returning its JSON."""
    cmd = [sys.executable, "-m", "benchmarks.weight_sync", "--case", case, "--repeats", str(args.repeats),
           "--bucket-mib", str(args.bucket_mib)] + (["--quick"] if args.quick else [])
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise SystemExit(f"weight_sync case {case} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(results: dict[str, Any]) -> str:
    rows = ["| case | method | sync time (s) | peak extra memory (MiB) |", "|---|---|---:|---:|"]
    for case, label in (("plain", "plain tensors, 1 process"), ("fsdp2", "FSDP2, 2 gloo ranks, tp 2")):
        data = results.get(case)
        if not data:
            continue
        for method in ("full_copy", "bucketed", "bucketed_packed"):
            if method in data:
                m = data[method]
                rows.append(f"| {label} | {method.replace('_', ' ')} | {m['seconds']:.3f} | "
                            f"{m['peak_extra_mib']:.1f} |")
    return "\n".join(rows)


def update_table(update: dict[str, Any]) -> str:
    rows = ["| inference copy during the update | copy in the update (MiB) | training state (MiB) | "
            "update + sync (s) | peak resident set (MiB) |", "|---|---:|---:|---:|---:|"]
    for way, label in (("copy_held", "held"), ("copy_released", "released (`RoleTraining.release`)")):
        m = update[way]
        rows.append(f"| {label} | {m['copy_mib_in_update']:.1f} | {m['training_mib']:.1f} | {m['seconds']:.3f} | "
                    f"{m['peak_rss_mib']:.0f} |")
    return "\n".join(rows)


def update_section(results: dict[str, Any]) -> list[str]:
    update = results.get("update")
    if not update or "error" in update:
        return []
    held, released = update["copy_held"], update["copy_released"]
    return ["", "### The inference copy during a sharded update", "",
            "The same policy in `RoleTraining`'s sharded layout on 2 gloo ranks, through the actor's update loop "
            f"(`train_epochs`: one AdamW step on {update['rows_per_rank']} sequences of {update['tokens']} tokens "
            "per rank, then the sync into the inference copy), once with the copy held through the update and "
            "once released for it and gathered again at its end, as the runtime does. Each way runs in a fresh "
            "pair of processes after one unmeasured update; figures are the worse rank's, the time a median, the "
            "peak the largest resident set of the measured updates (Linux VmHWM).", "",
            update_table(update), "",
            f"Releasing the {held['copy_mib']:.0f} MiB copy lowers the rank's peak by "
            f"{held['peak_rss_mib'] - released['peak_rss_mib']:.0f} MiB; the update and sync took "
            f"{held['seconds']:.2f} s held and {released['seconds']:.2f} s released. The update's "
            "activations and the copy, gathered again one weight at a time after them, no longer take memory at "
            "the same time, so the saving is at most the smaller of the two. Besides them a rank holds its half "
            "of the fp32 weights, gradients and Adam's moments (the training state), and the process's own "
            "(torch, transformers, gloo)."]


def render(results: dict[str, Any]) -> str:
    plain = results["plain"]
    lines = [BEGIN, "## Weight sync: full state-dict copy vs bucketed streaming", "",
             "`make bench-weight-sync` (`python -m benchmarks.weight_sync`) syncs a Llama-shaped policy of "
             f"{plain['model_mib']:.0f} MiB (fp32) into its generation copy, with {results['bucket_mib']} MiB "
             "buckets; each case runs in a fresh process. Packed is the vLLM path's wire format: each bucket "
             "also copied into one byte buffer and viewed back. Peak extra memory is the process's peak resident set "
             "during the sync minus its resident set before it (Linux VmHWM); times are medians of "
             f"{results['repeats']} syncs. In the FSDP2 case each rank holds half the policy and loads its "
             "tensor-parallel half into its own generation slices; figures are the worse of the two ranks.", "",
             f"Generated on {results['generated']}; {results['machine']}.", "", table(results), "",
             "A full copy costs a second policy in memory (on every rank, under FSDP2); a bucket stream costs "
             "one bucket, whatever the model's size. Here the largest weight, the "
             f"{plain['largest_weight_mib']:.1f} MiB embedding, is larger than a bucket and travels alone, so it "
             "sets the bucketed peak; under FSDP2 its gather (the shards and the whole tensor) comes on top.",
             *update_section(results), END]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bucket-mib", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="a small model; results under runs/ only")
    ap.add_argument("--case", choices=["plain", "fsdp2", "update"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    config = QUICK_CONFIG if args.quick else CONFIG
    bucket_bytes = args.bucket_mib * MiB
    if args.case == "plain":
        print(json.dumps(plain_case(config, args.repeats, bucket_bytes)))
        return
    if args.case in ("fsdp2", "update"):
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            result = (fsdp_case(config, args.repeats, bucket_bytes, Path(tmp)) if args.case == "fsdp2"
                      else update_case(config, args.repeats, Path(tmp)))
        print(json.dumps(result))
        return
    results: dict[str, Any] = {
        "generated": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), "repeats": args.repeats,
        "bucket_mib": args.bucket_mib, "config": config,
        "machine": f"{os.cpu_count()} CPUs, torch {torch.__version__}, {platform.machine()}",
    }
    results["plain"] = one_case("plain", args)
    for case in ("fsdp2", "update"):
        try:
            results[case] = one_case(case, args)
        except SystemExit as e:
            results[case] = {"error": str(e)[-500:]}
    text = json.dumps(results, indent=1)
    print(table(results))
    if args.quick:
        out = ROOT / "runs" / "weight_sync.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(text + "\n")
        return
    RESULTS.write_text(text + "\n")
    write_section(README, BEGIN, END, render(results))


if __name__ == "__main__":
    main()
