"""The benchmark reports: benchmarks/README.md's sections are what the committed results render to, and a
results file of another format is refused rather than read."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import dispatch, offpolicy, passes, runtime, weight_sync
from benchmarks.operator import report
from benchmarks.operator.summarise import FormatError, check_format, summarise

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = (ROOT / "benchmarks" / "README.md").read_text()


def section(begin: str, end: str) -> str:
    return README[README.index(begin) : README.index(end) + len(end)]


def test_operator_section_is_rendered_from_operator_json() -> None:
    raw = check_format(json.loads((RESULTS / "operator.json").read_text()), "operator.json")
    assert report.readme_block(summarise(raw)) == section(report.BEGIN, report.END)


@pytest.mark.parametrize("workload", list(runtime.WORKLOADS.values()), ids=list(runtime.WORKLOADS))
def test_runtime_section_is_rendered_from_runtime_json(workload: runtime.Workload) -> None:
    results = json.loads((RESULTS / f"{workload.stem}.json").read_text())
    assert results["format"] == runtime.FORMAT and results["config"]["workload"] == workload.name
    assert runtime.markdown(results) == section(*workload.markers)
    assert (RESULTS / f"{workload.stem}.png").is_file()


def test_every_system_but_the_naive_loop_runs_in_one_process_and_in_two_ranks(monkeypatch) -> None:
    """The two-rank layout is a job that trains: the co-located group in two ranks of half the cores, replicated."""
    from hybridflow.plan import step_plan, trainable_graph

    monkeypatch.setenv("HYBRIDFLOW_TORCH_THREADS", "4")
    assert runtime.layouts("hybridflow") == runtime.layouts("trl") == [(1, 4), (2, 2)]
    assert runtime.layouts("naive_ray") == [(1, 1), (1, 4)]
    job = runtime.with_layout(runtime.bench_job(3, "layout", runtime.WORKLOADS["tiny"]), 2, 2)
    graph = trainable_graph(job.spec, "CPU")
    group = graph.group_of("actor_rollout")
    assert len(group.nodes) == 3 and group.parallelism == 2 and group.bundle["CPU"] == 2.0
    assert not job.spec.trainer.training.shard and not step_plan(graph, job.spec).fused


def test_weight_sync_section_is_rendered_from_weight_sync_json() -> None:
    results = json.loads((RESULTS / "weight_sync.json").read_text())
    assert weight_sync.render(results) == section(weight_sync.BEGIN, weight_sync.END)
    plain, fsdp = results["plain"], results["fsdp2"]
    assert fsdp["slices_match"]
    for case in (plain, fsdp):  # streaming never holds more than a full copy does
        assert case["bucketed"]["peak_extra_mib"] < case["full_copy"]["peak_extra_mib"]
    update = results["update"]
    assert update["copy_released"]["copy_mib_in_update"] == 0
    assert update["copy_released"]["peak_rss_mib"] < update["copy_held"]["peak_rss_mib"]


def test_the_update_case_holds_the_copy_only_when_told() -> None:
    """The weight-sync benchmark's update case, on its small model: the runtime's update releases the copy."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.weight_sync", "--case", "update", "--quick",
                           "--repeats", "1"], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    held, released = result["copy_held"], result["copy_released"]
    assert held["copy_mib_in_update"] == held["copy_mib"] == released["copy_mib"] > 0
    assert released["copy_mib_in_update"] == 0


def test_dispatch_section_is_rendered_from_dispatch_json() -> None:
    results = json.loads((RESULTS / "dispatch.json").read_text())
    assert results["format"] == dispatch.FORMAT and len(results["cases"]) == len(dispatch.SIZES)
    assert dispatch.render(results) == section(dispatch.BEGIN, dispatch.END)
    for case in results["cases"]:  # streamed, every next chunk arrived during the call before it; serial, none did
        assert all(a is not None for a in case["streamed"]["next_arrived_s"])
        assert all(a is None for a in case["serial"]["next_arrived_s"])
    assert (RESULTS / "dispatch.png").is_file()


def test_passes_section_is_rendered_from_passes_json() -> None:
    """Every mode ran the same rows (its log-probs agree), length order put fewer tokens through the model, and
    the LM head on the response positions returned smaller logits."""
    results = json.loads((RESULTS / "passes.json").read_text())
    assert results["format"] == passes.FORMAT and list(results["modes"]) == list(passes.MODES)
    assert passes.render(results) == section(passes.BEGIN, passes.END)
    assert results["max_log_prob_difference"] < 1e-4
    padded, *ordered = results["modes"].values()
    assert padded["tokens"] == results["rows"] * (results["prompt"] + results["response"])
    assert all(results["real_tokens"] <= m["tokens"] < padded["tokens"] for m in ordered)
    heads = results["heads"]
    assert list(heads["modes"]) == list(passes.HEADS) and heads["max_log_prob_difference"] < 1e-4
    every, response_only = heads["modes"].values()
    assert response_only["largest_logits_bytes"] < every["largest_logits_bytes"]
    runs = results["reductions"]["runs"]
    for reduction in passes.REDUCTIONS:
        whole, chunked = (runs[f"{reduction}, {way}"] for way in passes.REDUCE_WAYS)
        assert chunked["extra_peak_bytes"] < whole["extra_peak_bytes"]
    assert passes.reduction_agreement(results["reductions"]) < 1e-6
    assert list(results["sharing"]) == list(passes.LAYOUTS)
    for out in results["sharing"].values():
        whole, shared = (out["modes"][way] for way in passes.SHARING)
        assert shared["tokens"] < whole["tokens"] and out["max_log_prob_difference"] < 1e-4
    assert (RESULTS / "passes.png").is_file()


def test_offpolicy_section_is_rendered_from_offpolicy_json() -> None:
    results = json.loads((RESULTS / "offpolicy.json").read_text())
    assert results["format"] == offpolicy.FORMAT and set(results["workloads"]) == set(runtime.WORKLOADS)
    assert offpolicy.render(results) == section(offpolicy.BEGIN, offpolicy.END)
    for w in results["workloads"].values():  # the pipelined runs trained one version behind after their first step
        assert w["strong"]["policy_lags"] == [0] and w["eventual"]["policy_lags"] == [1]
        assert w["gain"] == w["eventual"]["tokens_per_s"] / w["strong"]["tokens_per_s"]
    assert (RESULTS / "offpolicy.png").is_file()


def test_a_results_file_of_another_format_is_refused() -> None:
    with pytest.raises(FormatError, match="format None"):
        check_format({"sizes": {}}, "old.json")
