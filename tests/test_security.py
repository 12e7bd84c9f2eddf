"""Security properties of what the operator renders for a job, checked on the rendered objects (pure).

- The per-job Role: the job's Ray pods may read their own job and patch its status, nothing else.
- Secrets referenced through spec.cluster env/envFrom appear by name only: no value in any rendered object.
- Ray containers drop every capability and cannot gain privileges; the head has no public Service.
- The optional per-job NetworkPolicy admits the job's own pods and the configured peers only.

The same properties against a real API server: e2e/test_security_controlplane.py (a real token, a real Secret).
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

import pytest
import yaml

from hybridflow.api import API_GROUP, PLURAL
from hybridflow.k8s import names
from hybridflow.k8s.render import render_children, render_manifests
from hybridflow.k8s.settings import RenderSettings, SettingsError, parse_network_policy_peers
from hybridflow_operator.apply import LEADING_KINDS
from tests.helpers import templates_of

ROOT = Path(__file__).resolve().parents[1]
UID = "7c9e6679-7425-40de-944b-e07fc1f90ae7"
OPERATOR_PEER = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "hybridflow-system"}},
                 "podSelector": {"matchLabels": {"app.kubernetes.io/name": "hybridflow",
                                                 "app.kubernetes.io/instance": "hybridflow"}}}
KUBERAY_PEER = {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}}}
WITH_POLICY = RenderSettings(network_policy_peers=(OPERATOR_PEER, KUBERAY_PEER))


def job(name: str = "ppo-job.yaml", **cluster: Any) -> dict:
    doc = yaml.safe_load((ROOT / "examples" / name).read_text())
    doc["metadata"].update(name="ppo", uid=UID, generation=1, namespace="team-a")
    doc["spec"]["cluster"].update(cluster)
    return doc


def by_kind(children: list[dict]) -> dict[str, dict]:
    return {c["kind"]: c for c in children}


def ray_containers(rayjob: dict) -> list[dict]:
    templates = list(templates_of(rayjob).values())
    if "submitterPodTemplate" in rayjob["spec"]:
        templates.append(rayjob["spec"]["submitterPodTemplate"])
    return [c for t in templates for c in t["spec"]["containers"]]


# -- the per-job Role --------------------------------------------------------------------------------------

RUNTIME_ALLOWED = {
    # (apiGroup, resource, resourceNames): {verb: why the job's Ray pods need it}
    (API_GROUP, f"{PLURAL}/status", ("ppo",)): {"patch": "hybridflow.reporting patches status.progress"},
}
"""Every verb the operator grants a job's ServiceAccount. A verb not here fails: justify it here with the runtime
code that needs it."""


def test_the_job_role_grants_its_own_status_and_nothing_else() -> None:
    children = by_kind(render_children(job(), RenderSettings()))
    role = children["Role"]
    granted = {(group, resource, tuple(rule.get("resourceNames") or ())): set(rule["verbs"])
               for rule in role["rules"] for group in rule["apiGroups"] for resource in rule["resources"]}
    extra = [f"{key}: {verb}" for key, verbs in granted.items() for verb in sorted(verbs)
             if verb not in RUNTIME_ALLOWED.get(key, {})]
    assert not extra, (f"the job's Role grants more than the allow-list: {extra}. Justify each new verb in "
                       "RUNTIME_ALLOWED (tests/test_security.py) with the runtime request that needs it")
    assert granted == {key: set(verbs) for key, verbs in RUNTIME_ALLOWED.items()}
    for rule in role["rules"]:
        assert rule["resourceNames"] == ["ppo"], "every rule is pinned to the one job"
    binding = children["RoleBinding"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "ppo-runtime"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "ppo-runtime", "namespace": "team-a"}]
    for template in (c["template"] for c in [children["RayJob"]["spec"]["rayClusterSpec"]["headGroupSpec"],
                                              *children["RayJob"]["spec"]["rayClusterSpec"]["workerGroupSpecs"]]):
        assert template["spec"]["serviceAccountName"] == "ppo-runtime"


# -- Secrets: by reference only -----------------------------------------------------------------------------


def test_secret_values_never_reach_a_rendered_object(monkeypatch: pytest.MonkeyPatch) -> None:
    """A canary value in the operator's own environment (where a careless render might pick it up) and
    Secret references in the spec: the objects carry the references, never the value."""
    canary = f"canary-{secrets.token_hex(16)}"
    for var in ("HF_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY", "HYBRIDFLOW_HF_TOKEN"):
        monkeypatch.setenv(var, canary)
    doc = job(
        env=[{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}},
             {"name": "WANDB_API_KEY",
              "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "key", "optional": True}}}],
        envFrom=[{"secretRef": {"name": "s3-credentials"}}, {"prefix": "DB_", "secretRef": {"name": "db"}}],
        imagePullSecrets=[{"name": "registry-credentials"}],
        submissionMode="K8sJobMode",
    )
    settings = RenderSettings.from_env()
    children = render_children(doc, settings)
    text = json.dumps(children) + render_manifests(doc, settings)
    assert canary not in text

    config = json.loads(by_kind(children)["ConfigMap"]["data"]["job.json"]
                        if "job.json" in by_kind(children)["ConfigMap"]["data"]
                        else next(iter(by_kind(children)["ConfigMap"]["data"].values())))
    assert config["spec"]["cluster"]["envFrom"][0] == {"secretRef": {"name": "s3-credentials"}}
    containers = ray_containers(by_kind(children)["RayJob"])
    assert len(containers) >= 4  # head, two worker groups, the submitter
    for container in containers:
        env = {e["name"]: e for e in container["env"]}
        assert env["HF_TOKEN"] == {"name": "HF_TOKEN",
                                   "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}
        assert "value" not in env["WANDB_API_KEY"]
        assert container["envFrom"] == [{"secretRef": {"name": "s3-credentials"}},
                                        {"prefix": "DB_", "secretRef": {"name": "db"}}]


# -- Ray pods: no capabilities, no privilege escalation, no public Service -----------------------------------


@pytest.mark.parametrize("example", ["ppo-job.yaml", "grpo-job.yaml", "tiny-ppo-job.yaml"])
def test_every_ray_container_drops_all_capabilities(example: str) -> None:
    rayjob = by_kind(render_children(job(example, submissionMode="K8sJobMode"), RenderSettings()))["RayJob"]
    containers = ray_containers(rayjob)
    assert containers
    for container in containers:
        assert container["securityContext"] == {"allowPrivilegeEscalation": False,
                                                 "capabilities": {"drop": ["ALL"]}}, container["name"]
        assert "privileged" not in json.dumps(container)


def test_the_head_is_reached_through_a_cluster_ip_service_only() -> None:
    """KubeRay makes the head's Service ClusterIP unless told otherwise: nothing here tells it otherwise, and the
    operator renders no Service or Ingress of its own. The dashboard is reached with `kubectl port-forward`."""
    children = render_children(job(), WITH_POLICY)
    assert {c["kind"] for c in children} == {"ConfigMap", "ServiceAccount", "Role", "RoleBinding", "NetworkPolicy",
                                             "RayJob"}
    head = by_kind(children)["RayJob"]["spec"]["rayClusterSpec"]["headGroupSpec"]
    assert head.get("serviceType", "ClusterIP") == "ClusterIP"
    assert "headService" not in head and "enableIngress" not in head
    for template in [head["template"]]:
        for container in template["spec"]["containers"]:
            assert all("hostPort" not in port for port in container["ports"])
        assert not template["spec"].get("hostNetwork")


# -- the NetworkPolicy ---------------------------------------------------------------------------------------


def test_no_network_policy_unless_the_settings_ask() -> None:
    assert "NetworkPolicy" not in by_kind(render_children(job(), RenderSettings()))


def test_the_network_policy_admits_the_jobs_pods_its_submitter_and_the_peers_only() -> None:
    children = render_children(job(), WITH_POLICY)
    policy = by_kind(children)["NetworkPolicy"]
    assert policy["metadata"]["name"] == names.network_policy_name("ppo")
    assert policy["metadata"]["namespace"] == "team-a"
    assert policy["metadata"]["ownerReferences"][0]["uid"] == UID
    assert policy["metadata"]["labels"][names.JOB_LABEL] == "ppo"
    assert policy["spec"]["podSelector"] == {"matchLabels": {names.JOB_LABEL: "ppo"}}
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # egress stays open: models, data, trackers
    (rule,) = policy["spec"]["ingress"]
    assert "ports" not in rule  # Ray's pods talk on many ports among themselves
    assert rule["from"] == [
        {"podSelector": {"matchLabels": {names.JOB_LABEL: "ppo"}}},
        {"podSelector": {"matchLabels": {"batch.kubernetes.io/job-name": names.rayjob_name("ppo")}}},
        OPERATOR_PEER,
        KUBERAY_PEER,
    ]
    # it selects every Ray pod of the job: head and workers carry the job label
    for template in templates_of(by_kind(children)["RayJob"]).values():
        assert template["metadata"]["labels"][names.JOB_LABEL] == "ppo"
    # created before the RayJob, so no Ray pod runs without it
    kinds = [c["kind"] for c in children]
    assert kinds.index("NetworkPolicy") < kinds.index("RayJob")
    assert LEADING_KINDS.index("NetworkPolicy") < LEADING_KINDS.index("RayJob")


def test_in_http_mode_there_is_no_submitter_pod_to_admit() -> None:
    policy = by_kind(render_children(job(submissionMode="HTTPMode"), WITH_POLICY))["NetworkPolicy"]
    assert all(names.JOB_NAME_LABEL not in json.dumps(peer) for peer in policy["spec"]["ingress"][0]["from"])


def test_peers_come_from_the_environment_and_a_bad_value_is_refused() -> None:
    value = json.dumps([OPERATOR_PEER, KUBERAY_PEER])
    settings = RenderSettings.from_env({"HYBRIDFLOW_NETWORK_POLICY_PEERS": value})
    assert settings.network_policy_peers == (OPERATOR_PEER, KUBERAY_PEER)
    assert RenderSettings.from_env({"HYBRIDFLOW_NETWORK_POLICY_PEERS": "[]"}).network_policy_peers == ()
    assert RenderSettings.from_env({"HYBRIDFLOW_NETWORK_POLICY_PEERS": " "}).network_policy_peers is None
    for bad in ("{}", "[1]", "[{}]", '[{"podSelectr": {}}]', "[{"):
        with pytest.raises(SettingsError, match="HYBRIDFLOW_NETWORK_POLICY_PEERS"):
            parse_network_policy_peers(bad)
    # the rendered policy holds copies: rendering twice gives equal, independent objects
    first = by_kind(render_children(job(), settings))["NetworkPolicy"]
    first["spec"]["ingress"][0]["from"][-1]["podSelector"]["matchLabels"]["x"] = "y"
    assert by_kind(render_children(job(), settings))["NetworkPolicy"] != first
    assert settings.network_policy_peers == (OPERATOR_PEER, KUBERAY_PEER)
