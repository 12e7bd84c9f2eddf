"""charts/hybridflow/README.md, generated from the values schema: how to install, upgrade and test the chart,
and one table row per value with its type, default and description."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from hybridflow_operator.chart.schema import values_schema

HEADER = (
    "<!-- Generated from operator/hybridflow_operator/chart/values.py by `make chart-files`\n"
    "     (python -m hybridflow_operator.chart). Do not edit: change the model and regenerate. -->\n"
)

INTRO = """\
# hybridflow Helm chart

The hybridflow operator: RL post-training of LLMs declared as `RLTrainingJob` resources and run as KubeRay
RayJobs. The chart installs the RLTrainingJob CRD, the operator Deployment, its RBAC, ClusterRoles that give
the built-in `admin`, `edit` and `view` roles access to RLTrainingJobs, and a `helm test` check. The operator
renders RayJobs: the KubeRay operator (ray.io/v1, 1.1 or later) must be installed too. Kubernetes 1.29 or later.

## Install

    helm install hybridflow charts/hybridflow -n hybridflow-system --create-namespace
    kubectl -n hybridflow-system rollout status deployment/hybridflow

`watchNamespaces={team-a,team-b}` limits the operator to those namespaces (a Role in each instead of a
ClusterRole). Users bound to the built-in `edit` or `admin` role in a namespace can create RLTrainingJobs
there, and `view` can read them and their status (`rbac.aggregateRoles`).

## Upgrade

    helm upgrade hybridflow charts/hybridflow -n hybridflow-system -f my-values.yaml

Pass your values again (or `--reset-then-reuse-values`, Helm 3.14 or later): `--reuse-values` keeps the old
chart's defaults, without the keys a newer chart adds. The CRD is a template of the chart, so an upgrade brings
its new schema along; with `crds.keep` (the default) `helm uninstall` leaves it, and with it every
RLTrainingJob, in place.

## Test

    helm test hybridflow -n hybridflow-system

runs a pod from the operator image (`python -m hybridflow_operator.install_check`) that checks the
RLTrainingJob CRD is Established and the operator Deployment is Available, under a ServiceAccount that may
only read those two objects (both come with `rbac.create`). Helm prints the pod's report (Helm 3.18 or later)
and deletes the pod when it passes; a failed one stays for `kubectl logs`. Leave out `--logs`: Helm reads the
logs after it deleted a passed pod, and fails.

## Values

`values.schema.json` holds the same types: `helm install`, `upgrade`, `template` and `lint` refuse an unknown
key or a value of the wrong type, naming it (`at '/image': additional properties 'tga' not allowed`). Kubernetes
objects the chart copies into the pod as they are (`podSecurityContext`, `securityContext`, `affinity`,
`extraEnv[].valueFrom`) are checked by the API server. A numeric image tag needs `--set-string`.

| Key | Type | Default | Description |
|-----|------|---------|-------------|
"""


def _either(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def type_name(node: dict[str, Any]) -> str:
    """A short name of a schema node's type: `string`, `list of string`, `map of string`, `integer or string`."""
    if "anyOf" in node:
        return _either([type_name(o) for o in node["anyOf"] if o.get("type") != "null"])
    if "enum" in node:
        return "one of " + _either([json.dumps(v) for v in node["enum"]])
    kind = node.get("type", "any")
    if kind == "array":
        return f"list of {type_name(node.get('items', {}))}"
    if kind == "object" and isinstance(node.get("additionalProperties"), dict):
        return f"map of {type_name(node['additionalProperties'])}"
    return str(kind)


def _cell(text: str) -> str:
    """Table-safe Markdown: `|` escaped, and `<`/`>` outside code spans, which would read as HTML tags."""
    parts = text.replace("|", "\\|").split("`")
    for i in range(0, len(parts), 2):  # the even parts lie outside backticks
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def rows(node: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, str, str, str]]:
    """(key, type, default, description) of every value, depth first; an object of values gets a row of its own."""
    for key, child in node.get("properties", {}).items():
        if not prefix and key == "global":
            continue
        path = f"{prefix}{key}"
        default = f"`{json.dumps(child['default'], separators=(', ', ': '))}`" if "default" in child else ""
        yield path, type_name(child), default, child.get("description", "")
        if "properties" in child:
            yield from rows(child, f"{path}.")
        elif "properties" in child.get("items", {}):
            yield from rows(child["items"], f"{path}[].")


def render_readme() -> str:
    """Contents of README.md."""
    table = "".join(
        f"| `{key}` | {_cell(kind)} | {_cell(default)} | {_cell(description)} |\n"
        for key, kind, default, description in rows(values_schema())
    )
    return HEADER + "\n" + INTRO + table
