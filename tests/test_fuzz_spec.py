"""Property-based fuzzing of the RLTrainingJob spec (documents from tests/spec_strategies.py).

1. Agreement: the models (what `hybridflow validate` checks) and the API server's admission (strict field
   validation, schema, defaults, CEL rules; a dry-run create on a real kube-apiserver) give every document the
   same verdict, for the rules both see.
2. The operator: every job the API server admits is either rendered into its children or marked Stalled with a
   field path and a Warning Event; nothing it admits crashes the reconciler (on an in-memory Kubernetes).
3. Messages: validate, render and the CLI answer every document without a traceback: one message per problem,
   each naming its field, and a non-zero exit for bad input.

Rules only one side sees (ONE_SIDED, each pinned by test_one_sided_rules): the generator leaves them out of
property 1 rather than the test forgiving a disagreement.

Examples per property: HYBRIDFLOW_FUZZ_EXAMPLES (default 300; `make chaos` runs 2000), derandomized under
CI=true; HYBRIDFLOW_FUZZ_REPORT=path writes how many each property ran, as JSON.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from hybridflow.api import SpecError, parse_job
from hybridflow.api.load import parse_job_text
from hybridflow.cli import main as cli_main
from hybridflow.k8s import names
from hybridflow.k8s.errors import RenderError
from hybridflow.k8s.render import render_manifests
from hybridflow.k8s.settings import RenderSettings
from tests.helpers import DryRun, Verdict, condition, in_ci
from tests.memory_kube import Loop, MemoryKube, run
from tests.spec_strategies import job_documents

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES_PER_PROPERTY = int(os.environ.get("HYBRIDFLOW_FUZZ_EXAMPLES", "300"))
REPORT = os.environ.get("HYBRIDFLOW_FUZZ_REPORT")
settings.register_profile(
    "hybridflow-fuzz",
    max_examples=EXAMPLES_PER_PROPERTY,
    deadline=None,
    derandomize=in_ci(),
    database=None if in_ci() else settings.default.database,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
FUZZ = settings.get_profile("hybridflow-fuzz")
CLI_SAMPLES = max(2, EXAMPLES_PER_PROPERTY // 200)
"""Documents checked by a `hybridflow validate` process of its own, in batches of CLI_BATCH."""
CLI_BATCH = 8

RAN: Counter[str] = Counter()
"""Examples each property ran, and how many of them the API server admitted."""

FIELD = r"[A-Za-z_]\w*([.\[][^\n]*?)?"
"""A field path as users write it (spec.cluster.workerGroups[0].name); a map's keys may hold any character."""
PROBLEM = re.compile(rf"^(\(document\)|{FIELD}): \S")
STALLED = re.compile(rf"^{FIELD}: \S")
SETTINGS = RenderSettings()


@pytest.fixture(scope="module", autouse=True)
def report() -> Iterator[None]:
    """Write the counts for the chaos runner; and a generator that stopped giving both verdicts is a failure."""
    RAN.clear()
    yield
    if REPORT:
        Path(REPORT).write_text(json.dumps({"examples": {k: v for k, v in RAN.items() if "/" not in k},
                                            "verdicts": {k: v for k, v in RAN.items() if "/" in k},
                                            "max_examples": EXAMPLES_PER_PROPERTY}, indent=2, sort_keys=True))
    if RAN["agreement"] >= 100:
        admitted = RAN["agreement/admitted"] / RAN["agreement"]
        assert 0.2 <= admitted <= 0.8, f"{admitted:.0%} of the documents were admitted: the generator lost its mix"


@pytest.fixture(scope="module")
def dry_run(apiserver: Any) -> Iterator[DryRun]:
    client = DryRun(apiserver)
    yield client
    client.close()


@pytest.fixture(scope="module")
def offline_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """An empty Hub cache and no network: `hybridflow validate` reports a Hub name it cannot find, asking no one."""
    home = tmp_path_factory.mktemp("hf-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HOME", str(home))
        mp.setenv("HF_HUB_OFFLINE", "1")
        for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE", "HF_ENDPOINT"):
            mp.delenv(var, raising=False)
        yield home


def model_problems(doc: Any) -> list[str]:
    """What the models say of the document ([]: valid), as `hybridflow validate` reads it."""
    try:
        parse_job(copy.deepcopy(doc))
    except SpecError as e:
        return e.problems
    return []


def disagreement(doc: Mapping[str, Any], problems: list[str], verdict: Verdict) -> str:
    said = "admitted it" if verdict.admitted else f"refused it: {verdict.message}"
    models = "; ".join(problems) if problems else "accept it"
    return f"the API server {said}\nthe models {models}\n{json.dumps(doc, indent=1)}"


# -- 1. the models and the API server agree -------------------------------------------------------------------


@dataclass(frozen=True)
class OneSided:
    """A rule only one side checks: the generator never asks property 1 about it; this case pins it down."""

    case: str
    doc: dict[str, Any]
    models_accept: bool
    api_admits: bool
    why: str


def _job(spec: dict[str, Any] | None = None, **metadata: Any) -> dict[str, Any]:
    meta = {"name": "one-sided", "namespace": "default", **metadata}
    return {"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLTrainingJob",
            "metadata": {k: v for k, v in meta.items() if v is not None}, "spec": spec or {}}


ONE_SIDED = [
    OneSided("pod-label-key-syntax", _job({"cluster": {"podLabels": {"not a key": "x"}}}), False, True,
             "only the models check label key and value syntax (pod.metadata_problems); the CRD's rule checks the "
             "reserved prefixes alone, and KubeRay's pods would be refused later"),
    OneSided("pod-annotation-in-a-reserved-subdomain", _job({"cluster": {"podAnnotations": {"x.ray.io/a": "1"}}}),
             False, True, "the CEL rule matches the reserved prefixes exactly; the models also refuse subdomains"),
    OneSided("service-account-annotation-key", _job({"cluster": {"serviceAccount": {"annotations": {"a b": "1"}}}}),
             False, True, "annotation key syntax, as for podLabels"),
    OneSided("no-job-name", _job(name=None), True, False,
             "a local file may leave metadata.name out (`hybridflow run` calls the job `local`); a Kubernetes object "
             "needs a name"),
    OneSided("metadata-label-syntax", _job(labels={"not a key": "x"}), True, False,
             "the API server validates the object's own metadata; the models read only metadata.name"),
]


@pytest.mark.controlplane
@pytest.mark.parametrize("case", ONE_SIDED, ids=[c.case for c in ONE_SIDED])
def test_one_sided_rules(dry_run: DryRun, case: OneSided) -> None:
    assert (not model_problems(case.doc)) is case.models_accept, case.why
    assert dry_run.create(case.doc).admitted is case.api_admits, case.why


FOUND = [
    # Shrunk cases the fuzzer found, where the models and the API server disagreed: (case, spec, admitted).
    ("snake-case-field", {"trainer": {"total_steps": 3}}, False),
    ("string-for-an-integer", {"algorithm": {"ppoEpochs": "2"}}, False),
    ("integral-float-for-an-integer", {"algorithm": {"ppoEpochs": 2.0}}, True),
    ("largest-64-bit-integer", {"trainer": {"seed": 2**63 - 1}}, True),
    ("integer-beyond-64-bits", {"trainer": {"seed": 2**63}}, False),
    ("integral-float-beyond-2-to-the-53", {"trainer": {"seed": 1e20}}, False),
    ("huge-integer-for-a-number", {"trainer": {"actorLr": 2**64}}, True),
    ("number-for-a-boolean", {"runPolicy": {"suspend": 1}}, False),
    ("string-for-a-number", {"rollout": {"temperature": "0.5"}}, False),
    ("null-for-a-field-without-null", {"rollout": {"engine": None}, "trainer": None}, True),
    ("non-ascii-reward-function", {"reward": {"function": "mödule:fn"}}, False),
    ("graph-node-named-twice", {"graph": {"nodes": [{"name": "a", "role": "actor_rollout"},
                                                    {"name": "a", "role": "reward"}]}}, False),
    ("worker-group-named-twice", {"cluster": {"workerGroups": [{"name": "a"}, {"name": "a"}]}}, False),
    ("too-many-worker-groups", {"cluster": {"workerGroups": [{"name": f"g{i}"} for i in range(17)]}}, False),
    ("lora-target-twice", {"model": {"policy": {"lora": {"targetModules": ["q_proj", "q_proj"]}}}}, False),
    ("too-many-pod-labels", {"cluster": {"podLabels": {f"l{i}": "x" for i in range(65)}}}, False),
    ("min-replicas-above-replicas", {"cluster": {"workerGroups": [{"name": "g", "replicas": 1, "minReplicas": 2}]}},
     False),
    ("tensor-parallel-without-vllm", {"rollout": {"engine": "torch", "tensorParallelSize": 2}}, False),
    ("graph-pool-without-a-worker-group", {"graph": {"nodes": [{"name": "a", "role": "actor_rollout", "pool": "p"}]},
                                           "cluster": {"workerGroups": [{"name": "other"}]}}, False),
    ("integral-float-replica-bound", {"cluster": {"workerGroups": [{"name": "g", "replicas": 2, "minReplicas": 1.0}]}},
     True),
    ("null-in-a-string-map", {"cluster": {"nodeSelector": {"a": None, "b": "x"}}}, True),
    ("graph-edge-to-an-unknown-node", {"graph": {"nodes": [{"name": "a", "role": "actor_rollout"}],
                                                 "edges": [{"src": "a", "dst": "x"}]}}, False),
]


@pytest.mark.controlplane
@pytest.mark.parametrize(("case", "spec", "admitted"), FOUND, ids=[c[0] for c in FOUND])
def test_found_cases_get_one_verdict(dry_run: DryRun, case: str, spec: dict[str, Any], admitted: bool) -> None:
    doc = _job(copy.deepcopy(spec), name=case)
    assert (not model_problems(doc)) is admitted, model_problems(doc)
    assert dry_run.create(doc).admitted is admitted, dry_run.create(doc).message


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
def test_a_file_with_a_number_json_cannot_hold_is_refused_naming_the_field(value: str) -> None:
    """YAML can write NaN and infinities, JSON cannot: such a file would never reach the API server."""
    text = f"apiVersion: hybridflow.io/v1alpha1\nkind: RLTrainingJob\nspec:\n  trainer: {{actorLr: {value}}}\n"
    code, _, err = in_process(["validate", "-"], text)
    assert code == 1 and "Traceback" not in err
    assert "  - spec.trainer.actorLr: " in err and "JSON has no NaN or infinity" in err, err


@pytest.mark.controlplane
@FUZZ
@given(doc=job_documents())
def test_models_and_api_server_agree(dry_run: DryRun, doc: dict[str, Any]) -> None:
    problems = model_problems(doc)
    verdict = dry_run.create(doc)
    RAN["agreement"] += 1
    RAN["agreement/admitted"] += verdict.admitted
    assert (not problems) == verdict.admitted, disagreement(doc, problems, verdict)


# -- 2. nothing the API server admits crashes the operator ------------------------------------------------------


def reconcile(stored: Mapping[str, Any]) -> Loop:
    """One pass of the operator's reconciler over the job as the API server stored it."""

    async def scenario() -> Loop:
        loop = Loop(MemoryKube())
        loop.job_event(loop.kube.put(stored), "ADDED")
        await loop.settle()
        return loop

    loop: Loop = run(scenario())
    return loop


def check_operator(stored: Mapping[str, Any]) -> str:
    """'rendered' or 'stalled', after checking that the operator said so the way it must."""
    meta = stored["metadata"]
    loop = reconcile(stored)
    job = loop.kube.objects[("RLTrainingJob", meta["namespace"], meta["name"])]
    stalled = condition(job, "Stalled")
    if loop.kube.objects.get(("RayJob", meta["namespace"], names.rayjob_name(meta["name"]))) is not None:
        assert stalled.get("status") != "True", stalled
        return "rendered"
    assert stalled.get("status") == "True", f"no RayJob and not Stalled: {job.get('status')}"
    assert STALLED.match(stalled["message"]), stalled["message"]
    assert ("Warning", stalled["reason"]) in [(kind, reason) for kind, reason, _ in loop.events], loop.events
    return "stalled"


@pytest.mark.controlplane
@FUZZ
@given(doc=job_documents(valid_values=True))
def test_the_operator_renders_or_stalls_every_admitted_job(dry_run: DryRun, doc: dict[str, Any]) -> None:
    verdict = dry_run.create(doc)
    assume(verdict.admitted)
    RAN["operator"] += 1
    RAN[f"operator/{check_operator(verdict.body)}"] += 1


# -- 3. one clear message, never a traceback -------------------------------------------------------------------


def in_process(argv: list[str], stdin: str) -> tuple[int, str, str]:
    """hybridflow's main() with `stdin` as its standard input: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    saved, sys.stdin = sys.stdin, io.StringIO(stdin)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli_main(argv)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.stdin = saved
    return code, out.getvalue(), err.getvalue()


def as_text(doc: Any, yaml_form: bool) -> str:
    return yaml.safe_dump(doc, sort_keys=False) if yaml_form else json.dumps(doc)


def assert_clear(problems: list[str]) -> None:
    assert problems, "a refusal without a reason"
    for problem in problems:
        assert PROBLEM.match(problem), f"no field path: {problem!r}"
        assert "Traceback" not in problem and "\n" not in problem.rstrip("\n"), problem


@FUZZ
@given(doc=job_documents(agreement=False), yaml_form=st.booleans(), cut=st.none() | st.integers(0, 3000))
def test_validate_render_and_the_cli_answer_with_one_clear_message(
    offline_hub: Path, doc: Any, yaml_form: bool, cut: int | None
) -> None:
    """Every document, as a file would carry it (YAML or JSON, now and then cut short), through every entry point."""
    RAN["messages"] += 1
    text = as_text(doc, yaml_form)[:cut]
    try:
        job = parse_job_text(text, "<stdin>", as_json=text.lstrip().startswith("{"))
        problems: list[str] = []
    except SpecError as e:
        problems = e.problems
        assert_clear(problems)
    else:
        try:
            render_manifests(job, SETTINGS)
        except RenderError as e:
            assert PROBLEM.match(str(e)), str(e)
    if isinstance(doc, dict):  # the operator's path: a mapping straight from the API server
        try:
            render_manifests(doc, SETTINGS)
        except RenderError as e:
            assert PROBLEM.match(str(e)), str(e)
            assert not model_problems(doc) or e.reason == "InvalidSpec", e
        else:
            assert not model_problems(doc), "rendered a job the models refuse"

    code, out, err = in_process(["validate", "-"], text)
    assert "Traceback" not in err + out
    if code == 0:
        assert not problems and out.startswith("<stdin>: valid "), (out, err)
    else:
        assert code == 1 and err.startswith("<stdin>: "), (code, out, err)
        assert_clear([line.removeprefix("  - ") for line in err.splitlines()[1:]])
    code, out, err = in_process(["render", "-"], text)
    assert "Traceback" not in err + out
    assert code in (0, 1) and (code == 1 or not problems), (code, err)
    if code:
        assert err.strip() and out == "", (out, err)


@settings(FUZZ, max_examples=CLI_SAMPLES)
@given(docs=st.lists(job_documents(agreement=False), min_size=CLI_BATCH, max_size=CLI_BATCH),
       forms=st.lists(st.booleans(), min_size=CLI_BATCH, max_size=CLI_BATCH))
def test_the_cli_process_answers_every_file_once(
    offline_hub: Path, tmp_path_factory: pytest.TempPathFactory, docs: list[dict[str, Any]], forms: list[bool]
) -> None:
    """`hybridflow validate` as a user runs it: files and standard input, its own interpreter, exit 1 on any bad."""
    RAN["cli-process"] += 1
    where = tmp_path_factory.mktemp("jobs")
    files = []
    for i, (doc, yaml_form) in enumerate(zip(docs, forms, strict=True)):
        path = where / f"job{i}.{'yaml' if yaml_form else 'json'}"
        path.write_text(as_text(doc, yaml_form))
        files.append(path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("runtime", "operator", "."))}
    result = subprocess.run([sys.executable, "-m", "hybridflow", "validate", *map(str, files)], env=env,
                            capture_output=True, text=True, timeout=120, check=False)
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    for path, doc in zip(files, docs, strict=True):
        valid = [line for line in result.stdout.splitlines() if line.startswith(f"{path}: valid ")]
        refused = [line for line in result.stderr.splitlines() if line.startswith(f"{path}: ")]
        assert len(valid) + len(refused) == 1, (path, result.stdout, result.stderr)
        assert not (refused == [] and model_problems(doc)), (path, result.stdout)
    assert result.returncode == (1 if "problem" in result.stderr else 0), (result.returncode, result.stderr)
    stdin = subprocess.run([sys.executable, "-m", "hybridflow", "validate", "-"], input=as_text(docs[0], forms[0]),
                           env=env, capture_output=True, text=True, timeout=120, check=False)
    assert "Traceback" not in stdin.stderr and stdin.returncode in (0, 1), stdin.stderr
    assert stdin.returncode == 1 or not model_problems(docs[0]), stdin.stdout
