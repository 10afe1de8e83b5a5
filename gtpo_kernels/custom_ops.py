"""The vocabulary-sized work as registered operators in the ``gtpo_kernels`` namespace (``torch.library``), so
that ``torch.compile(fullgraph=True)`` traces a training step through the losses without a graph break.

    gtpo_kernels::token_stats(logits, ids, valid, temperature, token_temperature, backend, max_chunk_bytes)
        -> (row_max, log_s, logp, H)                       autograd registered; backward is the next op
    gtpo_kernels::token_stats_backward(logits, ids, valid, row_max, log_s, logp, H, grad_logp, grad_H,
                                       temperature, token_temperature, backend, max_chunk_bytes) -> dlogits

(``token_temperature``: ``None``, or each token's temperature ``[N, L]``, which then replaces ``temperature``.)
    gtpo_kernels::conflict_weights(ids, valid, advantages, group_size, weight, backend) -> (lambda, n_conflict)
    gtpo_kernels::fused_linear_gtpo(...)  the whole fused hidden @ lm_head loss (its chunk loop inside)

Each has a fake (meta) implementation, so the compiler knows its output shapes without running it, and
each backend's kernels run inside (``backend`` names a registered backend). A second derivative through
the closed-form backwards raises, as in eager mode. Everything else in the losses is plain torch code,
which the compiler traces; value checks (`validation`) run only in eager mode.
"""

from __future__ import annotations

import json
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ._autograd import SECOND_DERIVATIVE, first_derivative_only
from .backends import get_backend, kernels_for
from .backends.base import Backend, stats_dtype
from .fused_chunks import Walk, fused_forward, unmasked_tokens
from .rows import LossRows
from .vocab_parallel import VocabParallel, VocabShards, group_named

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


def _vocab_shards(vocab_group: Optional[str], shard_sizes: Optional[List[int]]) -> Optional[VocabParallel]:
    if vocab_group is None:
        return None
    group = group_named(vocab_group)
    return VocabParallel(group, VocabShards(tuple(shard_sizes), torch.distributed.get_rank(group)))


@torch.library.custom_op(f"{NAMESPACE}::token_stats", mutates_args=())
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
    vocab_parallel = _vocab_shards(vocab_group, shard_sizes)
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


@torch.library.custom_op(f"{NAMESPACE}::token_stats_backward", mutates_args=())
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
    logits, ids, valid, temperature, token_temperature, backend, max_chunk_bytes, inplace, group, sizes = inputs
    ctx.save_for_backward(logits, ids, valid, *output, token_temperature)
    ctx.settings = (temperature, backend, max_chunk_bytes)
    ctx.inplace = inplace
    vocab_parallel = _vocab_shards(group, sizes)
    ctx.id_offset = 0 if vocab_parallel is None else vocab_parallel.shards.offset


def _token_stats_grad(ctx, grad_row_max, grad_log_s, grad_logp, grad_entropy):
    logits, ids, valid, row_max, log_s, logp, entropy, token_temperature = ctx.saved_tensors
    if ctx.id_offset:
        ids = ids.long() - ctx.id_offset  # this shard's columns
    saved = (logits, ids, valid, row_max, log_s, logp, entropy)
    temperature, backend, max_chunk_bytes = ctx.settings
    if ctx.inplace and not torch.compiler.is_compiling() and _is_plain(logits):
        grad = _gradient_over_the_logits(ctx, saved, grad_logp, grad_entropy, _either(temperature, token_temperature))
    else:
        grad = token_stats_backward(
            *saved, grad_logp, grad_entropy, temperature, token_temperature, backend, max_chunk_bytes
        )
    return (grad,) + (None,) * 9


def _gradient_over_the_logits(ctx, saved, grad_logp, grad_entropy, temperature) -> Tensor:
    """The in-place mode's backward: the gradient written over the saved logits, whose version is then bumped, so that
    any other node that saved them and runs later raises "modified by an inplace operation" instead of reading
    gradients as logits. Not differentiable (`first_derivative_only`)."""

    @first_derivative_only
    def write(ctx, grad_logp, grad_entropy):
        logits = saved[0]
        kernels = kernels_for(get_backend(ctx.settings[1]), logits.dtype, ctx.settings[2] or None)
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


@torch.library.custom_op(f"{NAMESPACE}::conflict_weights", mutates_args=())
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


# ------------------------------------------------------------------------------------------ the fused loss


@torch.library.custom_op(f"{NAMESPACE}::fused_linear_gtpo", mutates_args=())
def fused_linear_gtpo(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    hidden_index: Optional[Tensor],
    ids: Tensor,
    valid: Tensor,
    advantages: Tensor,
    lambda_: Optional[Tensor],
    n_conflict: Optional[Tensor],
    old_logprobs: Optional[Tensor],
    ref_logprobs: Optional[Tensor],
    sampling_logprobs: Optional[Tensor],
    initial_entropy: Optional[float],
    temperature: float,
    row_temperature: Optional[Tensor],
    num_sequences: Optional[Tensor],
    num_tokens: Optional[Tensor],
    config_json: str,
    backend: str,
    compute_dtype: torch.dtype,
    row_lengths: Optional[List[int]],
    vocab_group: Optional[str],
    shard_sizes: Optional[List[int]],
    entropy_quantile_group: Optional[str],
    need_grads: List[bool],
) -> List[Tensor]:
    """The fused loss and, computed on the way, its gradients: ``[loss, d_hidden, d_weight, d_bias, metric sums,
    completion entropy, completion clip low, completion clip high]`` (gradients not asked for are empty tensors).
    ``ids`` to ``num_tokens`` are a checked `rows.LossRows` as `LossRows.op_args` flattens it. ``row_lengths``: the
    unmasked tokens of each row, when the caller has read them already (else one host synchronisation here).
    ``hidden_index``: ``None`` for ``hidden [N, L, H]``; for packed ``hidden [T, H]``, each position's row in it
    (`packed.Packing.index`). ``vocab_group`` (with each rank's ``shard_sizes``) and ``entropy_quantile_group``: the
    names `vocab_parallel.group_name` gave the process groups (a schema takes no process group)."""
    from .config import GTPOConfig

    rows = LossRows.from_op_args(
        (ids, valid, advantages, lambda_, n_conflict, old_logprobs, ref_logprobs, sampling_logprobs)
        + (initial_entropy, temperature, row_temperature, num_sequences, num_tokens)
    )
    config = GTPOConfig.from_dict(json.loads(config_json))
    kernels = kernels_for(get_backend(backend), compute_dtype, config.max_chunk_bytes)
    tokens = unmasked_tokens(valid, row_lengths, hidden_index)
    vocab_parallel = None
    if vocab_group is not None:
        group = group_named(vocab_group)
        vocab_parallel = VocabParallel(group, VocabShards(tuple(shard_sizes), torch.distributed.get_rank(group)))
    walk = Walk(
        kernels,
        compute_dtype,
        tokens,
        need_grads,
        config.max_chunk_bytes,
        vocab_parallel,
        group_named(entropy_quantile_group),
    )
    return fused_forward(hidden, (weight, bias), rows, config, walk)


@fused_linear_gtpo.register_fake
def _(hidden, weight, bias, hidden_index, ids, *rest):
    from .result import ROW_METRICS, SUMS_SIZE

    compute_dtype, need_grads = rest[-6], rest[-1]
    stat = stats_dtype(compute_dtype)
    n_rows = ids.shape[0]

    def empty():  # a fresh one each time: an operator's outputs may not alias one another
        return hidden.new_empty((0,))

    return [
        hidden.new_empty((), dtype=stat),
        torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_grads[0] else empty(),
        torch.empty_like(weight) if need_grads[1] else empty(),
        torch.empty_like(bias) if bias is not None and need_grads[2] else empty(),
        hidden.new_empty((SUMS_SIZE,), dtype=torch.float64),
        *(hidden.new_empty((n_rows,), dtype=stat) for _ in ROW_METRICS),
    ]


def _fused_setup(ctx, inputs, output):
    # Only the loss is differentiated: no zero gradients materialised for the other outputs (two of them are
    # d_hidden- and d_weight-sized).
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(output[1], output[2], output[3])
    ctx.needed = [need and (i != 2 or inputs[2] is not None) for i, need in enumerate(inputs[-1])]
    ctx.num_inputs = len(inputs)


def _fused_grad(ctx, output_grads):
    return fused_gradients(ctx, output_grads[0])  # a list-returning operator's backward takes them as one list


def _is_plain(tensor: Tensor) -> bool:
    """An eager tensor holding data (not a fake, functional or other traced stand-in)."""
    return type(tensor) is Tensor and not torch._is_functional_tensor(tensor)


@first_derivative_only
def fused_gradients(ctx, grad_loss):
    """The fused loss's backward: the gradients its forward stored (``ctx.saved_tensors``: hidden, weight, bias)
    times the loss's incoming gradient; ``None`` for the ``ctx.num_inputs - 3`` other inputs.

    In eager mode they are scaled in place and handed on: a copy would cost another ``d_weight`` and
    ``d_hidden`` (1.1 GB at H = 3584, V = 151936 in bf16) at the backward's peak, to multiply by 1. So the
    backward runs once per forward: a second one (``retain_graph=True``) raises instead of scaling twice.
    Traced (``torch.compile``, ``opcheck``'s AOT dispatch) it is the out-of-place product: a functional graph plans
    its memory itself."""
    if getattr(ctx, "gradients_handed_on", False):
        raise RuntimeError(
            "the fused gtpo_kernels loss's backward ran twice on one forward (retain_graph=True): its stored "
            "gradients were handed on the first time; call fused_linear_gtpo_loss again for another backward"
        )
    saved = ctx.saved_tensors
    if grad_loss is None:
        grad_loss = torch.zeros((), device=saved[0].device)
    in_place = not torch.compiler.is_compiling() and all(_is_plain(t) for t in (*saved, grad_loss))
    ctx.gradients_handed_on = in_place
    grads = [
        (g.mul_(grad_loss.to(g.dtype)) if in_place else g * grad_loss.to(g.dtype)) if needed else None
        for g, needed in zip(saved, ctx.needed)
    ]
    return (*grads,) + (None,) * (ctx.num_inputs - len(grads))  # hidden, weight, bias; nothing for the rest


torch.library.register_autograd(f"{NAMESPACE}::fused_linear_gtpo", _fused_grad, setup_context=_fused_setup)
