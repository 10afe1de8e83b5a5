"""Run under torchrun (gloo, CPU): the vocabulary-parallel losses on every rank against the whole-vocabulary
float64 oracle, which each rank computes itself from the whole logits (every rank draws the same batch).

    torchrun --nproc_per_node R tests/vocab_parallel_ranks.py OUT.json

Rank 0 writes ``{case: {"loss": err, "grad": err, ...}}``, each error the largest over the ranks (relative to
the oracle's largest entry), and the number of collectives each forward and backward ran. Cases: every
backend and dtype, each preset and reduction, temperature, uneven shards, a sliced batch, bad input.
"""

import dataclasses
import json
import os
import sys

if os.environ.get("GTPO_TEST_CUDA", "0") == "0":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import gtpo_kernels  # noqa: E402
from gtpo_kernels import GTPOConfig, GTPOMetrics, conflict_weights, fused_linear_gtpo_loss, gtpo_loss  # noqa: E402
from gtpo_kernels.backends import registered  # noqa: E402
from gtpo_kernels.fused_chunks import LogitTransform  # noqa: E402
from gtpo_kernels.reference import reference_gtpo_loss, token_logprobs_and_entropy  # noqa: E402
from gtpo_kernels.vocab_parallel import shard_sizes  # noqa: E402
from tests.helpers import loss_scale, random_batch  # noqa: E402

CONFIGS = {
    "paper": GTPOConfig(preset="paper"),
    "official": GTPOConfig(preset="official"),
    "grpo+kl": GTPOConfig(preset="grpo", kl_beta=0.05),
    "penalty+token_mean": GTPOConfig(preset="paper", entropy_mode="penalty", loss_reduction="token_mean"),
    "sum+bonus": GTPOConfig(preset="paper", loss_reduction="sum", entropy_bonus=0.05),
    "dr_grpo": GTPOConfig(preset="grpo", loss_reduction="dr_grpo", max_completion_length=5),
    "sequence_sum+sapo": GTPOConfig(preset="paper", loss_reduction="sequence_sum", ratio_function="sapo"),
}
NO_TRANSFORM = LogitTransform()  # a head whose logits are hidden @ W.T + b
SOFTCAP_SCALE = LogitTransform(scale=1.5, softcap=3.0)  # each shard caps its own logits (the logits spread ~6)


class Collectives:
    """Counts the all-gathers `gtpo_kernels.vocab_parallel` runs (its only collective)."""

    def __init__(self):
        self.count = 0
        self._gather = dist.all_gather_into_tensor

    def __enter__(self):
        def counted(*args, **kwargs):
            self.count += 1
            return self._gather(*args, **kwargs)

        dist.all_gather_into_tensor = counted
        return self

    def __exit__(self, *exc):
        dist.all_gather_into_tensor = self._gather


def shard_of(full: torch.Tensor, sizes, rank: int) -> torch.Tensor:
    start = sum(sizes[:rank])
    return full[..., start : start + sizes[rank]]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300)) if b.numel() else 0.0


def old_and_ref(logits64, ids, mask, temperature):
    logp64, _ = token_logprobs_and_entropy(logits64 / temperature, torch.where(mask.bool(), ids, 0))
    g = torch.Generator().manual_seed(11)
    old = logp64 + 0.3 * torch.randn(logp64.shape, generator=g, dtype=torch.float64)
    ref = logp64 + 0.5 * torch.randn(logp64.shape, generator=g, dtype=torch.float64)
    return old, ref


def shards_without_targets(ids, mask, sizes) -> float:
    """How many shards hold none of the batch's unmasked targets (the cases want 0: every shard's target path)."""
    from gtpo_kernels.vocab_parallel import VocabShards, target_owner

    owners = target_owner(ids[mask.bool()], VocabShards(tuple(sizes), 0))
    return float(sum(int((owners == r).sum()) == 0 for r in range(len(sizes))))


def one_case(rank, sizes, group, backend, dtype, config, *, temperature=1.0, seed=0, parts=1):
    """Errors of the sharded call(s) against the oracle: loss, this rank's gradient, logp-derived metrics."""
    vocab = sum(sizes)
    logits, ids, mask, adv = random_batch(2, 4, 5, vocab, dtype=dtype, seed=seed)
    logits64 = logits.double()
    old, ref = old_and_ref(logits64, ids, mask, temperature)
    x64 = logits64.clone().requires_grad_()
    kwargs = dict(old_logprobs=old, ref_logprobs=ref if config.kl_beta else None)
    oracle = reference_gtpo_loss(
        x64, ids, mask, adv.double(), group_size=4, config=config, temperature=temperature, **kwargs
    )
    oracle.loss.backward()

    shard = shard_of(logits, sizes, rank).clone().requires_grad_()
    cast = {
        k: None if v is None else v.to(torch.float64 if dtype == torch.float64 else torch.float32)
        for k, v in kwargs.items()
    }
    forward_count = backward_count = 0
    n = ids.shape[0]
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    lam, n_conflict = conflict_weights(ids, mask, adv, 4, config.conflict_weight)
    loss, metrics = 0.0, []
    for r0, r1 in zip(bounds, bounds[1:]):
        rows = slice(r0, r1)
        with Collectives() as forward:
            out = gtpo_loss(
                shard[rows],
                ids[rows],
                mask[rows],
                adv[rows],
                conflict=(lam[rows], n_conflict[rows]),
                config=config,
                temperature=temperature,
                backend=backend,
                vocab_group=group,
                num_sequences=n,
                num_tokens=int(mask.sum()),
                **{k: None if v is None else v[rows] for k, v in cast.items()},
            )
        with Collectives() as backward:
            out.loss.backward()
        forward_count += forward.count
        backward_count += backward.count
        loss = loss + out.loss.detach()
        metrics.append(out.metrics)
    entropy = GTPOMetrics.merge(metrics).entropy  # the slices' token-weighted entropies, as a trainer merges them
    grad = relative(shard.grad, shard_of(x64.grad, sizes, rank))
    return report(loss, entropy, oracle, grad, (forward_count / parts, backward_count), x64.grad, (ids, mask, sizes))


def report(loss, entropy, oracle, grad_error, collectives, oracle_grad, batch, terms=0.0):
    """A case's errors against the oracle, its collectives ``(forward, backward)``, whether the oracle's gradient is
    non-zero and how many shards hold none of ``batch = (ids, mask, sizes)``'s targets. The loss's error is
    relative to the loss or, where the loss is a difference of larger terms (``terms``, `helpers.loss_scale`), to
    their size."""
    return {
        "loss": float((loss.detach().double() - oracle.loss.detach()).abs())
        / max(float(oracle.loss.detach().abs()), terms, 1e-300),
        "grad": grad_error,
        "entropy": relative(entropy, oracle.metrics.entropy),
        "forward_collectives": collectives[0],
        "backward_collectives": collectives[1],
        "signal": float(oracle_grad.abs().sum() > 0),
        "shards_without_targets": shards_without_targets(*batch),
    }


def statistics_report(mine, logp, entropy, forward_collectives):
    """A no-grad statistics case: its log-probs' and entropies' errors against the oracle's, its collectives, and
    whether the oracle's values say anything (not all zero)."""
    return {
        "logp": relative(mine[0], logp),
        "entropy": relative(mine[1], entropy),
        "forward_collectives": forward_collectives,
        "nonzero": float(bool(logp.abs().sum() > 0 and entropy.abs().sum() > 0)),
    }


def fused_case(
    rank,
    sizes,
    group,
    backend,
    config,
    *,
    dtype=torch.float32,
    temperature=1.0,
    chunk_tokens=None,
    packed=False,
    seed=3,
    transform=NO_TRANSFORM,
):
    """`fused_linear_gtpo_loss` with this rank's rows of the head (weight and bias) against the oracle on the whole
    head's float64 logits (through the head's ``transform``, by autograd): loss, the shard's weight and bias
    gradients and the hidden states' (summed over the group, as a tensor-parallel framework does); optionally packed
    (``cu_seqlens``)."""
    vocab, hidden_size = sum(sizes), 16
    _, ids, mask, adv = random_batch(2, 4, 5, vocab, seed=seed)
    g = torch.Generator().manual_seed(seed)
    shapes = ((8, 5, hidden_size), (vocab, hidden_size), (vocab,))
    hidden, weight, bias = (torch.randn(s, generator=g, dtype=dtype) for s in shapes)
    weight = weight * 2.0  # confident rows: the entropy filter keeps some completions
    h64, w64, b64 = (t.detach().double().clone().requires_grad_() for t in (hidden, weight, bias))
    logits64 = transform(h64 @ w64.T + b64)
    old, ref = old_and_ref(logits64.detach(), ids, mask, temperature)
    kwargs = dict(old_logprobs=old, ref_logprobs=ref if config.kl_beta else None)
    oracle = reference_gtpo_loss(
        logits64, ids, mask, adv.double(), group_size=4, config=config, temperature=temperature, **kwargs
    )
    oracle.loss.backward()
    if chunk_tokens:
        config = dataclasses.replace(config, max_chunk_bytes=chunk_tokens * max(sizes) * 4)
    start = sum(sizes[:rank])
    h = hidden.clone().requires_grad_()
    w = weight[start : start + sizes[rank]].clone().requires_grad_()
    b = bias[start : start + sizes[rank]].clone().requires_grad_()
    per_token = {
        k: None if v is None else v.to(torch.float64 if dtype == torch.float64 else torch.float32)
        for k, v in kwargs.items()
    }
    rows = (ids, mask, adv)
    extra = {}
    if packed:  # each row's unmasked tokens, packed
        lengths = mask.sum(dim=1)
        at = mask.reshape(-1).nonzero().squeeze(1)
        extra["cu_seqlens"] = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        rows = (ids.reshape(-1)[at], mask.reshape(-1)[at], adv)
        per_token = {k: None if v is None else v.reshape(-1)[at] for k, v in per_token.items()}
        h = hidden.reshape(-1, hidden_size)[at].clone().requires_grad_()
    with Collectives() as forward:
        out = fused_linear_gtpo_loss(
            h,
            w,
            *rows,
            group_size=4,
            lm_head_bias=b,
            config=config,
            temperature=temperature,
            backend=backend,
            vocab_group=group,
            logit_scale=transform.scale,
            logit_softcap=transform.softcap,
            **per_token,
            **extra,
        )
    with Collectives() as backward:
        out.loss.backward()
    d_hidden = h.grad.clone()
    dist.all_reduce(d_hidden)
    want_hidden = h64.grad
    if packed:
        want_hidden = want_hidden.reshape(-1, hidden_size)[at]
    grad = max(
        relative(w.grad, w64.grad[start : start + sizes[rank]]),
        relative(b.grad, b64.grad[start : start + sizes[rank]]),
        relative(d_hidden, want_hidden),
    )
    counts = (forward.count, backward.count)
    # The walk's float32 GEMMs round the logits the float64 oracle has exact: ~1e-6 of the terms the loss sums.
    terms = loss_scale(
        logits64.detach(), ids, mask, adv.double(), config=config, temperature=temperature, group_size=4, **kwargs
    )
    return report(out.loss, out.metrics.entropy, oracle, grad, counts, w64.grad, (ids, mask, sizes), terms)


def packed_logits_case(rank, sizes, group, backend, dtype, config):
    """Packed ``[T, V_r]`` logits shards (``cu_seqlens``) against the oracle on the padded whole logits."""
    logits, ids, mask, adv = random_batch(2, 4, 5, sum(sizes), dtype=dtype, seed=4)
    x64 = logits.double().requires_grad_()
    oracle = reference_gtpo_loss(x64, ids, mask, adv.double(), group_size=4, config=config)
    oracle.loss.backward()
    at = mask.reshape(-1).nonzero().squeeze(1)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), mask.sum(dim=1).cumsum(0)])
    shard = shard_of(logits.reshape(-1, sum(sizes))[at], sizes, rank).clone().requires_grad_()
    with Collectives() as forward:
        out = gtpo_loss(
            shard,
            ids.reshape(-1)[at],
            mask.reshape(-1)[at],
            adv,
            group_size=4,
            config=config,
            backend=backend,
            vocab_group=group,
            cu_seqlens=cu,
        )
    with Collectives() as backward:
        out.loss.backward()
    want = shard_of(x64.grad.reshape(-1, sum(sizes))[at], sizes, rank)
    counts = (forward.count, backward.count)
    grad = relative(shard.grad, want)
    return report(out.loss, out.metrics.entropy, oracle, grad, counts, x64.grad, (ids, mask, sizes))


def bad_input(rank, sizes, group):
    """Each misuse's error message on this rank (the same on every rank, the test checks)."""
    vocab = sum(sizes)
    logits, ids, mask, adv = random_batch(1, 4, 3, vocab, seed=5)
    messages = {}
    cases = {
        "id outside the whole vocabulary": lambda: gtpo_loss(
            shard_of(logits, sizes, rank),
            ids.masked_fill(torch.arange(3) == 1, vocab),
            mask.fill_(1),
            adv,
            group_size=4,
            vocab_group=group,
        ),
        "rows differ across ranks": lambda: gtpo_loss(
            shard_of(logits, sizes, rank)[: 4 if rank == 0 else 2],
            ids[: 4 if rank == 0 else 2],
            mask[: 4 if rank == 0 else 2],
            adv[: 4 if rank == 0 else 2],
            group_size=2,
            vocab_group=group,
        ),
    }
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(4, 3, 8, generator=g), torch.randn(vocab, 8, generator=g)
    start = sum(sizes[:rank])
    cases["fused: id outside the whole vocabulary"] = lambda: fused_linear_gtpo_loss(
        hidden,
        weight[start : start + sizes[rank]],
        ids.masked_fill(torch.arange(3) == 2, -1),
        mask.fill_(1),
        adv,
        group_size=4,
        vocab_group=group,
    )
    for name, call in cases.items():
        try:
            call()
            messages[name] = None
        except ValueError as error:
            messages[name] = str(error)
    return messages


def main(out_path):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    results = {}
    even = shard_sizes(37, world)  # 37 columns: uneven on 2 and 3 ranks
    uneven = [5, 32] if world == 2 else [5, 20, 12]  # 37 columns too
    # Every backend and dtype, and every preset in float64, on 2 ranks; on 3, the C++ and torch backends in float32
    # and three presets (the suite's time: Triton runs interpreted here).
    dtypes = (torch.float32, torch.bfloat16, torch.float16) if world == 2 else (torch.float32,)
    backends = registered() if world == 2 else [b for b in registered() if b != "triton"]
    configs = CONFIGS if world == 2 else {k: CONFIGS[k] for k in ("paper", "penalty+token_mean", "sequence_sum+sapo")}
    for backend in backends:
        for dtype in dtypes:
            results[f"{backend}/{str(dtype)[6:]}/paper"] = one_case(rank, even, group, backend, dtype, CONFIGS["paper"])
    for name, config in configs.items():
        results[f"torch/float64/{name}"] = one_case(rank, even, group, "torch", torch.float64, config, seed=0)
    results["torch/float64/uneven+temperature"] = one_case(
        rank, uneven, group, "torch", torch.float64, CONFIGS["grpo+kl"], temperature=0.7, seed=2
    )
    results["cpu/float32/uneven+temperature"] = one_case(
        rank, uneven, group, "cpu", torch.float32, CONFIGS["official"], temperature=0.7, seed=2
    )
    results["torch/float64/sliced"] = one_case(rank, uneven, group, "torch", torch.float64, CONFIGS["paper"], parts=2)
    results["cpu/float32/sliced+token_mean"] = one_case(
        rank, even, group, "cpu", torch.float32, CONFIGS["penalty+token_mean"], parts=3
    )
    for backend in registered() if world == 2 else ("cpu",):
        results[f"{backend}/float32/fused/official"] = fused_case(rank, even, group, backend, CONFIGS["official"])
    for name in ("paper", "grpo+kl", "sum+bonus"):
        results[f"torch/float64/fused/{name}"] = fused_case(
            rank, uneven, group, "torch", CONFIGS[name], dtype=torch.float64
        )
    results["cpu/float32/fused/chunked+temperature"] = fused_case(
        rank, uneven, group, "cpu", CONFIGS["grpo+kl"], temperature=0.8, chunk_tokens=3
    )
    results["cpu/float32/fused/chunked+softcap+scale"] = fused_case(
        rank, uneven, group, "cpu", CONFIGS["grpo+kl"], temperature=0.8, chunk_tokens=6, transform=SOFTCAP_SCALE
    )
    results["cpu/float32/fused/packed+chunked"] = fused_case(
        rank, uneven, group, "cpu", CONFIGS["official"], chunk_tokens=4, packed=True
    )
    for backend in registered() if world == 2 else ("cpu",):
        results[f"{backend}/float32/packed/paper"] = packed_logits_case(
            rank, uneven, group, backend, torch.float32, CONFIGS["official"]
        )
    logits, ids, mask, _ = random_batch(2, 3, 4, 37, seed=9)
    logp, entropy = token_logprobs_and_entropy(logits.double(), ids)
    with Collectives() as forward:
        mine = gtpo_kernels.token_logprobs_and_entropy(shard_of(logits, uneven, rank), ids, vocab_group=group)
    results["auto/float32/token_logprobs_and_entropy"] = statistics_report(mine, logp, entropy, forward.count)
    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(6, 4, 16, generator=g), 2.0 * torch.randn(37, 16, generator=g)
    logp, entropy = token_logprobs_and_entropy((hidden @ weight.T).double(), ids)
    start = sum(uneven[:rank])
    with Collectives() as forward:  # chunks of 5 tokens
        mine = gtpo_kernels.fused_linear_token_logprobs_and_entropy(
            hidden, weight[start : start + uneven[rank]], ids, vocab_group=group, max_chunk_bytes=5 * 20 * 4
        )
    results["cpu/float32/fused_linear_token_logprobs_and_entropy/chunked"] = statistics_report(
        mine, logp, entropy, forward.count
    )
    worst = {}
    for case, errors in results.items():
        values = torch.tensor(list(errors.values()), dtype=torch.float64)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        worst[case] = dict(zip(errors, values.tolist()))
    messages = [None] * world
    dist.all_gather_object(messages, bad_input(rank, even, group))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"cases": worst, "bad_input": messages, "world": world}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
