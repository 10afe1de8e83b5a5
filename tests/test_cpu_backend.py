"""The C++ CPU kernels (``backend="cpu"``): built, exact, deterministic, and a clean fallback.

The parity suite (test_parity.py, test_fused_linear.py, the in-place tests in test_triton.py) runs
this backend against the float64 reference like every other; this file holds what is CPU-specific.
"""

import os
import warnings

import pytest
import torch

from gtpo_kernels import GTPOConfig, conflict_weights, gtpo_loss
from gtpo_kernels import _extension
from gtpo_kernels.ops import token_stats_cpu, token_stats_torch
from gtpo_kernels.ops.token_stats_cpu import conflict_weights_cpu
from gtpo_kernels.token_stats import resolve_backend

from .helpers import random_batch


def test_extension_is_built():
    # CI installs with a compiler; a missing extension would silently demote "auto" to the slow path.
    if os.environ.get("GTPO_ALLOW_NO_EXTENSION") == "1":
        pytest.skip("GTPO_ALLOW_NO_EXTENSION=1")
    assert _extension.cpu_extension_available()
    assert resolve_backend("auto", torch.device("cpu")) == "cpu"


@pytest.mark.parametrize("seed", range(6))
def test_conflict_weights_bit_for_bit(seed):
    g = torch.Generator().manual_seed(seed)
    group, length = [2, 3, 8][seed % 3], [1, 6, 40][seed % 3]
    n = 4 * group
    ids = torch.randint(0, 3, (n, length), generator=g)
    lengths = torch.randint(0, length + 1, (n,), generator=g)
    mask = torch.arange(length)[None] < lengths[:, None]
    adv = torch.randint(-1, 2, (n,), generator=g).float() * torch.rand(n, generator=g)
    lam, cnt = conflict_weights_cpu(ids, mask, adv, group, 2.0 + seed % 2)
    lam_ref, cnt_ref = conflict_weights(ids, mask, adv, group, 2.0 + seed % 2)
    assert torch.equal(lam, lam_ref) and torch.equal(cnt, cnt_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_deterministic_across_runs_and_thread_counts(dtype):
    logits, ids, mask, adv = random_batch(4, 4, 9, 3001, dtype=dtype, seed=3)
    config = GTPOConfig(entropy_mode="penalty")
    threads = torch.get_num_threads()
    results = []
    try:
        for n_threads in (1, 2, 3, 1):
            torch.set_num_threads(n_threads)
            x = logits.clone().requires_grad_()
            out = gtpo_loss(x, ids, mask, adv, group_size=4, config=config, backend="cpu")
            out.loss.backward()
            results.append((out.loss, x.grad, out.metrics.completion_entropy))
    finally:
        torch.set_num_threads(threads)
    for loss, grad, entropy in results[1:]:
        assert torch.equal(loss, results[0][0])
        assert torch.equal(grad, results[0][1])
        assert torch.equal(entropy, results[0][2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_gradient_rounding_matches_torch_backend(dtype):
    # Both backends compute the gradient in float32 and round once to the logits' dtype (to nearest).
    logits, ids, mask, _ = random_batch(2, 3, 4, 777, dtype=dtype, seed=4)
    lse, logp, entropy = token_stats_torch.forward(logits, ids, mask)
    g = torch.Generator().manual_seed(5)
    c, e = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)

    out_cpu = token_stats_cpu.backward(logits, ids, mask, lse, entropy, c, e, torch.empty_like(logits))
    out_torch = token_stats_torch.backward(logits, ids, mask, lse, entropy, c, e, torch.empty_like(logits))
    torch.testing.assert_close(out_cpu.float(), out_torch.float(), rtol=0, atol=float(torch.finfo(dtype).eps) * 4)


def test_unavailable_extension_warns_once_and_auto_falls_back(monkeypatch):
    monkeypatch.setattr(_extension, "_load", lambda: (None, "no compiler (test)"))
    _extension.cpu_extension_available.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert resolve_backend("auto", torch.device("cpu")) == "torch"
            assert resolve_backend("auto", torch.device("cpu")) == "torch"
        messages = [str(w.message) for w in caught if "C++ CPU kernels are unavailable" in str(w.message)]
        assert len(messages) == 1 and "no compiler (test)" in messages[0]
        with pytest.raises(RuntimeError, match="backend='cpu' is unavailable: no compiler"):
            _extension.load_cpu_extension()
    finally:
        _extension.cpu_extension_available.cache_clear()


def test_cpu_backend_needs_cpu_tensors():
    with pytest.raises(ValueError, match="backend='cpu' needs CPU tensors"):
        resolve_backend("cpu", torch.device("meta"))
