"""Reading an RLTrainingJob from YAML (or JSON), with every problem reported by field path."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from hybridflow.api.spec import RLTrainingJob


class SpecError(Exception):
    """A user error in a job file: `problems` are lines of `field.path: what is wrong (what is allowed)`."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        super().__init__(self.render())

    def render(self) -> str:
        head = f"{self.source}: {len(self.problems)} problem{'s' if len(self.problems) != 1 else ''}"
        return "\n".join([head, *(f"  - {p}" for p in self.problems)])


def _field_path(loc: tuple[Any, ...]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += ("." if path else "") + str(part)
    return path or "(document)"


def _describe(err: ErrorDetails) -> str:
    kind = err["type"]
    ctx = err.get("ctx") or {}
    if kind == "extra_forbidden":
        return "unknown field (check the spelling; fields are camelCase)"
    if kind == "literal_error":
        return f"got {err.get('input')!r}, allowed: {ctx.get('expected')}"
    if kind == "missing":
        return "required field is missing"
    msg = err["msg"]
    if kind == "value_error":
        msg = msg.removeprefix("Value error, ")
    elif "input" in err and not isinstance(err["input"], dict | list):
        msg = f"{msg} (got {err['input']!r})"
    return msg


def problems_from(error: ValidationError) -> list[str]:
    """One line per pydantic error, using the camelCase paths users write."""
    out = []
    for err in error.errors():
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        out.append(f"{_field_path(loc)}: {_describe(err)}")
    return out


INT64 = 2**63
JSON_INTEGRAL = 2**53
"""The largest float the API server still takes for an integer (go-openapi's IsFloat64AJSONInteger)."""


def as_json(value: Any, path: str = "", problems: list[str] | None = None) -> Any:
    """The document's numbers as the API server reads its JSON: an integer beyond 64 bits is a float, a float
    with no fraction (2.0, up to 2^53) an integer; NaN and the infinities, which YAML can write and JSON cannot,
    are problems (appended to `problems`)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        if -INT64 <= value < INT64:
            return value
        try:
            return float(value)
        except OverflowError:
            value = math.inf
    if isinstance(value, float):
        if not math.isfinite(value):
            if problems is not None:
                problems.append(f"{path or '(document)'}: {value} is not a number a Kubernetes object can hold "
                                "(JSON has no NaN or infinity)")
            return value
        return int(value) if value.is_integer() and abs(value) <= JSON_INTEGRAL else value
    if isinstance(value, dict):
        return {k: as_json(v, f"{path}.{k}" if path else str(k), problems) for k, v in value.items()}
    if isinstance(value, list):
        return [as_json(v, f"{path}[{i}]", problems) for i, v in enumerate(value)]
    return value


def parse_job(doc: Any, source: str = "<input>") -> RLTrainingJob:
    """Validate a decoded YAML document as the API server would; raise SpecError listing every problem.

    Strict types, as the API server's JSON types: "2" is no integer and 1 no boolean (pydantic's default
    would convert both). Fields by their camelCase names alone: total_steps is no field of the API.
    """
    if not isinstance(doc, dict):
        raise SpecError(source, [f"(document): expected a mapping with apiVersion/kind/spec, got {type(doc).__name__}"])
    non_json: list[str] = []
    doc = as_json(doc, problems=non_json)
    if non_json:
        raise SpecError(source, non_json)
    try:
        return RLTrainingJob.model_validate(doc, strict=True, by_alias=True, by_name=False)
    except ValidationError as e:
        raise SpecError(source, problems_from(e)) from None


STDIN = "-"
"""The path that means standard input (`hybridflow validate -`)."""


def load_job(path: str | Path) -> RLTrainingJob:
    """Read one RLTrainingJob from a YAML file, or a JSON one (`.json`, as the operator mounts it); `-` reads
    standard input (JSON when it starts with `{`, else YAML).

    JSON is read as JSON: YAML 1.1 would take a number such as 1e-06 for a string.
    """
    if str(path) == STDIN:
        text = sys.stdin.read()
        return parse_job_text(text, "<stdin>", as_json=text.lstrip().startswith("{"))
    p = Path(path)
    if not p.is_file():
        raise SpecError(str(p), [f"file not found: {p}"])
    return parse_job_text(p.read_text(), str(p), as_json=p.suffix == ".json")


def parse_job_text(text: str, source: str, as_json: bool = False) -> RLTrainingJob:
    """One RLTrainingJob from YAML or JSON text; a YAML stream may hold other documents beside it."""
    if as_json:
        try:
            return parse_job(json.loads(text), source)
        except json.JSONDecodeError as e:
            where = f"line {e.lineno}, column {e.colno}"
            raise SpecError(source, [f"(document): malformed JSON: {where}: {e.msg}"]) from None
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise SpecError(source, [f"(document): malformed YAML: {where}{getattr(e, 'problem', e)}"]) from None
    jobs = [d for d in docs if isinstance(d, dict) and d.get("kind") == "RLTrainingJob"]
    if len(docs) == 1:
        return parse_job(docs[0], source)
    if len(jobs) != 1:
        raise SpecError(source, [f"(document): expected exactly one RLTrainingJob, found {len(jobs)}"])
    return parse_job(jobs[0], source)
