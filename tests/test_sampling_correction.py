"""The sampler's correction (``GTPOConfig.sampling_correction``, TRL's vLLM importance sampling): hand-computed
weights in each mode, both entry points on every backend against the float64 oracle on-policy (the weights then
come from the current log-probs), slices of a batch adding up, and the errors for inputs that do not fit."""

import math

import pytest
import torch

from gtpo_kernels import GTPOConfig, fused_linear_gtpo_loss, gtpo_loss
from gtpo_kernels.backends import registered
from gtpo_kernels.reference import reference_gtpo_loss, token_logprobs_and_entropy

from .helpers import assert_rel_close, device_for

BACKENDS = list(registered())
# No clipping, no filter, no conflict weights, token mean: on-policy the loss is -A * mean(w) by hand.
PLAIN = dict(preset="grpo", clip_eps_low=None, clip_eps_high=None, loss_reduction="token_mean", warn_no_signal=False)
V = 4  # uniform logits: every log-prob is -log 4


def hand_loss(backend, entry, sampled, **knobs):
    """The loss of one completion of 2 tokens with advantage 1 and uniform logits, on-policy."""
    dev = device_for(backend)
    config = GTPOConfig(**PLAIN, **knobs)
    ids = torch.tensor([[1, 2]], device=dev)
    mask = torch.ones(1, 2, dtype=torch.bool, device=dev)
    adv = torch.ones(1, device=dev)
    common = dict(config=config, backend=backend, sampling_logprobs=torch.tensor([sampled], device=dev))
    if entry == "logits":
        out = gtpo_loss(torch.zeros(1, 2, V, device=dev), ids, mask, adv, **common)
    else:  # a zero head: logits 0, uniform
        hidden = torch.randn(1, 2, 8, device=dev)
        out = fused_linear_gtpo_loss(hidden, torch.zeros(V, 8, device=dev), ids, mask, adv, **common)
    return float(out.loss)


LOG4 = math.log(4.0)
# Sampler log-probs: token 0 at half the trainer's probability (w = 2), token 1 at 4x (w = 1/4).
HALF_QUARTER = [-LOG4 - math.log(2.0), -LOG4 + math.log(4.0)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("entry", ["logits", "fused"])
@pytest.mark.parametrize(
    "knobs, sampled, expected",
    [
        # w = [2, 1/4]; truncated at 1.5 above: [1.5, 0.25]
        (dict(sampling_correction="token_truncate", sampling_ratio_max=1.5), HALF_QUARTER, -(1.5 + 0.25) / 2),
        # zeroed below 0.3: [2, 0]
        (dict(sampling_correction="token_mask", sampling_ratio_min=0.3), HALF_QUARTER, -(2 + 0) / 2),
        # per completion: exp(log 2 - log 4) = 1/2 on both tokens
        (dict(sampling_correction="sequence_truncate"), HALF_QUARTER, -0.5),
        # 1/2 is below 0.6: the whole completion is zeroed
        (dict(sampling_correction="sequence_mask", sampling_ratio_min=0.6), HALF_QUARTER, 0.0),
        # a NaN sampler log-prob counts as the trainer's: w = [2, 1], truncated at 3 (TRL's default)
        (dict(sampling_correction="token_truncate"), [HALF_QUARTER[0], float("nan")], -(2 + 1) / 2),
        (dict(sampling_correction="sequence_truncate", sampling_ratio_max=None), [HALF_QUARTER[0], float("nan")], -2),
    ],
)
def test_hand_computed_weights(backend, entry, knobs, sampled, expected):
    assert hand_loss(backend, entry, sampled, **knobs) == pytest.approx(expected, abs=1e-6)


def batch(seed=0, n=6, length=5, hidden=7, vocab=29):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, length, hidden, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64)
    ids = torch.randint(0, vocab, (n, length), generator=g)
    lengths = torch.tensor([5, 1, 0, 3, 4, 2])[:n]  # one token, a fully masked row
    mask = torch.arange(length)[None] < lengths[:, None]
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    logp, _ = token_logprobs_and_entropy(h @ w.T, ids)
    sampled = logp + 0.4 * torch.randn(logp.shape, generator=g, dtype=torch.float64)
    sampled[0, 1] = float("nan")
    return h, w, ids, mask, adv, sampled


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_on_policy_both_entry_points_match_the_oracle(backend, mode):
    """Without old log-probs the weights come from the current ones (detached): float64 to 1e-10."""
    h, w, ids, mask, adv, sampled = batch()
    # (No entropy filter: these random logits are too uncertain for the paper's threshold.)
    config = GTPOConfig(
        preset="paper", entropy_threshold=None, sampling_correction=mode, sampling_ratio_min=0.7, sampling_ratio_max=1.4
    )
    common = dict(config=config, group_size=2, sampling_logprobs=sampled)
    h_ref = h.clone().requires_grad_()
    ref = reference_gtpo_loss(h_ref @ w.T, ids, mask, adv, **common)
    ref.loss.backward()
    if backend == "triton" and device_for(backend).type == "cpu":
        pytest.skip("float64 is the torch and C++ backends'; the Triton one is checked in tests/test_parity.py")
    h_logits = h.clone().requires_grad_()
    out = gtpo_loss(h_logits @ w.T, ids, mask, adv, backend=backend, **common)
    out.loss.backward()
    h_fused = h.clone().requires_grad_()
    fused = fused_linear_gtpo_loss(h_fused, w, ids, mask, adv, backend=backend, **common)
    fused.loss.backward()
    assert ref.loss.abs() > 0
    for what, loss, grad in (("logits", out.loss, h_logits.grad), ("fused", fused.loss, h_fused.grad)):
        assert_rel_close(loss.detach(), ref.loss.detach(), 1e-10, f"{what} loss")
        assert_rel_close(grad, h_ref.grad, 1e-10, f"{what} grad")
        assert float(out.metrics.signal_fraction) == pytest.approx(float(ref.metrics.signal_fraction))


def test_the_weights_change_the_loss_and_slices_add_up():
    h, w, ids, mask, adv, sampled = batch(seed=1)
    logits = h @ w.T
    config = GTPOConfig(
        preset="paper", entropy_threshold=None, sampling_correction="sequence_truncate", sampling_ratio_max=1.2
    )
    common = dict(config=config, group_size=2, backend="torch")
    whole = gtpo_loss(logits, ids, mask, adv, sampling_logprobs=sampled, **common)
    uncorrected = gtpo_loss(logits, ids, mask, adv, config=config.replace(sampling_correction=None), group_size=2)
    assert abs(float(whole.loss) - float(uncorrected.loss)) > 1e-3
    from gtpo_kernels import conflict_weights

    lam, n_conflict = conflict_weights(ids, mask, adv, 2)
    parts = 0.0
    for rows in (slice(0, 1), slice(1, 4), slice(4, 6)):  # cuts through groups
        parts += float(
            gtpo_loss(
                logits[rows],
                ids[rows],
                mask[rows],
                adv[rows],
                config=config,
                backend="torch",
                conflict=(lam[rows], n_conflict[rows]),
                sampling_logprobs=sampled[rows],
                num_sequences=6,
            ).loss
        )
    assert parts == pytest.approx(float(whole.loss), rel=1e-12)


@pytest.mark.parametrize(
    "knobs, given, message",
    [
        (dict(sampling_correction="token_mask"), {}, "needs sampling_logprobs"),
        ({}, {"sampling_logprobs": torch.zeros(2, 3)}, "nothing would read them"),
        (dict(sampling_correction="token_mask"), {"sampling_logprobs": torch.zeros(2, 4)}, r"shape \[N, L\]"),
        (dict(sampling_correction="token_mask"), {"sampling_logprobs": torch.zeros(2, 3, dtype=torch.long)}, "float"),
    ],
)
def test_inputs_that_do_not_fit_are_refused(knobs, given, message):
    config = GTPOConfig(preset="grpo", **knobs)
    with pytest.raises(ValueError, match=message):
        gtpo_loss(
            torch.randn(2, 3, 5),
            torch.zeros(2, 3, dtype=torch.long),
            torch.ones(2, 3),
            torch.ones(2),
            config=config,
            **given,
        )


@pytest.mark.parametrize(
    "knobs, message",
    [
        (dict(sampling_correction="token"), "sampling_correction must be one of"),
        (dict(sampling_ratio_min=-1.0), "sampling_ratio_min must be a number >= 0"),
        (dict(sampling_ratio_min=2.0, sampling_ratio_max=1.0), "must not exceed sampling_ratio_max"),
    ],
)
def test_bad_knobs_are_refused(knobs, message):
    with pytest.raises(ValueError, match=message):
        GTPOConfig(**knobs)
