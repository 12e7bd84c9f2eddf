"""The command line on bad input: one clear message naming the field, exit 1, never a traceback."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import EXAMPLES, ROOT
from tests.helpers import templates_of


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


def test_validate_names_evaluation_settings_that_cannot_work(tmp_path, example_doc) -> None:
    doc = example_doc("tiny-ppo.yaml")
    doc["spec"]["trainer"]["eval"] = {"samplesPerPrompt": 4}
    doc["spec"]["data"]["promptFormat"] = "jinja"
    fields = write(tmp_path, doc, "fields.yaml")
    doc = example_doc("tiny-ppo.yaml")
    doc["spec"]["trainer"]["evalEvery"] = 5
    no_val = write(tmp_path, doc, "no-val.yaml")
    out = hybridflow("validate", fields, no_val)
    assert_clean_failure(out, "fields.yaml: 2 problems",
                         "spec.data.promptFormat: got 'jinja', allowed: 'auto', 'chat' or 'raw'",
                         "spec.trainer.eval: eval.temperature and eval.samplesPerPrompt above 1 need eval.greedy "
                         "false", "no-val.yaml: 1 problem\n  - spec: trainer.evalEvery needs data.val")


def test_validate_names_pod_settings_that_cannot_work(tmp_path, example_doc) -> None:
    doc = example_doc("ppo-job.yaml")
    doc["spec"]["cluster"]["volumeMounts"].append({"name": "logs", "mountPath": "/var/log/ray"})
    doc["spec"]["cluster"]["env"].append({"name": "HYBRIDFLOW_CONFIG", "value": "/tmp/job.json"})
    out = hybridflow("validate", write(tmp_path, doc))
    assert_clean_failure(out, "2 problems",
                         "spec.cluster.volumeMounts: volumeMounts[3] (/var/log/ray) mounts volume 'logs', "
                         "which is not in cluster.volumes",
                         "spec.cluster.env[1].name: env names HYBRIDFLOW_*")


def test_a_local_run_on_one_gpu_gives_the_critic_a_quarter_of_the_actors_gpu(capsys) -> None:
    from hybridflow import DataflowGraph
    from hybridflow.api import load_job
    from hybridflow.cli import _fit_local_gpus

    job = load_job(EXAMPLES / "tiny-ppo.yaml")
    _fit_local_gpus(job, 1)
    assert job.spec.graph is not None
    assert DataflowGraph.from_spec(job.spec.graph).get("critic").resources == {"GPU": 0.25}
    assert ("the critic shares the actor's GPU: the built-in ppo graph needs 1.75 GPUs and this machine has 1"
            in capsys.readouterr().out)
    roomy = load_job(EXAMPLES / "tiny-ppo.yaml")
    _fit_local_gpus(roomy, 2)
    assert roomy.spec.graph is None and capsys.readouterr().out == ""


def test_render_shows_the_examples_mounts_and_secret(tmp_path) -> None:
    out = hybridflow("render", str(EXAMPLES / "ppo-job.yaml"))
    assert out.returncode == 0, out.stderr
    rayjob = next(d for d in yaml.safe_load_all(out.stdout) if d["kind"] == "RayJob")
    head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    assert {"name": "models", "mountPath": "/mnt/models", "readOnly": True} in head["containers"][0]["volumeMounts"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}} \
        in head["containers"][0]["env"]


def test_render_shows_the_jobs_annotations_on_the_rayjob_and_pods(tmp_path, example_doc) -> None:
    doc = example_doc("ppo-job.yaml")
    doc["metadata"]["annotations"] = {"team.example.com/owner": "rl-infra",
                                      "kubectl.kubernetes.io/last-applied-configuration": "{}"}
    out = hybridflow("render", write(tmp_path, doc))
    assert out.returncode == 0, out.stderr
    rayjob = next(d for d in yaml.safe_load_all(out.stdout) if d["kind"] == "RayJob")
    assert rayjob["metadata"]["annotations"]["team.example.com/owner"] == "rl-infra"
    for template in templates_of(rayjob).values():
        assert template["metadata"]["annotations"] == {"team.example.com/owner": "rl-infra"}
    assert "last-applied-configuration" not in out.stdout


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
        "edges": [{"src": "actor", "dst": "rm", "coLocate": True}, {"src": "rm", "dst": "actor"}],
    }
    out = hybridflow("validate", write(tmp_path, doc))
    assert_clean_failure(out, "spec.graph: cycle through actor, rm is not closed by a control edge",
                         "cannot share a bundle")


@pytest.mark.slow
def test_run_names_missing_paths_and_unimportable_reward(tmp_path, example_doc) -> None:
    doc = example_doc("tiny-ppo.yaml")
    doc["spec"]["model"]["policy"]["path"] = str(tmp_path / "no-model")
    doc["spec"]["reward"]["function"] = "no_such_module:score"
    doc["spec"]["data"]["train"] = str(tmp_path / "missing.parquet")
    doc["spec"]["data"]["val"] = str(tmp_path / "missing-val.jsonl")
    out = hybridflow("run", write(tmp_path, doc), "--quiet")
    assert_clean_failure(out, "4 problems", "spec.model.policy.path: no HF model",
                         "spec.reward.function: cannot import", "spec.data.train: file not found",
                         "spec.data.val: file not found")


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


# -- version, standard input, shell completion ------------------------------------------------------------


def test_version_prints_the_package_version() -> None:
    from hybridflow import __version__

    out = hybridflow("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"hybridflow {__version__}"


def test_validate_reads_standard_input(example_doc) -> None:
    for text in (yaml.safe_dump(example_doc("tiny-grpo.yaml")), json.dumps(example_doc("tiny-ppo.yaml"))):
        out = subprocess.run([sys.executable, "-m", "hybridflow", "validate", "-"], input=text,
                             capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("<stdin>: valid ")
    doc = example_doc("tiny-grpo.yaml")
    doc["spec"]["algorithm"]["name"] = "rloo"
    doc["spec"]["rollout"]["samplesPerPrompt"] = 1
    out = subprocess.run([sys.executable, "-m", "hybridflow", "validate", "-"], input=yaml.safe_dump(doc),
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert_clean_failure(out, "<stdin>: 1 problem", "rollout.samplesPerPrompt must be at least 2 for rloo")


def completion_script(shell: str) -> str:
    out = hybridflow("completion", shell)
    assert out.returncode == 0, out.stderr
    return out.stdout


def complete_in_bash(script: str, *words: str) -> list[str]:
    """What the script offers for `words` (the last one being typed), in a bash subprocess."""
    line = " ".join(shlex.quote(w) for w in words)
    probe = (f"source {shlex.quote(script)}\n"
             f"COMP_WORDS=({line}); COMP_CWORD=$((${{#COMP_WORDS[@]}} - 1)); _hybridflow\n"
             'printf "%s\\n" "${COMPREPLY[@]}"\n')
    out = subprocess.run(["bash", "--norc", "--noprofile", "-c", probe], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return [w for w in out.stdout.splitlines() if w]


def test_bash_completion_registers_and_completes_commands_options_and_choices(tmp_path) -> None:
    script = tmp_path / "hybridflow.bash"
    script.write_text(completion_script("bash"))
    registered = subprocess.run(["bash", "--norc", "--noprofile", "-c", f"source {script} && complete -p hybridflow"],
                                capture_output=True, text=True, timeout=30)
    assert registered.returncode == 0, registered.stderr
    assert registered.stdout.strip() == "complete -o bashdefault -o default -F _hybridflow hybridflow"
    s = str(script)
    assert complete_in_bash(s, "hybridflow", "") == ["run", "train", "validate", "render", "export", "ctl",
                                                       "dashboard", "completion"]
    assert complete_in_bash(s, "hybridflow", "va") == ["validate"]
    assert complete_in_bash(s, "hybridflow", "--ver") == ["--verbose", "--version"]
    assert complete_in_bash(s, "hybridflow", "completion", "") == ["bash", "zsh"]
    assert complete_in_bash(s, "hybridflow", "ctl", "s") == ["status", "scale"]
    assert complete_in_bash(s, "hybridflow", "export", "ckpt", "--adapters", "") == ["merge", "separate"]
    assert complete_in_bash(s, "hybridflow", "-v", "run", "--steps", "3", "--q") == ["--quiet"]
    # An option's value and a job file: nothing from the script, so bash completes file names (-o default).
    assert complete_in_bash(s, "hybridflow", "run", "--metrics-out", "") == []
    assert complete_in_bash(s, "hybridflow", "validate", "") == []


def test_zsh_completion_is_a_compdef_function_with_the_same_commands() -> None:
    text = completion_script("zsh")
    assert text.startswith("#compdef hybridflow\n")
    assert "compdef _hybridflow hybridflow" in text
    assert '"") subs=(run train validate render export ctl dashboard completion)' in text
    assert '"completion") subs=(); opts=(-h --help); choices=(bash zsh) ;;' in text
    if shutil.which("zsh"):
        checked = subprocess.run(["zsh", "-n"], input=text, capture_output=True, text=True, timeout=30)
        assert checked.returncode == 0, checked.stderr


def test_completion_refuses_other_shells() -> None:
    out = hybridflow("completion", "fish")
    assert out.returncode == 2
    assert "invalid choice: 'fish'" in out.stderr
