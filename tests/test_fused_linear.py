"""`fused_linear_gtpo_loss` against the float64 reference applied to ``hidden @ W.T + b``."""

import pytest
import torch

from gtpo_kernels import FusedLinearGTPOLoss, GTPOConfig, fused_linear_gtpo_loss, gtpo_loss
from gtpo_kernels.fused_linear import chunk_rows_for
from gtpo_kernels.reference import reference_gtpo_loss, token_logprobs_and_entropy

from .helpers import RTOL, assert_rel_close, device_for

G = 2


def make(n_groups=3, length=5, hidden=16, vocab=37, seed=0, bias=True, min_len=1):
    g = torch.Generator().manual_seed(seed)
    n = n_groups * G
    h = torch.randn(n, length, hidden, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64) * 0.7
    b = torch.randn(vocab, generator=g, dtype=torch.float64) if bias else None
    ids = torch.randint(0, vocab, (n, length), generator=g)
    ids[1::G, :2] = ids[0::G, :2]  # shared prefixes: conflict tokens
    lengths = torch.randint(min_len, length + 1, (n,), generator=g)
    mask = torch.arange(length)[None] < lengths[:, None]
    rewards = torch.randint(0, 3, (n,), generator=g).double()
    adv = (rewards.view(-1, G) - rewards.view(-1, G).mean(1, keepdim=True)).view(-1)
    return h, w, b, ids, mask, adv


def reference(h, w, b, ids, mask, adv, config, logits_dtype=None, **kw):
    """float64 oracle: gradients w.r.t. hidden, weight and bias by plain autograd.

    With ``logits_dtype`` (bf16 runs) the logits' values are rounded to that dtype, as any bf16 model's
    logits are, while their gradient flows unrounded: the oracle of a bf16 forward, not of exact maths.
    """
    fresh = lambda t: t.detach().double().clone().requires_grad_()  # noqa: E731 (never the caller's tensor)
    h64, w64 = fresh(h), fresh(w)
    b64 = None if b is None else fresh(b)
    logits = h64 @ w64.T + (0 if b64 is None else b64)
    if logits_dtype is not None:
        logits = logits + (logits.to(logits_dtype).double() - logits).detach()
    out = reference_gtpo_loss(logits, ids, mask, adv.double(), group_size=G, config=config,
                              **{k: v.double() for k, v in kw.items()})
    out.loss.backward()
    return out, h64.grad, w64.grad, None if b64 is None else b64.grad


def fused(h, w, b, ids, mask, adv, config, backend, dtype, chunk_size=None, freeze_weight=False, **kw):
    dev = device_for(backend)
    hx = h.to(dtype).to(dev).requires_grad_()
    wx = w.to(dtype).to(dev).requires_grad_(not freeze_weight)
    bx = None if b is None else b.to(dtype).to(dev).requires_grad_()
    out = fused_linear_gtpo_loss(hx, wx, ids.to(dev), mask.to(dev), adv.to(dev), group_size=G, lm_head_bias=bx,
                                 config=config, chunk_size=chunk_size, backend=backend,
                                 **{k: v.to(dev) for k, v in kw.items()})
    out.loss.backward()
    return out, hx.grad, wx.grad, None if bx is None else bx.grad


def off_policy_kwargs(h, w, b, ids, mask, config):
    logits = h @ w.T + (0 if b is None else b)
    logp, _ = token_logprobs_and_entropy(logits, torch.where(mask, ids, 0))
    g = torch.Generator().manual_seed(9)
    kw = {"old_logprobs": (logp + 0.2 * torch.randn(logp.shape, generator=g, dtype=torch.float64)).float()}
    if config.kl_beta:
        kw["ref_logprobs"] = (logp + 0.4 * torch.randn(logp.shape, generator=g, dtype=torch.float64)).float()
    return kw


CONFIGS = {
    "paper": GTPOConfig(preset="paper"),
    "official": GTPOConfig(preset="official"),
    "grpo": GTPOConfig(preset="grpo", kl_beta=0.05),
    "penalty": GTPOConfig(preset="paper", entropy_mode="penalty", loss_reduction="token_mean"),
    "dr_grpo": GTPOConfig(preset="paper", loss_reduction="dr_grpo", clip_eps_low=0.2),
}


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("chunk_size", [1, 2, 3, None])  # 1 and 3 split groups of 2; 2 aligns; None: one chunk
def test_against_float64_reference(backend, dtype, name, chunk_size):
    config = CONFIGS[name]
    h, w, b, ids, mask, adv = make(seed=list(CONFIGS).index(name))
    # Sharpen the logits so that the entropy filter keeps some completions.
    w = w * 3
    kw = off_policy_kwargs(h, w, b, ids, mask, config)
    ref, dh_ref, dw_ref, db_ref = reference(h, w, b, ids, mask, adv, config, **kw)
    out, dh, dw, db = fused(h, w, b, ids, mask, adv, config, backend, dtype, chunk_size, **kw)
    # bf16 rounds hidden, weight and logits; the reference sees the same rounded values.
    if dtype == torch.bfloat16:
        ref, dh_ref, dw_ref, db_ref = reference(h.to(dtype), w.to(dtype), b.to(dtype), ids, mask, adv, config,
                                                logits_dtype=dtype, **kw)
    rtol = RTOL[dtype]
    assert dh.dtype == dw.dtype == db.dtype == dtype
    assert_rel_close(out.loss.detach().cpu(), ref.loss.detach(), rtol, "loss")
    assert_rel_close(dh.cpu(), dh_ref, rtol, "d_hidden")
    assert_rel_close(dw.cpu(), dw_ref, rtol, "d_weight")
    assert_rel_close(db.cpu(), db_ref, rtol, "d_bias")
    for metric in ("entropy", "completion_entropy", "ratio_mean"):
        assert_rel_close(getattr(out.metrics, metric).cpu(), getattr(ref.metrics, metric), rtol, metric)
    for metric in ("filtered_fraction", "amplified_fraction", "skipped_fraction", "clip_fraction"):
        assert float(getattr(out.metrics, metric)) == pytest.approx(float(getattr(ref.metrics, metric)), abs=1e-6)


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_agrees_with_gtpo_loss_on_materialised_logits(backend):
    h, w, b, ids, mask, adv = make(seed=5)
    config = GTPOConfig(preset="official")
    dev = device_for(backend)
    h, w, b, ids, mask, adv = (t.float().to(dev) if t.is_floating_point() else t.to(dev) for t in (h, w, b, ids, mask, adv))
    hx, wx = h.clone().requires_grad_(), w.clone().requires_grad_()
    out = fused_linear_gtpo_loss(hx, wx, ids, mask, adv, group_size=G, lm_head_bias=b, config=config,
                                 chunk_size=1, backend=backend)
    out.loss.backward()
    hy, wy = h.clone().requires_grad_(), w.clone().requires_grad_()
    plain = gtpo_loss(hy @ wy.T + b, ids, mask, adv, group_size=G, config=config, backend=backend)
    plain.loss.backward()
    torch.testing.assert_close(out.loss, plain.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hx.grad, hy.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(wx.grad, wy.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_frozen_weight_skips_weight_gradient(backend):
    h, w, b, ids, mask, adv = make(seed=6, bias=False)
    config = GTPOConfig()
    _, dh_ref, _, _ = reference(h, w, b, ids, mask, adv, config)
    out, dh, dw, _ = fused(h, w, b, ids, mask, adv, config, backend, torch.float32, chunk_size=2, freeze_weight=True)
    assert dw is None
    assert_rel_close(dh.cpu(), dh_ref, RTOL[torch.float32], "d_hidden")


def test_hidden_without_grad_gives_weight_gradient_only():
    h, w, b, ids, mask, adv = make(seed=7, bias=False)
    wx = w.float().requires_grad_()
    out = fused_linear_gtpo_loss(h.float(), wx, ids, mask, adv, group_size=G, backend="torch")
    out.loss.backward()
    _, _, dw_ref, _ = reference(h, w, b, ids, mask, adv, GTPOConfig())
    assert_rel_close(wx.grad, dw_ref, RTOL[torch.float32], "d_weight")


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_all_masked_gives_zero_loss_and_gradients(backend):
    h, w, b, ids, mask, adv = make(seed=8)
    out, dh, dw, db = fused(h, w, b, ids, torch.zeros_like(mask), adv, GTPOConfig(), backend, torch.float32)
    assert out.loss.item() == 0.0
    assert not dh.any() and not dw.any() and not db.any()


def test_gradient_scales_with_incoming_gradient():
    h, w, b, ids, mask, adv = make(seed=10)
    hx = h.float().requires_grad_()
    out = fused_linear_gtpo_loss(hx, w.float(), ids, mask, adv, group_size=G, backend="torch")
    (3.0 * out.loss).backward()
    _, dh_ref, _, _ = reference(h, w, None, ids, mask, adv, GTPOConfig())
    assert_rel_close(hx.grad, 3.0 * dh_ref, RTOL[torch.float32], "3 * d_hidden")


def test_autocast_runs_products_in_bf16():
    h, w, b, ids, mask, adv = make(seed=11)
    hx, wx = h.float().requires_grad_(), w.float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fused_linear_gtpo_loss(hx, wx, ids, mask, adv, group_size=G, backend="torch")
    out.loss.backward()
    assert hx.grad.dtype == wx.grad.dtype == torch.float32
    ref, dh_ref, _, _ = reference(h.bfloat16(), w.bfloat16(), None, ids, mask, adv, GTPOConfig(),
                                  logits_dtype=torch.bfloat16)
    assert_rel_close(out.loss.detach(), ref.loss.detach(), RTOL[torch.bfloat16], "loss")
    assert_rel_close(hx.grad, dh_ref, RTOL[torch.bfloat16], "d_hidden")


def test_module_wrapper():
    h, w, b, ids, mask, adv = make(seed=12)
    module = FusedLinearGTPOLoss(GTPOConfig(preset="official"), chunk_size=2, backend="torch")
    a = module(h.float(), w.float(), ids, mask, adv, group_size=G, lm_head_bias=b.float()).loss
    c = fused_linear_gtpo_loss(h.float(), w.float(), ids, mask, adv, group_size=G, lm_head_bias=b.float(),
                               config=GTPOConfig(preset="official"), chunk_size=2, backend="torch").loss
    assert torch.equal(a, c)
    assert "official" in repr(module)


def test_chunk_rows_from_the_memory_budget():
    # 4 bytes * L * V per completion: 256 MiB holds 16 completions of L = 1024, V = 4096.
    assert chunk_rows_for(1024, 4096, 256 * 2**20) == 16
    assert chunk_rows_for(4096, 151936, 256 * 2**20) == 1  # longer than the budget: one at a time


def test_errors_name_the_argument():
    h, w, b, ids, mask, adv = make(seed=13)
    h, w = h.float(), w.float()
    with pytest.raises(ValueError, match=r"lm_head_weight must be \[V, H\] with H = 16"):
        fused_linear_gtpo_loss(h, w[:, :8], ids, mask, adv, group_size=G)
    with pytest.raises(ValueError, match="must share a dtype"):
        fused_linear_gtpo_loss(h, w.bfloat16(), ids, mask, adv, group_size=G)
    with pytest.raises(ValueError, match=r"completion_ids must lie in \[0, V=37\)"):
        fused_linear_gtpo_loss(h, w, ids + 37, mask, adv, group_size=G)
    with pytest.raises(ValueError, match="hidden_states must be 3-D"):
        fused_linear_gtpo_loss(h[0], w, ids, mask, adv, group_size=G)
    with pytest.raises(ValueError, match=r"lm_head_bias must have shape \[V\]"):
        fused_linear_gtpo_loss(h, w, ids, mask, adv, group_size=G, lm_head_bias=torch.zeros(5))
    with pytest.raises(ValueError, match="group_size"):
        fused_linear_gtpo_loss(h, w, ids, mask, adv, group_size=4)
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        fused_linear_gtpo_loss(h, w, ids, mask, adv, group_size=G, chunk_size=0)
    with pytest.raises(ValueError, match="disagree on N or L"):
        fused_linear_gtpo_loss(h[:, :3], w, ids, mask, adv, group_size=G)


def test_non_contiguous_hidden_states():
    # The trainer passes hidden[:, P - 1:-1] of the model's output: a strided view.
    h, w, b, ids, mask, adv = make(seed=14)
    full = torch.randn(h.shape[0], h.shape[1] + 3, h.shape[2], dtype=torch.float32)
    full[:, 2:-1] = h.float()
    full.requires_grad_()
    view = full[:, 2:-1]
    assert not view.is_contiguous()
    out = fused_linear_gtpo_loss(view, w.float(), ids, mask, adv, group_size=G, backend="torch")
    out.loss.backward()
    _, dh_ref, _, _ = reference(h, w, None, ids, mask, adv, GTPOConfig())
    assert_rel_close(full.grad[:, 2:-1], dh_ref, RTOL[torch.float32], "d_hidden")
    assert (full.grad[:, :2] == 0).all() and (full.grad[:, -1] == 0).all()
