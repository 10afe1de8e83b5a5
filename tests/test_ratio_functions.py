"""TRL's CISPO and SAPO policy terms (``GTPOConfig.ratio_function``) and its entropy bonus on one token worked by
hand, on every backend:
the loss value and its gradient with respect to the token's log-prob. (Against the float64 oracle on random
batches: tests/test_parity.py; the closed-form gradient: tests/test_compile.py; against GRPOTrainer:
tests/test_trl.py.)"""

import math

import pytest
import torch

from gtpo_kernels import GTPOConfig, gtpo_loss
from gtpo_kernels.backends import registered

from .helpers import device_for

V = 4
LOGP = -math.log(V)  # uniform logits


def one_token(backend, advantage, ratio, **knobs):
    """``(loss, d loss / d logp)`` of one token whose ratio to the old policy is ``ratio`` (token mean, no shaping)."""
    dev = device_for(backend)
    config = GTPOConfig(preset="grpo", normalize_advantages_by_std=False, loss_reduction="token_mean", **knobs)
    logits = torch.zeros(1, 1, V, device=dev, requires_grad=True)
    out = gtpo_loss(
        logits,
        torch.tensor([[2]], device=dev),
        torch.ones(1, 1, device=dev),
        torch.tensor([advantage], device=dev),
        config=config,
        old_logprobs=torch.tensor([[LOGP - math.log(ratio)]], device=dev),
        backend=backend,
    )
    out.loss.backward()
    # d loss / d z_y = c (1 - p_y) at the target with p_y = 1/V: c = grad / (1 - 1/V)
    return float(out.loss.detach()), float(logits.grad[0, 0, 2]) / (1 - 1 / V)


@pytest.mark.parametrize("backend", list(registered()))
def test_cispo_by_hand(backend):
    # rho = 2 capped at 1.5: loss -1.5 * a * logp, gradient -1.5 * a (the capped token still learns)
    loss, c = one_token(backend, 1.0, 2.0, ratio_function="cispo", cispo_ratio_max=1.5)
    assert loss == pytest.approx(-1.5 * LOGP, rel=1e-6) and c == pytest.approx(-1.5, rel=1e-5)
    loss, c = one_token(backend, -0.5, 0.8, ratio_function="cispo", cispo_ratio_max=1.5)  # below the cap: rho
    assert loss == pytest.approx(0.8 * 0.5 * LOGP, rel=1e-6) and c == pytest.approx(0.4, rel=1e-5)


@pytest.mark.parametrize("backend", list(registered()))
def test_sapo_by_hand(backend):
    sigmoid = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    # a > 0, tau = 0.5, rho = 2: loss -sigma(0.5) * 4 / 0.5, gradient -4 sigma(0.5)(1 - sigma(0.5)) * 2
    loss, c = one_token(backend, 1.0, 2.0, ratio_function="sapo", sapo_temperature_pos=0.5)
    s = sigmoid(0.5)
    assert loss == pytest.approx(-s * 8, rel=1e-6) and c == pytest.approx(-4 * s * (1 - s) * 2, rel=1e-5)
    # a < 0 takes the negative temperature: tau = 2, rho = 1 (on the old policy): the gradient is -a, as PPO's
    loss, c = one_token(backend, -1.0, 1.0, ratio_function="sapo", sapo_temperature_neg=2.0)
    assert loss == pytest.approx(0.5 * 4 / 2, rel=1e-6) and c == pytest.approx(1.0, rel=1e-5)


@pytest.mark.parametrize("backend", list(registered()))
def test_vespo_by_hand(backend):
    # One token, w = rho = 2: phi = exp(lambda + k log 2 - 2 lambda) = 4 e^-3 (k 2, lambda 3 for a >= 0); the
    # term is -phi a logp, its gradient -phi a. For a < 0 (k 3, lambda 2): phi = 8 e^-2.
    loss, c = one_token(backend, 1.0, 2.0, ratio_function="vespo")
    phi = 4 * math.exp(-3)
    assert loss == pytest.approx(-phi * LOGP, rel=1e-6) and c == pytest.approx(-phi, rel=1e-5)
    loss, c = one_token(backend, -0.5, 2.0, ratio_function="vespo")
    phi = 8 * math.exp(-2)
    assert loss == pytest.approx(0.5 * phi * LOGP, rel=1e-6) and c == pytest.approx(0.5 * phi, rel=1e-5)


def test_ppo_settings_are_refused_with_other_ratio_functions():
    with pytest.raises(ValueError, match="ratio_cap is PPO's two-sided clipping"):
        GTPOConfig(ratio_function="sapo", ratio_cap=1.5)
    with pytest.raises(ValueError, match="sapo_temperature_neg must be a finite number > 0"):
        GTPOConfig(ratio_function="sapo", sapo_temperature_neg=0.0)
    with pytest.raises(ValueError, match="ratio_function must be one of"):
        GTPOConfig(ratio_function="gpg")
    with pytest.raises(ValueError, match="with ratio_function='vespo' must be a token mode"):
        GTPOConfig(ratio_function="vespo", sampling_correction="sequence_mask")


@pytest.mark.parametrize("backend", list(registered()))
def test_entropy_bonus_by_hand(backend):
    """Uniform logits over V: H = log V on each token, whose gradient is 0 there; the bonus is -b log V whatever
    the reduction, beside the policy term (-a: on-policy, token mean)."""
    dev = device_for(backend)
    for reduction in ("token_mean", "sequence_mean", "sum"):
        config = GTPOConfig(
            preset="grpo", normalize_advantages_by_std=False, loss_reduction=reduction, entropy_bonus=0.3
        )
        out = gtpo_loss(
            torch.zeros(2, 3, V, device=dev),
            torch.zeros(2, 3, dtype=torch.long, device=dev),
            torch.tensor([[1, 1, 1], [1, 0, 0]], device=dev),
            torch.tensor([0.5, 0.5], device=dev),
            config=config,
            backend=backend,
            num_tokens=8,  # the whole batch's: 4 here
        )
        policy = {"token_mean": -0.5 * 4 / 8, "sequence_mean": -0.5, "sum": -1.0}[reduction]
        assert float(out.loss) == pytest.approx(policy - 0.3 * 4 * math.log(V) / 8, rel=1e-6), reduction


@pytest.mark.parametrize("backend", list(registered()))
def test_off_policy_mask_by_hand(backend):
    """Three one-token completions with uniform logits (logp = -log V), sampler log-probs 0.3 above the trainer's
    for the first two and 0.05 above for the third, threshold 0.1: the one pushed down (A < 0) and off-policy
    is dropped, the one pushed up stays, the one pushed down but close to the sampler stays."""
    dev = device_for(backend)
    config = GTPOConfig(
        preset="grpo", normalize_advantages_by_std=False, loss_reduction="sum", off_policy_mask_threshold=0.1
    )
    sampled = torch.tensor([[LOGP + 0.3], [LOGP + 0.3], [LOGP + 0.05]], device=dev)
    logits = torch.zeros(3, 1, V, device=dev, requires_grad=True)
    out = gtpo_loss(
        logits,
        torch.zeros(3, 1, dtype=torch.long, device=dev),
        torch.ones(3, 1, device=dev),
        torch.tensor([-1.0, 1.0, -1.0], device=dev),
        config=config,
        sampling_logprobs=sampled,
        backend=backend,
    )
    out.loss.backward()
    assert float(out.loss.detach()) == pytest.approx(0 - 1.0 + 1.0, abs=1e-6)  # -a per kept token, on-policy
    target_grad = logits.grad[:, 0, 0] / (1 - 1 / V)
    assert target_grad.tolist() == pytest.approx([0.0, -1.0, 1.0], abs=1e-5)
    assert float(out.metrics.signal_fraction) == pytest.approx(2 / 3)
