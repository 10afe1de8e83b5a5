"""A run's `Session`: what every step works with once the run is loaded (settings, processes, model, its loss module
and optimiser, the task, the stop requests), and the checks that come before any loading."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

import torch
from torch import nn

from gtpo_kernels import GTPOConfig
from gtpo_kernels.hf import check_hidden_states_supported

from .checkpoint import RunState, save_checkpoint
from .config import ConfigError, TrainConfig
from .distributed import Distributed, full_parameters, full_state, wrap
from .evaluation import evaluate
from .model import load_model_and_tokenizer, use_grouped_query_attention_on_cpu
from .precision import uses_bf16
from .stopping import StopRequests
from .task import Task
from .update import PolicyLoss


def warmup_cosine(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def check_process_shares(config: TrainConfig, world: int) -> None:
    """At start, before anything is loaded or written: each of the ``world`` processes samples whole prompt
    groups, and splits its own groups into ``grad_accum_steps`` equal micro-batches (a split that dropped the
    remainder would train on part of the batch while the dropped rows still counted in the denominators)."""
    if config.prompts_per_step % world:
        raise ConfigError(
            f"--prompts-per-step ({config.prompts_per_step}) must be a multiple of the number of "
            f"processes ({world}): each process samples whole prompt groups"
        )
    share = config.prompts_per_step // world
    if share % config.grad_accum_steps:
        raise ConfigError(
            f"--grad-accum-steps ({config.grad_accum_steps}) must divide each process's prompt groups "
            f"(--prompts-per-step {config.prompts_per_step} over {world} processes = {share}): every "
            f"micro-batch holds whole groups, none is left out"
        )


def step_rows(train_set, step: int, config: TrainConfig, dist: Distributed) -> Dict[str, list]:
    """This process's rows of a step, as columns: a fixed stream that depends only on the step (resuming repeats
    nothing), cut into one contiguous share per process."""
    share = config.prompts_per_step // dist.world
    first = step * config.prompts_per_step + dist.rank * share
    return train_set.select([(first + j) % len(train_set) for j in range(share)]).to_dict()


@dataclass
class Session:
    """What every step of a run works with, fixed once the run is loaded: the trainer's and the loss's settings,
    the processes, the model, its loss as a (wrapped) module and its optimiser, the task, the stop requests."""

    config: TrainConfig
    loss_config: GTPOConfig
    dist: Distributed
    model: nn.Module
    tokenizer: Any
    policy: nn.Module  # PolicyLoss(model), wrapped for DDP / FSDP
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    task: Task
    checkpoint_path: Path
    stop: StopRequests

    def evaluate(self, seed: int, desc: str = "eval") -> Optional[dict]:
        with full_parameters(self.policy):
            return evaluate(
                self.model, self.tokenizer, self.task, self.config, self.dist, seed=seed, stop=self.stop, desc=desc
            )

    def checkpoint(self, state: RunState) -> None:
        model_state, optimizer_state = full_state(self.policy, self.optimizer)  # every process takes part
        if self.dist.is_main:
            save_checkpoint(
                self.checkpoint_path,
                model_state,
                optimizer_state,
                self.scheduler.state_dict(),
                state,
                self.config.to_dict(),
            )
        self.dist.barrier()


def load_session(config: TrainConfig, dist: Distributed, task: Task) -> Session:
    """The model (seeded by ``config.seed``), its loss module wrapped for the processes, the optimiser and
    the schedule: what a run's steps work with (``python -m bench trainer`` times steps of it)."""
    checkpoint_path = Path(config.output_dir) / "checkpoint.pt"
    torch.manual_seed(config.seed)
    model, tokenizer = load_model_and_tokenizer(config.model, dist.device)
    if config.max_prompt_length is not None:
        lost = task.drop_long_prompts(tokenizer, config.max_prompt_length)
        if dist.is_main and any(lost.values()):
            print(
                f"--max-prompt-length {config.max_prompt_length}: dropped {lost['train']} training and "
                f"{lost['held_out']} held-out rows with longer prompts",
                flush=True,
            )
    if dist.device.type == "cpu" and not uses_bf16(config, dist.device):
        use_grouped_query_attention_on_cpu()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    if config.gradient_checkpointing:  # transformers >= 5.2x renamed it
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    check_hidden_states_supported(model)  # before wrapping: its check runs the model once on a few tokens
    policy = wrap(PolicyLoss(model), model.get_decoder().layers, dist, config.fsdp)
    # fused: one kernel over all parameters; on 2 CPU cores 0.07 s a step for SmolLM2-135M against 0.39 s for
    # the loop over parameters torch picks on a CPU (the same update, summed in another order).
    optimizer = torch.optim.AdamW(
        policy.parameters(),
        lr=config.learning_rate,
        betas=(0.9, 0.99),
        weight_decay=config.weight_decay,
        fused=dist.device.type in ("cpu", "cuda") or None,
    )
    total_updates = config.steps * config.num_iterations
    return Session(
        config=config,
        loss_config=config.loss_config(max_completion_length=config.max_new_tokens),
        dist=dist,
        model=model,
        tokenizer=tokenizer,
        policy=policy,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(config.warmup_steps, total_updates)),
        task=task,
        checkpoint_path=checkpoint_path,
        stop=StopRequests(),
    )
