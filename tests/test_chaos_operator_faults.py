"""The operator fault campaign's judging, as pure logic: when a namespace counts as converged, what counts as a
duplicate, a loss or a stray child, and how the operator's API server is derived from the control plane's.
The faults themselves run on a real control plane in e2e/test_operator_faults.py."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml

from benchmarks.chaos.operator_faults import assess, lines_since, replace_flags, row, status_converged
from hybridflow.k8s import names
from hybridflow.k8s.render import render_children
from hybridflow.k8s.settings import RenderSettings
from hybridflow_operator.apply import status_patch
from hybridflow_operator.observed import JobView

ROOT = Path(__file__).resolve().parent.parent


def live_job(name: str) -> dict[str, Any]:
    job = yaml.safe_load((ROOT / "examples" / "grpo-job.yaml").read_text())
    job["metadata"].update(name=name, namespace="chaos", uid=f"uid-{name}", generation=1, resourceVersion="7")
    return job


def children_of(job: dict[str, Any]) -> dict[str, list[dict]]:
    plurals = {"ConfigMap": "configmaps", "ServiceAccount": "serviceaccounts", "Role": "roles",
               "RoleBinding": "rolebindings", "RayJob": "rayjobs"}
    out: dict[str, list[dict]] = {p: [] for p in plurals.values()}
    for child in render_children(job, RenderSettings()):
        if child["kind"] in plurals:
            out[plurals[child["kind"]]].append(child)
    return out


def reported(job: dict[str, Any], rayjob: dict[str, Any]) -> dict[str, Any]:
    """The job with the status the operator writes for this RayJob."""
    done = copy.deepcopy(job)
    patch = status_patch(JobView.parse(job), rayjob, [], None)
    done["status"] = {k: v for k, v in patch.items() if v is not None}
    return done


def merged(*parts: dict[str, list[dict]]) -> dict[str, list[dict]]:
    return {plural: [c for part in parts for c in part[plural]] for plural in parts[0]}


def test_a_job_converges_once_its_status_is_what_the_operator_writes_for_its_rayjob() -> None:
    job = live_job("a")
    rayjob = children_of(job)["rayjobs"][0]
    assert not status_converged(job, rayjob)  # nobody has observed it yet
    assert status_converged(reported(job, rayjob), rayjob)
    assert not status_converged(reported(job, rayjob), None)  # its RayJob is gone
    running = copy.deepcopy(rayjob)
    running["status"] = {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"}
    assert not status_converged(reported(job, rayjob), running)  # KubeRay moved on, the job has not followed
    assert status_converged(reported(job, running), running)


def test_duplicates_losses_and_strays_are_counted_per_kind() -> None:
    a, b = live_job("a"), live_job("b")
    kids_a, kids_b = children_of(a), children_of(b)
    jobs = {"a": reported(a, kids_a["rayjobs"][0]), "b": reported(b, kids_b["rayjobs"][0])}
    clean = assess(["a", "b"], jobs, merged(kids_a, kids_b))
    assert (clean.converged, clean.duplicates, clean.missing, clean.strays) == ({"a", "b"}, 0, 0, 0)
    assert clean.done(["a", "b"]) and clean.children_complete

    doubled = merged(kids_a, kids_b)
    doubled["configmaps"].append(copy.deepcopy(kids_a["configmaps"][0]))  # a second ConfigMap of job a
    del doubled["rayjobs"][1]  # job b lost its RayJob
    seen = assess(["a", "b"], jobs, doubled)
    assert (seen.converged, seen.duplicates, seen.missing, seen.strays) == (frozenset(), 1, 1, 0)
    assert not seen.done(["a", "b"]) and not seen.children_complete

    only_a = assess(["a"], {"a": jobs["a"]}, merged(kids_a, kids_b))  # job b was deleted, its children stayed
    assert (only_a.converged, only_a.strays) == ({"a"}, 5)
    assert not only_a.done(["a"])


def test_the_operators_api_server_differs_from_the_control_planes_only_in_the_flags_given() -> None:
    argv = ["/bin/kube-apiserver", "--etcd-servers=http://127.0.0.1:1", "--secure-port=6443", "--cert-dir=/a"]
    assert replace_flags(argv, {"secure-port": "7443", "cert-dir": "/b", "watch-cache": "false"}) == [
        "/bin/kube-apiserver", "--etcd-servers=http://127.0.0.1:1", "--secure-port=7443", "--cert-dir=/b",
        "--watch-cache=false"]


def test_log_lines_are_counted_past_a_mark_only() -> None:
    text = "W old retrying in 10 s ns-a/x\n"
    mark = len(text)
    text += "INFO ns-a/x created\nWARNING applying ns-a/x: API error 500; retrying in 10 s\nWARNING ns-b/y\n"
    problem = re.compile(r"\bWARNING\b|retrying in")
    assert lines_since(text, mark, problem, "ns-a/") == 1
    assert lines_since(text, mark, problem) == 2


def test_a_row_has_the_campaigns_shape() -> None:
    out = row("operator_kill", 2, 1, 0, 3, [2.0, 4.0], {"seed": 1})
    assert out == {"kind": "operator_kill", "injected": 2, "survived": 1, "duplicates": 0, "losses": 3,
                   "recovery_s": {"p50": 3.0, "p95": 3.9, "samples": [2.0, 4.0]}, "detail": {"seed": 1}}
    assert row("etcd_restart", 1, 0, 0, 1, [], {})["recovery_s"] == {"p50": None, "p95": None, "samples": []}
    assert names.JOB_LABEL  # the children above carry it: assess counts by it
