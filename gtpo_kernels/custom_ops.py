"""The kernels' registered operators in the ``gtpo_kernels`` namespace (``torch.library``), so that
``torch.compile(fullgraph=True)`` traces a training step through the losses without a graph break. They know
nothing of the GTPO objective: the fused loss's operator, which runs the objective inside its chunk walk, is
registered beside its public function (`fused_linear`).

    gtpo_kernels::token_stats(logits, ids, valid, temperature, token_temperature, backend, max_chunk_bytes,
                              inplace, vocab_group, shard_sizes)
        -> (row_max, log_s, logp, H)                       autograd registered; backward is the next op
    gtpo_kernels::token_stats_backward(logits, ids, valid, row_max, log_s, logp, H, grad_logp, grad_H,
                                       temperature, token_temperature, backend, max_chunk_bytes) -> dlogits

(``token_temperature``: ``None``, or each token's temperature ``[N, L]``, which then replaces ``temperature``.)
    gtpo_kernels::conflict_weights(ids, valid, advantages, group_size, weight, backend) -> (lambda, n_conflict)
    (gtpo_kernels::fused_linear_gtpo, the whole fused hidden @ lm_head loss: `fused_linear`)

Each is registered by `operators.register_operator`, which keeps its parameter names: its autograd reads its
inputs by name. Each has a fake (meta) implementation, so the compiler knows its output shapes without running it, and
each backend's kernels run inside (``backend`` names a registered backend). A second derivative through
the closed-form backwards raises, as in eager mode. Everything else in the losses is plain torch code,
which the compiler traces; value checks (`validation`) run only in eager mode.
"""

# No `from __future__ import annotations` here: torch.library.custom_op reads the signatures of the operators
# registered in this module, and torch 2.4-2.6 cannot read annotations written as strings (tools/torch-matrix.md).
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ._autograd import SECOND_DERIVATIVE, first_derivative_only, is_plain
from .backends import get_backend, kernels_for
from .backends.base import Backend, stats_dtype
from .operators import Inputs, gradients_for, register_operator
from .vocab_parallel import VocabParallel

NAMESPACE = "gtpo_kernels"


# ------------------------------------------------------------------------------------------ token statistics


def token_stats_gradient(
    kernels: Backend,
    saved,
    grad_logp: Optional[Tensor],
    grad_entropy: Optional[Tensor],
    out: Tensor,
    temperature,
) -> Tensor:
    """The one backward of the token statistics: writes the gradient of ``sum grad_logp logp + grad_H H`` with respect
    to the logits into ``out`` (which may be the logits themselves: the in-place mode) and returns it. ``saved =
    (logits, ids, valid, row_max, log_s, logp, H)`` (``ids`` in the logits' own columns: a vocabulary shard's
    neighbours' ids fall outside them); ``grad_logp`` None is zero, ``grad_H`` None is zero (nothing downstream
    differentiates the entropy: the kernels skip its term)."""
    logits, ids, valid, row_max, log_s, logp, entropy = saved
    grad_logp = torch.zeros_like(logp) if grad_logp is None else grad_logp
    kernels.backward(logits, ids, valid, row_max, log_s, logp, entropy, grad_logp, grad_entropy, out, temperature)
    return out


@register_operator(f"{NAMESPACE}::token_stats")
def token_stats(
    logits: Tensor,
    ids: Tensor,
    valid: Tensor,
    temperature: float,
    token_temperature: Optional[Tensor],
    backend: str,
    max_chunk_bytes: int,
    inplace: bool,
    vocab_group: Optional[str],
    shard_sizes: Optional[List[int]],
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(row_max, log_s, logp, H)`` ``[N, L]`` of ``softmax(logits / temperature)``; ``max_chunk_bytes`` (for a
    chunked backend) 0: its default. ``logits`` must have a contiguous last dimension. ``inplace``: the backward writes
    the gradient over the logits (eager mode; traced, it writes a new tensor). ``vocab_group`` (the name
    `vocab_parallel.group_name` gave it) with each rank's ``shard_sizes``: ``logits`` is this rank's shard of the
    vocabulary and the statistics are the whole vocabulary's, combined over the group (one all-gather), zeros where
    masked."""
    kernels = kernels_for(get_backend(backend), logits.dtype, max_chunk_bytes or None)
    temperature = _either(temperature, token_temperature)
    vocab_parallel = VocabParallel.named(vocab_group, shard_sizes)
    if vocab_parallel is None:
        return tuple(kernels.forward(logits, ids, valid, temperature))
    # This shard's statistics (an id another shard holds falls outside its columns), then the whole vocabulary's.
    shard = torch.stack(kernels.forward(logits, ids.long() - vocab_parallel.shards.offset, valid, temperature))
    combined = vocab_parallel.combine(shard, ids, temperature)
    return tuple(torch.where(valid, t, torch.zeros((), dtype=t.dtype, device=t.device)) for t in combined)


def _either(temperature: float, token_temperature: Optional[Tensor]):
    return temperature if token_temperature is None else token_temperature


@token_stats.register_fake
def _(logits, ids, valid, *settings):
    shape, dtype = logits.shape[:2], stats_dtype(logits.dtype)
    return tuple(logits.new_empty(shape, dtype=dtype) for _ in range(4))


@register_operator(f"{NAMESPACE}::token_stats_backward")
def token_stats_backward(
    logits: Tensor,
    ids: Tensor,
    valid: Tensor,
    row_max: Tensor,
    log_s: Tensor,
    logp: Tensor,
    entropy: Tensor,
    grad_logp: Optional[Tensor],
    grad_entropy: Optional[Tensor],
    temperature: float,
    token_temperature: Optional[Tensor],
    backend: str,
    max_chunk_bytes: int,
) -> Tensor:
    """`token_stats_gradient` into a new tensor (``ids`` in the logits' own columns)."""
    kernels = kernels_for(get_backend(backend), logits.dtype, max_chunk_bytes or None)
    out = torch.empty_like(logits, memory_format=torch.contiguous_format)
    saved = (logits, ids, valid, row_max, log_s, logp, entropy)
    return token_stats_gradient(kernels, saved, grad_logp, grad_entropy, out, _either(temperature, token_temperature))


@token_stats_backward.register_fake
def _(logits, ids, valid, row_max, log_s, logp, entropy, grad_logp, grad_entropy, *settings):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _token_stats_setup(ctx, inputs, output):
    given = Inputs(token_stats, inputs)
    ctx.save_for_backward(given.logits, given.ids, given.valid, *output, given.token_temperature)
    ctx.settings = given.pick(("temperature", "backend", "max_chunk_bytes"))
    ctx.inplace = given.inplace
    vocab_parallel = VocabParallel.named(given.vocab_group, given.shard_sizes)
    ctx.id_offset = 0 if vocab_parallel is None else vocab_parallel.shards.offset


def _token_stats_grad(ctx, grad_row_max, grad_log_s, grad_logp, grad_entropy):
    logits, ids, valid, row_max, log_s, logp, entropy, token_temperature = ctx.saved_tensors
    if ctx.id_offset:
        ids = ids.long() - ctx.id_offset  # this shard's columns
    saved = (logits, ids, valid, row_max, log_s, logp, entropy)
    settings = ctx.settings
    if ctx.inplace and not torch.compiler.is_compiling() and is_plain(logits):
        temperature = _either(settings["temperature"], token_temperature)
        grad = _gradient_over_the_logits(ctx, saved, grad_logp, grad_entropy, temperature)
    else:
        grad = token_stats_backward(*saved, grad_logp, grad_entropy, token_temperature=token_temperature, **settings)
    return gradients_for(token_stats, logits=grad)


def _gradient_over_the_logits(ctx, saved, grad_logp, grad_entropy, temperature) -> Tensor:
    """The in-place mode's backward: the gradient written over the saved logits, whose version is then bumped, so that
    any other node that saved them and runs later raises "modified by an inplace operation" instead of reading
    gradients as logits. Not differentiable (`first_derivative_only`)."""

    @first_derivative_only
    def write(ctx, grad_logp, grad_entropy):
        logits = saved[0]
        backend, max_chunk_bytes = ctx.settings["backend"], ctx.settings["max_chunk_bytes"]
        kernels = kernels_for(get_backend(backend), logits.dtype, max_chunk_bytes or None)
        token_stats_gradient(kernels, saved, grad_logp, grad_entropy, logits, temperature)
        torch.autograd.graph.increment_version(logits)
        return logits

    return write(ctx, grad_logp, grad_entropy)


def _refuse_second_derivative(ctx, *grads):
    raise RuntimeError(SECOND_DERIVATIVE)


torch.library.register_autograd(f"{NAMESPACE}::token_stats", _token_stats_grad, setup_context=_token_stats_setup)
torch.library.register_autograd(
    f"{NAMESPACE}::token_stats_backward", _refuse_second_derivative, setup_context=lambda ctx, inputs, output: None
)


# ------------------------------------------------------------------------------------------ conflict weights


@register_operator(f"{NAMESPACE}::conflict_weights")
def conflict_weights(
    ids: Tensor, valid: Tensor, advantages: Tensor, group_size: int, weight: float, backend: str
) -> Tuple[Tensor, Tensor]:
    """``(lambda [N, L], n_conflict [N])`` of whole groups (see `gtpo_kernels.conflict_weights`)."""
    kernels = get_backend("torch") if advantages.dtype == torch.float64 else get_backend(backend)
    return tuple(kernels.conflict_weights(ids, valid, advantages, group_size, weight))


@conflict_weights.register_fake
def _(ids, valid, advantages, group_size, weight, backend):
    dtype = stats_dtype(advantages.dtype)
    return ids.new_empty(ids.shape, dtype=dtype), ids.new_empty(ids.shape[:1], dtype=torch.int64)
