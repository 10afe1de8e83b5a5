"""`torch.autograd.gradcheck` of the loss w.r.t. the logits, in float64, through the public API.

On-policy the loss value does not depend on the logits (rho = 1 in value), so finite differences
would see nothing: the checks pass ``old_logprobs`` equal to the current log-probs (same gradient at
that point as on-policy) or shifted away from them (clipping active).

In the advantage-shift mode the completion entropy ``Hbar`` enters the loss *detached* (docs/method.md), so
finite differences see a dependence the gradient deliberately omits. Those checks set
``entropy_coef=0`` (the filter, a step function, stays on); `test_detached_entropy_shift` then
compares the gradient with the shift against plain autograd on the unfused reference.
"""

import pytest
import torch

from gtpo_kernels import GTPOConfig, gtpo_loss
from gtpo_kernels.reference import reference_gtpo_loss, token_logprobs_and_entropy

from .helpers import random_batch

G = 3


def inputs(seed=0, n_groups=2, length=4, vocab=7):
    logits, ids, mask, adv = random_batch(n_groups, G, length, vocab, dtype=torch.float64, seed=seed)
    logp, _ = token_logprobs_and_entropy(logits, torch.where(mask, ids, 0))
    return logits.requires_grad_(), ids, mask, adv, logp.detach()


def check(config, logits, ids, mask, adv, **kwargs):
    def f(z):
        return gtpo_loss(z, ids, mask, adv, group_size=G, config=config, backend="torch", **kwargs).loss

    # The check is meaningful only if some completion passes the filter and moves the loss.
    (grad,) = torch.autograd.grad(f(logits), logits)
    assert grad.abs().max() > 1e-6, "degenerate case: zero gradient"
    assert torch.autograd.gradcheck(f, (logits,), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("preset", ["paper", "official", "grpo"])
def test_presets(preset):
    logits, ids, mask, adv, logp = inputs()
    check(
        GTPOConfig(preset=preset, max_chunk_bytes=4 * 7 * 5, entropy_coef=0.0),
        logits,
        ids,
        mask,
        adv,
        old_logprobs=logp,
    )


@pytest.mark.parametrize("preset", ["paper", "official"])
def test_detached_entropy_shift(preset):
    logits, ids, mask, adv, _ = inputs(seed=6)
    config = GTPOConfig(preset=preset, max_chunk_bytes=4 * 7 * 3)
    out = gtpo_loss(logits, ids, mask, adv, group_size=G, config=config, backend="torch")
    expected = reference_gtpo_loss(logits, ids, mask, adv, group_size=G, config=config)
    assert float(out.metrics.filtered_fraction) < 1
    (grad,) = torch.autograd.grad(out.loss, logits)
    (grad_ref,) = torch.autograd.grad(expected.loss, logits)
    assert grad.abs().max() > 1e-6
    torch.testing.assert_close(grad, grad_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-12, atol=0)


@pytest.mark.parametrize("preset", ["paper", "official", "grpo"])
def test_with_old_and_reference_logprobs(preset):
    logits, ids, mask, adv, logp = inputs(seed=1)
    g = torch.Generator().manual_seed(1)
    old = logp + 0.05 * torch.randn(logp.shape, generator=g, dtype=torch.float64)
    ref = logp + 0.3 * torch.randn(logp.shape, generator=g, dtype=torch.float64)
    check(
        GTPOConfig(preset=preset, kl_beta=0.05, entropy_coef=0.0),
        logits,
        ids,
        mask,
        adv,
        old_logprobs=old,
        ref_logprobs=ref,
    )


def test_with_clipping_active():
    logits, ids, mask, adv, logp = inputs(seed=2)
    # Ratios of about e^{+-0.5}: well outside [0.8, 1.2] for most tokens, never at a clip boundary.
    sign = torch.where(torch.rand(logp.shape, generator=torch.Generator().manual_seed(2)) > 0.5, 1.0, -1.0)
    old = logp + 0.5 * sign.double()
    config = GTPOConfig(preset="paper", clip_eps_low=0.2, clip_eps_high=0.28, entropy_coef=0.0)
    out = gtpo_loss(logits, ids, mask, adv, group_size=G, config=config, old_logprobs=old)
    assert 0 < float(out.metrics.clip_fraction) < 1
    check(config, logits, ids, mask, adv, old_logprobs=old)


@pytest.mark.parametrize("preset", ["paper", "official"])
def test_entropy_penalty_variant(preset):
    logits, ids, mask, adv, logp = inputs(seed=3)
    check(
        GTPOConfig(preset=preset, entropy_mode="penalty", max_chunk_bytes=4 * 7 * 2),
        logits,
        ids,
        mask,
        adv,
        old_logprobs=logp,
    )


@pytest.mark.parametrize("reduction", ["token_mean", "dr_grpo"])
def test_token_reductions(reduction):
    logits, ids, mask, adv, logp = inputs(seed=4)
    check(
        GTPOConfig(preset="paper", loss_reduction=reduction, entropy_coef=0.0),
        logits,
        ids,
        mask,
        adv,
        old_logprobs=logp,
    )


def test_banned_tokens():
    """-inf logits (banned tokens) away from the targets: finite loss, gradient checks out, zero there."""
    logits, ids, mask, adv, _ = inputs(seed=5)
    banned = torch.zeros_like(logits, dtype=torch.bool)
    banned[..., 0] = True
    banned &= ~torch.nn.functional.one_hot(torch.where(mask, ids, 0), logits.shape[-1]).bool()
    logits = logits.detach().masked_fill(banned, float("-inf")).requires_grad_()
    logp, _ = token_logprobs_and_entropy(logits, torch.where(mask, ids, 0))
    check(GTPOConfig(preset="paper", entropy_mode="penalty"), logits, ids, mask, adv, old_logprobs=logp.detach())
    out = gtpo_loss(logits, ids, mask, adv, group_size=G, config=GTPOConfig(entropy_mode="penalty"))
    (grad,) = torch.autograd.grad(out.loss, logits)
    assert torch.isfinite(grad).all() and (grad[banned] == 0).all()
