# The reliability campaign (included from the top-level Makefile).
#
#   make chaos                            everything at full size: 20 worker and 10 controller SIGKILL runs, a
#                                         checkpoint write that fills its tmpfs, 20 operator-kill rounds of 50
#                                         jobs, API server / etcd restarts and an expired watch, foreign edits,
#                                         2,000 fuzzed specs per property, the security tests; writes
#                                         benchmarks/results/reliability.json, .png and the README's table
#   make chaos CHAOS_ARGS=--quick         a few of each, outputs under runs/chaos only
#   make chaos CHAOS_ARGS="--parts fuzz"  some parts, outputs under runs/chaos only
#
# Root (a tmpfs mount); needs the control-plane binaries of e2e/ (built on first use: `make toolchain`).
# The fast subset runs in `make test`: tests/test_runtime_faults.py, e2e/test_operator_faults.py and
# tests/test_fuzz_spec.py at a few hundred examples.

CHAOS_ARGS ?=

.PHONY: chaos

chaos: venv toolchain
	$(PYTHON) -m benchmarks.chaos $(CHAOS_ARGS)
