"""Security against a real kube-apiserver: a job's real ServiceAccount token, a real Secret, a real namespace
being deleted. The operator runs as in e2e/test_operator.py (a subprocess, `control_plane` without
controllers), here at DEBUG level and with NetworkPolicies on, so that everything it logs and renders is
checked.

- The token of a job's ServiceAccount (TokenRequest, as the kubelet mounts it) may patch its own job's
  status and nothing else: not another job's status, not its spec, no Secret; its rules, as the API server
  reports them, are that one rule plus what every authenticated user has.
- A canary Secret referenced through spec.cluster env and envFrom: its value is in no ConfigMap, RayJob,
  Event or other object in the namespace, and not in the operator's log.
- A namespace being deleted: the operator stops creating there after one refusal, however its objects go.
"""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.harness.controlplane import ControlPlane, eventually, run_kubectl
from e2e.harness.operator import OperatorProcess
from e2e.test_operator import WAIT_S, apply, example, get, job_of, wait_job, wait_rayjob
from hybridflow.k8s import names
from hybridflow.k8s.render import render_manifests
from hybridflow.k8s.settings import RenderSettings

pytestmark = pytest.mark.controlplane

ROOT = Path(__file__).resolve().parents[1]

OPERATOR_PEER = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "hybridflow-system"}},
                 "podSelector": {"matchLabels": {"app.kubernetes.io/name": "hybridflow"}}}
OPERATOR_ENV = {  # read by the `operator` fixture (e2e/conftest.py)
    "HYBRIDFLOW_LOG_LEVEL": "DEBUG",
    "HYBRIDFLOW_NETWORK_POLICY_PEERS": json.dumps([OPERATOR_PEER]),
}
EVERY_USER = {  # what the API server's default roles give any authenticated user (system:basic-user)
    ("authorization.k8s.io", "selfsubjectaccessreviews"),
    ("authorization.k8s.io", "selfsubjectrulesreviews"),
    ("authentication.k8s.io", "selfsubjectreviews"),
}


def reconciled(cp: ControlPlane, op: OperatorProcess, namespace: str, name: str) -> dict:
    wait_rayjob(cp, op, namespace, name)
    return wait_job(cp, op, namespace, name,
                    lambda j: (j.get("status") or {}).get("observedGeneration") == j["metadata"]["generation"],
                    f"{name} reconciled")


class Token:
    """kubectl with a bearer token of a ServiceAccount, made by the TokenRequest API, and nothing else."""

    def __init__(self, cp: ControlPlane, namespace: str, service_account: str, work: Path) -> None:
        self.namespace = namespace
        token = cp.kubectl("create", "token", service_account, "-n", namespace, "--duration=10m").stdout.strip()
        admin = yaml.safe_load(cp.kubeconfig.read_text())
        cluster = admin["clusters"][0]["cluster"]
        trust = {"server": cluster["server"], "certificate-authority-data": cluster["certificate-authority-data"]}
        self.kubeconfig = work / f"{service_account}.kubeconfig"
        self.kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "sa",
            "clusters": [{"name": "cp", "cluster": trust}],
            "users": [{"name": "sa", "user": {"token": token}}],
            "contexts": [{"name": "sa", "context": {"cluster": "cp", "user": "sa", "namespace": namespace}}],
        }))

    def kubectl(self, *args: str, input: str | None = None) -> Any:
        return run_kubectl(self.kubeconfig, *args, input=input, check=False)

    def patch(self, name: str, body: dict, *, status: bool = True) -> subprocess.CompletedProcess[str]:
        """A merge patch of a job (its status subresource, or the job itself) through the runtime's own client
        (hybridflow.reporting): a plain PATCH, no read first (kubectl patch reads the object before)."""
        what = "patch_namespaced_custom_object_status" if status else "patch_namespaced_custom_object"
        code = (
            "import json, sys\n"
            "from hybridflow.reporting import kubernetes_patcher\n"
            "from hybridflow.api.spec import API_GROUP, API_VERSION, PLURAL\n"
            "from kubernetes import client\n"
            "namespace, name, what, body = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])\n"
            "if what.endswith('_status'):\n"
            "    kubernetes_patcher()(namespace, name, body)\n"
            "else:\n"
            "    kubernetes_patcher()  # loads the kubeconfig\n"
            "    client.CustomObjectsApi().patch_namespaced_custom_object(API_GROUP, API_VERSION, namespace, PLURAL,"
            " name, body)\n"
        )
        path = os.pathsep.join([str(ROOT / "runtime"), str(ROOT / "operator"), str(ROOT)])
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "PYTHONPATH": path}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        return subprocess.run([sys.executable, "-c", code, self.namespace, name, what, json.dumps(body)], env=env,
                              capture_output=True, text=True, timeout=60, check=False, cwd=ROOT)


def forbidden(result: Any) -> bool:
    return result.returncode != 0 and "forbidden" in result.stderr.lower()


def test_a_jobs_token_patches_its_own_status_and_nothing_else(
    control_plane: ControlPlane, running: OperatorProcess, namespace: str, tmp_path: Path
) -> None:
    cp = control_plane
    for name in ("alpha", "beta"):
        apply(cp, example(namespace, name))
    for name in ("alpha", "beta"):
        reconciled(cp, running, namespace, name)
    sa = names.runtime_identity_name("alpha")
    token = Token(cp, namespace, sa, tmp_path)

    whoami = token.kubectl("auth", "whoami", "-o", "json")
    assert whoami.returncode == 0, whoami.stderr
    assert json.loads(whoami.stdout)["status"]["userInfo"]["username"] == f"system:serviceaccount:{namespace}:{sa}"

    progress = {"status": {"progress": {"step": 3, "totalSteps": 10}}}
    own = token.patch("alpha", progress)  # what the runtime does, with its own code
    assert own.returncode == 0, own.stderr
    assert job_of(cp, namespace, "alpha")["status"]["progress"]["step"] == 3

    other = token.patch("beta", progress)
    assert forbidden(other), (other.returncode, other.stderr)
    assert (job_of(cp, namespace, "beta")["status"].get("progress") or {}).get("step") != 3

    spec = token.patch("alpha", {"spec": {"runPolicy": {"suspend": True}}}, status=False)
    assert forbidden(spec), (spec.returncode, spec.stderr)
    assert not job_of(cp, namespace, "alpha")["spec"]["runPolicy"].get("suspend")

    cp.kubectl("create", "secret", "generic", "model-registry", "-n", namespace, "--from-literal=key=value")
    for args in (("get", "secret", "model-registry"), ("get", "secrets"), ("get", "secrets", "-A"),
                 ("create", "secret", "generic", "mine", "--from-literal=a=b"),
                 ("get", "rltrainingjob", "beta"), ("delete", "rltrainingjob", "alpha"),
                 ("get", "configmaps"), ("get", "pods"), ("create", "token", sa),
                 ("patch", "role", sa, "--type=merge", "-p", '{"rules": []}')):
        result = token.kubectl(*args)
        assert forbidden(result), (args, result.returncode, result.stdout, result.stderr)

    # everything the token may do in the namespace, as the API server reports it
    review = token.kubectl("create", "--validate=false", "-o", "json", "-f", "-", input=json.dumps({
        "apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectRulesReview", "spec": {"namespace": namespace},
    }))
    assert review.returncode == 0, review.stderr
    rules = json.loads(review.stdout)["status"]["resourceRules"]
    granted = {(group, resource, tuple(rule.get("resourceNames") or ()), tuple(sorted(rule["verbs"])))
               for rule in rules for group in rule.get("apiGroups") or [""] for resource in rule["resources"]}
    ours = {g for g in granted if (g[0], g[1]) not in EVERY_USER}
    assert ours == {("hybridflow.io", "rltrainingjobs/status", ("alpha",), ("patch",))}, rules
    assert all(verbs == ("create",) for group, resource, _, verbs in granted if (group, resource) in EVERY_USER)
    can_i = token.kubectl("auth", "can-i", "--list")
    assert can_i.returncode == 0 and "rltrainingjobs.hybridflow.io/status" in can_i.stdout, can_i.stderr
    assert "secrets" not in can_i.stdout and "rltrainingjobs.hybridflow.io " not in can_i.stdout, can_i.stdout


def test_a_secret_referenced_by_a_job_appears_in_no_object_event_or_log(
    control_plane: ControlPlane, running: OperatorProcess, namespace: str
) -> None:
    cp = control_plane
    canary = f"canary-{secrets.token_hex(16)}"
    encoded = base64.b64encode(canary.encode()).decode()
    cp.kubectl("create", "secret", "generic", "hf-token", "-n", namespace, f"--from-literal=token={canary}")
    cp.kubectl("create", "secret", "generic", "s3-credentials", "-n", namespace,
               f"--from-literal=AWS_SECRET_ACCESS_KEY={canary}")
    log_before = len(running.log())
    doc = example(namespace, "canary")
    doc["spec"]["cluster"]["env"] = [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token",
                                                                                          "key": "token"}}}]
    doc["spec"]["cluster"]["envFrom"] = [{"secretRef": {"name": "s3-credentials"}}]
    apply(cp, doc)
    reconciled(cp, running, namespace, "canary")
    # a second generation: patches, another round of status writes and Events
    cp.kubectl("patch", "rltrainingjob", "canary", "-n", namespace, "--type=merge", "-p",
               json.dumps({"spec": {"runPolicy": {"suspend": True}}}))
    wait_job(cp, running, namespace, "canary",
             lambda j: (j.get("status") or {}).get("observedGeneration") == 2, "generation 2 reconciled")
    eventually(lambda: cp.get_json("events", "-n", namespace)["items"], WAIT_S, "the operator's Events")

    rayjob = get(cp, "rayjob", namespace, names.rayjob_name("canary"))
    assert rayjob is not None and "hf-token" in json.dumps(rayjob) and "s3-credentials" in json.dumps(rayjob)
    kinds = "configmaps,serviceaccounts,roles,rolebindings,networkpolicies,rayjobs,rltrainingjobs,events,pods"
    seen = {
        "objects": cp.kubectl("get", kinds, "-n", namespace, "-o", "json").stdout,
        "events everywhere": cp.kubectl("get", "events", "-A", "-o", "json").stdout,
        "the rendered manifests": render_manifests(job_of(cp, namespace, "canary"),
                                                   RenderSettings.from_env(OPERATOR_ENV)),
        "the operator's log": running.log()[log_before:],
    }
    assert "ConfigMap" in seen["objects"] and "RayJob" in seen["objects"] and seen["the operator's log"]
    for where, text in seen.items():
        assert canary not in text and encoded not in text, f"the Secret's value is in {where}"
    # the check can see it: the Secret itself holds it
    assert encoded in cp.kubectl("get", "secret", "hf-token", "-n", namespace, "-o", "json").stdout


def test_the_network_policy_is_created_with_the_job(
    control_plane: ControlPlane, running: OperatorProcess, namespace: str
) -> None:
    cp = control_plane
    apply(cp, example(namespace, "fenced"))
    job = reconciled(cp, running, namespace, "fenced")
    policy = get(cp, "networkpolicy", namespace, names.network_policy_name("fenced"))
    assert policy is not None, "the API server accepted the rendered NetworkPolicy"
    assert policy["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
    assert policy["spec"]["podSelector"] == {"matchLabels": {names.JOB_LABEL: "fenced"}}
    assert policy["spec"]["ingress"][0]["from"][-1] == OPERATOR_PEER


def _create_requests(op: OperatorProcess) -> dict[str, float]:
    """hybridflow_operator_api_requests_total of verb create, by code."""
    with urllib.request.urlopen(op.metrics, timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        match = re.match(r'hybridflow_operator_api_requests_total\{(.*)\} (\S+)', line)
        if match:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
            if labels.get("verb") == "create":
                out[labels["code"]] = float(match.group(2))
    return out


def test_a_namespace_being_deleted_gets_no_retries_and_nothing_recreated(
    control_plane: ControlPlane, running: OperatorProcess
) -> None:
    """Without a namespace controller here, a deleted namespace stays Terminating: the operator's view of it
    for as long as a real one takes. Its objects are then deleted one by one, as that controller would."""
    cp = control_plane
    namespace = f"e2e-going-{uuid.uuid4().hex[:8]}"
    cp.create_namespace(namespace)
    apply(cp, example(namespace, "going"))
    apply(cp, example(namespace, "staying"))
    for name in ("going", "staying"):
        reconciled(cp, running, namespace, name)
    log_start = len(running.log())
    cp.kubectl("delete", "namespace", namespace, "--wait=false")
    eventually(lambda: cp.kubectl("get", "namespace", namespace, "-o", "jsonpath={.status.phase}").stdout
               == "Terminating", WAIT_S, "the namespace Terminating")
    before = _create_requests(running)

    rayjob = names.rayjob_name("going")
    cp.kubectl("delete", "rayjob", rayjob, "-n", namespace, "--wait=false")
    eventually(lambda: _create_requests(running).get("403", 0) > before.get("403", 0), WAIT_S,
               "the operator's attempt to recreate the RayJob, refused")
    time.sleep(3)
    after_refusal = _create_requests(running)

    # more of what a namespace deletion brings: children of both jobs go, a job changes on its way out
    cp.kubectl("delete", "rayjob", names.rayjob_name("staying"), "-n", namespace, "--wait=false")
    cp.kubectl("delete", "configmap", names.config_map_name("going"), "-n", namespace, "--wait=false")
    cp.kubectl("patch", "rltrainingjob", "going", "-n", namespace, "--type=merge", "-p",
               json.dumps({"spec": {"runPolicy": {"suspend": True}}}))
    time.sleep(RETRY_WINDOW_S)

    assert running.alive(), running.tail()
    assert _create_requests(running) == after_refusal, "the operator kept creating in a terminating namespace"
    assert get(cp, "rayjob", namespace, rayjob) is None and get(cp, "rayjob", namespace, "staying") is None
    log = running.log()[log_start:]
    assert f"namespace {namespace} is being deleted" in log
    noisy = [line for line in log.splitlines() if namespace in line and re.search(r"WARNING|ERROR|retrying", line)]
    assert not noisy, "\n".join(noisy)


RETRY_WINDOW_S = 15.0
"""Longer than the operator's retry delay after an API error (10 s): a retry would show in this time."""
