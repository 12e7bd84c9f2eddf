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

import jsonschema
import pydantic
import pytest
import yaml

from hybridflow.api import crd as crdgen
from hybridflow.api import generated
from hybridflow_operator import install_check
from hybridflow_operator.chart import __main__ as chart_files
from hybridflow_operator.chart import values as chart_values
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


# -- values: the model, the schema and README generated from it -------------------------------------------

SCHEMA = json.loads((CHART / "values.schema.json").read_text())


def value_paths(values: dict[str, Any], schema: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any, Any]]:
    """(key path, schema node, value) of every key in `values`, into the objects the schema models key by key."""
    for key, value in values.items():
        node = schema.get("properties", {}).get(key)
        yield f"{prefix}{key}", node, value
        if node is not None and "properties" in node and isinstance(value, dict):
            yield from value_paths(value, node, f"{prefix}{key}.")


def test_values_yaml_holds_the_models_defaults() -> None:
    chart_values.ChartValues.model_validate(VALUES)
    assert chart_values.defaults() == VALUES


def test_every_key_of_values_yaml_has_a_type_default_and_description() -> None:
    paths = list(value_paths(VALUES, SCHEMA))
    assert len(paths) > 50
    for path, node, value in paths:
        assert node is not None, f"{path} is not in values.schema.json"
        assert node.get("description"), f"{path} has no description"
        assert "type" in node or "anyOf" in node, f"{path} has no type"
        if "properties" not in node:
            assert node["default"] == value, path


def test_values_yaml_validates_against_the_schema_and_every_modelled_object_is_closed() -> None:
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    jsonschema.Draft7Validator(SCHEMA).validate(VALUES)

    def objects(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
        if "properties" in node:
            yield path, node
            for key, child in node["properties"].items():
                yield from objects(child, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            yield from objects(node["items"], f"{path}[]")

    closed = list(objects(SCHEMA, ""))
    assert len(closed) >= 15
    for path, node in closed:
        assert node.get("additionalProperties") is False, f"{path or '.'} accepts unknown keys"
    assert set(SCHEMA["properties"]) == set(VALUES) | {"global"}  # Helm adds `global` to every chart's values


def test_schema_and_readme_are_generated_from_the_model() -> None:
    problems = generated.stale(chart_files.outputs(CHART))
    assert not problems, "\n".join(problems) + "\nrun `make chart-files`"


def test_readme_has_a_row_for_every_value_and_install_upgrade_test_sections() -> None:
    readme = (CHART / "README.md").read_text()
    for path, node, value in value_paths(VALUES, SCHEMA):
        row = next((line for line in readme.splitlines() if line.startswith(f"| `{path}` |")), None)
        assert row is not None, f"README.md has no row for {path}"
        if "properties" not in node:
            assert f"`{json.dumps(value, separators=(', ', ': '))}`" in row, path
    for heading in ("## Install", "## Upgrade", "## Test", "## Values"):
        assert heading in readme
    assert "| `tolerations[].effect` | one of \"NoSchedule\", \"PreferNoSchedule\" or \"NoExecute\" |" in readme
    assert "`docker.io/hybridflow/runtime:<appVersion>`" in readme  # a code span, not an HTML tag


def test_check_names_each_stale_file_and_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert chart_files.main(["--chart", str(tmp_path)]) == 0
    assert chart_files.main(["--check", "--chart", str(tmp_path)]) == 0
    readme, schema = tmp_path / chart_files.README_FILE, tmp_path / chart_files.SCHEMA_FILE
    readme.write_text(readme.read_text().replace("| `logLevel` |", "| `loglevel` |"))
    schema.unlink()
    capsys.readouterr()
    assert chart_files.main(["--check", "--chart", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"{readme}: out of date" in err and "-| `loglevel` |" in err and "+| `logLevel` |" in err
    assert f"{schema}: missing" in err and "make chart-files" in err
    assert not schema.exists()  # --check writes nothing


BAD_VALUES = [
    pytest.param({"image": {"tga": "x"}}, "at '/image': additional properties 'tga' not allowed", id="typo"),
    pytest.param({"watchNamespace": ["a"]}, "at '': additional properties 'watchNamespace' not allowed",
                 id="top-level-typo"),
    pytest.param({"tolerations": [{"key": "k", "efect": "NoSchedule"}]},
                 "at '/tolerations/0': additional properties 'efect' not allowed", id="typo-in-a-list"),
    pytest.param({"health": {"port": "8080"}}, "at '/health/port': got string, want integer", id="wrong-type"),
    pytest.param({"rbac": {"aggregateRoles": "yes"}}, "at '/rbac/aggregateRoles': got string, want boolean",
                 id="wrong-type-bool"),
    pytest.param({"logLevel": "debug"}, "at '/logLevel': value must be one of 'DEBUG', 'INFO', 'WARNING', 'ERROR'",
                 id="not-allowed"),
]


@pytest.mark.parametrize(("bad", "message"), BAD_VALUES)
def test_helm_refuses_unknown_keys_and_wrong_types_naming_them(
        helm: str, tmp_path: Path, bad: dict[str, Any], message: str) -> None:
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(bad))
    for command in (["template", RELEASE], ["lint", "--strict"]):
        result = run_helm(helm, *command, str(CHART), "--kube-version", KUBE_VERSION, "-f", str(values_file))
        assert result.returncode != 0, (command, result.stdout)
        said = result.stderr + result.stdout
        assert "values don't meet the specifications of the schema" in said, said
        assert message in said, said
    with pytest.raises(pydantic.ValidationError):  # the model refuses what its schema refuses
        chart_values.ChartValues.model_validate(merged(VALUES, bad))


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Helm's merge of a values file over the defaults: maps merge key by key, everything else is replaced."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def test_helm_accepts_global_values_and_dropped_gpu_types(helm: str) -> None:
    """Helm hands a subchart its parent's `global`; null removes a map entry before validation."""
    docs = render(helm, "global.imageRegistry=registry.local", "gpuProductLabels.L4=null")
    assert "L4" not in json.loads(env(docs)["HYBRIDFLOW_GPU_PRODUCTS"])


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
    assert e["HYBRIDFLOW_PROGRESS_INTERVAL"] == "5"
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
        set_json=('gpuProductLabels={"B300": ["NVIDIA-B300"]}', "progressInterval=0.5"),  # --set reads 0.5 as text
    )
    c = container(docs)
    assert c["image"] == "docker.io/hybridflow/operator:dev"
    assert c["args"][-1] == "--verbose"
    e = env(docs)
    assert e["HYBRIDFLOW_RUNTIME_IMAGE"] == "registry.local/runtime:x"
    assert e["HYBRIDFLOW_LOG_LEVEL"] == "DEBUG"
    assert e["HYBRIDFLOW_PROGRESS_INTERVAL"] == "0.5"
    # Helm merges maps: entries are added to the defaults, and null drops one.
    expected = {k: v for k, v in VALUES["gpuProductLabels"].items() if k != "L4"} | {"B300": ["NVIDIA-B300"]}
    assert json.loads(e["HYBRIDFLOW_GPU_PRODUCTS"]) == expected
    assert one(docs, "ServiceAccount", "custom")["metadata"]["namespace"] == NAMESPACE
    binding = one(docs, "ClusterRoleBinding", RELEASE)
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
    assert_least_privilege(one(default, "ClusterRole", RELEASE), ALLOWED)
    for role in named(namespaced, ("Role",), RELEASE):
        assert_least_privilege(role, ALLOWED)
    with_policy = render(helm, "networkPolicy.enabled=true")
    assert_least_privilege(one(with_policy, "ClusterRole", RELEASE), ALLOWED | NETWORK_POLICY_ALLOWED)


def test_the_allow_list_check_fails_on_a_new_verb(default: list[dict[str, Any]]) -> None:
    role = json.loads(json.dumps(one(default, "ClusterRole", RELEASE)))
    role["rules"].append({"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]})
    with pytest.raises(AssertionError, match=r"core/secrets: get.*Justify"):
        assert_least_privilege(role, ALLOWED)
    role["rules"][-1] = {"apiGroups": ["ray.io"], "resources": ["rayjobs"], "verbs": ["delete"]}
    with pytest.raises(AssertionError, match=r"ray\.io/rayjobs: delete"):
        assert_least_privilege(role, ALLOWED)


def named(docs: list[dict[str, Any]], kinds: tuple[str, ...], name: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in kinds and d["metadata"]["name"] == name]


def test_cluster_wide_rbac(default: list[dict[str, Any]]) -> None:
    assert named(default, ("Role", "RoleBinding"), RELEASE) == []
    assert grants(one(default, "ClusterRole", RELEASE)) == NAMESPACED_RULES
    binding = one(default, "ClusterRoleBinding", RELEASE)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": RELEASE}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": RELEASE, "namespace": NAMESPACE}]


def test_namespaced_rbac(namespaced: list[dict[str, Any]]) -> None:
    assert named(namespaced, ("ClusterRole", "ClusterRoleBinding"), RELEASE) == [], \
        "nothing cluster-wide: kopf scans no CRDs or namespaces, and the jobs' namespaces are listed"
    operator = {"kind": "ServiceAccount", "name": RELEASE, "namespace": NAMESPACE}
    assert not [b for b in by_kind(namespaced, "ClusterRoleBinding") if operator in b["subjects"]]
    roles = named(namespaced, ("Role",), RELEASE)
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["a", "b"]
    for role in roles:
        assert grants(role) == NAMESPACED_RULES
    bindings = named(namespaced, ("RoleBinding",), RELEASE)
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
    assert ("networking.k8s.io", "networkpolicies") not in grants(one(default, "ClusterRole", RELEASE))


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


# -- users' roles, aggregated into the built-in admin, edit and view ----------------------------------------

AGGREGATE = "rbac.authorization.k8s.io/aggregate-to-"


def aggregated_to(role: dict[str, Any]) -> set[str]:
    labels = role["metadata"]["labels"]
    return {k.removeprefix(AGGREGATE) for k, v in labels.items() if k.startswith(AGGREGATE) and v == "true"}


def test_aggregate_roles_let_edit_write_jobs_and_view_read_them(default: list[dict[str, Any]]) -> None:
    edit = one(default, "ClusterRole", f"{RELEASE}-edit")
    assert aggregated_to(edit) == {"admin", "edit"}
    assert grants(edit) == {
        ("hybridflow.io", "rltrainingjobs"): {"get", "list", "watch", "create", "update", "patch", "delete",
                                              "deletecollection"},
        ("hybridflow.io", "rltrainingjobs/status"): {"get", "list", "watch"},  # the operator's alone to write
    }
    view = one(default, "ClusterRole", f"{RELEASE}-view")
    assert aggregated_to(view) == {"view"}
    assert grants(view) == {("hybridflow.io", "rltrainingjobs"): {"get", "list", "watch"},
                            ("hybridflow.io", "rltrainingjobs/status"): {"get", "list", "watch"}}
    assert view["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
    refs = [b["roleRef"]["name"] for b in by_kind(default, "ClusterRoleBinding") + by_kind(default, "RoleBinding")]
    assert f"{RELEASE}-edit" not in refs and f"{RELEASE}-view" not in refs  # aggregated, never bound


def test_aggregate_roles_only_when_asked(helm: str, namespaced: list[dict[str, Any]]) -> None:
    assert {f"{RELEASE}-edit", f"{RELEASE}-view"} <= {r["metadata"]["name"] for r in by_kind(namespaced, "ClusterRole")}
    for sets in (["rbac.aggregateRoles=false"], ["rbac.create=false"]):
        roles = by_kind(render(helm, *sets), "ClusterRole")
        assert not [r for r in roles if aggregated_to(r)], sets


# -- helm test ----------------------------------------------------------------------------------------------

TEST_HOOK = "templates/tests/install-check.yaml"


def test_helm_test_pod_checks_the_install_from_the_operator_image(helm: str, default: list[dict[str, Any]]) -> None:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION,
            "--show-only", TEST_HOOK, "--set", "tolerations[0].operator=Exists", "--set", "image.tag=dev"]
    result = run_helm(helm, *args)
    assert result.returncode == 0, result.stderr
    (pod,) = [d for d in yaml.safe_load_all(result.stdout) if d]
    assert pod["kind"] == "Pod" and pod["metadata"]["name"] == f"{RELEASE}-test"
    assert pod["metadata"]["annotations"] == {
        "helm.sh/hook": "test",
        "helm.sh/hook-delete-policy": "before-hook-creation,hook-succeeded",
        # Helm prints the pod's report before deleting it (`helm test --logs` would look after the deletion).
        "helm.sh/hook-output-log-policy": "hook-succeeded,hook-failed",
    }
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never" and spec["serviceAccountName"] == f"{RELEASE}-test"
    assert spec["tolerations"] == [{"operator": "Exists"}]  # schedules wherever the operator may
    assert spec["securityContext"] == VALUES["podSecurityContext"]
    (c,) = spec["containers"]
    assert c["image"] == "docker.io/hybridflow/operator:dev"
    assert c["securityContext"] == VALUES["securityContext"]
    assert c["command"] == ["python", "-m", "hybridflow_operator.install_check"]
    args_seen = install_check.parse_args(c["args"])
    assert (args_seen.crd, args_seen.deployment, args_seen.namespace) == (crdgen.CRD_NAME, RELEASE, NAMESPACE)
    assert one(default, "Deployment")["metadata"]["name"] == args_seen.deployment


def test_helm_test_identity_may_only_get_the_crd_and_the_deployment(default: list[dict[str, Any]]) -> None:
    test = f"{RELEASE}-test"
    assert one(default, "ServiceAccount", test)["metadata"]["namespace"] == NAMESPACE
    assert one(default, "ClusterRole", test)["rules"] == [
        {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"],
         "resourceNames": [crdgen.CRD_NAME], "verbs": ["get"]}]
    role = one(default, "Role", test)
    assert role["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == [{"apiGroups": ["apps"], "resources": ["deployments"], "resourceNames": [RELEASE],
                              "verbs": ["get"]}]
    subject = [{"kind": "ServiceAccount", "name": test, "namespace": NAMESPACE}]
    for kind, role_kind in (("ClusterRoleBinding", "ClusterRole"), ("RoleBinding", "Role")):
        binding = one(default, kind, test)
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": role_kind, "name": test}
        assert binding["subjects"] == subject


def test_no_helm_test_without_rbac(helm: str) -> None:
    docs = render(helm, "rbac.create=false", "serviceAccount.create=false", "serviceAccount.name=operator")
    assert by_kind(docs, "Pod") == []


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


def apply_chart(helm: str, cp: Any, release_ns: str, *sets: str, namespaces: tuple[str, ...] = ()) -> None:
    """Render the chart as release `release_ns` (its objects named after it too) and apply it with the
    namespaces it needs, the way helm would; wait until the CRD is Established."""
    args = ["template", RELEASE, str(CHART), "--namespace", release_ns, "--kube-version", KUBE_VERSION]
    for s in [*sets, f"fullnameOverride={release_ns}"]:
        args += ["--set", s]
    result = run_helm(helm, *args)
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    namespace_objs = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n}} for n in [release_ns, *namespaces, "jobs"]
    ]
    created = kubectl(cp, "apply", "--server-side", "--field-manager=test", "-f", "-", objects=namespace_objs)
    assert created.returncode == 0, created.stderr
    applied = kubectl(cp, "apply", "--server-side", "--field-manager=helm", "-f", "-", objects=docs)
    assert applied.returncode == 0, applied.stderr
    jsonpath = 'jsonpath={.status.conditions[?(@.type=="Established")].status}'
    established = eventually(lambda: kubectl(cp, "get", f"crd/{crdgen.CRD_NAME}", "-o", jsonpath).stdout == "True")
    assert established, f"{crdgen.CRD_NAME} never became Established"


def can(cp: Any, who: str, verb: str, *what: str) -> bool:
    answer = kubectl(cp, "auth", "can-i", verb, *what, f"--as={who}").stdout.strip()
    assert answer in ("yes", "no"), answer
    return answer == "yes"


@pytest.mark.controlplane
@pytest.mark.parametrize("mode", ["cluster-wide", "namespaced"])
def test_rendered_chart_is_accepted_and_its_rbac_suffices(helm: str, apiserver: Any, mode: str) -> None:
    namespaces = ["team-a", "team-b"] if mode == "namespaced" else []
    sets = [f"watchNamespaces={{{','.join(namespaces)}}}"] if namespaces else []
    release_ns = f"hf-{mode}"
    apply_chart(helm, apiserver, release_ns, *sets, namespaces=tuple(namespaces))
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
        answer = kubectl(apiserver, "auth", "can-i", verb, resource, *more, "-n", job_ns, f"--as={sa}")
        assert answer.stdout.strip() == "yes", (verb, resource, answer.stdout, answer.stderr)
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


@pytest.mark.controlplane
def test_aggregate_roles_grant_users_jobs_but_never_their_status(helm: str, apiserver: Any) -> None:
    """The rules of the aggregated roles, bound directly (this API server runs no aggregation controller)."""
    release_ns = "hf-users"
    apply_chart(helm, apiserver, release_ns)
    bindings = [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": f"{user}-{role}", "namespace": "jobs"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": f"{release_ns}-{role}"},
         "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]}
        for user, role in (("alice", "edit"), ("bob", "view"))
    ]
    made = kubectl(apiserver, "apply", "--server-side", "--field-manager=test", "-f", "-", objects=bindings)
    assert made.returncode == 0, made.stderr
    rlj = "rltrainingjobs.hybridflow.io"
    for verb in ("create", "patch", "delete", "list", "watch"):
        assert can(apiserver, "alice", verb, rlj, "-n", "jobs"), verb
    assert can(apiserver, "alice", "get", rlj, "--subresource=status", "-n", "jobs")
    assert not can(apiserver, "alice", "patch", rlj, "--subresource=status", "-n", "jobs")
    assert not can(apiserver, "alice", "create", rlj, "-n", "default")  # only where bound
    for verb in ("get", "list", "watch"):
        assert can(apiserver, "bob", verb, rlj, "-n", "jobs"), verb
    assert can(apiserver, "bob", "get", rlj, "--subresource=status", "-n", "jobs")
    assert not can(apiserver, "bob", "create", rlj, "-n", "jobs")
    assert not can(apiserver, "bob", "delete", rlj, "-n", "jobs")


@pytest.mark.controlplane
def test_install_check_reads_what_it_needs_and_passes_once_the_operator_is_available(
        helm: str, apiserver: Any, tmp_path: Path) -> None:
    """`helm test`'s check, run as the test pod's ServiceAccount (a TokenRequest token) against a real API server:
    nothing runs the Deployment here, so it fails until its status is written the way its controller would."""
    release_ns = "hf-check"
    apply_chart(helm, apiserver, release_ns)
    test_sa = f"system:serviceaccount:{release_ns}:{release_ns}-test"
    assert can(apiserver, test_sa, "get", f"customresourcedefinitions/{crdgen.CRD_NAME}")
    assert can(apiserver, test_sa, "get", f"deployments.apps/{release_ns}", "-n", release_ns)
    assert not can(apiserver, test_sa, "list", "customresourcedefinitions")
    assert not can(apiserver, test_sa, "get", "customresourcedefinitions/rayjobs.ray.io")
    assert not can(apiserver, test_sa, "list", "deployments.apps", "-n", release_ns)
    assert not can(apiserver, test_sa, "get", "deployments.apps/other", "-n", release_ns)
    assert not can(apiserver, test_sa, "get", "secrets", "-n", release_ns)

    token = kubectl(apiserver, "create", "token", f"{release_ns}-test", "-n", release_ns, "--duration=10m")
    assert token.returncode == 0, token.stderr
    admin = yaml.safe_load(apiserver.kubeconfig.read_text())
    kubeconfig = tmp_path / "test-pod.kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "clusters": admin["clusters"],
        "users": [{"name": "test", "user": {"token": token.stdout.strip()}}],
        "contexts": [{"name": "test", "context": {"cluster": admin["clusters"][0]["name"], "user": "test"}}],
        "current-context": "test",
    }))
    source = os.pathsep.join(str(ROOT / d) for d in ("runtime", "operator"))
    run_env = {**os.environ, "KUBECONFIG": str(kubeconfig),
               "PYTHONPATH": os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH")) if p)}
    command = [sys.executable, "-m", "hybridflow_operator.install_check", f"--deployment={release_ns}",
               f"--namespace={release_ns}", "--timeout=0"]

    before = subprocess.run(command, env=run_env, capture_output=True, text=True, timeout=120, check=False)
    assert before.returncode == 1, before.stdout + before.stderr
    assert f"ok   CustomResourceDefinition {crdgen.CRD_NAME}: Established=True" in before.stdout
    assert f"FAIL Deployment {release_ns}/{release_ns}: " in before.stdout
    assert "HTTP" not in before.stdout and "Traceback" not in before.stderr  # refused nothing

    generation = json.loads(kubectl(apiserver, "get", "deployment", release_ns, "-n", release_ns,
                                    "-o", "json").stdout)["metadata"]["generation"]
    status = {"status": {"observedGeneration": generation, "replicas": 1, "readyReplicas": 1,
                         "availableReplicas": 1, "updatedReplicas": 1, "conditions": [
                             {"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable",
                              "message": "Deployment has minimum availability.",
                              "lastUpdateTime": "2026-01-01T00:00:00Z",
                              "lastTransitionTime": "2026-01-01T00:00:00Z"}]}}
    patched = kubectl(apiserver, "patch", "deployment", release_ns, "-n", release_ns, "--subresource=status",
                      "--type=merge", "-p", json.dumps(status))
    assert patched.returncode == 0, patched.stderr

    after = subprocess.run(command, env=run_env, capture_output=True, text=True, timeout=120, check=False)
    assert after.returncode == 0, after.stdout + after.stderr
    assert after.stdout.splitlines() == [
        f"ok   CustomResourceDefinition {crdgen.CRD_NAME}: Established=True (InitialNamesAccepted: the initial "
        "names have been accepted); serves v1alpha1",
        f"ok   Deployment {release_ns}/{release_ns}: Available=True (MinimumReplicasAvailable: Deployment has "
        "minimum availability.); 1/1 available",
        install_check.PASSED,
    ]
