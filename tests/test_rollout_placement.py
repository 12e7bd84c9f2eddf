"""A tensor-parallel vLLM engine's GPUs: one actor bundle of N GPUs, pods that hold whole engines, the spec and
preflight rules on tensorParallelSize, and the engine arguments the rollout spec gives."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from hybridflow.api import SpecError, parse_job
from hybridflow.graph import builtin_graph, rollout_gpus
from hybridflow.k8s.layout import plan_layout
from hybridflow.k8s.render import render_children
from hybridflow.k8s.settings import DEFAULT_GPU_PRODUCTS, RenderSettings
from hybridflow.plan import graph_problems
from hybridflow.preflight import preflight, tensor_parallel_problems
from hybridflow.scheduler.placement import actor_options, plan_placement
from hybridflow.workers.rollout import vllm_engine_args

ROOT = Path(__file__).resolve().parents[1]


def grpo(tp: int, engine: str = "vllm", groups: list[dict[str, Any]] | None = None, **spec: Any) -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "examples" / "grpo-job.yaml").read_text())
    doc["spec"]["rollout"] |= {"engine": engine, "tensorParallelSize": tp}
    if groups is not None:
        doc["spec"]["cluster"]["workerGroups"] = groups
    doc["spec"] |= spec
    return doc


def actor_group(gpus: int, replicas: int = 1) -> list[dict[str, Any]]:
    return [{"name": "actor", "replicas": replicas, "gpusPerWorker": gpus, "cpusPerWorker": 32, "memory": "400Gi"}]


@pytest.mark.parametrize("tp", [2, 4])
def test_the_actor_bundle_holds_every_gpu_of_its_engine(tp: int) -> None:
    spec = parse_job(grpo(tp)).spec
    assert rollout_gpus(spec) == tp
    graph = builtin_graph(spec, "GPU", parallelism=2).validate()
    plans = {p.name: p for p in plan_placement(graph, [{"GPU": 8, "CPU": 64}])}
    (actor,) = [p for p in plans.values() if "actor_rollout" in p.node_names]
    assert actor.bundle["GPU"] == tp
    assert actor_options(actor.bundle)["num_gpus"] == tp  # the host process sees all N GPUs
    assert actor.staged and actor.strategy == "STRICT_PACK"
    assert all(graph.get(n).gpus == 0 for n in actor.node_names if n != "actor_rollout")  # on the engine's GPUs


@pytest.mark.parametrize("engine", ["torch", "vllm"])
def test_one_gpu_generation_keeps_the_shared_gpu_split(engine: str) -> None:
    spec = parse_job(grpo(1, engine=engine)).spec
    graph = builtin_graph(spec, "GPU")
    assert rollout_gpus(spec) == 1
    assert (graph.get("actor_rollout").gpus, graph.get("reference").gpus) == (0.5, 0.25)


@pytest.mark.parametrize(("tp", "width"), [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_a_worker_group_holds_gpus_per_worker_over_tp_engines(tp: int, width: int) -> None:
    layout = plan_layout(parse_job(grpo(tp, groups=actor_group(8))).spec, DEFAULT_GPU_PRODUCTS)
    actor = layout.graph.get("actor_rollout")
    assert actor.parallelism == width
    assert sum(n.gpus for n in layout.graph.nodes if n.pool == "actor") == (0.5 + 0.25 if tp == 1 else tp)


def test_rendered_pods_request_whole_engines() -> None:
    children = render_children(grpo(4, groups=actor_group(8, replicas=2)), RenderSettings())
    rayjob = next(c for c in children if c["kind"] == "RayJob")
    (group,) = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert group["replicas"] == 2


@pytest.mark.parametrize(("tp", "pods", "gpus"), [(2, 2, 8), (3, 4, 6), (16, 8, 16)])
def test_derived_pods_never_split_an_engine(tp: int, pods: int, gpus: int) -> None:
    """Without worker groups the actor runs 8 instances; a pod holds whole N-GPU engines only."""
    doc = grpo(tp, groups=[])
    doc["spec"]["model"]["policy"]["path"] = "builtin:tiny"
    layout = plan_layout(parse_job(doc).spec, DEFAULT_GPU_PRODUCTS)
    (group,) = [g for g in layout.groups if g.name == "actor"]
    assert (group.replicas, group.gpus) == (pods, gpus)
    assert group.gpus % tp == 0 and group.total_gpus >= 8 * tp


def test_tp_larger_than_any_worker_is_refused_naming_the_fields() -> None:
    with pytest.raises(SpecError) as e:
        parse_job(grpo(16, groups=actor_group(8)))
    (problem,) = e.value.problems
    assert "rollout.tensorParallelSize" in problem and "gpusPerWorker" in problem
    assert "tensorParallelSize 16; the largest worker group has 8" in problem


def test_a_worker_as_large_as_tp_is_accepted() -> None:
    assert parse_job(grpo(8, groups=actor_group(8))).spec.rollout.tensor_parallel_size == 8


def _tiny(tp: int) -> Any:
    doc = grpo(tp, groups=actor_group(8))
    doc["spec"]["model"]["policy"]["path"] = "builtin:tiny"
    doc["spec"]["data"] = {"train": "builtin:tiny_task", "batchSize": 8, "maxPromptLength": 8,
                           "maxResponseLength": 4}
    doc["spec"]["trainer"]["checkpoint"] = {"every": 0}
    doc["spec"]["cluster"] = {"workerGroups": actor_group(8)}
    doc["spec"]["algorithm"]["miniBatchSize"] = 8
    return parse_job(copy.deepcopy(doc)).spec


def test_preflight_checks_tp_divides_the_attention_heads() -> None:
    """builtin:tiny has 4 attention heads."""
    assert tensor_parallel_problems(_tiny(2)) == []
    (problem,) = tensor_parallel_problems(_tiny(3))
    assert problem.startswith("spec.rollout.tensorParallelSize: 3 does not divide the policy's 4 attention heads")
    assert problem.endswith("use one of 1, 2, 4")
    assert problem in preflight(_tiny(3), "GPU")
    assert not any("tensorParallelSize" in p for p in preflight(_tiny(4), "GPU"))


def test_preflight_says_nothing_when_the_model_config_is_unreadable(tmp_path: Path) -> None:
    spec = _tiny(3).model_copy(deep=True)
    spec.model.policy.path = str(tmp_path / "absent")
    assert tensor_parallel_problems(spec) == []


def test_a_written_graph_must_give_the_actor_its_engines_gpus() -> None:
    spec = parse_job(grpo(2)).spec
    written = builtin_graph(spec, "GPU").to_spec().model_dump(by_alias=True, mode="json", exclude_none=True)
    actor = next(i for i, n in enumerate(written["nodes"]) if n["role"] == "actor_rollout")
    written["nodes"][actor]["resources"] = {"GPU": 1}
    doc = grpo(2)
    doc["spec"]["graph"] = written
    (problem,) = graph_problems(parse_job(doc).spec)
    assert problem.startswith(f"spec.graph.nodes[{actor}]: one instance of 'actor_rollout' holds 1 GPUs")
    assert "spec.rollout.tensorParallelSize 2 needs 2 for one vLLM engine" in problem
    written["nodes"][actor]["resources"] = {"GPU": 2}
    assert graph_problems(parse_job(doc).spec) == []


@pytest.mark.parametrize("tp", [1, 2])
def test_the_engine_gets_its_gpus_share_and_eager_mode_from_the_spec(tp: int) -> None:
    rollout = parse_job(grpo(tp)).spec.rollout
    args = vllm_engine_args("/models/policy", rollout, 1536, "bfloat16", 7, on_cpu=False, can_sleep=True,
                            host_memory_bytes=2**40)
    assert args["tensor_parallel_size"] == tp
    assert args["gpu_memory_utilization"] == rollout.gpu_memory_utilization and "kv_cache_memory_bytes" not in args
    assert args["enable_sleep_mode"] and args["enforce_eager"] is False
    # a tensor-parallel engine's workers are the actor process's children on its bundle's GPUs
    assert args["distributed_executor_backend"] == ("mp" if tp > 1 else None)

    doc = grpo(tp)
    doc["spec"]["rollout"] |= {"enforceEager": True, "gpuMemoryUtilization": 0.25}
    cpu = vllm_engine_args("/models/policy", parse_job(doc).spec.rollout, 1536, "float32", 7, on_cpu=True,
                           can_sleep=False, host_memory_bytes=2**30)
    # on vLLM's CPU build the share is the KV cache's, of host memory
    assert cpu["kv_cache_memory_bytes"] == 2**28 and "gpu_memory_utilization" not in cpu
    assert cpu["enforce_eager"] is True and cpu["enable_sleep_mode"] is False
