"""The GTPO loss for models whose logits are a transform of ``hidden @ W.T (+ b)`` (soft-capped or scaled: Gemma 2/3,
Cohere, Granite, Falcon-H1), which the fused ``hidden @ lm_head`` kernels cannot serve.

Rows are taken in chunks of at most ``max_chunk_bytes`` of float32 logits: each chunk's logits are built, turned
into its share of the loss by `gtpo_loss` and dropped, then rebuilt in backward (activation checkpointing), so
memory stays within one chunk's logits whatever the batch. The chunks' losses add up to the whole batch's
because every call is given the whole batch's counts (``num_sequences``, ``num_tokens``) and the conflict
weights of whole groups (``conflict``).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .config import GTPOConfig
from .loss import gtpo_loss
from .result import GTPOLossOutput, GTPOMetrics
from .token_stats import token_logprobs_and_entropy

DEFAULT_CHUNK_BYTES = 256 * 2**20


def _row_chunks(n_rows: int, length: int, vocab: int, max_chunk_bytes: Optional[int]):
    rows = max(1, (max_chunk_bytes or DEFAULT_CHUNK_BYTES) // max(1, 4 * length * vocab))
    return [slice(start, min(start + rows, n_rows)) for start in range(0, n_rows, rows)]


def transformed_logits_gtpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    transform: Callable,
    completion_ids,
    completion_mask,
    advantages,
    *,
    config: GTPOConfig,
    conflict=None,
    old_logprobs=None,
    ref_logprobs=None,
    num_sequences=None,
    num_tokens=None,
    **loss_kwargs,
) -> GTPOLossOutput:
    """`gtpo_loss` on ``transform(hidden @ weight.T + bias)`` (``hidden [N, L, H]``), in row chunks.

    ``conflict`` (whole groups' weights, sliced like the rows) is required when the config uses conflict
    weights; ``num_sequences``/``num_tokens`` default to this call's rows and tokens (the whole call's, not a
    chunk's)."""
    n_rows, length = completion_ids.shape
    if config.use_conflict_weights and conflict is None:
        raise ValueError("transformed_logits_gtpo_loss: pass conflict=conflict_weights(...) computed on whole groups")
    valid = completion_mask.bool()
    num_sequences = n_rows if num_sequences is None else num_sequences
    num_tokens = valid.sum() if num_tokens is None else num_tokens

    def part(rows, h, w, b):
        def pick(t):
            return None if t is None else t[rows]

        logits = transform(F.linear(h, w, b))
        out = gtpo_loss(
            logits,
            completion_ids[rows],
            completion_mask[rows],
            advantages[rows],
            config=config,
            conflict=None if conflict is None else (conflict[0][rows], conflict[1][rows]),
            old_logprobs=pick(old_logprobs),
            ref_logprobs=pick(ref_logprobs),
            num_sequences=num_sequences,
            num_tokens=num_tokens,
            **loss_kwargs,
        )
        m = out.metrics
        rows_out = [m.completion_entropy] + [
            torch.zeros_like(m.completion_entropy) if r is None else r
            for r in (m.completion_clip_low, m.completion_clip_high)
        ]
        return out.loss, m.to_sums(), *rows_out

    losses, sums, per_row = [], [], []
    for rows in _row_chunks(n_rows, length, weight.shape[0], config.max_chunk_bytes):
        outs = checkpoint(part, rows, hidden[rows], weight, bias, use_reentrant=False)
        losses.append(outs[0])
        sums.append(outs[1].detach())
        per_row.append([o.detach() for o in outs[2:]])
    metrics = GTPOMetrics.from_sums(torch.stack(sums).sum(0), parts=len(sums))
    metrics.completion_entropy, metrics.completion_clip_low, metrics.completion_clip_high = (
        torch.cat([p[k] for p in per_row]) for k in range(3)
    )
    return GTPOLossOutput(torch.stack(losses).sum(), metrics)


@torch.no_grad()
def transformed_logits_token_stats(
    hidden,
    weight,
    bias,
    transform,
    completion_ids,
    completion_mask=None,
    *,
    temperature: float = 1.0,
    max_chunk_bytes: Optional[int] = None,
):
    """``(logp [N, L], H [N, L])`` of ``transform(hidden @ weight.T + bias)``, in row chunks (no gradient)."""
    n_rows, length = completion_ids.shape
    logps, entropies = [], []
    for rows in _row_chunks(n_rows, length, weight.shape[0], max_chunk_bytes):
        logits = transform(F.linear(hidden[rows], weight, bias))
        mask = None if completion_mask is None else completion_mask[rows]
        logp, entropy = token_logprobs_and_entropy(logits, completion_ids[rows], mask, temperature=temperature)
        logps.append(logp)
        entropies.append(entropy)
    return torch.cat(logps), torch.cat(entropies)
