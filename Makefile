# hybridflow: `make run` trains the tiny model locally; `make test` runs the whole suite.
# Heavy builds (the Kubernetes binaries) and downloads live in $(HYBRIDFLOW_CACHE), outside the repo.

VENV ?= .venv
PYTHON := $(VENV)/bin/python
HYBRIDFLOW_CACHE ?= $(HOME)/.cache/hybridflow
export HYBRIDFLOW_CACHE
PYTEST_ARGS ?=

.PHONY: all venv run run-grpo test lint unit e2e e2e-kind toolchain cluster-up cluster-down bench clean

all: test

# The venv is rebuilt when pyproject.toml changes; uv's download cache (~/.cache/uv) makes that quick.
$(VENV)/.installed: pyproject.toml
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check uv
	$(VENV)/bin/uv pip install -q --python $(PYTHON) -e '.[runtime,operator,dev]'
	touch $@

venv: $(VENV)/.installed

run: venv
	$(PYTHON) -m hybridflow run examples/tiny-ppo.yaml

run-grpo: venv
	$(PYTHON) -m hybridflow run examples/tiny-grpo.yaml

lint: venv
	$(PYTHON) -m ruff check .
	$(PYTHON) -m hybridflow.api.crd --check

# Everything: unit, real Ray, and the control-plane tests (built from Go modules on first use).
test: lint
	$(PYTHON) -m pytest -q -ra $(PYTEST_ARGS)

unit: venv
	$(PYTHON) -m pytest -q -ra tests $(PYTEST_ARGS)

toolchain:
	bash e2e/toolchain/build.sh

e2e: venv toolchain
	$(PYTHON) -m pytest -q -ra e2e $(PYTEST_ARGS)

e2e-kind: venv
	bash e2e/kind/run.sh

cluster-up: venv toolchain
	$(PYTHON) -m e2e.harness up --full

cluster-down: venv
	$(PYTHON) -m e2e.harness down

clean:
	rm -rf runs .pytest_cache .ruff_cache

-include mk/crds.mk
-include mk/bench.mk
-include mk/bench-operator.mk

# Side-by-side benchmarks; results land in benchmarks/results and the tables in benchmarks/README.md.
bench: venv toolchain bench-runtime bench-operator
