#!/usr/bin/env bash
# Build (once) the virtual environment in which tests/test_algos_oracle.py runs verl's reference implementations:
# Python 3.11, torch (CPU wheels when download.pytorch.org answers, else PyPI's), verl without its dependencies and
# only what `verl.trainer.ppo.core_algos` imports. hybridflow never depends on verl; only this test reads it.
#
#   bash tests/oracle/setup-verl-oracle.sh      # prints the environment's python
#
# The environment lives outside the repo, in $HYBRIDFLOW_CACHE/verl-oracle-<verl version>; a finished one is
# reused (its stamp records the requirements it was built from), so a second run takes a second.
set -euo pipefail

VERL_VERSION="${VERL_VERSION:-0.9.1}"
# What verl/__init__.py and core_algos.py import at this version (verl's protocol module imports ray).
REQUIREMENTS=(numpy omegaconf packaging tensordict transformers ray codetiming orjson)
CACHE="${HYBRIDFLOW_CACHE:-$HOME/.cache/hybridflow}"
ENV_DIR="$CACHE/verl-oracle-$VERL_VERSION"
WANT="verl==$VERL_VERSION torch ${REQUIREMENTS[*]}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=../../scripts/cached-env.sh
source "$REPO/scripts/cached-env.sh"
# The CPU wheels are a tenth of the size; PyPI's torch works as well where that index is unreachable.
"$UV" pip install -q --python "$PY" torch --index-url https://download.pytorch.org/whl/cpu >&2 \
  || "$UV" pip install -q --python "$PY" torch >&2
"$UV" pip install -q --python "$PY" "${REQUIREMENTS[@]}" >&2
"$UV" pip install -q --python "$PY" --no-deps "verl==$VERL_VERSION" >&2
# Run from the environment's directory: a cwd holding a ray/ or verl/ folder (Ray's /tmp/ray) would shadow them.
(cd "$ENV_DIR" && "$PY" -c "import verl.trainer.ppo.core_algos") >&2
env_built
