"""From scored rollouts to advantages: the controller's only math, pure on tensors."""

from __future__ import annotations

import torch

from hybridflow import algos
from hybridflow.api.spec import RLTrainingJobSpec
from hybridflow.rollout_correction import corrected
from hybridflow.workers.batch import RolloutBatch, extra_means, reward_number


def compute_advantages(batch: RolloutBatch, spec: RLTrainingJobSpec, kl_coef: float) -> dict[str, float]:
    """Token rewards (score on the last token, minus beta*KL when mode=reward), then the algorithm's estimator;
    `kl` is the batch's mean KL of the old policy to the reference.

    ppo: GAE on the critic's values; grpo, rloo, reinforce_plus_plus_baseline, opo, grpo_passk: one advantage
    per sequence from its group (the sum of its token rewards against the other samples of its prompt), on every
    valid token; reinforce_plus_plus: discounted per-token returns, whitened over the batch; remax: the returns
    less the reward of the prompt's greedy response (`reward_baselines`, scored by the reward step); gdpo: the
    reward function's components (algorithm.gdpo.rewardKeys) group-normalised one by one, summed and whitened; gpg:
    the group mean as baseline, scaled by the batch's share of non-zero scores; optimal_token_baseline: the returns
    less a baseline for each position of the group, weighted by the old log-probs' score norms (`sum_pi_squared`)
    and the rollout correction's weights, over the tokens its rejection keeps.
    """
    algo = spec.algorithm
    mask = batch.response_mask.float()
    scores = batch.tensors["scores"]
    token_rewards = algos.scores_to_token_rewards(scores, mask)
    out: dict[str, float] = {}
    # without old log-probs the update scores them and measures the KL (plan.old_log_probs_from_update)
    if "ref_log_probs" in batch.tensors and (algo.kl_penalty.mode == "reward" or "old_log_probs" in batch.tensors):
        old, ref = batch.tensors["old_log_probs"], batch.tensors["ref_log_probs"]
        if algo.kl_penalty.mode == "reward":
            token_rewards, kl = algos.apply_kl_to_rewards(token_rewards, old, ref, mask, kl_coef, algo.kl_penalty.type)
        else:
            kl = float(algos.masked_mean(algos.kl_penalty(old, ref, algo.kl_penalty.type), mask))
        out["kl"] = float(kl)
    seq = (token_rewards * mask).sum(-1)
    if algo.name == "ppo":
        adv, ret = algos.compute_gae(token_rewards, batch.tensors["values"], mask, algo.gamma, algo.lam)
        if algo.normalize_advantages:
            adv = algos.masked_whiten(adv, mask)
        batch.tensors["returns"] = ret
        out["value_mean"] = float(algos.masked_mean(batch.tensors["values"], mask))
    elif algo.name == "reinforce_plus_plus":
        adv, _ = algos.compute_reinforce_plus_plus_advantages(token_rewards, mask, algo.gamma,
                                                              whiten=algo.normalize_advantages)
    elif algo.name == "reinforce_plus_plus_baseline":
        adv = algos.compute_reinforce_plus_plus_baseline_advantages(seq, batch.group_ids, mask,
                                                                    whiten=algo.normalize_advantages)
    elif algo.name == "rloo":
        adv = algos.compute_rloo_advantages(seq, batch.group_ids).unsqueeze(-1) * mask
    elif algo.name == "opo":
        adv = algos.compute_opo_advantages(seq, batch.group_ids, mask.sum(-1)).unsqueeze(-1) * mask
    elif algo.name == "grpo_passk":
        adv = algos.compute_grpo_passk_advantages(seq, batch.group_ids, normalize_std=algo.normalize_advantages)
        adv = adv.unsqueeze(-1) * mask
    elif algo.name == "gdpo":
        assert algo.gdpo is not None  # the spec requires it
        adv = algos.compute_gdpo_advantages(reward_components(batch, algo.gdpo.reward_keys), algo.gdpo.weights(),
                                            batch.group_ids, mask, normalize_std=algo.normalize_advantages)
    elif algo.name == "gpg":
        adv = algos.compute_gpg_advantages(seq, batch.group_ids).unsqueeze(-1) * mask
    elif algo.name == "optimal_token_baseline":
        adv = optimal_token_baseline(batch, token_rewards, mask, spec)
    elif algo.name == "remax":
        baselines = batch.tensors["reward_baselines"]
        adv, _ = algos.compute_remax_advantages(token_rewards, baselines, mask)
        out["reward_baseline_mean"] = float(baselines.mean())
    else:
        adv = algos.compute_grpo_advantages(seq, batch.group_ids, normalize_std=algo.normalize_advantages)
        adv = adv.unsqueeze(-1) * mask
    batch.tensors["advantages"] = adv
    out["advantage_abs_mean"] = float(algos.masked_mean(adv.abs(), mask))
    return out


def optimal_token_baseline(batch: RolloutBatch, token_rewards: torch.Tensor, mask: torch.Tensor,
                           spec: RLTrainingJobSpec) -> torch.Tensor:
    """compute_optimal_token_baseline_advantages on the batch; with rolloutCorrection, its weights and kept tokens
    (as verl, which corrects the batch before its advantages)."""
    old = batch.tensors["old_log_probs"]
    weights = None
    if "rollout_log_probs" in batch.tensors:
        weights, kept, _ = corrected(spec.algorithm.rollout_correction, old, batch.tensors["rollout_log_probs"], mask)
        mask = mask if kept is None else kept
    return algos.compute_optimal_token_baseline_advantages(token_rewards, mask, batch.group_ids, old,
                                                           batch.tensors["sum_pi_squared"], weights)


def policy_filtered(batch: RolloutBatch, spec: RLTrainingJobSpec) -> RolloutBatch:
    """spec.algorithm.policyFiltration: len(batch) rows drawn with replacement by pf_ppo_weights of their scores,
    by a generator seeded from trainer.seed and the batch's policy version (the same draw on a resumed run)."""
    rule = spec.algorithm.policy_filtration
    assert rule is not None
    weights = algos.pf_ppo_weights(batch.tensors["scores"].double(), rule.reweight_method, rule.weight_pow)
    draw = torch.Generator().manual_seed(spec.trainer.seed * 1_000_003 + batch.policy_version)
    return batch.slice_index(torch.multinomial(weights, len(batch), replacement=True, generator=draw))


def reward_components(batch: RolloutBatch, keys: list[str]) -> torch.Tensor:
    """The reward function's numbers under `keys`, [K, B] (see reward_number)."""
    return torch.stack([reward_number(batch.tensors, key, "algorithm.gdpo.rewardKeys") for key in keys])


def batch_stats(batch: RolloutBatch) -> dict[str, float]:
    """What a step record needs from a scored batch, so the batch itself need not travel."""
    scores = batch.tensors["scores"]
    lengths = batch.response_mask.float().sum(-1)
    return {"reward_mean": float(scores.mean()), "reward_max": float(scores.max()),
            "tokens": float(lengths.sum()), "response_length": float(lengths.mean()),
            "policy_version": float(batch.policy_version), "size": float(len(batch))} | extra_means([batch.tensors])
