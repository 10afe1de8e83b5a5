"""Masks with holes: a masked position inside a completion (a tool's output, which the policy did not
sample) takes no part in the loss, the entropy means or the token counts; the conflict runs are those of
the completion as generated, holes included. Every backend and both entry points against the float64
reference, which implements the rule independently (loops over the unmasked positions)."""

import pytest
import torch

from gtpo_kernels import GTPOConfig, conflict_weights, fused_linear_gtpo_loss, gtpo_loss
from gtpo_kernels.backends import registered
from gtpo_kernels.reference import reference_gtpo_loss

from .helpers import RTOL, assert_close_per_entry, assert_rel_close, device_for, random_batch

G = 3


def with_holes(mask: torch.Tensor, seed: int) -> torch.Tensor:
    """Masks some positions strictly inside each completion (never its first or last token)."""
    g = torch.Generator().manual_seed(seed)
    holes = mask.clone()
    lengths = mask.sum(dim=1)
    for i in range(mask.shape[0]):
        for t in range(1, int(lengths[i]) - 1):
            if torch.rand((), generator=g) < 0.4:
                holes[i, t] = False
    assert (holes != mask).any()
    return holes


def test_conflict_runs_are_those_of_the_completion_as_generated():
    # Rows 0 (A > 0) and 1 (A < 0) share "5 6 7" at the start; row 0's position 1 is a tool's output.
    ids = torch.tensor([[5, 6, 7, 1], [5, 6, 7, 2], [9, 9, 9, 9]])
    mask = torch.ones(3, 4, dtype=torch.bool)
    holes = mask.clone()
    holes[0, 1] = False
    adv = torch.tensor([1.0, -1.0, 0.0])
    lam, n = conflict_weights(ids, holes, adv, 3)
    assert lam.tolist() == [[2, 2, 2, 1], [0, 0, 0, 1], [1, 1, 1, 1]]
    assert n.tolist() == [3, 3, 0]
    assert torch.equal(lam, conflict_weights(ids, mask, adv, 3)[0])


@pytest.mark.parametrize("entry", ["logits", "fused_linear"])
@pytest.mark.parametrize("backend", registered())
@pytest.mark.parametrize(
    "config",
    [GTPOConfig(), GTPOConfig(preset="official"), GTPOConfig(preset="grpo", loss_reduction="token_mean")],
    ids=["paper", "official", "grpo-token_mean"],
)
def test_holes_against_the_float64_reference(entry, backend, config):
    _, ids, mask, adv = random_batch(2, G, 7, 29, seed=5, min_len=3, sharpness=8.0)
    holes = with_holes(mask, seed=5)
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(*ids.shape, 8, generator=g, dtype=torch.float64)
    weight = 2 * torch.randn(29, 8, generator=g, dtype=torch.float64)
    h64 = hidden.clone().requires_grad_()
    ref = reference_gtpo_loss(
        h64 @ weight.T, ids, holes, adv.double(), group_size=G, config=config, initial_entropy=0.1
    )
    ref.loss.backward()
    dev = device_for(backend)
    h = hidden.float().to(dev).requires_grad_()
    w = weight.float().to(dev)
    if entry == "logits":
        out = gtpo_loss(
            h @ w.T,
            ids.to(dev),
            holes.to(dev),
            adv.to(dev),
            group_size=G,
            config=config,
            initial_entropy=0.1,
            backend=backend,
        )
    else:
        out = fused_linear_gtpo_loss(
            h,
            w,
            ids.to(dev),
            holes.to(dev),
            adv.to(dev),
            group_size=G,
            config=config,
            initial_entropy=0.1,
            backend=backend,
        )
    out.loss.backward()
    assert h64.grad.abs().max() > 0
    rtol = 10 * RTOL[torch.float32]  # the float32 GEMM's rounding of the logits, against float64's
    assert_rel_close(out.loss.detach().cpu(), ref.loss.detach(), rtol, "loss", atol=1e-7)
    assert_close_per_entry(h.grad.cpu(), h64.grad, rtol, "d hidden", atol=1e-7)
    assert_rel_close(out.metrics.completion_entropy.cpu(), ref.metrics.completion_entropy, rtol, "Hbar")
    assert float(out.metrics.num_tokens) == float(holes.sum())
    # The holes changed the loss: they are not read as part of the completions.
    full = reference_gtpo_loss(
        hidden @ weight.T, ids, mask, adv.double(), group_size=G, config=config, initial_entropy=0.1
    )
    assert abs(float(full.loss) - float(ref.loss.detach())) > 1e-6
