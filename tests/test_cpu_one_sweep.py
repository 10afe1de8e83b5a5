"""The C++ forward's one-sweep path against float64.

``token_stats_forward`` walks a row in blocks of 1024 values. After the first block, a block whose values all lie
below the running max is summed in one sweep (its own max taken in the same sweep, ``exp`` as ``2^x`` with a
degree-5 polynomial); a block that reaches the running max, or holds a NaN, is done again by the two-sweep path.
These rows are built so that each way through a row runs: the max in the first block (every later block takes the
one sweep), a max that rises block by block (every block falls back), a tie with the max, banned tokens (-inf) and
a NaN in later blocks, temperatures other than 1, and a vocabulary that is no multiple of the vector width.
"""

import math

import pytest
import torch

from gtpo_kernels.backends import cpu_backend

VOCAB = 5 * 1024 + 37  # five full blocks and a tail that no vector width divides
TOKENS = 6


def _rows(kind: str, seed: int) -> torch.Tensor:
    """float32 logits ``[2, TOKENS, VOCAB]`` of one kind."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(2, TOKENS, VOCAB, generator=g) * 3
    if kind == "max_first":  # every block after the first lies below the running max
        z[..., 17] = z.amax(-1) + 4
    elif kind == "rising":  # each block's max passes the last one: every block falls back to two sweeps
        z += torch.arange(VOCAB) / 1024 * 12
    elif kind == "tie_later":  # the max again, exactly, in the fourth block
        z[..., 17] = z.amax(-1) + 4
        z[..., 3 * 1024 + 5] = z[..., 17]
    elif kind == "banned_later":  # banned tokens in later blocks, whole blocks of them and scattered ones
        z[..., 17] = z.amax(-1) + 4
        z[..., 1024:2048] = float("-inf")
        z[..., 2500::7] = float("-inf")
    elif kind == "confident":  # p(max) = 1 - 1e-9 or so: log p lives in s = 1 + delta
        z[..., 17] = z.amax(-1) + 30
    return z


def _oracle(z: torch.Tensor, inv_t: torch.Tensor):
    """float64 ``(max, lse, log p of every token, entropy)`` of softmax(z * inv_t)."""
    u = z.double() * inv_t.double()[..., None]
    log_p = u.log_softmax(-1)
    p = log_p.exp()
    entropy = -(p * torch.where(p > 0, log_p, torch.zeros_like(log_p))).sum(-1)
    return z.amax(-1), u.logsumexp(-1), log_p, entropy


KINDS = ["max_first", "rising", "tie_later", "banned_later", "confident"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("temperature", ["1", "0.7", "per-token"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.cpu_kernels
def test_forward_against_float64(kind, temperature, dtype):
    z = _rows(kind, seed=KINDS.index(kind)).to(dtype)
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, VOCAB, (2, TOKENS), generator=g)
    ids[:, 0] = 17  # the planted max (where there is one): a confident token's log-prob
    ids[z.gather(-1, ids[..., None])[..., 0] == float("-inf")] = 17  # a sampled token is never a banned one
    valid = torch.ones(2, TOKENS, dtype=torch.bool)
    valid[1, -1] = False
    if temperature == "per-token":
        temp = 0.5 + torch.rand(2, TOKENS, generator=g)
    else:
        temp = torch.full((2, TOKENS), float(temperature))
    given = temp if temperature == "per-token" else float(temperature)  # one float, or each token's
    row_max, log_s, logp, entropy = cpu_backend.forward(z, ids, valid, given)
    ref_max, ref_lse, ref_log_p, ref_entropy = _oracle(z.float(), 1 / temp)
    ref_logp = ref_log_p.gather(-1, ids[..., None])[..., 0]
    on = valid
    # The row's max is returned exactly (the shift that log_s is relative to; the backward reads both).
    assert torch.equal(row_max[on], ref_max[on])
    lse = row_max.double() / temp.double() + log_s.double()
    assert (lse - ref_lse)[on].abs().max() <= 1e-5
    assert (logp.double() - ref_logp)[on].abs().max() <= 1e-5
    assert (entropy.double() - ref_entropy)[on].abs().max() <= 1e-5
    assert torch.equal(logp[~on], torch.zeros_like(logp[~on]))
    if kind == "confident":  # 1 - p of the planted max, to a relative 1e-3 (a float32 sum of 1 + tiny loses it)
        one_minus_p = -torch.expm1(logp.double()[:, 0])
        # The others' probabilities summed: float64's log p of the max itself (u - lse) cancels to 1e-14.
        others = ref_log_p[:, 0].exp()
        others[..., 17] = 0
        ref_one_minus_p = others.sum(-1)
        assert ((one_minus_p - ref_one_minus_p).abs() / ref_one_minus_p).max() <= 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.cpu_kernels
def test_a_nan_in_a_later_block_is_not_lost(dtype):
    # The kernel's contract for a NaN logit (the callers check the logits first): that token's outputs are not
    # finite. A one-sweep block that held the NaN and let its sums stay finite would return a wrong number.
    z = _rows("max_first", seed=5).to(dtype)
    z[0, 2, 3 * 1024 + 9] = float("nan")
    ids = torch.zeros(2, TOKENS, dtype=torch.long)
    valid = torch.ones(2, TOKENS, dtype=torch.bool)
    _, log_s, logp, entropy = cpu_backend.forward(z, ids, valid, 1.0)
    assert not math.isfinite(logp[0, 2]) and not math.isfinite(entropy[0, 2]) and not math.isfinite(log_s[0, 2])
    finite = torch.ones(2, TOKENS, dtype=torch.bool)
    finite[0, 2] = False
    assert torch.isfinite(logp[finite]).all() and torch.isfinite(entropy[finite]).all()
