"""Schema helpers shared by the spec models: CEL rules, list types and constrained strings."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import Field, PlainValidator, WithJsonSchema

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


MAX_CPU_CORES = 1024
# Cores ("2", "1.5": at most 3 decimals, as Kubernetes counts CPU in millicores) or millicores ("500m").
# Bounded digit counts keep the CEL rule's int() from overflowing; `[.]` needs no escape in a CEL string.
_CPU_TEXT = r"^([0-9]{1,4}([.][0-9]{1,3})?|[0-9]{1,7}m)$"
# The API server costs a CEL rule on an int-or-string by its maxLength (else as long as a whole request).
_CPU_MAX_LENGTH = 16
CPU_AMOUNT_MESSAGE = (
    f"must be a CPU amount above 0 and at most {MAX_CPU_CORES} cores: an integer (cores), or a string"
    ' of cores with at most 3 decimals ("2", "1.5") or of millicores ("500m")'
)
_MILLICORES = "int(self.replace('m', ''))"
_CPU_RULE = (
    f"type(self) == int ? self >= 1 && self <= {MAX_CPU_CORES}"
    f" : type(self) == string && self.matches('{_CPU_TEXT}') && (self.endsWith('m')"
    f" ? {_MILLICORES} >= 1 && {_MILLICORES} <= {MAX_CPU_CORES * 1000}"
    f" : double(self) > 0.0 && double(self) <= {MAX_CPU_CORES}.0)"
)


def cpu_cores(amount: int | str) -> float:
    """Cores of a CPU amount (2, "1.5", "500m"): the one place that reads the Kubernetes notation."""
    if isinstance(amount, str) and amount.endswith("m"):
        return int(amount[:-1]) / 1000
    return float(amount)


def _cpu_amount(value: Any) -> int | str:
    """The amount as written, so pods request exactly what the user asked for; anything else is refused.

    One check with one message for every kind of mistake (bool, fraction, unit, zero, too many cores), the
    message of the CRD's rule, so `hybridflow validate` and the API server say the same thing.
    """
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # JSON has one kind of number: the API server takes 2.0 for the integer 2
    ok = (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, str) and re.fullmatch(_CPU_TEXT, value) is not None
    )
    if not ok or not 0 < cpu_cores(value) <= MAX_CPU_CORES:
        raise ValueError(f"{CPU_AMOUNT_MESSAGE} (got {value!r})")
    return value


CpuAmount = Annotated[
    int | str,
    PlainValidator(_cpu_amount),
    WithJsonSchema(
        {
            "x-kubernetes-int-or-string": True,
            "maxLength": _CPU_MAX_LENGTH,
            **rules(cel(_CPU_RULE, CPU_AMOUNT_MESSAGE)),
        }
    ),
]
"""A CPU request as Kubernetes writes one: 2, "2", "1.5" or "500m"; an int-or-string in the CRD."""
