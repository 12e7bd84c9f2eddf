"""The critic: a causal-LM backbone with a scalar value head, trained data-parallel across ranks."""

from __future__ import annotations

import time
from typing import Any

import torch

from hybridflow import algos
from hybridflow.api.spec import RLTrainingJobSpec
from hybridflow.plan import SP_FIELDS, optimizer_steps
from hybridflow.workers.batch import RolloutBatch
from hybridflow.workers.lr_schedule import learning_rate
from hybridflow.workers.modeling import DTYPES, check_model_dir, in_micro_batches, position_ids
from hybridflow.workers.optim import train_epochs
from hybridflow.workers.training import RoleTraining
from hybridflow.workers.ulysses import SequenceParallel, forward_tokens


class ValueModel(torch.nn.Module):
    """V(s_t) = w . h_t + b over the backbone's last hidden state."""

    def __init__(self, path: str, dtype: str) -> None:
        super().__init__()
        from transformers import AutoModel

        self.backbone = AutoModel.from_pretrained(path, dtype=DTYPES[dtype])
        self.value_head = torch.nn.Linear(self.backbone.config.hidden_size, 1, dtype=DTYPES[dtype])
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """`positions` default to those that skip left padding; a mask of None is plain causal (a
        sequence-parallel slice, whose attention brings the whole sequence's mask)."""
        if positions is None:
            assert attention_mask is not None
            positions = position_ids(attention_mask)
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=positions, use_cache=False).last_hidden_state
        return self.value_head(hidden).squeeze(-1).float()


class CriticWorker:
    """One data-parallel rank; its weights and optimizer are laid out over the ranks by RoleTraining.

    `own_phase`: its values run in the step's scores phase (plan.scored_steps: a critic outside the actor's
    processes, or sharded in them), each rank scoring its shard of the batch in one call, so a sharded critic
    scores them with the shards and keeps no full copy between updates. Otherwise it scores chunks in the
    actor's process as they are generated, one host at a time, and keeps its copy for them.
    """

    def __init__(self, spec: RLTrainingJobSpec, device: torch.device, seed: int = 0, own_phase: bool = False) -> None:
        self.spec, self.device = spec, device
        path = spec.model.critic.path or spec.model.policy.path
        field = "spec.model.critic.path" if spec.model.critic.path else "spec.model.policy.path"
        self.model = ValueModel(check_model_dir(path, field), spec.model.critic.dtype).to(device)
        self.training = RoleTraining(self.model, lr=spec.trainer.critic_lr, options=spec.trainer.training,
                                     device=device, keep_copy=not own_phase,
                                     weight_decay=spec.trainer.optimizer.weight_decay)
        self.updates = 0
        """Updates taken: the training step the learning-rate schedule is at."""
        self.shuffle = torch.Generator().manual_seed(seed + 7919)
        self.sp = SequenceParallel.for_model(spec.model.critic.sequence_parallel, self.model.backbone.config,
                                             SP_FIELDS["critic"])

    def _values(self, batch: RolloutBatch, module: torch.nn.Module | None = None) -> torch.Tensor:
        """Values of the states that precede each response token: positions P-1 .. P+R-2, by `module` (default:
        the copy)."""
        module = self.model if module is None else module
        v = forward_tokens(module, self.sp, batch.input_ids.to(self.device), batch.attention_mask.to(self.device))
        return v[:, batch.prompt_length - 1:-1]

    @torch.no_grad()
    def values(self, batch: RolloutBatch) -> RolloutBatch:
        t0 = time.perf_counter()
        module = self.training.current
        module.eval()
        values = in_micro_batches(batch, self.spec.trainer.training, lambda mb: self._values(mb, module),
                                  sharded_on=self.device if self.training.released else None)
        batch.tensors["values"] = values.cpu()
        batch.add_timing("values", time.perf_counter() - t0)
        return batch

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """Clipped value regression towards the GAE returns."""
        algo = self.spec.algorithm

        def loss_fn(mb: RolloutBatch) -> tuple[torch.Tensor, dict[str, float]]:
            loss, metrics = algos.value_loss(
                self._values(mb, self.training.module), mb.tensors["returns"].to(self.device),
                mb.tensors["values"].to(self.device),
                mb.response_mask.float().to(self.device), clip=algo.value_clip, agg=algo.loss_agg,
                horizon=self.spec.data.max_response_length,
            )
            metrics["critic_loss"] = loss.item()
            return loss, metrics

        lr = learning_rate(self.spec.trainer.critic_lr, self.updates, self.spec.trainer)
        self.training.set_lr(lr)
        out = train_epochs(self.training, batch, loss_fn, epochs=algo.ppo_epochs,
                           steps_per_epoch=optimizer_steps(self.spec), shuffle=self.shuffle,
                           max_grad_norm=self.spec.trainer.max_grad_norm, device=self.device,
                           limits=self.spec.trainer.training, agg=algo.loss_agg)
        self.updates += 1
        out["critic_grad_norm"] = out.pop("grad_norm")
        out["critic_lr"] = lr
        out["critic_model_bytes"] = float(self.training.inference_copy_bytes())
        return out

    def state_dict(self, with_model: bool = True) -> dict[str, Any]:
        """Updates taken, sampling order and (`with_model`) the weights; the optimizer's state is `training`'s."""
        weights = {"model": self.training.held_copy().state_dict()} if with_model else {}
        return weights | {"updates": self.updates, "shuffle": self.shuffle.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Weights given here restart the optimizer from them (see RoleTraining.invalidate)."""
        if "model" in state:
            self.training.invalidate()
            self.model.load_state_dict(state["model"])
        self.updates = int(state.get("updates", 0))  # absent from checkpoints written before the schedule
        self.shuffle.set_state(state["shuffle"])

    def load_training(self, directory: str) -> None:
        """The exact training state of a checkpoint (fp32 weights, Adam's moments), resharded to these ranks."""
        self.training.load(directory)
