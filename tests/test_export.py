"""Exporting a trained policy as a Hugging Face folder: from a checkpoint (`hybridflow export`) and at the end of
a run (spec.trainer.export), loaded back with transformers; and the CLI's refusals, each naming its argument."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.api import parse_job
from hybridflow.checkpoint import JOB_FILE, complete_steps, resolve
from hybridflow.cli import main
from hybridflow.data.tiny import ensure_tiny_model, tiny_task_rows
from hybridflow.export import METADATA_FILE, metadata, model_card
from tests.conftest import ROOT
from tests.helpers import greedy_tokens, policy_from_checkpoint, train_in_fresh_ray

pytestmark = pytest.mark.slow

PROMPTS = [r["prompt"] for r in tiny_task_rows(200, seed=11)]


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


def hybridflow(*args: str) -> subprocess.CompletedProcess:
    """The installed command line, in a process of its own."""
    return subprocess.run([sys.executable, "-m", "hybridflow", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=240)


def export(capsys: pytest.CaptureFixture[str], *args: str) -> Ran:
    """`hybridflow export ...` through the CLI's main in this process (a new process costs the imports again)."""
    capsys.readouterr()
    code = main(["export", *args])
    out = capsys.readouterr()
    return Ran(code, out.out, out.err)


def assert_clean_failure(out: subprocess.CompletedProcess | Ran, *needles: str) -> None:
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    for needle in needles:
        assert needle in out.stderr, f"{needle!r} not in {out.stderr!r}"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, example_doc_module: dict) -> dict:
    """The tiny GRPO job, full fine-tune, 8 steps with a checkpoint every 4 and the spec's export at the end."""
    tmp = tmp_path_factory.mktemp("export")
    doc = example_doc_module
    doc["metadata"]["name"] = "export-full"
    doc["spec"]["trainer"].update(totalSteps=8, resume="never",
                                  checkpoint={"every": 4, "path": str(tmp / "ckpt")},
                                  export={"path": str(tmp / "final")})
    job = parse_job(doc)
    result = train_in_fresh_ray(job, tmp / "m.jsonl")
    return {"tmp": tmp, "job": job, "result": result, "root": tmp / "ckpt"}


@pytest.fixture(scope="module")
def example_doc_module() -> dict:
    import yaml

    return yaml.safe_load((ROOT / "examples" / "tiny-grpo.yaml").read_text())


def test_the_run_exports_its_final_policy_and_saves_its_job_with_each_checkpoint(trained: dict) -> None:
    final = trained["tmp"] / "final"
    assert trained["result"]["export"] == str(final)
    assert (final / "model.safetensors").is_file() and not list(final.glob("*.bin"))
    assert (final / "config.json").is_file() and (final / "tokenizer.json").is_file()
    meta = json.loads((final / METADATA_FILE).read_text())
    assert (meta["job"], meta["step"], meta["kind"], meta["baseModel"]) == ("export-full", 8, "full", "builtin:tiny")
    assert "# export-full: policy at step 8" in (final / "README.md").read_text()
    assert complete_steps(trained["root"]) == [4, 8]
    saved = json.loads((trained["root"] / "step_00000008" / JOB_FILE).read_text())
    assert saved["metadata"]["name"] == "export-full" and saved["spec"]["model"]["policy"]["path"] == "builtin:tiny"


def test_an_exported_folder_generates_what_the_trained_policy_generates(trained: dict) -> None:
    """Greedy tokens of the folders (CLI from the checkpoint root, and the run's own export) equal those of the
    policy restored from the newest checkpoint, and differ from the untrained base's."""
    out_dir = trained["tmp"] / "cli"
    out = hybridflow("export", str(trained["root"]), "--to", str(out_dir))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"exported": str(out_dir), "step": 8, "kind": "full", "baseModel": "builtin:tiny"}
    newest = resolve(trained["root"])
    assert newest is not None and newest.name == "step_00000008"
    policy = policy_from_checkpoint(newest, trained["job"].spec)
    tok = AutoTokenizer.from_pretrained(out_dir)
    expected = greedy_tokens(policy, tok, PROMPTS)
    for folder in (out_dir, trained["tmp"] / "final"):
        exported = AutoModelForCausalLM.from_pretrained(folder)
        assert torch.equal(greedy_tokens(exported, AutoTokenizer.from_pretrained(folder), PROMPTS), expected)
    base = AutoModelForCausalLM.from_pretrained(ensure_tiny_model())
    moved = (greedy_tokens(base, tok, PROMPTS) != expected).any(dim=1).sum().item()
    assert moved >= 10, f"only {moved} of {len(PROMPTS)} prompts changed: the weights did not move"


def test_a_step_directory_exports_that_step_and_an_export_is_replaced_only_when_asked(
        trained: dict, capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = trained["tmp"] / "step4"
    assert export(capsys, str(trained["root"] / "step_00000004"), "--to", str(out_dir)).returncode == 0
    assert json.loads((out_dir / METADATA_FILE).read_text())["step"] == 4
    assert_clean_failure(export(capsys, str(trained["root"]), "--to", str(out_dir)),
                         "--to:", "holds an earlier export; pass --overwrite")
    assert export(capsys, str(trained["root"]), "--to", str(out_dir), "--overwrite").returncode == 0
    assert json.loads((out_dir / METADATA_FILE).read_text())["step"] == 8


def test_a_checkpoint_without_its_job_needs_config(trained: dict, capsys: pytest.CaptureFixture[str]) -> None:
    old = trained["tmp"] / "old" / "step_00000008"
    shutil.copytree(trained["root"] / "step_00000008", old)
    (old / JOB_FILE).unlink()
    assert_clean_failure(export(capsys, str(old), "--to", str(trained["tmp"] / "x")),
                         "--config:", f"holds no {JOB_FILE}", "--config JOB.yaml")
    job_file = trained["tmp"] / "job.json"
    job_file.write_text(json.dumps(trained["job"].model_dump(by_alias=True, mode="json")))
    out = export(capsys, str(old), "--to", str(trained["tmp"] / "x"), "--config", str(job_file))
    assert out.returncode == 0, out.stderr


def test_export_refusals_name_the_argument(trained: dict, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    root = str(trained["root"])
    assert_clean_failure(export(capsys, str(tmp_path / "none"), "--to", str(tmp_path / "o")),
                         "CHECKPOINT:", "neither a checkpoint directory")
    assert_clean_failure(export(capsys, root, "--to", str(tmp_path / "o"), "--adapters", "separate"),
                         "--adapters: 'separate' needs a LoRA policy (spec.model.policy.lora)")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    assert_clean_failure(export(capsys, root, "--to", str(tmp_path / "busy"), "--overwrite"),
                         "--to:", "holds no earlier export")
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"
    bad = tmp_path / "bad.yaml"
    bad.write_text("spec: {model: {policy: {path: /nowhere}}}\n")
    assert_clean_failure(export(capsys, root, "--to", str(tmp_path / "o"), "--config", str(bad)),
                         "spec.model.policy.path: no HF model at '/nowhere'")
    lora = tmp_path / "lora.yaml"
    lora.write_text("spec: {model: {policy: {lora: {targetModules: [q_proj]}}}}\n")
    assert_clean_failure(export(capsys, root, "--to", str(tmp_path / "o"), "--config", str(lora)),
                         "spec.model.policy.lora:", "the weights are a full fine-tune's")
    assert not (tmp_path / "o").exists()


def test_the_model_card_says_what_the_folder_holds_and_how_to_load_it() -> None:
    lora = {"rank": 4, "alpha": 8, "targetModules": ["q_proj"]}
    job = parse_job({"metadata": {"name": "j"}, "spec": {
        "algorithm": {"name": "grpo"}, "rollout": {"samplesPerPrompt": 2}, "model": {"policy": {"lora": lora}}}})
    meta = metadata(job, 12, "adapter", "/ck/step_00000012")
    assert meta["lora"] == {"rank": 4, "alpha": 8.0, "targetModules": ["q_proj"], "dropout": 0.0}
    card = model_card(meta)
    assert card.startswith("---\nlibrary_name: peft\n")
    assert "# j: policy at step 12" in card and "exported from /ck/step_00000012" in card
    assert "LoRA adapters alone (rank 4, alpha 8, on q_proj); the base model is `builtin:tiny`" in card
    assert "PeftModel.from_pretrained" in card
    merged = model_card(metadata(job, 3, "merged", ""))
    assert "library_name: transformers" in merged and "merged into the base weights" in merged
    assert "exported from the end of the run" in merged
