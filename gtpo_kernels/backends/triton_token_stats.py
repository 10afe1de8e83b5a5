"""Per-token log-prob and entropy as Triton kernels: one pass over the vocabulary forward, one back.

Both kernels see ``u = z / T`` (``softmax(z / T)``, the sampling distribution) and work in the base-2
domain, where ``exp2`` is one hardware instruction: ``t = (z - m) * (log2(e) / T)`` with the
difference taken first (exact for nearby values) and one rounding after.

Forward (`_token_stats_forward_kernel`): one program per token streams its ``V`` logits once, keeping a
running max ``m`` of ``z`` (rescaling the per-lane sums only when a block raises it), and per lane
``s = sum 2^t`` (values at the max, ``2^0 = 1``, counted apart so that they do not swamp the small
terms: ``s = 1 + delta`` is where a confident token's log-prob lives) and ``w = sum 2^t t``. It writes
``m``, ``log s``, ``logp = (z_y - m) / T - log s`` and ``H = log s - w ln 2 / s``. Masked tokens read
nothing and get zeros.

Backward (`_token_stats_backward_kernel`): one program per token reads its logits once more and writes
``dlogits = (c (onehot(y) - p) + e dH/du) / T`` with ``dH/du = -p (log p + H)``; per element that is
``-p (A + e log p)`` with the per-token constant ``A = c + e H`` and ``log p = (z - m) / T - log s``. The target's entry uses the
forward's ``log p_y`` and ``1 - p_y = -expm1(log p_y)``, which does not cancel for a confident token.
Masked tokens get exact zeros without reading their logits.

The same kernels run on CPU tensors under ``TRITON_INTERPRET=1`` (how CI tests them). Loops run over
bounds computed from scalar arguments only: triton 3.6's interpreter with numpy >= 2.4 fails on loops
bounded by a tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_interpreter import triton_interpreted

@triton.jit
def _log1p(x):
    """log(1 + x) without losing small x (Kahan): tl has no log1p."""
    u = 1.0 + x
    return tl.where(u == 1.0, x, tl.log(u) * x / tl.where(u == 1.0, 1.0, u - 1.0))


@triton.jit
def _expm1(x):
    """exp(x) - 1 for x <= 0 without cancellation near 0 (Kahan): tl has no expm1."""
    u = tl.exp(x)
    safe_u = tl.where((u == 1.0) | (u == 0.0), 0.5, u)
    return tl.where(u == 1.0, x, tl.where(u == 0.0, -1.0, (u - 1.0) * x / tl.log(safe_u)))


@triton.jit
def _token_stats_forward_kernel(
    logits_ptr, ids_ptr, valid_ptr, max_ptr, log_s_ptr, logp_ptr, entropy_ptr,
    length, vocab, stride_n, stride_l, inv_temperature,
    BLOCK_V: tl.constexpr,
):
    token = tl.program_id(0)
    row = token // length
    pos = token % length
    # int64 offsets: N * L * V exceeds 2^31 at realistic sizes.
    base = logits_ptr + row.to(tl.int64) * stride_n + pos.to(tl.int64) * stride_l
    is_valid = tl.load(valid_ptr + token) != 0
    scale = inv_temperature * 1.4426950408889634  # log2(e) / T

    m = tl.full((), float("-inf"), tl.float32)  # running max of z
    s_lanes = tl.zeros((BLOCK_V,), tl.float32)    # sum of 2^t below the max
    top_lanes = tl.zeros((BLOCK_V,), tl.float32)  # how many values equal the max (2^0 = 1 each)
    w_lanes = tl.zeros((BLOCK_V,), tl.float32)    # sum of 2^t t
    cols = tl.arange(0, BLOCK_V)
    readable = tl.where(is_valid, vocab, 0)  # masked tokens read nothing (every lane -inf)
    for b in range(0, tl.cdiv(vocab, BLOCK_V)):
        offs = b * BLOCK_V + cols
        z = tl.load(base + offs, mask=offs < readable, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        if m_new > m:
            # Rescale what the lanes hold to the new max: 2^t -> alpha 2^t, t -> t + delta.
            delta = tl.where(m == float("-inf"), 0.0, (m - m_new) * scale)
            alpha = tl.exp2(delta)
            s_old = s_lanes + top_lanes
            w_lanes = alpha * (w_lanes + delta * s_old)
            s_lanes = alpha * s_old
            top_lanes = tl.zeros((BLOCK_V,), tl.float32)
            m = m_new
        # While everything seen is -inf (banned tokens) shift by 0, so that no -inf - -inf = NaN appears.
        t = (z - tl.where(m == float("-inf"), 0.0, m)) * scale
        e = tl.exp2(t)
        at_max = t == 0.0
        top_lanes += at_max.to(tl.float32)
        s_lanes += tl.where(at_max, 0.0, e)
        w_lanes += tl.where(e > 0.0, e * t, 0.0)  # e = 0 where z = -inf: avoid 0 * -inf
    rest = tl.sum(s_lanes, axis=0) + (tl.sum(top_lanes, axis=0) - 1.0)  # s - 1
    log_s = _log1p(rest)
    s = 1.0 + rest
    shift = tl.where(m == float("-inf"), 0.0, m)
    entropy = log_s - tl.sum(w_lanes, axis=0) * 0.6931471805599453 / s
    # Ids are validated on the host; clamp anyway so that an unchecked bad id reads in bounds, and
    # turn it into NaN rather than a plausible wrong value.
    target = tl.load(ids_ptr + token)
    in_vocab = (target >= 0) & (target < vocab)
    z_target = tl.load(base + tl.where(in_vocab, target, 0).to(tl.int64), mask=is_valid, other=0.0).to(tl.float32)
    # (z_y - m) / T - log s, not z_y / T - lse: no cancellation against a large lse.
    logp = tl.where(in_vocab, (z_target - shift) * inv_temperature - log_s, float("nan"))

    tl.store(max_ptr + token, tl.where(is_valid, shift, 0.0))
    tl.store(log_s_ptr + token, tl.where(is_valid, log_s, 0.0))
    tl.store(logp_ptr + token, tl.where(is_valid, logp, 0.0))
    tl.store(entropy_ptr + token, tl.where(is_valid, entropy, 0.0))


@triton.jit
def _token_stats_backward_kernel(
    logits_ptr, grad_ptr, ids_ptr, valid_ptr, max_ptr, log_s_ptr, logp_ptr, entropy_ptr, grad_logp_ptr,
    grad_entropy_ptr,
    length, vocab, stride_n, stride_l, grad_stride_n, grad_stride_l, inv_temperature,
    BLOCK_V: tl.constexpr, EMULATE_BF16_ROUNDING: tl.constexpr,
):
    token = tl.program_id(0)
    row = token // length
    pos = token % length
    base = logits_ptr + row.to(tl.int64) * stride_n + pos.to(tl.int64) * stride_l
    grad_base = grad_ptr + row.to(tl.int64) * grad_stride_n + pos.to(tl.int64) * grad_stride_l
    is_valid = tl.load(valid_ptr + token) != 0
    cols = tl.arange(0, BLOCK_V)

    # Per-token constants. Everything is zero for masked tokens, whose logits are never read, so that
    # the same loop writes their exact zeros.
    row_max = tl.load(max_ptr + token)
    log_s = tl.load(log_s_ptr + token)
    entropy = tl.load(entropy_ptr + token)
    c = tl.where(is_valid, tl.load(grad_logp_ptr + token).to(tl.float32) * inv_temperature, 0.0)
    e = tl.where(is_valid, tl.load(grad_entropy_ptr + token).to(tl.float32) * inv_temperature, 0.0)
    coef_a = c + e * entropy
    target = tl.where(is_valid, tl.load(ids_ptr + token), -1)
    # The target's entry c (1 - p_y) - e p_y (log p_y + H), from the forward's log p_y.
    log_p_target = tl.load(logp_ptr + token)
    p_target = tl.exp(log_p_target)
    grad_target = -c * _expm1(log_p_target) - e * p_target * (log_p_target + entropy)
    readable = tl.where(is_valid, vocab, 0)
    for b in range(0, tl.cdiv(vocab, BLOCK_V)):
        offs = b * BLOCK_V + cols
        in_row = offs < vocab
        z = tl.load(base + offs, mask=offs < readable, other=float("-inf")).to(tl.float32)
        # log p = (z - max) / T - log s: the difference to the max first (exact near the max, where z / T - lse
        # would cancel), then the base change for exp2 on the small result.
        log_p = tl.fma(z - row_max, inv_temperature, -log_s)
        p = tl.exp2(log_p * 1.4426950408889634)
        grad = tl.where(p > 0.0, -p * tl.fma(e, log_p, coef_a), 0.0)  # banned tokens: p = 0, log p = -inf
        grad = tl.where(offs == target, grad_target, grad)
        if EMULATE_BF16_ROUNDING:
            # Triton's interpreter truncates float32 -> bfloat16; GPUs round to nearest even. Round
            # here so that tests on the CPU see the GPU's numerics (the cast below is then exact).
            bits = grad.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            grad = bits.to(tl.float32, bitcast=True)
        tl.store(grad_base + offs, grad.to(grad_ptr.dtype.element_ty), mask=in_row)


# (BLOCK_V, num_warps) by vocabulary size; tuned on the H200 by `bench/gpu_check.sh`'s sweep when a
# GPU is at hand (see bench/results/). Under the interpreter only BLOCK_V matters.
_LAUNCH_TABLE = ((1024, 1024, 4), (8192, 2048, 8), (1 << 62, 4096, 16))


def launch_config(vocab: int):
    """``(BLOCK_V, num_warps)`` for a vocabulary of ``vocab``."""
    for limit, block, warps in _LAUNCH_TABLE:
        if vocab <= limit:
            return min(block, triton.next_power_of_2(vocab)), warps
    raise AssertionError("unreachable")


def forward(logits: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, temperature: float = 1.0,
            max_chunk_bytes=None):
    """``logits [N, L, V]`` (last dim contiguous), ``ids, valid [N, L]`` -> ``(row_max, log_s, logp, H)``
    float32 ``[N, L]`` of softmax(logits / T), zeros where masked. ``max_chunk_bytes`` is unused (each
    program streams its own row)."""
    n_rows, length, vocab = logits.shape
    ids = ids.to(torch.int32).contiguous()
    valid = valid.contiguous()
    row_max, log_s, logp, entropy = (torch.empty((n_rows, length), dtype=torch.float32, device=logits.device)
                                     for _ in range(4))
    if logp.numel():
        block, warps = launch_config(vocab)
        _token_stats_forward_kernel[(n_rows * length,)](
            logits, ids, valid, row_max, log_s, logp, entropy, length, vocab, logits.stride(0), logits.stride(1),
            1.0 / temperature, BLOCK_V=block, num_warps=warps,
        )
    return row_max, log_s, logp, entropy


def backward(logits: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, row_max: torch.Tensor, log_s: torch.Tensor,
             logp: torch.Tensor, entropy: torch.Tensor, grad_logp: torch.Tensor, grad_entropy: torch.Tensor,
             out: torch.Tensor, temperature: float = 1.0, max_chunk_bytes=None) -> torch.Tensor:
    """Writes ``dlogits`` into ``out`` (``[N, L, V]``, last dim contiguous; may be ``logits`` itself)."""
    if logits.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("triton backward needs logits and out with a contiguous last dimension")
    n_rows, length, vocab = logits.shape
    if logp.numel():
        block, warps = launch_config(vocab)
        _token_stats_backward_kernel[(n_rows * length,)](
            logits, out, ids.to(torch.int32).contiguous(), valid.contiguous(), row_max.float().contiguous(),
            log_s.float().contiguous(), logp.float().contiguous(), entropy.float().contiguous(), grad_logp.float().contiguous(),
            grad_entropy.float().contiguous(), length, vocab, logits.stride(0), logits.stride(1), out.stride(0),
            out.stride(1), 1.0 / temperature,
            BLOCK_V=block, EMULATE_BF16_ROUNDING=out.dtype == torch.bfloat16 and triton_interpreted(),
            num_warps=warps,
        )
    return out
