"""`gtpo_loss` and `GTPOLoss`: the public GTPO loss on logits, with a choice of backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import nn

from . import validation
from .backends import resolve_backend_name
from .config import GTPOConfig
from .conflict import compute_conflict_weights
from .objective import loss_from_token_stats
from .result import GTPOLossOutput
from .token_stats import token_stats

Conflict = Tuple[torch.Tensor, torch.Tensor]


def gtpo_loss(
    logits: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    group_size: Optional[int] = None,
    config: Optional[GTPOConfig] = None,
    old_logprobs: Optional[torch.Tensor] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    initial_entropy: Optional[float] = None,
    conflict: Optional[Conflict] = None,
    num_sequences=None,
    num_tokens=None,
    temperature: float = 1.0,
    backend: str = "auto",
) -> GTPOLossOutput:
    """The GTPO loss of a batch of completions, from the policy's logits.

    Args:
        logits: ``[N, L, V]``; ``logits[i, t]`` predicts ``completion_ids[i, t]`` (already shifted by the
            caller). float16, bfloat16, float32 or float64; statistics accumulate in float32 (float64 for
            float64 input). ``-inf`` entries (banned tokens) are allowed.
        completion_ids: ``[N, L]`` integer ids; values at masked positions are ignored.
        completion_mask: ``[N, L]`` bool or 0/1: 1 on the tokens to train (EOS included), right-padded. Holes
            inside a completion (a tool's output) take no part in the loss; the conflict runs still count
            them (docs/method.md, "Inputs").
        advantages: ``[N]`` float, e.g. from `compute_advantages`.
        group_size: ``G``, completions per prompt, with the rows of a group contiguous: needed only to
            compute the conflict weights here, from whole groups. May be ``None`` when ``conflict`` is
            given or the config does not use conflict weights.
        config: `GTPOConfig` (default: the ``"paper"`` preset).
        old_logprobs: ``[N, L]`` log-probs of the sampling policy, for off-policy updates
            (``num_iterations > 1``); without them the ratio is ``exp(logp - logp.detach())``.
        ref_logprobs: ``[N, L]`` reference-model log-probs, for the KL term and metric.
        initial_entropy: the policy's mean token entropy at the first step, for the entropy gate.
        conflict: ``(lambda_ [N, L], n_conflict [N])`` from `conflict_weights` on whole groups, sliced like
            these rows: for calls that hold part of a group. Ignored when the config does not use
            conflict weights.
        num_sequences, num_tokens: the whole optimisation batch's number of completions and of unmasked
            tokens (every rank and micro-batch), ints or 0-d tensors: the denominators of
            ``sequence_mean``/``dr_grpo`` and of ``token_mean`` (defaults: this call's own). With them the
            losses and gradients of calls over any partition of the batch's rows add up to the whole
            batch's.
        temperature: the sampling temperature ``T``: every statistic is that of ``softmax(logits / T)``,
            computed inside the kernels (no scaled copy); the gradient is with respect to ``logits``.
        backend: ``"auto"`` (Triton for CUDA tensors, the C++ kernels for CPU tensors), ``"triton"``
            (fused kernels; on CPU tensors only under ``TRITON_INTERPRET=1``), ``"cpu"`` (C++ kernels)
            or ``"torch"`` (chunked plain PyTorch).

    Returns:
        `GTPOLossOutput` with ``.loss`` (0-d, differentiable w.r.t. ``logits``) and ``.metrics``
        (`GTPOMetrics` of this call's rows, detached; merge calls with `GTPOMetrics.merge`). A batch with
        every position masked gives a zero loss and zero gradients.
    """
    validation.check_logits(logits)
    inputs = prepare_loss_inputs(
        logits,
        completion_ids,
        completion_mask,
        advantages,
        group_size,
        config,
        old_logprobs,
        ref_logprobs,
        initial_entropy,
        conflict,
        num_sequences,
        num_tokens,
        temperature,
        what="logits [N, L, V]",
    )
    config = inputs.config
    backend_ = resolve_backend_name(backend, logits.device.type)
    logp, entropy = token_stats(
        backend_,
        logits,
        completion_ids,
        inputs.valid,
        temperature=inputs.temperature,
        max_chunk_bytes=config.max_chunk_bytes,
        inplace=config.inplace_backward,
    )
    # The kernels report ids outside the vocabulary, NaN/+inf logits and sampled -inf tokens as NaN statistics.
    validation.add_stats_check(inputs.checks, logp, entropy, inputs.valid, completion_ids, logits.shape[-1])
    lambda_, n_conflict = loss_conflict_weights(
        config, backend_, completion_ids, inputs.valid, advantages, group_size, conflict
    )
    out = loss_from_token_stats(
        logp,
        entropy,
        inputs.valid,
        advantages,
        lambda_,
        n_conflict,
        config,
        old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs,
        initial_entropy=inputs.initial_entropy,
        num_sequences=num_sequences,
        num_tokens=num_tokens,
    )
    if config.warn_no_signal:
        metrics = out.metrics
        inputs.checks.add_warning(
            metrics.signal_fraction == 0,
            "no_signal",
            lambda: validation.no_signal_message(float(metrics.filtered_fraction), config),
        )
    inputs.checks.read()  # the call's one host synchronisation, after every kernel is queued
    return out


@dataclass
class LossInputs:
    config: GTPOConfig
    valid: torch.Tensor  # [N, L] bool
    initial_entropy: Optional[float]
    temperature: float
    checks: validation.DeferredChecks  # value checks, read once at the end of the call


def prepare_loss_inputs(
    source,
    completion_ids,
    completion_mask,
    advantages,
    group_size,
    config,
    old_logprobs,
    ref_logprobs,
    initial_entropy,
    conflict,
    num_sequences,
    num_tokens,
    temperature,
    what: str,
) -> LossInputs:
    """Checks the inputs shared by every GTPO loss entry point.

    ``source`` is the ``[N, L, *]`` tensor the loss reads (logits or hidden states), named ``what`` in
    errors. Checks of values are queued on the returned ``checks`` (the caller adds its own, e.g. the
    ids' range, and reads them all once).
    """
    config = config or GTPOConfig()
    if not isinstance(config, GTPOConfig):
        raise TypeError(f"config must be a GTPOConfig, got {type(config).__name__}")
    shape = validation.check_rows_match_ids(source, what, completion_ids)
    # Value checks need the device's answer: eager mode only (under torch.compile they would break the graph).
    checks = validation.DeferredChecks(config.validate_inputs and not torch.compiler.is_compiling())
    needs_groups = config.use_conflict_weights and conflict is None
    if needs_groups and group_size is None:
        raise ValueError(
            "the config uses conflict weights, which compare the completions of a group: pass "
            "group_size=G with whole groups, or conflict=conflict_weights(ids, mask, advantages, G) "
            "computed on whole groups and sliced like these rows (or set use_conflict_weights=False)"
        )
    if group_size is not None and not needs_groups:
        validation.check_group_size(group_size, None)
        group_size = None  # unused: not required to divide a slice's rows
    valid, initial_entropy = validation.check_loss_inputs(
        source,
        completion_ids,
        completion_mask,
        advantages,
        group_size,
        old_logprobs,
        ref_logprobs,
        initial_entropy,
        checks,
    )
    if config.use_conflict_weights and conflict is not None:
        validation.check_conflict(conflict, shape, source, what.split(" ")[0], checks)
    if config.loss_reduction == "dr_grpo" and num_sequences is not None and config.max_completion_length is None:
        raise ValueError(
            "loss_reduction='dr_grpo' divides by num_sequences * max_completion_length; for a call that "
            "holds a slice of the batch (num_sequences given) set GTPOConfig(max_completion_length=...) "
            "to the generation cap, or each slice would divide by its own padded length and the "
            "slices would not add up to the whole batch's loss"
        )
    if config.kl_beta and ref_logprobs is None:
        raise ValueError(
            f"config.kl_beta = {config.kl_beta} needs ref_logprobs [N, L]; pass the reference "
            f"model's log-probs or set kl_beta=0"
        )
    validation.check_count(
        "num_sequences", num_sequences, shape[0], checks, "the number of completions in the whole optimisation batch"
    )
    # No lower bound from this call: under DDP, which averages the processes' gradients, each process passes
    # the whole batch's tokens divided by the number of processes, which a process with long completions
    # may exceed on its own.
    validation.check_count(
        "num_tokens",
        num_tokens,
        0,
        checks,
        "the number of unmasked tokens in the whole optimisation batch (summed over every "
        "rank and micro-batch; divided by the number of processes when DDP averages them)",
    )
    return LossInputs(config, valid, initial_entropy, validation.check_temperature(temperature), checks)


def loss_conflict_weights(
    config: GTPOConfig, backend: str, completion_ids, valid, advantages, group_size, conflict: Optional[Conflict]
):
    """``(lambda_, n_conflict)`` for the loss: the given slice, computed from whole groups, or ``(None, None)``
    when the config does not use conflict weights."""
    if not config.use_conflict_weights:
        return None, None
    if conflict is not None:
        return conflict
    return compute_conflict_weights(backend, completion_ids, valid, advantages, group_size, config.conflict_weight)


class GTPOLoss(nn.Module):
    """`gtpo_loss` as a module: ``GTPOLoss(config)(logits, ids, mask, advantages, group_size=G)``."""

    def __init__(self, config: Optional[GTPOConfig] = None, backend: str = "auto") -> None:
        super().__init__()
        self.config = config or GTPOConfig()
        self.backend = backend

    def forward(self, logits, completion_ids, completion_mask, advantages, **kwargs) -> GTPOLossOutput:
        """Every keyword of `gtpo_loss` except ``config`` and ``backend``, which the module holds."""
        return gtpo_loss(
            logits, completion_ids, completion_mask, advantages, config=self.config, backend=self.backend, **kwargs
        )

    def extra_repr(self) -> str:
        return f"preset={self.config.preset!r}, backend={self.backend!r}"
