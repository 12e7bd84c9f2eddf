# Runtime benchmark (included from the top-level Makefile).
#
#   make bench-runtime                      hybridflow vs a naive Ray loop vs TRL's GRPOTrainer on the tiny
#                                           GRPO job (~6 minutes on 2 cores): benchmarks/results/runtime.json,
#                                           runtime.png and the table in benchmarks/README.md
#   make bench-runtime BENCH_ARGS=--quick   smoke run, 4 steps, outputs under runs/ only
#   make bench-runtime BENCH_ARGS=--render  redraw runtime.png and the README section from runtime.json
#                                           (prose: benchmarks/templates/runtime.md)
#   make bench-weight-sync                  full state-dict copy vs bucketed streaming after an update, plain
#                                           and FSDP2 on 2 gloo ranks, and the sharded update's peak memory
#                                           with the inference copy held or released (~2 minutes):
#                                           results/weight_sync.json
#   make bench-offpolicy                    strong vs eventual consistency (one-step off-policy pipelining) on a
#                                           three-raylet local cluster, both workloads (~6 minutes):
#                                           results/offpolicy.json, offpolicy.png
#   make bench-dispatch                     a remote step's micro-batches dispatched streamed vs serially across
#                                           raylets: does the next transfer overlap the current compute (~1
#                                           minute): results/dispatch.json, dispatch.png
#   make bench-passes                       reference log-probs and an update over rows in length order and
#                                           trimmed vs padded rows in batch order, at rollout lengths, and
#                                           the LM head on the response positions vs every position, and a
#                                           group's prompt run once vs every row whole (~5 minutes):
#                                           results/passes.json, passes.png

BENCH_ARGS ?=

.PHONY: bench-runtime bench-weight-sync bench-offpolicy bench-dispatch bench-passes

bench-runtime: venv
	$(PYTHON) -m benchmarks.runtime $(BENCH_ARGS)

bench-weight-sync: venv
	$(PYTHON) -m benchmarks.weight_sync

bench-offpolicy: venv
	$(PYTHON) -m benchmarks.offpolicy $(BENCH_ARGS)

bench-dispatch: venv
	$(PYTHON) -m benchmarks.dispatch

bench-passes: venv
	$(PYTHON) -m benchmarks.passes
