"""Per-token log-prob and entropy as Triton kernels: one pass over the vocabulary forward, one back.

Forward (`_token_stats_forward_kernel`): one program per token streams its ``V`` logits once,
keeping a running max ``m``, ``s = sum exp(z - m)`` and ``w = sum exp(z - m) (z - m)`` in float32,
and writes ``lse = m + log s``, ``logp = z[y] - lse`` and ``H = log s - w / s``. Masked tokens read
nothing and get zeros.

Backward (`_token_stats_backward_kernel`): one program per token reads its logits once more and
writes ``dlogits = c (onehot(y) - p) + e dH/dz`` with ``dH/dz = -p (log p + H)``, where ``c`` and
``e`` are the incoming gradients of ``logp`` and ``H`` (the per-token coefficients of SPEC.md's
"Gradient with respect to the logits"). Masked tokens get exact zeros without reading their logits.

The same kernels run on CPU tensors under ``TRITON_INTERPRET=1`` (how CI tests them).
`function.TokenStats` wraps `forward`/`backward` for autograd.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..token_stats import triton_interpreted


MAX_BLOCK_V = 8192


@triton.jit
def _token_stats_forward_kernel(
    logits_ptr, ids_ptr, valid_ptr, lse_ptr, logp_ptr, entropy_ptr,
    length, vocab, stride_n, stride_l,
    BLOCK_V: tl.constexpr,
):
    token = tl.program_id(0)
    row = token // length
    pos = token % length
    # int64 offsets: N * L * V exceeds 2^31 at realistic sizes.
    base = logits_ptr + row.to(tl.int64) * stride_n + pos.to(tl.int64) * stride_l
    is_valid = tl.load(valid_ptr + token) != 0
    n_blocks = tl.where(is_valid, tl.cdiv(vocab, BLOCK_V), 0)

    # Running max m is a scalar (one reduction per block); the sums s and w are kept per lane and
    # reduced once at the end, so each element costs one exp and no cross-warp traffic.
    m = tl.full((), float("-inf"), tl.float32)
    s_lanes = tl.zeros((BLOCK_V,), tl.float32)
    w_lanes = tl.zeros((BLOCK_V,), tl.float32)
    cols = tl.arange(0, BLOCK_V)
    for b in range(0, n_blocks):
        offs = b * BLOCK_V + cols
        z = tl.load(base + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        # Shift by the new max; while everything seen is -inf (banned tokens) shift by 0 so that
        # no -inf - -inf = NaN appears. e = 0 exactly where z = -inf.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        e = tl.exp(z - shift)
        d = tl.where(e > 0, z - shift, 0.0)
        # Rescale what the lanes hold from the old shift to the new one:
        # sum e^(z-m)(z-m) -> alpha * (w + (m - shift) s), with alpha = e^(m - shift).
        alpha = tl.exp(m - shift)
        old_delta = tl.where(m == float("-inf"), 0.0, m - shift)
        w_lanes = alpha * (w_lanes + old_delta * s_lanes) + e * d
        s_lanes = alpha * s_lanes + e
        m = m_new
    s = tl.sum(s_lanes, axis=0)
    w = tl.sum(w_lanes, axis=0)

    log_s = tl.log(tl.where(is_valid, s, 1.0))  # masked tokens read nothing: s = 0
    lse = m + log_s
    entropy = log_s - w / tl.where(is_valid, s, 1.0)
    # Ids are validated on the host; clamp anyway so that an unchecked bad id reads in bounds, and
    # turn it into NaN rather than a plausible wrong value.
    target = tl.load(ids_ptr + token).to(tl.int64)
    in_vocab = (target >= 0) & (target < vocab)
    safe_target = tl.where(in_vocab, target, 0)
    z_target = tl.load(base + safe_target, mask=is_valid, other=0.0).to(tl.float32)
    logp = tl.where(in_vocab, z_target - lse, float("nan"))

    tl.store(lse_ptr + token, tl.where(is_valid, lse, 0.0))
    tl.store(logp_ptr + token, tl.where(is_valid, logp, 0.0))
    tl.store(entropy_ptr + token, tl.where(is_valid, entropy, 0.0))


@triton.jit
def _token_stats_backward_kernel(
    logits_ptr, grad_ptr, ids_ptr, valid_ptr, lse_ptr, entropy_ptr, grad_logp_ptr, grad_entropy_ptr,
    length, vocab, stride_n, stride_l, grad_stride_n, grad_stride_l,
    BLOCK_V: tl.constexpr, EMULATE_BF16_ROUNDING: tl.constexpr,
):
    token = tl.program_id(0)
    row = token // length
    pos = token % length
    base = logits_ptr + row.to(tl.int64) * stride_n + pos.to(tl.int64) * stride_l
    grad_base = grad_ptr + row.to(tl.int64) * grad_stride_n + pos.to(tl.int64) * grad_stride_l
    is_valid = tl.load(valid_ptr + token) != 0
    n_total = tl.cdiv(vocab, BLOCK_V)
    n_compute = tl.where(is_valid, n_total, 0)
    cols = tl.arange(0, BLOCK_V)

    lse = tl.load(lse_ptr + token)
    entropy = tl.load(entropy_ptr + token)
    c = tl.load(grad_logp_ptr + token).to(tl.float32)
    e = tl.load(grad_entropy_ptr + token).to(tl.float32)
    target = tl.load(ids_ptr + token).to(tl.int64)
    for b in range(0, n_compute):
        offs = b * BLOCK_V + cols
        in_row = offs < vocab
        z = tl.load(base + offs, mask=in_row, other=float("-inf")).to(tl.float32)
        log_p = z - lse
        p = tl.exp(log_p)
        log_p = tl.where(p > 0, log_p, 0.0)  # banned tokens: p = 0, avoid 0 * -inf
        grad = -p * (c + e * (log_p + entropy)) + tl.where(offs == target, c, 0.0)
        if EMULATE_BF16_ROUNDING:
            # Triton's interpreter truncates float32 -> bfloat16; GPUs round to nearest even. Round
            # here so that tests on the CPU see the GPU's numerics (the cast below is then exact).
            bits = grad.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            grad = bits.to(tl.float32, bitcast=True)
        tl.store(grad_base + offs, grad.to(grad_ptr.dtype.element_ty), mask=in_row)
    # Masked tokens: zeros, without reading logits that may hold anything.
    for b in range(n_compute, n_total):
        offs = b * BLOCK_V + cols
        tl.store(grad_base + offs, tl.zeros((BLOCK_V,), grad_ptr.dtype.element_ty), mask=offs < vocab)


def _block_v(vocab: int) -> int:
    return min(MAX_BLOCK_V, triton.next_power_of_2(vocab))


def _num_warps(block_v: int) -> int:
    return 16 if block_v >= 8192 else 8 if block_v >= 2048 else 4


def forward(logits: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, chunk_size=None):
    """``logits [N, L, V]`` (last dim contiguous), ``ids, valid [N, L]`` -> ``(lse, logp, H)`` float32
    ``[N, L]``, zeros where masked. ``chunk_size`` is ignored (each program streams its own row)."""
    n_rows, length, vocab = logits.shape
    ids = ids.contiguous()
    valid = valid.contiguous()
    lse = torch.empty((n_rows, length), dtype=torch.float32, device=logits.device)
    logp = torch.empty_like(lse)
    entropy = torch.empty_like(lse)
    if lse.numel():
        block = _block_v(vocab)
        _token_stats_forward_kernel[(n_rows * length,)](
            logits, ids, valid, lse, logp, entropy, length, vocab, logits.stride(0), logits.stride(1),
            BLOCK_V=block, num_warps=_num_warps(block),
        )
    return lse, logp, entropy


def backward(logits: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, lse: torch.Tensor,
             entropy: torch.Tensor, grad_logp: torch.Tensor, grad_entropy: torch.Tensor, out: torch.Tensor,
             chunk_size=None) -> torch.Tensor:
    """Writes ``dlogits`` into ``out`` (``[N, L, V]``, last dim contiguous; may be ``logits`` itself)."""
    if logits.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("triton backward needs logits and out with a contiguous last dimension")
    n_rows, length, vocab = logits.shape
    if lse.numel():
        block = _block_v(vocab)
        _token_stats_backward_kernel[(n_rows * length,)](
            logits, out, ids.contiguous(), valid.contiguous(), lse, entropy,
            grad_logp.float().contiguous(), grad_entropy.float().contiguous(),
            length, vocab, logits.stride(0), logits.stride(1), out.stride(0), out.stride(1),
            BLOCK_V=block, EMULATE_BF16_ROUNDING=out.dtype == torch.bfloat16 and triton_interpreted(),
            num_warps=_num_warps(block),
        )
    return out
