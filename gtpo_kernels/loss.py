"""`gtpo_loss` and `GTPOLoss`: the public GTPO loss on logits, with a choice of backend."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from . import validation
from .backends import resolve_backend_name
from .config import GTPOConfig
from .conflict import with_conflict_weights
from .objective import entropy_floor, loss_from_token_stats
from .packed import Packing, padded_rows
from .result import GTPOLossOutput
from .rows import LossRows, checked_rows, resolved_config, rows_of_call, takes_row_keywords
from .token_stats import token_stats
from .vocab_parallel import quantile_gather


@takes_row_keywords()
def gtpo_loss(
    logits: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    config: Optional[GTPOConfig] = None,
    backend: str = "auto",
    vocab_group=None,
    cu_seqlens: Optional[torch.Tensor] = None,
    entropy_quantile_group=None,
    **row_keywords,
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
        sampling_logprobs: ``[N, L]`` the sampler's own log-probs of the tokens (vLLM's), for
            ``config.sampling_correction`` (NaN where the sampler reported none).
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
            computed inside the kernels (no scaled copy); the gradient is with respect to ``logits``. A float, or
            an ``[N]`` tensor, each completion's own (mixed-temperature rollouts): a per-row scale read inside
            the kernels.
        backend: ``"auto"`` (Triton for CUDA tensors, the C++ kernels for CPU tensors), ``"triton"``
            (fused kernels; on CPU tensors only under ``TRITON_INTERPRET=1``), ``"cpu"`` (C++ kernels)
            or ``"torch"`` (chunked plain PyTorch).
        vocab_group: a ``torch.distributed`` process group over which the vocabulary is sharded (tensor
            parallelism): ``logits`` is then this rank's ``[N, L, V_r]`` shard, the shards in the group's rank
            order (any sizes), and every other argument the same on every rank. The loss and statistics are
            the whole vocabulary's, on every rank; the gradient is this shard's (docs/method.md,
            "Vocabulary-parallel logits"). ``completion_ids`` are ids of the whole vocabulary.
        cu_seqlens: ``[N + 1]`` int offsets of packed completions (flash-attention's varlen layout): ``logits``
            is then ``[T, V]``, ``completion_ids``, ``completion_mask`` and the per-token log-probs ``[T]``,
            ``conflict`` ``(lambda [T], n_conflict [N])``, completion ``i`` the tokens ``cu_seqlens[i]`` to
            ``cu_seqlens[i + 1]`` (`packed`); the same loss as the padded call. One host read of the offsets.
        entropy_quantile_group: with ``config.top_entropy_quantile < 1``, the process group whose tokens the
            entropy threshold is a quantile of (TRL's: every process's); ``None``: this call's tokens.

    Returns:
        `GTPOLossOutput` with ``.loss`` (0-d, differentiable w.r.t. ``logits``) and ``.metrics``
        (`GTPOMetrics` of this call's rows, detached; merge calls with `GTPOMetrics.merge`). A batch with
        every position masked gives a zero loss and zero gradients.
    """
    given = rows_of_call("gtpo_loss", completion_ids, completion_mask, advantages, row_keywords)
    packing = None
    if cu_seqlens is not None:
        given, packing = padded_rows(logits, "logits", given, cu_seqlens)
        logits = logits[None]  # the kernels see one row of T positions
    groups = dict(vocab_group=vocab_group, quantile_group=entropy_quantile_group)
    return loss_of_rows(logits, given, config, backend, stacklevel=4, packing=packing, **groups)


def loss_of_rows(
    logits: torch.Tensor,
    given: LossRows,
    config: Optional[GTPOConfig],
    backend: str = "auto",
    stacklevel: int = 3,
    vocab_group=None,
    packing: Optional[Packing] = None,
    quantile_group=None,
) -> GTPOLossOutput:
    """`gtpo_loss` on the per-row inputs ``given`` as one bundle (checked here), e.g. a `LossRows.slice` of a
    batch's. ``stacklevel``: where a warning points (3: this function's caller). With ``packing``, ``logits`` is
    ``[1, T, V]`` and ``given`` the padded rows (`packed.padded_rows`)."""
    validation.check_logits(logits)
    config = resolved_config(config)
    # A packed call's rows are checked in their padded [N, L] layout (a free expanded view stands for the logits).
    layout = logits if packing is None else logits.new_empty(()).expand(*packing.shape, logits.shape[-1])
    rows, checks = checked_rows(layout, "logits", given, config)
    backend_ = resolve_backend_name(backend, logits.device.type)
    ids, valid, temperature = rows.ids, rows.valid, rows.token_temperature
    if packing is not None:
        ids, valid = packing.unpad(ids)[None], packing.unpad(valid)[None]
        if isinstance(temperature, torch.Tensor):
            temperature = packing.unpad(temperature)[None]
    logp, entropy, vocab_size = token_stats(
        backend_,
        logits,
        ids,
        valid,
        temperature=temperature,
        max_chunk_bytes=config.max_chunk_bytes,
        inplace=config.inplace_backward,
        vocab_group=vocab_group,
    )
    if packing is not None:
        logp, entropy = packing.pad(logp[0]), packing.pad(entropy[0])
    if config.top_entropy_quantile < 1 and rows.entropy_floor is None:  # the whole call's (and group's) threshold
        rows = rows.replace(entropy_floor=entropy_floor(entropy, rows.valid, config, quantile_gather(quantile_group)))
    # The kernels report ids outside the vocabulary, NaN/+inf logits and sampled -inf tokens as NaN statistics
    # (the same on every rank of a vocab_group: the statistics are the combined ones).
    validation.add_stats_check(checks, logp, entropy, rows.valid, rows.ids, vocab_size)
    rows = with_conflict_weights(rows, config, backend_)
    out = loss_from_token_stats(logp, entropy, rows, config)
    if config.warn_no_signal:
        metrics = out.metrics
        checks.add_warning(
            metrics.signal_fraction == 0,
            "no_signal",
            lambda: validation.no_signal_message(float(metrics.filtered_fraction), config),
        )
    checks.read(stacklevel=stacklevel)  # the call's one host synchronisation, after every kernel is queued
    return out


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
