"""Batches cut across calls (ranks, micro-batches, shuffled slices through prompt groups): with the conflict
weights of whole groups and the whole batch's counts, the calls' losses and gradients add up to the whole
batch's, and their metrics merge to the whole batch's (docs/method.md, "Batches split across calls")."""

import itertools
import math

import pytest
import torch

from gtpo_kernels import GTPOConfig, GTPOMetrics, conflict_weights, fused_linear_gtpo_loss, gtpo_loss
from gtpo_kernels.config import PRESETS, REDUCTIONS
from gtpo_kernels.reference import token_logprobs_and_entropy

from .helpers import random_batch

G = 4


def batch(seed=0):
    """float64: 3 groups of 4, L = 6, V = 23; old and reference log-probs near the policy's (clipping and
    KL active); hidden states and a weight for the fused entry point."""
    g = torch.Generator().manual_seed(seed)
    n, length, hidden_size, vocab = 12, 6, 8, 23
    hidden = torch.randn(n, length, hidden_size, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, hidden_size, generator=g, dtype=torch.float64)
    _, ids, mask, adv = random_batch(3, G, length, vocab, dtype=torch.float64, seed=seed)
    logits = hidden @ weight.T
    logp, _ = token_logprobs_and_entropy(logits, torch.where(mask, ids, 0))
    old = logp + 0.3 * torch.randn(logp.shape, generator=g, dtype=torch.float64)
    ref = logp + 0.3 * torch.randn(logp.shape, generator=g, dtype=torch.float64)
    return hidden, weight, ids, mask, adv, old, ref


def partition(n, parts, seed):
    """A shuffled partition of the rows into ``parts`` calls of different sizes (cutting through groups)."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    cuts = sorted(torch.randperm(n - 1, generator=torch.Generator().manual_seed(seed + 1))[: parts - 1].add(1).tolist())
    return [order[a:b] for a, b in zip([0, *cuts], [*cuts, n])]


def run(entry, leaves, ids, mask, adv, old, ref, config, rows=None, **kwargs):
    """One call of an entry point on ``rows`` (all by default); ``leaves`` accumulate the gradient."""
    rows = torch.arange(ids.shape[0]) if rows is None else rows
    common = dict(config=config, old_logprobs=old[rows], ref_logprobs=ref[rows], backend="torch", **kwargs)
    if entry == "logits":
        hidden, weight = leaves
        return gtpo_loss(hidden[rows] @ weight.T, ids[rows], mask[rows], adv[rows], **common)
    hidden, weight = leaves
    return fused_linear_gtpo_loss(hidden[rows], weight, ids[rows], mask[rows], adv[rows], **common)


def run_parts(entry, leaves, ids, mask, adv, old, ref, config, parts, sampled=None):
    """One call per part of the rows (conflict weights of whole groups, the whole batch's counts), each backward
    into ``leaves``; returns the calls' summed loss and their metrics."""
    lambda_, n_conflict = conflict_weights(ids, mask, adv, G, config.conflict_weight)
    total, metrics = 0.0, []
    for rows in parts:
        out = run(
            entry,
            leaves,
            ids,
            mask,
            adv,
            old,
            ref,
            config,
            rows=rows,
            conflict=(lambda_[rows], n_conflict[rows]),
            sampling_logprobs=None if sampled is None else sampled[rows],
            num_sequences=ids.shape[0],
            num_tokens=int(mask.sum()),
        )
        out.loss.backward()
        total = total + out.loss.detach()
        metrics.append(out.metrics)
    return total, metrics


@pytest.mark.parametrize("entry", ["logits", "fused"])
@pytest.mark.parametrize("preset, reduction", list(itertools.product(PRESETS, REDUCTIONS)))
def test_any_partition_adds_up_to_the_whole_batch(entry, preset, reduction):
    hidden, weight, ids, mask, adv, old, ref = batch(seed=PRESETS.index(preset))
    config = GTPOConfig(
        preset=preset,
        loss_reduction=reduction,
        kl_beta=0.05,
        clip_eps_low=0.2,
        clip_eps_high=0.28,
        max_completion_length=8 if reduction == "dr_grpo" else None,
    )
    leaves = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
    whole = run(entry, leaves, ids, mask, adv, old, ref, config, group_size=G)
    whole.loss.backward()
    expected_grads = [leaf.grad.clone() for leaf in leaves]

    # The conflict weights are computed once, on whole groups (at rollout time), then sliced like the rows.
    for seed in range(2):
        parts = partition(ids.shape[0], 3, seed)
        assert any(len(set((p // G).tolist())) < len(p) or len(p) % G for p in parts)  # groups are cut
        leaves = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
        total, metrics = run_parts(entry, leaves, ids, mask, adv, old, ref, config, parts)
        torch.testing.assert_close(total, whole.loss.detach(), rtol=1e-10, atol=1e-14)
        for leaf, expected in zip(leaves, expected_grads):
            torch.testing.assert_close(leaf.grad, expected, rtol=1e-10, atol=1e-14)
        merged = GTPOMetrics.merge(metrics)
        for name, value in whole.metrics.to_dict().items():
            if name != "completion_entropy":
                assert merged.to_dict()[name] == pytest.approx(value, rel=1e-10, abs=1e-14), name
        order = torch.cat(parts)
        torch.testing.assert_close(merged.completion_entropy, whole.metrics.completion_entropy[order])


def test_metrics_merge_across_processes_through_sums():
    """What a data-parallel trainer does: all-reduce (sum) each rank's `to_sums()`, rebuild with `from_sums`."""
    hidden, weight, ids, mask, adv, old, ref = batch(seed=3)
    config = GTPOConfig(kl_beta=0.05)
    leaves = [hidden, weight]
    whole = run("logits", leaves, ids, mask, adv, old, ref, config, group_size=G)
    lambda_, n_conflict = conflict_weights(ids, mask, adv, G)
    sums = sum(
        run(
            "logits", leaves, ids, mask, adv, old, ref, config, rows=rows, conflict=(lambda_[rows], n_conflict[rows])
        ).metrics.to_sums()
        for rows in partition(12, 4, seed=5)
    )
    reduced = GTPOMetrics.from_sums(sums, parts=4)
    assert reduced.completion_entropy is None
    for name, value in whole.metrics.to_dict().items():
        if name != "completion_entropy":
            assert reduced.to_dict()[name] == pytest.approx(value, rel=1e-10), name


def test_conflict_weights_instead_of_group_size():
    hidden, weight, ids, mask, adv, old, ref = batch(seed=4)
    logits = hidden @ weight.T
    config = GTPOConfig(entropy_threshold=math.inf)  # no filter: these logits' entropies are all above ln 2
    with pytest.raises(ValueError, match="pass group_size=G with whole groups, or conflict=conflict_weights"):
        gtpo_loss(logits, ids, mask, adv, config=config)
    with pytest.raises(ValueError, match="pass conflict=conflict_weights"):
        gtpo_loss(logits[:6], ids[:6], mask[:6], adv[:6], group_size=G, config=config)  # a cut group
    conflict = conflict_weights(ids, mask, adv, G)
    a = gtpo_loss(logits, ids, mask, adv, conflict=conflict, config=config).loss
    b = gtpo_loss(logits, ids, mask, adv, group_size=G, config=config).loss
    assert torch.equal(a, b) and float(a.detach()) != 0
    # Without conflict weights in the config, conflict and group_size are ignored (no need to divide N).
    grpo = GTPOConfig(preset="grpo")
    garbage = (torch.full_like(conflict[0], 7.0), conflict[1])
    c = gtpo_loss(logits[:6], ids[:6], mask[:6], adv[:6], config=grpo, conflict=garbage, group_size=G).loss
    d = gtpo_loss(logits[:6], ids[:6], mask[:6], adv[:6], config=grpo).loss
    assert torch.equal(c, d)


@pytest.mark.parametrize(
    "bad, match",
    [
        ((torch.ones(12, 6),), "conflict must be the pair"),
        ((torch.ones(12, 5), torch.zeros(12, dtype=torch.long)), r"conflict\[0\] \(lambda_\) must have shape"),
        ((torch.ones(12, 6), torch.zeros(12)), r"conflict\[1\] \(n_conflict\) must be an integer tensor"),
        ((torch.full((12, 6), float("nan")), torch.zeros(12, dtype=torch.long)), "must be finite and >= 0"),
    ],
)
def test_bad_conflict_argument(bad, match):
    hidden, weight, ids, mask, adv, _, _ = batch()
    with pytest.raises(ValueError, match=match):
        gtpo_loss(hidden @ weight.T, ids, mask, adv, conflict=bad)


def test_whole_batch_counts_are_checked():
    hidden, weight, ids, mask, adv, _, _ = batch()
    logits = hidden @ weight.T
    with pytest.raises(ValueError, match=r"num_sequences = 5 is less than this call's own count \(12\)"):
        gtpo_loss(logits, ids, mask, adv, group_size=G, num_sequences=5)
    with pytest.raises(ValueError, match="num_tokens = 0 must be a finite number > 0"):
        gtpo_loss(logits, ids, mask, adv, group_size=G, num_tokens=0)
    with pytest.raises(ValueError, match="num_tokens = nan must be a finite number > 0"):
        gtpo_loss(logits, ids, mask, adv, group_size=G, num_tokens=torch.tensor(float("nan")))
    # A share smaller than the call's own tokens is legitimate (DDP: the whole batch's count / processes).
    gtpo_loss(logits, ids, mask, adv, group_size=G, num_tokens=3, config=GTPOConfig(warn_no_signal=False))
    with pytest.raises(ValueError, match="num_tokens must be a number"):
        gtpo_loss(logits, ids, mask, adv, group_size=G, num_tokens="all")
    # Tensors are accepted (an all-reduced count), and give the same loss as the int.
    config = GTPOConfig(loss_reduction="token_mean", entropy_threshold=math.inf)  # these logits: all above ln 2
    a = gtpo_loss(logits, ids, mask, adv, group_size=G, config=config, num_tokens=torch.tensor(100)).loss
    b = gtpo_loss(logits, ids, mask, adv, group_size=G, config=config, num_tokens=100).loss
    assert torch.equal(a, b) and float(a) != 0


def test_dr_grpo_with_max_completion_length_by_hand():
    """grpo preset, on-policy (ratio 1): per-token loss -A. Rows of lengths 2 and 1, A = [1, -1], L = 3:
    the tokens sum to -1 * 2 + 1 * 1 = -1. dr_grpo divides by N * L = 6, or with the generation cap 8
    by N * 8 = 16 (TRL's and Liger's convention), whatever the padding."""
    logits = torch.randn(2, 3, 5, dtype=torch.float64)
    ids = torch.tensor([[1, 2, 0], [3, 0, 0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    plain = GTPOConfig(preset="grpo", loss_reduction="dr_grpo")
    capped = GTPOConfig(preset="grpo", loss_reduction="dr_grpo", max_completion_length=8)
    assert float(gtpo_loss(logits, ids, mask, adv, config=plain).loss) == pytest.approx(-1 / 6)
    assert float(gtpo_loss(logits, ids, mask, adv, config=capped).loss) == pytest.approx(-1 / 16)
    # The same with more padding: the capped loss does not move.
    padded = torch.cat([logits, torch.randn(2, 4, 5, dtype=torch.float64)], dim=1)
    ids_p = torch.cat([ids, torch.zeros(2, 4, dtype=torch.long)], dim=1)
    mask_p = torch.cat([mask, torch.zeros(2, 4, dtype=torch.bool)], dim=1)
    assert float(gtpo_loss(padded, ids_p, mask_p, adv, config=capped).loss) == pytest.approx(-1 / 16)


@pytest.mark.parametrize("entry", ["logits", "fused"])
def test_dr_grpo_slices_need_the_generation_cap(entry):
    """Without max_completion_length each call would divide by its own padded length: two trimmed slices gave
    0.0625 where the whole batch gives 0.0208. A call that holds a slice (num_sequences given) is refused."""
    hidden, weight, ids, mask, adv, old, ref = batch()
    config = GTPOConfig(preset="grpo", loss_reduction="dr_grpo")
    leaves = [hidden, weight]
    run(entry, leaves, ids, mask, adv, old, ref, config)  # a whole batch: its own L is the batch's
    with pytest.raises(ValueError, match="dr_grpo.*max_completion_length"):
        run(entry, leaves, ids, mask, adv, old, ref, config, rows=torch.arange(4), num_sequences=ids.shape[0])


@pytest.mark.parametrize("entry", ["logits", "fused"])
@pytest.mark.parametrize(
    "knobs",
    [
        dict(sampling_correction="sequence_mask", sampling_ratio_max=1.5, off_policy_mask_threshold=0.02),
        dict(importance_sampling_level="sequence", ratio_function="sapo", kl_ratio_weighted=True, entropy_bonus=0.1),
        dict(ratio_function="cispo", cispo_ratio_max=1.1, sampling_correction="token_truncate", entropy_bonus=0.05),
    ],
    ids=["sampler+opsm", "gspo+sapo+bonus", "cispo+sampler+bonus"],
)
def test_trls_terms_add_up_across_slices(entry, knobs):
    """The terms of TRL's loss types (docs/method.md) on a paper-preset batch cut through its groups: the slices'
    losses and gradients add up to the whole batch's, in float64."""
    hidden, weight, ids, mask, adv, old, ref = batch(seed=5)
    sampled = old + 0.2 * torch.randn(old.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    config = GTPOConfig(preset="paper", entropy_threshold=None, kl_beta=0.05, **knobs)
    reads = config.sampling_correction is not None or config.off_policy_mask_threshold is not None
    sampled = sampled if reads else None
    leaves = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
    whole = run(entry, leaves, ids, mask, adv, old, ref, config, group_size=G, sampling_logprobs=sampled)
    whole.loss.backward()
    expected = [leaf.grad.clone() for leaf in leaves]
    leaves = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
    parts = partition(ids.shape[0], 3, seed=1)
    total, _ = run_parts(entry, leaves, ids, mask, adv, old, ref, config, parts, sampled=sampled)
    assert whole.loss.abs() > 0
    torch.testing.assert_close(total, whole.loss.detach(), rtol=1e-10, atol=1e-14)
    for leaf, grad in zip(leaves, expected):
        torch.testing.assert_close(leaf.grad, grad, rtol=1e-10, atol=1e-14)
