"""charts/hybridflow/values.schema.json, generated from `ChartValues`.

Helm validates the merged values against it on install, upgrade, template and lint, so an unknown key
(`additionalProperties: false` on every modelled object) or a wrong type fails before anything is applied.
Pydantic's schema is rewritten into one self-contained JSON Schema (draft-07, which every Helm 3 reads):
$refs are inlined, titles dropped, and each leaf's default is the model's, as values.yaml has it.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from hybridflow_operator.chart.values import ChartValues, defaults

DRAFT = "http://json-schema.org/draft-07/schema#"
TITLE = "Values of the hybridflow Helm chart"
# Helm adds `global` to every chart's values (a parent chart shares it with its subcharts): allowed, unused.
GLOBAL = {"description": "Values Helm shares between a parent chart and its subcharts; this chart reads none.",
          "type": "object"}

_KEY_ORDER = ["$schema", "title", "description", "type", "enum", "default", "minimum", "maximum", "minLength",
              "maxLength", "pattern", "minItems", "required", "properties", "additionalProperties", "items", "anyOf"]
_DROPPED = {"title", "default"}


def _merge(target: dict[str, Any], field: dict[str, Any]) -> dict[str, Any]:
    """A field's schema over its model's: the field's own description wins over the model's docstring."""
    return {**target, **field}


def _inline(node: Any, defs: dict[str, Any], seen: tuple[str, ...] = ()) -> Any:
    if isinstance(node, list):
        return [_inline(n, defs, seen) for n in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "$ref" in node:
        name = node.pop("$ref").removeprefix("#/$defs/")
        if name in seen:
            raise ValueError(f"recursive model {name!r}: the values schema inlines every model")
        return _inline(_merge(copy.deepcopy(defs[name]), node), defs, (*seen, name))
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROPPED:
            continue
        if key == "properties":
            out[key] = {k: _inline(v, defs, seen) for k, v in value.items()}
        elif key == "description":
            out[key] = " ".join(value.split())  # docstrings wrap lines; a description is one paragraph
        else:
            out[key] = _inline(value, defs, seen)
    return out


def _set_defaults(node: dict[str, Any], value: dict[str, Any]) -> None:
    """Each leaf property gets its default from `value` (the model's defaults at this level)."""
    for key, child in node.get("properties", {}).items():
        if key not in value:
            continue
        if "properties" in child and isinstance(value[key], dict):
            _set_defaults(child, value[key])
        else:
            child["default"] = value[key]


def _tidy(node: Any) -> Any:
    if isinstance(node, list):
        return [_tidy(n) for n in node]
    if not isinstance(node, dict):
        return node
    rank = {k: i for i, k in enumerate(_KEY_ORDER)}
    out = {k: node[k] for k in sorted(node, key=lambda k: (rank.get(k, len(rank)), k))}
    for key, value in out.items():
        if key == "properties":
            out[key] = {k: _tidy(v) for k, v in value.items()}
        elif key != "default":
            out[key] = _tidy(value)
    return out


def values_schema() -> dict[str, Any]:
    """The JSON Schema of the chart's values."""
    raw = ChartValues.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    root = _inline(raw, defs)
    _set_defaults(root, defaults())
    root["properties"]["global"] = dict(GLOBAL)
    return _tidy({"$schema": DRAFT, "title": TITLE, **root})


def render_schema() -> str:
    """Contents of values.schema.json."""
    return json.dumps(values_schema(), indent=2, ensure_ascii=False) + "\n"
