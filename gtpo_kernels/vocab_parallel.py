"""Per-token statistics of logits sharded over the vocabulary (tensor parallelism: Megatron's
``ColumnParallelLinear`` output layer), without gathering the logits.

Each rank of ``vocab_group`` holds ``logits_shard [N, L, V_r]``, the columns ``[offset_r, offset_r + V_r)`` of
the whole vocabulary, shards in rank order (sizes may differ: ``V = 151936`` over 3 ranks). Each runs the
backend's kernels on its shard, which give, per token, the shard's ``row_max_r``, ``log_s_r`` (so
``lse_r = row_max_r / T + log_s_r``), entropy ``H_r`` and, where the target lies in the shard, ``logp_r``. One
all-gather of those four floats per token combines them on every rank (`combine_shard_stats`):

    lse = logsumexp_r lse_r,   w_r = exp(lse_r - lse)            (each shard's share of the probability)
    logp = logp_r* + log w_r*                                      (r*: the shard holding the target)
    H = sum_r w_r (H_r - log w_r)                                  (the mixture's entropy: no cancellation)

The backward is local: the gradient of a shard's logits is ``c (onehot - p) + e dH/dz`` on its own columns,
with the global ``p``, ``H`` and ``lse``, which the kernels' backward takes as they are (the target's entry is
written only by the shard that holds it). No collective: every rank computes the same loss from the same
statistics, so the incoming ``c`` and ``e`` agree.

Before the gather, a header of a few integers per rank (shard size, the rows' shape, the hidden size on the fused
path, the dtype) is gathered too, so that shards that do not line up give the same clear error on every rank
rather than a hang or a wrong answer: two collectives per forward (one of them a few dozen bytes per rank), none
backward.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}


@dataclass(frozen=True)
class VocabShards:
    """Where each rank's shard lies in the whole vocabulary: ``sizes[r]`` columns from ``offsets[r]``; ``rank``:
    this process's index in the group."""

    sizes: Tuple[int, ...]
    rank: int

    @property
    def offsets(self) -> Tuple[int, ...]:
        starts, total = [], 0
        for size in self.sizes:
            starts.append(total)
            total += size
        return tuple(starts)

    @property
    def vocab_size(self) -> int:
        return sum(self.sizes)

    @property
    def offset(self) -> int:
        return self.offsets[self.rank]


def all_gather_ranks(tensor: torch.Tensor, group) -> torch.Tensor:
    """``[R, *tensor.shape]``: every rank's ``tensor`` (the same shape on every rank), in rank order."""
    world = dist.get_world_size(group)
    out = tensor.new_empty((world * tensor.shape[0],) + tuple(tensor.shape[1:]))
    dist.all_gather_into_tensor(out, tensor.contiguous(), group=group)
    return out.view((world,) + tuple(tensor.shape))


# Process groups by name, for registered operators (whose schemas take no process group): `group_name` registers one,
# `group_named` gives it back inside the operator. Weak references: a group the caller has let go of (after
# destroy_process_group) must not outlive it here, or gloo's threads are torn down at interpreter exit, which aborts
# the process ("terminate called without an active exception", after the work was done).
_GROUPS: weakref.WeakValueDictionary[str, object] = weakref.WeakValueDictionary()


def group_name(group) -> Optional[str]:
    """A name a registered operator can take for ``group`` (``None`` for none); `group_named` reverses it."""
    if group is None:
        return None
    name = f"{type(group).__name__}@{id(group):x}"
    _GROUPS[name] = group
    return name


def group_named(name: Optional[str]):
    """The group `group_name` named (``None`` for none)."""
    return None if name is None else _GROUPS[name]


def quantile_gather(group) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """For ``top_entropy_quantile``'s threshold over ``group``'s processes (`objective.entropy_floor`'s ``gather``):
    ``values [n_r]`` -> every process's, each padded with NaN to the longest (one gather of the lengths, one of
    the values); ``None`` without a group."""
    if group is None:
        return None

    def gather(values: torch.Tensor) -> torch.Tensor:
        sizes = all_gather_ranks(torch.tensor([values.numel()], device=values.device), group)
        longest = int(sizes.max())
        padded = torch.cat([values, values.new_full((longest - values.numel(),), torch.nan)])
        return all_gather_ranks(padded, group).reshape(-1)

    return gather


def exchange_shards(
    group, vocab_local: int, rows: Tuple[int, ...], dtype: torch.dtype, device, what: str
) -> VocabShards:
    """The layout of ``group``'s shards, from one gather of each rank's ``[V_r, *rows, dtype]``; raises the same
    error on every rank when the ranks' rows (``N, L`` or ``T``) or dtypes differ or a shard is empty."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "vocab_group was given but torch.distributed is not initialised: call "
            "torch.distributed.init_process_group first (or leave vocab_group=None for whole-vocabulary logits)"
        )
    header = torch.tensor([vocab_local, *rows, _DTYPE_CODES.get(dtype, -1)], dtype=torch.int64)
    headers = all_gather_ranks(header.to(device)[None], group).view(-1, header.numel()).cpu().tolist()
    sizes = [h[0] for h in headers]
    if any(h[1:] != headers[0][1:] for h in headers):
        raise ValueError(
            f"vocab_group: every rank must pass the same rows of {what} with the same dtype, only the vocabulary "
            f"shard differing; got [rows..., dtype code] per rank {[h[1:] for h in headers]}"
        )
    if min(sizes) < 1:
        raise ValueError(
            f"vocab_group: every rank's shard needs at least one vocabulary column; sizes per rank {sizes}"
        )
    return VocabShards(tuple(sizes), dist.get_rank(group))


def combine_shard_stats(stats: torch.Tensor, owner: torch.Tensor, temperature):
    """The whole vocabulary's ``(row_max, log_s, logp, H)`` from the shards' (the module's notes).

    Each shard's share is kept as a log: ``rel_r = log_s_r + (row_max_r - M) / T`` (its mass relative to
    ``exp(M / T)``, ``M`` the largest logit) and ``log w_r = -log1p(sum_{q != r} exp(rel_q - rel_r))``, which
    keeps its relative precision when one shard holds nearly all the mass: a confident target's ``logp`` near 0
    then has the digits the backward's ``expm1(logp)`` needs (``lse_r - lse`` would cancel them).

    Args:
        stats: ``[R, 4, *S]``: each shard's kernel statistics ``(row_max, log_s, logp, H)`` (``logp`` only read
            where the shard holds the target).
        owner: ``[*S]`` int64, the shard that holds each token's target (``-1``: none, which gives NaN ``logp``).
        temperature: a float, or each token's (broadcastable to ``[*S]``).
    """
    row_max, log_s, logp, entropy = stats.unbind(1)
    whole_max = row_max.amax(dim=0)
    banned = torch.isneginf(row_max)  # a shard whose every logit is -inf holds no probability
    rel = torch.where(banned, torch.full_like(log_s, -torch.inf), log_s + (row_max - whole_max) / temperature)
    others = torch.exp(rel[None] - rel[:, None])  # [r, q]: shard q's mass over shard r's
    diagonal = torch.eye(rel.shape[0], dtype=torch.bool, device=rel.device).view(
        rel.shape[:1] * 2 + (1,) * (rel.dim() - 1)
    )
    log_share = -torch.log1p(torch.where(diagonal, torch.zeros_like(others), others).sum(dim=1))
    log_share = torch.where(banned, torch.full_like(log_share, -torch.inf), log_share)
    share = torch.exp(log_share)
    terms = torch.where(share > 0, share * (entropy - log_share), torch.zeros_like(share))
    at = owner.clamp(min=0)[None]
    own_logp = logp.gather(0, at).squeeze(0) + log_share.gather(0, at).squeeze(0)
    whole_logp = torch.where(owner >= 0, own_logp, torch.full_like(own_logp, torch.nan))
    return whole_max, torch.logsumexp(rel, dim=0), whole_logp, terms.sum(dim=0)


def target_owner(ids: torch.Tensor, shards: VocabShards) -> torch.Tensor:
    """``ids``' shape, int64: the rank whose shard holds each id, ``-1`` for an id outside the whole vocabulary."""
    bounds = torch.tensor(shards.offsets[1:], dtype=torch.int64, device=ids.device)
    owner = torch.bucketize(ids.long(), bounds, right=True)
    inside = (ids >= 0) & (ids < shards.vocab_size)
    return torch.where(inside, owner, torch.full_like(owner, -1))


@dataclass(frozen=True)
class VocabParallel:
    """A vocabulary group and its shards, for a walk that combines statistics as it goes (the fused loss)."""

    group: object
    shards: VocabShards

    @classmethod
    def of_head(cls, group, vocab_local: int, rows: Tuple[int, ...], hidden_size: int, dtype, device) -> VocabParallel:
        """The group of a head whose rows (vocabulary) are sharded, this rank's ``vocab_local`` of them, for the
        ``rows`` positions of hidden states of ``hidden_size`` (`exchange_shards`)."""
        return cls(
            group, exchange_shards(group, vocab_local, tuple(rows) + (hidden_size,), dtype, device, "hidden_states")
        )

    @classmethod
    def named(cls, name: Optional[str], sizes: Optional[List[int]]) -> Optional[VocabParallel]:
        """The group `group_name` called ``name`` with each rank's shard ``sizes``, inside a registered operator
        (``None`` for no group)."""
        if name is None:
            return None
        group = group_named(name)
        return cls(group, VocabShards(tuple(sizes), dist.get_rank(group)))

    @property
    def largest_shard(self) -> int:
        """The columns of the largest shard: what sizes a chunk on every rank, so that all walk the same chunks."""
        return max(self.shards.sizes)

    def combine(self, stats: torch.Tensor, ids: torch.Tensor, temperature) -> torch.Tensor:
        """``[4, *S]`` this shard's ``(row_max, log_s, logp, H)`` of tokens ``ids [*S]`` (ids of the whole vocabulary)
        -> the whole vocabulary's (one all-gather)."""
        gathered = all_gather_ranks(stats.contiguous(), self.group)
        return torch.stack(combine_shard_stats(gathered, target_owner(ids, self.shards), temperature))


def shard_sizes(vocab_size: int, world: int) -> List[int]:
    """Megatron's even split of ``vocab_size`` columns over ``world`` ranks, the first ranks one larger when it
    does not divide (a helper for tests and examples; any sizes in rank order are accepted)."""
    base, extra = divmod(vocab_size, world)
    return [base + (r < extra) for r in range(world)]
