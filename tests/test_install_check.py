"""The verdicts of `helm test`'s install check (hybridflow_operator.install_check), on objects as the API
server returns them. tests/test_chart.py runs the whole module against a real kube-apiserver."""

from __future__ import annotations

from typing import Any

import pytest

from hybridflow.api import crd as crdgen
from hybridflow_operator import install_check as ic

CRD = crdgen.CRD_NAME


def crd_obj(status: str | None, reason: str = "InitialNamesAccepted") -> dict[str, Any]:
    conditions = [{"type": "NamesAccepted", "status": "True", "reason": "NoConflicts"}]
    if status is not None:
        conditions.append({"type": "Established", "status": status, "reason": reason,
                           "message": "the initial names have been accepted"})
    return {"metadata": {"name": CRD}, "spec": {"versions": [{"name": "v1alpha1", "served": True}]},
            "status": {"conditions": conditions}}


def deployment_obj(available: str | None, generation: int = 2, observed: int = 2, ready: int = 1) -> dict[str, Any]:
    status: dict[str, Any] = {"observedGeneration": observed, "replicas": 1, "availableReplicas": ready}
    if available is not None:
        reason = "MinimumReplicasAvailable" if available == "True" else "MinimumReplicasUnavailable"
        status["conditions"] = [
            {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"},
            {"type": "Available", "status": available, "reason": reason},
        ]
    return {"metadata": {"name": "hybridflow", "generation": generation}, "spec": {"replicas": 1}, "status": status}


def test_an_established_crd_passes_and_says_what_it_serves() -> None:
    found = ic.crd_finding(CRD, ic.Read(crd_obj("True")))
    assert found.ok
    assert found.line() == (f"ok   CustomResourceDefinition {CRD}: Established=True (InitialNamesAccepted: the "
                            "initial names have been accepted); serves v1alpha1")


@pytest.mark.parametrize(("read", "detail"), [
    (ic.Read(crd_obj(None)), "no Established condition yet"),
    (ic.Read(crd_obj("False", "Installing")), "Established=False (Installing: "),
    (ic.Read(None), "not found (crds.install=false needs it applied separately)"),
    (ic.Read(None, "HTTP 403: forbidden"), "cannot read it: HTTP 403: forbidden"),
])
def test_a_crd_not_established_fails_naming_why(read: ic.Read, detail: str) -> None:
    found = ic.crd_finding(CRD, read)
    assert not found.ok
    assert found.line().startswith(f"FAIL CustomResourceDefinition {CRD}: {detail}")


def test_an_available_deployment_passes() -> None:
    found = ic.deployment_finding("hybridflow-system", "hybridflow", ic.Read(deployment_obj("True")))
    assert found.ok
    assert found.line() == ("ok   Deployment hybridflow-system/hybridflow: Available=True "
                            "(MinimumReplicasAvailable); 1/1 available")


@pytest.mark.parametrize(("obj", "detail"), [
    (deployment_obj("False", ready=0), "Available=False (MinimumReplicasUnavailable); 0/1 available"),
    (deployment_obj(None, ready=0), "no Available condition yet; 0/1 available"),
    # Available=True of the previous generation says nothing about the spec just applied.
    (deployment_obj("True", generation=3, observed=2), "its controller has not seen generation 3 yet (1/1 available)"),
])
def test_a_deployment_not_available_fails_naming_why(obj: dict[str, Any], detail: str) -> None:
    found = ic.deployment_finding("ns", "hybridflow", ic.Read(obj))
    assert not found.ok
    assert found.detail == detail


def test_a_missing_or_unreadable_deployment_fails() -> None:
    assert ic.deployment_finding("ns", "d", ic.Read(None)).line() == "FAIL Deployment ns/d: not found"
    unreadable = ic.deployment_finding("ns", "d", ic.Read(None, "HTTP 403: no"))
    assert not unreadable.ok and unreadable.detail == "cannot read it: HTTP 403: no"


def test_report_passes_only_when_every_finding_does() -> None:
    good = ic.crd_finding(CRD, ic.Read(crd_obj("True")))
    bad = ic.deployment_finding("ns", "d", ic.Read(None))
    ok, text = ic.report([good, ic.deployment_finding("ns", "d", ic.Read(deployment_obj("True")))])
    assert ok and text.splitlines()[-1] == ic.PASSED
    ok, text = ic.report([good, bad])
    assert not ok
    assert text.splitlines() == [good.line(), bad.line(), "the check failed"]


def test_arguments_default_to_the_crd_of_the_models() -> None:
    args = ic.parse_args(["--deployment", "hybridflow", "--namespace", "hybridflow-system"])
    assert (args.crd, args.deployment, args.namespace, args.timeout) == (
        CRD, "hybridflow", "hybridflow-system", ic.DEFAULT_TIMEOUT_S)
