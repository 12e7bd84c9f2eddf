"""hybridflow run | train | validate | render | export | ctl | dashboard | completion."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from hybridflow._version import __version__
from hybridflow.api import RLTrainingJob, SpecError, load_job
from hybridflow.api.load import STDIN
from hybridflow.k8s import contract
from hybridflow.metrics import step_records


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 1


def cmd_validate(args: argparse.Namespace) -> int:
    bad = 0
    for path in args.files:
        try:
            job = load_job(path)
        except SpecError as e:
            print(e.render(), file=sys.stderr)
            bad += 1
            continue
        name = "<stdin>" if path == STDIN else path
        problems = _graph_problems(job) + _hub_problems(job)
        if problems:
            print(SpecError(name, problems).render(), file=sys.stderr)
            bad += 1
        else:
            print(f"{name}: valid {job.spec.algorithm.name} job {job.metadata.name!r}")
    return 1 if bad else 0


def _graph_problems(job: RLTrainingJob) -> list[str]:
    from hybridflow.plan import graph_problems

    return graph_problems(job.spec, "GPU")


def _hub_problems(job: RLTrainingJob) -> list[str]:
    """Hub names that are neither in the local cache nor known to the Hub (none asked when HF_HUB_OFFLINE)."""
    from hybridflow.hub import hub_problems

    return hub_problems(job.spec)


def cmd_render(args: argparse.Namespace) -> int:
    try:
        job = load_job(args.file)
    except SpecError as e:
        print(e.render(), file=sys.stderr)
        return 1
    from hybridflow.k8s.errors import RenderError
    from hybridflow.k8s.render import render_manifests
    from hybridflow.k8s.settings import RenderSettings, SettingsError

    try:
        sys.stdout.write(render_manifests(job, RenderSettings.from_env()))
    except (RenderError, SettingsError) as e:
        return _fail(str(e))
    return 0


def default_metrics_path(job: RLTrainingJob, local: bool) -> str:
    """runs/<name>/ on a laptop; in a cluster, next to the checkpoints: the driver's working directory dies with
    its pod, the checkpoint volume outlives the job (and a resumed run appends to the same file)."""
    if local:
        return str(Path("runs") / job.metadata.name / "metrics.jsonl")
    return str(Path(job.spec.trainer.checkpoint.path) / "metrics.jsonl")


def _train(args: argparse.Namespace, config: str, local: bool) -> int:
    try:
        job = load_job(config)
    except SpecError as e:
        print(e.render(), file=sys.stderr)
        return 1
    if getattr(args, "steps", None):
        job.spec.trainer.total_steps, job.spec.trainer.total_epochs = args.steps, None
    from hybridflow.driver import TrainingFailed, init_ray, run_training
    from hybridflow.preflight import preflight

    init_ray(local, getattr(args, "num_cpus", None))
    import ray

    gpus = ray.cluster_resources().get("GPU", 0)
    accelerator = "GPU" if gpus > 0 else "CPU"
    if local and accelerator == "GPU":
        _fit_local_gpus(job, gpus)
    problems = preflight(job.spec, accelerator)
    if problems:
        print(SpecError(config, problems).render(), file=sys.stderr)
        return 1
    from hybridflow.hub import pin_sources

    job.spec = pin_sources(job.spec)  # fetched by preflight: the controller and workers open these commits
    metrics_out = args.metrics_out or default_metrics_path(job, local)
    if contract.job_from_env() is not None:  # a pod of the job: the driver, on the Ray head, serves the live page
        _serve_dashboard(job, getattr(args, "dashboard_port", contract.DASHBOARD_PORT))
    from hybridflow.trackers import TrackerSet, namespaced, open_trackers

    console = TrackerSet({}) if args.quiet else open_trackers(job, ("console",))

    def on_progress(progress: dict[str, Any]) -> None:
        console.log(int(progress.get("step", 0)), namespaced(progress))

    t0 = time.perf_counter()
    try:
        result = run_training(job, metrics_out, on_progress)
    except TrainingFailed as e:
        console.close()
        return _fail(str(e))
    except Exception as e:  # placement and other plan errors carry their own message
        console.close()
        from hybridflow.ray_errors import innermost_message

        return _fail(innermost_message(e))
    console.close()
    written = metrics_out if "jsonl" in job.spec.trainer.loggers.backends else None
    _summarise(result, written, time.perf_counter() - t0)
    return 0


def _fit_local_gpus(job: RLTrainingJob, gpus: float) -> None:
    """On a machine with fewer GPUs than the built-in graph asks for, the critic takes a share of the actor's
    GPU (graph.graph_for_gpus)."""
    from hybridflow.graph import builtin_graph, gpus_needed, graph_for_gpus

    compact = graph_for_gpus(job.spec, gpus)
    if compact is not None:
        print(f"the critic shares the actor's GPU: the built-in {job.spec.algorithm.name} graph needs "
              f"{gpus_needed(builtin_graph(job.spec, 'GPU')):g} GPUs and this machine has {gpus:g}", flush=True)
        job.spec.graph = compact.to_spec()


def _serve_dashboard(job: RLTrainingJob, port: int) -> None:
    from hybridflow.control.names import job_ref
    from hybridflow.dashboard.head import serve_on_head

    ref = job_ref(job.metadata.name, job.metadata.namespace)
    server = serve_on_head(ref, port)
    if server is not None:
        print(f"scheduler dashboard of {ref} on port {server.server_address[1]}", flush=True)


def _summarise(result: dict[str, Any], metrics_out: str | None, seconds: float) -> None:
    recs = step_records(result["records"])
    if not recs:
        print(f"nothing to do: already at step {result['steps']}")
        return
    first, last = recs[0], recs[-1]
    window = recs[-5:]
    end_reward = sum(r["reward_mean"] for r in window) / len(window)
    val = [r["val/reward_mean"] for r in result["records"] if "val/reward_mean" in r]
    print(json.dumps({
        "steps": result["steps"], "wall_s": round(seconds, 1),
        "reward_start": round(first["reward_mean"], 4), "reward_end": round(end_reward, 4),
        "reward_last": round(last["reward_mean"], 4),
        **({"val_reward_first": round(val[0], 4), "val_reward_last": round(val[-1], 4)} if val else {}),
        "metrics": metrics_out, "plot": result["plot"],
        "report": result.get("report"), "export": result.get("export"),
        "recoveries": result["recoveries"],
    }))


def cmd_run(args: argparse.Namespace) -> int:
    return _train(args, args.file, local=True)


def cmd_train(args: argparse.Namespace) -> int:
    if not args.config:
        return _fail(f"no job to train: pass --config FILE or set {contract.ENV_CONFIG} "
                     "(the operator sets it in every Ray pod)")
    return _train(args, args.config, local=args.local)


def cmd_export(args: argparse.Namespace) -> int:
    from hybridflow.export import ExportError, export_checkpoint
    from hybridflow.workers.modeling import quiet_transformers

    quiet_transformers()
    try:
        done = export_checkpoint(args.checkpoint, args.to, args.adapters, args.config, args.overwrite)
    except ExportError as e:
        return _fail(str(e))
    print(json.dumps(done.summary()))
    return 0


def cmd_completion(args: argparse.Namespace) -> int:
    from hybridflow.completion import script

    sys.stdout.write(script(build_parser(), args.shell))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hybridflow", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--version", action="version", version=f"hybridflow {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train locally on in-process Ray (the embedded default)")
    run.add_argument("file")
    run.add_argument("--metrics-out")
    run.add_argument("--steps", type=int, help="override spec.trainer.totalSteps (and totalEpochs)")
    run.add_argument("--num-cpus", type=int, help="logical CPUs for local Ray")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.set_defaults(fn=cmd_run)
    train = sub.add_parser("train", help="the cluster entrypoint: join the running Ray cluster")
    train.add_argument("--config", default=os.environ.get(contract.ENV_CONFIG),
                       help=f"the job file (default: ${contract.ENV_CONFIG})")
    train.add_argument("--metrics-out")
    train.add_argument("--local", action="store_true", help="start Ray in-process instead of joining one")
    train.add_argument("--quiet", action="store_true")
    train.add_argument("--dashboard-port", type=int, default=contract.DASHBOARD_PORT,
                       help="where the driver serves the live scheduler dashboard when it runs in a pod of the job "
                            "(default: %(default)d, the head's named port; 0: any free one)")
    train.set_defaults(fn=cmd_train)
    val = sub.add_parser("validate", help="check job files; every problem with its field path")
    val.add_argument("files", nargs="+", metavar="FILE", help=f"a job file; {STDIN} reads standard input")
    val.set_defaults(fn=cmd_validate)
    ren = sub.add_parser("render", help="print the manifests the operator would create")
    ren.add_argument("file")
    ren.set_defaults(fn=cmd_render)
    exp = sub.add_parser("export", help="write a checkpoint's policy as a Hugging Face model folder",
                         description="The policy of CHECKPOINT (a step_N directory, or a checkpoint root: its newest "
                                     "complete one) in the job's base model, saved with save_pretrained "
                                     "(safetensors), with its tokenizer and a model card.")
    exp.add_argument("checkpoint", metavar="CHECKPOINT")
    exp.add_argument("--to", required=True, metavar="DIR", help="the folder to write")
    exp.add_argument("--adapters", choices=("merge", "separate"), default="merge",
                     help="LoRA policies: merge the adapters into the base weights (default) or write them alone "
                          "as a peft adapter folder")
    exp.add_argument("--config", metavar="JOB.yaml",
                     help="the job file (default: the job saved in the checkpoint); its spec.model.policy gives "
                          "the base model and LoRA settings")
    exp.add_argument("--overwrite", action="store_true", help="replace an earlier export at --to")
    exp.set_defaults(fn=cmd_export)
    from hybridflow.control import cli as control_cli

    control_cli.add_parser(sub)
    from hybridflow.dashboard import cli as dashboard_cli

    dashboard_cli.add_parser(sub)
    comp = sub.add_parser("completion", help="print the shell completion script (bash or zsh)",
                          description="bash: source <(hybridflow completion bash); zsh: source <(hybridflow "
                                      "completion zsh), or save it as _hybridflow in a directory on $fpath")
    comp.add_argument("shell", choices=("bash", "zsh"))
    comp.set_defaults(fn=cmd_completion)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.fn(args))
    except KeyboardInterrupt:
        return _fail("interrupted")
