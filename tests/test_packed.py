"""Packed completions (``cu_seqlens``, `gtpo_kernels.packed`): both entry points on ``[T, V]`` logits or
``[T, H]`` hidden states equal the padded call (loss, gradients, metrics), on every backend, against the float64
oracle in float64; ragged completions inside a group (conflict weights), masked tokens inside the packed ones,
sliced batches; bad packed input gets an error naming the argument."""

import pytest
import torch

from gtpo_kernels import GTPOConfig, conflict_weights, fused_linear_gtpo_loss, gtpo_loss
from gtpo_kernels.backends import registered
from gtpo_kernels.packed import packing_of
from gtpo_kernels.reference import reference_gtpo_loss, token_logprobs_and_entropy

from .helpers import random_batch

BACKENDS = list(registered())
CONFIGS = {
    "paper": GTPOConfig(preset="paper"),
    "official+token_mean": GTPOConfig(preset="official", loss_reduction="token_mean"),
    "grpo+kl+sapo": GTPOConfig(preset="grpo", kl_beta=0.05, ratio_function="sapo"),
    "paper+sampler+sequence_sum": GTPOConfig(
        preset="paper", sampling_correction="token_truncate", sampling_ratio_max=1.2, loss_reduction="sequence_sum"
    ),
}


def packed_batch(vocab=37, dtype=torch.float32, seed=0, length=6):
    """A padded batch and its packing: row ``i`` keeps its first ``k_i`` positions (its unmasked tokens, and for odd
    rows one masked position after them, as a packer that keeps the EOS's padding would), one row empty."""
    logits, ids, mask, adv = random_batch(2, 4, length, vocab, dtype=dtype, seed=seed)
    mask[5] = 0  # an empty completion: no packed tokens at all
    kept = [min(length, int(n) + (i % 2)) if int(n) else 0 for i, n in enumerate(mask.sum(dim=1))]
    at = torch.cat([torch.arange(k) + i * length for i, k in enumerate(kept)])
    cu = torch.tensor([0] + torch.tensor(kept).cumsum(0).tolist())
    logp64, _ = token_logprobs_and_entropy(logits.double(), ids)
    g = torch.Generator().manual_seed(seed + 1)
    per_token = {
        "old_logprobs": logp64 + 0.3 * torch.randn(logp64.shape, generator=g, dtype=torch.float64),
        "ref_logprobs": logp64 + 0.5 * torch.randn(logp64.shape, generator=g, dtype=torch.float64),
        "sampling_logprobs": logp64 + 0.2 * torch.randn(logp64.shape, generator=g, dtype=torch.float64),
    }
    return logits, ids, mask, adv, per_token, at, cu


def kwargs_for(config, per_token, dtype):
    names = ["old_logprobs"]
    if config.kl_beta:
        names.append("ref_logprobs")
    if config.sampling_correction:
        names.append("sampling_logprobs")
    stats = torch.float64 if dtype == torch.float64 else torch.float32
    return {name: per_token[name].to(stats) for name in names}


def flat(tensor, at):
    """The packed tokens' entries of a padded ``[N, L, *]`` tensor."""
    return tensor.reshape(tensor.shape[0] * tensor.shape[1], *tensor.shape[2:])[at]


def packed_call(logits, ids, mask, adv, at, cu, config, per_token, backend="auto"):
    """``(loss output, packed logits)``: the packed call on the padded batch's packed tokens, backpropagated."""
    packed_x = flat(logits, at).clone().requires_grad_()
    packed = gtpo_loss(
        packed_x,
        flat(ids, at),
        flat(mask, at),
        adv,
        group_size=4,
        config=config,
        backend=backend,
        cu_seqlens=cu,
        **{k: flat(v, at) for k, v in per_token.items()},
    )
    packed.loss.backward()
    return packed, packed_x


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_packed_logits_equal_the_padded_call(backend, dtype, name):
    config = CONFIGS[name]
    logits, ids, mask, adv, per_token, at, cu = packed_batch(dtype=dtype, seed=list(CONFIGS).index(name))
    kwargs = kwargs_for(config, per_token, dtype)
    padded_x = logits.clone().requires_grad_()
    padded = gtpo_loss(padded_x, ids, mask, adv, group_size=4, config=config, backend=backend, **kwargs)
    padded.loss.backward()
    packed, packed_x = packed_call(logits, ids, mask, adv, at, cu, config, kwargs, backend)
    torch.testing.assert_close(packed.loss, padded.loss, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(packed_x.grad, flat(padded_x.grad, at), rtol=1e-6, atol=1e-9)
    assert float(flat(padded_x.grad, at).abs().sum()) > 0  # not a vacuous comparison
    for metric in ("entropy", "filtered_fraction", "amplified_fraction", "clip_fraction", "completion_entropy"):
        torch.testing.assert_close(getattr(packed.metrics, metric), getattr(padded.metrics, metric), msg=metric)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_packed_float64_equals_the_oracle(name):
    """The packed call in float64 (the torch backend) against the float64 oracle on the padded rows, to 1e-10."""
    config = CONFIGS[name]
    logits, ids, mask, adv, per_token, at, cu = packed_batch(dtype=torch.float64, seed=7)
    kwargs = kwargs_for(config, per_token, torch.float64)
    oracle_x = logits.clone().requires_grad_()
    oracle = reference_gtpo_loss(oracle_x, ids, mask, adv.double(), group_size=4, config=config, **kwargs)
    oracle.loss.backward()
    packed, packed_x = packed_call(logits, ids, mask, adv.double(), at, cu, config, kwargs)
    torch.testing.assert_close(packed.loss, oracle.loss.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(packed_x.grad, flat(oracle_x.grad, at), rtol=1e-10, atol=1e-12)


def test_packed_slices_with_conflict_weights_of_whole_groups_add_up():
    """Two packed calls, each one group's completions with the conflict weights of the whole batch (packed) and the
    whole batch's counts, add up to the whole padded call."""
    config = GTPOConfig(preset="paper", loss_reduction="token_mean", entropy_threshold=5.0)  # both parts kept
    logits, ids, mask, adv, _, at, cu = packed_batch(seed=3)
    whole = gtpo_loss(logits, ids, mask, adv, group_size=4, config=config)
    lam, n_conflict = conflict_weights(ids, mask, adv, 4, config.conflict_weight)
    total = 0.0
    for rows in (slice(0, 4), slice(4, 8)):
        start, end = int(cu[rows.start]), int(cu[rows.stop])
        part = at[start:end]
        out = gtpo_loss(
            flat(logits, part),
            flat(ids, part),
            flat(mask, part),
            adv[rows],
            conflict=(flat(lam, part), n_conflict[rows]),
            config=config,
            cu_seqlens=cu[rows.start : rows.stop + 1] - start,
            num_sequences=8,
            num_tokens=int(mask.sum()),
        )
        assert float(out.loss) != 0
        total = total + out.loss
    torch.testing.assert_close(total, whole.loss, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["grpo+kl+sapo", "official+token_mean"])
def test_packed_hidden_states_equal_the_padded_fused_call(backend, name):
    """`fused_linear_gtpo_loss` on packed ``[T, H]`` hidden states: the padded call's loss and gradients (hidden
    states, weight, bias), chunks of a few tokens cutting through completions."""
    config = CONFIGS[name].replace(max_chunk_bytes=4 * 37 * 4)
    _, ids, mask, adv, per_token, at, cu = packed_batch(seed=11)
    g = torch.Generator().manual_seed(0)
    hidden, weight, bias = (torch.randn(s, generator=g) for s in ((8, 6, 16), (37, 16), (37,)))
    kwargs = kwargs_for(config, per_token, torch.float32)

    def run(h, **extra):
        h = h.clone().requires_grad_()
        w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
        out = fused_linear_gtpo_loss(
            h, w, *extra.pop("rows"), group_size=4, lm_head_bias=b, config=config, backend=backend, **extra
        )
        out.loss.backward()
        return out.loss, h.grad, w.grad, b.grad

    padded = run(hidden, rows=(ids, mask, adv), **kwargs)
    packed = run(
        flat(hidden, at),
        rows=(flat(ids, at), flat(mask, at), adv),
        cu_seqlens=cu,
        **{k: flat(v, at) for k, v in kwargs.items()},
    )
    torch.testing.assert_close(packed[0], padded[0], rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(packed[1], flat(padded[1], at), rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(packed[2], padded[2], rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(packed[3], padded[3], rtol=1e-5, atol=1e-8)
    assert float(packed[2].abs().sum()) > 0


def test_packing_by_hand():
    packing = packing_of(torch.tensor([0, 2, 2, 5]), 5, 3, "cpu")
    assert packing.shape == (3, 3)
    assert packing.rows.tolist() == [0, 0, 2, 2, 2] and packing.positions.tolist() == [0, 1, 0, 1, 2]
    assert packing.index().tolist() == [[0, 1, 0], [0, 0, 0], [2, 3, 4]]


@pytest.mark.parametrize(
    "change,match",
    [
        ({"cu_seqlens": torch.tensor([0, 3, 9])}, r"cu_seqlens has 3 offsets but advantages has N = 4"),
        ({"cu_seqlens": torch.tensor([0, 3, 2, 6, 9])}, r"never decrease and end at T = 10"),
        ({"cu_seqlens": torch.tensor([0.0, 3, 6, 9, 10])}, r"integer offsets"),
        ({"completion_ids": torch.zeros(10, 1, dtype=torch.long)}, r"completion_ids must be \[T\] = \(10,\)"),
        ({"old_logprobs": torch.zeros(4, 3)}, r"old_logprobs must be \[T\]"),
        ({"logits": torch.zeros(1, 10, 7)}, r"logits must be 2-D \[T, \*\]"),
    ],
    ids=["offsets-vs-advantages", "decreasing", "float-offsets", "ids-shape", "old-shape", "logits-3d"],
)
def test_bad_packed_input_names_the_argument(change, match):
    inputs = {
        "logits": torch.randn(10, 7),
        "completion_ids": torch.randint(0, 7, (10,)),
        "completion_mask": torch.ones(10),
        "advantages": torch.randn(4),
        "cu_seqlens": torch.tensor([0, 3, 6, 9, 10]),
    }
    inputs.update(change)
    with pytest.raises(ValueError, match=match):
        gtpo_loss(**inputs, group_size=2)
