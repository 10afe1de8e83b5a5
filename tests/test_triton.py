"""Triton-specific behaviour: conflict weights bit for bit, the in-place gradient mode, the no-grad
forward, backend selection, and a property test over random shapes. On the CPU the kernels run
under Triton's interpreter (tests/conftest.py); with GTPO_TEST_CUDA=1 they run compiled on a GPU."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gtpo_kernels import GTPOConfig, gtpo_loss, token_logprobs_and_entropy
from gtpo_kernels.backends import registered, resolve_backend
from gtpo_kernels.backends.triton_conflict_weights import conflict_weights_triton
from gtpo_kernels.backends.triton_interpreter import triton_interpreted
from gtpo_kernels.reference import reference_conflict_weights, reference_gtpo_loss
from gtpo_kernels.reference import token_logprobs_and_entropy as reference_token_stats

from .helpers import (
    RTOL,
    RTOL_ACCUMULATED,
    assert_close_per_entry,
    assert_rel_close,
    device_for,
    logits_gradient_scale,
    loss_scale,
    random_batch,
)

DEV = device_for("triton")


@pytest.mark.parametrize("seed", range(8))
def test_conflict_weights_bit_for_bit(seed):
    g = torch.Generator().manual_seed(seed)
    n_groups, group, length = 3, [2, 4, 8][seed % 3], [1, 5, 37][seed % 3]
    ids = torch.randint(0, 3, (n_groups * group, length), generator=g)
    lengths = torch.randint(0, length + 1, (n_groups * group,), generator=g)
    mask = torch.arange(length)[None] < lengths[:, None]
    adv = torch.randint(-1, 2, (n_groups * group,), generator=g).float() * torch.rand(n_groups * group, generator=g)
    weight = [2.0, 3.0][seed % 2]
    lam, n = conflict_weights_triton(ids.to(DEV), mask.to(DEV), adv.to(DEV), group, weight)
    lam_ref, n_ref = reference_conflict_weights(ids, mask, adv, group, weight)
    assert torch.equal(lam.cpu(), lam_ref.float()) and torch.equal(n.cpu(), n_ref)


def test_conflict_weights_long_completions_cross_blocks():
    # L > 1024 spans several position blocks; the run must continue across the block boundary.
    length = 1500
    ids = torch.randint(0, 50, (2, length))
    ids[1] = ids[0]
    ids[1, 1300] = (ids[0, 1300] + 1) % 50
    mask = torch.ones(2, length, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0])
    lam, n = conflict_weights_triton(ids.to(DEV), mask.to(DEV), adv.to(DEV), 2)
    lam_ref, n_ref = reference_conflict_weights(ids, mask, adv, 2)
    assert torch.equal(lam.cpu(), lam_ref.float()) and n.tolist() == n_ref.tolist() == [1300, 1300]


def make(dtype=torch.float32, seed=0, backend="triton"):
    """A batch on the device ``backend`` takes (CUDA for triton with GTPO_TEST_CUDA=1, else the CPU)."""
    dev = device_for(backend)
    logits, ids, mask, adv = random_batch(2, 3, 5, 29, dtype=dtype, seed=seed)
    return logits.to(dev), ids.to(dev), mask.to(dev), adv.to(dev)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", registered())
def test_inplace_backward_gives_the_same_gradient(dtype, backend):
    logits, ids, mask, adv = make(dtype, backend=backend)
    base = logits.clone().requires_grad_()
    out = gtpo_loss(base * 1, ids, mask, adv, group_size=3, backend=backend, config=GTPOConfig(entropy_mode="penalty"))
    out.loss.backward()

    base_inplace = logits.clone().requires_grad_()
    model_output = base_inplace * 1  # stands for the model's logits: a non-leaf tensor
    out_inplace = gtpo_loss(
        model_output,
        ids,
        mask,
        adv,
        group_size=3,
        backend=backend,
        config=GTPOConfig(entropy_mode="penalty", inplace_backward=True),
    )
    storage = model_output.data_ptr()
    out_inplace.loss.backward()
    assert torch.equal(out.loss, out_inplace.loss)
    assert torch.equal(base.grad, base_inplace.grad)
    # The gradient really was written over the logits (that is the memory saving).
    assert model_output.data_ptr() == storage
    assert torch.equal(model_output.detach(), base.grad)


@pytest.mark.parametrize("backend", registered())
def test_inplace_backward_refuses_to_corrupt_saved_logits(backend):
    logits, ids, mask, adv = make(backend=backend)
    base = logits.clone().requires_grad_()
    model_output = base * 1
    # A node created *before* the loss that saved the logits runs its backward *after* the loss's:
    # it would read gradients as logits. Autograd must refuse.
    other_use = (model_output**2).sum()
    config = GTPOConfig(inplace_backward=True, entropy_mode="penalty")  # a gradient whatever the filter keeps
    out = gtpo_loss(model_output, ids, mask, adv, group_size=3, backend=backend, config=config)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (out.loss + 0 * other_use).backward()


def test_inplace_backward_rejects_leaf_logits():
    logits, ids, mask, adv = make()
    leaf = logits.clone().requires_grad_()
    with pytest.raises(ValueError, match="inplace_backward=True would write the gradient over a leaf"):
        gtpo_loss(leaf, ids, mask, adv, group_size=3, config=GTPOConfig(inplace_backward=True), backend="triton")


@pytest.mark.parametrize("backend", registered())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_token_logprobs_and_entropy(backend, dtype):
    logits, ids, mask, _ = make(dtype, seed=3, backend=backend)
    logp, entropy = token_logprobs_and_entropy(logits, ids, mask, backend=backend)
    assert not logp.requires_grad and logp.dtype == torch.float32
    ref_logp, ref_entropy = reference_token_stats(logits.cpu().double(), torch.where(mask, ids, 0).cpu())
    valid = mask.cpu()
    assert_rel_close(logp.cpu()[valid], ref_logp[valid], RTOL[torch.float32], "logp")
    assert_rel_close(entropy.cpu()[valid], ref_entropy[valid], RTOL[torch.float32], "entropy")
    assert (logp.cpu()[~valid] == 0).all() and (entropy.cpu()[~valid] == 0).all()
    # Without a mask every position counts.
    full_logp, _ = token_logprobs_and_entropy(logits, ids, backend=backend)
    all_logp, _ = reference_token_stats(logits.cpu().double(), ids.cpu())
    assert_rel_close(full_logp.cpu(), all_logp, RTOL[torch.float32], "logp, no mask")


def test_token_logprobs_and_entropy_validates():
    logits, ids, mask, _ = make()
    bad = ids.clone()
    bad[0, 0] = 29
    with pytest.raises(ValueError, match=r"completion_ids must lie in \[0, V=29\)"):
        token_logprobs_and_entropy(logits, bad)
    with pytest.raises(ValueError, match="disagree on N or L"):
        token_logprobs_and_entropy(logits[:, :2], ids)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_logits_are_reported(value):
    logits, ids, mask, adv = make()
    logits[3, 0, 7] = value
    with pytest.raises(ValueError, match=r"unmasked position \[3, 0\]"):
        gtpo_loss(logits, ids, mask, adv, group_size=3, backend="triton")


def test_unchecked_bad_id_gives_nan_not_a_wrong_value():
    # With validation off, an out-of-range id must not read out of bounds or give a plausible number.
    logits, ids, mask, _ = make()
    bad = ids.clone()
    bad[0, 0] = 10_000
    logp, _ = token_logprobs_and_entropy(logits, bad, backend="triton", validate=False)
    assert torch.isnan(logp[0, 0]) and torch.isfinite(logp[0, 1:]).all()


def test_backend_selection(monkeypatch):
    assert resolve_backend("auto", torch.device("cpu")).name in ("cpu", "torch")  # "torch" if no C++ kernels
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):
        resolve_backend("triton", torch.device("cpu"))
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("cuda", torch.device("cpu"))


# Every fixed example exercises the method: the draws compared with the oracle and carrying a gradient are
# asserted to be most of them below; a draw skipped (an entropy on the filter's threshold) counts as skipped.
_PROPERTY_DRAWS = {"total": 0, "skipped": 0, "compared_with_gradient": 0}


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    n_groups=st.integers(1, 3),
    group_size=st.integers(2, 4),
    length=st.integers(1, 6),
    vocab=st.integers(2, 70),
    seed=st.integers(0, 10_000),
    preset=st.sampled_from(["paper", "official", "grpo"]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def _property_draw(n_groups, group_size, length, vocab, seed, preset, dtype):
    # min_len=0 gives empty rows; a target boost around 3 + ln V keeps about half the completions under
    # the entropy threshold (flat logits would have the filter drop every row: the case would say nothing).
    logits, ids, mask, adv = random_batch(
        n_groups, group_size, length, vocab, dtype=dtype, seed=seed, min_len=0, sharpness=3.0 + math.log(vocab)
    )
    # Groups whose rewards all tie have no policy gradient under grpo; give each such group one winner
    # (ties have their own tests in test_parity.py).
    tied = (adv.view(-1, group_size) == 0).all(dim=1)
    adv.view(-1, group_size)[tied] = torch.tensor([1.0] + [-1.0 / (group_size - 1)] * (group_size - 1))
    config = GTPOConfig(preset=preset)
    x = logits.clone().to(DEV).requires_grad_()
    out = gtpo_loss(x, ids.to(DEV), mask.to(DEV), adv.to(DEV), group_size=group_size, config=config, backend="triton")
    out.loss.backward()
    x64 = logits.double().requires_grad_()
    ref = reference_gtpo_loss(x64, ids, mask, adv.double(), group_size=group_size, config=config)
    ref.loss.backward()
    _PROPERTY_DRAWS["total"] += 1
    rtol = RTOL[dtype]
    # A completion entropy within rounding of the threshold may flip the filter; such a draw is not compared.
    tau = config.entropy_threshold
    if tau is not None and (ref.metrics.completion_entropy - tau).abs().min() < 1e-3:
        _PROPERTY_DRAWS["skipped"] += 1
        return
    _PROPERTY_DRAWS["compared_with_gradient"] += int(bool(x64.grad.abs().max() > 0))
    # The loss sums terms of both signs; it may cancel to 0 while each term is known to rtol of its size.
    terms = loss_scale(logits, ids, mask, adv, config=config, group_size=group_size)
    accumulated = RTOL_ACCUMULATED[dtype]  # the loss, from the same rounded logits, in float32
    assert_rel_close(out.loss.detach().cpu(), ref.loss.detach(), accumulated, "loss", atol=accumulated * terms)
    scale = logits_gradient_scale(logits, ids, mask, adv, config=config, group_size=group_size)
    assert_close_per_entry(x.grad.cpu(), x64.grad, rtol, "grad", scale=scale)


def test_property_random_shapes_and_masks():
    """Hypothesis's fixed draws of shapes, masks, presets and dtypes against the oracle; most of them compared and
    carrying a gradient (skipped draws count against it), counted in the same test so that no worker split hides it."""
    _PROPERTY_DRAWS.update(total=0, skipped=0, compared_with_gradient=0)
    _property_draw()
    assert _PROPERTY_DRAWS["total"] >= 20, _PROPERTY_DRAWS
    assert _PROPERTY_DRAWS["compared_with_gradient"] >= 0.8 * _PROPERTY_DRAWS["total"], _PROPERTY_DRAWS


@pytest.mark.skipif(not triton_interpreted(), reason="the kernels run compiled")
def test_interpreter_index_fix_is_installed():
    """triton 3.6's interpreter with numpy >= 2.4 fails every kernel that loops over a runtime bound unless
    its __index__ is patched (checked by hand against triton 3.6.0 + numpy 2.4.6: all kernel tests pass)."""
    import numpy as np
    from triton.runtime import interpreter

    if not hasattr(interpreter, "_patch_lang_tensor"):
        pytest.skip("this triton's interpreter has no _patch_lang_tensor")
    assert interpreter._patch_lang_tensor._gtpo_index_fix
    # What the fix relies on: .item() takes the one-element 1-D arrays that int() refuses on numpy >= 2.4.
    assert int(np.array([7]).item()) == 7
