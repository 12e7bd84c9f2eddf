"""spec.algorithm.policyFiltration (PF-PPO): the update trains on the batch redrawn by score
(tests/test_algos_oracle.py checks the weights and the draw against verl's); tests/test_training.py trains with it."""

from __future__ import annotations

import pytest
import torch

from hybridflow.advantages import compute_advantages, policy_filtered
from hybridflow.api import SpecError, parse_job
from hybridflow.workers.host import WorkerHost
from tests.test_workers import ROLES, rows


def test_it_is_refused_without_ppo(example_doc) -> None:
    doc = example_doc("tiny-grpo.yaml")
    doc["spec"]["algorithm"]["policyFiltration"] = {}
    with pytest.raises(SpecError, match=r"algorithm\.policyFiltration redraws PPO's batch after GAE"):
        parse_job(doc)


def test_the_redrawn_batch_keeps_the_rows_the_weights_allow_and_the_same_seed_draws_the_same(example_doc) -> None:
    doc = example_doc("tiny-ppo.yaml")
    doc["spec"]["algorithm"]["policyFiltration"] = {"reweightMethod": "max_min"}
    spec = parse_job(doc).spec
    host = WorkerHost(spec.model_dump(mode="json"), {**ROLES, "critic": "critic"}, instance=0, use_gpu=False)
    r, _ = rows(16)
    batch = host.rollout(r, list(range(16)), ["reward", "reference", "values", "old_log_probs"])
    g = torch.Generator().manual_seed(1)
    batch.tensors["scores"] = torch.randint(0, 3, (16,), generator=g).double() / 2  # 0, 0.5 and 1, each some
    compute_advantages(batch, spec, kl_coef=0.001)
    drawn = policy_filtered(batch, spec)
    assert len(drawn) == len(batch)
    assert set(drawn.tensors["scores"].tolist()) <= {0.0, 1.0}  # max_min: only the best and worst are drawn
    assert len(set(drawn.prompts)) < len(batch)  # with replacement
    row = {p: i for i, p in enumerate(batch.prompts)}
    for i, p in enumerate(drawn.prompts):  # every tensor follows its row
        for key in ("advantages", "returns", "values", "old_log_probs"):
            torch.testing.assert_close(drawn.tensors[key][i], batch.tensors[key][row[p]])
    assert policy_filtered(batch, spec).prompts == drawn.prompts
    batch.policy_version += 1
    assert policy_filtered(batch, spec).prompts != drawn.prompts
