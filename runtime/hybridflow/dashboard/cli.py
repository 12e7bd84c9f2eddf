"""`hybridflow dashboard [JOB] [--metrics PATH]`: the live page of a running job or a local run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

DEFAULT_PORT = 8700


def add_parser(sub: Any) -> None:
    p = sub.add_parser("dashboard", help="serve the live scheduler dashboard of a running job or a local run")
    p.add_argument("job", nargs="?", help="NAME or NAMESPACE/NAME of a running RLTrainingJob (its controller "
                                          "gives the graph, placement, memory, edges and decisions)")
    p.add_argument("--metrics", type=Path, help="the run's metrics.jsonl (curves and step times; with JOB, read "
                                                "here instead of through the controller)")
    p.add_argument("--address", help="the Ray cluster of JOB (default: $RAY_ADDRESS, else auto)")
    p.add_argument("--namespace", "-n", help="the job's Kubernetes namespace (default: default)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 on a Ray head pod)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help="port to listen on; the next free one when busy, 0 for any (default: %(default)d)")
    p.add_argument("--refresh", type=float, default=2.0, help="seconds between page updates (default: %(default)g)")
    p.set_defaults(fn=cmd_dashboard)


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 1


def cmd_dashboard(args: argparse.Namespace) -> int:
    from hybridflow.control.errors import ControlError
    from hybridflow.dashboard.feed import Feed
    from hybridflow.dashboard.server import DashboardError, bind, url_of

    if args.job is None and args.metrics is None:
        return _fail("nothing to show: pass JOB (a running job), --metrics PATH (a run's metrics.jsonl), or both")
    if args.metrics is not None and not args.metrics.is_file():
        return _fail(f"no metrics file at {args.metrics}")
    if args.refresh <= 0:
        return _fail(f"--refresh must be positive, got {args.refresh:g}")
    handle = None
    if args.job is not None:
        from hybridflow.control.client import connect

        try:
            handle = connect(args.job, args.address, args.namespace)
        except ControlError as e:
            return _fail(str(e))
    title = str(handle.ref) if handle is not None else str(args.metrics.parent.name or args.metrics)
    feed = Feed(args.metrics, handle, title)
    try:
        server = bind(feed, args.host, args.port, args.refresh)
    except DashboardError as e:
        return _fail(str(e))
    print(f"dashboard of {title} at {url_of(server)} (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
