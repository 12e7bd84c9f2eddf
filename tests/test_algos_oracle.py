"""The advantage estimators and policy losses against verl's own implementations.

verl's `verl/trainer/ppo/core_algos.py` runs in a separate environment (tests/oracle/setup-verl-oracle.sh
builds it once under $HYBRIDFLOW_CACHE; hybridflow does not depend on verl), as a subprocess fed the same
seeded random inputs, in float64. Where the environment cannot be built (no network) the test skips, except
under CI=true, where it fails.

Agreement asked: |ours - verl| <= 1e-9 + 1e-8 * |verl| on every advantage, return, loss, gradient entry and
clip fraction. The formulas are the same; verl's masked mean divides by (n + 1e-8) where hybridflow divides
by n, a relative difference of 1e-8 / n (measured at most 2.7e-10 on these inputs; RLOO, which takes no masked
mean, agrees to 2e-16). GSPO under seq-mean-token-mean divides each sequence's sum by (|y| + 1e-8), up to
1e-8 relative per sequence (|y| = 1), so there the bound is 2e-8 * (1 + |verl|) (absolute as well: a loss
summing terms of both signs can be much smaller than its terms, which are of order 1 here; measured 3e-9).
verl computes GDPO and the share of rejected responses in float32 whatever its inputs, and GPG's scale
B / #{r != 0} too: those agree to float32 (TOL_GDPO, IN_FLOAT32, 2^-23 for GPG).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridflow import policy_losses
from hybridflow.algos import (
    AGG_MODES,
    compute_gdpo_advantages,
    compute_gpg_advantages,
    compute_grpo_passk_advantages,
    compute_opo_advantages,
    compute_optimal_token_baseline_advantages,
    compute_reinforce_plus_plus_advantages,
    compute_reinforce_plus_plus_baseline_advantages,
    compute_remax_advantages,
    compute_rloo_advantages,
    divided_by_mean,
    gspo_policy_loss,
    pf_ppo_weights,
    rollout_rejection,
    rollout_weights,
    scores_to_token_rewards,
    weight_mean_terms,
)
from hybridflow.api.spec import RejectionRule
from tests.helpers import unavailable

ORACLE = Path(__file__).resolve().parent / "oracle"
SEEDS = range(5)
RTOL, ATOL = 1e-8, 1e-9
TOL_SEQ_MEAN_TOKEN_MEAN = 5e-8
"""verl divides each sequence's sum by its length + 1e-8: a relative 1e-8 on every sequence's loss, which SAPO's
gate (4 / tau, times advantages up to ~3) makes a few 1e-8 of the aggregate."""
GDPO_WEIGHTS = [1.0, 0.5, 2.0]
TOL_GDPO = 2e-6
"""verl's GDPO casts the components to float32 and computes in it (measured up to 2.0e-7 apart)."""
IN_FLOAT32 = {"rollout_rejected_seq_frac"}
"""Results verl rounds to float32 whatever its inputs (the share of rejected responses: `seq_has_masked.float()`)."""
BATCH, TOKENS = 18, 7
HORIZON = 11
"""seq-mean-token-sum-norm's constant (verl's loss_scale_factor), apart from the width TOKENS verl takes without it."""
GROUP_SIZES = (4, 5, 1, 6, 2)  # a lone sample included: verl gives it no baseline, and so does hybridflow


def oracle_python() -> str:
    try:
        built = subprocess.run(["bash", str(ORACLE / "setup-verl-oracle.sh")], capture_output=True, text=True,
                               timeout=1800)
    except subprocess.TimeoutExpired:
        unavailable("building the verl oracle environment took over 30 minutes")
    if built.returncode != 0:
        unavailable(f"could not build the verl oracle environment (tests/oracle/setup-verl-oracle.sh):\n"
                    f"{built.stderr[-3000:]}")
    return built.stdout.strip().splitlines()[-1]


def run_oracle(cases: list[dict[str, Any]]) -> dict[str, Any]:
    python = oracle_python()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    done = subprocess.run([python, str(ORACLE / "verl_oracle.py")], input=json.dumps({"cases": cases}),
                          capture_output=True, text=True, timeout=600, env=env, cwd=ORACLE)
    assert done.returncode == 0, done.stderr[-5000:]
    return json.loads(done.stdout)


# -- inputs ------------------------------------------------------------------------------------------


def batch(seed: int) -> dict[str, Any]:
    """Right-padded responses of random lengths in groups of GROUP_SIZES (shuffled), one score each."""
    g = torch.Generator().manual_seed(seed)
    index = torch.cat([torch.full((n,), i) for i, n in enumerate(GROUP_SIZES)])[torch.randperm(BATCH, generator=g)]
    lengths = torch.randint(1, TOKENS + 1, (BATCH,), generator=g)
    mask = (torch.arange(TOKENS)[None, :] < lengths[:, None]).double()
    # Binary task scores with some real-valued ones, so groups have ties and spread alike.
    scores = torch.where(torch.rand(BATCH, generator=g) < 0.7, torch.randint(0, 2, (BATCH,), generator=g).double(),
                         torch.randn(BATCH, generator=g, dtype=torch.float64))
    return {"index": index, "mask": mask, "scores": scores, "gen": g}


def dense_rewards(b: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards (a score minus a KL term on every token) and a mask with a hole inside some responses."""
    g = b["gen"]
    mask = b["mask"].clone()
    hole = torch.rand(BATCH, generator=g) < 0.3
    mask[hole, 1] = 0.0  # a masked token inside a response (an observation span in multi-turn rollouts)
    rewards = scores_to_token_rewards(b["scores"], b["mask"]) - 0.05 * torch.rand(BATCH, TOKENS, generator=g,
                                                                                  dtype=torch.float64)
    return rewards, mask


def policy_inputs(b: dict[str, Any], per_token_adv: bool) -> dict[str, torch.Tensor]:
    g = b["gen"]
    old = -3.0 * torch.rand(BATCH, TOKENS, generator=g, dtype=torch.float64)
    new = old + 0.1 * torch.randn(BATCH, TOKENS, generator=g, dtype=torch.float64)
    adv = torch.randn(BATCH, TOKENS if per_token_adv else 1, generator=g, dtype=torch.float64)
    return {"old_log_probs": old, "log_probs": new, "advantages": adv.expand(BATCH, TOKENS) if per_token_adv
            else adv.squeeze(-1)}


def as_lists(x: Any) -> Any:
    return x.tolist() if isinstance(x, torch.Tensor) else x


# -- the cases: what verl is asked, and what hybridflow answers ----------------------------------------

Ours = Callable[[], dict[str, Any]]


def make_cases() -> list[tuple[dict[str, Any], Ours]]:
    cases: list[tuple[dict[str, Any], Ours]] = []
    for seed in SEEDS:
        b = batch(seed)
        mask, index, scores = b["mask"], b["index"], b["scores"]
        outcome = scores_to_token_rewards(scores, mask)
        ids = [f"prompt-{int(i)}" for i in index]
        seq = (outcome * mask).sum(-1)
        cases.append((
            {"kind": "rloo", "token_rewards": outcome, "mask": mask, "index": ids},
            lambda seq=seq, ids=ids, mask=mask: {"advantages": compute_rloo_advantages(seq, ids).unsqueeze(-1) * mask},
        ))
        cases.append((
            {"kind": "reinforce_plus_plus_baseline", "token_rewards": outcome, "mask": mask, "index": ids},
            lambda seq=seq, ids=ids, mask=mask: {
                "advantages": compute_reinforce_plus_plus_baseline_advantages(seq, ids, mask)},
        ))
        cases.append((
            {"kind": "opo", "token_rewards": outcome, "mask": mask, "index": ids},
            lambda seq=seq, ids=ids, mask=mask: {
                "advantages": compute_opo_advantages(seq, ids, mask.sum(-1)).unsqueeze(-1) * mask},
        ))
        pairs = index != GROUP_SIZES.index(1)  # verl refuses a Pass@k group of one, as hybridflow does
        kept = [i for i, p in zip(ids, pairs.tolist(), strict=True) if p]
        for normalize in (True, False):
            cases.append((
                {"kind": "grpo_passk", "token_rewards": outcome[pairs], "mask": mask[pairs], "index": kept,
                 "normalize": normalize},
                lambda seq=seq[pairs], kept=kept, mask=mask[pairs], normalize=normalize: {
                    "advantages": compute_grpo_passk_advantages(seq, kept, normalize_std=normalize).unsqueeze(-1)
                    * mask},
            ))
        components = torch.stack([scores[pairs].double(), torch.rand(int(pairs.sum()), generator=b["gen"]).double(),
                                  torch.randn(int(pairs.sum()), generator=b["gen"]).double()])
        for normalize in (True, False):  # a lone sample left out: verl gives it its score, hybridflow 0 (GRPO)
            cases.append((
                {"kind": "gdpo", "components": components, "weights": GDPO_WEIGHTS, "mask": mask[pairs],
                 "index": kept, "normalize": normalize},
                lambda components=components, kept=kept, mask=mask[pairs], normalize=normalize: {
                    "advantages": compute_gdpo_advantages(components, GDPO_WEIGHTS, kept, mask, normalize)},
            ))
        rewards, holed = dense_rewards(b)
        greedy = torch.where(torch.rand(BATCH, generator=b["gen"]) < 0.5, 1.0, 0.0).double()

        def rmx(rewards: torch.Tensor = rewards, greedy: torch.Tensor = greedy, mask: torch.Tensor = mask
                ) -> dict[str, Any]:
            adv, ret = compute_remax_advantages(rewards * mask, greedy, mask)
            return {"advantages": adv, "returns": ret}

        cases.append(({"kind": "remax", "token_rewards": rewards * mask, "baselines": greedy, "mask": mask}, rmx))
        cases.append((
            {"kind": "gpg_advantages", "token_rewards": outcome, "mask": mask, "index": ids},
            lambda seq=seq, ids=ids, mask=mask: {"advantages": compute_gpg_advantages(seq, ids).unsqueeze(-1) * mask},
        ))
        cases.extend(optimal_token_baseline_cases(b, rewards, ids))
        for method, power in (("pow", 2.0), ("pow", 0.5), ("max_min", 1.0), ("max_random", 1.0)):
            cases.append((
                {"kind": "pf_ppo", "token_scores": outcome, "method": method, "power": power, "seed": seed},
                lambda scores=scores, method=method, power=power, seed=seed: {"rows": torch.multinomial(
                    pf_ppo_weights(scores, method, power), BATCH, replacement=True,
                    generator=torch.Generator().manual_seed(seed)).double()},
            ))
        gamma = (1.0, 0.95, 0.5, 0.99, 1.0)[seed]
        cases.extend(rollout_is_cases(b))

        def rpp(rewards: torch.Tensor = rewards, holed: torch.Tensor = holed, gamma: float = gamma) -> dict[str, Any]:
            adv, ret = compute_reinforce_plus_plus_advantages(rewards, holed, gamma)
            return {"advantages": adv, "returns": ret}

        cases.append(({"kind": "reinforce_plus_plus", "token_rewards": rewards, "mask": holed, "gamma": gamma}, rpp))
        for agg in AGG_MODES:
            for per_token_adv in (False, True):
                cases.append(policy_loss_case("gspo", policy_inputs(b, per_token_adv), mask, agg, 0.02, 0.03))
        for mode in ("cispo", "gpg", "clip_cov", "kl_cov"):
            for agg in ("token-mean", "seq-mean-token-sum-norm"):
                cases.append(policy_loss_case(mode, policy_inputs(b, per_token_adv=True), mask, agg, 0.1, 0.15))
        for mode in ("dppo_tv", "dppo_kl", "dro"):
            for agg in ("token-mean", "seq-mean-token-sum-norm"):
                cases.append(policy_loss_case(mode, policy_inputs(b, per_token_adv=True), mask, agg, 0.004, 0.006))
        # verl's SAPO always aggregates with seq-mean-token-mean, and GMPO averages over sequences whatever the mode
        cases.append(policy_loss_case("sapo", policy_inputs(b, per_token_adv=True), mask, "seq-mean-token-mean", 0, 0))
        cases.append(policy_loss_case("geo_mean", policy_inputs(b, per_token_adv=False), mask, "token-mean", 0.1, 0.15))
    return cases


def optimal_token_baseline_cases(b: dict[str, Any], rewards: torch.Tensor, ids: list[str]
                                  ) -> list[tuple[dict[str, Any], Ours]]:
    """Dense token rewards, each token's old log-prob and a sum of squared probabilities at least its square; with
    and without rollout weights."""
    g, mask = b["gen"], b["mask"]
    old = -3.0 * torch.rand(BATCH, TOKENS, generator=g, dtype=torch.float64)
    floor = old.exp().square()
    spp = floor + (1.0 - floor) * torch.rand(BATCH, TOKENS, generator=g, dtype=torch.float64)
    cases: list[tuple[dict[str, Any], Ours]] = []
    for weights in (None, 0.5 + torch.rand(BATCH, TOKENS, generator=g, dtype=torch.float64)):
        request = {"kind": "optimal_token_baseline", "token_rewards": rewards * mask, "mask": mask, "index": ids,
                   "old_log_probs": old, "sum_pi_squared": spp} | ({} if weights is None else {"weights": weights})
        cases.append((request, lambda r=request: {"advantages": compute_optimal_token_baseline_advantages(
            r["token_rewards"], r["mask"], r["index"], r["old_log_probs"], r["sum_pi_squared"], r.get("weights"))}))
    return cases


REJECTION_RULES = [[RejectionRule.model_validate(rule) for rule in rules] for rules in (
    [{"divergence": "token_k1", "threshold": 1.3, "lowerThreshold": 0.8}],
    [{"divergence": "token_k2", "threshold": 0.05}], [{"divergence": "token_k3", "threshold": 0.05}],
    [{"divergence": "seq_sum_k1", "threshold": 2.0, "lowerThreshold": 0.5}],
    [{"divergence": "seq_sum_k2", "threshold": 0.3}], [{"divergence": "seq_sum_k3", "threshold": 0.3}],
    [{"divergence": "seq_mean_k1", "threshold": 1.1}], [{"divergence": "seq_mean_k2", "threshold": 0.05}],
    [{"divergence": "seq_mean_k3", "threshold": 0.05}], [{"divergence": "seq_max_k2", "threshold": 0.15}],
    [{"divergence": "seq_max_k3", "threshold": 0.15}],
    [{"divergence": "token_k1", "threshold": 1.3, "lowerThreshold": 0.8},
     {"divergence": "seq_mean_k3", "threshold": 0.05}],
)]
"""Every divergence verl's rollout_rs offers, alone with bounds that reject some of these inputs, and two together."""


def verl_rs_threshold(rule: RejectionRule) -> str:
    """verl's rollout_rs_threshold entry: "lower_upper" for k1, else the upper bound."""
    lower, upper = rule.band()
    return str(upper) if lower is None else f"{lower}_{upper}"


def rejection(trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor,
              rules: list[RejectionRule]) -> dict[str, Any]:
    kept, metrics = rollout_rejection(trainer, engine, mask, [(r.divergence, *r.band()) for r in rules])
    return {"mask": kept} | metrics


def bypass_reinforce(current: torch.Tensor, engine: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                     level: str, upper: float, rules: list[RejectionRule], agg: str) -> dict[str, Any]:
    """A pass of the actor with bypass, importance weights and policyLoss gpg: weights and rejection on the
    log-probs being trained against the engine's (ActorRolloutWorker._rollout_gap), then REINFORCE weighed."""
    log_probs = current.clone().requires_grad_()
    weights, _ = rollout_weights(current, engine, mask, level, upper)
    kept = rejection(current, engine, mask, rules)["mask"] if rules else mask
    loss, _ = policy_losses.gpg_policy_loss(engine, log_probs, advantages, kept, agg=agg, weights=weights)
    loss.backward()
    return {"loss": loss.item(), "grad": log_probs.grad}


def normalized(weights: torch.Tensor, mask: torch.Tensor, level: str, normalize: bool) -> torch.Tensor:
    """The weights over their batch mean, as the actor divides them on a single rank."""
    if not normalize:
        return weights
    return divided_by_mean(weights, *weight_mean_terms(weights, mask, level))[0]


def rollout_is_cases(b: dict[str, Any]) -> list[tuple[dict[str, Any], Ours]]:
    """The trainer's and an engine's log-probs a little apart, weighed per token and per sequence, truncated (verl's
    threshold a number) and IcePop's band (verl's "lower_upper"), each also normalised to mean 1; rejected by each of
    REJECTION_RULES; and REINFORCE's loss weighed as bypass does it (verl's bypass loss_type reinforce)."""
    g, mask = b["gen"], b["mask"]
    trainer = -3.0 * torch.rand(BATCH, TOKENS, generator=g, dtype=torch.float64)
    engine = trainer + 0.3 * torch.randn(BATCH, TOKENS, generator=g, dtype=torch.float64)
    out: list[tuple[dict[str, Any], Ours]] = []
    for (level, upper, lower), normalize in itertools.product(
            (("token", 1.3, None), ("token", 1.3, 0.8), ("sequence", 2.0, None), ("sequence", 2.0, 0.5)),
            (False, True)):
        request = {"kind": "rollout_is", "trainer_log_probs": trainer, "rollout_log_probs": engine, "mask": mask,
                   "level": level, "threshold": upper if lower is None else f"{lower}_{upper}",
                   "normalize": normalize}
        out.append((request, lambda level=level, upper=upper, lower=lower, normalize=normalize: {
            "weights": normalized(rollout_weights(trainer, engine, mask, level, upper, lower)[0], mask, level,
                                  normalize)}))
    advantages = torch.randn(BATCH, TOKENS, generator=g, dtype=torch.float64)
    for (level, upper), rules, agg in itertools.product((("token", 1.3), ("sequence", 2.0)), ([], REJECTION_RULES[-1]),
                                                        ("token-mean", "seq-mean-token-mean")):
        request = {"kind": "bypass_reinforce", "log_probs": trainer, "rollout_log_probs": engine, "mask": mask,
                   "advantages": advantages, "level": level, "threshold": upper, "agg": agg} | ({
                       "options": ",".join(r.divergence for r in rules),
                       "thresholds": ",".join(verl_rs_threshold(r) for r in rules)} if rules else {})
        out.append((request, lambda level=level, upper=upper, rules=rules, agg=agg: bypass_reinforce(
            trainer, engine, advantages, mask, level, upper, rules, agg)))
    for rules in REJECTION_RULES:
        request = {"kind": "rollout_rs", "trainer_log_probs": trainer, "rollout_log_probs": engine, "mask": mask,
                   "options": ",".join(rule.divergence for rule in rules),
                   "thresholds": ",".join(verl_rs_threshold(rule) for rule in rules)}
        out.append((request, lambda rules=rules: rejection(trainer, engine, mask, rules)))
    return out


COVARIANCE = {"clip_cov": {"clip_cov_ratio": 1.0, "clip_cov_lb": 0.2, "clip_cov_ub": 2.0},
              "kl_cov": {"kl_cov_ratio": 0.25, "ppo_kl_coef": 0.5}, "dro": {"dro_beta": 0.3}}
"""verl's policy_loss settings: clip_cov cuts every candidate (a share of 1: none drawn at random, so the two sides
agree), kl_cov the quarter of the tokens of largest covariance; DRO's penalty weight."""
OURS: dict[str, Callable[..., tuple[torch.Tensor, dict[str, float]]]] = {
    "gspo": lambda args, low, high, **kw: gspo_policy_loss(*args, clip_low=low, clip_high=high, **kw),
    "cispo": lambda args, low, high, **kw: policy_losses.cispo_policy_loss(*args, clip_low=low, clip_high=high, **kw),
    "gpg": lambda args, low, high, **kw: policy_losses.gpg_policy_loss(*args, **kw),
    "sapo": lambda args, low, high, **kw: policy_losses.sapo_policy_loss(*args, tau_pos=1.0, tau_neg=1.3, **kw),
    "geo_mean": lambda args, low, high, agg, horizon: policy_losses.geo_mean_policy_loss(*args, clip_low=low,
                                                                                         clip_high=high),
    "clip_cov": lambda args, low, high, **kw: policy_losses.clip_cov_policy_loss(
        *args, clip_low=low, clip_high=high, share=1.0, lower=0.2, upper=2.0, **kw),
    "kl_cov": lambda args, low, high, **kw: policy_losses.kl_cov_policy_loss(*args, share=0.25, coef=0.5, **kw),
    "dppo_tv": lambda args, low, high, **kw: policy_losses.dppo_policy_loss(*args, "tv", low=low, high=high,
                                                                            truncate=1.05, **kw),
    "dppo_kl": lambda args, low, high, **kw: policy_losses.dppo_policy_loss(*args, "kl", low=low, high=high,
                                                                            truncate=1.05, **kw),
    "dro": lambda args, low, high, **kw: policy_losses.dro_policy_loss(*args, beta=0.3, **kw),
}
"""hybridflow's side of each loss mode, with the settings COVARIANCE gives verl."""
FRACTIONS = {"gspo": "clip_frac", "cispo": "clip_frac", "clip_cov": "cov_frac", "dppo_tv": "clip_frac",
             "dppo_kl": "clip_frac"}
ACTOR = {"sapo": {"tau_pos": 1.0, "tau_neg": 1.3}, "dppo_tv": {"clip_ratio_c": 1.05}, "dppo_kl": {"clip_ratio_c": 1.05}}
"""verl's actor settings per mode: SAPO's temperatures; DPPO's truncation of the ratio, low enough to bite here."""


def policy_loss_case(mode: str, x: dict[str, torch.Tensor], mask: torch.Tensor, agg: str, low: float,
                     high: float) -> tuple[dict[str, Any], Ours]:
    """verl's request for loss_mode `mode` and hybridflow's answer: the loss, its gradient in the log-probs and
    the fraction verl reports as actor/pg_clipfrac."""
    horizon = HORIZON if agg == "seq-mean-token-sum-norm" else None

    def ours() -> dict[str, Any]:
        log_probs = x["log_probs"].clone().requires_grad_()
        args = (x["old_log_probs"], log_probs, x["advantages"], mask)
        loss, metrics = OURS[mode](args, low, high, agg=agg, horizon=horizon)
        loss.backward()
        return {"loss": loss.item(), "grad": log_probs.grad} | (
            {FRACTIONS[mode]: metrics[FRACTIONS[mode]]} if mode in FRACTIONS else {})

    advantages = x["advantages"] if x["advantages"].dim() == 2 else x["advantages"].unsqueeze(-1).expand(BATCH, TOKENS)
    request = {"kind": mode, "old_log_probs": x["old_log_probs"], "log_probs": x["log_probs"],
               "advantages": advantages, "mask": mask, "agg": agg, "clip_low": low, "clip_high": high}
    return request | ({"horizon": horizon} if horizon else {}) | (
        {"cov": COVARIANCE[mode]} if mode in COVARIANCE else {}) | (
        {"actor": ACTOR[mode]} if mode in ACTOR else {}), ours


@pytest.fixture(scope="module")
def compared() -> list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]:
    cases = make_cases()
    requests = [{k: as_lists(v) for k, v in request.items()} for request, _ in cases]
    answer = run_oracle(requests)
    assert answer["verl"], answer
    return [(request, ours(), theirs) for (request, ours), theirs in zip(cases, answer["results"], strict=True)]


@pytest.mark.parametrize("kind", ["rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "opo", "grpo_passk",
                                  "remax", "gdpo", "gpg_advantages", "optimal_token_baseline", "pf_ppo", "rollout_is",
                                  "rollout_rs", "bypass_reinforce", "gspo", "cispo", "gpg", "sapo", "geo_mean",
                                  "clip_cov", "kl_cov", "dppo_tv", "dppo_kl", "dro"])
def test_agrees_with_verl(compared: list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]], kind: str) -> None:
    checked = 0
    for request, ours, theirs in compared:
        if request["kind"] != kind:
            continue
        for key, expected in theirs.items():
            actual = torch.as_tensor(ours[key], dtype=torch.float64)
            loose = request.get("agg") == "seq-mean-token-mean"
            rtol, atol = (TOL_SEQ_MEAN_TOKEN_MEAN,) * 2 if loose else (RTOL, ATOL)
            if key in IN_FLOAT32:
                rtol, atol = 2.0 ** -23, 0.0
            if request["kind"] == "gdpo":
                rtol, atol = TOL_GDPO, TOL_GDPO
            if request["kind"] == "gpg_advantages":
                rtol, atol = 2.0 ** -23, ATOL
            torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=torch.float64), rtol=rtol, atol=atol,
                                       msg=lambda m, key=key, req=request: f"{kind} {key} "
                                       f"(agg={req.get('agg')}, gamma={req.get('gamma')}): {m}")
            checked += 1
    assert checked >= len(SEEDS)


def test_the_gspo_cases_clip_some_sequences_and_not_others(
    compared: list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]],
) -> None:
    """Otherwise agreement would say nothing about the clipping."""
    fractions = [theirs["clip_frac"] for request, _, theirs in compared if request["kind"] == "gspo"]
    assert all(0.0 < f < 1.0 for f in fractions), fractions


@pytest.mark.parametrize("mode", ["dppo_tv", "dppo_kl"])
def test_the_dppo_cases_leave_some_tokens_outside_the_trust_region_and_not_others(
    compared: list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]], mode: str,
) -> None:
    fractions = [theirs["clip_frac"] for request, _, theirs in compared if request["kind"] == mode]
    assert fractions and all(0.0 < f < 1.0 for f in fractions), fractions


def test_each_rejection_case_drops_some_responses_and_keeps_others(
    compared: list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]],
) -> None:
    """Otherwise agreement would say nothing about the bounds."""
    fractions = {request["options"]: theirs["rollout_rejected_seq_frac"] for request, _, theirs in compared
                 if request["kind"] == "rollout_rs"}
    assert len(fractions) == len(REJECTION_RULES) and all(0.0 < f < 1.0 for f in fractions.values()), fractions


def test_the_covariance_cases_cut_some_tokens_and_not_others(
    compared: list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]],
) -> None:
    """clip_cov's candidates lie between the bounds: some tokens, not all, so the cut is what agrees."""
    fractions = [theirs["cov_frac"] for request, _, theirs in compared if request["kind"] == "clip_cov"]
    assert fractions and all(0.0 < f < 0.5 for f in fractions), fractions
