"""The policy's GTPO loss on a rollout batch, and one optimiser update from it (or from a mini-batch of its prompt
groups): micro-batches of whole prompt groups, each loss divided by the update's counts (all processes), no optimiser
step without signal."""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from gtpo_kernels import (
    GTPOConfig,
    GTPOMetrics,
    fused_linear_gtpo_loss,
    fused_linear_token_logprobs_and_entropy,
    gtpo_loss,
)
from gtpo_kernels.fused_chunks import LogitTransform
from gtpo_kernels.hf import grouped_completion_hidden_states

from .config import TrainConfig
from .distributed import Distributed, no_sync
from .optimizer import PolicyOptimizer
from .precision import autocast
from .rollout import Completions, Rollout


def completion_hidden_states(model, completions: Completions, groups: slice, group_size: int):
    """``(hidden [n, L, H], lm_head weight, bias)`` of the completions of prompt groups ``groups``: position
    ``t`` predicts ``completion_ids[:, t]``. Each prompt runs once and shares its cache with its group. The head
    was checked when the run was loaded (`session.check_head`), its transform found there."""
    rows = slice(groups.start * group_size, groups.stop * group_size)
    return grouped_completion_hidden_states(
        model,
        completions.prompt_ids[groups],
        completions.prompt_mask[groups],
        completions.completion_ids[rows],
        completions.completion_mask[rows],
        group_size,
        head_checked=True,
    )


def completion_logits(model, completions: Completions, groups: slice, group_size: int) -> torch.Tensor:
    """``[n, L, V]`` logits of the completions of prompt groups ``groups`` (the --no-fused-linear path)."""
    rows = slice(groups.start * group_size, groups.stop * group_size)
    prompt_ids = completions.prompt_ids[groups].repeat_interleave(group_size, 0)
    prompt_mask = completions.prompt_mask[groups].repeat_interleave(group_size, 0)
    input_ids = torch.cat([prompt_ids, completions.completion_ids[rows]], dim=1)
    attention_mask = torch.cat([prompt_mask, completions.completion_mask[rows].long()], dim=1)
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)  # left-padded prompts: real tokens only
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    return logits[:, prompt_ids.shape[1] - 1 : -1]


class PolicyLoss(nn.Module):
    """The policy's GTPO loss on prompt groups ``groups`` of a rollout, as a module: DDP and FSDP see the whole
    computation (decoder, loss, lm_head) as its forward."""

    def __init__(self, model: nn.Module, head: Optional[LogitTransform] = None) -> None:
        super().__init__()
        self.model = model
        self.head = head  # the head's logit scale or soft cap (Gemma 2, Cohere, Granite), applied by the fused loss

    def forward(self, rollout: Rollout, groups: slice, config: TrainConfig, **call):
        """``call``: the row keywords that are neither the rollout's nor the sampling temperature (`Rollout.rows`):
        the initial entropy and the whole batch's counts."""
        rows, g = rollout.rows(groups, temperature=config.temperature, **call), rollout.group_size
        keywords = dict(config=config.loss_config(), **rows.row_keywords())
        if config.fused_linear:  # never builds the [n, L, V] logits
            hidden, weight, bias = completion_hidden_states(self.model, rollout.completions, groups, g)
            return fused_linear_gtpo_loss(
                hidden,
                weight,
                rows.ids,
                rows.valid,
                rows.advantages,
                lm_head_bias=bias,
                **head_arguments(self.head),
                **keywords,
            )
        logits = completion_logits(self.model, rollout.completions, groups, g)
        return gtpo_loss(logits, rows.ids, rows.valid, rows.advantages, **keywords)


def head_arguments(head: Optional[LogitTransform]) -> dict:
    """The fused functions' ``logit_scale`` and ``logit_softcap`` for a head's transform (none: a plain head)."""
    return {} if head is None else {"logit_scale": head.scale, "logit_softcap": head.softcap}


@torch.no_grad()
def token_stats(model, rollout: Rollout, config: TrainConfig, head: Optional[LogitTransform] = None):
    """Per-token log-probs and entropies of ``model``'s ``softmax(logits / T)`` (no grad, no logits): the old
    log-probs and the initial entropy (the sampling policy), the reference log-probs of ``--beta``."""
    completions = rollout.completions
    hidden, weight, bias = completion_hidden_states(model, completions, slice(0, rollout.prompts), rollout.group_size)
    budget = None if config.loss_chunk_mib is None else config.loss_chunk_mib * 2**20
    return fused_linear_token_logprobs_and_entropy(
        hidden,
        weight,
        completions.completion_ids,
        completions.completion_mask,
        lm_head_bias=bias,
        temperature=config.temperature,
        max_chunk_bytes=budget,
        **head_arguments(head),
    )


@dataclass
class UpdateResult:
    """One optimiser update's figures: the whole batch's loss, the metrics merged over micro-batches and processes,
    whether the optimiser stepped (not without signal) and the gradient norm before clipping (NaN: no step)."""

    loss: float
    metrics: GTPOMetrics
    stepped: bool
    grad_norm: float


def update(
    policy: nn.Module,
    optimizer: PolicyOptimizer,
    rollout: Rollout,
    config: TrainConfig,
    dist: Distributed,
    initial_entropy: Optional[float],
    groups: Optional[slice] = None,
) -> UpdateResult:
    """One optimiser update from this process's rollout's prompt ``groups`` (a mini-batch; all by default):
    micro-batches of whole prompt groups, the loss of each divided by the mini-batch's counts (all processes),
    gradients summed; no step without signal."""
    first, end = (0, rollout.prompts) if groups is None else (groups.start, groups.stop)
    mask = rollout.completions.completion_mask[first * rollout.group_size : end * rollout.group_size]
    counts = dist.all_sum(torch.tensor([mask.shape[0], mask.sum()], dtype=torch.float64, device=dist.device))
    num_sequences, num_tokens = counts[0], counts[1]
    n_groups = end - first
    if n_groups % config.grad_accum_steps:  # check_process_shares refuses this at start
        raise ValueError(f"{n_groups} prompt groups cannot be split into {config.grad_accum_steps} equal micro-batches")
    per_micro = n_groups // config.grad_accum_steps
    optimizer.zero_grad()
    loss_sum = torch.zeros((), dtype=torch.float64, device=dist.device)
    metrics = []
    for k in range(config.grad_accum_steps):
        groups = slice(first + k * per_micro, first + (k + 1) * per_micro)
        with no_sync(policy, last=k == config.grad_accum_steps - 1):
            with autocast(config, dist.device):
                out = policy(
                    rollout,
                    groups,
                    config,
                    initial_entropy=initial_entropy,
                    num_sequences=num_sequences,
                    num_tokens=num_tokens,
                )
            # Each call's loss is its share of the whole batch's; DDP and FSDP average the processes'
            # gradients, hence the factor: the sum over processes is the whole batch's gradient.
            (out.loss * dist.world).backward()
        loss_sum += out.loss.detach().double()
        metrics.append(out.metrics)
    merged = GTPOMetrics.from_sums(dist.all_sum(GTPOMetrics.merge(metrics).to_sums().to(dist.device)), parts=dist.world)
    signal = float(merged.signal_fraction) > 0
    grad_norm = float("nan")
    if signal:  # with no signal every gradient is 0, but Adam's momentum would still move the weights
        grad_norm = optimizer.clip_and_step(config.max_grad_norm)
    optimizer.zero_grad()
    return UpdateResult(float(dist.all_sum(loss_sum)), merged, signal, grad_norm)


def advance_schedule(scheduler) -> None:
    """One step of the learning-rate schedule, which follows the training steps, those without an optimiser
    step too (PyTorch warns when the schedule moves before the optimiser ever stepped: here that is meant)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()` before"))
        scheduler.step()


def no_signal_cause(metrics: GTPOMetrics, loss_config: GTPOConfig) -> str:
    if float(metrics.filtered_fraction) >= 1:
        return (
            f"every completion was dropped by the entropy filter (threshold {loss_config.entropy_threshold:.3g} "
            f"nats, preset {loss_config.preset!r}): raise --entropy-threshold, or use --preset paper, whose "
            f"gate switches the filter off when the initial entropy is above the threshold"
        )
    return (
        "every prompt group's rewards tied (all right or all wrong), so every advantage is 0: make the "
        "problems easier or harder (--difficulty), sample more (--group-size) or at a higher --temperature"
    )
