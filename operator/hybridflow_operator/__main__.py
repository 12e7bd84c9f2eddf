"""`hybridflow-operator`: run the operator (kopf) with settings from the environment and flags.

The console script and `python -m hybridflow_operator` (what the chart's Deployment runs) are the same.
Flags override the HYBRIDFLOW_* environment variables of the same meaning: both are read by one
parser (settings.from_env), and the settings reach the handlers through kopf's memo.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import sys
from collections.abc import Sequence

import kopf
import uvloop

from hybridflow_operator import __version__, lifecycle
from hybridflow_operator.metrics import OperatorMetrics
from hybridflow_operator.settings import SettingsError, from_env

DEFAULT_LIVENESS = "http://0.0.0.0:8080/healthz"
YOUNG_GENERATION = 10_000  # objects allocated between two collections of the youngest generation (CPython: 700)
FLAG_ENV = {
    "namespaces": "HYBRIDFLOW_WATCH_NAMESPACES",
    "log_level": "HYBRIDFLOW_LOG_LEVEL",
    "event_level": "HYBRIDFLOW_EVENT_LEVEL",
    "gpu_products": "HYBRIDFLOW_GPU_PRODUCTS",
    "runtime_image": "HYBRIDFLOW_RUNTIME_IMAGE",
    "status_interval": "HYBRIDFLOW_STATUS_INTERVAL",
    "metrics_port": "HYBRIDFLOW_METRICS_PORT",
}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hybridflow-operator", description=__doc__.splitlines()[0])
    p.add_argument("--namespaces", help="comma-separated namespaces to watch (default: cluster-wide)")
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR")
    p.add_argument("--event-level", help="lowest level posted as Kubernetes Events (INFO or WARNING)")
    p.add_argument("--gpu-products", help="JSON/YAML mapping gpuType -> nvidia.com/gpu.product values")
    p.add_argument("--runtime-image", help="image of the Ray pods when spec.cluster.image is empty")
    p.add_argument("--status-interval", help="seconds between safety-net resyncs")
    p.add_argument("--metrics-port", help="port of the Prometheus /metrics endpoint (default 8081; 0 disables)")
    p.add_argument("--standalone", action="store_true",
                   help="accepted for clarity: the operator always runs standalone (one replica, no peering)")
    p.add_argument("--version", action="version", version=f"hybridflow-operator {__version__}")
    p.add_argument("--liveness", default=os.environ.get("HYBRIDFLOW_LIVENESS", DEFAULT_LIVENESS),
                   help=f"kopf liveness endpoint (default {DEFAULT_LIVENESS}; empty disables)")
    return p.parse_args(argv)


def tune_gc() -> None:
    """Cheaper garbage collection for a long-lived process that allocates in bursts.

    What the imports made (kopf, pydantic models, the Kubernetes client) lives as long as the process:
    frozen, a full collection no longer walks it. A larger youngest generation lets most of a burst's
    short-lived objects die by reference count before a collection scans them.
    """
    gc.collect()
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_GENERATION, middle, oldest)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    flags = {env: getattr(args, attr) for attr, env in FLAG_ENV.items() if getattr(args, attr) is not None}
    try:
        settings = from_env({**os.environ, **flags})
    except SettingsError as e:
        print(f"hybridflow-operator: {e}", file=sys.stderr)
        return 2
    kopf.configure(debug=settings.log_level == "DEBUG")
    logging.getLogger().setLevel(settings.log_level_number)
    metrics = OperatorMetrics()
    if settings.metrics_port:
        try:
            metrics.serve(settings.metrics_port)
        except OSError as e:
            print(f"hybridflow-operator: cannot serve /metrics on port {settings.metrics_port}: {e}", file=sys.stderr)
            return 2
    tune_gc()

    operator = kopf.operator(
        registry=lifecycle.registry(),
        memo=kopf.Memo(settings=settings, metrics=metrics),
        clusterwide=settings.clusterwide,
        namespaces=settings.watch_namespaces,
        liveness_endpoint=args.liveness or None,
        standalone=True,  # one replica (Deployment strategy Recreate); no peering CRD needed
    )
    # uvloop, as `kopf run` picks it when installed: every watch stream and request goes through the loop
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner, contextlib.suppress(asyncio.CancelledError):
        runner.run(operator)
    return 0


if __name__ == "__main__":
    sys.exit(main())
