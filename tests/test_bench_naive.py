"""The naive Ray baseline of the runtime benchmark: it trains, and on the same batch shape as hybridflow."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from benchmarks.naive_ray import run_naive
from hybridflow.advantages import compute_advantages
from hybridflow.api import load_job
from hybridflow.data.prompts import PromptSampler, load_rows
from hybridflow.workers.host import WorkerHost

ROOT = Path(__file__).resolve().parent.parent
TINY_GRPO = ROOT / "examples" / "tiny-grpo.yaml"


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    if ray.is_initialized():
        ray.shutdown()
    # address="local": never join a cluster another process left running
    ray.init(address="local", num_cpus=3, include_dashboard=False, configure_logging=False,
             runtime_env={"env_vars": {"HYBRIDFLOW_TORCH_THREADS": "1"}})
    yield
    ray.shutdown()


def hybridflow_batch(spec):  # -> RolloutBatch
    """One batch as hybridflow's co-located host produces it, advantages included, without Ray."""
    rows = PromptSampler(load_rows(spec.data.train, spec.data.prompt_key, spec.data.answer_key, 0),
                         spec.data.batch_size, 0).next_batch()
    n = spec.rollout.samples_per_prompt
    host = WorkerHost(spec.model_dump(mode="json"),
                      {"actor_rollout": "actor_rollout", "reward_score": "reward", "reference": "reference"}, 0,
                      use_gpu=False)
    batch = host.rollout([r for r in rows for _ in range(n)], [i for i in range(len(rows)) for _ in range(n)],
                         ["reward", "reference", "old_log_probs"])
    compute_advantages(batch, spec, spec.algorithm.kl_penalty.coef)
    return batch


def test_naive_ray_two_steps_finite_and_shaped_like_hybridflow(local_ray: None) -> None:
    spec = load_job(TINY_GRPO).spec
    result = run_naive(spec, steps=2)
    assert [r["step"] for r in result.records] == [1, 2]
    for r in result.records:
        for key in ("reward_mean", "kl", "actor_loss", "tokens", "tokens_per_s", "timing/step",
                    "timing/generate", "timing/actor_update_compute", "orchestration_overhead_frac"):
            assert math.isfinite(r[key]), (key, r[key])
        assert r["tokens"] > 0 and r["timing/step"] > 0
        assert 0.0 <= r["orchestration_overhead_frac"] < 1.0
    expected = hybridflow_batch(spec)
    rows = spec.data.batch_size * spec.rollout.samples_per_prompt
    assert result.batch_shape == tuple(expected.input_ids.shape)
    assert result.batch_shape[0] == rows
    assert result.batch_keys == sorted(expected.tensors)
