"""Backend choice and dispatch for the vocabulary-sized work, and the public no-grad forward.

A backend maps ``logits [N, L, V]`` to per-token ``(logp, H)`` (float32, float64 for float64
logits) with a closed-form backward; everything after that is ``O(N L)`` and shared.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Optional, Tuple

import torch

from . import validation
from ._extension import cpu_extension_available
from .ops.function import TokenStats

BACKENDS = ("auto", "torch", "triton", "cpu")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_backend(backend: str, device: torch.device) -> str:
    """The concrete backend for tensors on ``device``: ``"auto"`` takes Triton for CUDA tensors, the
    C++ kernels for CPU tensors, and the chunked PyTorch path when those are unavailable."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if device.type == "cuda":
            return "triton" if triton_available() else "torch"
        if device.type == "cpu" and cpu_extension_available():
            return "cpu"
        return "torch"
    if backend == "cpu" and device.type != "cpu":
        raise ValueError(f"backend='cpu' needs CPU tensors, got tensors on {device}; use backend='auto'")
    if backend == "triton":
        if not triton_available():
            raise ValueError("backend='triton' needs the triton package: pip install triton (Linux), "
                             "or use backend='torch'")
        if device.type != "cuda" and not triton_interpreted():
            raise ValueError(f"backend='triton' needs CUDA tensors, got tensors on {device}; use "
                             f"backend='torch' (or set TRITON_INTERPRET=1 before importing triton to run "
                             f"the kernels on the CPU, slowly, for testing)")
    return backend


def token_stats(
    backend: str, logits: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, *,
    chunk_size: Optional[int] = None, inplace: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(logp, H)`` ``[N, L]`` from a resolved backend; differentiable w.r.t. ``logits``."""
    if inplace and logits.requires_grad and logits.is_leaf:
        raise ValueError("inplace_backward=True would write the gradient over a leaf tensor that is its own "
                         "parameter (logits.grad would alias logits); use it on logits computed by the "
                         "model, or set inplace_backward=False")
    kernels = kernels_for(backend, logits.dtype)
    return TokenStats.apply(logits, ids, valid, kernels, chunk_size, inplace)


def kernels_for(backend: str, dtype: torch.dtype):
    """The module holding a resolved backend's ``forward``/``backward`` (see `ops.function`)."""
    if backend == "triton" and dtype != torch.float64:
        from .ops import token_stats_triton

        return token_stats_triton
    if backend == "cpu" and dtype != torch.float64:
        from .ops import token_stats_cpu

        return token_stats_cpu
    if backend in ("torch", "triton", "cpu"):
        # float64 (the oracle's dtype) stays exact in the torch path; the kernels accumulate in float32.
        from .ops import token_stats_torch

        return token_stats_torch
    raise AssertionError(f"unresolved backend {backend!r}")


def token_logprobs_and_entropy(
    logits: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: Optional[torch.Tensor] = None,
    *,
    backend: str = "auto",
    validate: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs and entropies without gradient, e.g. for ``old_logprobs``/``ref_logprobs``.

    Args:
        logits: ``[N, L, V]``.
        completion_ids: ``[N, L]`` integer ids.
        completion_mask: ``[N, L]`` prefix mask; masked positions return 0 (default: all unmasked).

    Returns:
        ``(logp, H)``, each ``[N, L]`` float32 (float64 for float64 logits), one pass over the logits.
    """
    validation.check_logits(logits)
    shape = validation.check_ids(completion_ids)
    if tuple(logits.shape[:2]) != shape:
        raise ValueError(f"logits [N, L, V] = {tuple(logits.shape)} and completion_ids [N, L] = {shape} "
                         f"disagree on N or L")
    if completion_mask is None:
        valid = torch.ones(shape, dtype=torch.bool, device=logits.device)
    else:
        validation.check_same_device(logits=logits, completion_mask=completion_mask)
        valid = validation.check_mask(completion_mask, shape, sync=validate)
    validation.check_same_device(logits=logits, completion_ids=completion_ids)
    if validate:
        validation.check_ids_in_vocab(completion_ids, valid, logits.shape[-1])
    with torch.no_grad():
        logp, entropy = token_stats(resolve_backend(backend, logits.device), logits, completion_ids, valid)
    if validate:
        validation.check_token_stats_finite(logp, entropy, valid)
    return logp, entropy
