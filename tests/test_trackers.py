"""Experiment trackers: verl's metric names, the spec field, and what tensorboard, mlflow and wandb hold
afterwards, read back with their own readers (offline: a file-backed mlflow store, wandb offline runs)."""

from __future__ import annotations

import json
import logging
import struct
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from hybridflow import trackers
from hybridflow.api import SpecError, parse_job
from hybridflow.api import crd as crdgen
from hybridflow.preflight import preflight
from hybridflow.step import StepOutput, step_record
from hybridflow.trackers import (
    TRACKERS,
    TrackerSet,
    TrackerUnavailable,
    missing_extras,
    namespaced,
    open_trackers,
    tracker_name,
)
from tests.test_cli import assert_clean_failure, hybridflow, write

RECORDS = [
    {"step": s, "reward_mean": 0.1 * s, "kl": 0.01 * s, "actor_loss": -0.5 + s, "critic_loss": 2.0 / s,
     "tokens_per_s": 1000.0 + s, "timing/generate": 0.25 * s, "policy_version": s}
    for s in (1, 2, 3)
]
EXPECTED = {"rollout/reward_mean": "reward_mean", "actor/kl": "kl", "actor/pg_loss": "actor_loss",
            "critic/value_loss": "critic_loss", "perf/tokens_per_s": "tokens_per_s",
            "timing/generate": "timing/generate"}


@pytest.fixture
def mlflow_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither a tracking URI nor the file-store opt-in in the environment; what the tracker sets is undone after."""
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def job_with(example_doc, tmp_path: Path, **loggers: Any):
    doc = example_doc("tiny-grpo.yaml")
    doc["metadata"]["name"] = "trk"
    doc["spec"]["trainer"]["loggers"] = {"dir": str(tmp_path / "trackers"), **loggers}
    return parse_job(doc)


def log_all(job, records: list[dict[str, Any]], first_step: int = 1) -> TrackerSet:
    opened = open_trackers(job, TRACKERS, first_step=first_step)
    assert set(opened.trackers) == set(job.spec.trainer.loggers.backends)
    for record in records:
        opened.log_record(record)
    opened.close()
    return opened


# -- names ----------------------------------------------------------------------------------------------------


def test_every_key_of_a_step_record_gets_a_verl_style_name() -> None:
    out = StepOutput(seconds={"rollout": 0.5, "update": 0.3}, compute=0.7, timings={"generate": 0.2, "reward": 0.01},
                     stats={"reward_mean": 0.4, "reward_max": 1.0, "tokens": 80.0, "response_length": 3.5,
                            "policy_version": 0.0, "size": 16.0},
                     advantages={"kl": 0.02, "value_mean": 0.1, "advantage_abs_mean": 0.3},
                     update={"actor_loss": -0.1, "critic_loss": 0.05, "entropy": 2.5, "clip_frac": 0.1})
    record = step_record(4, out, elapsed=1.0, kl_coef=0.001)
    names = namespaced(record)
    assert {"rollout/reward_mean": 0.4, "actor/kl": 0.02, "actor/pg_loss": -0.1, "critic/value_loss": 0.05,
            "actor/entropy": 2.5, "actor/pg_clipfrac": 0.1, "actor/kl_coef": 0.001, "perf/tokens_per_s": 80.0,
            "timing/generate": 0.2, "timing/update": 0.3, "training/policy_version": 1.0,
            "training/policy_lag": 0.0}.items() <= names.items()
    assert "step" not in names and len(names) == len(record) - 1
    assert all("/" in name and not name.startswith("train/") for name in names), sorted(names)


def test_names_keep_a_namespace_and_put_unknown_keys_under_train() -> None:
    assert tracker_name("timing/generate") == "timing/generate"
    assert tracker_name("critic_loss") == "critic/value_loss"
    assert tracker_name("something_new") == "train/something_new"
    assert namespaced({"step": 3, "kl": 1, "flag": True, "note": "x"}) == {"actor/kl": 1.0}


# -- the spec -------------------------------------------------------------------------------------------------


def test_loggers_default_to_the_progress_bar_and_metrics_file(example_doc) -> None:
    loggers = parse_job(example_doc("tiny-ppo.yaml")).spec.trainer.loggers
    assert (loggers.backends, loggers.project, loggers.experiment, loggers.dir, loggers.val_generations) == (
        ["console", "jsonl"], "hybridflow", None, None, 0)
    job = parse_job({"metadata": {"name": "named"}, "spec": {"trainer": {"loggers": {
        "backends": ["jsonl", "tensorboard", "mlflow", "wandb"], "project": "p", "experiment": "e", "dir": "/d"}}}})
    assert job.spec.trainer.to_yaml_dict()["loggers"] == {
        "backends": ["jsonl", "tensorboard", "mlflow", "wandb"], "project": "p", "experiment": "e", "dir": "/d",
        "valGenerations": 0}
    assert trackers.experiment_name(parse_job({"metadata": {"name": "named"}})) == "named"


@pytest.mark.parametrize(("loggers", "problem"), [
    ({"backends": ["jsonl", "tensorbord"]},
     "spec.trainer.loggers.backends[1]: got 'tensorbord', allowed: 'console', 'jsonl', 'tensorboard', 'mlflow' "
     "or 'wandb'"),
    ({"backends": ["wandb", "wandb"]}, "spec.trainer.loggers.backends: 'wandb' appears more than once"),
    ({"backends": "wandb"}, "spec.trainer.loggers.backends: Input should be a valid list (got 'wandb')"),
    ({"project": ""}, "spec.trainer.loggers.project: String should have at least 1 character (got '')"),
    ({"backend": ["wandb"]}, "spec.trainer.loggers.backend: unknown field (check the spelling; fields are camelCase)"),
])
def test_bad_loggers_name_the_field_and_what_is_allowed(loggers: dict, problem: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_job({"spec": {"trainer": {"loggers": loggers}}})
    assert caught.value.problems == [problem]


def test_validate_refuses_an_unknown_backend_without_a_traceback(tmp_path, example_doc) -> None:
    doc = example_doc("tiny-ppo.yaml")
    doc["spec"]["trainer"]["loggers"] = {"backends": ["console", "neptune"]}
    out = hybridflow("validate", write(tmp_path, doc))
    assert_clean_failure(out, "1 problem", "spec.trainer.loggers.backends[1]: got 'neptune', allowed: 'console', "
                         "'jsonl', 'tensorboard', 'mlflow' or 'wandb'")


def test_the_crd_takes_the_backends_as_a_set_of_names() -> None:
    trainer = crdgen.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"]["trainer"]
    backends = trainer["properties"]["loggers"]["properties"]["backends"]
    assert backends["items"]["enum"] == ["console", "jsonl", "tensorboard", "mlflow", "wandb"]
    assert backends["x-kubernetes-list-type"] == "set"


# -- extras and failures --------------------------------------------------------------------------------------


def test_a_missing_package_names_its_extra_before_anything_opens(example_doc, tmp_path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(trackers.EXTRAS, "mlflow", ("hybridflow_no_such_tracker", "mlflow"))
    job = job_with(example_doc, tmp_path, backends=["tensorboard", "mlflow"])
    problem = ("spec.trainer.loggers.backends: 'mlflow' needs the hybridflow_no_such_tracker package: "
               "pip install 'hybridflow[mlflow]' (or 'hybridflow[trackers]' for all)")
    assert missing_extras(job.spec.trainer.loggers.backends) == [problem]
    assert problem in preflight(job.spec)
    with pytest.raises(TrackerUnavailable, match=r"hybridflow\[mlflow\]"):
        open_trackers(job, TRACKERS)
    assert not (tmp_path / "trackers").exists()
    assert missing_extras(["console", "jsonl", "tensorboard", "wandb"]) == []


class Broken:
    """A tracker whose destination is gone."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        raise ConnectionError("tracking server unreachable")

    def close(self) -> None:
        raise ConnectionError("tracking server unreachable")


class Kept:
    def __init__(self) -> None:
        self.steps: list[tuple[int, dict[str, float]]] = []

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.steps.append((step, dict(metrics)))

    def close(self) -> None:
        pass


def test_a_failing_tracker_is_warned_about_once_and_the_others_go_on(caplog: pytest.LogCaptureFixture) -> None:
    kept = Kept()
    group = TrackerSet({"broken": Broken(), "kept": kept})
    with caplog.at_level(logging.WARNING, logger="hybridflow.trackers"):
        for record in RECORDS:
            group.log_record(record)
        group.close()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "tracker broken failed to log" in warnings[0]
    assert [s for s, _ in kept.steps] == [1, 2, 3]
    assert kept.steps[1][1]["critic/value_loss"] == 1.0


def test_the_console_shows_reward_and_kl_and_steps_back_on_a_rollback(example_doc, tmp_path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    console = open_trackers(job_with(example_doc, tmp_path, backends=["console"]), ("console",))
    bar = console.trackers["console"].bar
    for record in RECORDS[:2]:
        console.log_record(record)
    assert (bar.n, bar.total) == (2, 80)
    console.log_record(RECORDS[0])
    assert bar.n == 1 and bar.postfix == "reward=0.100, kl=0.010"
    console.close()
    assert "reward=0.100, kl=0.010" in capsys.readouterr().err


def test_the_console_of_a_run_in_epochs_takes_its_length_from_the_first_progress(example_doc, tmp_path) -> None:
    job = job_with(example_doc, tmp_path, backends=["console"])
    job.spec.trainer.total_epochs = 3
    console = open_trackers(job, ("console",))
    bar = console.trackers["console"].bar
    assert bar.total is None  # not totalSteps: the controller counts the steps when it loads the data
    console.log(1, namespaced({"step": 1, "total_steps": 94, "reward_mean": 0.1}))
    assert (bar.n, bar.total) == (1, 94)
    console.close()


# -- the backends, read back ----------------------------------------------------------------------------------


def tensorboard_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def mlflow_history(store: Path, project: str, experiment: str) -> dict[str, dict[int, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store.resolve().as_uri())
    found = client.get_experiment_by_name(project)
    assert found is not None, f"no mlflow experiment {project!r} in {store}"
    (run,) = client.search_runs([found.experiment_id], filter_string=f"attributes.run_name = '{experiment}'")
    assert run.info.status == "FINISHED"
    return {name: {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}
            for name in run.data.metrics}


def assert_logged(held: dict[str, dict[int, float]], records: list[dict[str, Any]]) -> None:
    for name, key in EXPECTED.items():
        assert held[name] == pytest.approx({r["step"]: r[key] for r in records}, rel=1e-6), name


def test_tensorboard_holds_every_step_under_verl_names(example_doc, tmp_path) -> None:
    job = job_with(example_doc, tmp_path, backends=["tensorboard"], project="proj", experiment="exp")
    log_all(job, RECORDS)
    held = tensorboard_scalars(tmp_path / "trackers" / "tb" / "proj" / "exp")
    assert_logged(held, RECORDS)
    assert "step" not in held and "kl" not in held


def test_a_restarted_run_replaces_tensorboards_steps_past_its_checkpoint(example_doc, tmp_path) -> None:
    job = job_with(example_doc, tmp_path, backends=["tensorboard"])
    log_all(job, RECORDS)
    replayed = [{**r, "kl": r["kl"] + 5.0} for r in RECORDS[1:]]
    log_all(job, replayed, first_step=2)
    held = tensorboard_scalars(tmp_path / "trackers" / "tb" / "hybridflow" / "trk")
    assert held["actor/kl"] == pytest.approx({1: 0.01, 2: 5.02, 3: 5.03})


def test_mlflow_file_store_holds_every_step_under_verl_names(example_doc, tmp_path, mlflow_env) -> None:
    job = job_with(example_doc, tmp_path, backends=["mlflow"], project="proj", experiment="exp")
    log_all(job, RECORDS)
    store = tmp_path / "trackers" / "mlruns"
    assert_logged(mlflow_history(store, "proj", "exp"), RECORDS)


def test_mlflow_follows_the_tracking_uri_it_is_given(example_doc, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = tmp_path / "elsewhere"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.resolve().as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    job = job_with(example_doc, tmp_path, backends=["mlflow"])
    log_all(job, RECORDS[:2])
    assert mlflow_history(store, "hybridflow", "trk")["actor/kl"] == pytest.approx({1: 0.01, 2: 0.02})
    assert not (tmp_path / "trackers" / "mlruns").exists()


def wandb_records(path: Path) -> list[Any]:
    """The protobuf records of an offline run file (a leveldb log: 32 KiB blocks of checksummed chunks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, chunk, out = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        if left < 7 or kind == 0:  # the zero padding at the end of a block
            pos += left
            continue
        if pos + 7 + length > len(data):  # a record still being written
            break
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = pb.Record()
            record.ParseFromString(chunk)
            out.append(record)
            chunk = b""
    return out


def finished_wandb_records(path: Path, timeout_s: float = 60.0) -> list[Any]:
    """wandb's service writes the offline file after `finish()` returns: wait for the run's exit record."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = wandb_records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def test_wandb_without_an_api_key_runs_offline_and_holds_every_step(example_doc, tmp_path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "netrc").write_text("")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert not trackers.wandb_api_key_present()
    job = job_with(example_doc, tmp_path, backends=["wandb"], project="proj", experiment="exp")
    log_all(job, RECORDS)
    (run_file,) = (tmp_path / "trackers" / "wandb").glob("offline-run-*/run-*.wandb")
    records = finished_wandb_records(run_file)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name) == ("proj", "exp")
    assert json.loads(run.config.update[0].value_json) is not None
    history = {r.history.step.num: {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                    for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"}
    held = {name: {step: row[name] for step, row in history.items()} for name in EXPECTED}
    assert_logged(held, RECORDS)


SAMPLES = [{"prompt": "1 2 | 3", "response": "3\nmore", "answer": "3", "score": 1.0, "group": 0},
           {"prompt": "4 5", "response": "", "answer": "5", "score": 0.0, "group": 1}]
"""Two of an evaluation's samples (samples.sample_rows): a pipe and a newline to escape, an empty response."""
TABLE = [["1 2 | 3", "3\nmore", "3", 1.0], ["4 5", "", "5", 0.0]]


def log_samples(job, step: int = 2) -> None:
    opened = open_trackers(job, TRACKERS)
    opened.log_samples(step, SAMPLES)
    assert not opened.failed
    opened.close()


def test_an_evaluations_responses_reach_tensorboard_as_a_markdown_table(example_doc, tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_samples(job_with(example_doc, tmp_path, backends=["tensorboard"], project="proj", experiment="exp"))
    acc = EventAccumulator(str(tmp_path / "trackers" / "tb" / "proj" / "exp"), size_guidance={"tensors": 0})
    acc.Reload()
    (event,) = acc.Tensors("val/generations/text_summary")
    assert event.step == 2
    assert event.tensor_proto.string_val[0].decode().splitlines() == [
        "| prompt | response | answer | score |", "|---|---|---|---|",
        "| 1 2 \\| 3 | 3<br>more | 3 | 1.0 |", "| 4 5 |  | 5 | 0.0 |"]


def test_an_evaluations_responses_reach_mlflow_as_a_table_artifact(example_doc, tmp_path, mlflow_env) -> None:
    from mlflow.tracking import MlflowClient

    log_samples(job_with(example_doc, tmp_path, backends=["mlflow"], project="proj", experiment="exp"))
    client = MlflowClient(tracking_uri=(tmp_path / "trackers" / "mlruns").resolve().as_uri())
    found = client.get_experiment_by_name("proj")
    assert found is not None
    (run,) = client.search_runs([found.experiment_id])
    local = client.download_artifacts(run.info.run_id, "val/generations/step_00000002.json", str(tmp_path))
    assert json.loads(Path(local).read_text()) == {"columns": ["prompt", "response", "answer", "score"],
                                                   "data": TABLE}


def test_an_evaluations_responses_reach_wandb_as_a_table(example_doc, tmp_path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    log_samples(job_with(example_doc, tmp_path, backends=["wandb"]))
    (run_file,) = (tmp_path / "trackers" / "wandb").glob("offline-run-*/run-*.wandb")
    items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
             for r in finished_wandb_records(run_file) if r.WhichOneof("record_type") == "history"
             for i in r.history.item}
    assert (items["val/generations/_type"], items["val/generations/nrows"]) == ("table-file", 2)
    (table,) = (tmp_path / "trackers" / "wandb").glob("offline-run-*/files/media/table/val/generations_*.table.json")
    assert json.loads(table.read_text()) == {"columns": ["prompt", "response", "answer", "score"], "data": TABLE}


def test_val_generations_need_val_prompts(example_doc) -> None:
    doc = example_doc("tiny-ppo.yaml")
    doc["spec"]["trainer"]["loggers"] = {"valGenerations": 4}
    with pytest.raises(SpecError, match=r"trainer\.loggers\.valGenerations needs data\.val"):
        parse_job(doc)


@pytest.mark.slow
def test_the_trainer_sends_every_step_to_the_trackers(example_doc, tmp_path, mlflow_env) -> None:
    """A real short run: tensorboard and mlflow hold what the run's records say, step by step; without jsonl
    no metrics file is written, and the result still has the records."""
    import ray

    from hybridflow.driver import init_ray
    from hybridflow.trainer import Trainer

    doc = example_doc("tiny-grpo.yaml")
    doc["metadata"]["name"] = "trk-run"
    doc["spec"]["trainer"].update(totalSteps=2, resume="never",
                                  loggers={"backends": ["tensorboard", "mlflow"], "experiment": "short"})
    doc["spec"]["trainer"]["checkpoint"] = {"every": 0, "path": str(tmp_path / "ckpt")}
    job = parse_job(doc)
    init_ray(local=True, num_cpus=8)
    trainer = Trainer(job.model_dump(by_alias=True, mode="json"), str(tmp_path / "run" / "metrics.jsonl"))
    try:
        result = trainer.fit()
    finally:
        trainer.shutdown()
        ray.shutdown()
    records = result["records"]
    assert [r["step"] for r in records] == [1, 2]
    assert not (tmp_path / "run" / "metrics.jsonl").exists() and result["plot"] is None
    from_tb = tensorboard_scalars(tmp_path / "run" / "tb" / "hybridflow" / "short")
    from_mlflow = mlflow_history(tmp_path / "run" / "mlruns", "hybridflow", "short")
    for held in (from_tb, from_mlflow):
        for name in ("rollout/reward_mean", "actor/kl", "actor/pg_loss", "perf/tokens_per_s", "timing/generate"):
            key = next(k for k in records[0] if tracker_name(k) == name)
            assert held[name] == pytest.approx({r["step"]: r[key] for r in records}, rel=1e-6), name
    assert set(from_mlflow) == {tracker_name(k) for r in records for k in r if k != "step"}
    assert "val/reward_mean" in from_mlflow  # the example evaluates after its last step


def test_the_readme_example_parses() -> None:
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = text.split("<!-- loggers example -->", 1)[1].split("```yaml", 1)[1].split("```", 1)[0]
    job = parse_job(yaml.safe_load(block))
    assert job.spec.trainer.loggers.backends == ["console", "jsonl", "tensorboard", "mlflow"]
