"""Actor/rollout and reference roles: plain Python objects; the scheduler hosts them in Ray actors."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import Any

import torch

from hybridflow import algos, policy_losses
from hybridflow.api.spec import RLTrainingJobSpec
from hybridflow.plan import (
    SP_FIELDS,
    STEP_OF_ROLE,
    old_log_probs_from_rollout,
    old_log_probs_from_update,
    optimizer_steps,
    policy_copy_read_between_updates,
)
from hybridflow.rollout_correction import corrected
from hybridflow.workers import distributed
from hybridflow.workers.batch import PolicyVersionError, RolloutBatch, first_of_each_group
from hybridflow.workers.decoding import Sampling
from hybridflow.workers.footprint import training_footprint
from hybridflow.workers.lr_schedule import learning_rate
from hybridflow.workers.modeling import (
    TokenStat,
    check_model_dir,
    for_reduction,
    in_micro_batches,
    load_causal_lm,
    load_policy,
    load_policy_weights,
    load_tokenizer,
    policy_weights,
    response_log_probs,
    token_log_probs,
    token_stat,
)
from hybridflow.workers.optim import train_epochs
from hybridflow.workers.rollout import make_rollout
from hybridflow.workers.training import RoleTraining
from hybridflow.workers.ulysses import SequenceParallel, forward_tokens


def policy_log_probs(module: torch.nn.Module, sp: SequenceParallel, batch: RolloutBatch, device: torch.device,
                     stat: TokenStat | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`response_log_probs`, split over this rank's SP group when SP is on: each rank scores the next token at
    its 1/P of the positions, and only that [B, S, 2] table of log-prob and `stat` is gathered, never the
    [B, S, vocab] logits. A rank's LM head runs only on its positions that predict a response token."""
    if sp.group() is None:
        return response_log_probs(module, batch, device, stat)
    ids, mask = batch.input_ids.to(device), batch.attention_mask.to(device)
    labels = torch.cat([ids[:, 1:], ids.new_zeros(ids.shape[0], 1)], dim=1)  # the token each position predicts
    # > 0 at the positions P-1 .. S-1, cut like the sequence; the padding SP appends is 0
    predicts = (torch.arange(ids.shape[1], device=device) - batch.prompt_length + 2).expand_as(ids)

    def scores(part: torch.Tensor, _mask: None, positions: torch.Tensor, targets: torch.Tensor,
               wanted: torch.Tensor) -> torch.Tensor:
        keep = (wanted[0] > 0).nonzero().squeeze(-1)
        logits = for_reduction(module(input_ids=part, position_ids=positions, use_cache=False,
                                      logits_to_keep=keep).logits)
        logp = token_log_probs(logits, targets.index_select(1, keep))
        kept = torch.stack([logp, token_stat(logits, stat) if stat else torch.zeros_like(logp)], -1)
        return kept.new_zeros(*part.shape, 2).index_copy(1, keep, kept)

    table = forward_tokens(scores, sp, ids, mask, (labels, predicts), module)[:, batch.prompt_length - 1:-1]
    return table[..., 0], (table[..., 1] if stat else None)


def _as_table(scored: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
    """A pass's log-probs, [B, R], or with its TokenStat as a second column, [B, R, 2]: in_micro_batches carries
    them together like any per-token score."""
    logp, stat = scored
    return logp if stat is None else torch.stack([logp, stat], -1)


def _product(weights: list[torch.Tensor]) -> torch.Tensor | None:
    """The per-token weights together (None: none)."""
    return math.prod(weights[1:], start=weights[0]) if weights else None


class ActorRolloutWorker:
    """The policy: generates rollouts, scores old log-probs, and takes PPO steps.

    `version` counts updates. With `lag` 0 every batch it trains on must carry that version; with lag 1
    (consistency eventual) generation runs a copy of the policy that the control edge's sync refreshes, so a
    batch may come from the version before: its old log-probs are then the generating policy's, and the
    update corrects for it as decoupled PPO does (`_decouple`). Where `plan.old_log_probs_from_update` holds,
    the update takes them from its own forward pass and reports the batch's KL to the reference itself. With
    spec.model.policy.lora the module carries adapters and the optimizer holds only their parameters. The
    training passes run sequence-parallel when spec.model.policy.sequenceParallel is above 1; `shuffle_seed`
    (default `seed`) must then be the same on the ranks of a group, so that they cut the same minibatches.
    `scored` (StepPlan.scored) holding old_log_probs: every rank scores them at once, with the trained module.
    """

    def __init__(self, spec: RLTrainingJobSpec, device: torch.device, seed: int = 0, lag: int = 0,
                 shuffle_seed: int | None = None, scored: tuple[str, ...] = ()) -> None:
        self.spec, self.device, self.lag = spec, device, lag
        self.path = check_model_dir(spec.model.policy.path, "spec.model.policy.path")
        self.tokenizer = load_tokenizer(self.path)
        if spec.data.truncation != "error":  # else the controller has refused any prompt that would be cut
            self.tokenizer.truncation_side = spec.data.truncation
        self.model = load_policy(spec.model.policy, device)
        self.training = RoleTraining(self.model, lr=spec.trainer.actor_lr, options=spec.trainer.training,
                                     device=device, keep_copy=policy_copy_read_between_updates(spec, lag, scored),
                                     weight_decay=spec.trainer.optimizer.weight_decay)
        self.old_in_step = STEP_OF_ROLE["actor_rollout"].name in scored
        self.rollout = make_rollout(
            spec.rollout.engine, self.model, self.path, self.tokenizer, spec.rollout,
            spec.data.max_prompt_length, spec.data.max_response_length, device, spec.model.policy.dtype, seed,
            own_copy=lag > 0,
        )
        self.behaviour = getattr(self.rollout, "model", self.model)
        """The module that generates: old log-probs are its own, the policy the samples came from."""
        self.eval_sampling = Sampling.for_eval(spec.trainer.eval, spec.rollout)
        self.version = 0
        self.old_from_update = old_log_probs_from_update(spec, lag)
        self.gap_per_pass = self.old_from_update or old_log_probs_from_rollout(spec)
        """Whether each pass measures the engine's gap on its own log-probs: the update's are the old ones, or the
        engine's are (bypass: rejection then bounds the drift since sampling)."""
        self.shuffle = torch.Generator().manual_seed(seed if shuffle_seed is None else shuffle_seed)
        self.sp = SequenceParallel.for_model(spec.model.policy.sequence_parallel, self.model.config,
                                             SP_FIELDS["actor_rollout"])
        if lag:  # the copy starts as the policy's (a LoRA policy's merged weights under its base's names)
            self.rollout.sync_weights(self.model, 0)

    def generating_version(self) -> int:
        """The version the rollout engine holds, at most `lag` updates behind; else the sync is missing."""
        held = self.rollout.version
        if not 0 <= self.version - held <= self.lag:
            raise PolicyVersionError(
                f"the rollout engine holds policy version {held} and the actor is at version {self.version}; "
                f"consistency allows a lag of {self.lag}: the control edge's weight sync must come first")
        return held

    def generate(self, rows: list[dict[str, str]], group_ids: list[int]) -> RolloutBatch:
        """The samples; for remax also each prompt's greedy response (`RolloutBatch.baselines`, its tokens in
        `baseline_lengths`), by the same policy version, generated once per group. With rolloutCorrection.bypass
        the engine's log-probs are the old ones."""
        version = self.generating_version()
        if self.spec.algorithm.name != "remax":
            batch = self.rollout.generate(rows, group_ids, version)
        else:
            first = first_of_each_group(group_ids)
            with self.rollout.awake():
                batch = self.rollout.generate(rows, group_ids, version)
                greedy = self.rollout.generate([rows[i] for i in first.values()], list(first), version,
                                               Sampling(0.0))
            answer = dict(zip(first, greedy.responses, strict=True))
            length = dict(zip(first, greedy.response_mask.sum(-1).tolist(), strict=True))
            batch.baselines = [answer[g] for g in group_ids]
            batch.tensors["baseline_lengths"] = torch.tensor([length[g] for g in group_ids])
            batch.add_timing("generate_baseline", greedy.timings["generate"])
        if old_log_probs_from_rollout(self.spec):
            batch.tensors["old_log_probs"] = batch.tensors["rollout_log_probs"]
        return batch

    def evaluate(self, rows: list[dict[str, str]], group_ids: list[int], seed: int) -> RolloutBatch:
        """Responses to val prompts with spec.trainer.eval's sampling; the weights, the version and the
        process's random state stay as they were, so training goes on as if nothing had run."""
        return self.rollout.generate(rows, group_ids, self.generating_version(), self.eval_sampling, seed)

    @torch.no_grad()
    def old_log_probs(self, batch: RolloutBatch) -> RolloutBatch:
        """log pi_behaviour of the response tokens, by the module and version that generated them; scored by
        every rank at once (`old_in_step`, on lag 0), by the trained module: its shards while the copy is
        released. Where the advantages take sum_v pi_v^2 (Algorithm.needs_sum_pi_squared), the same pass scores
        it (`sum_pi_squared`)."""
        t0 = time.perf_counter()
        held = self.rollout.version
        if batch.policy_version != held:
            raise PolicyVersionError(f"batch generated by policy version {batch.policy_version}, the rollout "
                                     f"engine holds version {held}")
        stat: TokenStat | None = "sum_pi_squared" if self.spec.algorithm.needs_sum_pi_squared else None
        if self.old_in_step:
            table = self._log_probs_in_step(batch, self.training.current, self.training.released, stat)
        else:
            self.behaviour.eval()
            table = in_micro_batches(batch, self.spec.trainer.training, lambda mb: _as_table(
                response_log_probs(self.behaviour, mb, self.device, stat))).cpu()
        if stat:
            batch.tensors["old_log_probs"], batch.tensors[stat] = (c.contiguous() for c in table.unbind(-1))
        else:
            batch.tensors["old_log_probs"] = table
        batch.add_timing("old_log_probs", time.perf_counter() - t0)
        return batch

    def _log_probs_in_step(self, batch: RolloutBatch, module: torch.nn.Module, sharded: bool,
                           stat: TokenStat | None = None) -> torch.Tensor:
        """log pi of the response tokens by `module` (with `stat`: `_as_table`), scored by every rank at once:
        sequence-parallel when SP is on, and, when `module` is sharded, in as many passes as the rank with the most
        needs."""
        was_training = module.training
        module.eval()
        table = in_micro_batches(batch, self.spec.trainer.training,
                                 lambda mb: _as_table(policy_log_probs(module, self.sp, mb, self.device, stat)),
                                 sharded_on=self.device if sharded else None)
        module.train(was_training)
        return table.cpu()

    def _lag_of(self, batch: RolloutBatch) -> int:
        """Updates between the batch's policy and this one; more than `lag` (or a future one) is refused."""
        lag = self.version - batch.policy_version
        if not 0 <= lag <= self.lag:
            allowed = "the same version" if self.lag == 0 else f"at most {self.lag} versions behind"
            raise PolicyVersionError(f"batch generated by policy version {batch.policy_version}, actor is at "
                                     f"version {self.version}; consistency allows {allowed}")
        return lag

    def update(self, batch: RolloutBatch, kl_coef: float) -> dict[str, float]:
        """PPO epochs over minibatches: loss = clipped surrogate (per-token ratio, or GSPO's sequence ratio when
        policyLoss is gspo) - c_H * H + [beta * KL if mode=loss]. Rollout gets the result only through
        `sync_rollout` (the control edge)."""
        lag = self._lag_of(batch)
        if self.version < self.spec.trainer.critic_warmup_steps:
            return self._frozen_step(lag)
        algo = self.spec.algorithm
        horizon = self.spec.data.max_response_length
        gap = {} if self.gap_per_pass else self._rollout_gap(
            batch, batch.tensors["old_log_probs"], batch.response_mask.float(), over_ranks=True)
        if "rollout_mask" in batch.tensors:  # a copy: the batch the critic trains on keeps every token
            kept = batch.tensors.pop("rollout_mask") > 0
            batch = dataclasses.replace(batch, response_mask=kept.to(batch.response_mask.dtype),
                                        tensors=dict(batch.tensors))
        if lag:
            self._decouple(batch)

        def loss_fn(mb: RolloutBatch) -> tuple[torch.Tensor, dict[str, float]]:
            logp, ent = policy_log_probs(self.training.module, self.sp, mb, self.device,
                                         "entropy_loss" if algo.entropy_coef > 0 else "entropy")
            assert ent is not None
            m = mb.response_mask.float().to(self.device)
            old = logp.detach() if self.old_from_update else mb.tensors["old_log_probs"].to(self.device)
            pass_gap = self._rollout_gap(mb, logp.detach(), m, over_ranks=False) if self.gap_per_pass else {}
            if "rollout_mask" in mb.tensors:  # known only now: the pass's share (micro_weight) counts every token
                m = mb.tensors["rollout_mask"].to(m)
            adv = mb.tensors["advantages"].to(self.device)
            w = _product([mb.tensors[k].to(self.device) for k in ("behaviour_weights", "rollout_weights")
                          if k in mb.tensors])
            loss, metrics = self._policy_loss(old, logp, adv, m, w)
            metrics |= pass_gap
            if "behaviour_weights" in mb.tensors:
                metrics["behaviour_weight_mean"] = algos.masked_mean(mb.tensors["behaviour_weights"].to(m), m).item()
            entropy = algos.agg_loss(ent, m, algo.loss_agg, horizon)
            total = loss - algo.entropy_coef * entropy
            if "ref_log_probs" in mb.tensors:
                token_kl = algos.kl_penalty(logp, mb.tensors["ref_log_probs"].to(self.device), algo.kl_penalty.type)
                if self.old_from_update:  # what compute_advantages measures from the old log-probs otherwise
                    metrics["kl"] = algos.masked_mean(token_kl.detach(), m).item()
                if algo.kl_penalty.mode == "loss":
                    kl = algos.agg_loss(token_kl, m, algo.loss_agg, horizon)
                    total = total + kl_coef * kl
                    metrics["kl_loss"] = kl.item()
            metrics.update(actor_loss=loss.item(), entropy=entropy.item())
            return total, metrics

        lr = learning_rate(self.spec.trainer.actor_lr, self.version, self.spec.trainer,
                           start=self.spec.trainer.critic_warmup_steps)
        self.training.set_lr(lr)
        out = train_epochs(self.training, batch, loss_fn, epochs=algo.ppo_epochs,
                           steps_per_epoch=optimizer_steps(self.spec), shuffle=self.shuffle,
                           max_grad_norm=self.spec.trainer.max_grad_norm, device=self.device,
                           limits=self.spec.trainer.training, agg=algo.loss_agg)
        self.version += 1
        out["actor_grad_norm"] = out.pop("grad_norm")
        out["actor_lr"] = lr
        return out | gap | self._lag_and_footprint(lag)

    def _frozen_step(self, lag: int) -> dict[str, float]:
        """A step of the critic's warm-up: no pass and no optimiser step, the weights stay; the version still
        counts the step, so that versions, lags and checkpoints mean the same with or without a warm-up."""
        self.version += 1
        return {"actor_lr": 0.0} | self._lag_and_footprint(lag)

    def _lag_and_footprint(self, lag: int) -> dict[str, float]:
        footprint = training_footprint(self.model, self.training.layout.optimizer, self.training.parameter_counts())
        return {"policy_lag": float(lag)} | footprint.record("actor")

    def _policy_loss(self, old: torch.Tensor, logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                     w: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, float]]:
        """spec.algorithm.policyLoss on one pass (algos, policy_losses)."""
        algo, cov = self.spec.algorithm, self.spec.algorithm.covariance
        agg, horizon = algo.loss_agg, self.spec.data.max_response_length
        low, high = algo.clip_ratio, algo.clip_ratio_high or algo.clip_ratio
        match algo.policy_loss:
            case "gspo":
                return algos.gspo_policy_loss(old, logp, adv, mask, clip_low=low, clip_high=high, agg=agg, weights=w,
                                              horizon=horizon)
            case "cispo":
                return policy_losses.cispo_policy_loss(old, logp, adv, mask, clip_low=low, clip_high=high, agg=agg,
                                                       weights=w, horizon=horizon)
            case "gpg":
                return policy_losses.gpg_policy_loss(old, logp, adv, mask, agg=agg, weights=w, horizon=horizon)
            case "sapo":
                return policy_losses.sapo_policy_loss(old, logp, adv, mask, tau_pos=algo.sapo.tau_pos,
                                                      tau_neg=algo.sapo.tau_neg, agg=agg, weights=w, horizon=horizon)
            case "geo_mean":
                return policy_losses.geo_mean_policy_loss(old, logp, adv, mask, clip_low=low, clip_high=high, weights=w)
            case "clip_cov":
                return policy_losses.clip_cov_policy_loss(
                    old, logp, adv, mask, clip_low=low, clip_high=high, share=cov.clip_ratio,
                    lower=cov.clip_lower_bound, upper=cov.clip_upper_bound, generator=self.shuffle, agg=agg, weights=w,
                    horizon=horizon)
            case "kl_cov":
                return policy_losses.kl_cov_policy_loss(old, logp, adv, mask, share=cov.kl_ratio, coef=cov.kl_coef,
                                                        agg=agg, weights=w, horizon=horizon)
            case "dppo_tv" | "dppo_kl":
                return policy_losses.dppo_policy_loss(old, logp, adv, mask, "tv" if algo.policy_loss == "dppo_tv"
                                                      else "kl", low=low, high=high, truncate=algo.dual_clip_c,
                                                      agg=agg, weights=w, horizon=horizon)
            case "dro":
                assert algo.dro_beta is not None  # the spec refuses dro without it
                return policy_losses.dro_policy_loss(old, logp, adv, mask, beta=algo.dro_beta, agg=agg, weights=w,
                                                     horizon=horizon)
        return algos.ppo_policy_loss(old, logp, adv, mask, clip_low=low, clip_high=high, dual_clip_c=algo.dual_clip_c,
                                     agg=agg, weights=w, horizon=horizon)

    def _rollout_gap(self, batch: RolloutBatch, trainer_log_probs: torch.Tensor, mask: torch.Tensor, *,
                     over_ranks: bool) -> dict[str, float]:
        """The rollout engine's log-probs against the trainer's `trainer_log_probs` (those of the weights that
        generated `batch`; with bypass, of the policy being updated): the gap (rollout_kl; not with bypass) and, with
        spec.algorithm.rolloutCorrection, each token's weight (`rollout_weights`, normalised over all ranks where
        `over_ranks`) and the mask less what rejection sampling drops (`rollout_mask`)."""
        if "rollout_log_probs" not in batch.tensors:
            return {}
        engine = batch.tensors["rollout_log_probs"].to(trainer_log_probs.device)
        mask = mask.to(trainer_log_probs.device)
        out = {} if old_log_probs_from_rollout(self.spec) else {
            "rollout_kl": algos.rollout_kl(trainer_log_probs, engine, mask)}
        weights, kept, metrics = corrected(
            self.spec.algorithm.rollout_correction, trainer_log_probs, engine, mask,
            (lambda sums: distributed.average_scalars(sums, self.device)) if over_ranks else None)
        if weights is not None:
            batch.tensors["rollout_weights"] = weights
        if kept is not None:
            batch.tensors["rollout_mask"] = kept
        return out | metrics

    @torch.no_grad()
    def _decouple(self, batch: RolloutBatch) -> None:
        """A batch from the policy before this one: its old log-probs become the behaviour's, the clip is taken
        around this policy's (proximal) log-probs, and each token weighs min(pi_prox / pi_behaviour, cap)."""
        behaviour = batch.tensors["old_log_probs"]
        proximal = self._log_probs_in_step(batch, self.training.module, self.training.sharded)
        batch.tensors["old_log_probs"] = proximal
        batch.tensors["behaviour_weights"] = algos.behaviour_weights(
            proximal, behaviour, self.spec.algorithm.behaviour_weight_cap)

    def sync_rollout(self) -> tuple[int, int]:
        """The trained policy into the rollout engine: (the version it now holds, the bytes copied). From the
        shards when the copy stays released: each weight is gathered, copied out and dropped in turn."""
        if self.version <= self.spec.trainer.critic_warmup_steps:
            # no optimiser step yet: the engine holds the weights it started with or got from a checkpoint's load
            self.rollout.version = self.version
            return self.version, 0
        moved = self.rollout.sync_weights(self.training.current, self.version)
        return self.version, moved

    def weights(self) -> dict[str, torch.Tensor]:
        """The policy's trained weights: its adapters under LoRA, else every weight. A released copy must be
        gathered first (RoleTraining.held_copy), which the scheduler asks before ranks change."""
        return policy_weights(self.training.held_copy())

    def state_dict(self, with_model: bool = True) -> dict[str, Any]:
        """Version, sampling order and (`with_model`) the weights; the optimizer's state is `training`'s."""
        return ({"model": self.weights()} if with_model else {}) | {"version": self.version,
                                                                   "shuffle": self.shuffle.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Weights given here restart the optimizer from them (see RoleTraining.invalidate)."""
        if "model" in state:
            self.training.invalidate()
            load_policy_weights(self.model, state["model"])
        self.version = int(state["version"])
        self.shuffle.set_state(state["shuffle"])
        self.rollout.sync_weights(self.model, self.version)

    def load_training(self, directory: str) -> None:
        """The exact training state of a checkpoint (fp32 weights, Adam's moments), resharded to these ranks."""
        self.training.load(directory)
        self.rollout.sync_weights(self.model, self.version)


class ReferenceWorker:
    """The initial policy, frozen; its log-probs anchor the KL penalty.

    Its own copy of the model, or, given `policy` (a LoRA policy in the same process, see
    graph.reference_in_policy), that policy's module with the adapters switched off: the frozen base is
    exactly the initial policy, so no second copy is loaded.
    """

    def __init__(self, spec: RLTrainingJobSpec, device: torch.device,
                 policy: ActorRolloutWorker | None = None) -> None:
        self.device = device
        self.shared = policy is not None
        self.limits = spec.trainer.training
        if policy is not None:
            self.model = policy.model
        else:
            path = spec.model.reference.path or spec.model.policy.path
            self.model = load_causal_lm(check_model_dir(path, "spec.model.reference.path"), spec.model.policy.dtype,
                                        device)
            self.model.eval().requires_grad_(False)

    @torch.no_grad()
    def ref_log_probs(self, batch: RolloutBatch) -> RolloutBatch:
        t0 = time.perf_counter()
        if self.shared:
            self.model.eval()
        # PeftModel's disable_adapter, unknown to nn.Module
        base = self.model.disable_adapter() if self.shared else contextlib.nullcontext()  # type: ignore[operator]
        with base:
            logp = in_micro_batches(batch, self.limits,
                                    lambda mb: response_log_probs(self.model, mb, self.device)[0])
        batch.tensors["ref_log_probs"] = logp.cpu()
        batch.add_timing("ref_log_probs", time.perf_counter() - t0)
        return batch
