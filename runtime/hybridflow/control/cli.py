"""`hybridflow ctl status|scale|disable-ulysses`: the live API of a running job, from a shell."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hybridflow.control.client import DEFAULT_TIMEOUT_S, JobHandle, connect
from hybridflow.control.errors import ControlError

RECENT_DECISIONS = 10


def add_parser(sub: Any) -> None:
    """Register `ctl` and its subcommands on the main parser's subparsers."""
    ctl = sub.add_parser("ctl", help="see and steer a running job through its named controller")
    verbs = ctl.add_subparsers(dest="verb", required=True)
    status = verbs.add_parser("status", help="step, nodes and their parallelism, edges, recent decisions")
    _common(status)
    status.add_argument("--json", action="store_true", help="the whole status as JSON")
    status.set_defaults(fn=cmd_status)
    scale = verbs.add_parser("scale", help="set a node's parallelism at the job's next step boundary")
    _common(scale)
    scale.add_argument("node")
    scale.add_argument("n", type=int, metavar="N")
    scale.add_argument("--reason", default="", help="logged with the decision")
    scale.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                       help="seconds to wait for a step boundary (default: %(default)g)")
    scale.set_defaults(fn=cmd_scale)
    ulysses = verbs.add_parser("disable-ulysses", help="turn sequence parallelism (actor and critic) off at the "
                               "next step boundary (their ranks go on over whole sequences)")
    _common(ulysses)
    ulysses.add_argument("--reason", default="", help="logged with the decision")
    ulysses.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                         help="seconds to wait for a step boundary (default: %(default)g)")
    ulysses.set_defaults(fn=cmd_disable_ulysses)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", help="NAME or NAMESPACE/NAME of the RLTrainingJob")
    p.add_argument("--address", help="the Ray cluster (default: $RAY_ADDRESS, else auto)")
    p.add_argument("--namespace", "-n", help="the job's Kubernetes namespace (default: default)")


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 1


def cmd_status(args: argparse.Namespace) -> int:
    try:
        status = connect(args.job, args.address, args.namespace).scheduler.get_status()
    except ControlError as e:
        return _fail(str(e))
    print(json.dumps(status, indent=1, sort_keys=True) if args.json else render_status(status))
    return 0


def cmd_scale(args: argparse.Namespace) -> int:
    try:
        handle: JobHandle = connect(args.job, args.address, args.namespace, timeout_s=args.timeout)
        out = handle.scale(args.node, args.n, args.reason)
    except ControlError as e:
        return _fail(str(e))
    also = f" (with co-located {', '.join(out['colocated'])})" if out["colocated"] else ""
    print(f"{handle.ref}: {out['node']} parallelism {out['old']} -> {out['parallelism']}{also}")
    return 0


def cmd_disable_ulysses(args: argparse.Namespace) -> int:
    try:
        handle: JobHandle = connect(args.job, args.address, args.namespace, timeout_s=args.timeout)
        out = handle.disable_ulysses(args.reason)
    except ControlError as e:
        return _fail(str(e))
    for change in out["changes"]:
        print(f"{handle.ref}: {change['node']} sequence parallelism {change['old']} -> off "
              f"({change['ranks']} data-parallel ranks over whole sequences)")
    return 0


def render_status(status: dict[str, Any]) -> str:
    """The status for a terminal: one line per node and edge, the last decisions."""
    targets = status.get("manual", {}).get("targets", {})
    lines = [f"job {status['job']}  step {status['step']}/{status['total_steps']}", "nodes:"]
    width = max((len(n) for n in status["nodes"]), default=4)
    lines.append(f"  {'NODE':<{width}}  PARALLELISM  PLANNED  QUEUE  GROUP")
    for name, node in status["nodes"].items():
        manual = f" (manual {targets[name]})" if name in targets else ""
        lines.append(f"  {name:<{width}}  {node['parallelism']:>11}  {node['planned_parallelism']:>7}  "
                     f"{node['queue_len']:>5}  {node['group']}{manual}")
    lines.append("edges:" if status["edges"] else "edges: none (every step runs in the actor's hosts)")
    for key, edge in status["edges"].items():
        lat = edge["latency"]
        queued = edge.get("backlog", edge["queue_len"])  # sequences, the watermark's unit
        lines.append(f"  {key}  queue {queued}/{edge['high_watermark']}  transfers {lat['count']}  "
                     f"latency mean {lat['mean_s']:.3f}s p95 {lat['p95_s']:.3f}s")
    for key, edge in status["control_edges"].items():
        lines.append(f"  {key}  control, {edge['consistency']}  weight syncs {edge['syncs']}  policy version "
                     f"{edge['policy_version']}  lag {edge['policy_lag']} (max {edge['policy_lag_max']})  "
                     f"sync mean {edge['latency']['mean_s']:.3f}s  {edge['bytes_last']} bytes")
    decisions = status["decisions"]
    lines.append(f"decisions (last {min(RECENT_DECISIONS, len(decisions))} of {len(decisions)}):")
    lines += [f"  {d}" for d in decisions[-RECENT_DECISIONS:]]
    return "\n".join(lines)
