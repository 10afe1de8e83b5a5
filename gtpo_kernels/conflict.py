"""`conflict_weights`: the conflict-token weights of whole prompt groups (docs/method.md, "Conflict tokens").

They compare all completions of a group, so a trainer that cuts groups across ranks or micro-batches
computes them once, on whole groups (at rollout time), and hands each loss call its rows' slice through
the losses' ``conflict=`` argument.
"""

from __future__ import annotations

import math
from typing import Tuple

import torch

from . import custom_ops, validation
from .backends import resolve_backend_name
from .config import GTPOConfig
from .rows import LossRows


def conflict_weights(
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    group_size: int,
    weight: float = 2.0,
    *,
    backend: str = "auto",
    validate: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Conflict-token weights ``lambda = lambda_f * lambda_r`` and conflict counts.

    Args:
        completion_ids: ``[N, L]`` integer ids (values at masked positions are ignored).
        completion_mask: ``[N, L]``, a prefix of ones per row; holes inside a completion (a tool's output)
            are part of it here: the runs are those of the completions as generated, up to each row's last 1.
        advantages: ``[N]`` raw advantages; only their signs matter.
        group_size: ``G``; rows ``b*G .. b*G+G-1`` are one group (whole groups only).
        weight: ``W``, the weight of a conflict token in a positive completion (``config.conflict_weight``).
        backend: where to compute them (``"auto"``: the backend of the tensors' device).

    Returns:
        ``(lambda_ [N, L], n_conflict [N])``: ``lambda_`` is ``W`` or ``W^2`` on conflict tokens of positive
        completions, 0 on conflict tokens of negative ones and 1 elsewhere (padding and zero-advantage
        rows included), float32 (float64 for float64 advantages); ``n_conflict`` (int64) is
        ``max(|cf_i|, |cr_i|)``, the lengths of the forward and reverse conflict runs, 0 for rows with
        zero advantage. Pass the pair to `gtpo_loss` / `fused_linear_gtpo_loss` as ``conflict=``, sliced
        like the rows.
    """
    shape = validation.check_ids(completion_ids)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not (math.isfinite(weight) and weight > 0):
        raise ValueError(
            f"conflict_weights: weight must be a finite number > 0 (W, config.conflict_weight; 1 leaves conflict "
            f"tokens unweighted), got {weight!r}"
        )
    validation.check_same_device(completion_ids=completion_ids, completion_mask=completion_mask, advantages=advantages)
    checks = validation.DeferredChecks(validate and not torch.compiler.is_compiling())
    valid = validation.check_mask(completion_mask, shape, checks)
    validation.check_float("advantages", advantages, (shape[0],), "[N]")
    validation.check_group_size(group_size, shape[0])
    checks.read()
    return compute_conflict_weights(
        resolve_backend_name(backend, completion_ids.device.type), completion_ids, valid, advantages, group_size, weight
    )


def as_generated(valid: torch.Tensor) -> torch.Tensor:
    """``[N, L]`` bool: the positions up to each row's last unmasked one. A mask with holes (a tool's output
    inside a completion) marks what takes part in the loss; the completion as generated, on which the
    conflict runs are computed, runs to its last unmasked token. A prefix mask is its own."""
    return valid.flip(1).to(torch.int8).cummax(dim=1).values.flip(1).bool()


def compute_conflict_weights(backend: str, completion_ids, valid, advantages, group_size: int, weight: float):
    """Unchecked: ``valid`` a bool mask (holes allowed: the runs are those of `as_generated`); float64 advantages
    keep float64 weights (torch backend). Through the registered operator ``gtpo_kernels::conflict_weights``."""
    return custom_ops.conflict_weights(
        completion_ids, as_generated(valid), advantages.detach(), group_size, float(weight), backend
    )


def with_conflict_weights(rows: LossRows, config: GTPOConfig, backend: str) -> LossRows:
    """``rows`` with the conflict weights the config asks for: the given ones, or computed by ``backend`` from
    whole groups of ``rows.group_size``; ``conflict=None`` when the config does not use them."""
    if not config.use_conflict_weights:
        return rows.replace(conflict=None, group_size=None)
    if rows.conflict is not None:
        return rows.replace(group_size=None)
    conflict = compute_conflict_weights(
        backend, rows.ids, rows.valid, rows.advantages, rows.group_size, config.conflict_weight
    )
    return rows.replace(conflict=conflict, group_size=None)
