"""`TokenStats`: the autograd Function shared by every backend of the vocabulary-sized work.

A backend is a module with two functions over ``logits [N, L, V]`` and ``ids, valid [N, L]``:

    forward(logits, ids, valid, chunk_size) -> (lse, logp, H)        each [N, L], zeros where masked
    backward(logits, ids, valid, lse, H, grad_logp, grad_H, out, chunk_size) -> out
        writes dlogits = grad_logp (onehot(y) - p) + grad_H dH/dz into out, zeros where masked

``inplace=True`` passes the logits themselves as ``out``: the gradient replaces the logits, saving
an ``[N, L, V]`` buffer. Their version counter is then bumped, so any other autograd node that saved
the same tensor and runs later raises "modified by an inplace operation" rather than reading
gradients as logits.
"""

from __future__ import annotations

from typing import Optional

import torch

from .inplace import increment_version


class TokenStats(torch.autograd.Function):
    """``(logits, ids, valid, backend, chunk_size, inplace) -> (logp [N, L], H [N, L])``."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, backend,
                chunk_size: Optional[int], inplace: bool):
        if logits.stride(-1) != 1:
            logits = logits.contiguous()  # the kernels stream rows of V; strided rows are copied once
        lse, logp, entropy = backend.forward(logits, ids, valid, chunk_size)
        ctx.save_for_backward(logits, ids, valid, lse, entropy)
        ctx.backend, ctx.chunk_size, ctx.inplace = backend, chunk_size, inplace
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor]):
        logits, ids, valid, lse, entropy = ctx.saved_tensors
        grad_logp = torch.zeros_like(lse) if grad_logp is None else grad_logp
        grad_entropy = torch.zeros_like(lse) if grad_entropy is None else grad_entropy
        out = logits if ctx.inplace else torch.empty_like(logits, memory_format=torch.contiguous_format)
        ctx.backend.backward(logits, ids, valid, lse, entropy, grad_logp, grad_entropy, out, ctx.chunk_size)
        if ctx.inplace:
            increment_version(logits)
        return out, None, None, None, None, None
