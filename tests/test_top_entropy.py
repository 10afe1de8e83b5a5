"""TRL's top-entropy token mask (``GTPOConfig.top_entropy_quantile``) by hand: which tokens the policy term keeps,
the entropy bonus over the same tokens, the threshold as torch.quantile computes it (without its size limit),
and the same mask on both entry points. Against the float64 oracle on every backend: tests/test_parity.py and
tests/test_fused_linear.py ("top_entropy" configs); against GRPOTrainer: tests/test_trl.py."""

import pytest
import torch

from gtpo_kernels import GTPOConfig
from gtpo_kernels.objective import _quantile, entropy_floor, loss_from_token_stats
from gtpo_kernels.rows import LossRows


def rows_of(valid, advantages):
    ids = torch.zeros(valid.shape, dtype=torch.long)
    return LossRows(ids, valid, advantages)


def test_policy_term_on_the_tokens_at_or_above_the_quantile_by_hand():
    """One completion of 4 tokens, entropies 0.1, 0.5, 0.9, 1.3, rho = 0.5: the median 0.7 keeps the last two.
    grpo preset (sequence mean), on-policy (ratio 1), advantage 2: loss = -2 * 2 / 4, dloss/dlogp = -2/4 on the
    kept tokens, 0 on the others; the entropy bonus 0.1 averages over the kept two: -0.1 * (0.9 + 1.3) / 2."""
    entropy = torch.tensor([[0.1, 0.5, 0.9, 1.3]], dtype=torch.float64, requires_grad=True)
    logp = torch.tensor([[-0.2, -1.0, -0.5, -2.0]], dtype=torch.float64, requires_grad=True)
    rows = rows_of(torch.ones(1, 4, dtype=torch.bool), torch.tensor([2.0], dtype=torch.float64))
    config = GTPOConfig(preset="grpo", normalize_advantages_by_std=False, top_entropy_quantile=0.5, entropy_bonus=0.1)
    out = loss_from_token_stats(logp, entropy, rows, config)
    out.loss.backward()
    assert float(out.loss) == pytest.approx(-2 * 2 / 4 - 0.1 * (0.9 + 1.3) / 2, rel=1e-12)
    assert logp.grad[0].tolist() == pytest.approx([0.0, 0.0, -0.5, -0.5], rel=1e-12)
    assert entropy.grad[0].tolist() == pytest.approx([0.0, 0.0, -0.05, -0.05], rel=1e-12)


def test_quantile_counts_unmasked_tokens_only_and_interpolates_as_torch():
    g = torch.Generator().manual_seed(0)
    entropy = torch.rand(5, 7, generator=g, dtype=torch.float64)
    valid = torch.rand(5, 7, generator=g) < 0.6
    for rho in (0.2, 0.5, 0.8, 0.999):
        threshold, share = entropy_floor(entropy, valid, GTPOConfig(top_entropy_quantile=rho))
        assert float(threshold) == float(torch.quantile(entropy[valid], 1 - rho))
        assert float(share) == pytest.approx(float((entropy[valid] >= threshold).double().mean()))
    values = torch.tensor([float("nan"), 3.0, 1.0, float("nan"), 2.0])
    assert float(_quantile(values, 0.25)) == float(torch.nanquantile(values, 0.25)) == 1.5
    assert float(_quantile(torch.full((3,), float("nan")), 0.5)) == float("inf")  # nothing unmasked: nothing kept
    assert entropy_floor(entropy, valid, GTPOConfig()) is None  # rho = 1: off


@pytest.mark.parametrize("rho", [0.0, 1.5, float("nan")])
def test_bad_quantile_is_refused(rho):
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        GTPOConfig(top_entropy_quantile=rho)


def test_folded_token_advantages_drop_the_low_entropy_tokens():
    """verl's path (`token_advantages`): the per-token advantage is 0 below the quantile, unchanged above."""
    from gtpo_kernels.objective import token_advantages

    entropy = torch.tensor([[0.1, 0.5, 0.9, 1.3], [0.2, 0.4, 0.0, 0.0]], dtype=torch.float64)
    valid = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    rows = rows_of(valid, torch.tensor([1.0, -1.0], dtype=torch.float64))
    config = GTPOConfig(preset="grpo", normalize_advantages_by_std=False, top_entropy_quantile=0.5)
    _, _, a = token_advantages(entropy, rows, config)
    # median of 0.1, 0.2, 0.4, 0.5, 0.9, 1.3 is 0.45: kept 0.5, 0.9, 1.3
    assert a.tolist() == [[0.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]
