"""verl's ``gtpo`` and ``gtpo_sum`` policy losses: the package's objective on verl's per-token log-probs and
GTPO's per-token advantages, with verl's whole-mini-batch counts."""

from __future__ import annotations

import math
from typing import Optional

import torch

from ...config import GTPOConfig
from ...objective import loss_from_token_stats
from ...rows import LossRows
from .settings import POLICY_LOSS, POLICY_LOSS_SUM, _get, verl_reduction


def _clip(config) -> tuple[Optional[float], Optional[float]]:
    clip = _get(config, "clip_ratio")
    low = _get(config, "clip_ratio_low")
    high = _get(config, "clip_ratio_high")
    low = clip if low is None else low
    high = clip if high is None else high
    return (
        None if low is None or math.isinf(low) else float(low),
        None if high is None or math.isinf(high) else float(high),
    )


def gtpo_policy_loss(
    old_log_prob, log_prob, advantages, response_mask, reduction: str, config=None, rollout_is_weights=None
):
    """The package's objective on verl's per-token statistics and GTPO's per-token advantages (see the module
    docstring). Returns ``(loss, metrics)`` as verl's policy losses do."""
    info = dict(_get(config, "global_batch_info", None) or {})
    dp_size = info.get("dp_size") or 1
    scale = _get(config, "loss_scale_factor")
    if reduction == "dr_grpo" and scale is None:
        raise ValueError(
            "loss_agg_mode=seq-mean-token-sum-norm (dr_grpo) needs actor.loss_scale_factor, the "
            "generation cap: without it each micro-batch would divide by its own padded length"
        )
    low, high = _clip(config)
    loss_config = GTPOConfig(
        preset="grpo",
        normalize_advantages_by_std=False,
        entropy_threshold=None,
        entropy_coef=0.0,
        use_conflict_weights=True,
        divide_by_conflict_count=False,
        loss_reduction=reduction,
        clip_eps_low=low,
        clip_eps_high=high,
        max_completion_length=int(scale) if reduction == "dr_grpo" else None,
        warn_no_signal=False,
    )
    valid = response_mask.bool()
    weights = advantages if rollout_is_weights is None else advantages * rollout_is_weights  # IS weights >= 0
    ones = torch.ones(valid.shape[0], dtype=log_prob.dtype, device=log_prob.device)
    # The per-token advantages ride as the conflict weights of unit advantages: lambda * A = the given a.
    rows = LossRows(
        None,
        valid,
        ones,
        conflict=(weights, None),
        old_logprobs=old_log_prob,
        num_sequences=info.get("global_batch_size") if reduction in ("sequence_mean", "dr_grpo") else None,
        num_tokens=info.get("batch_num_tokens") if reduction == "token_mean" else None,
    )
    out = loss_from_token_stats(log_prob, torch.zeros_like(log_prob), rows, loss_config)
    mask = valid.to(log_prob.dtype)
    ppo_kl = ((old_log_prob - log_prob).detach() * mask).sum() / mask.sum().clamp(min=1)
    metrics = {
        "actor/pg_clipfrac": float(out.metrics.clip_fraction),
        "actor/ppo_kl": float(ppo_kl),
        "actor/gtpo_ratio_mean": float(out.metrics.ratio_mean),
    }
    return out.loss * dp_size, metrics


def compute_policy_loss_gtpo(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights=None,
):
    """verl's ``gtpo`` policy loss: the reduction named by ``loss_agg_mode`` (`AGG_MODE_REDUCTION`)."""
    return gtpo_policy_loss(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        verl_reduction(POLICY_LOSS, loss_agg_mode),
        config,
        rollout_is_weights,
    )


def compute_policy_loss_gtpo_sum(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode: str = "seq-mean-token-mean",
    config=None,
    rollout_is_weights=None,
):
    """verl's ``gtpo_sum`` policy loss: the ``official`` preset's sum of per-completion token means."""
    return gtpo_policy_loss(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        verl_reduction(POLICY_LOSS_SUM, loss_agg_mode),
        config,
        rollout_is_weights,
    )
