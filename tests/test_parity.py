"""Every backend against the float64 reference: loss, metrics and gradients.

The reference sees the same input values upcast to float64 (``logits.double()``), so the only
differences are the backend's own arithmetic. Error bars (`helpers.RTOL_ACCUMULATED`, `helpers.RTOL`): the
loss and metrics, accumulated in float32 from those inputs, 1e-5 in every input dtype; the gradients, returned
in the logits' dtype, 1e-5 in fp32 and 1e-2 in bf16/fp16, relative to each entry's terms
(`assert_close_per_entry`). Every registered backend runs
("triton" interpreted on CPU tensors, tests/conftest.py); the torch backend is made to chunk.
"""

import dataclasses
import math

import pytest
import torch

from gtpo_kernels import GTPOConfig, gtpo_loss
from gtpo_kernels.backends import registered
from gtpo_kernels.reference import reference_gtpo_loss, token_logprobs_and_entropy

from .helpers import (
    RTOL,
    RTOL_ACCUMULATED,
    assert_close_per_entry,
    assert_rel_close,
    device_for,
    logits_gradient_scale,
    random_batch,
    row_scale,
    tiny_chunks,
    to_cpu,
)

BACKENDS = list(registered())
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

CONFIGS = {
    "paper": GTPOConfig(preset="paper"),
    "official": GTPOConfig(preset="official"),
    "grpo": GTPOConfig(preset="grpo"),
    "penalty": GTPOConfig(preset="paper", entropy_mode="penalty"),
    "clip+kl": GTPOConfig(
        preset="paper", clip_eps_low=0.2, clip_eps_high=0.28, kl_beta=0.04, loss_reduction="token_mean"
    ),
    "dr_grpo": GTPOConfig(preset="grpo", loss_reduction="dr_grpo", kl_beta=0.1),
    # TRL's delta (two-sided clipping) and use_bias_correction_kl, on a GTPO preset
    "cap+weighted_kl": GTPOConfig(
        preset="paper", clip_eps_low=0.2, clip_eps_high=0.28, ratio_cap=1.25, kl_beta=0.05, kl_ratio_weighted=True
    ),
    # TRL's terms (docs/method.md), several to a config: the sampler's correction in each of its modes (bounds that
    # bite on these draws), CISPO and SAPO, off-policy masking (against the sampler's or the old log-probs), GSPO's
    # sequence-level ratio, LUSPO's sequence_sum and the entropy bonus, beside GTPO's presets and entropy terms.
    # (Each term alone, by hand: tests/test_ratio_functions.py, tests/test_sampling_correction.py.) They act after
    # the kernels, so tests/test_cpu_backend.py's reruns for the lower instruction sets leave them out ("trl:").
    "trl:sampler:token_truncate+cispo": GTPOConfig(
        preset="paper",
        sampling_correction="token_truncate",
        sampling_ratio_min=0.8,
        sampling_ratio_max=1.3,
        ratio_function="cispo",
        cispo_ratio_max=1.02,  # bites on these draws
    ),
    "trl:sampler:token_mask+kl+bonus": GTPOConfig(
        preset="grpo", sampling_correction="token_mask", sampling_ratio_min=0.7, kl_beta=0.05, entropy_bonus=0.05
    ),
    "trl:sampler:sequence_truncate+sapo": GTPOConfig(
        preset="official",
        sampling_correction="sequence_truncate",
        sampling_ratio_max=2.0,
        ratio_function="sapo",
        sapo_temperature_pos=0.8,
        sapo_temperature_neg=1.3,
    ),
    "trl:sampler:sequence_mask+penalty+opsm": GTPOConfig(
        preset="paper",
        entropy_mode="penalty",
        sampling_correction="sequence_mask",
        sampling_ratio_max=1.5,
        off_policy_mask_threshold=0.02,
    ),
    "trl:opsm+sequence_sum+kl": GTPOConfig(
        preset="paper", off_policy_mask_threshold=0.05, loss_reduction="sequence_sum", kl_beta=0.05
    ),
    "trl:gspo+sapo+weighted_kl": GTPOConfig(
        preset="grpo", importance_sampling_level="sequence", ratio_function="sapo", kl_beta=0.05, kl_ratio_weighted=True
    ),
    "trl:gspo+cispo": GTPOConfig(preset="paper", importance_sampling_level="sequence", ratio_function="cispo"),
    "trl:vespo+sampler:token_mask+top_entropy": GTPOConfig(
        preset="official",
        ratio_function="vespo",
        sampling_correction="token_mask",
        sampling_ratio_min=0.8,
        top_entropy_quantile=0.8,
    ),
    "trl:top_entropy+bonus+kl": GTPOConfig(preset="grpo", top_entropy_quantile=0.4, entropy_bonus=0.05, kl_beta=0.05),
    "trl:top_entropy+sapo+sampler:token_mask": GTPOConfig(
        preset="official",
        top_entropy_quantile=0.7,
        ratio_function="sapo",
        sampling_correction="token_mask",
        sampling_ratio_min=0.8,
    ),
    "trl:gspo+weighted_kl+bonus+penalty+dr_grpo": GTPOConfig(
        preset="grpo",
        importance_sampling_level="sequence",
        kl_beta=0.05,
        kl_ratio_weighted=True,
        entropy_bonus=0.1,
        entropy_mode="penalty",
        entropy_coef=0.02,
        loss_reduction="dr_grpo",
    ),
}


def sampler_logprobs(logp64: torch.Tensor) -> torch.Tensor:
    """A sampler's log-probs near the trainer's (vLLM's differ by rounding and kernels), some not reported."""
    g = torch.Generator().manual_seed(77)
    sampled = logp64 + 0.25 * torch.randn(logp64.shape, generator=g, dtype=torch.float64)
    return sampled.masked_fill(torch.rand(logp64.shape, generator=g) < 0.1, float("nan")).float()


def compare(
    backend,
    dtype,
    config,
    logits,
    ids,
    mask,
    adv,
    group_size,
    *,
    off_policy=False,
    initial_entropy=None,
    temperature=1.0,
    reseed=None,
):
    """``reseed``: torch's seed before each of the two calls (Clip-Cov draws its random pick from torch's CPU
    generator, the same draw for both)."""
    valid = mask.bool()
    # Chunks of 3 tokens: the torch backend walks several chunks that cut through rows (others ignore it).
    config = dataclasses.replace(config, max_chunk_bytes=tiny_chunks(logits.shape[-1]))
    logp64, _ = token_logprobs_and_entropy(logits.double() / row_scale(temperature), torch.where(valid, ids, 0))
    kwargs = {}
    if off_policy or config.clipping or config.ratio_function != "clip":  # CISPO's cap and SAPO's gate off-policy
        g = torch.Generator().manual_seed(123)
        kwargs["old_logprobs"] = (logp64 + 0.3 * torch.randn(logp64.shape, generator=g, dtype=torch.float64)).float()
    if config.kl_beta:
        g = torch.Generator().manual_seed(321)
        kwargs["ref_logprobs"] = (logp64 + 0.5 * torch.randn(logp64.shape, generator=g, dtype=torch.float64)).float()
    if config.sampling_correction:
        kwargs["sampling_logprobs"] = sampler_logprobs(logp64)

    dev = device_for(backend)
    x = logits.detach().clone().to(dev).requires_grad_()
    if reseed is not None:
        torch.manual_seed(reseed)
    out = gtpo_loss(
        x,
        ids.to(dev),
        mask.to(dev),
        adv.to(dev),
        group_size=group_size,
        config=config,
        backend=backend,
        initial_entropy=initial_entropy,
        temperature=temperature.to(dev) if isinstance(temperature, torch.Tensor) else temperature,
        **{k: v.to(dev) for k, v in kwargs.items()},
    )
    out.loss.backward()
    out = to_cpu(out)
    grad = x.grad.cpu()

    x64 = logits.detach().double().requires_grad_()
    if reseed is not None:
        torch.manual_seed(reseed)
    ref = reference_gtpo_loss(
        x64,
        ids,
        mask,
        adv.double(),
        group_size=group_size,
        config=config,
        initial_entropy=initial_entropy,
        temperature=temperature,
        **{k: v.double() for k, v in kwargs.items()},
    )
    ref.loss.backward()

    rtol, rtol_accumulated = RTOL[dtype], RTOL_ACCUMULATED[dtype]
    assert grad.dtype == dtype
    assert_rel_close(out.loss.detach(), ref.loss.detach(), rtol_accumulated, "loss")
    # Per entry, relative to the terms it is made of; float16 gradients below 6e-5 are subnormal, spaced
    # 2^-24 apart: that spacing is their resolution.
    scale = logits_gradient_scale(
        logits,
        ids,
        mask,
        adv,
        config=config,
        temperature=temperature,
        group_size=group_size,
        initial_entropy=initial_entropy,
        **kwargs,
    )
    assert_close_per_entry(grad, x64.grad, rtol, "grad", scale=scale, atol=2.0**-24 if dtype == torch.float16 else 0.0)
    m, r = out.metrics, ref.metrics
    for name in ("entropy", "completion_entropy", "ratio_mean"):
        assert_rel_close(getattr(m, name), getattr(r, name), rtol_accumulated, name)
    # Discrete metrics agree exactly unless an entropy sits on the threshold (not in these draws).
    for name in (
        "filtered_fraction",
        "signal_fraction",
        "amplified_fraction",
        "skipped_fraction",
        "clip_fraction",
        "clip_low_fraction",
        "clip_high_fraction",
        "cov_fraction",
    ):
        assert float(getattr(m, name)) == pytest.approx(float(getattr(r, name)), abs=1e-6), name
    for name in ("completion_clip_low", "completion_clip_high"):  # per completion; NaN for an empty one
        torch.testing.assert_close(
            getattr(m, name).double().cpu(),
            getattr(r, name).double().cpu(),
            atol=1e-6,
            rtol=0,
            equal_nan=True,
            msg=name,
        )
    if r.kl is not None:
        assert_rel_close(m.kl, r.kl, rtol_accumulated, "kl")
    assert (m.vespo_weight_mean is None) == (r.vespo_weight_mean is None)
    if r.vespo_weight_mean is not None:
        assert_rel_close(m.vespo_weight_mean, r.vespo_weight_mean, rtol_accumulated, "vespo_weight_mean")
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_configs_and_dtypes(backend, dtype, name):
    logits, ids, mask, adv = random_batch(2, 4, 6, 37, dtype=dtype, seed=list(CONFIGS).index(name))
    compare(backend, dtype, CONFIGS[name], logits, ids, mask, adv, 4, off_policy=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("vocab", [1, 7, 1000, 32003])
def test_vocab_sizes(backend, vocab):
    n_groups, length = (1, 3) if vocab > 1000 else (2, 5)
    # A target boost that grows with ln V keeps some completions under the filter's threshold (at V = 1000 the
    # default boost left every one above it: the comparison was of zeros).
    sharpness = 3.0 + math.log(vocab)
    logits, ids, mask, adv = random_batch(n_groups, 2, length, vocab, seed=vocab, sharpness=sharpness)
    out = compare(backend, torch.float32, CONFIGS["paper"], logits, ids, mask, adv, 2, off_policy=True)
    assert float(out.metrics.filtered_fraction) < 1 and float(out.loss) != 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_length_one(backend, dtype):
    logits, ids, mask, adv = random_batch(3, 2, 1, 11, dtype=dtype, seed=1)
    compare(backend, dtype, CONFIGS["official"], logits, ids, mask, adv, 2, off_policy=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_token_per_completion_and_fully_masked_rows(backend):
    logits, ids, mask, adv = random_batch(2, 3, 5, 13, dtype=torch.float32, seed=2)
    mask[:] = False
    mask[0, 0] = mask[1, 0] = mask[3, :1] = True  # rows 2, 4, 5 fully masked; the others length 1
    compare(backend, torch.float32, CONFIGS["paper"], logits, ids, mask, adv, 3, off_policy=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_equal_rewards(backend):
    logits, ids, mask, adv = random_batch(2, 4, 5, 17, dtype=torch.float32, seed=3, tie_groups=True)
    assert (adv == 0).all()
    out = compare(backend, torch.float32, CONFIGS["paper"], logits, ids, mask, adv, 4)
    # With A = 0 only the entropy shift -gamma Hbar moves the loss; no conflict weights apply.
    assert float(out.metrics.amplified_fraction) == 0 and float(out.metrics.skipped_fraction) == 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_extreme_logits_and_banned_tokens(backend, dtype):
    logits, ids, mask, adv = random_batch(2, 2, 4, 19, dtype=torch.float64, seed=4)
    logits = logits * 2500  # logits of order +-1e4
    onehot = torch.nn.functional.one_hot(ids, 19).bool()
    banned = torch.zeros_like(onehot)
    banned[..., 3] = True
    logits = logits.masked_fill(banned & ~onehot, float("-inf")).to(dtype)
    compare(backend, dtype, CONFIGS["penalty"], logits, ids, mask, adv, 2, off_policy=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_initial_entropy_gate(backend):
    logits, ids, mask, adv = random_batch(2, 3, 5, 23, dtype=torch.float32, seed=5)
    compare(backend, torch.float32, CONFIGS["paper"], logits, ids, mask, adv, 3, initial_entropy=5.0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("temperature", [0.5, 0.7, 1.3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_temperature(backend, temperature, dtype):
    # The statistics are those of softmax(logits / T), inside the kernels; the gradient is w.r.t. logits.
    logits, ids, mask, adv = random_batch(2, 4, 6, 37, dtype=dtype, seed=11)
    out = compare(
        backend, dtype, CONFIGS["clip+kl"], logits, ids, mask, adv, 4, off_policy=True, temperature=temperature
    )
    at_one = gtpo_loss(
        logits.to(device_for(backend)),
        ids.to(device_for(backend)),
        mask.to(device_for(backend)),
        adv.to(device_for(backend)),
        group_size=4,
        backend=backend,
    )
    assert not torch.allclose(out.metrics.entropy, at_one.metrics.entropy.cpu())  # T really changed something


ROW_TEMPERATURES = torch.tensor([0.5, 0.7, 1.3, 1.0, 0.8, 1.6, 0.6, 1.1])  # one per completion, no two alike


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_per_completion_temperature(backend, dtype):
    """Each completion at its own temperature (``temperature [N]``: mixed-temperature rollouts), a per-row scale read
    inside each backend's kernels: loss, gradient and metrics of the float64 oracle on ``logits / T_i``, and each row
    the statistics of the same row at its temperature as a float."""
    logits, ids, mask, adv = random_batch(2, 4, 6, 37, dtype=dtype, seed=11)
    out = compare(
        backend, dtype, CONFIGS["clip+kl"], logits, ids, mask, adv, 4, off_policy=True, temperature=ROW_TEMPERATURES
    )
    dev = device_for(backend)
    from gtpo_kernels import token_logprobs_and_entropy as ours

    logp, entropy = ours(
        logits.to(dev), ids.to(dev), mask.to(dev), temperature=ROW_TEMPERATURES.to(dev), backend=backend
    )
    for i in (0, 2, 5):  # a row alone at its own temperature, as a float
        one = ours(
            logits[i : i + 1].to(dev),
            ids[i : i + 1].to(dev),
            mask[i : i + 1].to(dev),
            temperature=float(ROW_TEMPERATURES[i]),
            backend=backend,
        )
        torch.testing.assert_close(logp[i : i + 1].cpu(), one[0].cpu(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(entropy[i : i + 1].cpu(), one[1].cpu(), rtol=1e-6, atol=1e-7)
    assert out.metrics.completion_entropy.unique().numel() == 8


@pytest.mark.parametrize("backend", BACKENDS)
def test_temperature_makes_no_scaled_copy(backend):
    """T is applied inside the kernels: no tensor as large as the logits is created by the forward."""
    from .helpers import PeakTensorMemory

    logits, ids, mask, adv = random_batch(2, 2, 8, 4096, dtype=torch.float32, seed=12)
    dev = device_for(backend)
    config = GTPOConfig(max_chunk_bytes=logits.nbytes // 8, warn_no_signal=False)  # the forward's memory only
    logits, ids, mask, adv = (t.to(dev) for t in (logits, ids, mask, adv))  # the copies are not the call's
    with PeakTensorMemory() as memory:
        gtpo_loss(logits, ids, mask, adv, group_size=2, temperature=0.7, config=config, backend=backend)
        per_row = ROW_TEMPERATURES[: ids.shape[0]].to(dev)
        gtpo_loss(logits, ids, mask, adv, group_size=2, temperature=per_row, config=config, backend=backend)
    assert memory.largest <= logits.nbytes // 8, (memory.largest, logits.nbytes)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_entropy_shift_scoped_to_nonzero_advantages(backend, dtype):
    """entropy_shift_scope="nonzero_advantage" on a batch whose first group ties (every A = 0) and whose second does
    not, against the float64 reference: the tied group's completions carry no signal (no gradient at all from their
    logits), the other group's are shifted as in the paper."""
    # A draw where two of the second group's completions pass the filter, and every one of the tied group's.
    logits, ids, mask, adv = random_batch(2, 4, 6, 37, dtype=dtype, seed=12, sharpness=8.0)
    adv[:4] = 0
    assert (adv[4:] != 0).all()
    scoped = GTPOConfig(preset="paper", entropy_shift_scope="nonzero_advantage")
    out = compare(backend, dtype, scoped, logits, ids, mask, adv, 4, off_policy=True)
    paper = compare(backend, dtype, CONFIGS["paper"], logits, ids, mask, adv, 4, off_policy=True)
    assert float(out.metrics.signal_fraction) < float(paper.metrics.signal_fraction)  # the tied rows lost theirs

    x = logits.detach().double().requires_grad_()
    reference_gtpo_loss(x, ids, mask, adv.double(), group_size=4, config=scoped).loss.backward()
    assert (x.grad[:4] == 0).all() and (x.grad[4:] != 0).any()
    x.grad = None
    reference_gtpo_loss(x, ids, mask, adv.double(), group_size=4, config=CONFIGS["paper"]).loss.backward()
    assert (x.grad[:4] != 0).any()  # the paper's shift reaches the tied group


# Clip-Cov and KL-Cov (GTPOConfig.cov_mode) with shares and a band that pick several tokens of these small batches.
COV_CONFIGS = {
    "clip_cov": GTPOConfig(preset="paper", cov_mode="clip_cov", cov_ratio=0.1, clip_cov_low=0.02, clip_cov_high=5.0),
    "clip_cov+clip": GTPOConfig(
        preset="grpo", cov_mode="clip_cov", cov_ratio=0.1, clip_cov_low=0.02, loss_reduction="token_mean"
    ),
    "kl_cov": GTPOConfig(preset="paper", cov_mode="kl_cov", cov_ratio=0.1, kl_cov_coef=0.5),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(COV_CONFIGS))
def test_clip_cov_and_kl_cov_equal_the_reference(backend, dtype, name):
    """cov_mode off-policy on an odd batch (the torch backend chunking through rows), against the float64 oracle's
    own pick (its covariances in float64, the same draw of torch's CPU generator): loss, gradient and every metric,
    the share picked among them; and the pick changes the loss (it is not a term that does nothing)."""
    config = COV_CONFIGS[name]
    logits, ids, mask, adv = random_batch(2, 4, 7, 37, dtype=dtype, seed=12, sharpness=8.0)
    out = compare(backend, dtype, config, logits, ids, mask, adv, 4, off_policy=True, reseed=7)
    tokens = int(mask.sum())
    k = math.floor(0.1 * tokens)  # Clip-Cov picks fewer where its band holds fewer
    assert 1 <= float(out.metrics.cov_fraction) * tokens <= k + 1e-9
    if config.cov_mode == "kl_cov":
        assert float(out.metrics.cov_fraction) * tokens == pytest.approx(k)
    off = compare(backend, dtype, config.replace(cov_mode=None), logits, ids, mask, adv, 4, off_policy=True)
    assert float(off.metrics.cov_fraction) == 0
    assert abs(float(out.loss) - float(off.loss)) > 1e-4 * abs(float(off.loss))


@pytest.mark.parametrize("mode", ["clip_cov", "kl_cov"])
def test_what_clip_cov_and_kl_cov_do_to_the_tokens_they_pick(mode):
    """By hand, on the float64 oracle: Clip-Cov's picked tokens carry no gradient at all (their policy term is
    gone, and nothing else acts on them here), the others the same as without it; KL-Cov's picks are the tokens of
    highest covariance and get ``coef * sign(logp - old)`` more gradient on their log-prob; on-policy KL-Cov changes
    nothing (``|logp - old| = 0``, and so is its gradient)."""
    from gtpo_kernels.reference import reference_covariance_tokens, reference_loss_from_token_stats
    from gtpo_kernels.rows import LossRows

    g = torch.Generator().manual_seed(3)
    n, length = 8, 9
    logp = (-3 * torch.rand(n, length, generator=g, dtype=torch.float64)).requires_grad_()
    entropy = torch.rand(n, length, generator=g, dtype=torch.float64)
    valid = torch.rand(n, length, generator=g) < 0.8
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    old = logp.detach() + 0.2 * torch.randn(n, length, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 50, (n, length), generator=g)
    config = GTPOConfig(preset="grpo", clip_eps_low=None, clip_eps_high=None, cov_mode=mode, cov_ratio=0.1)
    config = config.replace(clip_cov_low=0.01)

    def gradient(cfg, **kw):
        logp.grad = None
        torch.manual_seed(11)
        out = reference_loss_from_token_stats(logp, entropy, ids, valid, adv, config=cfg, group_size=4, **kw)
        out.loss.backward()
        return logp.grad.clone(), out

    with_cov, out = gradient(config, old_logprobs=old)
    without, _ = gradient(config.replace(cov_mode=None), old_logprobs=old)
    torch.manual_seed(11)
    rows = LossRows(ids=ids, valid=valid, advantages=adv, old_logprobs=old)
    picked = reference_covariance_tokens(logp.detach(), entropy, valid, torch.ones(n, length), rows, config)
    at = torch.zeros(n, length, dtype=torch.bool)
    for i, t in picked:
        at[i, t] = True
    k = math.floor(0.1 * int(valid.sum()))
    assert len(picked) == k and float(out.metrics.cov_fraction) * int(valid.sum()) == pytest.approx(k)
    assert (at <= valid).all()
    torch.testing.assert_close(with_cov[~at], without[~at], rtol=1e-12, atol=0)
    if mode == "clip_cov":
        assert (with_cov[at] == 0).all() and (without[at] != 0).all()
    else:
        # cov_t = (A_i - mean A)(logp - mean logp) over the unmasked tokens: the picks are the k highest
        a = adv[:, None].expand(n, length)[valid]
        x = logp.detach()[valid]
        cov = torch.zeros(n, length, dtype=torch.float64)
        cov[valid] = (a - a.mean()) * (x - x.mean())
        assert float(cov[at].min()) > float(cov[valid & ~at].max())
        per_token = 1 / valid.sum(dim=1, keepdim=True).double() / n  # sequence_mean's factor
        expected = without + config.kl_cov_coef * torch.sign(logp.detach() - old) * per_token
        torch.testing.assert_close(with_cov[at], expected[at], rtol=1e-12, atol=1e-15)
        on_policy, _ = gradient(config)
        torch.testing.assert_close(on_policy, gradient(config.replace(cov_mode=None))[0], rtol=0, atol=0)
