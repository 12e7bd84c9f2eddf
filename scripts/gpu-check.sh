#!/usr/bin/env bash
# The GPU-only paths in one run (benchmarks/gpu_check.py): FSDP2 mixed precision, fp32 masters and DCP,
# resharding into the torch rollout, a one-rank NCCL group, Ulysses, a 1.78B policy's step and weight sync,
# the fused step loop strong and eventual, and vLLM's bucketed weight load. Writes $OUT/gpu-check.json.
#
#   scripts/gpu-check.sh                  on a GPU machine (OUT defaults to ./runs)
#   scripts/gpu-check.sh --cpu            the CPU-possible parts
#   VLLM_INSTALL_SECONDS=300 scripts/gpu-check.sh   try `pip install vllm` first when it is missing
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$root/runs}"
mkdir -p "$OUT"
python="${PYTHON:-$(command -v python3 || command -v python)}"
export PYTHONPATH="$root/runtime:$root/operator:$root${PYTHONPATH:+:$PYTHONPATH}"
cd "$root"
exec "$python" -m benchmarks.gpu_check --out "$OUT/gpu-check.json" \
  --install-vllm "${VLLM_INSTALL_SECONDS:-0}" "$@"
