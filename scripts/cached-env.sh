# What the scripts that build a virtual environment of their own under $HYBRIDFLOW_CACHE share
# (scripts/setup-vllm-cpu.sh, tests/oracle/setup-verl-oracle.sh). Source it with REPO, ENV_DIR and WANT set (WANT:
# the requirements the environment is built from). One build at a time: a lock next to ENV_DIR is held until the
# sourcing script exits. When ENV_DIR's stamp records WANT, it prints the environment's python and exits; otherwise
# it leaves a fresh venv in ENV_DIR and sets PY and UV, and the script installs with them, then runs `env_built`.
# shellcheck shell=bash

PY="$ENV_DIR/bin/python"
STAMP="$ENV_DIR/.hybridflow-stamp"
mkdir -p "$(dirname "$ENV_DIR")"
exec 9>"$ENV_DIR.lock"
flock 9
if [[ -x "$PY" && -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
  echo "$PY"
  exit 0
fi

UV="${UV:-$(command -v uv || true)}"
[[ -n "$UV" ]] || UV="$REPO/.venv/bin/uv"
[[ -x "$UV" ]] || { echo "uv not found: install it or run 'make venv' (which puts uv in .venv/bin)" >&2; exit 1; }
rm -rf "$ENV_DIR"
"$UV" venv -q --python 3.11 "$ENV_DIR" >&2

env_built() {
  echo "$WANT" > "$STAMP"
  echo "$PY"
}
