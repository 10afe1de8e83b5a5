"""`gtpo_loss` and `GTPOLoss`: the public GTPO loss on logits, with a choice of backend."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from . import validation
from .config import GTPOConfig
from .reference import conflict_weights, gtpo_loss_from_token_stats
from .result import GTPOLossOutput
from .token_stats import resolve_backend, token_stats

def gtpo_loss(
    logits: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    group_size: int,
    config: Optional[GTPOConfig] = None,
    old_logprobs: Optional[torch.Tensor] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    initial_entropy: Optional[float] = None,
    backend: str = "auto",
) -> GTPOLossOutput:
    """The GTPO loss of a batch of completions, from the policy's logits.

    Args:
        logits: ``[N, L, V]``, ``N = B * G`` completions with the rows of a prompt group contiguous;
            ``logits[i, t]`` predicts ``completion_ids[i, t]`` (already shifted by the caller).
            float16, bfloat16, float32 or float64; statistics accumulate in float32 (float64 for
            float64 input). ``-inf`` entries (banned tokens) are allowed.
        completion_ids: ``[N, L]`` integer token ids; values at masked positions are ignored.
        completion_mask: ``[N, L]`` bool or 0/1, a contiguous prefix of ones per row (EOS included).
        advantages: ``[N]`` float, e.g. from `compute_advantages`.
        group_size: ``G``, completions per prompt; must divide ``N``.
        config: `GTPOConfig` (default: the ``"paper"`` preset).
        old_logprobs: ``[N, L]`` log-probs of the sampling policy, for off-policy updates
            (``num_iterations > 1``); without them the ratio is ``exp(logp - logp.detach())``.
        ref_logprobs: ``[N, L]`` reference-model log-probs, for the KL term and metric.
        initial_entropy: the policy's mean token entropy at the first step, for the entropy gate.
        backend: ``"auto"`` (Triton for CUDA tensors, the C++ kernels for CPU tensors), ``"triton"``
            (fused kernels; on CPU tensors only under ``TRITON_INTERPRET=1``), ``"cpu"`` (C++ kernels)
            or ``"torch"`` (chunked plain PyTorch).

    Returns:
        `GTPOLossOutput` with ``.loss`` (0-d, differentiable w.r.t. ``logits``) and ``.metrics``
        (`GTPOMetrics`, detached). A batch with every position masked gives a zero loss and zero
        gradients.
    """
    validation.check_logits(logits)
    config, valid, initial_entropy = prepare_loss_inputs(
        logits, completion_ids, completion_mask, advantages, group_size, config, old_logprobs, ref_logprobs,
        initial_entropy, vocab_size=logits.shape[-1], what="logits [N, L, V]")
    backend = resolve_backend(backend, logits.device)

    logp, entropy = token_stats(backend, logits, completion_ids, valid, chunk_size=config.chunk_size,
                                inplace=config.inplace_backward)
    if config.validate_inputs:
        validation.check_token_stats_finite(logp, entropy, valid)
    lambda_, n_conflict = batch_conflict_weights(config, backend, completion_ids, valid, advantages, group_size,
                                                 logp.dtype)
    return gtpo_loss_from_token_stats(
        logp, entropy, valid, advantages.detach(), lambda_, n_conflict, config,
        old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, initial_entropy=initial_entropy,
    )


def prepare_loss_inputs(source, completion_ids, completion_mask, advantages, group_size, config, old_logprobs,
                        ref_logprobs, initial_entropy, vocab_size: int, what: str):
    """Checks the inputs shared by every GTPO loss entry point.

    ``source`` is the ``[N, L, *]`` tensor the loss reads (logits or hidden states), named ``what`` in
    errors; ids at unmasked positions must lie in ``[0, vocab_size)``.
    Returns ``(config, valid [N, L] bool, initial_entropy float|None)``.
    """
    config = config or GTPOConfig()
    if not isinstance(config, GTPOConfig):
        raise TypeError(f"config must be a GTPOConfig, got {type(config).__name__}")
    shape = validation.check_ids(completion_ids)
    if tuple(source.shape[:2]) != shape:
        raise ValueError(f"{what} = {tuple(source.shape)} and completion_ids [N, L] = {shape} disagree on N "
                         f"or L; position t of row i must predict completion_ids[i, t]")
    valid, initial_entropy = validation.check_loss_inputs(
        source, completion_ids, completion_mask, advantages, group_size, old_logprobs, ref_logprobs,
        initial_entropy, sync=config.validate_inputs,
        vocab_size=vocab_size,
    )
    if config.kl_beta and ref_logprobs is None:
        raise ValueError(f"config.kl_beta = {config.kl_beta} needs ref_logprobs [N, L]; pass the reference "
                         f"model's log-probs or set kl_beta=0")
    return config, valid, initial_entropy


def batch_conflict_weights(config: GTPOConfig, backend: str, completion_ids, valid, advantages, group_size,
                           dtype: torch.dtype):
    """``(lambda_ [N, L], n_conflict [N])`` for the whole batch, or ones/zeros when disabled."""
    n_rows, length = completion_ids.shape
    if not config.use_conflict_weights:
        return (torch.ones((n_rows, length), dtype=dtype, device=valid.device),
                torch.zeros(n_rows, dtype=torch.long, device=valid.device))
    weights_fn = conflict_weights
    if backend == "triton" and dtype == torch.float32:
        from .ops.conflict_weights_triton import conflict_weights_triton as weights_fn
    elif backend == "cpu" and dtype == torch.float32:
        from .ops.token_stats_cpu import conflict_weights_cpu as weights_fn
    return weights_fn(completion_ids, valid, advantages.detach().to(dtype), group_size, config.conflict_weight)


class GTPOLoss(nn.Module):
    """`gtpo_loss` as a module: ``GTPOLoss(config)(logits, ids, mask, advantages, group_size=G)``."""

    def __init__(self, config: Optional[GTPOConfig] = None, backend: str = "auto") -> None:
        super().__init__()
        self.config = config or GTPOConfig()
        self.backend = backend

    def forward(self, logits, completion_ids, completion_mask, advantages, *, group_size, old_logprobs=None,
                ref_logprobs=None, initial_entropy=None) -> GTPOLossOutput:
        return gtpo_loss(
            logits, completion_ids, completion_mask, advantages, group_size=group_size, config=self.config,
            old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, initial_entropy=initial_entropy,
            backend=self.backend,
        )

    def extra_repr(self) -> str:
        return f"preset={self.config.preset!r}, backend={self.backend!r}"
