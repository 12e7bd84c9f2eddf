"""docs/from-verl.md against the API models: every spec field it names exists and takes the values it gives,
and its example job validates and renders. Pure: no cluster, no Ray."""

from __future__ import annotations

import re
import types
from dataclasses import dataclass
from typing import Annotated, Any, Union, get_args, get_origin

import pytest
import yaml
from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from hybridflow.api import RLTrainingJob, parse_job
from hybridflow.k8s.render import render_children
from hybridflow.k8s.settings import RenderSettings
from tests.conftest import ROOT

PAGE = ROOT / "docs" / "from-verl.md"
CODE = re.compile(r"`([^`]+)`")
FENCED = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
VERL_KEYS = (
    "data.train_batch_size",
    "actor_rollout_ref.actor.ppo_mini_batch_size",
    "actor_rollout_ref.rollout.n",
    "algorithm.adv_estimator",
    "algorithm.kl_ctrl.kl_coef",
    "actor_rollout_ref.actor.optim.lr",
    "critic.optim.lr",
    "trainer.total_training_steps",
    "trainer.save_freq",
    "actor_rollout_ref.rollout.name",
    "actor_rollout_ref.rollout.tensor_model_parallel_size",
    "actor_rollout_ref.actor.clip_ratio",
    "actor_rollout_ref.actor.loss_agg_mode",
    "trainer.n_gpus_per_node",
    "trainer.nnodes",
    "actor_rollout_ref.actor.policy_loss.loss_mode",
)
"""The verl keys the page must map (to a field, or to none)."""


@dataclass(frozen=True)
class Row:
    verl: str
    spec: str
    line: int


def table_rows(text: str) -> list[Row]:
    """The rows of every `| verl | RLTrainingJob | notes |` table."""
    rows: list[Row] = []
    in_table = False
    for number, line in enumerate(text.splitlines(), 1):
        if not line.startswith("|"):
            in_table = False
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[:2] == ["verl", "RLTrainingJob"]:
            in_table = True
        elif in_table and set(cells[0]) != {"-"}:
            rows.append(Row(cells[0], cells[1], number))
    return rows


def spec_refs(text: str) -> list[str]:
    """Every `spec.path` or `spec.path: value` in code spans of `text` (fenced blocks left out)."""
    return [c for c in CODE.findall(FENCED.sub("", text)) if c.startswith("spec.")]


def _unwrap(tp: Any) -> Any:
    """X from Annotated[X, ...] and from X | None."""
    if get_origin(tp) is Annotated:
        return _unwrap(get_args(tp)[0])
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return _unwrap(args[0])
    return tp


def field_at(path: str) -> FieldInfo:
    """The model field at a camelCase path such as spec.cluster.workerGroups[].gpusPerWorker.

    `name[]` steps into the items of a list; a list field must be written so to go below it.
    """
    model: Any = RLTrainingJob
    parts = path.split(".")
    field: FieldInfo | None = None
    for i, part in enumerate(parts):
        name, into_items = part.removesuffix("[]"), part.endswith("[]")
        where = ".".join(parts[:i]) or "the job"
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise AssertionError(f"{path}: {where} has no fields")
        fields = {f.alias or n: f for n, f in model.model_fields.items()}
        if name not in fields:
            raise AssertionError(f"{path}: {where} has no field {name!r}; it has {', '.join(sorted(fields))}")
        field = fields[name]
        tp = _unwrap(field.annotation)
        is_list = get_origin(tp) is list
        if into_items and not is_list:
            raise AssertionError(f"{path}: {name} is not a list")
        if is_list and i < len(parts) - 1 and not into_items:
            raise AssertionError(f"{path}: {name} is a list; write {name}[] to name a field of its items")
        model = _unwrap(get_args(tp)[0]) if into_items else tp
    assert field is not None
    return field


def check_ref(ref: str) -> None:
    """`spec.path` exists; `spec.path: value` also takes that value (YAML), within the field's constraints."""
    path, _, value = ref.partition(": ")
    field = field_at(path)
    if value:
        annotation = Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
        try:
            TypeAdapter(annotation).validate_python(yaml.safe_load(value))
        except ValidationError as e:
            raise AssertionError(f"{ref}: {path} does not take {value}: {e.errors()[0]['msg']}") from None


TEXT = PAGE.read_text()
ROWS = table_rows(TEXT)


def test_the_page_has_its_tables() -> None:
    assert len(ROWS) > 50
    assert all(r.verl for r in ROWS)
    assert len(set(spec_refs(TEXT))) > 60


@pytest.mark.parametrize("ref", sorted(set(spec_refs(TEXT))))
def test_every_spec_field_the_page_names_is_in_the_model(ref: str) -> None:
    check_ref(ref)


def test_every_row_maps_to_spec_fields_or_says_none() -> None:
    for row in ROWS:
        spans = CODE.findall(row.spec)
        assert row.spec == "none" or (spans and all(s.startswith("spec.") for s in spans)), \
            f"{PAGE.name}:{row.line}: {row.spec!r} names no spec field and is not 'none'"


def test_the_page_maps_the_verl_keys_of_a_ppo_or_grpo_run() -> None:
    mapped = {span.partition("=")[0] for row in ROWS for span in CODE.findall(row.verl)}
    assert not set(VERL_KEYS) - mapped


@pytest.mark.parametrize(("ref", "problem"), [
    ("spec.algorithm.klCoef", "has no field 'klCoef'"),
    ("spec.rollout.engine: sglang", "does not take sglang"),
    ("spec.algorithm.ppoEpochs: 0", "does not take 0"),
    ("spec.cluster.workerGroups.replicas", "write workerGroups[]"),
    ("spec.data[].batchSize", "data is not a list"),
    ("spec.data.batchSize.value", "has no fields"),
])
def test_the_check_catches_a_page_that_drifted(ref: str, problem: str) -> None:
    with pytest.raises(AssertionError, match=re.escape(problem)):
        check_ref(ref)


def test_the_example_job_validates_and_renders() -> None:
    block = TEXT.split("<!-- from-verl example -->", 1)[1].split("```yaml", 1)[1].split("```", 1)[0]
    job = parse_job(yaml.safe_load(block), source=PAGE.name)
    assert job.spec.algorithm.mini_batch_size == 64 * job.spec.rollout.samples_per_prompt  # verl's 64 prompts
    assert (job.spec.algorithm.kl_penalty.mode, job.spec.algorithm.name) == ("loss", "grpo")
    rayjob = next(c for c in render_children(job, RenderSettings()) if c["kind"] == "RayJob")
    groups = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert [(g["groupName"], g["replicas"]) for g in groups] == [("actor", 1)]


def test_the_readme_links_the_page() -> None:
    assert "(docs/from-verl.md)" in (ROOT / "README.md").read_text()
