"""Shared test helpers: random inputs that exercise the method, and relative-error assertions."""

from __future__ import annotations

import os
from typing import Optional

import torch

from bench.common import PeakTensorMemory  # noqa: F401 (re-exported for the tests)
from gtpo_kernels import GTPOLossOutput, GTPOMetrics
from gtpo_kernels.reference import reference_loss_from_token_stats

# GTPO_TEST_CUDA=1 (on a GPU machine) runs the Triton backend on CUDA tensors, compiled;
# otherwise it runs on CPU tensors under the interpreter (tests/conftest.py).
ON_CUDA = os.environ.get("GTPO_TEST_CUDA", "0") != "0"


def row_scale(temperature):
    """A temperature as a divisor of ``[N, L, V]`` logits: a float as it is, each completion's ``[N]`` as
    ``[N, 1, 1]`` float64."""
    if isinstance(temperature, torch.Tensor):
        return temperature.double()[:, None, None]
    return temperature


def device_for(backend: str) -> torch.device:
    return torch.device("cuda" if ON_CUDA and backend == "triton" else "cpu")


def to_cpu(out: GTPOLossOutput) -> GTPOLossOutput:
    m = {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in vars(out.metrics).items()}
    return GTPOLossOutput(out.loss.detach().cpu(), GTPOMetrics(**m))


def tiny_chunks(vocab: int, tokens: int = 3) -> int:
    """A ``max_chunk_bytes`` that makes the torch backend work through ``tokens`` tokens at a time."""
    return 4 * vocab * tokens


# Relative error bars against the float64 reference, per quantity. The reference sees the same rounded inputs
# (bf16/fp16 logits upcast, or the very logits the fused path's GEMM produced), so what is accumulated in float32
# from them (the loss, entropies, ratios, KL, every metric) is held to float32's 1e-5 whatever the input dtype:
# RTOL_ACCUMULATED. Only outputs rounded to the input dtype (the gradients of bf16/fp16 inputs) get 1e-2: RTOL.
RTOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
RTOL_ACCUMULATED = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-5, torch.float16: 1e-5}


# float32 carries an absolute error of about 1e-7 on quantities that are differences of O(1) numbers
# (the entropy of a near-deterministic distribution is log s - w/s with s ~ 1), however small they are.
FP32_ABS_FLOOR = 1e-6


# Without a term scale, per-entry comparisons allow, besides rtol * |expected|, rtol times this fraction of
# the largest entry of the same row (last dimension).
ENTRY_FLOOR = 1e-2


def assert_close_per_entry(
    actual: torch.Tensor,
    expected: torch.Tensor,
    rtol: float,
    what: str = "",
    scale: Optional[torch.Tensor] = None,
    floor: float = ENTRY_FLOOR,
    atol: float = 0.0,
) -> None:
    """Every entry: |actual - expected| <= rtol * (|expected| + scale) + atol (float64 comparison).

    ``scale``: per entry, the size of the terms the entry is a sum of (`logits_gradient_scale`): an entry
    whose terms nearly cancel cannot be more precise than the terms. Without it, ``floor`` times the
    largest entry of the same row."""
    actual = torch.as_tensor(actual).double()
    expected = torch.as_tensor(expected).double()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    if not expected.numel():
        return
    if scale is None:
        scale = floor * (expected.abs().amax(dim=-1, keepdim=True) if expected.dim() else expected.abs())
    bound = rtol * (expected.abs() + scale.double()) + atol
    excess = (actual - expected).abs() - bound
    worst = int(excess.argmax())
    assert excess.max() <= 0, (
        f"{what}: entry {tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), expected.shape))} is "
        f"{float(actual.reshape(-1)[worst]):.6e}, expected {float(expected.reshape(-1)[worst]):.6e}, allowed "
        f"+-{float(bound.reshape(-1)[worst]):.1e} (rtol {rtol:.0e})"
    )


def token_coefficients(
    logits: torch.Tensor, completion_ids, completion_mask, advantages, *, config, temperature=1.0, **kwargs
):
    """From the float64 oracle: ``(c, e, log_p)``, the gradient of the loss w.r.t. each token's log-prob and
    entropy ``[N, L]`` and the log-softmax ``[N, L, V]`` of ``logits / T``."""
    valid = completion_mask.bool()
    safe = torch.where(valid, completion_ids, 0)
    log_p = torch.log_softmax(logits.double() / row_scale(temperature), dim=-1)
    p = log_p.exp()
    logp = log_p.gather(-1, safe[..., None]).squeeze(-1)
    entropy = -(p * log_p.masked_fill(p == 0, 0.0)).sum(-1)
    lp, h = logp.detach().requires_grad_(), entropy.detach().requires_grad_()
    loss = reference_loss_from_token_stats(
        lp,
        h,
        completion_ids,
        valid,
        advantages.double(),
        config=config,
        **{k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kwargs.items()},
    ).loss
    c, e = (torch.zeros_like(lp) if g is None else g for g in torch.autograd.grad(loss, (lp, h), allow_unused=True))
    return c, e, log_p


def loss_scale(logits: torch.Tensor, completion_ids, completion_mask, advantages, **kwargs) -> float:
    """The size of the terms the loss sums, ``sum |c| + |e| H`` over tokens: a loss that is a difference of
    larger terms cannot be more precise than they are."""
    c, e, log_p = token_coefficients(logits, completion_ids, completion_mask, advantages, **kwargs)
    p = log_p.exp()
    entropy = -(p * log_p.masked_fill(p == 0, 0.0)).sum(-1)
    return float((c.abs() + e.abs() * entropy).sum())


def logits_gradient_scale(
    logits: torch.Tensor, completion_ids, completion_mask, advantages, *, config, temperature=1.0, **kwargs
) -> torch.Tensor:
    """``[N, L, V]``: the size of the terms of each entry of d loss / d logits, from the float64 oracle.

    The entry is ``(c (onehot - p) + e dH/du) / T`` with ``c, e`` the gradient of the loss w.r.t. the token's
    log-prob and entropy: off the target the terms are ``p_v |c|`` and ``p_v |e| |log p_v + H|`` (bounded by
    ``p_v |e| (|log p_v| + H)``), at the target ``|c| (1 - p_y)`` and ``p_y |e| |log p_y + H|``."""
    c, e, log_p = token_coefficients(
        logits, completion_ids, completion_mask, advantages, config=config, temperature=temperature, **kwargs
    )
    valid = completion_mask.bool()
    safe = torch.where(valid, completion_ids, 0)
    p = log_p.exp()
    finite_log_p = log_p.masked_fill(p == 0, 0.0)
    entropy = -(p * finite_log_p).sum(-1, keepdim=True)
    logp = finite_log_p.gather(-1, safe[..., None])
    c, e = c[..., None].abs(), e[..., None].abs()
    scale = p * (c + e * (finite_log_p.abs() + entropy))
    p_y = p.gather(-1, safe[..., None])
    at_target = c * (1 - p_y) + e * p_y * (logp + entropy).abs()
    scale = scale.scatter(-1, safe[..., None], at_target)
    return scale * valid[..., None] / row_scale(temperature)


def assert_rel_close(
    actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str = "", atol: float = 0.0
) -> None:
    """max |actual - expected| <= rtol * max(|expected|, tiny) + atol; both compared in float64. For
    scalars and vectors of like magnitude; gradients use `assert_close_per_entry`."""
    actual = torch.as_tensor(actual).double()
    expected = torch.as_tensor(expected).double()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values {actual}"
    scale = expected.abs().max().clamp(min=1e-12) if expected.numel() else torch.tensor(1.0)
    err = (actual - expected).abs().max() if expected.numel() else torch.tensor(0.0)
    assert err <= rtol * scale + atol, (
        f"{what}: max abs error {float(err):.3e} > {rtol:.1e} * {float(scale):.3e} + {atol:.1e}"
    )


def random_batch(
    n_groups,
    group_size,
    length,
    vocab,
    *,
    dtype=torch.float32,
    seed=0,
    sharpness=4.0,
    min_len=1,
    tie_groups=False,
    share_tokens=True,
):
    """A fresh random batch: logits ``[N, L, V]`` with a mix of confident and uncertain rows (so the
    entropy filter keeps some completions and drops others), ids that often repeat across a group (so
    there are conflict tokens), right-padded masks of random lengths and random rewards-based advantages.
    """
    g = torch.Generator().manual_seed(seed)
    n = n_groups * group_size
    ids = torch.randint(0, vocab, (n, length), generator=g)
    if share_tokens and vocab > 1:
        # Copy a random prefix/suffix of the group's first completion into the others.
        for b in range(n_groups):
            base = ids[b * group_size].clone()
            for i in range(b * group_size + 1, (b + 1) * group_size):
                k = int(torch.randint(0, length + 1, (1,), generator=g))
                ids[i, :k] = base[:k]
    lengths = torch.randint(min_len, length + 1, (n,), generator=g)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    # Per-row sharpness: some rows low-entropy (kept by the filter), some high-entropy (filtered).
    row_sharp = sharpness * torch.rand(n, 1, 1, generator=g) * 2
    logits = torch.randn(n, length, vocab, generator=g, dtype=torch.float64)
    logits = logits + row_sharp * torch.nn.functional.one_hot(ids, vocab).double()
    if tie_groups:
        rewards = torch.ones(n, dtype=torch.float64)
    else:
        rewards = torch.randint(0, 3, (n,), generator=g).double()
    advantages = (rewards.view(-1, group_size) - rewards.view(-1, group_size).mean(1, keepdim=True)).view(-1)
    return logits.to(dtype), ids, mask, advantages.to(torch.float32 if dtype != torch.float64 else dtype)
