"""Shared pydantic configuration: camelCase in YAML, snake_case in Python, unknown fields rejected."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
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

    def to_yaml_dict(self) -> dict:
        """The camelCase form, without unset optional fields."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")
