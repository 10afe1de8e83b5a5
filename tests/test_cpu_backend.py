"""The C++ CPU kernels (``backend="cpu"``): built, exact, deterministic, portable, and a clean fallback.

The parity suite (test_parity.py, test_fused_linear.py, the in-place tests in test_triton.py) runs
this backend against the float64 reference like every other; this file holds what is CPU-specific.
"""

import os
import subprocess
import sys
import warnings

import pytest
import torch

from gtpo_kernels import GTPOConfig, backends, gtpo_loss
from gtpo_kernels.backends import cpu_backend, cpu_extension, resolve_backend, torch_backend
from gtpo_kernels.reference import reference_conflict_weights

from .helpers import random_batch


def test_extension_is_built():
    # CI installs with a compiler; a missing extension would silently demote "auto" to the slow path.
    if os.environ.get("GTPO_ALLOW_NO_EXTENSION") == "1":
        pytest.skip("GTPO_ALLOW_NO_EXTENSION=1")
    assert cpu_extension.extension_error() is None
    assert resolve_backend("auto", torch.device("cpu")).name == "cpu"
    # The variant loaded is the one this machine supports (or the one asked for).
    assert torch.ops.gtpo_cpu.capability() == cpu_extension.wanted_variant()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.cpu_kernels
def test_conflict_weights_bit_for_bit(seed):
    g = torch.Generator().manual_seed(seed)
    group, length = [2, 3, 8][seed % 3], [1, 6, 40][seed % 3]
    n = 4 * group
    ids = torch.randint(0, 3, (n, length), generator=g)
    lengths = torch.randint(0, length + 1, (n,), generator=g)
    mask = torch.arange(length)[None] < lengths[:, None]
    adv = torch.randint(-1, 2, (n,), generator=g).float() * torch.rand(n, generator=g)
    lam, cnt = cpu_backend.conflict_weights(ids, mask, adv, group, 2.0 + seed % 2)
    lam_ref, cnt_ref = reference_conflict_weights(ids, mask, adv, group, 2.0 + seed % 2)
    assert torch.equal(lam, lam_ref.float()) and torch.equal(cnt, cnt_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.cpu_kernels
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
@pytest.mark.cpu_kernels
def test_gradient_rounding_matches_torch_backend(dtype):
    # Both backends compute the gradient in float32 and round once to the logits' dtype (to nearest).
    logits, ids, mask, _ = random_batch(2, 3, 4, 777, dtype=dtype, seed=4)
    stats = torch_backend.forward(logits, ids, mask)
    g = torch.Generator().manual_seed(5)
    c, e = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)

    out_cpu = cpu_backend.backward(logits, ids, mask, *stats, c, e, torch.empty_like(logits))
    out_torch = torch_backend.backward(logits, ids, mask, *stats, c, e, torch.empty_like(logits))
    torch.testing.assert_close(out_cpu.float(), out_torch.float(), rtol=0, atol=float(torch.finfo(dtype).eps) * 4)


def test_unavailable_extension_warns_once_and_auto_falls_back(monkeypatch):
    monkeypatch.setattr(cpu_extension, "_load", lambda: (None, "no compiler (test)"))
    backends._warn_fallback.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert resolve_backend("auto", torch.device("cpu")).name == "torch"
            assert resolve_backend("auto", torch.device("cpu")).name == "torch"
        messages = [str(w.message) for w in caught if "uses the slower 'torch' backend" in str(w.message)]
        assert len(messages) == 1 and "no compiler (test)" in messages[0]
        with pytest.raises(RuntimeError, match="backend='cpu' is unavailable: no compiler"):
            cpu_extension.load_cpu_extension()
        with pytest.raises(ValueError, match="backend='cpu' is unavailable: no compiler"):
            resolve_backend("cpu", torch.device("cpu"))
    finally:
        backends._warn_fallback.cache_clear()


def test_cpu_backend_needs_cpu_tensors():
    with pytest.raises(ValueError, match="backend='cpu' needs CPU tensors"):
        resolve_backend("cpu", torch.device("meta"))


def test_forced_capability_must_be_supported(monkeypatch):
    monkeypatch.setenv("GTPO_CPU_CAPABILITY", "sse9")
    with pytest.raises(ValueError, match="GTPO_CPU_CAPABILITY must be one of"):
        cpu_extension.wanted_variant()
    monkeypatch.setenv("GTPO_CPU_CAPABILITY", "default")
    assert cpu_extension.wanted_variant() == "default"


@pytest.mark.skipif(os.environ.get("GTPO_CPU_CAPABILITY") is not None, reason="already running a forced variant")
@pytest.mark.parametrize("variant", ["default", "avx2"])
@pytest.mark.cpu_kernels
def test_cpu_suite_passes_with_a_lower_variant(variant):
    """The portable builds: the CPU tests again in a process that loads the baseline (or AVX2) variant."""
    supported = cpu_extension.supported_variant()
    order = ("avx512", "avx2", "default")
    if order.index(variant) < order.index(supported):
        pytest.skip(f"this CPU does not support {variant}")
    env = dict(os.environ, GTPO_CPU_CAPABILITY=variant)
    tests = [
        "tests/test_cpu_backend.py",
        "tests/test_cpu_one_sweep.py",
        "tests/test_parity.py::test_configs_and_dtypes",
        "tests/test_parity.py::test_vocab_sizes",
        "tests/test_accuracy.py",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", "cpu and not trl", *tests],
        env=env,
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout
