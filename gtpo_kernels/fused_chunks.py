"""The chunk loop of the fused ``hidden @ lm_head`` loss: packing the unmasked tokens into chunks of whole
completions, each chunk's logits, statistics and gradients, and the float32 accumulation of ``d_W``.
`fused_forward` is the body of the ``gtpo_kernels::fused_linear_gtpo`` operator (`custom_ops`); the public
functions and the overview are in `fused_linear`. This module imports neither, so the operator can call it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from .backends import chunk_budget
from .backends.base import Backend, stats_dtype
from .config import GTPOConfig
from .objective import entropy_floor, loss_from_token_stats, loss_gradients
from .rows import LossRows
from .vocab_parallel import VocabParallel

WEIGHT_GRAD_SLICE_BYTES = 64 * 2**20  # temporary of one slice of d_W when it cannot accumulate in place


def chunk_tokens_for(vocab: int, device: torch.device, max_chunk_bytes: Optional[int]) -> int:
    """Tokens of one chunk of the fused loss (`chunk_budget.FUSED_LINEAR`, or ``max_chunk_bytes``)."""
    return chunk_budget.chunk_tokens(vocab, chunk_budget.FUSED_LINEAR, device, max_chunk_bytes)


@dataclass
class Tokens:
    """The unmasked tokens of a batch, in row-major order, and where each row's tokens start."""

    flat: torch.Tensor  # [T] int64: i * L + t of each unmasked token
    rows: torch.Tensor  # [T] int64: i
    positions: torch.Tensor  # [T] int64: t
    offsets: List[int]  # [N + 1]: row i's tokens are flat[offsets[i]:offsets[i + 1]]
    packed: Optional[torch.Tensor] = None  # [T] int64: each token's row of packed hidden states [T_all, H]

    def hidden_of(self, hidden: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
        """``[t1 - t0, H]``: tokens ``[t0, t1)``'s hidden states (``hidden [N, L, H]``, or ``[T_all, H]`` packed)."""
        if self.packed is None:
            return hidden[self.rows[t0:t1], self.positions[t0:t1]]
        return hidden[self.packed[t0:t1]]

    def hidden_rows(self, t0: int, t1: int) -> torch.Tensor:
        """Where tokens ``[t0, t1)`` lie in a contiguous gradient of the hidden states viewed ``[-1, H]``."""
        return self.flat[t0:t1] if self.packed is None else self.packed[t0:t1]


def unmasked_tokens(
    valid: torch.Tensor, lengths: Optional[List[int]] = None, hidden_index: Optional[torch.Tensor] = None
) -> Tokens:
    """``lengths``: each row's unmasked tokens, if the caller has read them (else one host synchronisation);
    ``hidden_index [N, L]``: each position's row in packed hidden states (`packed.Packing.index`)."""
    n_rows, length = valid.shape
    if lengths is None:
        lengths = valid.sum(dim=1).tolist()
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    if hasattr(torch, "nonzero_static"):
        flat = torch.nonzero_static(valid.reshape(-1), size=offsets[-1]).squeeze(1)
    else:  # pragma: no cover (torch < 2.1)
        flat = valid.reshape(-1).nonzero().squeeze(1)
    packed = None if hidden_index is None else hidden_index.reshape(-1)[flat]
    return Tokens(flat, flat // max(1, length), flat % max(1, length), offsets, packed)


def _chunks(offsets: List[int], budget: int) -> List[Tuple[int, int]]:
    """Row ranges ``[r0, r1)`` whose tokens fit ``budget``; a row longer than the budget is a range alone."""
    chunks, start = [], 0
    for row in range(len(offsets) - 1):
        if offsets[row + 1] - offsets[start] > budget and row > start:
            chunks.append((start, row))
            start = row
        if offsets[row + 1] - offsets[start] > budget:  # this row alone is over budget
            chunks.append((start, row + 1))
            start = row + 1
    if start < len(offsets) - 1:
        chunks.append((start, len(offsets) - 1))
    return chunks


def chunk_logits(h: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
    return h @ w.T if b is None else torch.addmm(b, h, w.T)


def chunk_stats(kernels: Backend, logits: torch.Tensor, ids: torch.Tensor, temperature: float):
    """``(row_max, log_s, logp, H)`` ``[t]`` of the rows of ``logits [t, V]`` (see `backends.base.Backend`)."""
    everything = torch.ones((1, logits.shape[0]), dtype=torch.bool, device=logits.device)
    return tuple(x[0] for x in kernels.forward(logits[None], ids[None], everything, temperature))


def _gradient_in_place(kernels: Backend, logits, ids, stats, c, e, temperature: float) -> torch.Tensor:
    """Overwrites ``logits [t, V]`` with the gradient ``c (onehot - p) + e dH/dz`` (for ``z / T``), from the
    forward's ``stats = (row_max, log_s, logp, H)``."""
    everything = torch.ones((1, logits.shape[0]), dtype=torch.bool, device=logits.device)
    kernels.backward(
        logits[None],
        ids[None],
        everything,
        *(x[None] for x in stats),
        c[None],
        e[None],
        logits[None],
        temperature,
    )
    return logits


@functools.cache
def _addmm_out_dtype_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``addmm(acc, a, b, out_dtype=float32, out=acc)`` accumulates low-precision products into a
    float32 tensor in place on this device (tried once on a small case and checked)."""
    try:
        a = torch.randn(8, 16, device=device).to(dtype)
        b = torch.randn(16, 8, device=device).to(dtype)
        acc = torch.randn(8, 8, device=device)
        expected = acc + a.float() @ b.float()
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        return bool(torch.allclose(acc, expected, rtol=1e-2, atol=1e-2))
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _add_weight_grad(d_weight: torch.Tensor, dlogits: torch.Tensor, h: torch.Tensor) -> None:
    """``d_weight [V, H] += dlogits.T @ h`` with ``d_weight`` float32 (or float64) and the product in the
    compute dtype: in place in the GEMM where possible, else in 128-row slices of the vocabulary."""
    if dlogits.dtype == d_weight.dtype:
        d_weight.addmm_(dlogits.T, h)
        return
    if dlogits.device.type == "cuda" and _addmm_out_dtype_works(dlogits.device, dlogits.dtype):
        torch.addmm(d_weight, dlogits.T, h, out_dtype=d_weight.dtype, out=d_weight)
        return
    vocab, hidden = d_weight.shape
    rows = max(128, WEIGHT_GRAD_SLICE_BYTES // (hidden * dlogits.element_size()) // 128 * 128)
    for v0 in range(0, vocab, rows):
        v1 = min(vocab, v0 + rows)
        d_weight[v0:v1] += (dlogits[:, v0:v1].T @ h).to(d_weight.dtype)


@dataclass(frozen=True)
class Walk:
    """How the fused walk runs: the backend's kernels, the matrix products' dtype, the call's tokens
    (`unmasked_tokens`), which gradients to compute (hidden, weight, bias) and the process groups it talks to:
    ``vocab_parallel``, the head is this rank's shard of the vocabulary (each chunk's shard statistics combined
    over the group: one all-gather per chunk, the same chunks on every rank; the gradients the shard's, ``d_hidden``
    its share, to be summed over the group); ``entropy_quantile_group``, the processes whose tokens
    ``top_entropy_quantile``'s threshold spans."""

    kernels: Backend
    compute_dtype: torch.dtype
    tokens: Tokens
    need_grads: List[bool]
    vocab_parallel: Optional[VocabParallel] = None
    entropy_quantile_group: object = None


def fused_forward(
    hidden: torch.Tensor,
    head: Tuple[torch.Tensor, Optional[torch.Tensor]],
    rows: LossRows,
    config: GTPOConfig,
    walk: Walk,
) -> List[torch.Tensor]:
    """The body of ``gtpo_kernels::fused_linear_gtpo`` (`custom_ops`): the loss and its gradients in one walk over
    the chunks of ``walk.tokens`` (``hidden`` ``[N, L, H]``, or ``[T, H]`` packed), for the head ``(weight [V, H],
    bias [V] or None)``. Returns ``[loss, d_hidden, d_weight, d_bias, logp, H, metric sums, completion entropy]``;
    a gradient not in ``walk.need_grads`` is an empty tensor.

    With ``top_entropy_quantile < 1`` the coefficients need the whole call's entropies (the threshold): a first
    walk computes every chunk's statistics, a second each chunk's logits again and its gradient (``8 T H V``
    FLOPs instead of ``6``)."""
    kernels, compute_dtype, tokens, need_grads = walk.kernels, walk.compute_dtype, walk.tokens, walk.need_grads
    vocab_parallel = walk.vocab_parallel
    weight, bias = head
    ids, temperature = rows.ids, rows.temperature
    shard_ids = ids if vocab_parallel is None else ids - vocab_parallel.shards.offset
    n_rows, length = ids.shape
    hidden_size = hidden.shape[-1]
    vocab = weight.shape[0]
    device = hidden.device
    need_hidden, need_weight = need_grads[0], need_grads[1]
    need_bias = bias is not None and need_grads[2]
    w = weight.to(compute_dtype)
    b = None if bias is None else bias.to(compute_dtype)
    stat_dtype = stats_dtype(compute_dtype)

    # The coefficients of a chunk's rows use the whole call's counts.
    whole = rows.replace(
        num_sequences=n_rows if rows.num_sequences is None else rows.num_sequences,
        num_tokens=tokens.offsets[-1] if rows.num_tokens is None else rows.num_tokens,
    )
    # Per token: row_max, log_s, logp, H (the backends' forward), for the whole call.
    stats_all = torch.zeros((4, n_rows, length), dtype=stat_dtype, device=device)
    logp_all, entropy_all = stats_all[2], stats_all[3]
    # Contiguous whatever the input's strides (hidden is often a slice of the model's output).
    d_hidden = torch.zeros(hidden.shape, dtype=hidden.dtype, device=device) if need_hidden else None
    # Accumulated in float32 across chunks (bf16 accumulation visibly shifts training).
    d_weight = torch.zeros((vocab, hidden_size), dtype=stat_dtype, device=device) if need_weight else None
    d_bias = torch.zeros(vocab, dtype=stat_dtype, device=device) if need_bias else None

    def rows_of(t0: int, t1: int):
        return tokens.hidden_of(hidden, t0, t1).to(compute_dtype), shard_ids.reshape(-1)[tokens.flat[t0:t1]]

    def coefficients(r0: int, r1: int):
        """``(c, e)`` ``[r1 - r0, L]``: the gradient of the batch loss w.r.t. these rows' logp and H."""
        return loss_gradients(logp_all[r0:r1], entropy_all[r0:r1], whole.slice(slice(r0, r1)), config)

    def gradients(t0: int, t1: int, r0: int, c, e, logits=None):
        """The gradient of tokens ``[t0, t1)`` (rows from ``r0``), into d_hidden, d_W and d_b."""
        h, y = rows_of(t0, t1)
        if logits is None:  # a piece of a completion longer than the budget: compute its logits again
            logits = chunk_logits(h, w, b)
        index = tokens.flat[t0:t1]
        local = index - r0 * length
        dlogits = _gradient_in_place(
            kernels, logits, y, stats_all.view(4, -1)[:, index], c.reshape(-1)[local], e.reshape(-1)[local], temperature
        )
        if need_hidden:
            d_hidden.view(-1, hidden_size).index_copy_(0, tokens.hidden_rows(t0, t1), (dlogits @ w).to(hidden.dtype))
        if need_weight:
            _add_weight_grad(d_weight, dlogits, h)
        if need_bias:
            d_bias.add_(dlogits.sum(dim=0, dtype=stat_dtype))

    # Every rank of a vocabulary group walks the same chunks (the largest shard's budget).
    budget_vocab = vocab if vocab_parallel is None else vocab_parallel.largest_shard
    budget = chunk_tokens_for(budget_vocab, device, config.max_chunk_bytes)
    chunks = [(r0, r1) for r0, r1 in _chunks(tokens.offsets, budget) if tokens.offsets[r0] < tokens.offsets[r1]]

    def pieces_of(r0: int, r1: int):  # one piece, unless one completion is over budget
        t_start, t_end = tokens.offsets[r0], tokens.offsets[r1]
        return [(t, min(t_end, t + budget)) for t in range(t_start, t_end, budget)]

    def statistics(r0: int, r1: int):
        """The chunk's statistics into ``stats_all``; returns its logits when it is one piece (else ``None``)."""
        logits = None
        for t0, t1 in pieces_of(r0, r1):
            h, y = rows_of(t0, t1)
            logits = chunk_logits(h, w, b)
            stats = torch.stack(chunk_stats(kernels, logits, y, temperature)).to(stat_dtype)
            stats_all.view(4, -1)[:, tokens.flat[t0:t1]] = stats
        if vocab_parallel is not None:  # this chunk's shard statistics -> the whole vocabulary's
            index = tokens.flat[tokens.offsets[r0] : tokens.offsets[r1]]
            stats_all.view(4, -1)[:, index] = vocab_parallel.combine(
                stats_all.view(4, -1)[:, index], ids.reshape(-1)[index], temperature
            )
        return logits if len(pieces_of(r0, r1)) == 1 else None

    def chunk_gradients(r0: int, r1: int, logits=None):
        c, e = coefficients(r0, r1)
        if logits is not None:
            gradients(tokens.offsets[r0], tokens.offsets[r1], r0, c, e, logits)
        else:
            for t0, t1 in pieces_of(r0, r1):
                gradients(t0, t1, r0, c, e)

    if config.top_entropy_quantile < 1:
        for r0, r1 in chunks:
            statistics(r0, r1)
        floor = entropy_floor(entropy_all, rows.valid, config, walk.entropy_quantile_group)
        whole, rows = whole.replace(entropy_floor=floor), rows.replace(entropy_floor=floor)
        for r0, r1 in chunks:
            chunk_gradients(r0, r1)
    else:
        for r0, r1 in chunks:
            chunk_gradients(r0, r1, statistics(r0, r1))

    # The loss value and metrics from the whole call's statistics (cheap, O(N L)).
    full = loss_from_token_stats(logp_all, entropy_all, rows, config)

    def empty():  # a fresh one each time: an operator's outputs may not alias one another
        return hidden.new_empty((0,))

    return [
        full.loss.detach().to(stat_dtype),
        empty() if d_hidden is None else d_hidden,
        empty() if d_weight is None else d_weight.to(weight.dtype),
        empty() if d_bias is None else d_bias.to(bias.dtype),
        logp_all.clone(),
        entropy_all.clone(),
        full.metrics.to_sums(),
        full.metrics.completion_entropy.to(stat_dtype),
    ]
