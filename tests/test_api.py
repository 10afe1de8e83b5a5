"""The public API: input validation, edge cases, the module wrapper and the config."""

import math

import pytest
import torch

import gtpo_kernels
from gtpo_kernels import GTPOConfig, GTPOLoss, compute_advantages, gtpo_loss
from gtpo_kernels.backends import registered

from .helpers import random_batch


@pytest.fixture
def batch():
    return random_batch(2, 3, 5, 11, dtype=torch.float32, seed=7)


def call(logits, ids, mask, adv, group_size=3, **kwargs):
    return gtpo_loss(logits, ids, mask, adv, group_size=group_size, **kwargs)


# ---- errors that name the argument ------------------------------------------------------------------


def test_logits_must_be_3d(batch):
    logits, ids, mask, adv = batch
    with pytest.raises(ValueError, match=r"logits must be 3-D \[N, L, V\]"):
        call(logits.view(-1, 11), ids, mask, adv)


def test_logits_must_be_float(batch):
    logits, ids, mask, adv = batch
    with pytest.raises(ValueError, match="logits must be float16, bfloat16, float32 or float64"):
        call(logits.long(), ids, mask, adv)


def test_logits_and_ids_must_agree(batch):
    logits, ids, mask, adv = batch
    with pytest.raises(ValueError, match="disagree on N or L"):
        call(logits[:, :4], ids, mask, adv)


def test_ids_must_be_integers(batch):
    logits, ids, mask, adv = batch
    with pytest.raises(ValueError, match="completion_ids must be an integer tensor"):
        call(logits, ids.float(), mask, adv)
    with pytest.raises(ValueError, match="completion_ids must be an integer tensor"):
        call(logits, mask, ids, adv)  # swapped


def test_ids_outside_vocabulary(batch):
    logits, ids, mask, adv = batch
    bad = ids.clone()
    bad[2, 0] = 11
    with pytest.raises(ValueError, match=r"completion_ids must lie in \[0, V=11\).*completion_ids\[2, 0\] = 11"):
        call(logits, bad, mask, adv)
    bad[2, 0] = -1
    with pytest.raises(ValueError, match="completion_ids must lie in"):
        call(logits, bad, mask, adv)


def test_ids_at_masked_positions_are_ignored(batch):
    logits, ids, mask, adv = batch
    padded = torch.where(mask, ids, -100)  # the usual ignore index
    a = call(logits, ids, mask, adv).loss
    b = call(logits, padded, mask, adv).loss
    assert torch.equal(a, b)


def test_mask_shape_and_values(batch):
    logits, ids, mask, adv = batch
    with pytest.raises(ValueError, match="completion_mask must have shape"):
        call(logits, ids, mask[:, :3], adv)
    with pytest.raises(ValueError, match="completion_mask must hold only 0 and 1"):
        call(logits, ids, mask.float() * 2, adv)


def test_mask_must_be_right_padded(batch):
    """Holes inside a completion are allowed (tests/test_mask_holes.py); a masked first position before an
    unmasked one is left padding, which would misalign the completions, and is refused."""
    logits, ids, mask, adv = batch
    left_padded = torch.ones_like(mask)
    left_padded[4, 0] = False
    with pytest.raises(ValueError, match="row 4 starts with a 0; left-padded"):
        call(logits, ids, left_padded, adv)
    gapped = torch.ones_like(mask)
    gapped[1, 2] = False
    call(logits, ids, gapped, adv)


def test_mask_dtypes_accepted(batch):
    logits, ids, mask, adv = batch
    expected = call(logits, ids, mask, adv).loss
    for as_dtype in (torch.long, torch.int32, torch.float32, torch.uint8):
        assert torch.equal(call(logits, ids, mask.to(as_dtype), adv).loss, expected)


def test_advantages_shape_dtype_and_nan(batch):
    logits, ids, mask, adv = batch
    with pytest.raises(ValueError, match=r"advantages must have shape \[N\]"):
        call(logits, ids, mask, adv[:, None])
    with pytest.raises(ValueError, match="advantages must be a floating-point tensor"):
        call(logits, ids, mask, adv.long())
    nan = adv.clone()
    nan[0] = float("nan")
    with pytest.raises(ValueError, match="advantages must be finite"):
        call(logits, ids, mask, nan)


@pytest.mark.parametrize("group_size", [4, 0, -3, 2.0, True])
def test_group_size(batch, group_size):
    logits, ids, mask, adv = batch
    with pytest.raises(ValueError, match="group_size"):
        call(logits, ids, mask, adv, group_size=group_size)


def test_old_and_ref_logprobs_shapes(batch):
    logits, ids, mask, adv = batch
    with pytest.raises(ValueError, match=r"old_logprobs must have shape \[N, L\]"):
        call(logits, ids, mask, adv, old_logprobs=torch.zeros(6))
    with pytest.raises(ValueError, match="ref_logprobs must be a floating-point tensor"):
        call(logits, ids, mask, adv, ref_logprobs=ids)


@pytest.mark.parametrize("entry", ["logits", "fused_linear"])
@pytest.mark.parametrize("name", ["old_logprobs", "ref_logprobs", "sampling_logprobs"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")], ids=["nan", "+inf", "-inf"])
def test_non_finite_given_logprobs_are_named(batch, entry, name, value):
    """A NaN or infinite old / reference log-prob at an unmasked position is refused on both entry points; the
    sampler's may be NaN (not reported: weight 1) but not infinite. The same value at a masked position is ignored."""
    logits, ids, mask, adv = batch
    config = {
        "old_logprobs": GTPOConfig(),
        "ref_logprobs": GTPOConfig(kl_beta=0.1),
        "sampling_logprobs": GTPOConfig(sampling_correction="token_truncate"),
    }[name]
    given = torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1) - 0.1
    hidden = weight = None
    if entry == "fused_linear":
        weight = torch.randn(11, 8, generator=torch.Generator().manual_seed(3))
        hidden = torch.randn(6, 5, 8, generator=torch.Generator().manual_seed(4))

    def run(values):
        kwargs = {name: values, "config": config, "group_size": 3}
        if name != "old_logprobs":
            kwargs["old_logprobs"] = given
        if entry == "logits":
            return gtpo_loss(logits, ids, mask, adv, **kwargs)
        return gtpo_kernels.fused_linear_gtpo_loss(hidden, weight, ids, mask, adv, **kwargs)

    masked = given.clone()
    masked[~mask] = value
    assert torch.isfinite(run(masked).loss)
    bad = given.clone()
    bad[1, 0] = value
    if name == "sampling_logprobs" and math.isnan(value):
        assert torch.isfinite(run(bad).loss)  # not reported by the sampler
        return
    allowed = r"finite or NaN \(not reported by the sampler\)" if name == "sampling_logprobs" else "finite"
    with pytest.raises(ValueError, match=rf"{name} must be {allowed} at unmasked positions, but {name}\[1, 0\]"):
        run(bad)


@pytest.mark.parametrize("backend", registered())
def test_ids_beyond_int32_are_not_wrapped_into_the_vocabulary(batch, backend):
    """2**32 + 5 is not token 5: every backend refuses it (the Triton kernels take int32 ids)."""
    logits, ids, mask, adv = batch
    bad = ids.clone()
    bad[2, 0] = 2**32 + 5
    with pytest.raises(ValueError, match=r"completion_ids\[2, 0\] = 4294967301"):
        call(logits, bad, mask, adv, backend=backend)
    with pytest.raises(ValueError, match=r"completion_ids\[2, 0\] = 4294967301"):
        gtpo_kernels.token_logprobs_and_entropy(logits, bad, mask, backend=backend)


@pytest.mark.parametrize("entry", ["logits", "fused_linear"])
def test_an_empty_batch_gives_a_zero_loss(entry):
    """N = 0 completions: loss 0, gradients of the inputs' (empty) shapes, metrics with nothing counted."""
    ids, mask, adv = torch.zeros(0, 4, dtype=torch.long), torch.zeros(0, 4, dtype=torch.bool), torch.zeros(0)
    if entry == "logits":
        inputs = [torch.randn(0, 4, 11, requires_grad=True)]
        out = gtpo_loss(*inputs, ids, mask, adv, group_size=2, config=GTPOConfig(warn_no_signal=False))
    else:
        inputs = [torch.randn(0, 4, 8, requires_grad=True), torch.randn(11, 8, requires_grad=True)]
        out = gtpo_kernels.fused_linear_gtpo_loss(
            *inputs, ids, mask, adv, group_size=2, config=GTPOConfig(warn_no_signal=False)
        )
    out.loss.backward()
    assert out.loss.item() == 0.0
    for x in inputs:
        assert x.grad is not None and x.grad.shape == x.shape and not x.grad.any()
    assert float(out.metrics.num_tokens) == 0 and out.metrics.completion_entropy.shape == (0,)


def test_kl_needs_reference(batch):
    logits, ids, mask, adv = batch
    with pytest.raises(ValueError, match="kl_beta = 0.1 needs ref_logprobs"):
        call(logits, ids, mask, adv, config=GTPOConfig(kl_beta=0.1))


def test_initial_entropy_must_be_finite(batch):
    logits, ids, mask, adv = batch
    with pytest.raises(ValueError, match="initial_entropy must be a finite number"):
        call(logits, ids, mask, adv, initial_entropy=float("nan"))
    call(logits, ids, mask, adv, initial_entropy=torch.tensor(0.3))  # a 0-d tensor is fine


def test_tensors_on_different_devices(batch):
    logits, ids, mask, adv = batch
    with pytest.raises(ValueError, match="one device.*advantages on meta"):
        call(logits, ids, mask, adv.to("meta"))


def test_unknown_backend(batch):
    logits, ids, mask, adv = batch
    with pytest.raises(ValueError, match="backend must be one of"):
        call(logits, ids, mask, adv, backend="cuda")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_logits_at_unmasked_positions(batch, value):
    logits, ids, mask, adv = batch
    bad = logits.clone()
    bad[1, 0, 3] = value
    with pytest.raises(ValueError, match=r"non-finite log-prob or entropy at unmasked position \[1, 0\]"):
        call(bad, ids, mask, adv)


def test_sampled_banned_token_is_reported(batch):
    logits, ids, mask, adv = batch
    bad = logits.clone()
    bad[0, 0, ids[0, 0]] = float("-inf")
    with pytest.raises(ValueError, match="target token's logit is -inf"):
        call(bad, ids, mask, adv)


def test_validation_can_be_switched_off(batch):
    logits, ids, mask, adv = batch
    bad = logits.clone()
    bad[1, 0, 3] = float("nan")
    out = call(bad, ids, mask, adv, config=GTPOConfig(validate_inputs=False))
    assert torch.isnan(out.loss)  # what the check exists to prevent


# ---- edge cases -----------------------------------------------------------------------------------


def test_garbage_at_masked_positions_is_ignored(batch):
    logits, ids, mask, adv = batch
    x = logits.clone().requires_grad_()
    expected = call(x, ids, mask, adv, config=GTPOConfig(entropy_mode="penalty")).loss
    (grad,) = torch.autograd.grad(expected, x)
    dirty = logits.clone()
    dirty[~mask] = float("nan")
    y = dirty.requires_grad_()
    out = call(y, ids, mask, adv, config=GTPOConfig(entropy_mode="penalty")).loss
    (grad_dirty,) = torch.autograd.grad(out, y)
    assert torch.equal(out, expected)
    assert torch.equal(grad_dirty, grad)
    assert (grad_dirty[~mask] == 0).all()


@pytest.mark.parametrize("preset", ["paper", "official", "grpo"])
def test_all_masked_batch_gives_zero_loss_and_zero_grad(batch, preset):
    logits, ids, mask, adv = batch
    x = logits.clone().requires_grad_()
    # Its no-signal warning is expected (tests/test_first_hour.py pins it): off here.
    out = call(x, ids, torch.zeros_like(mask), adv, config=GTPOConfig(preset=preset, warn_no_signal=False))
    out.loss.backward()
    assert out.loss.item() == 0.0
    assert torch.equal(x.grad, torch.zeros_like(x))
    for value in out.metrics.to_dict().values():
        assert math.isfinite(value)


def test_chunk_budget_does_not_change_results(batch, monkeypatch):
    from gtpo_kernels.backends import torch_backend

    logits, ids, mask, adv = batch
    blocks = []
    real = torch_backend._chunk_stats
    monkeypatch.setattr(torch_backend, "_chunk_stats", lambda z, *a: blocks.append(z.shape[0]) or real(z, *a))
    results = []
    for tokens in (None, 1, 3, 7, 1000):
        budget = None if tokens is None else 4 * 11 * tokens  # float32 bytes of `tokens` tokens at V = 11
        x = logits.clone().requires_grad_()
        blocks.clear()
        out = call(
            x, ids, mask, adv, config=GTPOConfig(max_chunk_bytes=budget, entropy_mode="penalty"), backend="torch"
        )
        out.loss.backward()
        # The torch backend really walked chunks of at most that many tokens.
        assert max(blocks) <= (tokens or 30) and (tokens is None or tokens >= 30 or len(blocks) > 1)
        results.append((out.loss, x.grad))
    for loss, grad in results[1:]:
        torch.testing.assert_close(loss, results[0][0], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(grad, results[0][1], rtol=1e-5, atol=1e-8)


def test_non_contiguous_logits(batch):
    logits, ids, mask, adv = batch
    # A model's logits over prompt + completion, sliced to the completion part: a non-contiguous view.
    full = torch.randn(6, 9, 11)
    full[:, 3:8] = logits
    view = full[:, 3:8]
    assert not view.is_contiguous()
    a, b = call(view, ids, mask, adv), call(logits, ids, mask, adv)
    assert torch.equal(a.loss, b.loss)


def test_module_matches_function(batch):
    logits, ids, mask, adv = batch
    config = GTPOConfig(preset="official")
    module = GTPOLoss(config)
    assert "official" in repr(module)
    assert torch.equal(
        module(logits, ids, mask, adv, group_size=3).loss, call(logits, ids, mask, adv, config=config).loss
    )


def test_metrics_to_dict(batch):
    logits, ids, mask, adv = batch
    d = call(logits, ids, mask, adv).metrics.to_dict()
    assert set(d) == {
        "entropy",
        "completion_entropy",
        "filtered_fraction",
        "signal_fraction",
        "amplified_fraction",
        "skipped_fraction",
        "ratio_mean",
        "clip_fraction",
        "clip_low_fraction",
        "clip_high_fraction",
        "cov_fraction",
        "num_tokens",
        "num_sequences",
        "num_nonempty",
    }
    assert all(isinstance(v, float) for v in d.values())
    assert d["num_tokens"] == float(mask.sum()) and d["num_sequences"] == 6.0


def test_public_names():
    for name in (
        "gtpo_loss",
        "GTPOLoss",
        "GTPOConfig",
        "compute_advantages",
        "conflict_weights",
        "fused_linear_gtpo_loss",
        "fused_linear_token_logprobs_and_entropy",
        "token_logprobs_and_entropy",
        "GTPOMetrics",
    ):
        assert hasattr(gtpo_kernels, name) and name in gtpo_kernels.__all__


# ---- advantages ------------------------------------------------------------------------------------


def test_compute_advantages_errors():
    with pytest.raises(ValueError, match="group_size"):
        compute_advantages(torch.ones(6), 4)
    with pytest.raises(ValueError, match=r"1-D tensor \[N\]"):
        compute_advantages(torch.ones(2, 3), 3)
    with pytest.raises(ValueError, match=r"rewards must be finite, but rewards\[4\] = nan"):
        compute_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0, float("nan"), 1.0]), 3)
    with pytest.raises(ValueError, match=r"rewards must be finite, but rewards\[0\] = inf"):
        compute_advantages(torch.tensor([float("inf"), 0.0]), 2)
    for eps in (0.0, -1e-4, float("nan")):
        with pytest.raises(ValueError, match="eps must be a finite number > 0"):
            compute_advantages(torch.ones(4), 2, normalize_std=True, eps=eps)


@pytest.mark.parametrize("weight", [0.0, -2.0, float("nan"), float("inf"), True])
def test_conflict_weight_must_be_positive_and_finite(batch, weight):
    _, ids, mask, adv = batch
    with pytest.raises(ValueError, match="conflict_weights: weight must be a finite number > 0"):
        gtpo_kernels.conflict_weights(ids, mask, adv, 3, weight)


def test_compute_advantages_single_completion_groups():
    assert compute_advantages(torch.tensor([3.0, 1.0]), 1, normalize_std=True).tolist() == [0.0, 0.0]


# ---- config: tests/test_config.py ------------------------------------------------------------------


def test_infinite_threshold_switches_the_filter_off(batch):
    logits, ids, mask, adv = batch
    out = call(logits, ids, mask, adv, config=GTPOConfig(entropy_threshold=float("inf")))
    assert float(out.metrics.filtered_fraction) == 0.0


@pytest.mark.parametrize("entry", ["logits", "fused_linear"])
@pytest.mark.parametrize("backend", registered())
def test_every_metric_is_detached(entry, backend):
    """Metrics are reports: none carries a grad_fn (backpropagating through one would silently give zero,
    and reading one as a float warns), whatever the entry point and backend."""
    from gtpo_kernels import fused_linear_gtpo_loss

    from .helpers import device_for, random_batch

    logits, ids, mask, adv = random_batch(2, 3, 5, 13, seed=9)
    dev = device_for(backend)
    g = torch.Generator().manual_seed(9)
    ref = logits.log_softmax(-1).gather(-1, ids[..., None])[..., 0] - 0.1
    kwargs = dict(
        group_size=3,
        config=GTPOConfig(kl_beta=0.1),
        ref_logprobs=ref.to(dev),
        old_logprobs=ref.to(dev),
        backend=backend,
    )
    if entry == "logits":
        out = gtpo_loss(logits.to(dev).requires_grad_(), ids.to(dev), mask.to(dev), adv.to(dev), **kwargs)
    else:
        hidden = torch.randn(6, 5, 8, generator=g).to(dev).requires_grad_()
        weight = torch.randn(13, 8, generator=g).to(dev).requires_grad_()
        out = fused_linear_gtpo_loss(hidden, weight, ids.to(dev), mask.to(dev), adv.to(dev), **kwargs)
    assert out.loss.requires_grad
    fields = {name: value for name, value in vars(out.metrics).items() if isinstance(value, torch.Tensor)}
    assert len(fields) >= 10
    for name, value in fields.items():
        assert not value.requires_grad and value.grad_fn is None, name
