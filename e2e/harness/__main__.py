"""Command line: python -m e2e.harness up [--full | --real-nodes] [--state-dir DIR] | down | status | build.

`up` starts a control plane whose processes outlive the command and records them in
<state-dir>/state.json; `down` stops them. `--real-nodes` (root) adds a real kubelet node that doubles as an
A100 node, the images of `make images`, the chart's operator from its image, and a `checkpoints` claim in the
default namespace: `kubectl apply -f examples/tiny-ppo-job.yaml` then trains in real pods.
Default state dir: ${HYBRIDFLOW_CACHE:-~/.cache/hybridflow}/cluster.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from . import binaries, images, realcluster
from .controlplane import ControlPlane, Process, StartupError
from .nodes import NodeSetupError

REPO_CRDS = Path(__file__).resolve().parents[2] / "crds"


def default_state_dir() -> Path:
    return binaries.cache_dir() / "cluster"


def _state_file(state_dir: Path) -> Path:
    return state_dir / "state.json"


def read_state(state_dir: Path) -> dict[str, Any] | None:
    """The recorded state of a detached control plane, if any."""
    path = _state_file(state_dir)
    return json.loads(path.read_text()) if path.is_file() else None


def running_processes(state: dict[str, Any]) -> list[str]:
    """Names of recorded processes that are still alive (pid and executable both match)."""
    entries = state["processes"] if "processes" in state else [
        *state["control_plane"]["processes"], *state["node"]["processes"]]
    procs = [Process(p["name"], int(p["pid"]), list(p["argv"]), Path(p["log"])) for p in entries]
    return [p.name for p in procs if p.running()]


def cmd_up(args: argparse.Namespace) -> int:
    state_dir: Path = args.state_dir
    previous = read_state(state_dir)
    if previous and running_processes(previous):
        print(f"already up: KUBECONFIG={previous['kubeconfig']} (run `down` first)", file=sys.stderr)
        return 1
    work_dir = state_dir / "run"
    if args.real_nodes:
        return _up_real_nodes(work_dir, state_dir)
    shutil.rmtree(work_dir, ignore_errors=True)
    crd_dirs = args.crds if args.crds is not None else ([REPO_CRDS] if REPO_CRDS.is_dir() else [])
    t0 = time.monotonic()
    cp = ControlPlane(full=args.full, work_dir=work_dir, crd_dirs=crd_dirs, detach=True, timeout=args.timeout)
    cp.start()
    try:
        if args.full and not args.no_fleet:
            cp.create_gpu_fleet()
    except BaseException:
        cp.stop()
        raise
    state = cp.state() | {"started_s": round(time.monotonic() - t0, 1)}
    _state_file(state_dir).write_text(json.dumps(state, indent=2))
    print(f"control plane up in {state['started_s']}s ({'full' if args.full else 'minimal'}); pids {cp.pids()}")
    print("timings (s from start): " + ", ".join(f"{k} {v:.1f}" for k, v in cp.timings.items()))
    print(f"export KUBECONFIG={cp.kubeconfig}")
    return 0


def _up_real_nodes(work_dir: Path, state_dir: Path) -> int:
    t0 = time.monotonic()
    try:
        cluster = realcluster.up_for_users(work_dir)
    except (NodeSetupError, StartupError, images.ImageError) as exc:
        print(f"real-node cluster did not start: {exc}", file=sys.stderr)
        return 1
    state = cluster.state() | {"started_s": round(time.monotonic() - t0, 1)}
    _state_file(state_dir).write_text(json.dumps(state, indent=2))
    print(f"real-node cluster up in {state['started_s']}s: node {cluster.node_name} (A100 x8, fake), "
          f"the operator from its image, claim default/checkpoints")
    print("try: kubectl apply -f examples/tiny-ppo-job.yaml && kubectl get rlj -w")
    print(f"export KUBECONFIG={cluster.kubeconfig}")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    state = read_state(args.state_dir)
    if state is None:
        print(f"nothing to stop: no {_state_file(args.state_dir)}")
        return 0
    if state.get("kind") == "real-nodes":
        problems = realcluster.RealNodeCluster.stop_from_state(state)
        _state_file(args.state_dir).unlink(missing_ok=True)
        print("stopped the real-node cluster; host state restored" + (f" except: {problems}" if problems else ""))
        return 1 if problems else 0
    stopped = ControlPlane.stop_from_state(state, remove_work_dir=True)
    _state_file(args.state_dir).unlink(missing_ok=True)
    print(f"stopped: {', '.join(stopped) or 'nothing was running'}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    state = read_state(args.state_dir)
    if state is None:
        print("down")
        return 1
    alive = running_processes(state)
    print(f"{'up' if alive else 'dead'}: running {alive}; KUBECONFIG={state['kubeconfig']}")
    return 0 if alive else 1


def cmd_build(args: argparse.Namespace) -> int:
    unknown = sorted(set(args.components) - set(binaries.COMPONENTS))
    if unknown:
        print(f"unknown component(s): {', '.join(unknown)}", file=sys.stderr)
        return 2
    binaries.build(args.components)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m e2e.harness", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    state = argparse.ArgumentParser(add_help=False)
    state.add_argument("--state-dir", type=Path, default=default_state_dir())

    up = sub.add_parser("up", parents=[state], help="start a control plane that keeps running")
    tier = up.add_mutually_exclusive_group()
    tier.add_argument("--full", action="store_true", help="controller-manager, scheduler, kwok, KubeRay too")
    tier.add_argument("--real-nodes", action="store_true",
                      help="--full plus a real kubelet node (root), the images and the chart's operator")
    up.add_argument("--no-fleet", action="store_true", help="with --full: do not create the fake GPU nodes")
    up.add_argument("--crds", type=Path, nargs="*", help=f"CRD directories to install (default: {REPO_CRDS})")
    up.add_argument("--timeout", type=float, default=120.0, help="seconds each component may take to start")
    up.set_defaults(func=cmd_up)
    sub.add_parser("down", parents=[state], help="stop it").set_defaults(func=cmd_down)
    sub.add_parser("status", parents=[state], help="is it running?").set_defaults(func=cmd_status)
    build = sub.add_parser("build", help="build missing binaries with e2e/toolchain/build.sh")
    build.add_argument("components", nargs="*", help=f"any of {', '.join(binaries.COMPONENTS)} (default: all)")
    build.set_defaults(func=cmd_build)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if hasattr(args, "state_dir"):
        args.state_dir = args.state_dir.expanduser()
        args.state_dir.mkdir(parents=True, exist_ok=True)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
