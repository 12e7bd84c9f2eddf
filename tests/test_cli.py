"""The command line on bad input: one clear message naming the field, exit 1, never a traceback."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import EXAMPLES, ROOT


def hybridflow(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridflow", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout)


def write(tmp_path: Path, doc: dict | str, name: str = "job.yaml") -> str:
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    return str(path)


def assert_clean_failure(out: subprocess.CompletedProcess, *needles: str) -> None:
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    for n in needles:
        assert n in out.stderr, f"{n!r} not in {out.stderr!r}"


def test_validate_passes_the_examples() -> None:
    out = hybridflow("validate", *sorted(str(p) for p in EXAMPLES.glob("*.yaml")))
    assert out.returncode == 0, out.stderr
    assert out.stdout.count(": valid ") == len(list(EXAMPLES.glob("*.yaml")))


def test_validate_reports_every_problem(tmp_path, example_doc) -> None:
    doc = example_doc("tiny-ppo.yaml")
    doc["spec"]["rollout"]["engine"] = "sglang"
    doc["spec"]["trainer"]["totalStep"] = 3
    out = hybridflow("validate", write(tmp_path, doc))
    assert_clean_failure(out, "2 problems", "spec.rollout.engine: got 'sglang', allowed: 'torch' or 'vllm'",
                         "spec.trainer.totalStep: unknown field")


def test_validate_names_pod_settings_that_cannot_work(tmp_path, example_doc) -> None:
    doc = example_doc("ppo-job.yaml")
    doc["spec"]["cluster"]["volumeMounts"].append({"name": "logs", "mountPath": "/var/log/ray"})
    doc["spec"]["cluster"]["env"].append({"name": "HYBRIDFLOW_CONFIG", "value": "/tmp/job.json"})
    out = hybridflow("validate", write(tmp_path, doc))
    assert_clean_failure(out, "2 problems",
                         "spec.cluster.volumeMounts: volumeMounts[3] (/var/log/ray) mounts volume 'logs', "
                         "which is not in cluster.volumes",
                         "spec.cluster.env[1].name: env names HYBRIDFLOW_*")


def test_render_shows_the_examples_mounts_and_secret(tmp_path) -> None:
    out = hybridflow("render", str(EXAMPLES / "ppo-job.yaml"))
    assert out.returncode == 0, out.stderr
    rayjob = next(d for d in yaml.safe_load_all(out.stdout) if d["kind"] == "RayJob")
    head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    assert {"name": "models", "mountPath": "/mnt/models", "readOnly": True} in head["containers"][0]["volumeMounts"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}} \
        in head["containers"][0]["env"]


def test_validate_and_render_take_cpu_quantities(tmp_path, example_doc) -> None:
    doc = example_doc("ppo-job.yaml")
    doc["spec"]["cluster"]["headCpus"] = "250m"
    for group in doc["spec"]["cluster"]["workerGroups"]:
        group["cpusPerWorker"] = "500m"
    path = write(tmp_path, doc)
    assert "headCpus: 250m" in Path(path).read_text()
    out = hybridflow("validate", path)
    assert out.returncode == 0, out.stderr
    out = hybridflow("render", path)
    assert out.returncode == 0, out.stderr
    assert "cpu: 250m" in out.stdout
    rayjob = next(d for d in yaml.safe_load_all(out.stdout) if d["kind"] == "RayJob")
    workers = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert {g["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] for g in workers} == {"500m"}


def test_validate_names_a_cpu_amount_that_is_not_one(tmp_path, example_doc) -> None:
    doc = example_doc("ppo-job.yaml")
    doc["spec"]["cluster"]["headCpus"] = "1Gi"
    out = hybridflow("validate", write(tmp_path, doc))
    assert_clean_failure(out, "1 problem", "spec.cluster.headCpus: must be a CPU amount above 0 and at most 1024 "
                         "cores", "(got '1Gi')")


def test_malformed_yaml(tmp_path) -> None:
    assert_clean_failure(hybridflow("validate", write(tmp_path, "spec: [a\n")), "malformed YAML: line 2")


def test_impossible_graph(tmp_path, example_doc) -> None:
    doc = example_doc("tiny-ppo.yaml")
    doc["spec"]["graph"] = {
        "nodes": [{"name": "actor", "role": "actor_rollout", "resources": {"GPU": 1}},
                  {"name": "rm", "role": "reward", "resources": {"GPU": 0.5}}],
        "edges": [{"src": "actor", "dst": "rm", "coLocate": True}, {"src": "actor", "dst": "ghost"}],
    }
    out = hybridflow("validate", write(tmp_path, doc))
    assert_clean_failure(out, "spec.graph: edge actor->ghost: unknown node 'ghost'", "cannot share a bundle")


@pytest.mark.slow
def test_run_names_missing_paths_and_unimportable_reward(tmp_path, example_doc) -> None:
    doc = example_doc("tiny-ppo.yaml")
    doc["spec"]["model"]["policy"]["path"] = str(tmp_path / "no-model")
    doc["spec"]["reward"]["function"] = "no_such_module:score"
    doc["spec"]["data"]["train"] = str(tmp_path / "missing.parquet")
    out = hybridflow("run", write(tmp_path, doc), "--quiet")
    assert_clean_failure(out, "3 problems", "spec.model.policy.path: no HF model",
                         "spec.reward.function: cannot import", "spec.data.train: file not found")


@pytest.mark.slow
def test_run_fails_within_the_placement_timeout_naming_missing_gpus(tmp_path, example_doc) -> None:
    doc = example_doc("tiny-grpo.yaml")
    doc["spec"]["scheduling"] = {"placementTimeoutSeconds": 5}
    doc["spec"]["graph"] = {
        "nodes": [{"name": "actor", "role": "actor_rollout", "resources": {"GPU": 1}, "parallelism": 2},
                  {"name": "rm", "role": "reward", "parallelism": 2}],
        "edges": [{"src": "actor", "dst": "rm", "coLocate": True}],
    }
    t0 = time.monotonic()
    out = hybridflow("run", write(tmp_path, doc), "--quiet")
    assert_clean_failure(out, "GPU")
    assert "missing" in out.stderr
    assert time.monotonic() - t0 < 180


def test_train_reads_its_job_from_the_config_variable_the_operator_sets(monkeypatch: pytest.MonkeyPatch,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from hybridflow import cli
    from hybridflow.k8s import contract

    monkeypatch.setenv(contract.ENV_CONFIG, contract.CONFIG_PATH)
    assert cli.build_parser().parse_args(["train"]).config == contract.CONFIG_PATH
    monkeypatch.delenv(contract.ENV_CONFIG)
    assert cli.main(["train"]) == 1
    assert contract.ENV_CONFIG in capsys.readouterr().err
