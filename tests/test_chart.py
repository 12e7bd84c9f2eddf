"""The Helm chart, linted and rendered by a real helm binary, and its objects checked.

helm is built from its Go module by `bash e2e/toolchain/build.sh helm` into
${HYBRIDFLOW_CACHE:-~/.cache/hybridflow}/bin/helm-<version>/helm; $HELM or a helm on PATH also do.
Without one these tests skip, except under CI=true, where they fail. The last tests also apply the
rendered objects to a real kube-apiserver (server-side dry run) and check, as the operator's own
ServiceAccount, that its RBAC lets it create everything it renders for a job.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from hybridflow.api import crd as crdgen
from tests.helpers import minimal_apiserver, unavailable

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "hybridflow"
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
RELEASE = "hybridflow"
NAMESPACE = "hybridflow-system"
# helm built from its Go module without release ldflags assumes Kubernetes 1.20 when no cluster is
# asked; the chart requires 1.29+ (CEL validation rules), so say which version to render for.
KUBE_VERSION = "1.34.0"
BUILD_HINT = "build it with `bash e2e/toolchain/build.sh helm` (needs Go), or set HELM / put helm on PATH"


def _harness_binaries() -> Any:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    try:
        from e2e.harness import binaries
    except ImportError:
        return None
    return binaries


def find_helm() -> str | None:
    """$HELM, then the e2e harness's lookup (the pinned version), then any cached build, then PATH."""
    if os.environ.get("HELM"):
        return os.environ["HELM"]
    binaries = _harness_binaries()
    if binaries is not None:
        found = binaries.find("helm")
        if found is not None:
            return str(found)
    cache = Path(os.environ.get("HYBRIDFLOW_CACHE") or Path.home() / ".cache" / "hybridflow")
    cached = sorted(glob.glob(str(cache / "bin" / "helm-*" / "helm")))
    if cached:
        return cached[-1]
    return shutil.which("helm")


@pytest.fixture(scope="module")
def helm() -> str:
    path = find_helm()
    if path is None:
        unavailable(f"no helm binary: {BUILD_HINT}")
    return path


def run_helm(helm: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=120, check=False)


def render(helm: str, *sets: str, set_json: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION]
    for s in sets:
        args += ["--set", s]
    for s in set_json:
        args += ["--set-json", s]
    result = run_helm(helm, *args)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in by_kind(docs, kind) if name is None or d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (c,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return c


def env(docs: list[dict[str, Any]]) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container(docs)["env"]}


@pytest.fixture(scope="module")
def default(helm: str) -> list[dict[str, Any]]:
    return render(helm)


@pytest.fixture(scope="module")
def namespaced(helm: str) -> list[dict[str, Any]]:
    return render(helm, "watchNamespaces={a,b}")


# -- lint -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sets", [[], ["watchNamespaces={a,b}"], ["crds.install=false", "crds.keep=false"],
                                  ["metrics.serviceMonitor.enabled=true", "metrics.podMonitor.enabled=true"],
                                  ["networkPolicy.enabled=true", "watchNamespaces={a}"]])
def test_helm_lint(helm: str, sets: list[str]) -> None:
    args = ["lint", "--strict", str(CHART), "--kube-version", KUBE_VERSION]
    for s in sets:
        args += ["--set", s]
    result = run_helm(helm, *args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


def test_chart_metadata() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert (chart["apiVersion"], chart["name"], chart["version"], chart["appVersion"]) == (
        "v2",
        "hybridflow",
        "0.1.0",
        "0.1.0",
    )


# -- the operator Deployment ------------------------------------------------------------------------


def test_deployment_runs_one_operator_and_replaces_it_cleanly(default: list[dict[str, Any]]) -> None:
    deployment = one(default, "Deployment", RELEASE)
    assert deployment["metadata"]["namespace"] == NAMESPACE
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    pod = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert pod["spec"]["serviceAccountName"] == RELEASE


def test_operator_command_is_standalone_with_a_liveness_endpoint(default: list[dict[str, Any]]) -> None:
    c = container(default)
    assert c["image"] == "docker.io/hybridflow/operator:0.1.0"
    assert c["command"] == ["python", "-m", "hybridflow_operator"]
    assert c["args"] == ["--standalone", "--liveness=http://0.0.0.0:8080/healthz"]
    assert c["ports"] == [{"name": "health", "containerPort": 8080, "protocol": "TCP"},
                          {"name": "metrics", "containerPort": 8081, "protocol": "TCP"}]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert c["livenessProbe"]["failureThreshold"] >= 3
    # kopf's advice for operators: no readiness probe (nothing routes traffic to the pod by it)
    assert "readinessProbe" not in c and "startupProbe" not in c


def test_pod_is_locked_down(default: list[dict[str, Any]]) -> None:
    pod = one(default, "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 65532
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container(default)["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    # A read-only root needs somewhere writable for temporary files.
    assert {"name": "tmp", "mountPath": "/tmp"} in container(default)["volumeMounts"]
    assert {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}} in pod["volumes"]


def test_resources_come_from_values(default: list[dict[str, Any]]) -> None:
    assert container(default)["resources"] == VALUES["resources"]
    assert set(VALUES["resources"]) == {"requests", "limits"}


def test_environment(default: list[dict[str, Any]], namespaced: list[dict[str, Any]]) -> None:
    e = env(default)
    assert e["HYBRIDFLOW_WATCH_NAMESPACES"] == ""
    assert e["HYBRIDFLOW_LOG_LEVEL"] == "INFO"
    assert e["HYBRIDFLOW_RUNTIME_IMAGE"] == "docker.io/hybridflow/runtime:0.1.0"
    assert json.loads(e["HYBRIDFLOW_GPU_PRODUCTS"]) == VALUES["gpuProductLabels"]
    assert env(namespaced)["HYBRIDFLOW_WATCH_NAMESPACES"] == "a,b"


def test_gpu_map_and_runtime_image_equal_the_operator_defaults(default: list[dict[str, Any]]) -> None:
    """The chart passes the map explicitly; it must not silently differ from the built-in one."""
    settings = pytest.importorskip("hybridflow.k8s.settings")
    builtin = {k: list(v) for k, v in settings.DEFAULT_GPU_PRODUCTS.items()}
    assert VALUES["gpuProductLabels"] == builtin
    assert settings.parse_gpu_products(env(default)["HYBRIDFLOW_GPU_PRODUCTS"]) == dict(settings.DEFAULT_GPU_PRODUCTS)
    assert env(default)["HYBRIDFLOW_RUNTIME_IMAGE"] == settings.DEFAULT_RUNTIME_IMAGE


def test_overrides(helm: str) -> None:
    docs = render(
        helm,
        "image.tag=dev",
        "runtimeImage=registry.local/runtime:x",
        "logLevel=DEBUG",
        "gpuProductLabels.L4=null",
        "extraArgs={--verbose}",
        "serviceAccount.name=custom",
        set_json=('gpuProductLabels={"B300": ["NVIDIA-B300"]}',),
    )
    c = container(docs)
    assert c["image"] == "docker.io/hybridflow/operator:dev"
    assert c["args"][-1] == "--verbose"
    e = env(docs)
    assert e["HYBRIDFLOW_RUNTIME_IMAGE"] == "registry.local/runtime:x"
    assert e["HYBRIDFLOW_LOG_LEVEL"] == "DEBUG"
    # Helm merges maps: entries are added to the defaults, and null drops one.
    expected = {k: v for k, v in VALUES["gpuProductLabels"].items() if k != "L4"} | {"B300": ["NVIDIA-B300"]}
    assert json.loads(e["HYBRIDFLOW_GPU_PRODUCTS"]) == expected
    assert one(docs, "ServiceAccount")["metadata"]["name"] == "custom"
    for binding in by_kind(docs, "ClusterRoleBinding"):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "custom", "namespace": NAMESPACE}]


# -- RBAC -------------------------------------------------------------------------------------------

ALLOWED = {
    # (apiGroup, resource): {verb: why the operator needs it}
    ("hybridflow.io", "rltrainingjobs"): {
        "list": "the informer lists the jobs", "watch": "the informer watches the jobs",
        "get": "reads a job again when its RayJob vanished",
    },
    ("hybridflow.io", "rltrainingjobs/status"): {
        "patch": "writes the status; granted to each job's Ray pods (progress), and a Role grants only what "
                 "its creator holds",
    },
    ("ray.io", "rayjobs"): {
        "list": "the informer", "watch": "the informer", "get": "reads a child before patching it",
        "create": "the job's RayJob", "patch": "suspend, TTL, deadline and rollout replicas",
    },
    ("", "configmaps"): {"get": "reads a child", "create": "the job's config", "patch": "a changed spec"},
    ("", "serviceaccounts"): {"get": "reads a child", "create": "the Ray pods' identity",
                              "patch": "workload-identity annotations"},
    ("", "events"): {"create": "Events about the jobs"},
    ("", "pods"): {"list": "the informer of unbound Ray pods (Unschedulable)", "watch": "the same informer"},
    ("rbac.authorization.k8s.io", "roles"): {"get": "reads a child", "create": "the Ray pods' Role",
                                             "patch": "rules brought back to the rendered ones"},
    ("rbac.authorization.k8s.io", "rolebindings"): {"get": "reads a child", "create": "binds the Role",
                                                    "patch": "subjects brought back to the rendered ones"},
}
"""Every verb the chart grants the operator, with its reason. A verb not here fails the tests: add it only with
the request of the operator that needs it, as the reason."""
NETWORK_POLICY_ALLOWED = {
    ("networking.k8s.io", "networkpolicies"): {"get": "reads a child", "create": "each job's NetworkPolicy",
                                               "patch": "peers brought back to the configured ones"},
}
"""Granted only with networkPolicy.enabled."""
NAMESPACED_RULES = {resource: set(verbs) for resource, verbs in ALLOWED.items()}


def grants(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"], rule
        assert "resourceNames" not in rule or rule["resourceNames"], rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


def unjustified(granted: dict[tuple[str, str], set[str]], allowed: dict[tuple[str, str], dict[str, str]]) -> list[str]:
    """`group/resource: verb` for each grant the allow-list has no reason for."""
    return [f"{group or 'core'}/{resource}: {verb}" for (group, resource), verbs in sorted(granted.items())
            for verb in sorted(verbs) if verb not in allowed.get((group, resource), {})]


def assert_least_privilege(role: dict[str, Any], allowed: dict[tuple[str, str], dict[str, str]]) -> None:
    extra = unjustified(grants(role), allowed)
    assert not extra, (f"{role['kind']} {role['metadata']['name']} grants more than the allow-list: {extra}. "
                       "Justify each new verb in ALLOWED (tests/test_chart.py) with the request that needs it, "
                       "or drop it from the chart")
    missing = unjustified({k: set(v) for k, v in allowed.items()}, {k: dict.fromkeys(v) for k, v in
                                                                    grants(role).items()})
    assert not missing, f"the chart no longer grants {missing}: drop them from ALLOWED too"


def test_every_verb_the_operator_holds_is_justified(helm: str, default: list[dict[str, Any]],
                                                    namespaced: list[dict[str, Any]]) -> None:
    assert_least_privilege(one(default, "ClusterRole"), ALLOWED)
    for role in by_kind(namespaced, "Role"):
        assert_least_privilege(role, ALLOWED)
    with_policy = render(helm, "networkPolicy.enabled=true")
    assert_least_privilege(one(with_policy, "ClusterRole"), ALLOWED | NETWORK_POLICY_ALLOWED)


def test_the_allow_list_check_fails_on_a_new_verb(default: list[dict[str, Any]]) -> None:
    role = json.loads(json.dumps(one(default, "ClusterRole")))
    role["rules"].append({"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]})
    with pytest.raises(AssertionError, match=r"core/secrets: get.*Justify"):
        assert_least_privilege(role, ALLOWED)
    role["rules"][-1] = {"apiGroups": ["ray.io"], "resources": ["rayjobs"], "verbs": ["delete"]}
    with pytest.raises(AssertionError, match=r"ray\.io/rayjobs: delete"):
        assert_least_privilege(role, ALLOWED)


def test_cluster_wide_rbac(default: list[dict[str, Any]]) -> None:
    assert by_kind(default, "Role") == [] and by_kind(default, "RoleBinding") == []
    assert grants(one(default, "ClusterRole")) == NAMESPACED_RULES
    binding = one(default, "ClusterRoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": RELEASE}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": RELEASE, "namespace": NAMESPACE}]


def test_namespaced_rbac(namespaced: list[dict[str, Any]]) -> None:
    assert by_kind(namespaced, "ClusterRole") == [] and by_kind(namespaced, "ClusterRoleBinding") == [], \
        "nothing cluster-wide: kopf scans no CRDs or namespaces, and the jobs' namespaces are listed"
    roles = by_kind(namespaced, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["a", "b"]
    for role in roles:
        assert grants(role) == NAMESPACED_RULES
    bindings = by_kind(namespaced, "RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["a", "b"]
    for binding in bindings:
        assert binding["roleRef"]["kind"] == "Role" and binding["roleRef"]["name"] == RELEASE
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": RELEASE, "namespace": NAMESPACE}]


def test_rbac_can_be_left_to_the_cluster_admin(helm: str) -> None:
    docs = render(helm, "rbac.create=false", "serviceAccount.create=false", "serviceAccount.name=operator")
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")]
    assert by_kind(docs, "ServiceAccount") == []
    assert one(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "operator"


def test_the_operator_holds_what_it_grants_to_ray_pods(default: list[dict[str, Any]]) -> None:
    """RBAC refuses to let the operator create a Role granting more than the operator holds."""
    held = grants(one(default, "ClusterRole", RELEASE))
    render = pytest.importorskip("hybridflow.k8s.render")
    settings = pytest.importorskip("hybridflow.k8s.settings")
    job = yaml.safe_load((ROOT / "examples" / "ppo-job.yaml").read_text())
    children = render.render_children(job, settings.RenderSettings())
    roles = [c for c in children if c["kind"] == "Role"]
    assert roles, "the operator renders a Role for the Ray pods"
    for role in roles:
        for (group, resource), verbs in grants(role).items():
            assert verbs <= held.get((group, resource), set()), (group, resource, verbs)
    for child in children:
        group = child["apiVersion"].rpartition("/")[0]
        plural = {"ConfigMap": "configmaps", "ServiceAccount": "serviceaccounts", "Role": "roles"}
        plural |= {"RoleBinding": "rolebindings", "RayJob": "rayjobs"}
        assert "create" in held[(group, plural[child["kind"]])], child["kind"]


# -- NetworkPolicy ---------------------------------------------------------------------------------


def test_network_policies_are_off_by_default(default: list[dict[str, Any]]) -> None:
    assert "HYBRIDFLOW_NETWORK_POLICY_PEERS" not in env(default)
    assert ("networking.k8s.io", "networkpolicies") not in grants(one(default, "ClusterRole"))


def test_network_policies_admit_the_operator_and_kuberay(helm: str) -> None:
    from hybridflow.k8s.settings import RenderSettings

    docs = render(helm, "networkPolicy.enabled=true")
    peers_env = "HYBRIDFLOW_NETWORK_POLICY_PEERS"
    settings = RenderSettings.from_env({peers_env: env(docs)[peers_env]})
    operator, kuberay = settings.network_policy_peers or ()
    assert operator["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}}
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert operator["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert kuberay == {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name":
                                                                                "kuberay-operator"}}}
    narrowed = render(helm, "networkPolicy.enabled=true", set_json=(
        'networkPolicy.ingressFrom=[{"namespaceSelector": {"matchLabels": '
        '{"kubernetes.io/metadata.name": "ray-system"}}}]',))
    peers = json.loads(env(narrowed)["HYBRIDFLOW_NETWORK_POLICY_PEERS"])
    assert peers[1:] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ray-system"}}}]


# -- CRD --------------------------------------------------------------------------------------------


def test_crd_is_installed_and_kept_by_default(default: list[dict[str, Any]]) -> None:
    crd = one(default, "CustomResourceDefinition")
    assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert crd["metadata"]["labels"]["app.kubernetes.io/part-of"] == "hybridflow"
    assert crd["spec"] == crdgen.crd()["spec"]


def test_crd_only_when_asked(helm: str) -> None:
    assert by_kind(render(helm, "crds.install=false"), "CustomResourceDefinition") == []
    crd = one(render(helm, "crds.keep=false"), "CustomResourceDefinition")
    assert "annotations" not in crd["metadata"]


def test_every_object_is_labelled(default: list[dict[str, Any]], namespaced: list[dict[str, Any]]) -> None:
    for doc in default + namespaced:
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == RELEASE, doc["kind"]
        assert labels["app.kubernetes.io/managed-by"] == "Helm", doc["kind"]


# -- metrics ----------------------------------------------------------------------------------------


def test_operator_metrics_have_a_service_and_no_prometheus_operator_objects_by_default(
        default: list[dict[str, Any]]) -> None:
    assert env(default)["HYBRIDFLOW_METRICS_PORT"] == "8081"
    service = one(default, "Service", f"{RELEASE}-metrics")
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 8081, "targetPort": "metrics", "protocol": "TCP"}]
    pod_labels = one(default, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert by_kind(default, "ServiceMonitor") == [] and by_kind(default, "PodMonitor") == []


def test_metrics_port_zero_serves_none(helm: str) -> None:
    docs = render(helm, "metrics.port=0")
    assert by_kind(docs, "Service") == []
    assert [p["name"] for p in container(docs)["ports"]] == ["health"]
    assert env(docs)["HYBRIDFLOW_METRICS_PORT"] == "0"


def test_service_monitor_scrapes_the_metrics_service(helm: str) -> None:
    docs = render(helm, "metrics.serviceMonitor.enabled=true", "metrics.serviceMonitor.labels.release=prom")
    monitor = one(docs, "ServiceMonitor")
    service = one(docs, "Service", f"{RELEASE}-metrics")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "30s"}]


def test_pod_monitor_scrapes_every_jobs_ray_pods_under_hybridflow_names(helm: str) -> None:
    from hybridflow import telemetry
    from hybridflow.k8s.names import JOB_LABEL

    monitor = one(render(helm, "metrics.podMonitor.enabled=true"), "PodMonitor")
    assert monitor["spec"]["selector"] == {"matchExpressions": [{"key": JOB_LABEL, "operator": "Exists"}]}
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics"  # the port KubeRay adds to every Ray container (8080)
    (rename,) = endpoint["metricRelabelings"]
    assert rename["regex"] == f"{telemetry.RAY_PREFIX}({telemetry.PREFIX}.*)" and rename["replacement"] == "$1"
    namespaced = one(render(helm, "metrics.podMonitor.enabled=true", "watchNamespaces={a,b}"), "PodMonitor")
    assert namespaced["spec"]["namespaceSelector"] == {"matchNames": ["a", "b"]}


def test_grafana_dashboard_ships_in_a_sidecar_configmap(default: list[dict[str, Any]], helm: str) -> None:
    cm = one(default, "ConfigMap", f"{RELEASE}-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads(cm["data"]["hybridflow.json"])
    assert shipped == json.loads((CHART / "dashboards" / "hybridflow.json").read_text())
    exprs = [t["expr"] for p in shipped["panels"] for t in p.get("targets", [])]
    assert exprs and all("hybridflow_" in e for e in exprs)
    moved = one(render(helm, "metrics.dashboard.namespace=grafana"), "ConfigMap", f"{RELEASE}-dashboard")
    assert moved["metadata"]["namespace"] == "grafana"
    assert by_kind(render(helm, "metrics.dashboard.enabled=false"), "ConfigMap") == []


# -- against a real API server ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def apiserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """etcd + kube-apiserver (RBAC on) with the CRDs the chart and the operator's objects need."""
    from e2e.harness import binaries

    kuberay = binaries.kuberay_crd_dir()
    with minimal_apiserver(tmp_path_factory, sorted(kuberay.glob("ray.io_*.yaml")) if kuberay else []) as cp:
        cp.has_kuberay_crds = kuberay is not None
        yield cp


def eventually(check: Callable[[], bool], timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.5)
    return False


def kubectl(cp: Any, *args: str, objects: list[dict[str, Any]] | None = None) -> subprocess.CompletedProcess[str]:
    body = json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}) if objects is not None else None
    return cp.kubectl(*args, input=body, check=False, timeout=120)


@pytest.mark.controlplane
@pytest.mark.parametrize("mode", ["cluster-wide", "namespaced"])
def test_rendered_chart_is_accepted_and_its_rbac_suffices(helm: str, apiserver: Any, mode: str) -> None:
    namespaces = ["team-a", "team-b"] if mode == "namespaced" else []
    sets = [f"watchNamespaces={{{','.join(namespaces)}}}"] if namespaces else []
    release_ns = f"hf-{mode}"
    args = ["template", RELEASE, str(CHART), "--namespace", release_ns, "--kube-version", KUBE_VERSION]
    for s in [*sets, f"fullnameOverride=hf-{mode}"]:
        args += ["--set", s]
    result = run_helm(helm, *args)
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    namespace_objs = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n}} for n in [release_ns, *namespaces, "jobs"]
    ]
    created = kubectl(apiserver, "apply", "--server-side", "--field-manager=test", "-f", "-", objects=namespace_objs)
    assert created.returncode == 0, created.stderr
    applied = kubectl(apiserver, "apply", "--server-side", "--field-manager=helm", "-f", "-", objects=docs)
    assert applied.returncode == 0, applied.stderr
    jsonpath = 'jsonpath={.status.conditions[?(@.type=="Established")].status}'
    established = eventually(
        lambda: kubectl(apiserver, "get", f"crd/{crdgen.CRD_NAME}", "-o", jsonpath).stdout == "True"
    )
    assert established, f"{crdgen.CRD_NAME} never became Established"
    kuberay = apiserver.has_kuberay_crds

    sa = f"system:serviceaccount:{release_ns}:hf-{mode}"
    job_ns = namespaces[0] if namespaces else "jobs"
    checks = [
        ("watch", "rltrainingjobs.hybridflow.io"),
        ("patch", "rltrainingjobs.hybridflow.io", "--subresource=status"),
        ("create", "roles.rbac.authorization.k8s.io"),
        ("create", "events"),
    ]
    if kuberay:  # kubectl resolves resource names through discovery: ray.io exists only with its CRDs
        checks += [("create", "rayjobs.ray.io"), ("watch", "rayjobs.ray.io")]
    for verb, resource, *more in checks:
        can = kubectl(apiserver, "auth", "can-i", verb, resource, *more, "-n", job_ns, f"--as={sa}")
        assert can.stdout.strip() == "yes", (verb, resource, can.stdout, can.stderr)
    spec_patch = kubectl(apiserver, "auth", "can-i", "patch", "rltrainingjobs.hybridflow.io", "-n", job_ns,
                         f"--as={sa}")
    assert spec_patch.stdout.strip() == "no", "the operator writes a job's status, never its spec"
    assert kubectl(apiserver, "auth", "can-i", "list", "namespaces", f"--as={sa}").stdout.strip() == "no"
    assert kubectl(apiserver, "auth", "can-i", "get", "secrets", "-n", job_ns, f"--as={sa}").stdout.strip() == "no"
    if namespaces:
        other = kubectl(apiserver, "auth", "can-i", "watch", "rltrainingjobs.hybridflow.io", "-n", "jobs", f"--as={sa}")
        assert other.stdout.strip() == "no", "namespaced mode must not reach unwatched namespaces"

    # Everything the operator renders for a job, created as the operator: this is where RBAC's
    # escalation check (a Role may grant only what its creator holds) would bite.
    render = pytest.importorskip("hybridflow.k8s.render")
    settings = pytest.importorskip("hybridflow.k8s.settings")
    job = yaml.safe_load((ROOT / "examples" / "ppo-job.yaml").read_text())
    job["metadata"]["namespace"] = job_ns
    children = render.render_children(job, settings.RenderSettings())
    if not kuberay:
        children = [c for c in children if c["kind"] != "RayJob"]
    for child in children:
        child.setdefault("metadata", {})["namespace"] = job_ns
    # A real create, not a dry run: binding a Role is checked against the Role, which must exist.
    made = kubectl(apiserver, "create", "-f", "-", f"--as={sa}", objects=children)
    assert made.returncode == 0, made.stderr
