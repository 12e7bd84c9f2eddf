"""The generated RLTrainingJob CRD: structural, in sync with the models and the committed files, and
enforced for real.

The schema tests walk the CRD and validate the examples with `jsonschema`. CEL rules cannot be
evaluated by jsonschema, so the admission tests create and update objects on a real kube-apiserver
(etcd + kube-apiserver from the e2e harness); they skip when those binaries are absent, except under
CI=true, where they must run.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from hybridflow.api import crd as crdgen
from hybridflow.api.spec import RLTrainingJobSpec
from tests.helpers import BAD_POD_SETTINGS, HUB_NAMES, BadPodSetting, HubName, hub_name_spec

ROOT = Path(__file__).resolve().parents[1]
CRDS_DIR = ROOT / "crds"
CHART_DIR = ROOT / "charts" / "hybridflow"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    return crdgen.crd()


@pytest.fixture(scope="module")
def schema(crd: dict[str, Any]) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def walk(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema node with its path (`.spec.cluster.workerGroups[].name`)."""
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from walk(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}{{}}")


def at(schema: dict[str, Any], path: str) -> dict[str, Any]:
    nodes = dict(walk(schema))
    assert path in nodes, f"no schema node at {path}"
    return nodes[path]


def rules_at(schema: dict[str, Any], path: str) -> list[dict[str, str]]:
    return at(schema, path).get("x-kubernetes-validations", [])


# -- structure -------------------------------------------------------------------------------------

FORBIDDEN_KEYS = {"$ref", "$defs", "anyOf", "allOf", "oneOf", "not", "title", "const", "discriminator", "examples"}


def test_schema_is_structural(schema: dict[str, Any]) -> None:
    for path, node in walk(schema):
        if node.get("x-kubernetes-int-or-string"):
            assert "type" not in node, f"{path}: an int-or-string has no type"
            continue
        assert "type" in node, f"{path or '.'}: every node needs a type"
        assert not FORBIDDEN_KEYS & node.keys(), f"{path or '.'}: {sorted(FORBIDDEN_KEYS & node.keys())}"
        assert node.get("additionalProperties") is not False, f"{path}: additionalProperties: false"
        assert "x-kubernetes-preserve-unknown-fields" not in node, f"{path}: nothing needs to be free-form"
        for bound in ("exclusiveMinimum", "exclusiveMaximum"):
            if bound in node:
                assert isinstance(node[bound], bool), f"{path}: OpenAPI v3.0 {bound} is a boolean"
                assert ("minimum" if bound == "exclusiveMinimum" else "maximum") in node
        if node["type"] == "object" and path != ".metadata":
            assert "properties" in node or "additionalProperties" in node, f"{path}: untyped object"
        if node.get("nullable"):
            assert node.get("default", "absent") is not None, f"{path}: a null default says nothing"
    assert set(schema["properties"]) == {"apiVersion", "kind", "metadata", "spec", "status"}
    assert schema["properties"]["metadata"] == {"type": "object"}


def test_optional_fields_are_nullable_and_enums_come_from_literals(schema: dict[str, Any]) -> None:
    assert at(schema, ".spec.algorithm.miniBatchSize") == {
        "description": "Sequences per optimiser step; null means the whole batch.",
        "type": "integer",
        "nullable": True,
        "minimum": 1,
    }
    # A null here means "disabled", so it must survive: nullable, yet defaulted when absent.
    dual = at(schema, ".spec.algorithm.dualClipC")
    assert dual["nullable"] is True and dual["default"] == 3.0
    assert at(schema, ".spec.algorithm.name")["enum"] == [
        "ppo", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "opo", "grpo_passk", "remax",
        "gdpo", "gpg", "optimal_token_baseline"]
    assert at(schema, ".spec.algorithm.policyLoss")["enum"] == ["vanilla", "gspo", "cispo", "gpg", "sapo", "geo_mean",
                                                                  "clip_cov", "kl_cov", "dppo_tv", "dppo_kl", "dro"]
    assert at(schema, ".spec.rollout.engine")["enum"] == ["torch", "vllm"]
    top_p = at(schema, ".spec.rollout.topP")
    assert (top_p["minimum"], top_p["exclusiveMinimum"], top_p["maximum"]) == (0.0, True, 1.0)
    assert "exclusiveMaximum" not in top_p
    assert at(schema, ".spec.graph.nodes[].resources")["additionalProperties"] == {"type": "number"}
    assert at(schema, ".spec.cluster.nodeSelector")["additionalProperties"] == {"type": "string"}
    assert at(schema, ".spec.cluster.gpuType")["pattern"] == "^[A-Za-z0-9][A-Za-z0-9-]*$"
    assert at(schema, ".spec.graph")["required"] == ["nodes"]


def test_cpu_amounts_are_int_or_string_with_one_rule(schema: dict[str, Any]) -> None:
    """Either CPU field takes 2 or "500m"; the type's rule, not a type or a pattern, says what is allowed."""
    for path in (".spec.cluster.headCpus", ".spec.cluster.workerGroups[].cpusPerWorker"):
        node = at(schema, path)
        assert node["x-kubernetes-int-or-string"] is True and "type" not in node, path
        (rule,) = node["x-kubernetes-validations"]
        assert rule["message"].startswith("must be a CPU amount above 0 and at most 1024 cores"), path
    assert at(schema, ".spec.cluster.headCpus")["default"] == 8


def test_nested_models_default_to_empty_objects(schema: dict[str, Any]) -> None:
    """`default: {}` on every nested model lets the API server fill in the whole tree of defaults."""
    for path in (".spec", ".spec.algorithm", ".spec.algorithm.klPenalty", ".spec.cluster.nccl", ".spec.runPolicy"):
        assert at(schema, path)["default"] == {}, path
    assert "default" not in at(schema, ".spec.graph")  # optional: absent means the built-in graph


def test_descriptions_come_from_docstrings(schema: dict[str, Any]) -> None:
    assert at(schema, ".spec.data.batchSize")["description"] == "Prompts per training step."
    assert "group-normalised" in at(schema, ".spec.algorithm.name")["description"]
    assert schema["description"].startswith("RLTrainingJob declares")


def test_names_scope_and_subresources(crd: dict[str, Any]) -> None:
    spec = crd["spec"]
    assert crd["metadata"]["name"] == "rltrainingjobs.hybridflow.io"
    assert spec["group"] == "hybridflow.io" and spec["scope"] == "Namespaced"
    assert spec["names"] == {
        "kind": "RLTrainingJob",
        "listKind": "RLTrainingJobList",
        "plural": "rltrainingjobs",
        "singular": "rltrainingjob",
        "shortNames": ["rlj"],
        "categories": ["hybridflow"],
    }
    (version,) = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    assert version["subresources"] == {"status": {}}
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]
    conditions = status["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    assert set(conditions["items"]["required"]) == {"type", "status", "reason", "lastTransitionTime"}
    assert status["properties"]["progress"]["properties"]["rewardMean"]["type"] == "number"


def test_printer_columns(crd: dict[str, Any]) -> None:
    columns = {c["name"]: c for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert list(columns) == [
        "Ready",
        "Succeeded",
        "Step",
        "Reward",
        "Val-Reward",
        "Phase",
        "Algorithm",
        "GPU",
        "RayJob",
        "Total-Steps",
        "Age",
    ]
    assert columns["Ready"]["jsonPath"] == '.status.conditions[?(@.type=="Ready")].status'
    assert columns["Succeeded"]["jsonPath"] == '.status.conditions[?(@.type=="Succeeded")].status'
    assert columns["Step"] == {"name": "Step", "type": "integer", "jsonPath": ".status.progress.step"}
    assert columns["Reward"]["jsonPath"] == ".status.progress.rewardMean"
    assert columns["Age"] == {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}
    wide = {name for name, c in columns.items() if c.get("priority") == 1}
    assert wide == {"Val-Reward", "Phase", "Algorithm", "GPU", "RayJob", "Total-Steps"}
    assert columns["Val-Reward"]["jsonPath"] == ".status.progress.valRewardMean"
    assert columns["GPU"]["jsonPath"] == ".spec.cluster.gpuType"
    assert columns["RayJob"]["jsonPath"] == ".status.rayJobName"
    assert columns["Total-Steps"]["jsonPath"] == ".status.progress.totalSteps"  # totalEpochs: counted in the run


# -- CEL rules --------------------------------------------------------------------------------------

IMMUTABLE_FIELDS = (".spec.algorithm", ".spec.model", ".spec.data", ".spec.reward", ".spec.cluster.gpuType")


def test_every_rule_has_a_message(schema: dict[str, Any]) -> None:
    count = 0
    for path, node in walk(schema):
        for rule in node.get("x-kubernetes-validations", []):
            count += 1
            assert rule["rule"].strip(), path
            assert len(rule.get("message", "")) > 20, f"{path}: {rule['rule']} needs a clear message"
            assert set(rule) <= {"rule", "message", "fieldPath", "reason"}
    assert count >= 15


@pytest.mark.parametrize("path", IMMUTABLE_FIELDS)
def test_immutable_fields_have_transition_rules(schema: dict[str, Any], path: str) -> None:
    (rule,) = [r for r in rules_at(schema, path) if "oldSelf" in r["rule"]]
    assert rule["rule"] == "self == oldSelf"
    assert rule["message"] == (f"{path[1:]} is immutable once the job has been created; delete and recreate the job")


def test_field_rules_and_model_rules_add_up(schema: dict[str, Any]) -> None:
    """spec.reward carries its model's cross-field rule and the field's immutability rule."""
    rules = [r["rule"] for r in rules_at(schema, ".spec.reward")]
    assert "self == oldSelf" in rules
    assert any("has(self.model)" in r for r in rules)


def test_optional_immutable_fields_are_guarded_at_the_parent(schema: dict[str, Any]) -> None:
    """A rule on an optional field never runs when the field is added or removed: the parent checks."""
    graph = [r for r in rules_at(schema, ".spec") if r.get("fieldPath") == ".graph"]
    assert graph and "has(self.graph) == has(oldSelf.graph)" in graph[0]["rule"]
    image = [r for r in rules_at(schema, ".spec.cluster") if r.get("fieldPath") == ".image"]
    assert image and "has(self.image) == has(oldSelf.image)" in image[0]["rule"]


def test_mutable_fields_have_no_transition_rules(schema: dict[str, Any]) -> None:
    for path in (".spec.runPolicy", ".spec.trainer", ".spec.rollout", ".spec.scheduling"):
        for sub, node in walk(at(schema, path), path):
            for rule in node.get("x-kubernetes-validations", []):
                assert "oldSelf" not in rule["rule"], f"{sub}: {rule['rule']}"
    group_rules = rules_at(schema, ".spec.cluster.workerGroups[]")
    transition = [r["rule"] for r in group_rules if "oldSelf" in r["rule"]]
    assert transition and all("replicas" not in r.lower() for r in transition)


def test_lists_iterated_by_rules_are_bounded(schema: dict[str, Any]) -> None:
    """The API server estimates a rule's worst-case cost; unbounded lists would exceed its budget."""
    lists = (".spec.graph.nodes", ".spec.graph.edges", ".spec.cluster.workerGroups", ".spec.cluster.volumes",
             ".spec.cluster.volumeMounts", ".spec.cluster.env", ".spec.cluster.envFrom",
             ".spec.cluster.imagePullSecrets")
    for path in lists:
        assert isinstance(at(schema, path).get("maxItems"), int), path
    for path in (".spec.cluster.podLabels", ".spec.cluster.podAnnotations"):
        assert isinstance(at(schema, path).get("maxProperties"), int), path
    for path, key in ((".spec.graph.nodes", "name"), (".spec.cluster.workerGroups", "name"),
                      (".spec.cluster.volumes", "name"), (".spec.cluster.volumeMounts", "mountPath"),
                      (".spec.cluster.env", "name"), (".spec.cluster.imagePullSecrets", "name")):
        node = at(schema, path)
        assert node["x-kubernetes-list-type"] == "map" and node["x-kubernetes-list-map-keys"] == [key], path


def test_pod_settings_are_typed_kubernetes_objects(schema: dict[str, Any]) -> None:
    """A subset of core/v1 with its own spelling, so a snippet from a pod spec pastes in unchanged."""
    volume = at(schema, ".spec.cluster.volumes[]")
    assert volume["required"] == ["name"]
    assert set(volume["properties"]) == {"name", "persistentVolumeClaim", "configMap", "secret", "emptyDir",
                                         "hostPath", "csi"}
    assert at(schema, ".spec.cluster.volumes[].persistentVolumeClaim")["required"] == ["claimName"]
    assert set(at(schema, ".spec.cluster.volumeMounts[]")["required"]) == {"name", "mountPath"}
    assert set(at(schema, ".spec.cluster.env[].valueFrom")["properties"]) == {"secretKeyRef", "configMapKeyRef",
                                                                             "fieldRef"}
    assert set(at(schema, ".spec.cluster.envFrom[]")["properties"]) == {"prefix", "secretRef", "configMapRef"}
    assert at(schema, ".spec.cluster.serviceAccount.annotations")["additionalProperties"] == {"type": "string"}


# -- generated files --------------------------------------------------------------------------------


def test_generation_is_deterministic() -> None:
    first = (crdgen.render_crd_yaml(), crdgen.render_chart_template())
    code = (
        "import sys; from hybridflow.api import crd; "
        "sys.stdout.write(crd.render_crd_yaml() + '\\0' + crd.render_chart_template())"
    )
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={**os.environ}
    ).stdout
    assert tuple(other.split("\0")) == first


def test_committed_files_match_the_models() -> None:
    problems = crdgen.check(CRDS_DIR, CHART_DIR)
    assert not problems, "\n".join(problems) + "\nrun `make crds`"


def test_crd_yaml_parses_back_to_the_crd(crd: dict[str, Any]) -> None:
    docs = [d for d in yaml.safe_load_all(crdgen.render_crd_yaml()) if d]
    assert docs == [crd]


def test_check_reports_drift_and_main_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, chart = tmp_path / "crds", tmp_path / "chart"
    assert crdgen.main(["--out", str(out), "--chart", str(chart)]) == 0
    assert crdgen.check(out, chart) == []
    assert crdgen.main(["--check", "--out", str(out), "--chart", str(chart)]) == 0

    target = out / crdgen.CRD_FILE
    target.write_text(target.read_text().replace("shortNames:\n    - rlj", "shortNames:\n    - rl"))
    (chart / "templates" / "crds" / crdgen.CRD_FILE).unlink()
    problems = crdgen.check(out, chart)
    assert len(problems) == 2
    assert "out of date" in problems[0] and "-    - rl" in problems[0] and "+    - rlj" in problems[0]
    assert problems[1].endswith(": missing")
    capsys.readouterr()
    assert crdgen.main(["--check", "--out", str(out), "--chart", str(chart)]) == 1
    assert "make crds" in capsys.readouterr().err
    assert target.read_text() != crdgen.render_crd_yaml()  # --check writes nothing


def test_chart_template_wraps_the_same_crd(crd: dict[str, Any]) -> None:
    text = crdgen.render_chart_template()
    lines = text.splitlines()
    assert lines[0] == "{{- if .Values.crds.install }}" and lines[-1] == "{{- end }}"
    assert "  {{- if .Values.crds.keep }}" in lines and "    helm.sh/resource-policy: keep" in lines
    body = "\n".join(line for line in lines if "{{" not in line)
    parsed = yaml.safe_load(body)
    assert parsed["spec"] == crd["spec"]
    assert parsed["metadata"]["name"] == crd["metadata"]["name"]


# -- validating objects with the schema -------------------------------------------------------------


def to_json_schema(node: dict[str, Any]) -> dict[str, Any]:
    """The CRD's OpenAPI v3.0 dialect as JSON Schema draft 4 (nullable becomes a null type)."""
    out = {k: v for k, v in node.items() if not k.startswith("x-kubernetes-") and k != "nullable"}
    if node.get("nullable"):
        out["type"] = [node["type"], "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    if "properties" in node:
        out["properties"] = {k: to_json_schema(v) for k, v in node["properties"].items()}
        # The API server prunes unknown fields; for these tests an unknown field is an error.
        out["additionalProperties"] = False
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            out[key] = to_json_schema(node[key])
    return out


def apply_defaults(value: Any, node: dict[str, Any]) -> Any:
    """Structural defaulting as the API server does it: absent fields take defaults, recursively."""
    if isinstance(value, dict) and "properties" in node:
        for name, child in node["properties"].items():
            if name not in value and "default" in child:
                value[name] = copy.deepcopy(child["default"])
            if name in value:
                value[name] = apply_defaults(value[name], child)
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        value = [apply_defaults(v, node["items"]) for v in value]
    return value


def load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def validator(schema: dict[str, Any]) -> jsonschema.Draft4Validator:
    js = to_json_schema(schema)
    jsonschema.Draft4Validator.check_schema(js)
    return jsonschema.Draft4Validator(js)


def errors(validator: jsonschema.Draft4Validator, obj: dict[str, Any]) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]


def test_there_are_examples() -> None:
    assert len(EXAMPLES) >= 2


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_validate_after_defaulting(
    path: Path, schema: dict[str, Any], validator: jsonschema.Draft4Validator
) -> None:
    obj = apply_defaults(load(path), schema)
    assert errors(validator, obj) == []


def _normal(value: Any) -> Any:
    """Drop nulls and empty collections, which the models and the CRD spell differently."""
    if isinstance(value, dict):
        out = {k: _normal(v) for k, v in value.items()}
        return {k: v for k, v in out.items() if v not in (None, [], {})}
    if isinstance(value, list):
        return [_normal(v) for v in value]
    return value


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_crd_defaults_equal_the_model_defaults(path: Path, schema: dict[str, Any]) -> None:
    """What the API server stores after defaulting is exactly what the runtime would assume."""
    spec = load(path).get("spec", {})
    defaulted = apply_defaults(copy.deepcopy(spec), at(schema, ".spec"))
    model = RLTrainingJobSpec.model_validate(spec).model_dump(by_alias=True, mode="json")
    assert _normal(defaulted) == _normal(model)


def test_empty_spec_defaults_equal_the_model_defaults(schema: dict[str, Any]) -> None:
    defaulted = apply_defaults({}, at(schema, ".spec"))
    assert _normal(defaulted) == _normal(RLTrainingJobSpec().model_dump(by_alias=True, mode="json"))


@pytest.mark.parametrize(
    ("mutate", "where"),
    [
        (lambda s: s["algorithm"].update(name="dpo"), "spec.algorithm.name"),
        (lambda s: s["rollout"].update(topP=0.0), "spec.rollout.topP"),
        (lambda s: s["algorithm"].update(clipRatio=1.0), "spec.algorithm.clipRatio"),
        (lambda s: s["data"].update(batchSize=0), "spec.data.batchSize"),
        (lambda s: s["cluster"]["workerGroups"][0].update(name="Actor_1"), "spec.cluster.workerGroups.0.name"),
        (lambda s: s["cluster"].update(shmSize="lots"), "spec.cluster.shmSize"),
        (lambda s: s["reward"].update(function="not a function"), "spec.reward.function"),
        (lambda s: s["cluster"]["nodeSelector"].update(zone=3), "spec.cluster.nodeSelector.zone"),
        (lambda s: s["trainer"].update(totalStep=10), "spec.trainer"),
        (lambda s: s["algorithm"].update(ppoEpochs="2"), "spec.algorithm.ppoEpochs"),
        (lambda s: s["model"]["policy"].update(lora={"rank": 0, "targetModules": ["q"]}), "spec.model.policy.lora"),
        (lambda s: s["model"]["policy"].update(lora={"targetModules": []}), "spec.model.policy.lora.targetModules"),
        (lambda s: s["model"]["policy"].update(lora={"rank": 8}), "spec.model.policy.lora"),
        (lambda s: s["trainer"].update(export={"adapters": "both"}), "spec.trainer.export.adapters"),
    ],
)
def test_invalid_objects_fail(
    mutate: Any, where: str, schema: dict[str, Any], validator: jsonschema.Draft4Validator
) -> None:
    obj = load(ROOT / "examples" / "ppo-job.yaml")
    obj["spec"]["cluster"]["nodeSelector"] = {}
    mutate(obj["spec"])
    found = errors(validator, apply_defaults(obj, schema))
    assert found, "expected a schema error"
    assert any(e.startswith(where) for e in found), found


def test_null_keeps_meaning_where_the_model_gives_it_one(
    schema: dict[str, Any], validator: jsonschema.Draft4Validator
) -> None:
    obj = load(ROOT / "examples" / "ppo-job.yaml")
    obj["spec"]["algorithm"]["dualClipC"] = None
    defaulted = apply_defaults(obj, schema)
    assert defaulted["spec"]["algorithm"]["dualClipC"] is None  # explicitly disabled stays disabled
    assert errors(validator, defaulted) == []


# -- admission on a real API server -----------------------------------------------------------------


controlplane = pytest.mark.controlplane


def kubectl(cp: Any, *args: str, body: dict[str, Any] | None = None) -> subprocess.CompletedProcess[str]:
    return cp.kubectl(*args, input=json.dumps(body) if body is not None else None, check=False)


def job(name: str | None = None, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "hybridflow.io/v1alpha1",
        "kind": "RLTrainingJob",
        "metadata": {"name": name or f"job-{uuid.uuid4().hex[:8]}", "namespace": "default"},
        "spec": spec,
    }


def create(cp: Any, obj: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    return kubectl(cp, "create", "-f", "-", body=obj)


def merge_patch(cp: Any, name: str, patch: dict[str, Any], *extra: str) -> subprocess.CompletedProcess[str]:
    return kubectl(cp, "patch", "rltrainingjob", name, "-n", "default", "--type=merge", "-p", json.dumps(patch), *extra)


def get(cp: Any, name: str) -> dict[str, Any]:
    return json.loads(kubectl(cp, "get", "rltrainingjob", name, "-n", "default", "-o", "json").stdout)


def gpu_groups(*names: str, gpus: int = 8) -> dict[str, Any]:
    return {"workerGroups": [{"name": n, "replicas": 1, "gpusPerWorker": gpus} for n in names]}


@controlplane
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_api_server_accepts_the_examples(apiserver: Any, path: Path) -> None:
    obj = load(path)
    obj["metadata"] = {"name": f"ex-{uuid.uuid4().hex[:8]}", "namespace": "default"}
    result = create(apiserver, obj)
    assert result.returncode == 0, result.stderr
    stored = get(apiserver, obj["metadata"]["name"])["spec"]
    model = RLTrainingJobSpec.model_validate(load(path)["spec"]).model_dump(by_alias=True, mode="json")
    assert _numbers_equal(stored, model)


def _numbers_equal(a: Any, b: Any) -> bool:
    """JSON round trips turn 1.0 into 1: compare numbers by value."""
    a, b = _normal(a), _normal(b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_numbers_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_numbers_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@controlplane
def test_api_server_fills_in_every_default(apiserver: Any) -> None:
    obj = job()
    obj.pop("spec")
    assert create(apiserver, obj).returncode == 0
    stored = get(apiserver, obj["metadata"]["name"])["spec"]
    assert _numbers_equal(stored, RLTrainingJobSpec().model_dump(by_alias=True, mode="json"))


@controlplane
def test_a_job_nobody_has_observed_reads_as_in_progress(apiserver: Any) -> None:
    """Before any operator writes a status, the API server shows observedGeneration 0 (kstatus: InProgress)."""
    obj = job()
    assert create(apiserver, obj).returncode == 0
    stored = get(apiserver, obj["metadata"]["name"])
    assert stored["metadata"]["generation"] == 1
    assert stored["status"] == {"observedGeneration": 0, "restarts": 0}


REJECTED = [
    (
        "grpo-one-sample",
        {"algorithm": {"name": "grpo"}, "rollout": {"samplesPerPrompt": 1}},
        "rollout.samplesPerPrompt must be at least 2 for grpo",
    ),
    (
        "rloo-one-sample",
        {"algorithm": {"name": "rloo"}, "rollout": {"samplesPerPrompt": 1}},
        "rollout.samplesPerPrompt must be at least 2 for rloo (its baseline comes from the samples",
    ),
    (
        "rpp-baseline-one-sample",
        {"algorithm": {"name": "reinforce_plus_plus_baseline"}},
        "rollout.samplesPerPrompt must be at least 2 for reinforce_plus_plus_baseline",
    ),
    (
        "opo-one-sample",
        {"algorithm": {"name": "opo"}, "rollout": {"samplesPerPrompt": 1}},
        "rollout.samplesPerPrompt must be at least 2 for opo",
    ),
    (
        "passk-one-sample",
        {"algorithm": {"name": "grpo_passk"}, "rollout": {"samplesPerPrompt": 1}},
        "rollout.samplesPerPrompt must be at least 2 for grpo_passk",
    ),
    (
        "minibatch-too-big",
        {"algorithm": {"miniBatchSize": 33}, "data": {"batchSize": 16}, "rollout": {"samplesPerPrompt": 2}},
        "algorithm.miniBatchSize must be at most data.batchSize * rollout.samplesPerPrompt",
    ),
    (
        "reward-model-without-model",
        {"reward": {"type": "model"}},
        "reward.model.path is required when reward.type is 'model'",
    ),
    (
        "vllm-without-gpus",
        {"rollout": {"engine": "vllm"}, "cluster": gpu_groups("default", gpus=0)},
        "rollout.engine vllm runs on GPUs",
    ),
    (
        "vllm-tp-larger-than-a-worker",
        {"rollout": {"engine": "vllm", "tensorParallelSize": 16}, "cluster": gpu_groups("default", gpus=8)},
        "gpusPerWorker >= rollout.tensorParallelSize",
    ),
    (
        "tp-with-torch",
        {"rollout": {"engine": "torch", "tensorParallelSize": 2}},
        "rollout.tensorParallelSize above 1 needs rollout.engine vllm",
    ),
    (
        "eval-without-val",
        {"trainer": {"evalEvery": 5}},
        "trainer.evalEvery needs data.val, the prompts to evaluate on",
    ),
    (
        "eval-with-a-null-val",
        {"data": {"val": None}, "trainer": {"evalEvery": 5}},
        "trainer.evalEvery needs data.val, the prompts to evaluate on",
    ),
    (
        "greedy-eval-with-a-temperature",
        {"data": {"val": "builtin:tiny_task"}, "trainer": {"eval": {"temperature": 0.5}}},
        "eval.temperature and eval.samplesPerPrompt above 1 need eval.greedy false",
    ),
    (
        "greedy-eval-with-samples",
        {"data": {"val": "builtin:tiny_task"}, "trainer": {"eval": {"greedy": True, "samplesPerPrompt": 4}}},
        "eval.temperature and eval.samplesPerPrompt above 1 need eval.greedy false",
    ),
    (
        "min-lr-without-cosine",
        {"trainer": {"optimizer": {"warmupSteps": 5, "minLrRatio": 0.1}}},
        "optimizer.minLrRatio is where schedule cosine ends: it needs optimizer.schedule cosine",
    ),
    (
        "covariance-bounds-out-of-order",
        {"algorithm": {"covariance": {"clipUpperBound": 0.5}}},
        "covariance.clipLowerBound must be below covariance.clipUpperBound",
    ),
    (
        "icepop-band-upside-down",
        {"algorithm": {"rolloutCorrection": {"importanceSampling": "token", "lowerThreshold": 3.0}}},
        "rolloutCorrection.lowerThreshold must be below rolloutCorrection.threshold",
    ),
    (
        "bypass-weights-on-a-clipped-loss",
        {"algorithm": {"rolloutCorrection": {"importanceSampling": "sequence", "bypass": True}}},
        "algorithm.rolloutCorrection.importanceSampling with bypass weighs REINFORCE's loss",
    ),
    (
        "optimal-token-baseline-without-its-pass",
        {"algorithm": {"name": "optimal_token_baseline", "rolloutCorrection": {"bypass": True}}},
        "algorithm.name optimal_token_baseline weighs each token by the trainer's sum of squared probabilities",
    ),
    (
        "overlong-buffer-beyond-the-response",
        {"data": {"maxResponseLength": 4}, "reward": {"overlongBuffer": {"length": 5}}},
        "reward.overlongBuffer.length must be at most data.maxResponseLength",
    ),
    (
        "overlong-buffer-at-the-default-response-length",
        {"reward": {"overlongBuffer": {"length": 9}}},
        "reward.overlongBuffer.length must be at most data.maxResponseLength",
    ),
    (
        "filter-groups-of-one",
        {"algorithm": {"filterGroups": {}}, "rollout": {"samplesPerPrompt": 1}},
        "algorithm.filterGroups drops the prompts whose samples all scored the same",
    ),
    (
        "filter-groups-metric-of-a-reward-model",
        {"algorithm": {"filterGroups": {"metric": "acc"}},
         "reward": {"type": "model", "model": {"path": "/models/rm"}}},
        "algorithm.filterGroups.metric other than score is a number the reward function returns",
    ),
    (
        "policy-filtration-without-ppo",
        {"algorithm": {"name": "grpo", "policyFiltration": {}}, "rollout": {"samplesPerPrompt": 4}},
        "algorithm.policyFiltration redraws PPO's batch after GAE",
    ),
    (
        "gdpo-without-keys",
        {"algorithm": {"name": "gdpo"}},
        "algorithm.gdpo.rewardKeys (the reward components to normalise) is required with name gdpo",
    ),
    (
        "gdpo-weights-not-one-per-key",
        {"algorithm": {"name": "gdpo", "gdpo": {"rewardKeys": ["score", "format"], "rewardWeights": [1.0]}}},
        "algorithm.gdpo.rewardWeights must have one weight per rewardKeys entry",
    ),
    (
        "gdpo-with-a-reward-model",
        {"algorithm": {"name": "gdpo", "gdpo": {"rewardKeys": ["score"]}},
         "reward": {"type": "model", "model": {"path": "/models/rm"}}},
        "algorithm.name gdpo normalises the components a reward function returns",
    ),
    (
        "normalized-without-weights",
        {"algorithm": {"rolloutCorrection": {"batchNormalize": True}}},
        "rolloutCorrection.batchNormalize scales importance weights",
    ),
    (
        "rejection-lower-bound-off-k1",
        {"algorithm": {"rolloutCorrection": {"rejectionSampling": [
            {"divergence": "seq_mean_k3", "threshold": 0.1, "lowerThreshold": 0.05}]}}},
        "rejectionSampling.lowerThreshold bounds a ratio: only a k1 divergence",
    ),
    (
        "rejection-k1-band-empty",
        {"algorithm": {"rolloutCorrection": {"rejectionSampling": [{"divergence": "token_k1", "threshold": 0.5}]}}},
        "a k1 divergence keeps ratios within [lowerThreshold, threshold]",
    ),
    (
        "rejection-divergence-twice",
        {"algorithm": {"rolloutCorrection": {"rejectionSampling": [
            {"divergence": "token_k2", "threshold": 0.1}, {"divergence": "token_k2", "threshold": 0.2}]}}},
        "Duplicate value",
    ),
    (
        "dro-without-beta",
        {"algorithm": {"policyLoss": "dro"}},
        "algorithm.droBeta (a number above 0) is required with policyLoss dro",
    ),
    (
        "dro-with-null-beta",
        {"algorithm": {"policyLoss": "dro", "droBeta": None}},
        "algorithm.droBeta (a number above 0) is required with policyLoss dro",
    ),
    (
        "eval-before-train-without-val",
        {"data": {"val": None}, "trainer": {"evalBeforeTrain": True}},
        "trainer.evalBeforeTrain needs data.val, the prompts to evaluate on",
    ),
    (
        "batched-reward-model",
        {"reward": {"type": "model", "model": {"path": "/mnt/rm"}, "batched": True}},
        "reward.batched is how reward.function is called: it needs reward.type function",
    ),
    (
        "validation-data-without-val",
        {"data": {"val": None}, "trainer": {"validationDataDir": "/mnt/samples/val"}},
        "trainer.validationDataDir needs data.val, the prompts to evaluate on",
    ),
    (
        "val-generations-without-val",
        {"data": {"val": None}, "trainer": {"loggers": {"valGenerations": 4}}},
        "trainer.loggers.valGenerations needs data.val, the prompts to evaluate on",
    ),
    (
        "critic-warmup-without-a-critic",
        {"algorithm": {"name": "grpo"}, "rollout": {"samplesPerPrompt": 4}, "trainer": {"criticWarmupSteps": 3}},
        "trainer.criticWarmupSteps trains the critic alone: it needs an algorithm with a critic",
    ),
    (
        "resume-from-with-resume-never",
        {"trainer": {"resume": "never", "resumeFrom": "/mnt/checkpoints/other"}},
        "trainer.resumeFrom needs trainer.resume auto",
    ),
    (
        "separate-adapters-without-lora",
        {"trainer": {"export": {"path": "/out", "adapters": "separate"}}},
        "trainer.export.adapters 'separate' needs model.policy.lora",
    ),
    (
        "min-above-replicas",
        {"cluster": {"workerGroups": [{"name": "default", "replicas": 1, "minReplicas": 2}]}},
        "minReplicas must be at most replicas",
    ),
    (
        "replicas-above-max",
        {"cluster": {"workerGroups": [{"name": "default", "replicas": 3, "maxReplicas": 2}]}},
        "replicas must be at most maxReplicas",
    ),
    (
        "duplicate-worker-groups",
        {"cluster": {"workerGroups": [{"name": "default"}, {"name": "default"}]}},
        "Duplicate value",
    ),
    (
        "edge-to-nowhere",
        {
            "graph": {
                "nodes": [{"name": "actor", "role": "actor_rollout"}],
                "edges": [{"src": "actor", "dst": "critic"}],
            }
        },
        "every graph edge's src and dst must name a node in graph.nodes",
    ),
    (
        "pool-without-group",
        {"graph": {"nodes": [{"name": "actor", "role": "actor_rollout", "pool": "gpu"}]}, "cluster": gpu_groups("cpu")},
        "every graph node's pool must name one of cluster.workerGroups",
    ),
]


@controlplane
@pytest.mark.parametrize(("case", "spec", "message"), REJECTED, ids=[c[0] for c in REJECTED])
def test_api_server_rejects(apiserver: Any, case: str, spec: dict[str, Any], message: str) -> None:
    result = create(apiserver, job(f"bad-{case}", **spec))
    assert result.returncode != 0, f"{case} was accepted"
    assert message in result.stderr, result.stderr


EVAL_SETTINGS = [
    {"data": {"val": "builtin:tiny_task", "promptFormat": "chat"}, "trainer": {"evalEvery": 5}},
    {"data": {"val": "/data/val.jsonl"}, "trainer": {"eval": {"greedy": False, "temperature": 0.6,
                                                               "samplesPerPrompt": 4}}},
    {"data": {"val": "builtin:tiny_task"}, "trainer": {"eval": {"greedy": True, "temperature": None}}},
    {"data": {"val": None}, "trainer": {"evalEvery": 0}},
]


NULL_CHOICES = [
    {"cluster": {"tolerations": [{"key": "gpu", "operator": None, "effect": None}]}},
    {"cluster": {"nccl": {"debug": None}}},
    {"cluster": {"volumes": [{"name": "scratch", "emptyDir": {"medium": None}}]}},
]


@controlplane
@pytest.mark.parametrize("spec", NULL_CHOICES, ids=["toleration", "nccl-debug", "empty-dir-medium"])
def test_api_server_takes_a_null_for_a_choice_the_model_leaves_open(apiserver: Any, spec: dict[str, Any]) -> None:
    """A nullable enum lists null among its values: the API server checks a null against the enum as well."""
    RLTrainingJobSpec.model_validate(spec)
    result = create(apiserver, job(**spec))
    assert result.returncode == 0, result.stderr


@controlplane
@pytest.mark.parametrize("spec", EVAL_SETTINGS, ids=["every", "sampled", "null-temperature", "null-val"])
def test_api_server_accepts_what_the_model_accepts_of_evaluation(apiserver: Any, spec: dict[str, Any]) -> None:
    RLTrainingJobSpec.model_validate(spec)
    result = create(apiserver, job(**spec))
    assert result.returncode == 0, result.stderr


@controlplane
@pytest.mark.parametrize("bad", BAD_POD_SETTINGS, ids=[b.case for b in BAD_POD_SETTINGS])
def test_api_server_rejects_pod_settings_that_cannot_work(apiserver: Any, bad: BadPodSetting) -> None:
    """The same objects tests/test_api.py gives the models, refused at admission naming the same field."""
    result = create(apiserver, job(f"bad-{bad.case}", cluster=copy.deepcopy(bad.cluster)))
    assert result.returncode != 0, f"{bad.case} was accepted"
    assert f"{bad.api_field or bad.field}: " in result.stderr, result.stderr
    assert (bad.api_says or bad.says) in result.stderr, result.stderr


@controlplane
@pytest.mark.parametrize("name", HUB_NAMES, ids=[f"{n.field.split('.')[-1]}={n.value}" for n in HUB_NAMES])
def test_api_server_checks_hub_names_as_the_models_do(apiserver: Any, name: HubName) -> None:
    """The CEL rule and hybridflow.hub share one pattern: the API server takes exactly what the models take."""
    result = create(apiserver, job(**hub_name_spec(name)))
    if name.accepted:
        assert result.returncode == 0, result.stderr
    else:
        assert result.returncode != 0, f"{name.value!r} was accepted"
        assert f"{name.field}: Invalid value" in result.stderr, result.stderr
        assert "a Hub dataset is hf://datasets/Org/Name" in result.stderr or "a Hub model is Org/Name" in result.stderr


@controlplane
def test_api_server_stores_pod_settings_as_written(apiserver: Any) -> None:
    cluster = {
        "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "models-pvc", "readOnly": True}},
                    {"name": "cache", "emptyDir": {}}],
        "volumeMounts": [{"name": "models", "mountPath": "/mnt/models", "readOnly": True},
                         {"name": "cache", "mountPath": "/cache"}],
        "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}],
        "envFrom": [{"configMapRef": {"name": "training-env"}}],
        "imagePullSecrets": [{"name": "registry-creds"}],
        "serviceAccount": {"annotations": {"iam.gke.io/gcp-service-account": "t@p.iam.gserviceaccount.com"}},
        "podLabels": {"cost-center": "research"},
        "podAnnotations": {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"},
        "priorityClassName": "training",
    }
    obj = job(cluster=copy.deepcopy(cluster))
    result = create(apiserver, obj)
    assert result.returncode == 0, result.stderr
    stored = get(apiserver, obj["metadata"]["name"])["spec"]["cluster"]
    assert {k: stored[k] for k in cluster} == cluster


@controlplane
def test_api_server_stores_cpu_amounts_as_written(apiserver: Any) -> None:
    groups = [{"name": "a", "cpusPerWorker": "500m"}, {"name": "b", "cpusPerWorker": "1.5"},
              {"name": "c", "cpusPerWorker": 2}, {"name": "d", "cpusPerWorker": "1024000m"}]
    obj = job(cluster={"headCpus": "250m", "workerGroups": copy.deepcopy(groups)})
    result = create(apiserver, obj)
    assert result.returncode == 0, result.stderr
    stored = get(apiserver, obj["metadata"]["name"])["spec"]["cluster"]
    assert stored["headCpus"] == "250m"
    assert [g["cpusPerWorker"] for g in stored["workerGroups"]] == ["500m", "1.5", 2, "1024000m"]


@controlplane
def test_api_server_rejects_names_that_are_not_dns_labels(apiserver: Any) -> None:
    result = create(apiserver, job("my.job"))
    assert result.returncode != 0 and "metadata.name must be a DNS label" in result.stderr


@pytest.fixture
def running(apiserver: Any) -> str:
    """A created job with a graph, two worker groups and an image: every transition rule applies."""
    obj = job(
        cluster={
            "image": "example.com/runtime:1",
            "workerGroups": [{"name": "default", "replicas": 2, "maxReplicas": 4}, {"name": "spare"}],
        },
        graph={"nodes": [{"name": "actor", "role": "actor_rollout"}]},
    )
    assert create(apiserver, obj).returncode == 0
    return obj["metadata"]["name"]


IMMUTABLE_PATCHES = [
    ("algorithm", {"algorithm": {"gamma": 0.9}}, "spec.algorithm is immutable"),
    ("model", {"model": {"policy": {"path": "/mnt/other"}}}, "spec.model is immutable"),
    ("data", {"data": {"batchSize": 32}}, "spec.data is immutable"),
    ("reward", {"reward": {"function": "builtin:gsm8k"}}, "spec.reward is immutable"),
    ("gpu-type", {"cluster": {"gpuType": "H100-80GB"}}, "spec.cluster.gpuType is immutable"),
    ("image", {"cluster": {"image": "example.com/runtime:2"}}, "spec.cluster.image is immutable"),
    ("image-removed", {"cluster": {"image": None}}, "spec.cluster.image is immutable"),
    ("graph", {"graph": {"nodes": [{"name": "actor", "role": "actor_rollout", "parallelism": 2}]}}, "spec.graph"),
    ("graph-removed", {"graph": None}, "spec.graph is immutable"),
    (
        "worker-shape",
        {"cluster": {"workerGroups": [{"name": "default", "replicas": 2, "gpusPerWorker": 4}, {"name": "spare"}]}},
        "gpusPerWorker, cpusPerWorker and memory are immutable",
    ),
    (
        "worker-cpus",
        {"cluster": {"workerGroups": [{"name": "default", "replicas": 2, "cpusPerWorker": "500m"}, {"name": "spare"}]}},
        "gpusPerWorker, cpusPerWorker and memory are immutable",
    ),
    (
        "worker-added",
        {"cluster": {"workerGroups": [{"name": "default", "replicas": 2}, {"name": "spare"}, {"name": "more"}]}},
        "spec.cluster.workerGroups cannot be added, removed or renamed",
    ),
    (
        "worker-renamed",
        {"cluster": {"workerGroups": [{"name": "default", "replicas": 2}, {"name": "other"}]}},
        "spec.cluster.workerGroups cannot be added, removed or renamed",
    ),
]


@controlplane
@pytest.mark.parametrize(("case", "patch", "message"), IMMUTABLE_PATCHES, ids=[c[0] for c in IMMUTABLE_PATCHES])
def test_api_server_refuses_changes_to_immutable_fields(
    apiserver: Any, running: str, case: str, patch: dict[str, Any], message: str
) -> None:
    result = merge_patch(apiserver, running, {"spec": patch})
    assert result.returncode != 0, f"{case} was accepted"
    assert message in result.stderr, result.stderr


@controlplane
def test_api_server_allows_operational_changes(apiserver: Any, running: str) -> None:
    patch = {
        "spec": {
            "runPolicy": {"suspend": True, "ttlSecondsAfterFinished": 60, "activeDeadlineSeconds": 7200},
            "trainer": {"totalSteps": 1000},
            "cluster": {
                "workerGroups": [
                    {"name": "default", "replicas": 3, "minReplicas": 1, "maxReplicas": 8},
                    {"name": "spare", "replicas": 0},
                ]
            },
        }
    }
    result = merge_patch(apiserver, running, patch)
    assert result.returncode == 0, result.stderr
    spec = get(apiserver, running)["spec"]
    assert spec["runPolicy"]["suspend"] is True and spec["trainer"]["totalSteps"] == 1000
    assert [g["replicas"] for g in spec["cluster"]["workerGroups"]] == [3, 0]


@controlplane
def test_status_subresource_takes_conditions_and_progress(apiserver: Any, running: str) -> None:
    status = {
        "status": {
            "observedGeneration": 1,
            "phase": "Running",
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "RayJobRunning",
                    "message": "training",
                    "lastTransitionTime": "2025-01-01T00:00:00Z",
                }
            ],
            "progress": {"step": 3, "totalSteps": 20, "rewardMean": 0.25, "valRewardMean": 0.5},
        }
    }
    result = merge_patch(apiserver, running, status, "--subresource=status")
    assert result.returncode == 0, result.stderr
    stored = get(apiserver, running)
    assert stored["status"]["progress"]["rewardMean"] == 0.25
    assert stored["metadata"]["generation"] == 1  # status writes do not bump the generation
    table = kubectl(apiserver, "get", "rltrainingjob", running, "-n", "default", "-o", "wide").stdout
    header, row = table.splitlines()[:2]
    assert header.split()[:4] == ["NAME", "READY", "SUCCEEDED", "STEP"]
    assert row.split()[1:6] == ["True", "3", "0.25", "0.5", "Running"]
    assert kubectl(apiserver, "get", "rlj", "-n", "default").returncode == 0
    assert running in kubectl(apiserver, "get", "hybridflow", "-n", "default", "-o", "name").stdout
