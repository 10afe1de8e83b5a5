"""`fused_linear_gtpo_loss` and `fused_linear_token_logprobs_and_entropy` against the float64 reference
applied to ``hidden @ W.T + b``."""

import dataclasses
import warnings

import pytest
import torch

from gtpo_kernels import (
    FusedLinearGTPOLoss,
    GTPOConfig,
    fused_linear_gtpo_loss,
    fused_linear_token_logprobs_and_entropy,
    gtpo_loss,
    token_logprobs_and_entropy,
)
from gtpo_kernels.backends import registered
from gtpo_kernels.fused_chunks import LogitTransform, _chunks, chunk_tokens_for
from gtpo_kernels.reference import reference_gtpo_loss
from gtpo_kernels.reference import token_logprobs_and_entropy as reference_token_stats

from .helpers import (
    RTOL,
    RTOL_ACCUMULATED,
    PeakTensorMemory,
    assert_close_per_entry,
    assert_rel_close,
    device_for,
    logits_gradient_scale,
    loss_scale,
    row_scale,
)

G = 2
BACKENDS = list(registered())
NO_TRANSFORM = LogitTransform()  # a head whose logits are hidden @ W.T + b
TEMPERATURE_SEED = 0


def budget(tokens, vocab=37):
    """A ``max_chunk_bytes`` of ``tokens`` tokens' float32 logits."""
    return 4 * vocab * tokens


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


def record_logits(monkeypatch, hidden: torch.Tensor) -> dict:
    """Records, by flat token index, the logits the fused path computes (a dict filled during the call; soft-capped
    where the head caps them, the scale being in the temperature): the oracle can then take the very values the
    path's GEMMs produced (their rounding depends on the chunk's shape) and compare only the loss's own
    arithmetic."""
    from gtpo_kernels import fused_chunks

    rows = hidden.detach().reshape(-1, hidden.shape[-1]).float()
    lookup = {row.cpu().numpy().tobytes(): i for i, row in enumerate(rows)}  # .cpu(): hidden may be on a GPU
    seen = {}
    real = fused_chunks.ChunkWalk.logits

    def spy(walk, h):
        out = real(walk, h)
        for k in range(h.shape[0]):
            seen.setdefault(lookup[h[k].float().cpu().numpy().tobytes()], out[k].detach().cpu().clone())
        return out

    # One chunk walk (fused_chunks) computes the logits of the loss and of the statistics alone.
    monkeypatch.setattr(fused_chunks.ChunkWalk, "logits", spy)
    return seen


def as_computed(seen: dict, h, w, b, dtype, softcap=None) -> torch.Tensor:
    """``[N, L, V]`` float64 logits: the recorded values where the fused path computed them, elsewhere (masked
    positions) the exact product (soft-capped) rounded to ``dtype``."""
    product = h.double() @ w.double().T + (0 if b is None else b.double())
    logits = LogitTransform(softcap=softcap)(product).to(dtype).double()
    flat = logits.view(-1, logits.shape[-1])
    for index, value in seen.items():
        flat[index] = value.double()
    return logits


def reference(
    h,
    w,
    b,
    ids,
    mask,
    adv,
    config,
    logits_dtype=None,
    temperature=1.0,
    logits_values=None,
    transform=NO_TRANSFORM,
    **kw,
):
    """float64 oracle: gradients w.r.t. hidden, weight and bias by plain autograd, through the head's ``transform``
    (the soft cap by autograd, then the scale).

    With ``logits_values`` (`as_computed`) or ``logits_dtype`` (the exact product rounded to it) the (soft-capped)
    logits take those values while their gradient flows unrounded: the oracle of that forward, so that what is
    compared is the loss's own arithmetic, not the rounding of its inputs (callers round hidden and weight the same
    way).
    """
    fresh = lambda t: t.detach().double().clone().requires_grad_()  # noqa: E731 (never the caller's tensor)
    h64, w64 = fresh(h), fresh(w)
    b64 = None if b is None else fresh(b)
    logits = LogitTransform(softcap=transform.softcap)(h64 @ w64.T + (0 if b64 is None else b64))
    if logits_values is not None:
        logits = logits + (logits_values - logits).detach()
    elif logits_dtype is not None:
        logits = logits + (logits.to(logits_dtype).double() - logits).detach()
    out = reference_gtpo_loss(
        logits * transform.scale,
        ids,
        mask,
        adv.double(),
        group_size=G,
        config=config,
        temperature=temperature,
        **{k: v.double() for k, v in kw.items()},
    )
    out.loss.backward()
    return out, h64.grad, w64.grad, None if b64 is None else b64.grad


def assert_loss_close(
    got, expected, h, w, b, ids, mask, adv, config, rtol, temperature=1.0, transform=NO_TRANSFORM, **kw
):
    """Relative to the loss or, when it is a difference of larger terms, to the terms' size."""
    logits = transform(h.double() @ w.double().T + (0 if b is None else b.double()))
    scale = loss_scale(logits, ids, mask, adv, config=config, temperature=temperature, group_size=G, **kw)
    assert_rel_close(got, expected, rtol, "loss", atol=rtol * scale)


def gradient_scales(h, w, b, ids, mask, adv, config, temperature=1.0, transform=NO_TRANSFORM, **kw):
    """Per entry of d_hidden, d_W, d_b: the size of the terms it sums (`logits_gradient_scale` of each logit,
    through the head's ``transform``'s scale (its soft cap's slope is at most 1), carried through the products with
    absolute values), the natural unit of its rounding error."""
    h, w = h.double(), w.double()
    logits = transform(h @ w.T + (0 if b is None else b.double()))
    scale = logits_gradient_scale(logits, ids, mask, adv, config=config, temperature=temperature, group_size=G, **kw)
    scale = scale * transform.scale
    return scale @ w.abs(), scale.flatten(0, 1).T @ h.abs().flatten(0, 1), scale.sum(dim=(0, 1))


def assert_linear_grads(got, expected, scales, rtol, resolution=None):
    """``resolution``: with fp16, ``(h, w)``: the logits' gradient is rounded to fp16 for the backward GEMMs, and
    below 6e-5 fp16 is subnormal, spaced 2^-24 apart; carried through the products that spacing is an absolute
    resolution of each entry (2^-24 times the sum of |w| over the vocabulary, of |h| over the tokens, the token
    count)."""
    atols = (0.0, 0.0, 0.0)
    if resolution is not None:
        h, w = (t.double().cpu() for t in resolution)
        step = 2.0**-24
        atols = (step * w.abs().sum(0), step * h.abs().flatten(0, 1).sum(0), step * h.shape[0] * h.shape[1])
    for g, e, s, atol, what in zip(got, expected, scales, atols, ("d_hidden", "d_weight", "d_bias")):
        if e is not None:
            assert_close_per_entry(g.cpu(), e, rtol, what, scale=s, atol=atol)


def fused(
    h,
    w,
    b,
    ids,
    mask,
    adv,
    config,
    backend,
    dtype,
    chunk_tokens=None,
    freeze_weight=False,
    temperature=1.0,
    transform=NO_TRANSFORM,
    **kw,
):
    dev = device_for(backend)
    hx = h.to(dtype).to(dev).requires_grad_()
    wx = w.to(dtype).to(dev).requires_grad_(not freeze_weight)
    bx = None if b is None else b.to(dtype).to(dev).requires_grad_()
    if chunk_tokens is not None:
        config = dataclasses.replace(config, max_chunk_bytes=budget(chunk_tokens, w.shape[0]))
    out = fused_linear_gtpo_loss(
        hx,
        wx,
        ids.to(dev),
        mask.to(dev),
        adv.to(dev),
        group_size=G,
        lm_head_bias=bx,
        config=config,
        backend=backend,
        temperature=temperature,
        logit_scale=transform.scale,
        logit_softcap=transform.softcap,
        **{k: v.to(dev) for k, v in kw.items()},
    )
    out.loss.backward()
    return out, hx.grad, wx.grad, None if bx is None else bx.grad


def off_policy_kwargs(h, w, b, ids, mask, config, temperature=1.0, transform=NO_TRANSFORM):
    logits = transform(h @ w.T + (0 if b is None else b))
    logp, _ = token_logprobs_and_entropy(logits / row_scale(temperature), torch.where(mask, ids, 0))
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
    # TRL's top-entropy tokens: the walk's statistics first, then every chunk's gradient from its logits again
    "top_entropy+bonus": GTPOConfig(preset="paper", top_entropy_quantile=0.6, entropy_bonus=0.05),
}


# Token budgets: 2 splits most completions (the two-pass path), 7 packs one or two whole completions
# (splitting groups), None is one chunk. fp16 runs one budget of each kind less (the two-pass path and one chunk).
CASES = [
    (dtype, name, chunk_tokens)
    for dtype in (torch.float32, torch.bfloat16, torch.float16)
    for name in CONFIGS
    for chunk_tokens in ([2, None] if dtype == torch.float16 else [2, 7, None])
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, name, chunk_tokens", CASES, ids=lambda v: str(v))
def test_against_float64_reference(backend, dtype, name, chunk_tokens, monkeypatch):
    config = CONFIGS[name]
    h, w, b, ids, mask, adv = make(seed=list(CONFIGS).index(name))
    # Sharpen the logits so that the entropy filter keeps some completions.
    w = w * 3
    kw = off_policy_kwargs(h, w, b, ids, mask, config)
    seen = record_logits(monkeypatch, h.to(dtype))
    out, dh, dw, db = fused(h, w, b, ids, mask, adv, config, backend, dtype, chunk_tokens, **kw)
    # The inputs are rounded to dtype and the logits are the values the path computed; the reference sees them.
    h, w, b = h.to(dtype), w.to(dtype), b.to(dtype)
    ref, dh_ref, dw_ref, db_ref = reference(
        h, w, b, ids, mask, adv, config, logits_values=as_computed(seen, h, w, b, dtype), **kw
    )
    rtol, rtol_accumulated = RTOL[dtype], RTOL_ACCUMULATED[dtype]
    assert dh.dtype == dw.dtype == db.dtype == dtype
    assert_loss_close(
        out.loss.detach().cpu(), ref.loss.detach(), h, w, b, ids, mask, adv, config, rtol_accumulated, **kw
    )
    # Per entry, relative to the size of the terms each entry sums.
    assert_linear_grads(
        (dh, dw, db),
        (dh_ref, dw_ref, db_ref),
        gradient_scales(h, w, b, ids, mask, adv, config, **kw),
        rtol,
        resolution=(h, w) if dtype == torch.float16 else None,
    )
    for metric in ("entropy", "completion_entropy", "ratio_mean"):
        assert_rel_close(getattr(out.metrics, metric).cpu(), getattr(ref.metrics, metric), rtol_accumulated, metric)
    for metric in (
        "filtered_fraction",
        "amplified_fraction",
        "skipped_fraction",
        "clip_fraction",
        "clip_low_fraction",
        "clip_high_fraction",
    ):
        assert float(getattr(out.metrics, metric)) == pytest.approx(float(getattr(ref.metrics, metric)), abs=1e-6)
    if config.clipping and kw.get("old_logprobs") is not None:  # per-row clip fractions (TRL's low_min/high_max)
        for metric in ("completion_clip_low", "completion_clip_high"):
            torch.testing.assert_close(
                getattr(out.metrics, metric).cpu().double(),
                getattr(ref.metrics, metric).double(),
                atol=1e-6,
                rtol=0,
                equal_nan=True,
            )


@pytest.mark.parametrize("backend", BACKENDS)
def test_agrees_with_gtpo_loss_on_materialised_logits(backend):
    h, w, b, ids, mask, adv = make(seed=5)
    w = 3 * w  # confident enough that the official filter keeps some completions (else both sides are 0)
    config = GTPOConfig(preset="official")
    dev = device_for(backend)
    h, w, b, ids, mask, adv = (
        t.float().to(dev) if t.is_floating_point() else t.to(dev) for t in (h, w, b, ids, mask, adv)
    )
    hx, wx = h.clone().requires_grad_(), w.clone().requires_grad_()
    out = fused_linear_gtpo_loss(
        hx,
        wx,
        ids,
        mask,
        adv,
        group_size=G,
        lm_head_bias=b,
        config=dataclasses.replace(config, max_chunk_bytes=budget(3)),
        backend=backend,
    )
    out.loss.backward()
    hy, wy = h.clone().requires_grad_(), w.clone().requires_grad_()
    plain = gtpo_loss(hy @ wy.T + b, ids, mask, adv, group_size=G, config=config, backend=backend)
    plain.loss.backward()
    assert float(plain.metrics.filtered_fraction) < 1 and float(plain.loss.detach()) != 0
    torch.testing.assert_close(out.loss, plain.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hx.grad, hy.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(wx.grad, wy.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_frozen_weight_skips_weight_gradient(backend):
    h, w, b, ids, mask, adv = make(seed=6, bias=False)
    config = GTPOConfig()
    _, dh_ref, _, _ = reference(h, w, b, ids, mask, adv, config)
    out, dh, dw, _ = fused(h, w, b, ids, mask, adv, config, backend, torch.float32, chunk_tokens=4, freeze_weight=True)
    assert dw is None
    assert_rel_close(dh.cpu(), dh_ref, RTOL[torch.float32], "d_hidden")


def test_hidden_without_grad_gives_weight_gradient_only():
    h, w, b, ids, mask, adv = make(seed=7, bias=False)
    wx = w.float().requires_grad_()
    out = fused_linear_gtpo_loss(h.float(), wx, ids, mask, adv, group_size=G, backend="torch")
    out.loss.backward()
    _, _, dw_ref, _ = reference(h, w, b, ids, mask, adv, GTPOConfig())
    assert_rel_close(wx.grad, dw_ref, RTOL[torch.float32], "d_weight")


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_masked_gives_zero_loss_and_gradients(backend):
    h, w, b, ids, mask, adv = make(seed=8)
    quiet = GTPOConfig(warn_no_signal=False)  # no signal is this test's point (its warning: test_first_hour.py)
    out, dh, dw, db = fused(h, w, b, ids, torch.zeros_like(mask), adv, quiet, backend, torch.float32)
    assert out.loss.item() == 0.0
    assert not dh.any() and not dw.any() and not db.any()


def test_gradient_scales_with_incoming_gradient():
    h, w, b, ids, mask, adv = make(seed=10)
    hx = h.float().requires_grad_()
    out = fused_linear_gtpo_loss(hx, w.float(), ids, mask, adv, group_size=G, backend="torch")
    (3.0 * out.loss).backward()
    _, dh_ref, _, _ = reference(h, w, None, ids, mask, adv, GTPOConfig())
    assert_rel_close(hx.grad, 3.0 * dh_ref, RTOL[torch.float32], "3 * d_hidden")


@pytest.mark.cpu_kernels
def test_tied_groups_under_the_entropy_shift_are_not_called_signal_free():
    """Every group tied (advantages all 0): the paper preset's shift still gives each kept completion -gamma Hbar, so
    the loss and gradient are not 0 and the call must not warn that they are (the fused path said so before its
    statistics, from the raw advantages alone)."""
    h, w, b, ids, mask, adv = make(seed=10, hidden=64)
    assert not adv.any()
    w = 3 * w
    hx = h.float().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = fused_linear_gtpo_loss(hx, w.float(), ids, mask, adv, group_size=G, backend="cpu")
    out.loss.backward()
    _, dh_ref, _, _ = reference(h, w, None, ids, mask, adv, GTPOConfig())
    assert dh_ref.abs().max() > 0 and float(out.loss.detach()) != 0
    assert_rel_close(hx.grad, dh_ref, RTOL[torch.float32], "d_hidden")


@pytest.mark.cpu_kernels
def test_no_grad_computes_no_gradient():
    """Under torch.no_grad (an evaluation, TRL's prediction_step) a head that requires grad costs no d_weight, no
    d_hidden: no storage the size of either is made (the walk's logits chunk is smaller here), the same loss."""
    h, w, b, ids, mask, adv = make(seed=11, hidden=64)
    hx, wx = h.float().requires_grad_(), w.float().requires_grad_()
    expected = fused_linear_gtpo_loss(hx, wx, ids, mask, adv, group_size=G, backend="cpu").loss.detach()
    with torch.no_grad(), PeakTensorMemory() as memory:
        out = fused_linear_gtpo_loss(hx, wx, ids, mask, adv, group_size=G, backend="cpu")
    assert out.loss.grad_fn is None and out.loss.item() == expected.item()
    assert memory.largest < min(wx.numel(), hx.numel()) * 4, memory.largest


@pytest.mark.cpu_kernels
def test_backward_hands_on_the_stored_gradients_without_a_copy():
    """The backward scales the gradients the forward stored in place: no new storage the size of d_weight or
    d_hidden at the backward's peak, the values still those of the incoming gradient (3 x), and a second backward
    of the same forward refused in one line."""
    h, w, b, ids, mask, adv = make(seed=10, hidden=64)
    w = 3 * w  # confident enough that the filter keeps some completions: gradients that are not all 0
    hx, wx = h.float().requires_grad_(), w.float().requires_grad_()
    out = fused_linear_gtpo_loss(hx, wx, ids, mask, adv, group_size=G, backend="cpu")
    scaled = 3.0 * out.loss
    with PeakTensorMemory() as memory:
        scaled.backward(retain_graph=True)
    assert memory.largest < min(wx.numel(), hx.numel()) * 4, memory.largest
    _, dh_ref, dw_ref, _ = reference(h, w, None, ids, mask, adv, GTPOConfig())
    assert dh_ref.abs().max() > 0 and dw_ref.abs().max() > 0
    assert_rel_close(hx.grad, 3.0 * dh_ref, RTOL[torch.float32], "3 * d_hidden")
    assert_rel_close(wx.grad, 3.0 * dw_ref, RTOL[torch.float32], "3 * d_weight")
    with pytest.raises(RuntimeError, match="backward ran twice on one forward"):
        scaled.backward()


def test_autocast_runs_products_in_bf16(monkeypatch):
    h, w, b, ids, mask, adv = make(seed=11)
    hx, wx = h.float().requires_grad_(), w.float().requires_grad_()
    seen = record_logits(monkeypatch, h.bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fused_linear_gtpo_loss(hx, wx, ids, mask, adv, group_size=G, backend="torch")
    out.loss.backward()
    assert hx.grad.dtype == wx.grad.dtype == torch.float32
    hb, wb = h.bfloat16(), w.bfloat16()
    ref, dh_ref, _, _ = reference(
        hb, wb, None, ids, mask, adv, GTPOConfig(), logits_values=as_computed(seen, hb, wb, None, torch.bfloat16)
    )
    # The loss from the very bf16 logits the GEMM made: float32 accumulation; d_hidden = dlogits (rounded to
    # bf16 for the backward GEMM) @ W: bf16's bar.
    assert_rel_close(out.loss.detach(), ref.loss.detach(), RTOL_ACCUMULATED[torch.bfloat16], "loss")
    assert_rel_close(hx.grad, dh_ref, RTOL[torch.bfloat16], "d_hidden")


def test_module_wrapper():
    h, w, b, ids, mask, adv = make(seed=12)
    config = GTPOConfig(preset="official", max_chunk_bytes=budget(4))
    module = FusedLinearGTPOLoss(config, backend="torch")
    a = module(h.float(), w.float(), ids, mask, adv, group_size=G, lm_head_bias=b.float()).loss
    c = fused_linear_gtpo_loss(
        h.float(), w.float(), ids, mask, adv, group_size=G, lm_head_bias=b.float(), config=config, backend="torch"
    ).loss
    assert torch.equal(a, c)
    assert "official" in repr(module)


def test_chunks_from_the_memory_budget():
    # 4 bytes * V per token: 256 MiB holds 16384 tokens at V = 4096, 441 at V = 151936.
    assert chunk_tokens_for(4096, torch.device("cpu"), 256 * 2**20) == 16384
    assert chunk_tokens_for(151936, torch.device("cpu"), 256 * 2**20) == 441
    assert chunk_tokens_for(151936, torch.device("cpu"), 1) == 1  # at least one token
    # Row lengths 3, 0, 5, 2, 9 (offsets below) with a budget of 5 tokens: whole rows packed while they
    # fit; the 9-token row alone (split into pieces later).
    assert _chunks([0, 3, 3, 8, 10, 19], 5) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert _chunks([0, 2, 4, 6], 5) == [(0, 2), (2, 3)]
    assert _chunks([0, 0, 0], 5) == [(0, 2)]


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
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        fused_linear_gtpo_loss(h, w, ids, mask, adv, group_size=G, temperature=0.0)
    with pytest.raises(TypeError, match="chunk_size"):
        fused_linear_gtpo_loss(h, w, ids, mask, adv, group_size=G, chunk_size=2)  # the budget is in the config
    with pytest.raises(ValueError, match="disagree on N or L"):
        fused_linear_gtpo_loss(h[:, :3], w, ids, mask, adv, group_size=G)


def test_non_contiguous_hidden_states():
    # The trainer passes hidden[:, P - 1:-1] of the model's output: a strided view.
    h, w, b, ids, mask, adv = make(seed=14)
    w = 3 * w  # confident enough that the filter keeps some completions: a gradient to compare
    full = torch.randn(h.shape[0], h.shape[1] + 3, h.shape[2], dtype=torch.float32)
    full[:, 2:-1] = h.float()
    full.requires_grad_()
    view = full[:, 2:-1]
    assert not view.is_contiguous()
    out = fused_linear_gtpo_loss(view, w.float(), ids, mask, adv, group_size=G, backend="torch")
    out.loss.backward()
    _, dh_ref, _, _ = reference(h, w, None, ids, mask, adv, GTPOConfig())
    assert dh_ref.abs().max() > 0
    assert_rel_close(full.grad[:, 2:-1], dh_ref, RTOL[torch.float32], "d_hidden")
    assert (full.grad[:, :2] == 0).all() and (full.grad[:, -1] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_temperature(backend):
    h, w, b, ids, mask, adv = make(seed=15)
    config = GTPOConfig(preset="paper", entropy_mode="penalty")
    ref, dh_ref, dw_ref, db_ref = reference(
        h.float(), w.float() * 3, b.float(), ids, mask, adv, config, logits_dtype=torch.float32, temperature=0.7
    )
    out, dh, dw, db = fused(
        h, w * 3, b, ids, mask, adv, config, backend, torch.float32, chunk_tokens=5, temperature=0.7
    )
    assert_rel_close(out.loss.detach().cpu(), ref.loss.detach(), RTOL[torch.float32], "loss")
    assert_linear_grads(
        (dh, dw, db),
        (dh_ref, dw_ref, db_ref),
        gradient_scales(h, w * 3, b, ids, mask, adv, config, temperature=0.7),
        RTOL[torch.float32],
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("chunk_tokens", [2, 7], ids=["pieces", "chunks"])
def test_per_completion_temperature(backend, dtype, chunk_tokens, monkeypatch):
    """``temperature [N]`` through the fused walk (each chunk's tokens read their completion's scale inside the
    kernels; completions split into pieces, or groups cut across chunks): the float64 oracle on ``logits / T_i``."""
    h, w, b, ids, mask, adv = make(seed=15)
    w = w * 3
    order = torch.randperm(ids.shape[0], generator=torch.Generator().manual_seed(TEMPERATURE_SEED))
    temperature = torch.linspace(0.5, 1.5, ids.shape[0], dtype=torch.float64)[order]
    config = GTPOConfig(preset="paper", entropy_mode="penalty")
    kw = off_policy_kwargs(h, w, b, ids, mask, config, temperature)  # near the policy at its temperatures
    seen = record_logits(monkeypatch, h.to(dtype))
    out, dh, dw, db = fused(
        h, w, b, ids, mask, adv, config, backend, dtype, chunk_tokens, temperature=temperature, **kw
    )
    h, w, b = h.to(dtype), w.to(dtype), b.to(dtype)
    ref, dh_ref, dw_ref, db_ref = reference(
        h, w, b, ids, mask, adv, config, logits_values=as_computed(seen, h, w, b, dtype), temperature=temperature, **kw
    )
    assert_loss_close(
        out.loss.detach().cpu(),
        ref.loss.detach(),
        h,
        w,
        b,
        ids,
        mask,
        adv,
        config,
        RTOL_ACCUMULATED[dtype],
        temperature=temperature,
        **kw,
    )
    assert_linear_grads(
        (dh, dw, db),
        (dh_ref, dw_ref, db_ref),
        gradient_scales(h, w, b, ids, mask, adv, config, temperature=temperature, **kw),
        RTOL[dtype],
        resolution=(h, w) if dtype == torch.float16 else None,
    )
    assert_rel_close(
        out.metrics.completion_entropy.cpu(), ref.metrics.completion_entropy, RTOL_ACCUMULATED[dtype], "Hbar"
    )


TRANSFORMS = {
    "softcap": LogitTransform(softcap=4.0),  # Gemma 2/3's final_logit_softcapping (the logits here spread ~8)
    "scale": LogitTransform(scale=0.25),  # Granite's 1 / logits_scaling
    "softcap+scale": LogitTransform(scale=1.5, softcap=4.0),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", TRANSFORMS)
@pytest.mark.parametrize("chunk_tokens", [2, 7], ids=["pieces", "chunks"])
def test_transformed_head(backend, dtype, name, chunk_tokens, monkeypatch):
    """A head that soft-caps or scales its logits (``logit_softcap``, ``logit_scale``), at per-completion
    temperatures: the walk caps each chunk's logits in place and multiplies their gradient by the cap's slope, and
    takes the scale into the temperature; the float64 oracle differentiates the transform by autograd. The loss,
    its gradients and the statistics alone, with completions split into pieces or groups cut across chunks."""
    h, w, b, ids, mask, adv = make(seed=17)
    w = w * 3
    transform = TRANSFORMS[name]
    order = torch.randperm(ids.shape[0], generator=torch.Generator().manual_seed(TEMPERATURE_SEED))
    temperature = torch.linspace(0.6, 1.4, ids.shape[0], dtype=torch.float64)[order]
    config = GTPOConfig(preset="paper", entropy_mode="penalty")
    kw = off_policy_kwargs(h, w, b, ids, mask, config, temperature, transform)
    seen = record_logits(monkeypatch, h.to(dtype))
    out, dh, dw, db = fused(
        h,
        w,
        b,
        ids,
        mask,
        adv,
        config,
        backend,
        dtype,
        chunk_tokens,
        temperature=temperature,
        transform=transform,
        **kw,
    )
    h, w, b = h.to(dtype), w.to(dtype), b.to(dtype)
    computed = as_computed(seen, h, w, b, dtype, transform.softcap)
    ref, dh_ref, dw_ref, db_ref = reference(
        h, w, b, ids, mask, adv, config, logits_values=computed, temperature=temperature, transform=transform, **kw
    )
    common = dict(temperature=temperature, transform=transform, **kw)
    assert_loss_close(
        out.loss.detach().cpu(), ref.loss.detach(), h, w, b, ids, mask, adv, config, RTOL_ACCUMULATED[dtype], **common
    )
    assert_linear_grads(
        (dh, dw, db),
        (dh_ref, dw_ref, db_ref),
        gradient_scales(h, w, b, ids, mask, adv, config, **common),
        RTOL[dtype],
        resolution=(h, w) if dtype == torch.float16 else None,
    )

    dev = device_for(backend)
    seen = record_logits(monkeypatch, h)
    logp, entropy = fused_linear_token_logprobs_and_entropy(
        *(t.to(dev) for t in (h, w, ids, mask)),
        lm_head_bias=b.to(dev),
        logit_scale=transform.scale,
        logit_softcap=transform.softcap,
        temperature=temperature.to(dev),
        backend=backend,
        max_chunk_bytes=budget(chunk_tokens),
    )
    logits = as_computed(seen, h, w, b, dtype, transform.softcap) * transform.scale / temperature[:, None, None]
    expected_logp, expected_entropy = reference_token_stats(logits, torch.where(mask, ids, 0))
    assert_rel_close(logp.cpu()[mask], expected_logp[mask], RTOL_ACCUMULATED[dtype], "logp")
    assert_rel_close(entropy.cpu()[mask], expected_entropy[mask], RTOL_ACCUMULATED[dtype], "entropy")


def test_logit_transform_errors_name_the_argument():
    h, w, b, ids, mask, adv = make()
    for kwargs, needle in (
        ({"logit_scale": 0.0}, "logit_scale must be a positive finite float"),
        ({"logit_scale": float("nan")}, "logit_scale must be a positive finite float"),
        ({"logit_softcap": -30.0}, "logit_softcap must be a positive finite float or None"),
        ({"logit_softcap": torch.tensor(30.0)}, "logit_softcap must be a positive finite float or None"),
    ):
        with pytest.raises(ValueError, match=needle):
            fused_linear_gtpo_loss(h.float(), w.float(), ids, mask, adv, group_size=G, **kwargs)
        with pytest.raises(ValueError, match=needle):
            fused_linear_token_logprobs_and_entropy(h.float(), w.float(), ids, mask, **kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_equal_per_completion_temperatures_are_the_float(backend):
    """A tensor of one temperature gives bitwise the float's loss and gradients: the per-row scale is read where the
    float was used, nothing else changes."""
    h, w, b, ids, mask, adv = make(seed=16)
    config = GTPOConfig(preset="grpo", kl_beta=0.05)
    kw = off_policy_kwargs(h, w * 3, b, ids, mask, config, 0.6)
    one = fused(h, w * 3, b, ids, mask, adv, config, backend, torch.float32, 7, temperature=0.6, **kw)
    rows = torch.full((ids.shape[0],), 0.6, dtype=torch.float64)
    each = fused(h, w * 3, b, ids, mask, adv, config, backend, torch.float32, 7, temperature=rows, **kw)
    assert torch.equal(one[0].loss, each[0].loss)
    for a, b_ in zip(one[1:], each[1:]):
        assert torch.equal(a, b_)


@pytest.mark.cpu_kernels
def test_one_long_completion_through_a_small_budget(monkeypatch):
    """A completion of 8192 tokens with a 4 MiB budget (512 tokens of V = 2048): split into 16 pieces,
    statistics first, then the gradient piece by piece; equal to the unchunked float64 reference, and the
    tensors alive at once stay within a few budgets (the full float32 logits would be 64 MiB)."""
    from gtpo_kernels import fused_chunks

    g = torch.Generator().manual_seed(21)
    length, hidden, vocab = 8192, 16, 2048
    h = torch.randn(2, length, hidden, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64)
    ids = torch.randint(0, vocab, (2, length), generator=g)
    mask = torch.zeros(2, length, dtype=torch.bool)
    mask[0] = True  # the long one
    mask[1, :100] = True  # and a short one beside it
    adv = torch.tensor([0.5, -0.5])
    config = GTPOConfig(preset="official", max_chunk_bytes=4 * 2**20)
    gemms = []
    real_logits = fused_chunks.chunk_logits
    monkeypatch.setattr(fused_chunks, "chunk_logits", lambda *a: gemms.append(a[0].shape[0]) or real_logits(*a))

    hx, wx = h.float().requires_grad_(), w.float().requires_grad_()
    with PeakTensorMemory() as memory:
        out = fused_linear_gtpo_loss(
            hx, wx, ids, mask, adv, group_size=G, config=config, backend="cpu" if "cpu" in BACKENDS else "torch"
        )
        out.loss.backward()
    budget_bytes = 4 * 2**20
    full_logits = 2 * length * vocab * 4
    inputs_sized = (hx.numel() + wx.numel()) * 4 * 3  # the gradients and the float32 accumulator of d_W
    assert memory.peak <= 3 * budget_bytes + inputs_sized, (memory.peak, budget_bytes)
    assert memory.peak < full_logits / 4
    # 16 pieces of the long completion twice (statistics, then gradient), the short one once.
    assert sorted(gemms).count(512) == 32 and 100 in gemms

    ref, dh_ref, dw_ref, _ = reference(h.float(), w.float(), None, ids, mask, adv, config, logits_dtype=torch.float32)
    assert_rel_close(out.loss.detach(), ref.loss.detach(), RTOL[torch.float32], "loss")
    assert_linear_grads(
        (hx.grad, wx.grad), (dh_ref, dw_ref), gradient_scales(h, w, None, ids, mask, adv, config), RTOL[torch.float32]
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_hidden_state_statistics(backend, dtype, monkeypatch):
    """`fused_linear_token_logprobs_and_entropy` equals `token_logprobs_and_entropy(hidden @ W.T + b, T)` and never
    creates a tensor as large as the logits."""
    h, w, b, ids, mask, _ = make(n_groups=4, length=9, vocab=300, seed=16)
    dev = device_for(backend)
    h, w, b = (t.to(dtype).to(dev) for t in (h, w * 2, b))
    ids, mask = ids.to(dev), mask.to(dev)
    seen = record_logits(monkeypatch, h)
    with PeakTensorMemory() as memory:
        logp, entropy = fused_linear_token_logprobs_and_entropy(
            h, w, ids, mask, lm_head_bias=b, temperature=0.7, backend=backend, max_chunk_bytes=4 * 300 * 5
        )
    logits = (h.double() @ w.double().T + b.double()).to(dtype)  # the logits a bf16 model would produce
    computed = as_computed(seen, h.cpu(), w.cpu(), b.cpu(), dtype)  # the very ones the chunks' GEMMs made
    expected_logp, expected_entropy = reference_token_stats(computed / 0.7, torch.where(mask, ids, 0).cpu())
    assert logp.dtype == torch.float32 and not logp.requires_grad
    valid = mask.cpu()
    assert_rel_close(logp.cpu()[valid], expected_logp[valid], RTOL_ACCUMULATED[dtype], "logp")
    assert_rel_close(entropy.cpu()[valid], expected_entropy[valid], RTOL_ACCUMULATED[dtype], "entropy")
    assert (logp.cpu()[~valid] == 0).all() and (entropy.cpu()[~valid] == 0).all()
    assert memory.largest < logits.numel() * 4 / 4  # chunks of 5 tokens, not [N, L, V]
    same_logp, _ = token_logprobs_and_entropy(logits, ids, mask, temperature=0.7, backend=backend)
    if dtype == torch.float32:
        assert_rel_close(logp.cpu(), same_logp.cpu(), 1e-5, "against token_logprobs_and_entropy")


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize(
    "config",
    [
        GTPOConfig(preset="grpo", ratio_cap=1.1, kl_beta=0.05),
        GTPOConfig(preset="paper", kl_beta=0.05, kl_ratio_weighted=True),
        GTPOConfig(preset="grpo", ratio_cap=1.1, kl_beta=0.05, kl_ratio_weighted=True),
    ],
    ids=["cap", "weighted_kl", "both"],
)
def test_ratio_cap_and_weighted_kl_equal_the_logits_loss_in_float64(backend, config):
    """TRL's delta and use_bias_correction_kl (GTPOConfig.ratio_cap, kl_ratio_weighted) through the fused path's
    closed-form coefficients: the same loss and gradients as `gtpo_loss` on the logits, to float64 rounding.
    (Their float32/bfloat16 precision is the KL's and the ratio's, tested with the other configs.)"""
    h, w, b, ids, mask, adv = make(seed=11)
    h, w, b, adv = h.double(), w.double(), b.double(), adv.double()
    kw = {k: v.double() for k, v in off_policy_kwargs(h, w, b, ids, mask, config).items()}
    ratio = torch.exp(token_logprobs_and_entropy(h @ w.T + b, torch.where(mask, ids, 0))[0] - kw["old_logprobs"])
    assert bool((ratio > 1.1).any()) and bool((ratio < 1.1).any())  # the cap binds on some tokens
    out, dh, dw, db = fused(h, w, b, ids, mask, adv, config, backend, torch.float64, **kw)
    logits = (h @ w.T + b).detach().requires_grad_()
    ref = gtpo_loss(logits, ids, mask, adv, group_size=G, config=config, backend="torch", **kw)
    ref.loss.backward()
    torch.testing.assert_close(out.loss.detach().cpu(), ref.loss.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(dh.cpu(), logits.grad @ w, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(dw.cpu(), logits.grad.flatten(0, 1).T @ h.flatten(0, 1), rtol=1e-10, atol=1e-13)
    assert float(out.metrics.kl) == pytest.approx(float(ref.metrics.kl), rel=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_the_entropy_shift_scoped_to_nonzero_advantages(backend, dtype, monkeypatch):
    """entropy_shift_scope="nonzero_advantage" through the fused path, chunks splitting completions, against the
    float64 reference: a tied group (its advantages 0) gives no gradient through its hidden states; the others do."""
    config = GTPOConfig(preset="paper", entropy_shift_scope="nonzero_advantage")
    h, w, b, ids, mask, adv = make(seed=8)  # a draw where the paper's shift reaches the tied group's gradient
    w = w * 3  # sharp enough that the filter keeps some completions
    adv[:G] = 0
    kw = off_policy_kwargs(h, w, b, ids, mask, config)
    seen = record_logits(monkeypatch, h.to(dtype))
    out, dh, dw, db = fused(h, w, b, ids, mask, adv, config, backend, dtype, 2, **kw)
    h, w, b = h.to(dtype), w.to(dtype), b.to(dtype)
    ref, dh_ref, dw_ref, db_ref = reference(
        h, w, b, ids, mask, adv, config, logits_values=as_computed(seen, h, w, b, dtype), **kw
    )
    assert_loss_close(
        out.loss.detach().cpu(), ref.loss.detach(), h, w, b, ids, mask, adv, config, RTOL_ACCUMULATED[dtype], **kw
    )
    scales = gradient_scales(h, w, b, ids, mask, adv, config, **kw)
    resolution = (h, w) if dtype == torch.float16 else None
    assert_linear_grads((dh, dw, db), (dh_ref, dw_ref, db_ref), scales, RTOL[dtype], resolution=resolution)
    assert (dh[:G] == 0).all() and (dh[G:] != 0).any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("mode", ["clip_cov", "kl_cov"])
def test_clip_cov_and_kl_cov_pick_from_the_whole_call(backend, dtype, mode, monkeypatch):
    """cov_mode through the fused path, off-policy, chunks of 2 tokens splitting completions: the pick is the whole
    call's (its means and its k over every chunk), against the float64 oracle's own pick from the same draw of
    torch's CPU generator: loss, gradients and the share picked."""
    config = GTPOConfig(preset="grpo", cov_mode=mode, cov_ratio=0.15, clip_cov_low=0.01, kl_cov_coef=0.5)
    h, w, b, ids, mask, adv = make(seed=8, length=7)
    kw = off_policy_kwargs(h, w, b, ids, mask, config)
    seen = record_logits(monkeypatch, h.to(dtype))
    torch.manual_seed(5)
    out, dh, dw, db = fused(h, w, b, ids, mask, adv, config, backend, dtype, 2, **kw)
    h, w, b = h.to(dtype), w.to(dtype), b.to(dtype)
    torch.manual_seed(5)
    ref, dh_ref, dw_ref, db_ref = reference(
        h, w, b, ids, mask, adv, config, logits_values=as_computed(seen, h, w, b, dtype), **kw
    )
    tokens = int(mask.sum())
    assert float(out.metrics.cov_fraction) == pytest.approx(float(ref.metrics.cov_fraction), abs=1e-6)
    assert float(out.metrics.cov_fraction) * tokens >= 2  # more than one chunk's worth of tokens could hold
    assert_loss_close(
        out.loss.detach().cpu(), ref.loss.detach(), h, w, b, ids, mask, adv, config, RTOL_ACCUMULATED[dtype], **kw
    )
    scales = gradient_scales(h, w, b, ids, mask, adv, config, **kw)
    resolution = (h, w) if dtype == torch.float16 else None
    assert_linear_grads((dh, dw, db), (dh_ref, dw_ref, db_ref), scales, RTOL[dtype], resolution=resolution)


def test_the_config_fields_left_out_of_the_operator_are_not_read_inside_it():
    """The fused operator's schema leaves out the config fields that act before it (a schema takes at most 64
    arguments), and its config takes their defaults: so neither the walk nor the objective may read them."""
    from pathlib import Path

    from gtpo_kernels.fused_linear import CONFIG_NOT_IN_OPERATOR

    package = Path(fused_linear_gtpo_loss.__code__.co_filename).parent
    for module in ("fused_chunks.py", "objective.py", "conflict.py", "result.py"):
        text = (package / module).read_text()
        for name in CONFIG_NOT_IN_OPERATOR:
            assert f"config.{name}" not in text, (module, name)
