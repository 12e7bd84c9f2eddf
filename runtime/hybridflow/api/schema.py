"""Schema helpers shared by the spec models: CEL rules, list types and constrained strings."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

Quantity = Annotated[str, Field(pattern=r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$")]


def cel(rule: str, message: str, field_path: str | None = None) -> dict[str, str]:
    """One CEL rule for the CRD: the API server enforces it at admission, before the operator sees the job.

    Rules guard fields with has() even where a default fills them: the API server also checks rules
    against each `default: {}` itself, before nested defaults apply.
    """
    out = {"rule": rule, "message": message}
    if field_path:
        out["fieldPath"] = field_path
    return out


def rules(*items: dict[str, str]) -> dict[str, Any]:
    """Schema extras carrying CEL rules (x-kubernetes-validations)."""
    return {"x-kubernetes-validations": list(items)}


def list_map(max_items: int, key: str = "name") -> dict[str, Any]:
    """A list the API server merges and de-duplicates by `key` (server-side apply, per-item oldSelf).

    A second item with the same key is refused at admission ("Duplicate value"), naming its index.
    """
    return {"maxItems": max_items, "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": [key]}
