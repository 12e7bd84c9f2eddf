"""TRL's GRPOTrainer on the same tiny model, task, batch and step count, timed per RL step: in one process, or
in several that train data-parallel as `accelerate launch` runs them (DDP; gloo on CPU).

One RL step is what hybridflow calls a step: one generation batch of prompts * samples completions, scored,
then `ppoEpochs * ceil(batch / miniBatchSize)` optimiser steps. TRL reaches that with
per_device_train_batch_size = miniBatchSize / processes and steps_per_generation = batch / miniBatchSize.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from hybridflow.api.spec import RLTrainingJobSpec
from hybridflow.data.prompts import load_rows
from hybridflow.data.tiny import tiny_task_reward
from hybridflow.hub import resolve_model_path


def optimizer_steps_per_rl_step(spec: RLTrainingJobSpec) -> tuple[int, int]:
    """(minibatch size, optimiser steps per generation batch) for the spec's batch and miniBatchSize."""
    total = spec.data.batch_size * spec.rollout.samples_per_prompt
    mbs = spec.algorithm.mini_batch_size or total
    if total % mbs:
        raise ValueError(f"TRL needs the batch ({total}) to be a multiple of miniBatchSize ({mbs})")
    return mbs, total // mbs


class _Clock:
    """Outermost-only timers by name, so nested timed calls are not counted twice."""

    def __init__(self) -> None:
        self.depth = 0
        self.seconds: dict[str, float] = {}

    @contextmanager
    def time(self, name: str) -> Iterator[None]:
        self.depth += 1
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.depth -= 1
            if self.depth == 0:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def take(self) -> dict[str, float]:
        out, self.seconds = self.seconds, {}
        return out


def run_trl(spec: RLTrainingJobSpec, steps: int, threads: int = 1, ranks: int = 1) -> dict[str, Any]:
    """Train `steps` RL steps with GRPOTrainer, in `ranks` processes of `threads` torch threads each; returns per-step
    records in hybridflow's metric names: rank 0's step times, every rank's tokens and rewards."""
    if ranks == 1:
        return _train(spec, steps, threads)
    import torch.multiprocessing as mp

    from hybridflow.workers.distributed import free_port

    with tempfile.TemporaryDirectory(prefix="bench-trl-ranks-") as tmp:
        out = os.path.join(tmp, "rank0.json")
        mp.spawn(_rank_main, args=(ranks, free_port(), spec.model_dump(by_alias=True, mode="json"), steps, threads,
                                   out), nprocs=ranks, join=True)
        with open(out) as f:
            result: dict[str, Any] = json.load(f)
    return result | {"ranks": ranks}


def _rank_main(rank: int, ranks: int, port: int, spec: dict[str, Any], steps: int, threads: int, out: str) -> None:
    """One process of a data-parallel run, found by accelerate through the variables `torchrun` sets;
    OMP_NUM_THREADS keeps accelerate from choosing the threads itself."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=str(threads))
    result = _train(RLTrainingJobSpec.model_validate(spec), steps, threads)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)


def _train(spec: RLTrainingJobSpec, steps: int, threads: int) -> dict[str, Any]:
    from datasets import Dataset
    from transformers import TrainerCallback
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig, GRPOTrainer

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(threads)
    torch.manual_seed(spec.trainer.seed)
    mbs, per_gen = optimizer_steps_per_rl_step(spec)
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    if mbs % ranks:
        raise ValueError(f"TRL on {ranks} processes needs miniBatchSize ({mbs}) to be a multiple of {ranks}")
    opt_steps = per_gen * spec.algorithm.ppo_epochs
    clock = _Clock()
    rewards: list[tuple[float, float]] = []  # (mean score, response tokens) per generation batch

    def tiny_reward(prompts: list[str], completions: list[str], completion_ids: list[list[int]],
                    answer: list[str], **_: Any) -> list[float]:
        scores = [tiny_task_reward(p, c, a) for p, c, a in zip(prompts, completions, answer, strict=True)]
        rewards.append((sum(scores) / len(scores), float(sum(len(ids) for ids in completion_ids))))
        return scores

    class Timed(GRPOTrainer):
        """Times generation, forward passes, loss, reward, backward and clipping; the rest is the trainer's."""

        def _generate_single_turn(self, *args: Any, **kwargs: Any) -> Any:
            with clock.time("generate"):
                return super()._generate_single_turn(*args, **kwargs)

        def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any) -> Any:
            with clock.time("forward"):
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)

        def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
            with clock.time("loss_forward"):
                return super().compute_loss(*args, **kwargs)

        def _calculate_rewards(self, *args: Any, **kwargs: Any) -> Any:
            with clock.time("reward"):
                return super()._calculate_rewards(*args, **kwargs)

        def _clip_grad_norm(self, *args: Any, **kwargs: Any) -> Any:
            with clock.time("optimizer"):
                return super()._clip_grad_norm(*args, **kwargs)

    ends: list[float] = []
    begins: list[float] = []
    compute: list[dict[str, float]] = []

    class StepClock(TrainerCallback):
        """An RL step runs from the first optimiser step's begin to the last one's end."""

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step % opt_steps == 0:
                begins.append(time.perf_counter())

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.t_opt = time.perf_counter()

        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.seconds["optimizer"] = clock.seconds.get("optimizer", 0.0) + time.perf_counter() - self.t_opt

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step % opt_steps == 0:
                ends.append(time.perf_counter())
                compute.append(clock.take())

    rows = load_rows(spec.data.train, spec.data.prompt_key, spec.data.answer_key, spec.trainer.seed)
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    algo = spec.algorithm
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as out:
        config = GRPOConfig(
            output_dir=out, max_steps=steps * opt_steps, per_device_train_batch_size=mbs // ranks,
            steps_per_generation=per_gen, num_iterations=algo.ppo_epochs, gradient_accumulation_steps=1,
            num_generations=spec.rollout.samples_per_prompt, max_completion_length=spec.data.max_response_length,
            temperature=spec.rollout.temperature, top_p=spec.rollout.top_p, top_k=spec.rollout.top_k,
            learning_rate=spec.trainer.actor_lr, lr_scheduler_type="constant", warmup_steps=0,
            weight_decay=spec.trainer.optimizer.weight_decay,
            max_grad_norm=spec.trainer.max_grad_norm, beta=algo.kl_penalty.coef, epsilon=algo.clip_ratio,
            loss_type="bnpo", scale_rewards="group" if algo.normalize_advantages else "none",
            use_vllm=False, use_cpu=not torch.cuda.is_available(), bf16=False, fp16=False,
            gradient_checkpointing=False, model_init_kwargs={"dtype": spec.model.policy.dtype},
            logging_strategy="no", save_strategy="no", eval_strategy="no", report_to=[], disable_tqdm=True,
            log_completions=False, dataloader_num_workers=0, seed=spec.trainer.seed,
        )
        model = resolve_model_path(spec.model.policy.path, "spec.model.policy.path")
        trainer = Timed(
            model=model, reward_funcs=tiny_reward, args=config,  # type: ignore[arg-type]
            train_dataset=dataset, callbacks=[StepClock()],
        )
        backward: Callable[..., Any] = trainer.accelerator.backward

        def timed_backward(*args: Any, **kwargs: Any) -> Any:
            with clock.time("backward"):
                return backward(*args, **kwargs)

        trainer.accelerator.backward = timed_backward
        t0 = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - t0
    if ranks > 1:  # each rank scored its own share of every generation batch, all of the same size
        both = torch.tensor(rewards, dtype=torch.float64)
        torch.distributed.all_reduce(both)
        rewards = [(score / ranks, tokens) for score, tokens in both.tolist()]
    records = []
    for i, (b, e) in enumerate(zip(begins, ends, strict=False)):
        elapsed = e - b
        parts = compute[i]
        mean_score, tokens = rewards[i]
        busy = sum(parts.values())
        records.append({
            "step": i + 1, "reward_mean": mean_score, "tokens": tokens, "tokens_per_s": tokens / elapsed,
            "timing/step": elapsed, **{f"timing/{k}": v for k, v in parts.items()},
            "orchestration_overhead_frac": max(0.0, 1.0 - busy / elapsed),
        })
    return {"records": records, "train_wall_s": wall, "torch_threads": torch.get_num_threads(),
            "optimizer_steps_per_rl_step": opt_steps, "minibatch": mbs}
