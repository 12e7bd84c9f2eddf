"""YAML for people to read: block style, keys in the order given, multi-line strings as literal blocks,
and no line folding (a CEL rule or an embedded job.json split over lines is hard to review)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import yaml


class _BlockDumper(yaml.SafeDumper):
    pass


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_BlockDumper.add_representer(str, _represent_str)
_OPTIONS: dict[str, Any] = {"Dumper": _BlockDumper, "sort_keys": False, "default_flow_style": False,
                            "width": 4096, "allow_unicode": True}


def dump(obj: Any) -> str:
    return yaml.dump(obj, **_OPTIONS)


def dump_all(docs: Iterable[Any]) -> str:
    return yaml.dump_all(docs, **_OPTIONS)
