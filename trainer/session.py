"""A run's `Session`: what every step works with once the run is loaded (settings, processes, model, its loss module
and optimiser, the task, the stop requests), and the checks that come before any loading."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

import torch
from torch import nn

from gtpo_kernels.fused_chunks import LogitTransform
from gtpo_kernels.hf import head_logit_transform
from gtpo_kernels.hf.model_config import unwrap

from .adapters import add_lora, frozen_reference
from .allocator import keep_freed_memory
from .checkpoint import RunState, write_checkpoint
from .config import ConfigError, TrainConfig
from .distributed import Distributed, full_parameters, full_state, wrap
from .evaluation import evaluate
from .metrics_log import MetricsLog
from .model import check_model_source, load_model_and_tokenizer, use_grouped_query_attention_on_cpu
from .optimizer import PolicyOptimizer, check_master_weights
from .precision import choose_together
from .report import save_model
from .stopping import StopRequests
from .task import Task
from .tracking import check_trackers
from .update import PolicyLoss


def warmup_cosine(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def check_before_loading(config: TrainConfig, world: int) -> None:
    """What can be told wrong of a run on ``world`` processes before any file of it is read: the split of its
    prompts over processes and micro-batches, the model's source, the trackers, the master weights. `train.start`
    runs it first (then the task, `task.load_task`); a study runs both for each of its cells before any runs."""
    check_process_shares(config, world)
    check_model_source(config.model)
    check_trackers(config.report_to)
    check_master_weights(config, world)


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
    if share % config.mini_batches:
        raise ConfigError(
            f"--mini-batches ({config.mini_batches}) must divide each process's prompt groups "
            f"(--prompts-per-step {config.prompts_per_step} over {world} processes = {share}): every "
            f"mini-batch holds whole groups, none is left out"
        )
    if share // config.mini_batches % config.grad_accum_steps:
        raise ConfigError(
            f"--grad-accum-steps ({config.grad_accum_steps}) must divide each process's prompt groups "
            f"(--prompts-per-step {config.prompts_per_step} over {world} processes = {share}"
            + (f", in {config.mini_batches} mini-batches" if config.mini_batches > 1 else "")
            + "): every micro-batch holds whole groups, none is left out"
        )


def step_rows(train_set, step: int, config: TrainConfig, dist: Distributed) -> Dict[str, list]:
    """This process's rows of a step, as columns: a fixed stream that depends only on the step (resuming repeats
    nothing), cut into one contiguous share per process."""
    share = config.prompts_per_step // dist.world
    first = step * config.prompts_per_step + dist.rank * share
    return train_set.select([(first + j) % len(train_set) for j in range(share)]).to_dict()


@dataclass
class Session:
    """What every step of a run works with, fixed once the run is loaded: the run's settings (the loss's among
    them, `TrainConfig.loss_config`), the processes, the model (a ``PeftModel`` under LoRA), its loss as a
    (wrapped) module and its optimiser, the frozen reference of ``--beta`` if it needs a copy, the task, the stop
    requests."""

    config: TrainConfig
    dist: Distributed
    model: nn.Module
    tokenizer: Any
    policy: nn.Module  # PolicyLoss(model), wrapped for DDP / FSDP
    optimizer: PolicyOptimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    task: Task
    stop: StopRequests
    head: Optional[LogitTransform] = None  # the head's scale or soft cap, which the fused loss applies
    reference: Optional[nn.Module] = None  # --beta without LoRA: the starting policy, frozen

    def evaluate(self, seed: int, desc: str = "eval", greedy_answers: Optional[list] = None) -> Optional[dict]:
        with full_parameters(self.policy):
            return evaluate(
                self.model,
                self.tokenizer,
                self.task,
                self.config,
                self.dist,
                seed=seed,
                stop=self.stop,
                desc=desc,
                greedy_answers=greedy_answers,
            )

    def checkpoint(self, state: RunState, log: MetricsLog) -> None:
        """``checkpoint-STEP/`` in the output folder (`checkpoint.write_checkpoint`), with ``log``'s rows; every
        process takes part in gathering the state, process 0 writes."""
        model_state, optimizer_state = full_state(self.policy, self.optimizer)
        if self.dist.is_main:
            write_checkpoint(
                Path(self.config.output_dir),
                state.step,
                lambda folder: save_model(self.model, self.tokenizer, model_state, folder),
                optimizer_state,
                {
                    "step": state.step,
                    "state": state.to_dict(),
                    "scheduler": self.scheduler.state_dict(),
                    "config": self.config.to_dict(),
                    "log_history": log.rows(),
                },
                self.config.save_total_limit,
            )
        self.dist.barrier()


def load_session(config: TrainConfig, dist: Distributed, task: Task, resume_from: Optional[Path] = None) -> Session:
    """The model (seeded by ``config.seed``; a checkpoint's weights from ``resume_from``), its loss module wrapped
    for the processes, the optimiser and the schedule: what a run's steps work with (``python -m bench trainer``
    times steps of it). The optimiser's and schedule's state are the caller's to load."""
    torch.manual_seed(config.seed)
    if dist.device.type == "cpu":
        keep_freed_memory()  # a step's activations are reused, not faulted in again (trainer/allocator.py)
    dtype = torch.bfloat16 if config.model_dtype == "bf16" else torch.float32
    lora = bool(config.lora_r)
    model, tokenizer = load_model_and_tokenizer(
        config.model, dist.device, dtype, weights_from=None if lora else resume_from
    )
    if config.max_prompt_length is not None:
        lost = task.drop_long_prompts(tokenizer, config.max_prompt_length)
        if dist.is_main and any(lost.values()):
            print(
                f"--max-prompt-length {config.max_prompt_length}: dropped {lost['train']} training and "
                f"{lost['held_out']} held-out rows with longer prompts",
                flush=True,
            )
    precision = choose_together(config, dist, model)  # measured once here; every later call reuses it
    if dist.is_main:
        print(f"precision: {precision.name} ({precision.reason})", flush=True)
    if dist.device.type == "cpu" and not precision.bf16 and dtype == torch.float32:
        use_grouped_query_attention_on_cpu()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    head = check_head(model, config)  # before wrapping: its check runs the model once on a few tokens
    reference = None
    if config.beta and not lora:  # the starting policy: this model before any update (not a resumed checkpoint's)
        reference = frozen_reference(
            model if resume_from is None else load_model_and_tokenizer(config.model, dist.device, dtype)[0]
        )
    if lora:
        model = add_lora(model, config, resume_from, say=print if dist.is_main else lambda *a: None)
    if config.gradient_checkpointing:  # transformers >= 5.2x renamed it
        base = unwrap(model)
        (getattr(base, "activation_checkpointing_enable", None) or base.gradient_checkpointing_enable)()
        if lora:  # frozen embeddings: the checkpointed layers' input must still carry a gradient
            base.enable_input_require_grads()
    policy = wrap(PolicyLoss(model, head), unwrap(model).get_decoder().layers, dist, config.fsdp)
    optimizer = PolicyOptimizer(policy.parameters(), config, dist.device, master=config.master_weights)
    total_updates = config.steps * config.updates_per_rollout
    return Session(
        config=config,
        dist=dist,
        model=model,
        tokenizer=tokenizer,
        policy=policy,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer.adamw, warmup_cosine(config.warmup_steps, total_updates)),
        task=task,
        stop=StopRequests(),
        head=head,
        reference=reference,
    )


def check_head(model, config: TrainConfig) -> Optional[LogitTransform]:
    """The head's logit transform (a soft cap, a scale), which the fused functions apply, or None for a plain head
    (the old log-probs, the entropy and the reference always come from the hidden states, whatever
    --fused-linear says); a model whose logits they cannot reproduce is one error."""
    try:
        found = head_logit_transform(model)
    except ValueError as exc:
        raise ConfigError(
            f"model {config.model!r}: {exc}".splitlines()[0]
            + " (gtpo-train computes log-probs from the final hidden states through the head)"
        ) from None
    return None if found is None else found[1]
