"""The policy's GTPO loss on a rollout batch, and one optimiser update from it: micro-batches of whole prompt groups,
each loss divided by the whole batch's counts (all processes), no optimiser step without signal."""

from __future__ import annotations

import re
import warnings
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


def completion_hidden_states(model, batch, groups: slice, group_size: int):
    """``(hidden [n, L, H], lm_head weight, bias)`` of the completions of prompt groups ``groups``: position
    ``t`` predicts ``completion_ids[:, t]``. Each prompt runs once and shares its cache with its group. The head
    was checked when the run was loaded (`session.check_head`), its transform found there."""
    rows = slice(groups.start * group_size, groups.stop * group_size)
    return grouped_completion_hidden_states(
        model,
        batch["prompt_ids"][groups],
        batch["prompt_mask"][groups],
        batch["completion_ids"][rows],
        batch["completion_mask"][rows],
        group_size,
        head_checked=True,
    )


def completion_logits(model, batch, groups: slice, group_size: int) -> torch.Tensor:
    """``[n, L, V]`` logits of the completions of prompt groups ``groups`` (the --no-fused-linear path)."""
    rows = slice(groups.start * group_size, groups.stop * group_size)
    prompt_ids = batch["prompt_ids"][groups].repeat_interleave(group_size, 0)
    prompt_mask = batch["prompt_mask"][groups].repeat_interleave(group_size, 0)
    input_ids = torch.cat([prompt_ids, batch["completion_ids"][rows]], dim=1)
    attention_mask = torch.cat([prompt_mask, batch["completion_mask"][rows].long()], dim=1)
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)  # left-padded prompts: real tokens only
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    return logits[:, prompt_ids.shape[1] - 1 : -1]


class PolicyLoss(nn.Module):
    """The policy's GTPO loss on prompt groups ``groups`` of a rollout batch, as a module: DDP and FSDP see
    the whole computation (decoder, loss, lm_head) as its forward."""

    def __init__(self, model: nn.Module, head: Optional[LogitTransform] = None) -> None:
        super().__init__()
        self.model = model
        self.head = head  # the head's logit scale or soft cap (Gemma 2, Cohere, Granite), applied by the fused loss

    def forward(
        self,
        batch: dict,
        groups: slice,
        loss_config: GTPOConfig,
        config: TrainConfig,
        *,
        old_logprobs,
        initial_entropy,
        num_sequences,
        num_tokens,
        ref_logprobs=None,
    ):
        g = config.group_size
        rows = slice(groups.start * g, groups.stop * g)
        conflict = batch.get("conflict")
        common = dict(
            config=loss_config,
            initial_entropy=initial_entropy,
            temperature=config.temperature,
            conflict=None if conflict is None else (conflict[0][rows], conflict[1][rows]),
            old_logprobs=None if old_logprobs is None else old_logprobs[rows],
            ref_logprobs=None if ref_logprobs is None else ref_logprobs[rows],
            num_sequences=num_sequences,
            num_tokens=num_tokens,
        )
        ids, mask, advantages = batch["completion_ids"][rows], batch["completion_mask"][rows], batch["advantages"][rows]
        if config.fused_linear:  # never builds the [n, L, V] logits
            hidden, weight, bias = completion_hidden_states(self.model, batch, groups, g)
            return fused_linear_gtpo_loss(
                hidden, weight, ids, mask, advantages, lm_head_bias=bias, **head_arguments(self.head), **common
            )
        return gtpo_loss(completion_logits(self.model, batch, groups, g), ids, mask, advantages, **common)


def head_arguments(head: Optional[LogitTransform]) -> dict:
    """The fused functions' ``logit_scale`` and ``logit_softcap`` for a head's transform (none: a plain head)."""
    return {} if head is None else {"logit_scale": head.scale, "logit_softcap": head.softcap}


@torch.no_grad()
def token_stats(model, batch, config: TrainConfig, head: Optional[LogitTransform] = None):
    """Per-token log-probs and entropies of ``model``'s ``softmax(logits / T)`` (no grad, no logits): the old
    log-probs and the initial entropy (the sampling policy), the reference log-probs of ``--beta``."""
    hidden, weight, bias = completion_hidden_states(
        model, batch, slice(0, batch["prompt_ids"].shape[0]), config.group_size
    )
    budget = None if config.loss_chunk_mib is None else config.loss_chunk_mib * 2**20
    return fused_linear_token_logprobs_and_entropy(
        hidden,
        weight,
        batch["completion_ids"],
        batch["completion_mask"],
        lm_head_bias=bias,
        temperature=config.temperature,
        max_chunk_bytes=budget,
        **head_arguments(head),
    )


def update(
    policy: nn.Module,
    optimizer: PolicyOptimizer,
    batch: dict,
    loss_config: GTPOConfig,
    config: TrainConfig,
    dist: Distributed,
    old_logprobs,
    initial_entropy,
    ref_logprobs=None,
) -> dict:
    """One optimiser update from this process's rollout rows: micro-batches of whole prompt groups, the loss of
    each divided by the whole batch's counts (all processes), gradients summed; no step without signal.
    Returns the step's loss (the whole batch's), metrics (merged over micro-batches and processes) and
    whether the optimiser stepped."""
    mask = batch["completion_mask"]
    counts = dist.all_sum(torch.tensor([mask.shape[0], mask.sum()], dtype=torch.float64, device=dist.device))
    num_sequences, num_tokens = counts[0], counts[1]
    n_groups = batch["prompt_ids"].shape[0]
    if n_groups % config.grad_accum_steps:  # check_process_shares refuses this at start
        raise ValueError(f"{n_groups} prompt groups cannot be split into {config.grad_accum_steps} equal micro-batches")
    per_micro = n_groups // config.grad_accum_steps
    optimizer.zero_grad()
    loss_sum = torch.zeros((), dtype=torch.float64, device=dist.device)
    metrics = []
    for k in range(config.grad_accum_steps):
        groups = slice(k * per_micro, (k + 1) * per_micro)
        with no_sync(policy, last=k == config.grad_accum_steps - 1):
            with autocast(config, dist.device):
                out = policy(
                    batch,
                    groups,
                    loss_config,
                    config,
                    old_logprobs=old_logprobs,
                    ref_logprobs=ref_logprobs,
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
    return {"loss": float(dist.all_sum(loss_sum)), "metrics": merged, "stepped": signal, "grad_norm": grad_norm}


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
