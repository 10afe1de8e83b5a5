"""Each preset on one small batch whose loss is worked out by hand below.

The batch (B = 1 group of G = 3, L = 3, V = 4):

    row 0: ids [0, 0, 0], length 3, "sharp" logits [ln 27, 0, 0, 0] at every position
    row 1: ids [0, 0, 1], length 3, sharp logits
    row 2: ids [3, 3, -], length 2, uniform logits [0, 0, 0, 0]
    rewards [1, 0, 0] -> mean-centred advantages A = [2/3, -1/3, -1/3]

Sharp logits give p = [27, 1, 1, 1] / 30 = [0.9, 1/30, 1/30, 1/30], so
    H_s = -(0.9 ln 0.9 + 3 * (1/30) ln(1/30)) = 0.9 ln(10/9) + 0.1 ln 30 ~= 0.434946,
    logp(token 0) = ln 0.9, logp(token 1) = ln(1/30).
Uniform logits give H_u = ln 4 ~= 1.386294 and logp = -ln 4.

Conflicts (P = {0}, N = {1, 2}):
    forward: t0 and t1 hold token 0 in rows 0 and 1 -> conflict; t2 holds 0 vs 1 -> not.
             Row 2's token 3 is in no positive row -> no run.
    reverse: s=0 compares 0 (row 0), 1 (row 1), 3 (row 2) -> no run anywhere.
    lambda = [[2, 2, 1], [0, 0, 1], [1, 1, -]], n = [2, 2, 0].
Completion entropies Hbar = [H_s, H_s, H_u]; with tau = ln 2 or 0.7 row 2 is filtered (delta = 0).
"""

import math

import pytest
import torch

from gtpo_kernels import GTPOConfig, compute_advantages, gtpo_loss

H_S = 0.9 * math.log(10 / 9) + 0.1 * math.log(30)
H_U = math.log(4)
LOGP = [[math.log(0.9)] * 3, [math.log(0.9), math.log(0.9), math.log(1 / 30)], [-math.log(4)] * 2 + [0.0]]


def batch(dtype=torch.float64):
    sharp = torch.tensor([math.log(27), 0, 0, 0], dtype=dtype)
    uniform = torch.zeros(4, dtype=dtype)
    logits = torch.stack([sharp.expand(3, 4), sharp.expand(3, 4), uniform.expand(3, 4)]).clone()
    ids = torch.tensor([[0, 0, 0], [0, 0, 1], [3, 3, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    advantages = compute_advantages(torch.tensor([1.0, 0.0, 0.0], dtype=dtype), group_size=3)
    return logits, ids, mask, advantages


def loss_of(config, **kwargs):
    logits, ids, mask, adv = batch()
    return gtpo_loss(logits, ids, mask, adv, group_size=3, config=config, **kwargs)


def test_advantages_are_mean_centred():
    _, _, _, adv = batch()
    assert adv.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3])


def test_paper_preset():
    # A~ = [2/3 - 0.1 H_s, -1/3 - 0.1 H_s, 0] (row 2 filtered). On-policy rho = 1, per-token loss -lambda A~:
    # l0 = -(2+2+1)/3 A~0 = -(5/3) A~0,  l1 = -(0+0+1)/3 A~1 = -(1/3) A~1,  l2 = 0.
    # L = (l0 + l1 + l2) / 3 = (-10/9 + H_s/6 + 1/9 + H_s/30) / 3 = (-1 + 0.2 H_s) / 3.
    out = loss_of(GTPOConfig(preset="paper"))
    assert float(out.loss) == pytest.approx((-1 + 0.2 * H_S) / 3, rel=1e-12)
    m = out.metrics
    assert float(m.filtered_fraction) == pytest.approx(1 / 3)
    assert float(m.amplified_fraction) == pytest.approx(2 / 8)  # two tokens of row 0 out of 8
    assert float(m.skipped_fraction) == pytest.approx(2 / 8)
    assert m.completion_entropy.tolist() == pytest.approx([H_S, H_S, H_U])
    assert float(m.entropy) == pytest.approx((6 * H_S + 2 * H_U) / 8)
    assert float(m.ratio_mean) == pytest.approx(1.0)
    assert float(m.clip_fraction) == 0.0 and m.kl is None


def test_official_preset_divides_by_conflict_count():
    # tau = 0.7 filters row 2 as well; n = [2, 2, 0] -> divisors [2, 2, 1]; reduction is a sum:
    # L = l0/2 + l1/2 = (-1 + 0.2 H_s) / 2.
    out = loss_of(GTPOConfig(preset="official"))
    assert float(out.loss) == pytest.approx((-1 + 0.2 * H_S) / 2, rel=1e-12)


def test_grpo_preset_with_clipping():
    # No filter, gamma = 0, lambda = 1, clip to [0.8, 1.2]. old_logprobs put the ratio at
    # 1.5 on row 0 (a = 2/3 > 0: -min(1.5 a, 1.2 a) = -1.2 a = -0.8 per token),
    # 0.5 on row 1 (a = -1/3 < 0: -min(-1/6, 0.8 * -1/3) = 0.8/3 per token),
    # 1 on row 2 (on-policy value; a = -1/3: +1/3 per token). NaN at the masked slot is ignored.
    # L = (-0.8 + 0.8/3 + 1/3) / 3 = -0.2/3.
    old = torch.tensor(LOGP, dtype=torch.float64)
    old[0] -= math.log(1.5)
    old[1] += math.log(2.0)
    old[2, 2] = float("nan")
    out = loss_of(GTPOConfig(preset="grpo"), old_logprobs=old)
    assert float(out.loss) == pytest.approx(-0.2 / 3, rel=1e-10)
    assert float(out.metrics.clip_fraction) == pytest.approx(6 / 8)  # rows 0 and 1 fully clipped
    assert float(out.metrics.ratio_mean) == pytest.approx((3 * 1.5 + 3 * 0.5 + 2 * 1.0) / 8)
    assert float(out.metrics.filtered_fraction) == 0.0


def test_entropy_penalty_variant():
    # A~ = delta A = [2/3, -1/3, 0]; each completion adds gamma * Hbar_i (row 2 too: delta gates only
    # the policy term). l0 = -(5/3)(2/3) + 0.1 H_s, l1 = -(1/3)(-1/3) + 0.1 H_s, l2 = 0.1 H_u.
    # L = (-10/9 + 1/9 + 0.2 H_s + 0.1 H_u) / 3.
    out = loss_of(GTPOConfig(preset="paper", entropy_mode="penalty"))
    assert float(out.loss) == pytest.approx((-1 + 0.2 * H_S + 0.1 * H_U) / 3, rel=1e-12)


def test_initial_entropy_gate_turns_the_filter_off():
    # H_ini = 1.0 > ln 2: no filtering, so row 2 gets A~2 = -1/3 - 0.1 H_u and lambda = 1:
    # l2 = -A~2 = 1/3 + 0.1 H_u.  L = (-1 + 0.2 H_s + 1/3 + 0.1 H_u) / 3.
    out = loss_of(GTPOConfig(preset="paper"), initial_entropy=1.0)
    assert float(out.loss) == pytest.approx((-1 + 0.2 * H_S + 1 / 3 + 0.1 * H_U) / 3, rel=1e-12)
    assert float(out.metrics.filtered_fraction) == 0.0
    # Below tau the gate leaves the filter on: same as no initial entropy.
    low = loss_of(GTPOConfig(preset="paper"), initial_entropy=0.5)
    assert float(low.loss) == pytest.approx((-1 + 0.2 * H_S) / 3, rel=1e-12)
    # The official preset has no gate.
    official = loss_of(GTPOConfig(preset="official"), initial_entropy=1.0)
    assert float(official.loss) == pytest.approx((-1 + 0.2 * H_S) / 2, rel=1e-12)


def test_token_mean_and_dr_grpo_reductions():
    # Sum of per-token losses: 3 l0 + 3 l1 = -5 A~0 - A~1 = -10/3 + 0.5 H_s + 1/3 + 0.1 H_s = -3 + 0.6 H_s.
    total = -3 + 0.6 * H_S
    out = loss_of(GTPOConfig(preset="paper", loss_reduction="token_mean"))
    assert float(out.loss) == pytest.approx(total / 8, rel=1e-12)  # 8 unmasked tokens
    out = loss_of(GTPOConfig(preset="paper", loss_reduction="dr_grpo"))
    assert float(out.loss) == pytest.approx(total / 9, rel=1e-12)  # N * L = 9


def test_kl_term():
    # ref - logp = ln 2 everywhere -> k3 = 2 - ln 2 - 1 = 1 - ln 2 per token; beta = 0.1 adds
    # 0.1 (1 - ln 2) to every non-empty completion's mean, so 0.1 (1 - ln 2) to the mean over rows.
    k3 = 1 - math.log(2)
    ref = torch.tensor(LOGP, dtype=torch.float64) + math.log(2)
    out = loss_of(GTPOConfig(preset="paper", kl_beta=0.1), ref_logprobs=ref)
    assert float(out.loss) == pytest.approx((-1 + 0.2 * H_S) / 3 + 0.1 * k3, rel=1e-12)
    assert float(out.metrics.kl) == pytest.approx(k3, rel=1e-12)
    # beta = 0 reports the KL without adding it.
    out = loss_of(GTPOConfig(preset="paper"), ref_logprobs=ref)
    assert float(out.loss) == pytest.approx((-1 + 0.2 * H_S) / 3, rel=1e-12)
    assert float(out.metrics.kl) == pytest.approx(k3, rel=1e-12)


def test_std_normalised_advantages():
    # Rewards [1, 0, 0]: mean 1/3, unbiased std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3).
    adv = compute_advantages(torch.tensor([1.0, 0.0, 0.0, 5.0, 5.0, 5.0]), 3, normalize_std=True)
    s = math.sqrt(1 / 3) + 1e-4
    assert adv.tolist() == pytest.approx([2 / 3 / s, -1 / 3 / s, -1 / 3 / s, 0.0, 0.0, 0.0], rel=1e-6)
