"""The RLTrainingJob CustomResourceDefinition, generated from the pydantic models.

    python -m hybridflow.api.crd [--out DIR] [--chart DIR] [--check] [--stdout]

Writes crds/hybridflow.io_rltrainingjobs.yaml and the same CRD as a Helm template in
charts/hybridflow/templates/crds/. `--check` writes nothing and exits 1 when the files on disk differ
from what the models generate (CI runs it, so the committed CRD never drifts from the models).

The API server only accepts a *structural* schema: every node typed, no $ref, no anyOf-with-null,
no `title`/`const`/`additionalProperties: false`. Pydantic emits JSON Schema 2020-12, so this module
rewrites it: $refs are inlined, `X | None` becomes `nullable: true`, numeric exclusive bounds become
OpenAPI v3.0 booleans, and fields whose default is a nested model get `default: {}` so the API server
fills in the whole tree of defaults and the stored object shows the effective configuration.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue
from pydantic_core import core_schema

from hybridflow.api import generated, yaml_text
from hybridflow.api.spec import API_GROUP, API_VERSION, KIND, PLURAL, RLTrainingJobSpec
from hybridflow.api.status import RLTrainingJobStatus

CRD_NAME = f"{PLURAL}.{API_GROUP}"
CRD_FILE = f"{API_GROUP}_{PLURAL}.yaml"
SHORT_NAMES = ["rlj"]
CATEGORIES = ["hybridflow"]
MAX_CONDITIONS = 16
DESCRIPTION = (
    "RLTrainingJob declares an RL post-training run (PPO or GRPO) of a language model; the hybridflow "
    "operator runs it as a KubeRay RayJob and reports progress and kstatus conditions in its status."
)

HEADER = (
    "# Generated from the pydantic models in runtime/hybridflow/api by `make crds`\n"
    "# (python -m hybridflow.api.crd). Do not edit: change the models and regenerate.\n"
)

# Marks an integer-or-string field (such as a CPU amount); the API server wants it without a `type`.
_INT_OR_STRING = "x-kubernetes-int-or-string"

# Keys the API server rejects or that carry no meaning for it.
_DROPPED_KEYS = {"title", "examples", "$schema", "discriminator", "readOnly", "writeOnly", "deprecated"}

# metadata.name names the RayJob, ConfigMap and RBAC objects the operator derives from the job, and the
# runtime's model of the job (ObjectMeta) accepts a DNS label only; the API server alone would allow dots.
ROOT_RULES = [
    {
        "rule": "self.metadata.name.size() <= 63 && !self.metadata.name.contains('.')",
        "message": "metadata.name must be a DNS label: at most 63 lowercase letters, digits and '-'",
    }
]

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
    {"name": "Succeeded", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Succeeded")].status'},
    {"name": "Step", "type": "integer", "jsonPath": ".status.progress.step"},
    {"name": "Reward", "type": "number", "jsonPath": ".status.progress.rewardMean"},
    {"name": "Val-Reward", "type": "number", "jsonPath": ".status.progress.valRewardMean", "priority": 1},
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "priority": 1},
    {"name": "Algorithm", "type": "string", "jsonPath": ".spec.algorithm.name", "priority": 1},
    {"name": "GPU", "type": "string", "jsonPath": ".spec.cluster.gpuType", "priority": 1},
    {"name": "RayJob", "type": "string", "jsonPath": ".status.rayJobName", "priority": 1},
    {"name": "Total-Steps", "type": "integer", "jsonPath": ".status.progress.totalSteps", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


class _CrdJsonSchema(GenerateJsonSchema):
    """Pydantic's generator, plus `default: {}` for fields defaulting to a nested model.

    Pydantic leaves defaults made by a factory out of the schema; for a nested model the factory only
    means "all of its own defaults", which the API server reproduces from `{}` recursively.
    """

    def default_schema(self, schema: core_schema.WithDefaultSchema) -> JsonSchemaValue:
        factory = schema.get("default_factory")
        if isinstance(factory, type) and issubclass(factory, BaseModel):
            return {**self.generate_inner(schema["schema"]), "default": {}}
        return super().default_schema(schema)


def _json_schema(model: type[BaseModel]) -> dict[str, Any]:
    return model.model_json_schema(by_alias=True, mode="validation", schema_generator=_CrdJsonSchema)


def _merge(model: dict[str, Any], field: dict[str, Any]) -> dict[str, Any]:
    """A field's schema over its model's: the field's description and default win, rules add up."""
    out = {**model, **field}
    rules = model.get("x-kubernetes-validations", []) + field.get("x-kubernetes-validations", [])
    if rules:
        out["x-kubernetes-validations"] = rules
    return out


class _Structural:
    """Rewrites one pydantic JSON Schema (with its $defs) into a Kubernetes structural schema."""

    def __init__(self, schema: dict[str, Any]) -> None:
        self.defs: dict[str, Any] = schema.get("$defs", {})
        self.root = {k: v for k, v in schema.items() if k != "$defs"}

    def convert(self) -> dict[str, Any]:
        return self._node(self.root, path="", seen=())

    def _resolve(self, ref: str, seen: tuple[str, ...]) -> tuple[dict[str, Any], tuple[str, ...]]:
        name = ref.removeprefix("#/$defs/")
        if name in seen:
            # A structural schema cannot express recursion; the models have none, keep it that way.
            raise ValueError(f"recursive model {name!r} cannot be expressed in a CRD schema")
        return copy.deepcopy(self.defs[name]), (*seen, name)

    def _node(self, node: dict[str, Any], path: str, seen: tuple[str, ...]) -> dict[str, Any]:
        node = dict(node)
        if "$ref" in node:
            target, seen = self._resolve(node.pop("$ref"), seen)
            node = _merge(target, node)
        if "allOf" in node:
            parts = node.pop("allOf")
            if len(parts) != 1:
                raise ValueError(f"{path or '.'}: allOf with {len(parts)} parts is not supported")
            node = _merge(self._node(parts[0], path, seen), node)
        nullable = False
        if "anyOf" in node:
            options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
            if len(options) != 1:
                raise ValueError(f"{path or '.'}: unions other than `X | None` cannot be structural")
            nullable = True
            node = _merge(self._node(options[0], path, seen), node)
        if "const" in node:
            node["enum"] = [node.pop("const")]
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in _DROPPED_KEYS:
                continue
            if key == "default" and value is None:
                continue  # absent and null mean the same to the models
            if key == "additionalProperties" and value is False:
                continue  # the API server prunes unknown fields (and kubectl rejects them)
            if key in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(value, bool):
                out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
                out[key] = True
                continue
            if key == "properties":
                out[key] = {k: self._node(v, f"{path}.{k}", seen) for k, v in value.items()}
            elif key in ("items", "additionalProperties") and isinstance(value, dict):
                out[key] = self._node(value, f"{path}[]", seen)
            else:
                out[key] = value
        if nullable and "enum" in out:
            # The API server checks a null against the enum even where the field is nullable, and refuses it. Not
            # nullable, the null is pruned as the field left out: what None means to the model where it defaults.
            if "default" in out:
                raise ValueError(f"{path or '.'}: an enum whose null differs from its default cannot be structural")
        elif nullable:
            out["nullable"] = True
        if "type" not in out and out.get(_INT_OR_STRING) is not True:
            raise ValueError(f"{path or '.'}: schema node without a type: {sorted(out)}")
        if out.get("type") == "object" and "properties" not in out and "additionalProperties" not in out:
            raise ValueError(f"{path or '.'}: free-form object; give it a model or a dict value type")
        return out


_KEY_ORDER = [
    "description",
    "type",
    "format",
    "nullable",
    "default",
    "enum",
    "minimum",
    "exclusiveMinimum",
    "maximum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "required",
    "properties",
    "additionalProperties",
    "items",
    "x-kubernetes-int-or-string",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "x-kubernetes-validations",
]
_RULE_KEY_ORDER = ["rule", "message", "fieldPath", "reason"]


def _by_rank(d: dict[str, Any], order: list[str]) -> dict[str, Any]:
    rank = {k: i for i, k in enumerate(order)}
    return dict(sorted(d.items(), key=lambda kv: (rank.get(kv[0], len(rank)), kv[0])))


def _tidy(node: dict[str, Any]) -> dict[str, Any]:
    """Stable, readable key order: description and type first, nested schemas, then CEL rules last."""
    out = _by_rank(node, _KEY_ORDER)
    if "properties" in out:
        out["properties"] = {k: _tidy(v) for k, v in out["properties"].items()}
    for key in ("items", "additionalProperties"):
        if isinstance(out.get(key), dict):
            out[key] = _tidy(out[key])
    if "x-kubernetes-validations" in out:
        out["x-kubernetes-validations"] = [_by_rank(r, _RULE_KEY_ORDER) for r in out["x-kubernetes-validations"]]
    return out


def structural_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The model's JSON Schema rewritten into a structural OpenAPI v3 schema the API server accepts."""
    return _tidy(_Structural(_json_schema(model)).convert())


def _status_schema() -> dict[str, Any]:
    schema = structural_schema(RLTrainingJobStatus)
    conditions = schema["properties"]["conditions"]
    # metav1.Condition lists are maps keyed by type (one condition per type), like built-in resources.
    conditions["x-kubernetes-list-type"] = "map"
    conditions["x-kubernetes-list-map-keys"] = ["type"]
    conditions["maxItems"] = MAX_CONDITIONS
    return schema


def openapi_schema() -> dict[str, Any]:
    """openAPIV3Schema of the RLTrainingJob: apiVersion, kind, metadata, spec and status."""
    spec = structural_schema(RLTrainingJobSpec)
    spec["default"] = {}
    spec.setdefault("description", "Desired state: what to train, on which data, with which resources.")
    status = _status_schema()
    status["default"] = {}  # a job nobody has observed yet reads observedGeneration 0
    status.setdefault("description", "Observed state, written by the operator and the runtime.")
    return {
        "description": DESCRIPTION,
        "type": "object",
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": _tidy(spec),
            "status": _tidy(status),
        },
        "x-kubernetes-validations": copy.deepcopy(ROOT_RULES),
    }


def crd() -> dict[str, Any]:
    """The CustomResourceDefinition object."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME},
        "spec": {
            "group": API_GROUP,
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": KIND.lower(),
                "shortNames": list(SHORT_NAMES),
                "categories": list(CATEGORIES),
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": API_VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": copy.deepcopy(PRINTER_COLUMNS),
                    "schema": {"openAPIV3Schema": openapi_schema()},
                }
            ],
        },
    }


def render_crd_yaml() -> str:
    """Contents of crds/hybridflow.io_rltrainingjobs.yaml."""
    return HEADER + "---\n" + yaml_text.dump(crd())


def render_chart_template() -> str:
    """The same CRD as a Helm template: installed iff .Values.crds.install, kept on uninstall iff crds.keep.

    It lives in templates/ rather than the chart's crds/ directory because Helm never upgrades files
    from crds/; a template is upgraded with the release, so a new chart version brings its schema along.
    """
    obj = crd()
    body = yaml_text.dump({"spec": obj["spec"]})
    if "{{" in body or "}}" in body:
        raise ValueError("the CRD contains '{{' or '}}', which Helm would read as template actions")
    head = (
        "{{- if .Values.crds.install }}\n"
        + HEADER
        + f"apiVersion: {obj['apiVersion']}\n"
        + f"kind: {obj['kind']}\n"
        + "metadata:\n"
        + f"  name: {obj['metadata']['name']}\n"
        + "  labels:\n"
        + '    {{- include "hybridflow.labels" . | nindent 4 }}\n'
        + "  {{- if .Values.crds.keep }}\n"
        + "  annotations:\n"
        + "    helm.sh/resource-policy: keep\n"
        + "  {{- end }}\n"
    )
    return head + body + "{{- end }}\n"


def outputs(out_dir: Path, chart_dir: Path) -> dict[Path, Callable[[], str]]:
    """Every generated file and how to render it."""
    return {
        out_dir / CRD_FILE: render_crd_yaml,
        chart_dir / "templates" / "crds" / CRD_FILE: render_chart_template,
    }


def check(out_dir: Path, chart_dir: Path) -> list[str]:
    """Differences between the files on disk and what the models generate (empty when up to date)."""
    return generated.stale(outputs(out_dir, chart_dir))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridflow.api.crd", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("crds"), help="directory of the CRD YAML (crds)")
    parser.add_argument(
        "--chart",
        type=Path,
        default=Path("charts/hybridflow"),
        help="Helm chart directory (charts/hybridflow)",
    )
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if the files are stale")
    parser.add_argument("--stdout", action="store_true", help="print the CRD YAML instead of writing files")
    args = parser.parse_args(argv)
    if args.stdout:
        sys.stdout.write(render_crd_yaml())
        return 0
    return generated.sync(outputs(args.out, args.chart), check=args.check, what="CRD files", make_target="crds")

if __name__ == "__main__":
    sys.exit(main())
