"""Per-token log-prob and entropy as Triton kernels: one pass over the vocabulary forward, one back.

Both kernels see ``u = z / T`` (``softmax(z / T)``, the sampling distribution), ``T`` one for every token
(scalar arguments) or each token's own (``PER_TOKEN_TEMPERATURE``: one load per program).

Forward (`_token_stats_forward_kernel`): one program per token streams its ``V`` logits once. It works in
the base-2 domain, where ``exp2`` is one instruction, shifted by ``big_m = m * log2(e) / T`` for the running
max ``m``: ``t = z * scale - big_m`` is one fma per element, rounded once like ``(z - m) * scale``. Per lane it
keeps ``s = sum 2^t`` and ``w = sum 2^t t``, so that the loop over most blocks is load, max, fma, exp2, add,
max (``-inf`` logits), fma, with one reduction (the block's max) per block. Blocks that reach the running
max (a few per row) take a branch that rescales the lanes and counts the values equal to the max apart:
``s = 1 + rest`` is where a confident token's log-prob lives, and a 1 in a lane's sum would swamp ``rest``.
It writes ``m``, ``log s``, ``logp = (z_y - m) / T - log s`` and ``H = log s - w ln 2 / s``. Masked tokens read
nothing and get zeros. Ids outside ``[0, V)``, NaN and +inf logits give NaN statistics, which the loss
reports (one check for every backend, without a pass of its own).

Backward (`_token_stats_backward_kernel`): one program per token reads its logits once more and writes
``dlogits = (c (onehot(y) - p) + e dH/du) / T`` with ``dH/du = -p (log p + H)``; per element that is
``-p (A + e log p)`` with the per-token constant ``A = c + e H``, ``log p = (z - m) / T - log s`` and ``p`` from
an exp accurate to an ulp (``libdevice``; ``ex2.approx`` of a rounded product loses digits as ``|log p|``
grows). The target's entry is written after the loop, from the forward's ``log p_y``, with
``1 - p_y = -expm1(log p_y)``, which does not cancel for a confident token. Masked tokens get exact zeros
without reading their logits.

The same kernels run on CPU tensors under ``TRITON_INTERPRET=1`` (how CI tests them). Loops run over
bounds computed from scalar arguments only: triton 3.6's interpreter with numpy >= 2.4 fails on loops
bounded by a tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .triton_interpreter import triton_interpreted


@triton.jit
def _log1p(x, INTERPRETED: tl.constexpr):
    """log(1 + x) without losing small x: libdevice's log1pf on a GPU; under the interpreter, which has no
    libdevice, Kahan's form (exact only as far as numpy's log is, which is accurate to an ulp: ``tl.log`` on a
    GPU, ``lg2.approx``, is not, so the compiled kernels do not lean on it)."""
    if INTERPRETED:
        u = 1.0 + x
        return tl.where(u == 1.0, x, tl.log(u) * x / tl.where(u == 1.0, 1.0, u - 1.0))
    else:
        return libdevice.log1p(x)


@triton.jit
def _expm1(x, INTERPRETED: tl.constexpr):
    """exp(x) - 1 for x <= 0: libdevice's expm1f on a GPU. Under the interpreter: near 0 Kahan's form, which
    does not cancel; below -1/2 plain exp(x) - 1, which does not cancel there either, and unlike Kahan's form
    stays exact where exp(x) is subnormal or 0 (its log would have lost the digits: a confident row's off-target
    token at log p = -100)."""
    if INTERPRETED:
        u = tl.exp(x)
        kahan = (u - 1.0) * x / tl.log(tl.where((u == 1.0) | (u == 0.0), 0.5, u))
        return tl.where(x < -0.5, u - 1.0, tl.where(u == 1.0, x, kahan))
    else:
        return libdevice.expm1(x)


@triton.jit
def _accurate_exp(x, INTERPRETED: tl.constexpr):
    """exp(x) to about one ulp: libdevice's expf on a GPU (``tl.exp`` is ``ex2.approx`` of a rounded
    ``x log2(e)``, whose error grows with |x|), numpy's under the interpreter, which has no libdevice."""
    if INTERPRETED:
        return tl.exp(x)
    else:
        return libdevice.exp(x)


@triton.jit
def _round_for(x, ptr, EMULATE_BF16_ROUNDING: tl.constexpr):
    """``x`` (float32) in ``ptr``'s element type. Triton's interpreter truncates float32 -> bfloat16 where
    GPUs round to nearest even: with ``EMULATE_BF16_ROUNDING`` round here, so that tests on the CPU see the
    GPU's numerics (the cast is then exact)."""
    if EMULATE_BF16_ROUNDING:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(ptr.dtype.element_ty)


@triton.jit
def _token_stats_forward_kernel(
    logits_ptr,
    ids_ptr,
    valid_ptr,
    max_ptr,
    log_s_ptr,
    logp_ptr,
    entropy_ptr,
    length,
    vocab,
    stride_n,
    stride_l,
    inv_temperature,
    scale,
    inv_temperature_ptr,
    scale_ptr,
    BLOCK_V: tl.constexpr,
    INTERPRETED: tl.constexpr,
    PER_TOKEN_TEMPERATURE: tl.constexpr,
):
    token = tl.program_id(0)
    if PER_TOKEN_TEMPERATURE:  # each token's own 1 / T and log2(e) / T (mixed-temperature rollouts)
        inv_temperature = tl.load(inv_temperature_ptr + token)
        scale = tl.load(scale_ptr + token)
    if tl.load(valid_ptr + token) == 0:  # masked: zeros, logits never read
        tl.store(max_ptr + token, 0.0)
        tl.store(log_s_ptr + token, 0.0)
        tl.store(logp_ptr + token, 0.0)
        tl.store(entropy_ptr + token, 0.0)
        return
    row = token // length
    pos = token % length
    # int64 offsets: N * L * V exceeds 2^31 at realistic sizes.
    base = logits_ptr + row.to(tl.int64) * stride_n + pos.to(tl.int64) * stride_l
    cols = tl.arange(0, BLOCK_V)

    # Base-2 domain, shifted by big_m = round(m * scale) (scale = log2(e) / T, m the running max of z): the
    # shift is one fma per element, t = z * scale - big_m, rounded once like (z - m) * scale. Values equal
    # to m are counted apart (top) so that s = 1 + rest keeps the precision of a small rest.
    m = tl.full((), float("-inf"), tl.float32)
    big_m = tl.zeros((), tl.float32)
    top = tl.zeros((), tl.float32)
    s_lanes = tl.zeros((BLOCK_V,), tl.float32)  # sum of 2^t below the max
    w_lanes = tl.zeros((BLOCK_V,), tl.float32)  # sum of 2^t t below the max
    for b in range(0, tl.cdiv(vocab, BLOCK_V)):
        offs = b * BLOCK_V + cols
        z = tl.load(base + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        block_max = tl.max(z, axis=0)
        if block_max >= m:
            # Rare (a few blocks per row): this block reaches the running max.
            if block_max > m:
                new_big_m = block_max * scale
                if m > float("-inf"):
                    # Move the lanes to the new shift, and the old max's values into the lanes.
                    delta = big_m - new_big_m
                    alpha = tl.exp2(delta)
                    w_lanes = alpha * (w_lanes + delta * s_lanes)
                    s_lanes = alpha * s_lanes
                    t_top = tl.fma(m, scale, -new_big_m)
                    e_top = tl.exp2(t_top)
                    s_lanes += tl.where(cols == 0, top * e_top, 0.0)
                    w_lanes += tl.where(cols == 0, top * e_top * t_top, 0.0)
                m = block_max
                big_m = new_big_m
                top = 0.0
            at_max = z == m  # (while m = -inf these are -inf values, which the row's NaN reports)
            top += tl.sum(at_max.to(tl.float32), axis=0)
            t = tl.fma(z, scale, -big_m)
            e = tl.exp2(t)
            s_lanes += tl.where(at_max, 0.0, e)
            w_lanes += tl.where(at_max, 0.0, e * tl.maximum(t, -1024.0))
        else:
            t = tl.fma(z, scale, -big_m)
            e = tl.exp2(t)
            s_lanes += e
            # -inf logits (banned tokens, the tail past V) have e = 0: the clamp keeps 0 * -inf out; NaN
            # logits still reach the sums through e.
            w_lanes += e * tl.maximum(t, -1024.0)
    # m * scale = big_m + r exactly; the lanes hold 2^r times the sums relative to m.
    r = tl.fma(m, scale, -big_m)
    unshift = tl.exp2(-r)
    s_rest = tl.sum(s_lanes, axis=0)
    rest = s_rest * unshift  # sum_v 2^u_v over values below m, u = (z - m) * scale
    w = (tl.sum(w_lanes, axis=0) - r * s_rest) * unshift  # sum_v 2^u_v u_v
    log_s = _log1p((top - 1.0) + rest, INTERPRETED)
    entropy = log_s - w * 0.6931471805599453 / (top + rest)
    # An id outside [0, V) (the loss reports it) reads in bounds and gives NaN; so do NaN or +inf logits.
    target = tl.load(ids_ptr + token)
    in_vocab = (target >= 0) & (target < vocab)
    z_target = tl.load(base + tl.where(in_vocab, target, 0).to(tl.int64)).to(tl.float32)
    finite = in_vocab & (m < float("inf"))
    # (z_y - m) / T - log s, not z_y / T - lse: no cancellation against a large lse.
    logp = tl.where(finite, tl.fma(z_target - m, inv_temperature, -log_s), float("nan"))
    tl.store(max_ptr + token, m)
    tl.store(log_s_ptr + token, log_s)
    tl.store(logp_ptr + token, logp)
    tl.store(entropy_ptr + token, entropy)


@triton.jit
def _token_stats_backward_kernel(
    logits_ptr,
    grad_ptr,
    ids_ptr,
    valid_ptr,
    max_ptr,
    log_s_ptr,
    logp_ptr,
    entropy_ptr,
    grad_logp_ptr,
    grad_entropy_ptr,
    length,
    vocab,
    stride_n,
    stride_l,
    grad_stride_n,
    grad_stride_l,
    inv_temperature,
    inv_temperature_ptr,
    BLOCK_V: tl.constexpr,
    HAS_GRAD_ENTROPY: tl.constexpr,
    INTERPRETED: tl.constexpr,
    EMULATE_BF16_ROUNDING: tl.constexpr,
    PER_TOKEN_TEMPERATURE: tl.constexpr,
):
    token = tl.program_id(0)
    if PER_TOKEN_TEMPERATURE:
        inv_temperature = tl.load(inv_temperature_ptr + token)
    row = token // length
    pos = token % length
    grad_base = grad_ptr + row.to(tl.int64) * grad_stride_n + pos.to(tl.int64) * grad_stride_l
    cols = tl.arange(0, BLOCK_V)
    if tl.load(valid_ptr + token) == 0:  # masked: exact zeros, logits never read
        for b in range(0, tl.cdiv(vocab, BLOCK_V)):
            offs = b * BLOCK_V + cols
            tl.store(grad_base + offs, tl.zeros((BLOCK_V,), grad_ptr.dtype.element_ty), mask=offs < vocab)
        return
    base = logits_ptr + row.to(tl.int64) * stride_n + pos.to(tl.int64) * stride_l

    # Per-token constants: dlogits = -p (coef_a + e log p) off the target.
    row_max = tl.load(max_ptr + token)
    log_s = tl.load(log_s_ptr + token)
    entropy = tl.load(entropy_ptr + token)
    c = tl.load(grad_logp_ptr + token).to(tl.float32) * inv_temperature
    if HAS_GRAD_ENTROPY:
        e = tl.load(grad_entropy_ptr + token).to(tl.float32) * inv_temperature
    else:
        e = 0.0
    coef_a = c + e * entropy
    for b in range(0, tl.cdiv(vocab, BLOCK_V)):
        offs = b * BLOCK_V + cols
        in_row = offs < vocab
        z = tl.load(base + offs, mask=in_row, other=float("-inf")).to(tl.float32)
        # log p = (z - max) / T - log s: the difference to the max first (exact near the max, where z / T - lse
        # would cancel), one rounding, then an exp accurate to an ulp.
        log_p = tl.fma(z - row_max, inv_temperature, -log_s)
        p = _accurate_exp(log_p, INTERPRETED)
        if HAS_GRAD_ENTROPY:
            # Banned tokens: p = 0 and log p = -inf; the clamp keeps 0 * -inf out.
            grad = -p * tl.fma(e, tl.maximum(log_p, -1024.0), coef_a)
        else:
            grad = -p * coef_a
        tl.store(grad_base + offs, _round_for(grad, grad_ptr, EMULATE_BF16_ROUNDING), mask=in_row)
    # The target's entry c (1 - p_y) - e p_y (log p_y + H), from the forward's log p_y, with 1 - p_y =
    # -expm1(log p_y), which does not cancel for a confident token. Written after the loop wrote this row
    # (the barrier orders the two stores to it), so that the loop needs no per-element compare.
    target = tl.load(ids_ptr + token)
    if (target >= 0) & (target < vocab):
        log_p_target = tl.load(logp_ptr + token)
        grad_target = -c * _expm1(log_p_target, INTERPRETED)
        if HAS_GRAD_ENTROPY:
            grad_target -= e * tl.exp(log_p_target) * (log_p_target + entropy)
        tl.debug_barrier()
        tl.store(grad_base + target.to(tl.int64), _round_for(grad_target, grad_ptr, EMULATE_BF16_ROUNDING))


# (vocabulary limit, BLOCK_V, num_warps, num_stages), for the forward and the backward apart. For V > 8192 the
# fastest of an H200 sweep (`python -m bench kernels`; its table: bench/results/h200-2026-11-30/README.md), which
# ran 4-16 warps at Triton's default 3 stages only: the GPU check now sweeps 1-8 warps and 1-3 stages. Smaller
# vocabularies take a block that covers them. Under the interpreter only BLOCK_V matters.
_FORWARD_LAUNCH = ((1024, 1024, 4, 3), (1 << 62, 2048, 4, 3))
_BACKWARD_LAUNCH = ((1024, 1024, 4, 3), (8192, 2048, 8, 3), (1 << 62, 4096, 16, 3))


def launch_config(vocab: int, table=None):
    """``(BLOCK_V, num_warps, num_stages)`` for a vocabulary of ``vocab`` (the forward's table unless ``table`` is
    given)."""
    for limit, block, warps, stages in table or _FORWARD_LAUNCH:
        if vocab <= limit:
            return min(block, triton.next_power_of_2(vocab)), warps, stages
    raise AssertionError("unreachable")


def _log2e_over(temperature: float) -> float:
    return 1.4426950408889634 / temperature


def _temperature_args(temperature, device):
    """``(inv_temperature, scale, inv_temperature_ptr, scale_ptr, per_token)``: scalars for a float; for each
    token's ``[N, L]``, float32 tensors of ``1 / T`` and ``log2(e) / T`` (each rounded once from float64, as the
    scalars are), the scalars then unused."""
    if not isinstance(temperature, torch.Tensor):
        dummy = torch.empty((1,), dtype=torch.float32, device=device)
        return 1.0 / temperature, _log2e_over(temperature), dummy, dummy, False
    t = temperature.to(device=device, dtype=torch.float64).contiguous()
    return 1.0, 1.0, (1.0 / t).float(), (1.4426950408889634 / t).float(), True


def _ids_int32(ids: torch.Tensor) -> torch.Tensor:
    """The kernels' int32 ids. An id outside int32's range becomes -1 (outside every vocabulary, so its
    log-prob is NaN and the caller's check names it) instead of wrapping into range: 2**32 + 5 is not 5."""
    if ids.dtype == torch.int64:
        ids = torch.where((ids < 0) | (ids > torch.iinfo(torch.int32).max), -1, ids)
    return ids.to(torch.int32).contiguous()


def forward(logits: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, temperature=1.0):
    """``logits [N, L, V]`` (last dim contiguous), ``ids, valid [N, L]`` -> ``(row_max, log_s, logp, H)``
    float32 ``[N, L]`` of softmax(logits / T) (``T`` a float or each token's ``[N, L]``), zeros where masked; NaN
    log-probs for ids outside ``[0, V)`` and for NaN or +inf logits. Each program streams its own row: no chunk
    budget."""
    n_rows, length, vocab = logits.shape
    ids = _ids_int32(ids)
    valid = valid.contiguous()
    row_max, log_s, logp, entropy = (
        torch.empty((n_rows, length), dtype=torch.float32, device=logits.device) for _ in range(4)
    )
    if logp.numel():
        block, warps, stages = launch_config(vocab, _FORWARD_LAUNCH)
        inv_t, scale, inv_t_ptr, scale_ptr, per_token = _temperature_args(temperature, logits.device)
        _token_stats_forward_kernel[(n_rows * length,)](
            logits,
            ids,
            valid,
            row_max,
            log_s,
            logp,
            entropy,
            length,
            vocab,
            logits.stride(0),
            logits.stride(1),
            inv_t,
            scale,
            inv_t_ptr,
            scale_ptr,
            BLOCK_V=block,
            INTERPRETED=triton_interpreted(),
            PER_TOKEN_TEMPERATURE=per_token,
            num_warps=warps,
            num_stages=stages,
        )
    return row_max, log_s, logp, entropy


def backward(
    logits: torch.Tensor,
    ids: torch.Tensor,
    valid: torch.Tensor,
    row_max: torch.Tensor,
    log_s: torch.Tensor,
    logp: torch.Tensor,
    entropy: torch.Tensor,
    grad_logp: torch.Tensor,
    grad_entropy,
    out: torch.Tensor,
    temperature=1.0,
) -> torch.Tensor:
    """Writes ``dlogits`` into ``out`` (``[N, L, V]``, last dim contiguous; may be ``logits`` itself);
    ``grad_entropy`` ``None`` is zero (the kernel then skips the entropy term)."""
    if logits.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("triton backward needs logits and out with a contiguous last dimension")
    n_rows, length, vocab = logits.shape
    if logp.numel():
        block, warps, stages = launch_config(vocab, _BACKWARD_LAUNCH)
        has_grad_entropy = grad_entropy is not None
        grad_entropy = grad_entropy.float().contiguous() if has_grad_entropy else logp
        inv_t, _, inv_t_ptr, _, per_token = _temperature_args(temperature, logits.device)
        _token_stats_backward_kernel[(n_rows * length,)](
            logits,
            out,
            _ids_int32(ids),
            valid.contiguous(),
            row_max.float().contiguous(),
            log_s.float().contiguous(),
            logp.float().contiguous(),
            entropy.float().contiguous(),
            grad_logp.float().contiguous(),
            grad_entropy,
            length,
            vocab,
            logits.stride(0),
            logits.stride(1),
            out.stride(0),
            out.stride(1),
            inv_t,
            inv_t_ptr,
            BLOCK_V=block,
            HAS_GRAD_ENTROPY=has_grad_entropy,
            INTERPRETED=triton_interpreted(),
            EMULATE_BF16_ROUNDING=out.dtype == torch.bfloat16 and triton_interpreted(),
            PER_TOKEN_TEMPERATURE=per_token,
            num_warps=warps,
            num_stages=stages,
        )
    return out
