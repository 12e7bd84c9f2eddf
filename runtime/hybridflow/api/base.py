"""Shared pydantic configuration: camelCase in YAML, snake_case in Python, unknown fields rejected."""

from __future__ import annotations

import functools
import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic.alias_generators import to_camel


class ApiModel(BaseModel):
    """Base of every spec model: the YAML a user writes is the YAML `kubectl apply` takes."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_assignment=True,
        use_attribute_docstrings=True,
    )

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        """A null where the field takes none is the field left out, as the API server reads it: a structural
        schema prunes such nulls before defaulting, and so a null value in a map (`nodeSelector: {a: null}`).
        A field that takes null (`dualClipC: null`) keeps it."""
        if not isinstance(data, dict):
            return data
        absent, maps = _not_nullable(cls), _maps_without_null(cls)
        return {k: {mk: mv for mk, mv in v.items() if mv is not None} if k in maps and isinstance(v, dict) else v
                for k, v in data.items() if v is not None or k not in absent}

    def to_yaml_dict(self) -> dict:
        """The camelCase form, without unset optional fields."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


@functools.cache
def _not_nullable(model: type[BaseModel]) -> frozenset[str]:
    """Aliases (the names documents use) of the model's fields whose type has no None."""
    return frozenset(field.alias or name for name, field in model.model_fields.items()
                     if not _takes_null(field.annotation))


@functools.cache
def _maps_without_null(model: type[BaseModel]) -> frozenset[str]:
    """Aliases of the model's map fields (dict[str, X]) whose values cannot be null."""
    out: set[str] = set()
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):
            options = [a for a in typing.get_args(annotation) if a is not type(None)]
            annotation = options[0] if len(options) == 1 else None
        if typing.get_origin(annotation) is dict and not _takes_null(typing.get_args(annotation)[1]):
            out.add(field.alias or name)
    return frozenset(out)


def _takes_null(annotation: Any) -> bool:
    """Whether a value of this type may be null: Any, None, or a union with None."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    return annotation is Any or annotation is None or (union and type(None) in typing.get_args(annotation))
