"""Per-token log-prob and entropy with a closed-form backward: the only vocabulary-sized work.

`token_stats` runs a backend's kernels through the registered operator ``gtpo_kernels::token_stats``
(`custom_ops`), or through the `TokenStats` autograd Function for the in-place gradient mode;
`token_logprobs_and_entropy` is the public no-grad forward (old and reference log-probs, the initial
entropy).

``inplace=True`` passes the logits themselves as the backward's output buffer: the gradient replaces the
logits, saving an ``[N, L, V]`` buffer. Their version counter is then bumped, so any other autograd node
that saved the same tensor and runs later raises "modified by an inplace operation" rather than reading
gradients as logits.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import custom_ops, validation
from ._autograd import first_derivative_only
from .backends import Backend, get_backend, kernels_for, resolve_backend_name
from .vocab_parallel import vocab_parallel_token_stats


class TokenStats(torch.autograd.Function):
    """``(logits [N, L, V], ids, valid, kernels, temperature) -> (logp, H)``, each ``[N, L]``, of
    ``softmax(logits / temperature)``, whose backward writes the gradient over the logits themselves (the
    in-place gradient mode; the registered operator's backward writes a new tensor). Both run
    `custom_ops.token_stats_gradient`.

    The backward is the closed form of docs/method.md and is not itself differentiable: a second derivative
    through it raises an error instead of returning a wrong one."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, kernels: Backend, temperature):
        if logits.stride(-1) != 1:
            logits = logits.contiguous()  # the kernels stream rows of V; strided rows are copied once
        row_max, log_s, logp, entropy = kernels.forward(logits, ids, valid, temperature)
        ctx.save_for_backward(logits, ids, valid, row_max, log_s, logp, entropy)
        ctx.kernels, ctx.temperature = kernels, temperature
        return logp, entropy

    @staticmethod
    @first_derivative_only
    def backward(ctx, grad_logp: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor]):
        saved = ctx.saved_tensors
        logits = saved[0]
        custom_ops.token_stats_gradient(ctx.kernels, saved, grad_logp, grad_entropy, logits, ctx.temperature)
        torch.autograd.graph.increment_version(logits)
        return logits, None, None, None, None


def token_stats(
    backend: str,
    logits: torch.Tensor,
    ids: torch.Tensor,
    valid: torch.Tensor,
    *,
    temperature: float = 1.0,
    max_chunk_bytes: Optional[int] = None,
    inplace: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(logp, H)`` ``[N, L]`` from a resolved backend (by name); differentiable w.r.t. ``logits``. Through the
    registered operator ``gtpo_kernels::token_stats`` (what ``torch.compile`` sees); the in-place gradient mode, which
    writes over a saved input, through `TokenStats` (eager mode). ``max_chunk_bytes`` is the chunk budget of a
    chunked backend (`chunk_budget`)."""
    if inplace:
        if logits.requires_grad and logits.is_leaf:
            raise ValueError(
                "inplace_backward=True would write the gradient over a leaf tensor that is its own "
                "parameter (logits.grad would alias logits); use it on logits computed by the "
                "model, or set inplace_backward=False"
            )
        kernels = kernels_for(get_backend(backend), logits.dtype, max_chunk_bytes)
        return TokenStats.apply(logits, ids, valid, kernels, float(temperature))
    if logits.stride(-1) != 1:
        logits = logits.contiguous()  # the kernels stream rows of V; strided rows are copied once
    _, _, logp, entropy = custom_ops.token_stats(logits, ids, valid, float(temperature), backend, max_chunk_bytes or 0)
    return logp, entropy


def token_stats_of_vocabulary(
    backend: str,
    logits: torch.Tensor,
    ids: torch.Tensor,
    valid: torch.Tensor,
    *,
    temperature: float = 1.0,
    max_chunk_bytes: Optional[int] = None,
    inplace: bool = False,
    vocab_group=None,
) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """``(logp, H, V)``: `token_stats` of ``logits``, or with ``vocab_group`` of this rank's vocabulary shard combined
    with the group's (`vocab_parallel`; never in place), and the whole vocabulary's size ``V``."""
    if vocab_group is None:
        logp, entropy = token_stats(
            backend, logits, ids, valid, temperature=temperature, max_chunk_bytes=max_chunk_bytes, inplace=inplace
        )
        return logp, entropy, logits.shape[-1]
    kernels = kernels_for(get_backend(backend), logits.dtype, max_chunk_bytes)
    logp, entropy, shards = vocab_parallel_token_stats(logits, ids, valid, kernels, temperature, vocab_group)
    return logp, entropy, shards.vocab_size


def token_logprobs_and_entropy(
    logits: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: Optional[torch.Tensor] = None,
    *,
    temperature: float = 1.0,
    backend: str = "auto",
    validate: bool = True,
    vocab_group=None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs and entropies without gradient, e.g. for ``old_logprobs``/``ref_logprobs``.

    Args:
        logits: ``[N, L, V]``.
        completion_ids: ``[N, L]`` integer ids.
        completion_mask: ``[N, L]``; masked positions return 0 (default: all unmasked).
        temperature: the statistics are those of ``softmax(logits / temperature)``, computed inside the
            kernels (no scaled copy of the logits).
        vocab_group: the process group over which the vocabulary is sharded (``logits`` is this rank's
            ``[N, L, V_r]`` shard; `gtpo_loss`'s argument of the same name).

    Returns:
        ``(logp, H)``, each ``[N, L]`` float32 (float64 for float64 logits), one pass over the logits.
    """
    validation.check_logits(logits)
    checks = validation.DeferredChecks(validate and not torch.compiler.is_compiling())
    valid, temperature = validation.check_stats_inputs(
        logits, "logits [N, L, V]", completion_ids, completion_mask, temperature, checks
    )
    backend = resolve_backend_name(backend, logits.device.type)
    with torch.no_grad():
        logp, entropy, vocab_size = token_stats_of_vocabulary(
            backend, logits, completion_ids, valid, temperature=temperature, vocab_group=vocab_group
        )
    validation.add_stats_check(checks, logp, entropy, valid, completion_ids, vocab_size)
    checks.read()  # one host synchronisation
    return logp, entropy
