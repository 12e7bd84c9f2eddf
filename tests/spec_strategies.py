"""Hypothesis strategies for RLTrainingJob documents: mostly near-valid ones, so that both verdicts are common.

A document starts from one of examples/*.yaml and takes a few mutations. Most of them are read off the
CRD's own schema (every field, its type, bounds, pattern and enum): a value inside the bounds, one at or just
past a bound, one of another JSON type, null, or the field removed; an unknown key in any object. The rest
aim at what the schema cannot say alone: the CEL rules between fields, graph shapes, pod settings, worker
groups, job names, quantities, CPU amounts and Hub names.

`agreement=True` leaves out the fields whose rules only one side checks (ONE_SIDED in
tests/test_fuzz_spec.py), so the models and the API server must give the same verdict on everything drawn.
"""

from __future__ import annotations

import copy
import functools
import re
import string
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml
from hypothesis import strategies as st

from hybridflow.api import crd as crdgen
from hybridflow.api.spec import ALGORITHMS, GROUP_ALGORITHMS
from tests.helpers import BAD_CPU_AMOUNTS, BAD_POD_SETTINGS, HUB_NAMES

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = {p.name: yaml.safe_load(p.read_text()) for p in sorted((ROOT / "examples").glob("*.yaml"))}
SCHEMA: dict[str, Any] = crdgen.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
SPEC: dict[str, Any] = SCHEMA["properties"]["spec"]

FieldPath = tuple[str, ...]
"""Keys from spec down; `[]` stands for an item of a list, `{}` for an entry of a map."""
ITEM, ENTRY = "[]", "{}"

INT64 = 2**63
MODEL_ONLY_MAPS: tuple[FieldPath, ...] = (
    ("cluster", "podLabels"), ("cluster", "podAnnotations"), ("cluster", "serviceAccount", "annotations"),
)
"""Maps whose keys and values only the models check in full (ONE_SIDED in tests/test_fuzz_spec.py)."""


def schema_fields(node: dict[str, Any], path: FieldPath = ()) -> Iterator[tuple[FieldPath, dict[str, Any]]]:
    """Every field under `node` with its schema node, parents before children."""
    for name, child in node.get("properties", {}).items():
        yield (*path, name), child
        yield from schema_fields(child, (*path, name))
    if isinstance(node.get("items"), dict):
        yield (*path, ITEM), node["items"]
        yield from schema_fields(node["items"], (*path, ITEM))
    if isinstance(node.get("additionalProperties"), dict):
        yield (*path, ENTRY), node["additionalProperties"]
        yield from schema_fields(node["additionalProperties"], (*path, ENTRY))


FIELDS = [(path, node) for path, node in schema_fields(SPEC) if path[-1] != ITEM and ENTRY not in path[:-1]]
"""The fields a mutation may set: object properties and map entries (a list item is set through its fields)."""


def one_sided(path: FieldPath) -> bool:
    return any(path[: len(m)] == m for m in MODEL_ONLY_MAPS)


ALL_PATHS = [path for path, _ in FIELDS]
AGREED_PATHS = [path for path in ALL_PATHS if not one_sided(path)]


# -- values from a schema node ------------------------------------------------------------------------

NAMEISH = st.sampled_from(["a", "actor", "critic", "default", "gpu", "x-1", "A", "a_b", "a.b", "-a", "a-", "9",
                           "reward", "ref", "actor_rollout", "a" * 40, "a" * 41, "é", "a\n", " a", ""])
CANDIDATES = ["a", "a1", "actor", "1", "builtin:a", "/a", "a:b", "1Gi", "A1", "a.b", "x"]


def _pattern_ok(node: dict[str, Any], text: str) -> bool:
    pattern = node.get("pattern")
    return (pattern is None or re.fullmatch(pattern, text) is not None) and \
        node.get("minLength", 0) <= len(text) <= node.get("maxLength", 10**6)


def _int_bounds(node: dict[str, Any]) -> tuple[int, int]:
    low = node.get("minimum", -(2**31))
    high = node.get("maximum", 2**31)
    low = int(low) + (1 if node.get("exclusiveMinimum") else 0)
    high = int(high) - (1 if node.get("exclusiveMaximum") else 0)
    return low, high


def valid_value(node: dict[str, Any], depth: int = 0) -> st.SearchStrategy[Any]:
    """A value the schema node's type, bounds, pattern and enum allow (CEL rules may still refuse it)."""
    if node.get("x-kubernetes-int-or-string"):
        return st.one_of(st.integers(1, 64), st.sampled_from(["500m", "1.5", "2", "250m", "1024", "1000m"]))
    if "enum" in node:
        return st.sampled_from([v for v in node["enum"] if v is not None])
    kind = node.get("type")
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        low, high = _int_bounds(node)
        return st.one_of(st.integers(low, min(high, low + 64)), st.integers(low, high))
    if kind == "number":
        low, high = node.get("minimum"), node.get("maximum")
        return st.floats(min_value=low, max_value=high, exclude_min=bool(node.get("exclusiveMinimum")),
                         exclude_max=bool(node.get("exclusiveMaximum")), allow_nan=False, allow_infinity=False)
    if kind == "string":
        fits = [c for c in CANDIDATES if _pattern_ok(node, c)]
        if "pattern" in node:
            limit = node.get("maxLength", 64)
            drawn = st.from_regex(node["pattern"], fullmatch=True).filter(
                lambda s: node.get("minLength", 0) <= len(s) <= limit)
            return st.sampled_from(fits) if fits else drawn
        text = st.text(string.ascii_letters + string.digits + "-_./", min_size=node.get("minLength", 0),
                       max_size=min(node.get("maxLength", 16), 16))
        return st.one_of(st.sampled_from(fits), text) if fits else text
    if kind == "array":
        if depth > 2:
            return st.just([])
        return st.lists(valid_value(node["items"], depth + 1), max_size=min(node.get("maxItems", 3), 3))
    if kind == "object":
        return minimal_object(node, depth)
    return st.none()


def minimal_object(node: dict[str, Any], depth: int = 0) -> st.SearchStrategy[dict[str, Any]]:
    """An object with its required fields (valid by the schema alone), and now and then a few more."""
    props = node.get("properties", {})
    if "additionalProperties" in node and not props:
        entry = node["additionalProperties"]
        values = st.sampled_from(["a", "b1", "x-y"]) if entry.get("type") == "string" else valid_value(entry, depth + 1)
        return st.dictionaries(st.sampled_from(["a", "GPU", "CPU", "zone", "team"]), values, max_size=2)
    required = {name: valid_value(props[name], depth + 1) for name in node.get("required", [])}
    optional = {name: valid_value(child, depth + 1) for name, child in props.items()
                if name not in required and depth < 2}
    return st.fixed_dictionaries(required, optional=optional if depth < 1 else {})


def boundary_value(node: dict[str, Any]) -> st.SearchStrategy[Any]:
    """At a bound or one step past it, and the limits of a JSON integer."""
    kind = node.get("type")
    out: list[Any] = []
    if kind == "integer":
        low, high = _int_bounds(node)
        out += [low, low - 1, high, high + 1, INT64 - 1, INT64, -INT64 - 1, 2**64, 0, -1]
        out += [float(low), float(low) + 0.5, 1e20]
    elif kind == "number":
        for bound in ("minimum", "maximum"):
            if bound in node:
                out += [node[bound], node[bound] - 1e-9, node[bound] + 1e-9, int(node[bound])]
        out += [0, -0.0, 1e308, -1e308, 5e-324, 2**64]
    elif kind == "string":
        limit = node.get("maxLength")
        if limit:
            out += ["a" * limit, "a" * (limit + 1)]
        out += ["", " ", "a\n", "\n", "é", "\uff41", "\x00", "a b", "A", "-", "a" * 300]
        if "enum" in node:
            out += [v.upper() for v in node["enum"] if isinstance(v, str)] + [f" {node['enum'][0]}"]
    elif kind == "array":
        items = node.get("items", {})
        limit = node.get("maxItems")
        if limit:
            keys = node.get("x-kubernetes-list-map-keys", [])
            return st.lists(valid_value(items, 3), min_size=limit + 1, max_size=limit + 1).map(
                lambda drawn: _distinct(drawn, keys))
        return st.lists(valid_value(items, 3), min_size=0, max_size=0)
    elif node.get("x-kubernetes-int-or-string"):
        out += [value for value, _ in BAD_CPU_AMOUNTS] + ["1024", "1024000m", 1024, 1, "0.001", "1m", 2.0]
    return st.sampled_from(out) if out else st.nothing()


def _distinct(items: list[Any], keys: list[str]) -> list[Any]:
    """Items of a list-map with a key of their own each, so only the list's length is at stake."""
    for i, item in enumerate(items):
        for key in keys:
            if isinstance(item, dict):
                item[key] = f"/m{i}" if key == "mountPath" else f"n{i}"
    return items


JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from([0.5, 1.0, -1.5, 1e-6]),
    st.sampled_from(["", "1", "0.5", "true", "false", "null", "yes", "on", "1Gi", "builtin:tiny"]),
)
JSON_VALUES = st.one_of(JSON_SCALARS, st.lists(JSON_SCALARS, max_size=2),
                        st.dictionaries(st.sampled_from(["a", "name", "value"]), JSON_SCALARS, max_size=2))


@functools.cache
def field_value(path: FieldPath) -> st.SearchStrategy[Any]:
    """Any value for one field: mostly allowed, often at a bound, sometimes of another JSON type or null."""
    node = _schema_at(path)
    special = SPECIAL.get(path[-1])
    choices = [valid_value(node), valid_value(node), boundary_value(node), JSON_VALUES]
    if special is not None:
        choices += [special, special]
    return st.one_of(*choices)


# -- values the schema alone does not describe -------------------------------------------------------------

HUB_MODELS = [n.value for n in HUB_NAMES if n.field == "spec.model.policy.path"]
HUB_DATASETS = [n.value for n in HUB_NAMES if n.field == "spec.data.train"]
HUB_PART = st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,6}", fullmatch=True)
HUB_LIKE = st.builds(
    lambda scheme, org, name, rev, tail: f"{scheme}{org}/{name}{rev}{tail}",
    st.sampled_from(["hf://", "hf://datasets/", "", "hf:/", "HF://"]), HUB_PART, HUB_PART,
    st.sampled_from(["", "@main", "@v1.0", "@", "@a/b", "@0123456789abcdef0123456789abcdef01234567"]),
    st.sampled_from(["", "/cfg", "?split=test", "/cfg?split=x", "?split=", "/", "\n", " "]),
)
PATHS = st.one_of(st.sampled_from(HUB_MODELS + HUB_DATASETS + ["builtin:tiny", "builtin:tiny_task", "builtin:gsm8k",
                                                                "/mnt/x", "relative/dir", "~/x", "a" * 4097]),
                  HUB_LIKE)
QUANTITIES = st.sampled_from(["1Gi", "512Mi", "0", "1.5Gi", "1", "64Gi", "1gi", "1 Gi", "Gi", "-1Gi", "1e3", "1.Gi",
                              "01Gi", "1Ei", "1.5", "1K", "1k", "", "1Gi\n", 1, 1.5])
CPUS = st.sampled_from([value for value, _ in BAD_CPU_AMOUNTS] + [1, 2, "2", "1.5", "500m", "1024", "0.001"])
FUNCTIONS = st.sampled_from(["builtin:tiny_task", "builtin:gsm8k", "builtin:Tiny", "mod:fn", "a.b.c:fn", "mod:",
                             ":fn", "mod:fn.x", "mödule:fn", "mod:fñ", "mod:fn\n", "1mod:fn", "_m:_f", "builtin:"])
SPECIAL: dict[str, st.SearchStrategy[Any]] = {
    "path": PATHS, "train": PATHS, "val": PATHS,
    "memory": QUANTITIES, "headMemory": QUANTITIES, "shmSize": QUANTITIES, "sizeLimit": QUANTITIES,
    "cpusPerWorker": CPUS, "headCpus": CPUS,
    "function": FUNCTIONS,
    "name": NAMEISH, "pool": NAMEISH, "src": NAMEISH, "dst": NAMEISH,
}


@functools.cache
def schema_value(path: FieldPath) -> st.SearchStrategy[Any]:
    return valid_value(_schema_at(path))


# -- putting a value at a path -----------------------------------------------------------------------------


def _schema_at(path: FieldPath) -> dict[str, Any]:
    node = SPEC
    for key in path:
        node = node["items"] if key == ITEM else node["additionalProperties"] if key == ENTRY else \
            node["properties"][key]
    return node


def _container(draw: st.DrawFn, spec: dict[str, Any], path: FieldPath) -> tuple[Any, Any]:
    """The parent object of the field at `path` and the key to set, creating what is missing on the way."""
    here: Any = spec
    for depth, key in enumerate(path[:-1]):
        child_schema = _schema_at(path[: depth + 1])
        if path[depth + 1] == ITEM:
            items = here.get(key)
            if not isinstance(items, list) or not items:
                items = [draw(minimal_object(child_schema["items"]))]
                here[key] = items
            here = items
            continue
        if key == ITEM:
            index = draw(st.integers(0, len(here) - 1))
            if not isinstance(here[index], dict):
                here[index] = draw(minimal_object(child_schema))
            here = here[index]
            continue
        if not isinstance(here.get(key), dict):
            here[key] = draw(minimal_object(child_schema))
        here = here[key]
    last = path[-1]
    if last == ENTRY:
        return here, draw(st.sampled_from(["a", "GPU", "CPU", "zone", "custom", "", "A B", "x/y"]))
    return here, last


def set_field(draw: st.DrawFn, spec: dict[str, Any], agreement: bool) -> None:
    path = draw(st.sampled_from(AGREED_PATHS if agreement else ALL_PATHS))
    parent, key = _container(draw, spec, path)
    parent[key] = draw(field_value(path))


def _objects(value: Any, path: FieldPath = ()) -> Iterator[tuple[FieldPath, dict[str, Any]]]:
    if isinstance(value, dict):
        yield path, value
        for key, child in value.items():
            yield from _objects(child, (*path, key))
    elif isinstance(value, list):
        for child in value:
            yield from _objects(child, (*path, ITEM))


def remove_field(draw: st.DrawFn, spec: dict[str, Any], agreement: bool) -> None:
    places = [(path, obj, key) for path, obj in _objects(spec) for key in obj
              if not (agreement and one_sided((*path, key)))]
    if places:
        _, obj, key = draw(st.sampled_from(places))
        del obj[key]


def unknown_key(draw: st.DrawFn, spec: dict[str, Any], agreement: bool) -> None:
    """A key the schema does not know: a typo, the snake_case spelling of a field, a field of another object."""
    places = [(path, obj) for path, obj in _objects(spec) if not (agreement and one_sided((*path, ENTRY)))]
    path, obj = draw(st.sampled_from(places))
    try:
        known = list(_schema_at(path).get("properties", {}))
    except KeyError:
        known = []
    snake = [re.sub(r"([A-Z])", lambda m: "_" + m.group(1).lower(), k) for k in known]
    key = draw(st.one_of(st.sampled_from([k for k in snake if k not in known] or ["x_y"]),
                         st.sampled_from(["totalStep", "Name", "extra", "replicas", "kind", "spec", "nodes"]),
                         st.sampled_from([k + "s" for k in known] or ["xs"])))
    if key not in obj and key not in known:
        obj[key] = draw(JSON_SCALARS)


# -- the rules between fields ------------------------------------------------------------------------------


def _section(spec: dict[str, Any], name: str) -> dict[str, Any]:
    if not isinstance(spec.get(name), dict):
        spec[name] = {}
    section: dict[str, Any] = spec[name]
    return section


def group_samples(draw: st.DrawFn, spec: dict[str, Any]) -> None:
    """Group-baseline algorithms need rollout.samplesPerPrompt >= 2."""
    _section(spec, "algorithm")["name"] = draw(st.sampled_from([*GROUP_ALGORITHMS, *ALGORITHMS]))
    rollout = _section(spec, "rollout")
    if draw(st.booleans()):
        rollout["samplesPerPrompt"] = draw(st.integers(1, 3))
    else:
        rollout.pop("samplesPerPrompt", None)


def gdpo_components(draw: st.DrawFn, spec: dict[str, Any]) -> None:
    """name gdpo needs algorithm.gdpo, one weight per key when weights are given, and a reward function."""
    algorithm = _section(spec, "algorithm")
    algorithm["name"] = "gdpo"
    keys = draw(st.lists(st.sampled_from(["score", "format", "acc"]), min_size=1, max_size=3, unique=True))
    if draw(st.booleans()):
        algorithm["gdpo"] = {"rewardKeys": keys} | (
            {"rewardWeights": draw(st.lists(st.sampled_from([0.5, 1.0]), min_size=1, max_size=3))}
            if draw(st.booleans()) else {})
    if draw(st.booleans()):
        spec["reward"] = {"type": "model", "model": {"path": "/models/rm"}}


def mini_batch(draw: st.DrawFn, spec: dict[str, Any]) -> None:
    """algorithm.miniBatchSize <= data.batchSize * rollout.samplesPerPrompt, at the edge."""
    batch, samples = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    _section(spec, "data")["batchSize"] = batch
    _section(spec, "rollout")["samplesPerPrompt"] = samples
    _section(spec, "algorithm")["miniBatchSize"] = batch * samples + draw(st.integers(-1, 1))
    if spec["algorithm"]["miniBatchSize"] < 1 or draw(st.integers(0, 4)) == 0:
        spec["algorithm"]["miniBatchSize"] = None


def overlong_buffer(draw: st.DrawFn, spec: dict[str, Any]) -> None:
    """reward.overlongBuffer.length <= data.maxResponseLength (8 when left out), at the edge."""
    longest = draw(st.sampled_from([None, 1, 4, 8, 16]))
    if longest is not None:
        _section(spec, "data")["maxResponseLength"] = longest
    edge = 8 if longest is None else longest
    _section(spec, "reward")["overlongBuffer"] = {"length": edge + draw(st.integers(-1, 1))} | draw(
        st.fixed_dictionaries({}, optional={"penaltyFactor": st.sampled_from([0.0, 0.5, 1.0])}))


def filter_groups(draw: st.DrawFn, spec: dict[str, Any]) -> None:
    """algorithm.filterGroups needs samplesPerPrompt >= 2, and a metric other than score a reward function."""
    _section(spec, "algorithm")["filterGroups"] = draw(st.fixed_dictionaries({}, optional={
        "metric": st.sampled_from(["score", "acc"]), "maxGenBatches": st.sampled_from([1, 10])}))
    _section(spec, "rollout")["samplesPerPrompt"] = draw(st.sampled_from([1, 2, 8]))
    if draw(st.booleans()):
        _section(spec, "reward").update(type="model", model={"path": "/models/rm"})


def policy_filtration(draw: st.DrawFn, spec: dict[str, Any]) -> None:
    """algorithm.policyFiltration only with name ppo (the default)."""
    algorithm = _section(spec, "algorithm")
    algorithm["policyFiltration"] = draw(st.fixed_dictionaries({}, optional={
        "reweightMethod": st.sampled_from(["pow", "max_min", "max_random"]), "weightPow": st.sampled_from([0.0, 2.0])}))
    name = draw(st.sampled_from(["absent", "ppo", "grpo"]))
    if name == "absent":
        algorithm.pop("name", None)
    else:
        algorithm["name"] = name


def reward_model(draw: st.DrawFn, spec: dict[str, Any]) -> None:
    """type model needs model.path; batched needs type function."""
    reward = _section(spec, "reward")
    reward["type"] = draw(st.sampled_from(["model", "function"]))
    if draw(st.booleans()):
        reward["batched"] = draw(st.booleans())
    if draw(st.booleans()):
        reward["model"] = draw(st.sampled_from([{"path": "/mnt/rm"}, {"path": "Org/rm"}, {}, None]))
    else:
        reward.pop("model", None)


def rollout_engine(draw: st.DrawFn, spec: dict[str, Any]) -> None:
    """tensorParallelSize > 1 needs vllm; vllm needs a worker group with as many GPUs."""
    rollout = _section(spec, "rollout")
    rollout["engine"] = draw(st.sampled_from(["torch", "vllm"]))
    rollout["tensorParallelSize"] = draw(st.sampled_from([1, 2, 4, 8, 16]))
    if draw(st.booleans()):
        groups = [{"name": f"g{i}", "gpusPerWorker": draw(st.sampled_from([0, 1, 4, 8, 16]))}
                  for i in range(draw(st.integers(0, 2)))]
        _section(spec, "cluster")["workerGroups"] = groups
        spec.pop("graph", None)


def evaluation(draw: st.DrawFn, spec: dict[str, Any]) -> None:
    """evalEvery, evalBeforeTrain, validationDataDir and loggers.valGenerations need data.val; a greedy evaluation
    takes no temperature and one sample."""
    data, trainer = _section(spec, "data"), _section(spec, "trainer")
    data["val"] = draw(st.sampled_from([None, "builtin:tiny_task", "/data/val.jsonl", "hf://datasets/o/n"]))
    trainer["evalEvery"] = draw(st.sampled_from([0, 1, 5]))
    trainer["evalBeforeTrain"] = draw(st.booleans())
    trainer["validationDataDir"] = draw(st.sampled_from([None, "/mnt/samples/val", ""]))
    trainer["loggers"] = {"valGenerations": draw(st.sampled_from([0, 4]))}
    trainer["eval"] = draw(st.fixed_dictionaries({}, optional={
        "greedy": st.booleans(), "temperature": st.sampled_from([None, 0.5, 1.0]),
        "samplesPerPrompt": st.sampled_from([1, 2, 4])}))


def lr_schedule(draw: st.DrawFn, spec: dict[str, Any]) -> None:
    """optimizer.minLrRatio above 0 needs schedule cosine."""
    _section(spec, "trainer")["optimizer"] = draw(st.fixed_dictionaries({}, optional={
        "schedule": st.sampled_from(["constant", "cosine"]), "minLrRatio": st.sampled_from([0.0, 0.1, 1.0]),
        "warmupSteps": st.sampled_from([0, 5])}))


def covariance_bounds(draw: st.DrawFn, spec: dict[str, Any]) -> None:
    """covariance.clipLowerBound below clipUpperBound, either one left at its default (1 and 5)."""
    _section(spec, "algorithm")["covariance"] = draw(st.fixed_dictionaries({}, optional={
        "clipLowerBound": st.sampled_from([0.5, 1.0, 5.0, 6.0]), "clipUpperBound": st.sampled_from([0.5, 1.0, 5.0])}))


def icepop_band(draw: st.DrawFn, spec: dict[str, Any]) -> None:
    """rolloutCorrection.lowerThreshold below threshold (2 when left out); bypass with importanceSampling only with
    policyLoss gpg, and not with name optimal_token_baseline; batchNormalize only with importanceSampling; a
    rejection rule's lowerThreshold only on k1, at most threshold (1/threshold when left out); one rule per
    divergence."""
    rule = st.fixed_dictionaries(
        {"divergence": st.sampled_from(["token_k1", "seq_mean_k1", "seq_sum_k3", "seq_max_k2"]),
         "threshold": st.sampled_from([0.5, 2.0])}, optional={"lowerThreshold": st.sampled_from([0.25, 1.0, 3.0])})
    _section(spec, "algorithm")["rolloutCorrection"] = draw(st.fixed_dictionaries(
        {"importanceSampling": st.sampled_from(["none", "token", "sequence"])},
        optional={"threshold": st.sampled_from([0.5, 2.0, 5.0]), "lowerThreshold": st.sampled_from([0.5, 2.0, 3.0]),
                  "bypass": st.booleans(), "batchNormalize": st.booleans(),
                  "rejectionSampling": st.lists(rule, max_size=3)}))
    if draw(st.booleans()):
        _section(spec, "algorithm")["policyLoss"] = "gpg"
    if draw(st.booleans()):
        _section(spec, "algorithm")["name"] = "optimal_token_baseline"


def dro_beta(draw: st.DrawFn, spec: dict[str, Any]) -> None:
    """policyLoss dro needs droBeta (absent, null or a number)."""
    algorithm = _section(spec, "algorithm")
    algorithm["policyLoss"] = draw(st.sampled_from(["dro", "vanilla"]))
    beta = draw(st.sampled_from(["absent", None, 0.1]))
    if beta != "absent":
        algorithm["droBeta"] = beta


def critic_warmup(draw: st.DrawFn, spec: dict[str, Any]) -> None:
    """trainer.criticWarmupSteps above 0 needs an algorithm with a critic (ppo, the default name)."""
    _section(spec, "trainer")["criticWarmupSteps"] = draw(st.sampled_from([0, 3]))
    algorithm = _section(spec, "algorithm")
    if draw(st.booleans()):
        algorithm["name"] = draw(st.sampled_from(ALGORITHMS))
    else:
        algorithm.pop("name", None)


def resume_from(draw: st.DrawFn, spec: dict[str, Any]) -> None:
    """trainer.resumeFrom needs resume auto (the default)."""
    trainer = _section(spec, "trainer")
    trainer["resumeFrom"] = draw(st.sampled_from(["/mnt/checkpoints/other/step_00000040", "", None]))
    resume = draw(st.sampled_from(["absent", "auto", "never"]))
    if resume == "absent":
        trainer.pop("resume", None)
    else:
        trainer["resume"] = resume


def export_adapters(draw: st.DrawFn, spec: dict[str, Any]) -> None:
    """adapters 'separate' needs model.policy.lora."""
    _section(spec, "trainer")["export"] = {"path": "/out", "adapters": draw(st.sampled_from(["merge", "separate"]))}
    policy = _section(_section(spec, "model"), "policy")
    if draw(st.booleans()):
        policy["lora"] = draw(st.sampled_from([{"targetModules": ["q_proj"]}, {"rank": 4, "targetModules": ["a", "b"]},
                                               {"targetModules": ["q", "q"]}, {"targetModules": []}, None]))
    else:
        policy.pop("lora", None)


def replicas(draw: st.DrawFn, spec: dict[str, Any]) -> None:
    """minReplicas <= replicas <= maxReplicas, group names unique."""
    count = draw(st.integers(1, 3))
    groups = []
    for _ in range(count):
        group: dict[str, Any] = {"name": draw(st.sampled_from(["default", "actor", "critic", "gpu"])),
                                 "replicas": draw(st.integers(0, 3))}
        for key in ("minReplicas", "maxReplicas"):
            if draw(st.booleans()):
                group[key] = draw(st.integers(0, 4))
        groups.append(group)
    _section(spec, "cluster")["workerGroups"] = groups


ROLES = ["actor_rollout", "critic", "reward", "reference"]


def graph(draw: st.DrawFn, spec: dict[str, Any]) -> None:
    """A graph of a few nodes, edges between names that may or may not exist, pools that may have no group."""
    names = ["actor", "critic", "rm", "ref", "x"]
    nodes = [{"name": draw(st.sampled_from(names)), "role": draw(st.sampled_from(ROLES)),
              "pool": draw(st.sampled_from(["default", "actor", "critic", "gpu"])),
              "resources": draw(st.dictionaries(st.sampled_from(["GPU", "CPU", "memory"]),
                                                st.sampled_from([0, 0.5, 1, 2, -1]), max_size=2)),
              "parallelism": draw(st.integers(1, 4))}
             for _ in range(draw(st.integers(0, 4)))]
    edges = [{"src": draw(st.sampled_from(names)), "dst": draw(st.sampled_from(names)),
              **draw(st.fixed_dictionaries({}, optional={"control": st.booleans(), "coLocate": st.booleans(),
                                                         "dataType": st.sampled_from(["batch", ""])}))}
             for _ in range(draw(st.integers(0, 4)))]
    spec["graph"] = {"nodes": nodes, **({"edges": edges} if edges or draw(st.booleans()) else {})}
    if draw(st.booleans()):
        pools = sorted({str(n["pool"]) for n in nodes} | set(draw(st.lists(st.sampled_from(["default", "spare"]),
                                                                             max_size=1))))
        _section(spec, "cluster")["workerGroups"] = [{"name": p, "replicas": 1} for p in pools]


def pod_settings(draw: st.DrawFn, spec: dict[str, Any]) -> None:
    """The pod settings tests/helpers.py knows are refused by both sides, or a good set of them."""
    cluster = _section(spec, "cluster")
    for key in ("volumes", "volumeMounts", "env", "envFrom"):
        cluster.pop(key, None)
    bad = draw(st.sampled_from([*BAD_POD_SETTINGS, None]))
    if bad is not None:
        cluster.update(copy.deepcopy(bad.cluster))
    else:
        cluster.update({"volumes": [{"name": "m", "persistentVolumeClaim": {"claimName": "m"}}],
                        "volumeMounts": [{"name": "m", "mountPath": "/mnt/m"}],
                        "env": [{"name": "A", "value": "1"}]})


NUMBER_FIELDS = [path for path, node in FIELDS if node.get("type") in ("number", "integer")]


def non_finite(draw: st.DrawFn, spec: dict[str, Any]) -> None:
    """NaN or an infinity, which YAML can spell (.nan, .inf) and JSON cannot: only a file can carry one."""
    path = draw(st.sampled_from(NUMBER_FIELDS))
    parent, key = _container(draw, spec, path)
    parent[key] = draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))


def top_level(draw: st.DrawFn, doc: dict[str, Any]) -> Any:
    """apiVersion, kind, metadata or spec of another value or type; or no mapping at all (only for files)."""
    key = draw(st.sampled_from(["apiVersion", "kind", "metadata", "spec"]))
    doc[key] = draw(st.one_of(JSON_SCALARS, st.sampled_from(["hybridflow.io/v1", "v1", "RLTrainingJobs", "Job"])))
    return doc


def job_name(draw: st.DrawFn, doc: dict[str, Any]) -> None:
    doc["metadata"]["name"] = draw(st.one_of(
        st.from_regex(r"[a-z0-9]([-a-z0-9]{0,20}[a-z0-9])?", fullmatch=True),
        st.sampled_from(["a" * 63, "a" * 64, "my.job", "My-job", "job-", "-job", "job_1", "", "job\n", "jöb"]),
    ))


RULES: list[Callable[[st.DrawFn, dict[str, Any]], None]] = [
    group_samples, gdpo_components, mini_batch, overlong_buffer, filter_groups, policy_filtration, reward_model,
    rollout_engine, evaluation, lr_schedule, critic_warmup, covariance_bounds, dro_beta, icepop_band,
    resume_from, export_adapters, replicas, graph, pod_settings,
]


@st.composite
def job_documents(draw: st.DrawFn, *, agreement: bool = True, max_mutations: int = 3,
                  valid_values: bool = False) -> Any:
    """An example job with up to `max_mutations` changes; `valid_values` keeps every set value within the schema
    (CEL rules, graph and layout may still refuse the job), for properties about admitted jobs."""
    doc = copy.deepcopy(draw(st.sampled_from(sorted(EXAMPLES.items())))[1])
    doc["metadata"] = {**{k: v for k, v in doc.get("metadata", {}).items() if k == "labels"},
                       "name": "job", "namespace": "default"}
    if not valid_values and draw(st.integers(0, 5)) == 0:
        job_name(draw, doc)
    spec = doc["spec"]
    for _ in range(draw(st.integers(0 if not valid_values else 1, max_mutations))):
        kinds = ["set", "rule", "rule"] if valid_values else ["set", "set", "set", "rule", "rule", "remove", "unknown"]
        kind = draw(st.sampled_from(kinds if agreement else [*kinds, "non-finite"]))
        if kind == "non-finite":
            non_finite(draw, spec)
        elif kind == "rule":
            draw(st.sampled_from(RULES))(draw, spec)
        elif kind == "remove":
            remove_field(draw, spec, agreement)
        elif kind == "unknown":
            unknown_key(draw, spec, agreement)
        elif valid_values:
            path = draw(st.sampled_from(AGREED_PATHS))
            parent, key = _container(draw, spec, path)
            parent[key] = draw(schema_value(path))
        else:
            set_field(draw, spec, agreement)
    if not agreement and draw(st.integers(0, 19)) == 0:
        return top_level(draw, doc) if draw(st.booleans()) else draw(JSON_VALUES)
    return doc
