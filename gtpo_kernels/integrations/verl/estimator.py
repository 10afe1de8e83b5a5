"""verl's ``gtpo`` advantage estimator: group-relative advantages, conflict weights and the entropy filter and
shift of whole groups found by ``uid``, folded into verl's per-token ``advantages``."""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from typing import Optional

import numpy as np
import torch

from ...advantages import compute_advantages
from ...config import GTPOConfig
from ...conflict import conflict_weights
from ...objective import token_advantages
from ...rows import LossRows
from .settings import gtpo_settings

_BATCH_FIELDS: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("gtpo_verl_batch_fields", default=None)


_MEASURED_INITIAL_ENTROPY: dict = {}


@contextmanager
def batch_fields(responses: torch.Tensor, entropy: Optional[torch.Tensor]):
    """Hands the batch's ``responses`` ``[bs, L]`` and old-policy ``entropy`` ``[bs, L]`` (rows in the order of
    the advantage call's) to `compute_gtpo_advantage` when verl calls it without them."""
    token = _BATCH_FIELDS.set({"responses": responses, "entropy": entropy})
    try:
        yield
    finally:
        _BATCH_FIELDS.reset(token)


def reset_initial_entropy() -> None:
    """Forgets the entropy measured on the first batch (for the gate): a new run in the same process."""
    _MEASURED_INITIAL_ENTROPY.clear()


def _groups(index, n_rows: int):
    """``(order, sizes)``: rows sorted by group (stable), and each group's size in that order."""
    if index is None:
        raise ValueError("the gtpo advantage estimator needs index (verl's uid of each row's prompt)")
    index = np.asarray(index, dtype=object)
    if index.shape != (n_rows,):
        raise ValueError(f"index must hold one uid per row ({n_rows}), got shape {index.shape}")
    _, inverse, sizes = np.unique(index.astype(str), return_inverse=True, return_counts=True)
    order = np.argsort(inverse, kind="stable")
    return torch.from_numpy(order), sizes[inverse[order]]


def group_advantages_and_conflicts(rewards, responses, valid, index, config: GTPOConfig):
    """``(A [bs], lambda_ [bs, L] or None, n_conflict [bs] or None)`` on whole groups found by ``index``: the
    rows may come in any order and groups may differ in size (each size is computed in one kernel call)."""
    n_rows = rewards.shape[0]
    order, row_sizes = _groups(index, n_rows)
    device = rewards.device
    advantages = torch.zeros(n_rows, dtype=rewards.dtype, device=device)
    lambda_ = n_conflict = None
    if config.use_conflict_weights:
        lambda_ = torch.ones(valid.shape, dtype=rewards.dtype, device=device)
        n_conflict = torch.zeros(n_rows, dtype=torch.int64, device=device)
    for size in np.unique(row_sizes):
        rows = order[torch.from_numpy(row_sizes == size)].to(device)  # whole groups, each contiguous
        group_rewards = rewards[rows]
        a = compute_advantages(group_rewards, int(size), normalize_std=config.normalize_advantages_by_std)
        advantages[rows] = a
        if lambda_ is not None:
            lam, n = conflict_weights(responses[rows], valid[rows], a, int(size), config.conflict_weight)
            lambda_[rows] = lam.to(lambda_.dtype)
            n_conflict[rows] = n
    return advantages, lambda_, n_conflict


def compute_gtpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index=None,
    config=None,
    responses: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
    **unused,
):
    """verl's ``gtpo`` advantage estimator.

    Args:
        token_level_rewards: ``[bs, L]``; a completion's reward is its row's sum.
        response_mask: ``[bs, L]``, 1 on the tokens trained (holes for tool outputs allowed).
        index: ``[bs]`` uids: rows with the same uid are one group (any order, any sizes).
        config: verl's ``algorithm`` config (its ``gtpo`` section, `gtpo_settings`).
        responses: ``[bs, L]`` completion ids (for the conflict weights); entropy: ``[bs, L]`` old-policy
            per-token entropies (for the filter and shift). verl's trainer does not pass them: they come from
            `batch_fields`, which the wrapped trainer sets.

    Returns:
        ``(advantages, returns)``, both the per-token GTPO advantage ``lambda delta (A - gamma Hbar) / n``
        (`objective.token_advantages`), 0 on masked positions.
    """
    gtpo, initial_entropy = gtpo_settings(config)
    supplied = _BATCH_FIELDS.get() or {}
    responses = responses if responses is not None else supplied.get("responses")
    entropy = entropy if entropy is not None else supplied.get("entropy")
    valid = response_mask.bool()
    n_rows, length = valid.shape
    if gtpo.use_conflict_weights and responses is None:
        raise ValueError(
            "the gtpo advantage estimator needs the completion ids for the conflict weights, which "
            "verl does not pass to estimators: run verl's V1 trainer with gtpo_kernels installed "
            "(it supplies them), or wrap the call in gtpo_kernels.integrations.verl.batch_fields"
        )
    needs_entropy = gtpo.entropy_coef > 0 or gtpo.entropy_filter
    if needs_entropy and entropy is None:
        raise ValueError(
            "the gtpo advantage estimator needs the old policy's per-token entropies (verl's "
            "'entropy' field) for the entropy filter and shift; or set algorithm.gtpo."
            "entropy_threshold=null and entropy_coef=0"
        )
    for name, tensor in (("responses", responses), ("entropy", entropy)):
        if tensor is not None and tuple(tensor.shape) != (n_rows, length):
            raise ValueError(
                f"{name} must be [bs, L] = {(n_rows, length)} like response_mask, got {tuple(tensor.shape)}"
            )
    dtype = token_level_rewards.dtype if token_level_rewards.is_floating_point() else torch.float32
    rewards = token_level_rewards.to(dtype).sum(dim=-1)
    advantages, lambda_, n_conflict = group_advantages_and_conflicts(rewards, responses, valid, index, gtpo)
    if entropy is None:
        entropy = torch.zeros(valid.shape, dtype=dtype, device=valid.device)
    if gtpo.entropy_gate and gtpo.entropy_filter and initial_entropy is None:
        if "value" not in _MEASURED_INITIAL_ENTROPY:
            mask = valid.to(entropy.dtype)
            _MEASURED_INITIAL_ENTROPY["value"] = float((entropy * mask).sum() / mask.sum().clamp(min=1))
        initial_entropy = _MEASURED_INITIAL_ENTROPY["value"]
    rows = LossRows(responses, valid, advantages, conflict=(lambda_, n_conflict), initial_entropy=initial_entropy)
    _, _, token_advantage = token_advantages(entropy.to(dtype), rows, gtpo)
    return token_advantage, token_advantage
