"""Shared test helpers: random inputs that exercise the method, and relative-error assertions."""

from __future__ import annotations

import os

import torch

from gtpo_kernels import GTPOLossOutput, GTPOMetrics

# GTPO_TEST_CUDA=1 (on a GPU machine) runs the Triton backend on CUDA tensors, compiled;
# otherwise it runs on CPU tensors under the interpreter (tests/conftest.py).
ON_CUDA = os.environ.get("GTPO_TEST_CUDA", "0") != "0"


def device_for(backend: str) -> torch.device:
    return torch.device("cuda" if ON_CUDA and backend == "triton" else "cpu")


def to_cpu(out: GTPOLossOutput) -> GTPOLossOutput:
    m = {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in vars(out.metrics).items()}
    return GTPOLossOutput(out.loss.detach().cpu(), GTPOMetrics(**m))

# Relative error bars against the float64 reference (DEVELOPERS.md, "Standards").
RTOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


# float32 carries an absolute error of about 1e-7 on quantities that are differences of O(1) numbers
# (the entropy of a near-deterministic distribution is log s - w/s with s ~ 1), however small they are.
FP32_ABS_FLOOR = 1e-6


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str = "",
                     atol: float = 0.0) -> None:
    """max |actual - expected| <= rtol * max(|expected|, tiny) + atol; both compared in float64."""
    actual = torch.as_tensor(actual).double()
    expected = torch.as_tensor(expected).double()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values {actual}"
    scale = expected.abs().max().clamp(min=1e-12) if expected.numel() else torch.tensor(1.0)
    err = (actual - expected).abs().max() if expected.numel() else torch.tensor(0.0)
    assert err <= rtol * scale + atol, \
        f"{what}: max abs error {float(err):.3e} > {rtol:.1e} * {float(scale):.3e} + {atol:.1e}"


def random_batch(n_groups, group_size, length, vocab, *, dtype=torch.float32, seed=0, sharpness=4.0,
                 min_len=1, tie_groups=False, share_tokens=True):
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
