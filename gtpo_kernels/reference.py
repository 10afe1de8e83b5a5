"""The GTPO loss in plain PyTorch: the readable definition every backend is tested against.

Everything here follows ``../shared/SPEC.md`` term by term and runs in float64 as well as float32
(half-precision inputs are upcast to float32). Nothing here is fused or chunked; `gtpo_loss` in
`loss.py` reuses the per-completion step (`gtpo_loss_from_token_stats`) and swaps only the
vocabulary-sized work for faster backends.

Shapes: ``N = B * G`` completions (rows of a group contiguous), ``L`` positions, ``V`` vocabulary.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .config import GTPOConfig
from .result import GTPOLossOutput, GTPOMetrics


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64 (for the oracle and gradcheck); everything else accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------------------------------
# Per-token statistics: the only part that touches the vocabulary.
# --------------------------------------------------------------------------------------------------

def token_logprobs_and_entropy(
    logits: torch.Tensor, completion_ids: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target token and the entropy of each predictive distribution.

    Args:
        logits: ``[..., V]`` (any float dtype; ``-inf`` entries allowed for banned tokens).
        completion_ids: ``[...]`` integer ids in ``[0, V)``.

    Returns:
        ``(logp, H)``, both ``[...]`` in float32 (float64 for float64 logits), differentiable
        through autograd: ``logp = z[y] - lse`` and ``H = -sum_v p_v log p_v``.
    """
    z = logits.to(accumulation_dtype(logits.dtype))
    log_p = torch.log_softmax(z, dim=-1)
    logp = log_p.gather(-1, completion_ids.long().unsqueeze(-1)).squeeze(-1)
    # Banned tokens (z = -inf) have p = 0 and contribute 0 to the entropy; p * log p would be
    # 0 * -inf = NaN there, so those entries are zeroed before the product.
    log_p_finite = log_p.masked_fill(torch.isneginf(z), 0.0)
    entropy = -(log_p.exp() * log_p_finite).sum(-1)
    return logp, entropy


# --------------------------------------------------------------------------------------------------
# Advantages.
# --------------------------------------------------------------------------------------------------

def compute_advantages(
    rewards: torch.Tensor, group_size: int, normalize_std: bool = False, eps: float = 1e-4
) -> torch.Tensor:
    """Group-relative advantages.

    Args:
        rewards: ``[N]`` with ``N = B * G``, rows of a group contiguous.
        group_size: ``G``.
        normalize_std: divide by the group's (unbiased) standard deviation plus ``eps``
            (standard GRPO). A group of one has advantage 0 either way.

    Returns:
        ``[N]`` advantages, ``A_i = R_i - mean_group(R)`` (optionally ``/ (std + eps)``).
    """
    if rewards.dim() != 1:
        raise ValueError(f"compute_advantages: rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.float32)
    if not isinstance(group_size, int) or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"compute_advantages: group_size ({group_size!r}) must be a positive int dividing the "
            f"number of rewards ({rewards.numel()})"
        )
    grouped = rewards.view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std:
        std = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(centred)
        centred = centred / (std + eps)
    return centred.reshape(-1)


# --------------------------------------------------------------------------------------------------
# Conflict tokens and weights.
# --------------------------------------------------------------------------------------------------

def _leading_conflict_run(
    ids: torch.Tensor, valid: torch.Tensor, positive: torch.Tensor, negative: torch.Tensor, group_size: int
) -> torch.Tensor:
    """``cf[i, t]``: positions ``0..t`` of row ``i`` all hold a token that, at the same position, also
    appears in a positive and in a negative completion of the group (the row itself counts).

    ``ids, valid: [N, L]``; ``positive, negative: [N]`` bool. Work and memory ``O(G^2 L)`` per group.
    """
    n, length = ids.shape
    y = ids.view(-1, group_size, length)
    v = valid.view(-1, group_size, length)
    # same[b, i, j, t]: rows i and j of group b hold the same token at position t, both unmasked.
    same = (y[:, :, None, :] == y[:, None, :, :]) & v[:, :, None, :] & v[:, None, :, :]
    in_positive = (same & positive.view(-1, 1, group_size, 1)).any(dim=2)
    in_negative = (same & negative.view(-1, 1, group_size, 1)).any(dim=2)
    raw = (in_positive & in_negative).view(n, length)
    return torch.cumprod(raw.to(torch.int32), dim=1).bool()  # leading run of True


def conflict_weights(
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    group_size: int,
    weight: float = 2.0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Conflict-token weights ``lambda = lambda_f * lambda_r`` and conflict counts.

    Args:
        completion_ids: ``[N, L]`` integer ids (values at masked positions are ignored).
        completion_mask: ``[N, L]``, a contiguous prefix of ones per row.
        advantages: ``[N]`` raw advantages; only their signs matter.
        group_size: ``G``; rows ``b*G .. b*G+G-1`` are one group.
        weight: ``W``, the weight of a conflict token in a positive completion.

    Returns:
        ``lambda_ [N, L]`` in the advantages' float dtype (``W`` or ``W^2`` on conflict tokens of
        positive completions, 0 on conflict tokens of negative ones, 1 elsewhere, including masked
        positions and completions with zero advantage), and ``n_conflict [N]`` (int64):
        ``max(|cf_i|, |cr_i|)``, the lengths of the forward and reverse conflict runs, 0 for rows with
        zero advantage. The official loss divides by ``max(1, n_conflict)``.
    """
    valid = completion_mask.bool()
    positive = advantages > 0
    negative = advantages < 0
    active = (positive | negative)[:, None]

    # Forward: position t of every row, left-aligned.
    forward_run = _leading_conflict_run(completion_ids, valid, positive, negative, group_size) & active

    # Reverse: right-align each row (s = len - 1 - t), run the same test, map back to t.
    # The map t <-> len - 1 - t is its own inverse on the unmasked prefix, so one gather index serves.
    lengths = valid.sum(dim=1, keepdim=True)
    s = torch.arange(completion_ids.shape[1], device=completion_ids.device)
    flip = (lengths - 1 - s).clamp(min=0)
    valid_reversed = s < lengths
    reverse_run_s = _leading_conflict_run(
        completion_ids.gather(1, flip), valid_reversed, positive, negative, group_size
    )
    reverse_run = reverse_run_s.gather(1, flip) & valid & active

    dtype = advantages.dtype if advantages.is_floating_point() else torch.float32
    one = torch.ones((), dtype=dtype, device=completion_ids.device)

    def run_weight(run: torch.Tensor) -> torch.Tensor:
        on_conflict = torch.where(positive[:, None], weight * one, 0.0 * one)
        return torch.where(run, on_conflict, one)

    lambda_ = run_weight(forward_run) * run_weight(reverse_run)
    n_conflict = torch.maximum(forward_run.sum(dim=1), reverse_run.sum(dim=1))
    return lambda_, n_conflict


# --------------------------------------------------------------------------------------------------
# The per-completion step: entropy filter, shaping, ratio, clipping, KL, reduction.
# --------------------------------------------------------------------------------------------------

def entropy_filter_active(config: GTPOConfig, initial_entropy: Optional[float]) -> bool:
    """The filter is on when a threshold is set, unless gated off by a too-high initial entropy."""
    if config.entropy_threshold is None:
        return False
    if config.entropy_gate and initial_entropy is not None:
        return not float(initial_entropy) > config.entropy_threshold
    return True


def gtpo_loss_from_token_stats(
    token_logprobs: torch.Tensor,
    token_entropy: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    lambda_: torch.Tensor,
    n_conflict: torch.Tensor,
    config: GTPOConfig,
    *,
    old_logprobs: Optional[torch.Tensor] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    initial_entropy: Optional[float] = None,
    total_rows: Optional[int] = None,
    total_tokens: Optional[torch.Tensor] = None,
) -> GTPOLossOutput:
    """The GTPO loss from per-token log-probs and entropies (``[N, L]`` each, differentiable).

    Values of ``token_logprobs``, ``token_entropy``, ``old_logprobs`` and ``ref_logprobs`` at masked
    positions are never used (they may hold anything, even NaN). ``lambda_`` and ``n_conflict``
    come from `conflict_weights` (pass ones and zeros to disable them).

    Everything is row-local except the reductions' denominators. For a chunk of rows of a larger
    batch, pass the batch's ``total_rows`` (``N``) and ``total_tokens`` (unmasked tokens): the
    returned loss is then the chunk's exact contribution to the batch loss (the metrics stay the
    chunk's own).
    """
    dtype = token_logprobs.dtype
    valid = completion_mask.bool()
    mask = valid.to(dtype)
    zero = torch.zeros((), dtype=dtype, device=token_logprobs.device)
    lengths = mask.sum(dim=1)
    n_rows, n_positions = valid.shape
    n_tokens = mask.sum()
    rows_denominator = n_rows if total_rows is None else total_rows
    tokens_denominator = n_tokens if total_tokens is None else total_tokens

    logp = torch.where(valid, token_logprobs, zero)
    entropy = torch.where(valid, token_entropy, zero)

    # Entropy filter and shaping. Hbar is detached: it selects and shifts, it is not optimised.
    completion_entropy = (entropy.detach() * mask).sum(dim=1) / lengths.clamp(min=1)
    if entropy_filter_active(config, initial_entropy):
        keep = (completion_entropy <= config.entropy_threshold).to(dtype)
    else:
        keep = torch.ones_like(completion_entropy)
    advantages = advantages.to(dtype)
    if config.entropy_mode == "advantage_shift":
        shaped = keep * (advantages - config.entropy_coef * completion_entropy)
    else:
        shaped = keep * advantages
    token_advantage = lambda_.to(dtype) * shaped[:, None]

    # Importance ratio; on-policy it is 1 in value and carries the gradient of logp.
    old = logp.detach() if old_logprobs is None else torch.where(valid, old_logprobs.to(dtype), zero)
    ratio = torch.exp(logp - old)
    unclipped = ratio * token_advantage
    if config.clipping:
        clipped = torch.clamp(ratio, 1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high) * token_advantage
        per_token = -torch.minimum(unclipped, clipped)
        was_clipped = ((ratio < 1.0 - config.clip_eps_low) & (token_advantage < 0)) | (
            (ratio > 1.0 + config.clip_eps_high) & (token_advantage > 0)
        )
    else:
        per_token = -unclipped
        was_clipped = torch.zeros_like(valid)

    if config.entropy_mode == "penalty" and config.entropy_coef:
        per_token = per_token + config.entropy_coef * entropy

    kl = None
    if ref_logprobs is not None:
        ref_minus_logp = torch.where(valid, ref_logprobs.to(dtype), zero) - logp
        kl_per_token = torch.exp(ref_minus_logp) - ref_minus_logp - 1.0  # k3, >= 0
        if config.kl_beta:
            per_token = per_token + config.kl_beta * kl_per_token
        kl = (kl_per_token.detach() * mask).sum() / n_tokens.clamp(min=1)

    per_token = torch.where(valid, per_token, zero)
    if config.divide_by_conflict_count:
        per_token = per_token / n_conflict.clamp(min=1).to(dtype)[:, None]

    if config.loss_reduction in ("sequence_mean", "sum"):
        per_completion = per_token.sum(dim=1) / lengths.clamp(min=1)
        loss = per_completion.sum()
        if config.loss_reduction == "sequence_mean":
            loss = loss / rows_denominator
    elif config.loss_reduction == "token_mean":
        loss = per_token.sum() / torch.as_tensor(tokens_denominator, dtype=dtype).clamp(min=1)
    else:  # dr_grpo
        loss = per_token.sum() / (rows_denominator * n_positions)

    def token_fraction(flags: torch.Tensor) -> torch.Tensor:
        return (flags & valid).sum().to(dtype) / n_tokens.clamp(min=1)

    non_empty = lengths > 0
    metrics = GTPOMetrics(
        entropy=(completion_entropy * lengths).sum() / n_tokens.clamp(min=1),
        completion_entropy=completion_entropy,
        filtered_fraction=((1 - keep) * non_empty).sum() / non_empty.sum().clamp(min=1),
        amplified_fraction=token_fraction(lambda_ > 1),
        skipped_fraction=token_fraction(lambda_ == 0),
        ratio_mean=(ratio.detach() * mask).sum() / n_tokens.clamp(min=1),
        clip_fraction=token_fraction(was_clipped),
        kl=kl,
    )
    return GTPOLossOutput(loss, metrics)


def reference_gtpo_loss(
    logits: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    group_size: int,
    config: Optional[GTPOConfig] = None,
    old_logprobs: Optional[torch.Tensor] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    initial_entropy: Optional[float] = None,
) -> GTPOLossOutput:
    """The whole GTPO loss in plain autograd, unchunked and unvalidated: the oracle for tests.

    ``logits: [N, L, V]``, ``completion_ids, completion_mask: [N, L]``, ``advantages: [N]``.
    """
    config = config or GTPOConfig()
    valid = completion_mask.bool()
    safe_ids = torch.where(valid, completion_ids.long(), 0)  # masked ids may be pad values like -100
    logp, entropy = token_logprobs_and_entropy(logits, safe_ids)
    dtype = logp.dtype
    if config.use_conflict_weights:
        lambda_, n_conflict = conflict_weights(
            completion_ids, valid, advantages.to(dtype), group_size, config.conflict_weight
        )
    else:
        lambda_ = torch.ones_like(logp)
        n_conflict = torch.zeros(logp.shape[0], dtype=torch.long, device=logp.device)
    return gtpo_loss_from_token_stats(
        logp, entropy, valid, advantages, lambda_, n_conflict, config,
        old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, initial_entropy=initial_entropy,
    )
