"""The ``"torch"`` backend: plain PyTorch in chunks of tokens, on any device and in any float dtype.

The unchunked oracle (`reference.py`) lets autograd keep several float32 ``[T, V]`` tensors alive until
backward. Here the forward keeps only a few numbers per token, and both passes walk the tokens in
chunks, so at most one chunk's float32 logits and softmax exist at a time. The backward uses the closed
form from docs/method.md, for ``u = z / T``:

    dlogits = (g_logp * (onehot(y) - p) + g_H * dH/du) / T,   dH/du = -p * (log p + H)

with the target's ``1 - p_y`` computed as ``-expm1(log p_y)``, as in every backend.

It is also the fallback for dtypes the other backends' kernels do not take (float64, the oracle's).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import chunk_budget
from .base import Backend, stats_dtype


def chunk_tokens(vocab_size: int, device: torch.device, max_chunk_bytes: Optional[int]) -> int:
    return chunk_budget.chunk_tokens(vocab_size, chunk_budget.TORCH_BACKEND, device, max_chunk_bytes)


def _chunk_stats(z: torch.Tensor, ids: torch.Tensor, temperature):
    """``z [C, V]`` float32/64 logits, ``ids [C]`` -> ``(row_max, log_s, logp, H)`` each ``[C]`` for
    ``softmax(z / T)``, with ``lse = row_max / T + log_s``; ``T`` a float or each row's ``[C, 1]``."""
    z_max = z.amax(dim=-1, keepdim=True)
    # Rows that are all -inf would give NaN here; they are reported by the caller's finiteness check.
    # The difference to the max first (exact for nearby values), then the temperature.
    shifted = _scaled(z - z_max, temperature)
    exp_shifted = shifted.exp()
    # s = (values at the max, each exactly 1) + (the rest), summed apart: a 1 in the float sum would
    # swamp the small terms, and s = 1 + delta is where a confident token's log-prob lives.
    at_max = shifted == 0
    rest = exp_shifted.masked_fill(at_max, 0.0).sum(dim=-1) + (at_max.sum(dim=-1) - 1)
    sum_exp = 1 + rest
    # sum_v p_v (z_v - max); banned tokens (-inf) have p = 0 and are zeroed to avoid 0 * -inf.
    weighted = (exp_shifted * shifted.masked_fill(torch.isneginf(z), 0.0)).sum(dim=-1)
    log_s = torch.log1p(rest)
    entropy = log_s - weighted / sum_exp
    # (z_y - max) / T - log s rather than z_y / T - lse: no cancellation against a large lse, so the
    # log-prob of a confident token keeps its relative precision.
    in_vocab = (ids >= 0) & (ids < z.shape[-1])
    logp = shifted.gather(-1, torch.where(in_vocab, ids, 0)[:, None]).squeeze(-1) - log_s
    # An id outside [0, V) (the loss reports it) gives NaN, never an out-of-bounds read.
    return z_max.squeeze(-1), log_s, torch.where(in_vocab, logp, torch.nan), entropy


def _blocks(n_rows: int, length: int, tokens: int):
    """Slices ``(rows, positions)`` covering ``[N, L]`` with at most ``tokens`` tokens each.

    Blocks are views of the caller's logits, so a non-contiguous ``[N, L, V]`` (e.g. a slice of a
    model's output that drops the prompt) is never copied whole.
    """
    rows_per_block = max(1, tokens // max(1, length))
    positions_per_block = min(length, tokens)
    for r in range(0, n_rows, rows_per_block):
        for t in range(0, length, positions_per_block):
            yield slice(r, r + rows_per_block), slice(t, t + positions_per_block)


def _scaled(z: torch.Tensor, temperature) -> torch.Tensor:
    if isinstance(temperature, torch.Tensor):
        return z / temperature
    return z if temperature == 1.0 else z / temperature


def _block_temperature(temperature, rows: slice, pos: slice, dtype: torch.dtype):
    """A block's temperature ``[r, p, 1]`` (a float as it is), from each token's ``[N, L]``."""
    if not isinstance(temperature, torch.Tensor):
        return temperature
    return temperature[rows, pos, None].to(dtype)


def forward(
    logits: torch.Tensor,
    ids: torch.Tensor,
    valid: torch.Tensor,
    temperature=1.0,
    *,
    max_chunk_bytes: Optional[int] = None,
):
    """``logits [N, L, V]``, ``ids, valid [N, L]`` -> ``(row_max, log_s, logp, H)`` ``[N, L]`` of
    softmax(logits / T) (``T`` a float or each token's ``[N, L]``), zeros where masked; in chunks of
    ``max_chunk_bytes`` of float32 logits (`chunk_budget.TORCH_BACKEND` by default)."""
    n_rows, length, vocab = logits.shape
    acc = stats_dtype(logits.dtype)
    chunk = chunk_tokens(vocab, logits.device, max_chunk_bytes)
    ids = torch.where(valid, ids.long(), 0)
    outputs = [torch.zeros((n_rows, length), dtype=acc, device=logits.device) for _ in range(4)]
    for rows, pos in _blocks(n_rows, length, chunk):
        z = logits[rows, pos].to(acc).reshape(-1, vocab)
        block_temperature = _block_temperature(temperature, rows, pos, acc)
        if isinstance(block_temperature, torch.Tensor):
            block_temperature = block_temperature.reshape(-1, 1)
        block = _chunk_stats(z, ids[rows, pos].reshape(-1), block_temperature)
        for out, value in zip(outputs, block):
            out[rows, pos] = value.view(out[rows, pos].shape)
    zero = torch.zeros((), dtype=acc, device=logits.device)
    return tuple(torch.where(valid, out, zero) for out in outputs)


def backward(
    logits: torch.Tensor,
    ids: torch.Tensor,
    valid: torch.Tensor,
    row_max: torch.Tensor,
    log_s: torch.Tensor,
    logp: torch.Tensor,
    entropy: torch.Tensor,
    grad_logp: torch.Tensor,
    grad_entropy: torch.Tensor,
    out: torch.Tensor,
    temperature=1.0,
    *,
    max_chunk_bytes: Optional[int] = None,
) -> torch.Tensor:
    """Writes the gradient of the logits into ``out`` (which may be ``logits`` itself: each block is
    read before it is overwritten); exact zeros at masked tokens."""
    acc = log_s.dtype
    chunk = chunk_tokens(logits.shape[-1], logits.device, max_chunk_bytes)
    # An id outside [0, V) has no entry here (a vocabulary shard whose neighbour holds the target): column 0
    # keeps its off-target value.
    in_vocab = (ids >= 0) & (ids < logits.shape[-1])
    ids = torch.where(valid & in_vocab, ids.long(), 0)
    zero = torch.zeros((), dtype=acc, device=logits.device)
    token_scale = temperature.to(acc) if isinstance(temperature, torch.Tensor) else temperature
    grad_logp = torch.where(valid, grad_logp.to(acc), zero) / token_scale
    grad_entropy = zero if grad_entropy is None else torch.where(valid, grad_entropy.to(acc), zero) / token_scale
    for rows, pos in _blocks(*log_s.shape, chunk):
        z = logits[rows, pos].to(acc)
        # log p = (z - max) / T - log s: near the max, no cancellation against a large lse.
        block_temperature = _block_temperature(temperature, rows, pos, acc)
        log_p = _scaled(z - row_max[rows, pos, None].to(acc), block_temperature) - log_s[rows, pos, None]
        p = log_p.exp()
        g_logp = grad_logp[rows, pos, None]
        # -g_logp p + g_H dH/du with dH/du = -p (log p + H); log p of banned tokens (-inf) zeroed.
        log_p = log_p.masked_fill(torch.isneginf(z), 0.0)
        g_entropy = grad_entropy if grad_entropy.dim() == 0 else grad_entropy[rows, pos, None]
        h = entropy[rows, pos, None]
        grad = -p * (g_logp + g_entropy * (log_p + h))
        # The target's entry g_logp (1 - p_y) - g_H p_y (log p_y + H), with 1 - p_y = -expm1(log p_y): the
        # difference cancels catastrophically for a confident sampled token.
        log_p_target = logp[rows, pos, None].to(acc)
        at = ids[rows, pos, None]
        target = -g_logp * torch.expm1(log_p_target) - g_entropy * log_p_target.exp() * (log_p_target + h)
        grad.scatter_(-1, at, torch.where(in_vocab[rows, pos, None], target, grad.gather(-1, at)))
        # Masked tokens may hold NaN logits: write exact zeros, not 0 * NaN.
        out[rows, pos] = torch.where(valid[rows, pos, None], grad, zero).to(out.dtype)
    return out


def _leading_conflict_run(
    ids: torch.Tensor, valid: torch.Tensor, positive: torch.Tensor, negative: torch.Tensor, group_size: int
) -> torch.Tensor:
    """``cf[i, t]``: positions ``0..t`` of row ``i`` all hold a token that, at the same position, also
    appears in a positive and in a negative completion of the group (the row itself counts).

    ``ids, valid: [N, L]``; ``positive, negative: [N]`` bool. Work and memory ``O(G^2 L)`` per group.
    """
    n, length = ids.shape
    y = ids.view(-1, group_size, length)
    v = valid.view(-1, group_size, length)
    # same[b, i, j, t]: rows i and j of group b hold the same token at position t, both unmasked.
    same = (y[:, :, None, :] == y[:, None, :, :]) & v[:, :, None, :] & v[:, None, :, :]
    in_positive = (same & positive.view(-1, 1, group_size, 1)).any(dim=2)
    in_negative = (same & negative.view(-1, 1, group_size, 1)).any(dim=2)
    raw = (in_positive & in_negative).view(n, length)
    return torch.cumprod(raw.to(torch.int32), dim=1).bool()  # leading run of True


def conflict_weights(
    completion_ids: torch.Tensor, valid: torch.Tensor, advantages: torch.Tensor, group_size: int, weight: float = 2.0
):
    """``(lambda [N, L], n_conflict [N] int64)``, vectorised; ``lambda`` in float64 for float64 advantages,
    else float32 (see `gtpo_kernels.conflict_weights`)."""
    positive = advantages > 0
    negative = advantages < 0
    active = (positive | negative)[:, None]
    forward_run = _leading_conflict_run(completion_ids, valid, positive, negative, group_size) & active
    # Reverse: right-align each row (s = len - 1 - t), run the same test, map back to t.
    # The map t <-> len - 1 - t is its own inverse on the unmasked prefix, so one gather index serves.
    lengths = valid.sum(dim=1, keepdim=True)
    s = torch.arange(completion_ids.shape[1], device=completion_ids.device)
    flip = (lengths - 1 - s).clamp(min=0)
    reverse_run_s = _leading_conflict_run(completion_ids.gather(1, flip), s < lengths, positive, negative, group_size)
    reverse_run = reverse_run_s.gather(1, flip) & valid & active

    dtype = stats_dtype(advantages.dtype)
    one = torch.ones((), dtype=dtype, device=completion_ids.device)
    on_conflict = torch.where(positive[:, None], weight * one, 0.0 * one)
    lambda_ = torch.where(forward_run, on_conflict, one) * torch.where(reverse_run, on_conflict, one)
    n_conflict = torch.maximum(forward_run.sum(dim=1), reverse_run.sum(dim=1))
    return lambda_, n_conflict


BACKEND = Backend(
    name="torch",
    description="plain PyTorch in chunks of tokens (max_chunk_bytes: 4 MiB on the CPU, 64 MiB on a GPU)",
    devices=None,  # any
    auto_devices=(),  # the fallback of "auto", never its first choice
    logits_dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64),
    forward=forward,
    backward=backward,
    conflict_weights=conflict_weights,
    unavailable=lambda device: None,
    chunked=True,
)
