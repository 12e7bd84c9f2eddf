"""Hub names of models and datasets, resolved offline from a Hub cache laid out as huggingface_hub lays it out.

The cache is written file by file in the layout huggingface_hub downloads into (refs/, snapshots/<commit>/ linking
into blobs/), and huggingface_hub's own scan_cache_dir must read it back, so every resolution below goes through
the real snapshot_download, datasets.load_dataset and from_pretrained, with HF_HUB_OFFLINE=1 and no network.

The models are the built-in tiny model with weights that make it prefer one digit, whatever the prompt: `org/tiny`
says 7 on main, 3 at the tag v1. The dataset `org/digits` has two configs of prompts whose answer is 7 (sevens) or
3 (threes); at v1, sevens held a single row. So a job that loads the right weights and rows scores about 0.81 at its
first step, before any update, where the built-in model scores about 1/14 and org/tiny@v1 about 1/68.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from hybridflow.api import SpecError, parse_job
from hybridflow.data import DataError
from hybridflow.data.prompts import load_rows
from hybridflow.hub import (
    HubError,
    HubRef,
    HubRefError,
    hub_problems,
    hub_sources,
    parse_hub_ref,
    pin_sources,
    resolve_model_path,
)
from tests.conftest import EXAMPLES, ROOT
from tests.helpers import HUB_NAMES, HubName, hub_name_spec

HUB_ENV = ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE", "HF_HUB_OFFLINE",
           "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "HF_ENDPOINT", "HF_HUB_ETAG_TIMEOUT")


# -- a Hub cache, as huggingface_hub writes one ----------------------------------------------------------

LFS_SUFFIXES = (".safetensors", ".parquet", ".bin")


def _etag(path: str, data: bytes) -> str:
    """The name of a file's blob: the sha256 of an LFS file, the git blob sha1 of any other."""
    if path.endswith(LFS_SUFFIXES):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def commit(hub: Path, repo_type: str, repo_id: str, files: dict[str, bytes], refs: tuple[str, ...]) -> str:
    """One commit of a repo in the Hub cache `hub`: blobs/<etag>, snapshots/<commit>/<path> as a relative link to
    its blob, refs/<branch or tag> holding the commit hash. Returns the commit hash."""
    repo = hub / f"{repo_type}s--{repo_id.replace('/', '--')}"
    etags = {path: _etag(path, data) for path, data in files.items()}
    sha = hashlib.sha1(json.dumps(sorted(etags.items())).encode()).hexdigest()
    for path, data in files.items():
        blob = repo / "blobs" / etags[path]
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repo / "snapshots" / sha / path
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(sha)
    return sha


def tiny_saying(digit: str, out: Path) -> dict[str, bytes]:
    """The built-in tiny model (config, weights, tokenizer) made to answer `digit` after any prompt.

    Every token embeds to e_0 and the blocks add nothing, so the final norm gives sqrt(64) * e_0 at every
    position; the head reads only that coordinate, for `digit`: its logit is 0.5 * 8 = 4, every other one 0.
    It samples `digit` with probability e^4 / (e^4 + 13) = 0.81 per token, so rewards still vary and GRPO learns.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridflow.data.tiny import VOCAB, ensure_tiny_model

    src = ensure_tiny_model()
    model = AutoModelForCausalLM.from_pretrained(src)
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, 0] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        model.lm_head.weight[VOCAB.index(digit), 0] = 0.5
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def parquet(rows: list[dict[str, str]]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    return buf.getvalue()


DIGITS_CARD = b"""---
configs:
- config_name: sevens
  data_files:
  - split: train
    path: sevens/train-*.parquet
  - split: test
    path: sevens/test-*.parquet
- config_name: threes
  data_files:
  - split: train
    path: threes/train-*.parquet
---
Prompts of three digits; the answer is the last one.
"""


def rows_ending_in(digit: str, n: int) -> list[dict[str, str]]:
    return [{"question": f"{i % 10} {(i * 7) % 10} {digit}", "solution": digit} for i in range(n)]


class Hub:
    """HF_HOME with org/tiny and org/digits in its Hub cache."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.hub = home / "hub"
        self.tiny_v1 = commit(self.hub, "model", "org/tiny", tiny_saying("3", home / "build-3"), ("v1",))
        self.tiny_main = commit(self.hub, "model", "org/tiny", tiny_saying("7", home / "build-7"), ("main",))
        self.digits_v1 = commit(self.hub, "dataset", "org/digits", {
            "README.md": DIGITS_CARD,
            "sevens/train-00000-of-00001.parquet": parquet(rows_ending_in("7", 1)),
            "sevens/test-00000-of-00001.parquet": parquet(rows_ending_in("7", 1)),
            "threes/train-00000-of-00001.parquet": parquet(rows_ending_in("3", 1)),
        }, ("v1",))
        self.digits_main = commit(self.hub, "dataset", "org/digits", {
            "README.md": DIGITS_CARD,
            "sevens/train-00000-of-00001.parquet": parquet(rows_ending_in("7", 40)),
            "sevens/test-00000-of-00001.parquet": parquet(rows_ending_in("7", 5)),
            "threes/train-00000-of-00001.parquet": parquet(rows_ending_in("3", 20)),
        }, ("main",))

    def env(self, offline: bool = True) -> dict[str, str]:
        """The process environment of a run against this cache (no other cache or Hub settings leak in)."""
        env = {k: v for k, v in os.environ.items() if k not in HUB_ENV}
        env["HF_HOME"] = str(self.home)
        if offline:
            env["HF_HUB_OFFLINE"] = "1"
        return env


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Hub:
    return Hub(tmp_path_factory.mktemp("hf-home"))


@pytest.fixture
def offline(hub: Hub, monkeypatch: pytest.MonkeyPatch) -> Hub:
    for name in HUB_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(hub.home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub


def test_the_cache_is_the_layout_huggingface_hub_reads(hub: Hub) -> None:
    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(hub.hub)
    assert info.warnings == []
    repos = {(r.repo_type, r.repo_id): r for r in info.repos}
    assert set(repos) == {("model", "org/tiny"), ("dataset", "org/digits")}
    refs = {rev.commit_hash: set(rev.refs) for rev in repos["model", "org/tiny"].revisions}
    assert refs == {hub.tiny_main: {"main"}, hub.tiny_v1: {"v1"}}
    (main,) = [r for r in repos["model", "org/tiny"].revisions if r.commit_hash == hub.tiny_main]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {f.file_name for f in main.files}


# -- parsing ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "ref"), [
    ("Qwen/Qwen2.5-0.5B", HubRef("Qwen/Qwen2.5-0.5B", explicit=False)),
    ("hf://Qwen/Qwen2.5-0.5B", HubRef("Qwen/Qwen2.5-0.5B")),
    ("hf://Qwen/Qwen2.5-0.5B@v1.0", HubRef("Qwen/Qwen2.5-0.5B", revision="v1.0")),
    ("hf://gpt2", HubRef("gpt2")),
    ("/mnt/models/qwen", None), ("./org/name", None), ("org/name/sub", None), ("builtin:tiny", None),
])
def test_parse_model_names(value: str, ref: HubRef | None) -> None:
    assert parse_hub_ref(value, "model") == ref
    if ref is not None and ref.explicit:
        assert parse_hub_ref(ref.uri, "model") == ref


@pytest.mark.parametrize(("value", "ref"), [
    ("hf://datasets/openai/gsm8k", HubRef("openai/gsm8k", "dataset")),
    ("hf://datasets/openai/gsm8k/main?split=test", HubRef("openai/gsm8k", "dataset", config="main", split="test")),
    ("hf://datasets/org/d@v2?split=validation", HubRef("org/d", "dataset", revision="v2", split="validation")),
    ("hf://datasets/org/d@v2/cfg", HubRef("org/d", "dataset", revision="v2", config="cfg")),
    ("/mnt/data/train.parquet", None), ("org/name", None), ("builtin:tiny_task", None),
])
def test_parse_dataset_names(value: str, ref: HubRef | None) -> None:
    assert parse_hub_ref(value, "dataset") == ref
    if ref is not None:
        assert parse_hub_ref(ref.uri, "dataset") == ref


def test_a_dataset_is_no_model_and_a_model_no_dataset() -> None:
    with pytest.raises(HubRefError, match="names a Hub dataset, not a model"):
        parse_hub_ref("hf://datasets/org/d", "model")
    with pytest.raises(HubRefError, match=r"a Hub dataset is hf://datasets/Org/Name\[@revision\]"):
        parse_hub_ref("hf://org/d", "dataset")


@pytest.mark.parametrize("name", HUB_NAMES, ids=[f"{n.field.split('.')[-1]}={n.value}" for n in HUB_NAMES])
def test_the_spec_takes_exactly_the_hub_names_the_api_server_takes(name: HubName) -> None:
    """tests/test_crd.py sends the same names to a real API server."""
    doc = {"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLTrainingJob", "spec": hub_name_spec(name)}
    if name.accepted:
        parse_job(doc)
        return
    with pytest.raises(SpecError) as e:
        parse_job(doc)
    (problem,) = e.value.problems
    assert problem.startswith(f"{name.field}: {name.value!r} ")
    assert ("a Hub model is Org/Name" in problem) != ("a Hub dataset is hf://datasets/Org/Name" in problem)


@pytest.mark.parametrize("field", ["spec.model.critic.path", "spec.model.reference.path", "spec.reward.model.path"])
def test_every_model_field_checks_hub_names(field: str) -> None:
    spec: dict = {"model": {"critic": {}, "reference": {}}, "reward": {"type": "model", "model": {"path": "/m"}}}
    *parents, leaf = field.removeprefix("spec.").split(".")
    target = spec
    for part in parents:
        target = target[part]
    target[leaf] = "hf://org/x@"
    with pytest.raises(SpecError) as e:
        parse_job({"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLTrainingJob", "spec": spec})
    assert e.value.problems == [f"{field}: 'hf://org/x@' is not a Hub model name: a Hub model is Org/Name or "
                                "hf://Org/Name[@revision] (a branch, tag or commit hash)"]


# -- resolution, offline -----------------------------------------------------------------------------------


def answer_of(model_dir: str) -> str:
    """What the model at `model_dir` says after a prompt (greedy)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = tok("1 2 3", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def test_models_resolve_from_the_cache_by_name_tag_and_commit(offline: Hub) -> None:
    field = "spec.model.policy.path"
    main = resolve_model_path("org/tiny", field)
    assert Path(main) == offline.hub / "models--org--tiny" / "snapshots" / offline.tiny_main
    assert resolve_model_path("hf://org/tiny", field) == main
    assert resolve_model_path(f"hf://org/tiny@{offline.tiny_main}", field) == main
    v1 = resolve_model_path("hf://org/tiny@v1", field)
    assert Path(v1).name == offline.tiny_v1
    assert resolve_model_path(f"hf://org/tiny@{offline.tiny_v1}", field) == v1
    assert answer_of(main) == "7 7 7 7"
    assert answer_of(v1) == "3 3 3 3"


def test_a_local_directory_shadows_a_bare_name_but_not_hf(offline: Hub, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "tiny").mkdir(parents=True)
    assert resolve_model_path("org/tiny", "spec.model.policy.path") == "org/tiny"
    assert Path(resolve_model_path("hf://org/tiny", "spec.model.policy.path")).name == offline.tiny_main


def test_hub_datasets_load_by_config_split_and_revision(offline: Hub) -> None:
    rows = load_rows("hf://datasets/org/digits/sevens?split=train", "question", "solution")
    assert len(rows) == 40 and {r["answer"] for r in rows} == {"7"}
    assert rows[0] == {"prompt": "0 0 7", "answer": "7"}
    assert len(load_rows("hf://datasets/org/digits/sevens?split=test", "question", "solution")) == 5
    threes = load_rows("hf://datasets/org/digits/threes", "question", "solution")
    assert len(threes) == 20 and {r["answer"] for r in threes} == {"3"}
    assert len(load_rows("hf://datasets/org/digits@v1/sevens", "question", "solution")) == 1
    assert len(load_rows(f"hf://datasets/org/digits@{offline.digits_v1}/threes", "question", "solution")) == 1


@pytest.mark.parametrize(("source", "says"), [
    ("hf://datasets/org/digits/fives", "spec.data.val: hf://datasets/org/digits/fives?split=train: BuilderConfig "
                                       "'fives' not found. Available: ['sevens', 'threes']"),
    ("hf://datasets/org/digits/threes?split=test", 'spec.data.val: hf://datasets/org/digits/threes?split=test: '
                                                   'Unknown split "test". Should be one of [\'train\'].'),
    ("hf://datasets/org/digits@v9/sevens", "spec.data.val: Hub dataset 'org/digits' (revision v9) is not in the "
                                           "Hub cache"),
    ("hf://datasets/org/nothing", "spec.data.val: Hub dataset 'org/nothing' (revision main) is not in the Hub cache"),
    ("hf://datasets/org", "spec.data.val: 'hf://datasets/org' is not a Hub dataset name"),
])
def test_a_dataset_that_cannot_load_names_its_field(offline: Hub, source: str, says: str) -> None:
    with pytest.raises(DataError) as e:
        load_rows(source, "question", "solution", split="val")
    assert str(e.value).startswith(says), str(e.value)


def test_the_prompt_key_is_checked_against_the_hub_dataset(offline: Hub) -> None:
    with pytest.raises(DataError, match=r"spec.data.promptKey: column 'prompt' not in .*\['question', 'solution'\]"):
        load_rows("hf://datasets/org/digits/sevens", "prompt", "answer")


def test_unknown_names_offline_name_the_field_and_the_name(offline: Hub) -> None:
    with pytest.raises(HubError) as e:
        resolve_model_path("org/absent", "spec.model.reference.path")
    assert str(e.value) == (f"spec.model.reference.path: 'org/absent' is not a local directory, and as a Hub model "
                            f"'org/absent' (revision main) it is not in the Hub cache {offline.hub} and HF_HUB_OFFLINE "
                            "forbids fetching it")
    with pytest.raises(HubError, match=r"^spec.model.policy.path: Hub model 'org/tiny' \(revision 0{40}\) is not in"):
        resolve_model_path("hf://org/tiny@" + "0" * 40, "spec.model.policy.path")
    with pytest.raises(HubError, match=r"^spec.reward.model.path: 'org--x/y' is not a valid Hub repo id"):
        resolve_model_path("hf://org--x/y", "spec.reward.model.path")


def job_spec(**spec: object):
    doc = {"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLTrainingJob", "spec": spec}
    return parse_job(doc).spec


def test_validate_checks_every_hub_name_of_the_job_against_the_cache(offline: Hub) -> None:
    good = job_spec(model={"policy": {"path": "org/tiny"}, "reference": {"path": "hf://org/tiny@v1"}},
                    data={"train": "hf://datasets/org/digits/sevens"})
    assert [f for f, _ in hub_sources(good)] == ["spec.model.policy.path", "spec.model.reference.path",
                                                 "spec.data.train"]
    assert hub_problems(good) == []
    bad = job_spec(model={"policy": {"path": "hf://org/tiny@v7"}, "critic": {"path": "org/absent"}},
                   reward={"type": "model", "model": {"path": "hf://org/rm"}},
                   data={"train": "hf://datasets/org/absent"})
    problems = hub_problems(bad)
    assert [p.split(":")[0] for p in problems] == ["spec.model.policy.path", "spec.model.critic.path",
                                                   "spec.reward.model.path", "spec.data.train"]
    assert "Hub model 'org/tiny' (revision v7) is not in the Hub cache" in problems[0]
    assert "Hub dataset 'org/absent' (revision main)" in problems[3]


def test_the_driver_pins_each_hub_name_to_the_commit_it_found(offline: Hub) -> None:
    spec = job_spec(model={"policy": {"path": "org/tiny"}, "reference": {"path": "hf://org/tiny@v1"}},
                    data={"train": "hf://datasets/org/digits/sevens?split=test"})
    pinned = pin_sources(spec)
    assert pinned.model.policy.path == f"hf://org/tiny@{offline.tiny_main}"
    assert pinned.model.reference.path == f"hf://org/tiny@{offline.tiny_v1}"
    assert pinned.data.train == f"hf://datasets/org/digits@{offline.digits_main}/sevens?split=test"
    assert spec.model.policy.path == "org/tiny"  # a copy
    assert pin_sources(job_spec()) == job_spec()  # builtins stay as they are


# -- the command line ------------------------------------------------------------------------------------


def hybridflow(env: dict[str, str], *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridflow", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=timeout)


def hub_job(tmp_path: Path, policy: str = "org/tiny", train: str = "hf://datasets/org/digits/sevens?split=train",
            steps: int = 2) -> str:
    """The tiny GRPO example by Hub names: the reference at the tag v1, the prompts of the sevens config."""
    doc = yaml.safe_load((EXAMPLES / "tiny-grpo.yaml").read_text())
    doc["metadata"]["name"] = "hub-grpo"
    doc["spec"]["model"] = {"policy": {"path": policy}, "reference": {"enabled": True, "path": "hf://org/tiny@v1"}}
    doc["spec"]["data"].update(train=train, promptKey="question", answerKey="solution", batchSize=8)
    doc["spec"]["rollout"]["samplesPerPrompt"] = 2
    doc["spec"]["algorithm"]["miniBatchSize"] = 16
    doc["spec"]["trainer"].update(totalSteps=steps, checkpoint={"every": 0, "path": str(tmp_path / "ckpt")})
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def assert_clean_failure(out: subprocess.CompletedProcess, *needles: str) -> None:
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    for n in needles:
        assert n in out.stderr, f"{n!r} not in {out.stderr!r}"


def test_validate_offline(hub: Hub, tmp_path: Path) -> None:
    out = hybridflow(hub.env(), "validate", hub_job(tmp_path))
    assert out.returncode == 0, out.stderr
    out = hybridflow(hub.env(), "validate", hub_job(tmp_path, policy="org/absent", train="hf://datasets/org/none"))
    assert_clean_failure(out, "2 problems",
                         "spec.model.policy.path: 'org/absent' is not a local directory, and as a Hub model "
                         "'org/absent' (revision main) it is not in the Hub cache",
                         "spec.data.train: Hub dataset 'org/none' (revision main) is not in the Hub cache")


@pytest.fixture
def silent_hub() -> Iterator[str]:
    """An endpoint that accepts connections and never answers: a Hub behind a black hole."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


def test_validate_gives_up_on_a_hub_that_does_not_answer(hub: Hub, tmp_path: Path, silent_hub: str) -> None:
    env = {**hub.env(offline=False), "HF_ENDPOINT": silent_hub, "HF_HUB_ETAG_TIMEOUT": "2"}
    t0 = time.monotonic()
    out = hybridflow(env, "validate", hub_job(tmp_path, policy="org/absent"))
    assert_clean_failure(out, "spec.model.policy.path: 'org/absent' is not a local directory, and as a Hub model "
                              "'org/absent' (revision main) it is not in the Hub cache",
                         "the Hub could not be reached within 2s (")
    assert time.monotonic() - t0 < 30
    out = hybridflow(env, "validate", hub_job(tmp_path))  # in the cache: no need to ask
    assert out.returncode == 0, out.stderr


@pytest.mark.slow
def test_run_trains_a_hub_model_on_a_hub_dataset_offline(hub: Hub, tmp_path: Path) -> None:
    """Policy and reference by Hub name (the reference at a tag), prompts from a Hub dataset's config."""
    metrics = tmp_path / "metrics.jsonl"
    out = hybridflow(hub.env(), "run", hub_job(tmp_path), "--quiet", "--metrics-out", str(metrics))
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    # org/tiny at main says 7 and every sevens prompt's answer is 7: the right weights and the right rows.
    assert records[0]["reward_mean"] > 0.5
    # The reference (org/tiny@v1) says 3: far from the policy (KL 0 at the first step if it were the same model).
    assert records[0]["kl"] > 1.0
    # It trains: the rewards of a prompt's samples differ, and the update changes the policy's entropy.
    assert records[0]["advantage_abs_mean"] > 0 and all(math.isfinite(r["actor_loss"]) for r in records)
    assert records[1]["entropy"] != records[0]["entropy"]


@pytest.mark.slow
def test_run_stops_on_an_unknown_name_before_training(hub: Hub, tmp_path: Path) -> None:
    out = hybridflow(hub.env(), "run", hub_job(tmp_path, policy="hf://org/absent@v2"), "--quiet")
    assert_clean_failure(out, "1 problem", "spec.model.policy.path: Hub model 'org/absent' (revision v2) is not in "
                                           f"the Hub cache {hub.hub} and HF_HUB_OFFLINE forbids fetching it")


def test_the_readme_example_names_its_model_and_data_on_the_hub() -> None:
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- hub example -->", 1)[1].split("```yaml", 1)[1].split("```", 1)[0]
    spec = parse_job(yaml.safe_load(block)).spec
    assert [(field, ref.uri) for field, ref in hub_sources(spec)] == [
        ("spec.model.policy.path", "hf://Qwen/Qwen2.5-0.5B-Instruct"),
        ("spec.model.reference.path", "hf://Qwen/Qwen2.5-0.5B-Instruct@main"),
        ("spec.data.train", "hf://datasets/openai/gsm8k/main?split=train"),
    ]
