"""Per-token log-prob and entropy with a closed-form backward: the only vocabulary-sized work.

`TokenStats` wraps any backend's kernels for autograd; `token_logprobs_and_entropy` is the public
no-grad forward (old and reference log-probs, the initial entropy).

``inplace=True`` passes the logits themselves as the backward's output buffer: the gradient replaces the
logits, saving an ``[N, L, V]`` buffer. Their version counter is then bumped, so any other autograd node
that saved the same tensor and runs later raises "modified by an inplace operation" rather than reading
gradients as logits.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch

from . import validation
from .backends import Backend, kernels_for, resolve_backend


def first_derivative_only(backward):
    """Marks a custom ``backward`` as not differentiable. Like ``torch.autograd.function.once_differentiable``,
    a second derivative through it raises instead of silently treating the gradient as a constant, but
    always: the stock decorator lets the gradient through as a constant when the incoming gradient does not
    require grad (``loss = logp.sum()``, the fused loss), which gives a wrong second derivative."""
    message = (b"trying to differentiate twice a gtpo_kernels loss: its backward is closed-form and "
               b"once_differentiable (second derivatives: use gtpo_kernels.reference on float64 logits)")

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        if not torch.is_grad_enabled():
            return outputs
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        flags = [isinstance(o, torch.Tensor) for o in outputs]
        tensors = [o.detach().requires_grad_() for o, is_tensor in zip(outputs, flags) if is_tensor]
        guarded = torch._C._functions.DelayedError(message, len(tensors))(*tensors)
        guarded = iter((guarded,) if isinstance(guarded, torch.Tensor) else guarded)
        return tuple(next(guarded) if is_tensor else o for o, is_tensor in zip(outputs, flags))

    return wrapper


class TokenStats(torch.autograd.Function):
    """``(logits [N, L, V], ids, valid, kernels, temperature, max_chunk_bytes, inplace) -> (logp, H)``, each
    ``[N, L]``, of ``softmax(logits / temperature)``.

    The backward is the closed form of SPEC.md and is not itself differentiable: a second derivative
    through it raises an error instead of returning a wrong one."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, kernels: Backend,
                temperature: float, max_chunk_bytes: Optional[int], inplace: bool):
        if logits.stride(-1) != 1:
            logits = logits.contiguous()  # the kernels stream rows of V; strided rows are copied once
        row_max, log_s, logp, entropy = kernels.forward(logits, ids, valid, temperature, max_chunk_bytes)
        ctx.save_for_backward(logits, ids, valid, row_max, log_s, logp, entropy)
        ctx.kernels, ctx.temperature, ctx.max_chunk_bytes, ctx.inplace = kernels, temperature, max_chunk_bytes, inplace
        return logp, entropy

    @staticmethod
    @first_derivative_only
    def backward(ctx, grad_logp: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor]):
        logits, ids, valid, row_max, log_s, logp, entropy = ctx.saved_tensors
        grad_logp = torch.zeros_like(logp) if grad_logp is None else grad_logp
        grad_entropy = torch.zeros_like(logp) if grad_entropy is None else grad_entropy
        out = logits if ctx.inplace else torch.empty_like(logits, memory_format=torch.contiguous_format)
        ctx.kernels.backward(logits, ids, valid, row_max, log_s, logp, entropy, grad_logp, grad_entropy, out,
                             ctx.temperature, ctx.max_chunk_bytes)
        if ctx.inplace:
            torch.autograd.graph.increment_version(logits)
        return out, None, None, None, None, None, None


def token_stats(backend: Backend, logits: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, *,
                temperature: float = 1.0, max_chunk_bytes: Optional[int] = None,
                inplace: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(logp, H)`` ``[N, L]`` from a resolved backend; differentiable w.r.t. ``logits``."""
    if inplace and logits.requires_grad and logits.is_leaf:
        raise ValueError("inplace_backward=True would write the gradient over a leaf tensor that is its own "
                         "parameter (logits.grad would alias logits); use it on logits computed by the "
                         "model, or set inplace_backward=False")
    return TokenStats.apply(logits, ids, valid, kernels_for(backend, logits.dtype), float(temperature),
                            max_chunk_bytes, inplace)


def token_logprobs_and_entropy(
    logits: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: Optional[torch.Tensor] = None,
    *,
    temperature: float = 1.0,
    backend: str = "auto",
    validate: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs and entropies without gradient, e.g. for ``old_logprobs``/``ref_logprobs``.

    Args:
        logits: ``[N, L, V]``.
        completion_ids: ``[N, L]`` integer ids.
        completion_mask: ``[N, L]`` prefix mask; masked positions return 0 (default: all unmasked).
        temperature: the statistics are those of ``softmax(logits / temperature)``, computed inside the
            kernels (no scaled copy of the logits).

    Returns:
        ``(logp, H)``, each ``[N, L]`` float32 (float64 for float64 logits), one pass over the logits.
    """
    validation.check_logits(logits)
    shape = validation.check_ids(completion_ids)
    if tuple(logits.shape[:2]) != shape:
        raise ValueError(f"logits [N, L, V] = {tuple(logits.shape)} and completion_ids [N, L] = {shape} "
                         f"disagree on N or L")
    temperature = validation.check_temperature(temperature)
    validation.check_same_device(logits=logits, completion_ids=completion_ids, completion_mask=completion_mask)
    if completion_mask is None:
        valid = torch.ones(shape, dtype=torch.bool, device=logits.device)
    else:
        valid = validation.check_mask(completion_mask, shape, sync=validate)
    if validate:
        validation.check_ids_in_vocab(completion_ids, valid, logits.shape[-1])
    with torch.no_grad():
        logp, entropy = token_stats(resolve_backend(backend, logits.device), logits, completion_ids, valid,
                                    temperature=temperature)
    if validate:
        validation.check_token_stats_finite(logp, entropy, valid)
    return logp, entropy
