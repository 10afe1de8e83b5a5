"""Per-token log-prob and entropy in plain PyTorch, chunked over tokens (the ``"torch"`` backend).

The unchunked reference (`reference.token_logprobs_and_entropy`) lets autograd keep several float32
``[T, V]`` tensors alive until backward. Here the forward keeps only ``lse`` and ``H`` per token, and
both passes walk the tokens in chunks, so at most one chunk's float32 logits and softmax exist at a
time (`function.TokenStats` wraps them for autograd). The backward uses the closed form from SPEC.md:

    dlogits = g_logp * (onehot(y) - p) + g_H * dH/dz,   dH/dz = -p * (z - lse + H)
"""

from __future__ import annotations

from typing import Optional

import torch

from ..reference import accumulation_dtype

# float32 bytes of logits per chunk when no chunk size is given. On the CPU a chunk that stays in
# cache makes the several elementwise passes below ~5x faster than 64 MiB chunks (measured at
# T = 512, V = 151936 on 2 cores); on a GPU larger chunks amortise kernel launches.
CHUNK_BYTES = {"cpu": 4 * 2**20}
DEFAULT_CHUNK_BYTES = 64 * 2**20


def default_chunk_size(vocab_size: int, device: torch.device) -> int:
    budget = CHUNK_BYTES.get(device.type, DEFAULT_CHUNK_BYTES)
    return max(1, budget // (4 * vocab_size))


def _chunk_stats(z: torch.Tensor, ids: torch.Tensor):
    """``z [C, V]`` float32/64, ``ids [C]`` -> ``(lse, logp, H)`` each ``[C]``."""
    z_max = z.amax(dim=-1, keepdim=True)
    # Rows that are all -inf would give NaN here; they are reported by the caller's finiteness check.
    shifted = z - z_max
    exp_shifted = shifted.exp()
    sum_exp = exp_shifted.sum(dim=-1)
    # sum_v p_v (z_v - max); banned tokens (-inf) have p = 0 and are zeroed to avoid 0 * -inf.
    weighted = (exp_shifted * shifted.masked_fill(torch.isneginf(z), 0.0)).sum(dim=-1)
    log_sum_exp = sum_exp.log()
    lse = z_max.squeeze(-1) + log_sum_exp
    entropy = log_sum_exp - weighted / sum_exp
    logp = z.gather(-1, ids[:, None]).squeeze(-1) - lse
    return lse, logp, entropy


def _blocks(n_rows: int, length: int, chunk_tokens: int):
    """Slices ``(rows, positions)`` covering ``[N, L]`` with at most ``chunk_tokens`` tokens each.

    Blocks are views of the caller's logits, so a non-contiguous ``[N, L, V]`` (e.g. a slice of a
    model's output that drops the prompt) is never copied whole.
    """
    rows_per_block = max(1, chunk_tokens // length)
    positions_per_block = min(length, chunk_tokens)
    for r in range(0, n_rows, rows_per_block):
        for t in range(0, length, positions_per_block):
            yield slice(r, r + rows_per_block), slice(t, t + positions_per_block)


def forward(logits: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, chunk_size: Optional[int] = None):
    """``logits [N, L, V]``, ``ids, valid [N, L]`` -> ``(lse, logp, H)`` ``[N, L]``, zeros where masked."""
    n_rows, length, vocab = logits.shape
    acc = accumulation_dtype(logits.dtype)
    chunk = chunk_size or default_chunk_size(vocab, logits.device)
    ids = torch.where(valid, ids.long(), 0)
    lse = torch.zeros((n_rows, length), dtype=acc, device=logits.device)
    logp = torch.zeros_like(lse)
    entropy = torch.zeros_like(lse)
    for rows, pos in _blocks(n_rows, length, chunk):
        z = logits[rows, pos].to(acc).reshape(-1, vocab)
        block = _chunk_stats(z, ids[rows, pos].reshape(-1))
        for out, value in zip((lse, logp, entropy), block):
            out[rows, pos] = value.view(out[rows, pos].shape)
    zero = torch.zeros((), dtype=acc, device=logits.device)
    return (torch.where(valid, lse, zero), torch.where(valid, logp, zero), torch.where(valid, entropy, zero))


def backward(logits: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, lse: torch.Tensor,
             entropy: torch.Tensor, grad_logp: torch.Tensor, grad_entropy: torch.Tensor, out: torch.Tensor,
             chunk_size: Optional[int] = None) -> torch.Tensor:
    """Writes ``dlogits = g_logp (onehot - p) + g_H dH/dz`` into ``out`` (which may be ``logits``
    itself: each block is read before it is overwritten); exact zeros at masked tokens."""
    acc = lse.dtype
    chunk = chunk_size or default_chunk_size(logits.shape[-1], logits.device)
    ids = torch.where(valid, ids.long(), 0)
    zero = torch.zeros((), dtype=acc, device=logits.device)
    grad_logp = torch.where(valid, grad_logp.to(acc), zero)
    grad_entropy = torch.where(valid, grad_entropy.to(acc), zero)
    for rows, pos in _blocks(*lse.shape, chunk):
        z = logits[rows, pos].to(acc)
        log_p = z - lse[rows, pos, None]
        p = log_p.exp()
        g_logp = grad_logp[rows, pos, None]
        # -g_logp p + g_H dH/dz with dH/dz = -p (log p + H); log p of banned tokens (-inf) zeroed.
        log_p = log_p.masked_fill(torch.isneginf(z), 0.0)
        grad = -p * (g_logp + grad_entropy[rows, pos, None] * (log_p + entropy[rows, pos, None]))
        grad.scatter_add_(-1, ids[rows, pos, None], g_logp)
        # Masked tokens may hold NaN logits: write exact zeros, not 0 * NaN.
        out[rows, pos] = torch.where(valid[rows, pos, None], grad, zero).to(out.dtype)
    return out
