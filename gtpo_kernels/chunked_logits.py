"""The GTPO loss for models whose logits are a transform of ``hidden @ W.T (+ b)`` (soft-capped or scaled: Gemma 2/3,
Cohere, Granite, Falcon-H1), which the fused ``hidden @ lm_head`` kernels cannot serve.

Rows are taken in chunks of at most ``max_chunk_bytes`` of float32 logits: each chunk's logits are built, turned
into its share of the loss by `gtpo_loss` and dropped, then rebuilt in backward (activation checkpointing), so
memory stays within one chunk's logits whatever the batch. The chunks' losses add up to the whole batch's
because every call is given the whole batch's counts (``num_sequences``, ``num_tokens``) and the conflict
weights of whole groups (``conflict``).
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .backends import chunk_budget
from .config import GTPOConfig
from .loss import loss_of_rows
from .objective import entropy_floor
from .result import ROW_METRICS, GTPOLossOutput, GTPOMetrics
from .rows import LossRows
from .token_stats import token_logprobs_and_entropy
from .vocab_parallel import quantile_gather


def _row_chunks(n_rows: int, length: int, vocab: int, device: torch.device, max_chunk_bytes: Optional[int]):
    budget = chunk_budget.chunk_bytes(chunk_budget.TRANSFORMED_LOGITS, device, max_chunk_bytes)
    rows = max(1, budget // max(1, 4 * length * vocab))
    return [slice(start, min(start + rows, n_rows)) for start in range(0, n_rows, rows)]


def transformed_logits_gtpo_loss(
    hidden: torch.Tensor,
    head: Tuple[torch.Tensor, Optional[torch.Tensor], Callable],
    given: LossRows,
    config: GTPOConfig,
    entropy_quantile_group=None,
) -> GTPOLossOutput:
    """`gtpo_loss` on ``transform(hidden @ weight.T + bias)`` (``hidden [N, L, H]``, ``head = (weight, bias,
    transform)``), in row chunks, for the per-row inputs ``given``.

    ``given.conflict`` (whole groups' weights, sliced like the rows) is required when the config uses conflict
    weights; the counts default to this call's rows and tokens (the whole call's, not a chunk's), and so does the
    threshold of ``config.top_entropy_quantile`` (a statistics pass first; over ``entropy_quantile_group``'s
    processes when given)."""
    weight, bias, transform = head
    n_rows, length = given.ids.shape
    if config.use_conflict_weights and given.conflict is None:
        raise ValueError("transformed_logits_gtpo_loss: pass conflict=conflict_weights(...) computed on whole groups")
    if config.top_entropy_quantile < 1 and given.entropy_floor is None:
        valid = given.valid.bool()
        _, entropy = transformed_logits_token_stats(
            hidden,
            weight,
            bias,
            transform,
            given.ids,
            valid,
            temperature=given.temperature,
            max_chunk_bytes=config.max_chunk_bytes,
        )
        given = given.replace(
            entropy_floor=entropy_floor(entropy, valid, config, quantile_gather(entropy_quantile_group))
        )

    def part(rows, h, w, b):
        out = loss_of_rows(transform(F.linear(h, w, b)), given.slice(rows), config)
        return out.loss, out.metrics.to_sums(), *(getattr(out.metrics, name) for name in ROW_METRICS)

    losses, sums, per_row = [], [], []
    for rows in _row_chunks(n_rows, length, weight.shape[0], hidden.device, config.max_chunk_bytes):
        outs = checkpoint(part, rows, hidden[rows], weight, bias, use_reentrant=False)
        losses.append(outs[0])
        sums.append(outs[1].detach())
        per_row.append([o.detach() for o in outs[2:]])
    rows_metrics = [torch.cat([p[k] for p in per_row]) for k in range(len(ROW_METRICS))]
    metrics = GTPOMetrics.from_sums(torch.stack(sums).sum(0), parts=len(sums), per_row=rows_metrics)
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
    temperature=1.0,
    max_chunk_bytes: Optional[int] = None,
):
    """``(logp [N, L], H [N, L])`` of ``transform(hidden @ weight.T + bias)``, in row chunks (no gradient)."""
    n_rows, length = completion_ids.shape
    logps, entropies = [], []
    for rows in _row_chunks(n_rows, length, weight.shape[0], hidden.device, max_chunk_bytes):
        logits = transform(F.linear(hidden[rows], weight, bias))
        mask = None if completion_mask is None else completion_mask[rows]
        row_temperature = temperature[rows] if isinstance(temperature, torch.Tensor) else temperature
        logp, entropy = token_logprobs_and_entropy(logits, completion_ids[rows], mask, temperature=row_temperature)
        logps.append(logp)
        entropies.append(entropy)
    return torch.cat(logps), torch.cat(entropies)
