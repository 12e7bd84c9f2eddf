# Operator benchmark (included from the top-level Makefile).
#
#   make bench-operator                 N = 100 and 500 RLTrainingJobs at once on the kwok control plane, against
#                                       the same RayJobs given to KubeRay alone: benchmarks/results/operator.json
#                                       (every pair of phases, results format 1), operator.png and the operator
#                                       section of benchmarks/README.md (prose: benchmarks/templates/operator.md)
#   make bench-operator BENCH_OPERATOR_ARGS=--quick    N = 10 and 20, outputs under runs/bench-operator only
#   make bench-operator BENCH_OPERATOR_ARGS=--render   redraw the plot and README section from operator.json
#   make bench-operator BENCH_OPERATOR_ARGS="--render --previous OLD.json"   ... with previous_design from OLD.json
#
# Needs the control-plane binaries of e2e/ (built on first use when Go is installed: `make toolchain`).

BENCH_OPERATOR_ARGS ?=

.PHONY: bench-operator

# --render only reads operator.json: it needs no control plane.
bench-operator: venv $(if $(filter --render,$(BENCH_OPERATOR_ARGS)),,toolchain)
	$(PYTHON) -m benchmarks.operator $(BENCH_OPERATOR_ARGS)
