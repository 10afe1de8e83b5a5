"""The per-completion step of the GTPO loss: from per-token statistics to the loss and its metrics.

Everything here is ``O(N L)``: the vocabulary-sized work (per-token log-prob and entropy) is done by a
backend before this step, and its gradient with respect to ``logp`` and ``H`` is what the backends'
backward turns into the gradient of the logits. Every entry point runs this one function: `gtpo_loss`
differentiates it through autograd, the fused ``hidden @ lm_head`` walk takes each chunk's gradient from it
with `loss_and_gradients`. `reference.py` is an independent float64 oracle for it. It knows nothing of kernels
or process groups: what it needs from them (the statistics, a gather for the entropy quantile) is handed in.

All terms are per completion or per token except the reductions' denominators, which are taken from
``num_sequences`` / ``num_tokens`` when given: a call then returns its rows' exact share of the loss of
the whole optimisation batch, so calls over any partition of the rows add up to the whole batch's loss
and gradient (docs/method.md, "Batches split across calls").
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from ._autograd import eager_autograd
from .config import GTPOConfig
from .result import GTPOLossOutput, GTPOMetrics
from .rows import LossRows


class _K3(torch.autograd.Function):
    """``k3(d) = e^d - d - 1`` (``d = ref - logp``) as ``expm1(d) - d``, with the gradient ``expm1(d)``: the
    plain formula's gradient ``e^d - 1`` cancels when the policy is close to the reference."""

    @staticmethod
    def forward(ctx, d):
        ctx.save_for_backward(d)
        return torch.expm1(d) - d

    @staticmethod
    def backward(ctx, grad):
        (d,) = ctx.saved_tensors
        return grad * torch.expm1(d)


def signal_beyond_advantages(config: GTPOConfig, has_reference: bool) -> bool:
    """Whether a term other than the advantages (the entropy penalty or bonus, the KL) gives every non-empty
    completion a gradient, whatever the filter and the advantages."""
    penalty = config.entropy_mode == "penalty" and config.entropy_coef > 0
    return penalty or config.entropy_bonus > 0 or bool(config.kl_beta and has_reference)


def entropy_filter_on(config: GTPOConfig, initial_entropy: Optional[float]) -> bool:
    """The filter is on when a finite threshold is set, unless gated off by a too-high initial entropy."""
    if not config.entropy_filter:
        return False
    if config.entropy_gate and initial_entropy is not None:
        return not float(initial_entropy) > config.entropy_threshold
    return True


class _Masked:
    """What every function here starts from: ``rows``' mask in the statistics' dtype, the completion lengths,
    the statistics with masked positions zeroed, and the entropy filter and shaping (`_shaping`)."""

    def __init__(self, token_logprobs, token_entropy, rows: LossRows, config: GTPOConfig) -> None:
        valid = rows.valid
        self.dtype = token_logprobs.dtype
        self.zero = torch.zeros((), dtype=self.dtype, device=valid.device)
        self.mask = valid.to(self.dtype)
        self.lengths = self.mask.sum(dim=1)
        self.logp = torch.where(valid, token_logprobs, self.zero)
        self.entropy = torch.where(valid, token_entropy.to(self.dtype), self.zero)
        self.completion_entropy, self.keep, self.shaped, self.token_advantage = _shaping(self, rows, config)
        # top_entropy_quantile: the tokens the policy term acts on ([N, L] in the statistics' dtype; None: all).
        floor = rows.entropy_floor
        if floor is None and config.top_entropy_quantile < 1:
            floor = entropy_floor(self.entropy, valid, config)
        self.kept_share = None if floor is None else floor[1].to(self.dtype)
        self.high_entropy = None if floor is None else ((self.entropy.detach() >= floor[0]) & valid).to(self.dtype)
        # cov_mode: the tokens Clip-Cov or KL-Cov picked ([N, L] bool; None: off), from the whole call's tokens.
        self.cov_selected = rows.cov_selected
        if self.cov_selected is None and config.cov_mode is not None:
            self.cov_selected = covariance_tokens(self, rows, config)

    def old(self, rows: LossRows) -> torch.Tensor:
        """``[N, L]``: the old log-probs (0 where masked), or the current ones, detached, on-policy."""
        return self.logp.detach() if rows.old_logprobs is None else self.given(rows, rows.old_logprobs)

    def ratio(self, rows: LossRows, config: GTPOConfig) -> torch.Tensor:
        """``[N, L]``: the importance ratio of each token against the old log-probs (with the gradient of ``logp``;
        ``exp(logp - logp.detach())`` without them), or of its completion (``importance_sampling_level``)."""
        log_ratio = self.logp - self.old(rows)
        if config.importance_sampling_level == "sequence":
            row_mean = (log_ratio * self.mask).sum(dim=1, keepdim=True) / self.lengths.clamp(min=1)[:, None]
            log_ratio = row_mean.expand(self.mask.shape)
        return torch.exp(log_ratio)

    def given(self, rows: LossRows, tensor: torch.Tensor) -> torch.Tensor:
        """A per-token input (old or reference log-probs) in the statistics' dtype, 0 where masked."""
        return torch.where(rows.valid, tensor.to(self.dtype), self.zero)


def entropy_floor(
    token_entropy: torch.Tensor,
    valid: torch.Tensor,
    config: GTPOConfig,
    gather: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
):
    """``(threshold, kept_share)`` 0-d tensors for ``config.top_entropy_quantile`` ``rho`` (``None`` when it is 1):
    the ``1 - rho`` quantile of the unmasked tokens' entropies, and the share of this call's unmasked tokens at or
    above it. ``gather``: this call's values ``[n]`` (NaN for a masked token) -> every process's, NaN-padded
    (`vocab_parallel.quantile_gather`), for a threshold over several processes. No host synchronisation (a sort
    on the device)."""
    rho = config.top_entropy_quantile
    if rho >= 1:
        return None
    entropy = token_entropy.detach()
    values = torch.where(valid, entropy, torch.full_like(entropy, torch.nan)).reshape(-1)
    if gather is not None:
        values = gather(values)
    threshold = _quantile(values, 1 - rho)
    kept = ((entropy >= threshold) & valid).sum().to(entropy.dtype)
    return threshold, kept / valid.sum().clamp(min=1).to(entropy.dtype)


def covariance_tokens(masked: _Masked, rows: LossRows, config: GTPOConfig) -> torch.Tensor:
    """``[N, L]`` bool: the tokens ``config.cov_mode`` picks among the call's unmasked ones (`GTPOConfig.cov_mode`),
    ``k = max(1, floor(cov_share * tokens))`` of them by ``cov_t = (a_t - mean a) (logp_t - mean logp)``, detached:
    Clip-Cov's ``k`` at random in its band (fewer if fewer are there), KL-Cov's ``k`` highest (ties by position).
    No host synchronisation: a token is picked when its rank by a key, in a stable sort, is below ``k``."""
    valid, mask = rows.valid, masked.mask
    tokens = mask.sum()
    advantage, logp = masked.token_advantage.detach(), masked.logp.detach()
    centred_advantage = advantage - (advantage * mask).sum() / tokens.clamp(min=1)
    cov = (centred_advantage * (logp - (logp * mask).sum() / tokens.clamp(min=1))).double()
    if config.cov_mode == "clip_cov":
        eligible = valid & (cov > config.clip_cov_low) & (cov < config.clip_cov_high)
        if config.clipping:  # a token PPO's clip already holds is not a candidate
            low, high = clip_flags(masked.ratio(rows, config).detach(), advantage, config)
            eligible = eligible & ~(low | high)
        draw = torch.rand(valid.shape, dtype=torch.float64).to(valid.device)  # CPU's generator: any device, one draw
        key = torch.where(eligible, draw, torch.full_like(draw, 2.0))
    else:
        eligible = valid
        key = torch.where(valid, -cov, torch.full_like(cov, torch.inf))
    order = torch.argsort(key.reshape(-1), stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    k = torch.floor(config.cov_share * tokens.double()).clamp(min=1)
    return eligible & (rank.reshape(valid.shape) < k)


def call_covariance_tokens(token_logprobs, token_entropy, rows: LossRows, config: GTPOConfig) -> torch.Tensor:
    """`covariance_tokens` of a whole call's statistics ``[N, L]``: ``rows.cov_selected`` for the steps that see
    part of its rows (the fused walk's chunks)."""
    return _Masked(token_logprobs.detach(), token_entropy.detach(), rows, config).cov_selected


def _quantile(values: torch.Tensor, q: float) -> torch.Tensor:
    """``torch.nanquantile(values, q)`` (linear interpolation) without its size limit: a sort of ``values`` with
    NaN (absent) last; +inf when every value is absent."""
    present = ~torch.isnan(values)
    ordered = torch.sort(torch.where(present, values, torch.full_like(values, torch.inf))).values
    count = present.sum()
    position = (count - 1).clamp(min=0).to(torch.float64) * q
    low = position.floor().long()
    high = position.ceil().long()
    value = torch.lerp(ordered[low], ordered[high], (position - low).to(values.dtype))
    return torch.where(count > 0, value, torch.full_like(value, torch.inf))


def _shaping(masked: _Masked, rows: LossRows, config: GTPOConfig):
    """``(Hbar [N], keep [N], shaped advantage [N], per-token advantage [N, L])``: the entropy filter and shaping.
    Hbar is detached: it selects and shifts, it is not optimised."""
    mask = masked.mask
    completion_entropy = (masked.entropy.detach() * mask).sum(dim=1) / masked.lengths.clamp(min=1)
    if entropy_filter_on(config, rows.initial_entropy):
        keep = (completion_entropy <= config.entropy_threshold).to(mask.dtype)
    else:
        keep = torch.ones_like(completion_entropy)
    advantages = rows.advantages.detach().to(mask.dtype)
    if config.entropy_mode == "advantage_shift":
        shift = config.entropy_coef * completion_entropy
        if config.entropy_shift_scope == "nonzero_advantage":  # a tied group (every A = 0) keeps A~ = 0
            shift = torch.where(advantages != 0, shift, torch.zeros_like(shift))
        shaped = keep * (advantages - shift)
    else:
        shaped = keep * advantages
    lambda_ = rows.lambda_
    token_advantage = shaped[:, None] if lambda_ is None else lambda_.to(mask.dtype) * shaped[:, None]
    return completion_entropy, keep, shaped, token_advantage.expand(mask.shape)


def policy_weights(masked: _Masked, rows: LossRows, config: GTPOConfig) -> Optional[torch.Tensor]:
    """The detached weights of the policy term: the sampler's correction (`sampling_weights`; VESPO takes it into
    its own weight instead) times the off-policy sequence mask (`off_policy_mask`) and the top-entropy token mask
    (``top_entropy_quantile``) and the tokens Clip-Cov takes out (``cov_mode``); ``None`` without any."""
    weight = None if config.ratio_function == "vespo" else sampling_weights(masked, rows, config)
    clip_cov = None
    if config.cov_mode == "clip_cov":
        clip_cov = (~masked.cov_selected).to(masked.dtype)
    for keep in (off_policy_mask(masked, rows, config), masked.high_entropy, clip_cov):
        if keep is not None:
            weight = keep if weight is None else weight * keep
    return weight


LOG_1E_8 = -18.420680743952367  # log(1e-8): VESPO's floor on its log-ratios (TRL's, from the original code)


def vespo_weights(masked: _Masked, rows: LossRows, config: GTPOConfig) -> torch.Tensor:
    """``[N, 1]``: VESPO's detached gamma weight ``phi(w) = exp(lambda + k log w - lambda w)`` of each completion's
    ratio ``w`` (the sum of its tokens' ``logp - old``, clamped to [-20, 20] each, plus the logs of the sampler's
    token weights), ``k, lambda`` by the sign of the completion's shaped advantage; 0 where it overflows."""
    log_w = (torch.clamp(masked.logp.detach() - masked.old(rows), -20.0, 20.0) * masked.mask).sum(dim=1, keepdim=True)
    sampler = sampling_weights(masked, rows, config)
    if sampler is not None:  # token modes only (the config refuses sequence ones here)
        log_w = log_w + (torch.clamp(torch.log(sampler), LOG_1E_8, 20.0) * masked.mask).sum(dim=1, keepdim=True)
    log_w = torch.clamp(log_w, LOG_1E_8, 20.0)
    nonneg = (masked.shaped >= 0)[:, None]
    k = torch.where(nonneg, torch.full_like(log_w, config.vespo_k_pos), torch.full_like(log_w, config.vespo_k_neg))
    lam = torch.where(
        nonneg, torch.full_like(log_w, config.vespo_lambda_pos), torch.full_like(log_w, config.vespo_lambda_neg)
    ).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def off_policy_mask(masked: _Masked, rows: LossRows, config: GTPOConfig) -> Optional[torch.Tensor]:
    """``[N, 1]``: 0 for a completion pushed down (shaped advantage < 0) whose mean ``sampling - logp`` over its
    unmasked tokens exceeds ``config.off_policy_mask_threshold`` (DeepSeek-V3.2's off-policy sequence masking;
    TRL's ``off_policy_mask_threshold``), else 1; ``None`` without a threshold. ``sampling``: the sampler's
    log-probs, else the old ones, else the current ones (then nothing is masked); NaN ones count as 0."""
    threshold = config.off_policy_mask_threshold
    if threshold is None:
        return None
    logp = masked.logp.detach()
    behaviour = rows.sampling_logprobs if rows.sampling_logprobs is not None else rows.old_logprobs
    if behaviour is None:
        behaviour = logp
    behaviour = behaviour.detach().to(masked.dtype)
    diff = torch.where(rows.valid & ~torch.isnan(behaviour), behaviour - logp, masked.zero)
    mean_kl = diff.sum(dim=1) / masked.lengths.clamp(min=1)
    dropped = (masked.shaped < 0) & (mean_kl > threshold)
    return (~dropped).to(masked.dtype)[:, None]


def sampling_weights(masked: _Masked, rows: LossRows, config: GTPOConfig) -> Optional[torch.Tensor]:
    """``[N, L]`` (or ``[N, 1]`` per completion) detached weights of the policy term that correct for a sampler
    whose probabilities differ from the trainer's (``config.sampling_correction``), or ``None`` without it.

    ``w = exp(old - sampling)`` per token, or ``exp`` of its sum over the completion's unmasked tokens, with
    ``old`` the old log-probs (the current ones, detached, on-policy); truncated to the bounds, or 0 outside
    them. A NaN sampler log-prob (none reported) contributes a difference of 0."""
    mode = config.sampling_correction
    if mode is None:
        return None
    sampled = rows.sampling_logprobs.detach().to(masked.dtype)
    diff = torch.where(rows.valid & ~torch.isnan(sampled), masked.old(rows) - sampled, masked.zero)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=1, keepdim=True)
    weight = torch.exp(diff)
    low, high = config.sampling_ratio_min, config.sampling_ratio_max
    if mode.endswith("_truncate"):
        if low is not None or high is not None:
            weight = torch.clamp(weight, min=low, max=high)
    else:
        outside = torch.zeros_like(weight, dtype=torch.bool)
        if low is not None:
            outside = outside | (weight < low)
        if high is not None:
            outside = outside | (weight > high)
        weight = torch.where(outside, masked.zero, weight)
    return weight


def token_advantages(token_entropy: torch.Tensor, rows: LossRows, config: GTPOConfig):
    """Everything GTPO does to the advantages, folded into one per-token advantage, for trainers whose policy
    loss takes per-token advantages and knows nothing of GTPO (verl).

    Args:
        token_entropy: ``[N, L]`` per-token entropies (no gradient is taken); only ``rows.valid`` positions are
            read.
        rows: the rows' mask (bool), raw advantages, conflict weights from whole groups (``None`` when the
            config does not use them) and initial entropy.

    Returns:
        ``(completion_entropy [N], keep [N], a [N, L])``: ``a = lambda * delta (A - gamma Hbar) / n`` (``n`` only
        with ``divide_by_conflict_count``), 0 at masked positions and, with ``top_entropy_quantile < 1``, at the
        tokens below that quantile of these entropies. A loss that takes ``-min(rho a, clip(rho) a)``
        per token with the config's reduction then equals `loss_from_token_stats` for the ``advantage_shift``
        mode (``n > 0`` is a per-completion factor, so it passes through the ``min``); the ``penalty`` mode's
        entropy term needs the current entropy with its gradient and cannot be folded.
    """
    if config.entropy_mode == "penalty" and config.entropy_coef > 0:
        raise ValueError(
            "entropy_mode='penalty' adds gamma * H with its gradient to the loss, which per-token "
            "advantages cannot carry: use entropy_mode='advantage_shift'"
        )
    if config.cov_mode is not None:
        raise ValueError(
            f"cov_mode={config.cov_mode!r} picks tokens by their current log-probs inside the loss, which per-token "
            "advantages cannot carry: leave it None here (verl has its own clip_cov and kl_cov policy losses)"
        )
    dtype = token_entropy.dtype if token_entropy.is_floating_point() else torch.float32
    entropy = token_entropy.detach().to(dtype)
    masked = _Masked(entropy, entropy, rows, config)
    token_advantage = masked.token_advantage
    if config.divide_by_conflict_count and rows.n_conflict is not None:
        token_advantage = token_advantage / rows.n_conflict.clamp(min=1).to(dtype)[:, None]
    if masked.high_entropy is not None:  # top_entropy_quantile: no policy term below the threshold, a = 0 there
        token_advantage = token_advantage * masked.high_entropy
    return masked.completion_entropy, masked.keep, token_advantage * masked.mask


def clip_flags(ratio: torch.Tensor, token_advantage: torch.Tensor, config: GTPOConfig):
    """``(low, high)`` ``[N, L]`` bool: where the clip takes the update away, below ``1 - eps_low`` with a
    negative advantage or above ``1 + eps_high`` with a positive one (TRL's ``clip_ratio/low`` and ``/high``)."""
    low, high = config.clip_bounds
    return (ratio < low) & (token_advantage < 0), (ratio > high) & (token_advantage > 0)


def _cispo_weight(ratio: torch.Tensor, config: GTPOConfig) -> torch.Tensor:
    """CISPO's weight on the log-prob: the ratio, capped at ``cispo_ratio_max`` (uncapped when ``None``)."""
    cap = config.cispo_ratio_max
    return ratio if cap is None else torch.clamp(ratio, max=cap)


def cispo_clipped(ratio: torch.Tensor, token_advantage: torch.Tensor, config: GTPOConfig) -> Optional[torch.Tensor]:
    """``[N, L]`` bool: where CISPO's cap lowers the weight of a token pushed up (ratio above ``cispo_ratio_max``,
    positive advantage; TRL's ``cispo_clip_ratio``), ``None`` without a cap. CISPO has no low side."""
    cap = config.cispo_ratio_max
    return None if cap is None else (ratio > cap) & (token_advantage > 0)


def _row_fraction(flags, valid, lengths):
    """``[N]``: each row's fraction of unmasked tokens flagged (0 without flags), NaN for an empty row."""
    empty = torch.where(lengths > 0, torch.zeros_like(lengths), torch.full_like(lengths, float("nan")))
    if flags is None:
        return empty
    return (flags & valid).sum(dim=1).to(lengths.dtype) / lengths.clamp(min=1) + empty


def _token_weights(rows: LossRows, lengths: torch.Tensor, config: GTPOConfig):
    """``[N, L]``: d loss / d per-token loss, the reduction's factor for each unmasked token (0 where masked)."""
    dtype = lengths.dtype
    valid, n_conflict = rows.valid, rows.n_conflict
    n_rows, n_positions = valid.shape
    sequences = n_rows if rows.num_sequences is None else rows.num_sequences
    if config.loss_reduction in ("sequence_mean", "sum"):
        row = 1.0 / lengths.clamp(min=1)
        if config.loss_reduction == "sequence_mean":
            row = row / sequences
    elif config.loss_reduction == "token_mean":
        row = torch.ones_like(lengths) / _batch_tokens(rows, lengths)
    elif config.loss_reduction == "sequence_sum":
        row = torch.ones_like(lengths) / sequences
    else:  # dr_grpo
        row = torch.ones_like(lengths) / (sequences * (config.max_completion_length or n_positions))
    if config.divide_by_conflict_count and n_conflict is not None:
        row = row / n_conflict.clamp(min=1).to(dtype)
    return torch.where(valid, row[:, None], torch.zeros((), dtype=dtype, device=lengths.device))


def _sapo_temperature(token_advantage, config: GTPOConfig):
    """SAPO's temperature of each token, in the statistics' dtype (a float32 1.05 would be 5e-8 off in float64)."""
    positive = torch.full_like(token_advantage, config.sapo_temperature_pos)
    return torch.where(token_advantage > 0, positive, torch.full_like(token_advantage, config.sapo_temperature_neg))


def _bonus_tokens(masked: _Masked) -> torch.Tensor:
    """``[N, L]``: the tokens the entropy bonus averages over: the unmasked ones, or those the top-entropy mask
    keeps."""
    return masked.mask if masked.high_entropy is None else masked.high_entropy


def _bonus_denominator(masked: _Masked, rows: LossRows) -> torch.Tensor:
    """The whole batch's tokens, times the call's kept share under the top-entropy mask: TRL's mean over the kept
    tokens when the calls hold as many tokens."""
    tokens = _batch_tokens(rows, masked.lengths)
    return tokens if masked.kept_share is None else tokens * masked.kept_share.clamp(min=1e-12)


def _batch_tokens(rows: LossRows, lengths: torch.Tensor) -> torch.Tensor:
    """The whole batch's unmasked tokens (``rows.num_tokens``, else this call's), at least 1, in ``lengths``' dtype."""
    tokens = lengths.sum() if rows.num_tokens is None else rows.num_tokens
    if not isinstance(tokens, torch.Tensor):
        tokens = torch.tensor(float(tokens), dtype=lengths.dtype, device=lengths.device)
    return tokens.to(lengths.dtype).clamp(min=1)


class _PolicyTerm(NamedTuple):
    """The policy term per token ``[N, L]`` and what the metrics report of it: the importance ratio, the tokens
    the clip (or CISPO's cap) held below or above (``None``: the ratio function has no clip), VESPO's weights."""

    per_token: torch.Tensor
    ratio: torch.Tensor
    was_clipped: Optional[torch.Tensor]
    clipped_low: Optional[torch.Tensor]
    clipped_high: Optional[torch.Tensor]
    phi: Optional[torch.Tensor]


def _policy_term(masked: _Masked, rows: LossRows, config: GTPOConfig) -> _PolicyTerm:
    """``-f(ratio) * A`` per token for ``config.ratio_function`` (the clip, CISPO, VESPO, SAPO, or none)."""
    logp, token_advantage = masked.logp, masked.token_advantage
    # Importance ratio; on-policy it is 1 in value and carries the gradient of logp.
    ratio = masked.ratio(rows, config)
    capped = ratio if config.ratio_cap is None else torch.clamp(ratio, max=config.ratio_cap)
    unclipped = capped * token_advantage
    was_clipped = clipped_low = clipped_high = phi = None
    if config.ratio_function == "cispo":  # the clipped ratio is a detached weight on the log-prob
        per_token = -_cispo_weight(ratio, config).detach() * token_advantage * logp
        clipped_high = cispo_clipped(ratio.detach(), token_advantage, config)
        was_clipped = clipped_high
    elif config.ratio_function == "vespo":  # a detached gamma weight of the completion's ratio on the log-prob
        phi = vespo_weights(masked, rows, config)
        per_token = -phi * token_advantage * logp
    elif config.ratio_function == "sapo":  # a soft gate instead of the clip
        tau = _sapo_temperature(token_advantage, config)
        per_token = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * token_advantage
    elif config.clipping:
        low, high = config.clip_bounds
        clipped = torch.clamp(ratio, low, high) * token_advantage
        per_token = -torch.minimum(unclipped, clipped)
        clipped_low, clipped_high = clip_flags(ratio.detach(), token_advantage, config)
        was_clipped = clipped_low | clipped_high
    else:
        per_token = -unclipped
    return _PolicyTerm(per_token, ratio, was_clipped, clipped_low, clipped_high, phi)


def loss_from_token_stats(
    token_logprobs: torch.Tensor, token_entropy: torch.Tensor, rows: LossRows, config: GTPOConfig
) -> GTPOLossOutput:
    """The GTPO loss from per-token log-probs and entropies.

    Args:
        token_logprobs, token_entropy: ``[N, L]`` float32/float64, differentiable; values at masked
            positions are never used (they may hold anything, even NaN).
        rows: the checked per-row inputs (`rows.checked_rows`): ``valid`` ``[N, L]`` bool (the tokens that take
            part, a prefix per row or with holes), the advantages ``[N]``, the conflict weights ``[N, L]`` and
            counts ``[N]`` (``None`` when the config does not use them), old and reference log-probs, and
            the whole batch's completions and unmasked tokens (defaults: this call's), as ints or 0-d tensors
            (tensors keep the call free of host synchronisation).

    Returns:
        `GTPOLossOutput`; the metrics describe this call's rows only (merge them with
        `GTPOMetrics.merge`).
    """
    masked = _Masked(token_logprobs, token_entropy, rows, config)
    valid, mask, lengths, zero = rows.valid, masked.mask, masked.lengths, masked.zero
    logp, entropy = masked.logp, masked.entropy
    policy = _policy_term(masked, rows, config)
    per_token, ratio = policy.per_token, policy.ratio

    weight = policy_weights(masked, rows, config)
    if weight is not None:  # the sampler's correction weighs the policy term only, not the penalty or the KL
        per_token = per_token * weight
    if config.cov_mode == "kl_cov":  # KL-Cov: |logp - old| on the tokens it picked (0 with its gradient on-policy)
        per_token = (
            per_token + config.kl_cov_coef * masked.cov_selected.to(masked.dtype) * (logp - masked.old(rows)).abs()
        )

    penalty = config.entropy_mode == "penalty" and config.entropy_coef > 0
    if penalty:
        per_token = per_token + config.entropy_coef * entropy

    kl = None
    if rows.ref_logprobs is not None:
        kl_per_token = _K3.apply(masked.given(rows, rows.ref_logprobs) - logp)  # k3, >= 0
        if config.kl_ratio_weighted:
            kl_per_token = kl_per_token * ratio  # reported weighted too, as TRL reports it
        if config.kl_beta:
            per_token = per_token + config.kl_beta * kl_per_token
        kl = (kl_per_token.detach() * mask).sum() / mask.sum().clamp(min=1)

    # The reduction: each unmasked token's factor (the whole batch's denominators when given).
    weights = _token_weights(rows, lengths, config)
    loss = (torch.where(valid, per_token, zero) * weights).sum()
    if config.entropy_bonus > 0:
        loss = loss - config.entropy_bonus * (entropy * _bonus_tokens(masked)).sum() / _bonus_denominator(masked, rows)

    return GTPOLossOutput(loss, _call_metrics(masked, rows, config, policy, weight, kl))


def _call_metrics(
    masked: _Masked,
    rows: LossRows,
    config: GTPOConfig,
    policy: _PolicyTerm,
    weight: Optional[torch.Tensor],
    kl: Optional[torch.Tensor],
) -> GTPOMetrics:
    """The call's `GTPOMetrics` (of its own rows): entropies, the filter's and the signal's shares, the conflict
    weights' and the clip's shares of tokens, the ratio's mean, the KL and the counts."""
    valid, mask, lengths, zero = rows.valid, masked.mask, masked.lengths, masked.zero
    token_advantage, completion_entropy, keep = masked.token_advantage, masked.completion_entropy, masked.keep
    dtype, device, n_rows, call_tokens = masked.dtype, valid.device, valid.shape[0], mask.sum()
    ratio, was_clipped, clipped_low, clipped_high, phi = (
        policy.ratio,
        policy.was_clipped,
        policy.clipped_low,
        policy.clipped_high,
        policy.phi,
    )

    def token_fraction(flags: Optional[torch.Tensor]) -> torch.Tensor:
        if flags is None:
            return zero
        return (flags & valid).sum().to(dtype) / call_tokens.clamp(min=1)

    non_empty = lengths > 0
    n_non_empty = non_empty.sum()
    carries = (token_advantage != 0) & valid
    if weight is not None:
        carries = carries & (weight != 0)
    has_signal = carries.any(dim=1)
    if signal_beyond_advantages(config, rows.ref_logprobs is not None):
        has_signal = torch.ones_like(has_signal)
    count = dict(dtype=torch.float64, device=device)
    return GTPOMetrics(
        entropy=(completion_entropy * lengths).sum() / call_tokens.clamp(min=1),
        completion_entropy=completion_entropy,
        filtered_fraction=((1 - keep) * non_empty).sum() / n_non_empty.clamp(min=1),
        signal_fraction=(has_signal & non_empty).sum().to(dtype) / n_non_empty.clamp(min=1),
        amplified_fraction=token_fraction(None if rows.lambda_ is None else rows.lambda_ > 1),
        skipped_fraction=token_fraction(None if rows.lambda_ is None else rows.lambda_ == 0),
        ratio_mean=(ratio.detach() * mask).sum() / call_tokens.clamp(min=1),
        clip_fraction=token_fraction(was_clipped),
        clip_low_fraction=token_fraction(clipped_low),
        clip_high_fraction=token_fraction(clipped_high),
        completion_clip_low=_row_fraction(clipped_low, valid, lengths),
        completion_clip_high=_row_fraction(clipped_high, valid, lengths),
        kl=kl,
        cov_fraction=token_fraction(masked.cov_selected),
        vespo_weight_mean=None if phi is None else phi.mean() if n_rows else zero,
        num_tokens=call_tokens.detach().to(**count),
        num_sequences=torch.full((), n_rows, **count),
        num_nonempty=n_non_empty.to(**count),
    )


def loss_and_gradients(token_logprobs: torch.Tensor, token_entropy: torch.Tensor, rows: LossRows, config: GTPOConfig):
    """``(out, d_logp, d_H)``: `loss_from_token_stats` of these rows (its loss detached) and its gradient with respect
    to ``token_logprobs`` and ``token_entropy`` ``[N, L]`` (zeros where nothing depends on them), by autograd: what
    the fused walk needs for each chunk of rows, from the one function the logits path differentiates, so that a
    term of the loss is written once. ``O(N L)``; runs inside a registered operator too (`eager_autograd`)."""
    with eager_autograd():
        logp = token_logprobs.detach().requires_grad_()
        entropy = token_entropy.detach().requires_grad_()
        out = loss_from_token_stats(logp, entropy, rows, config)
        if out.loss.requires_grad:
            d_logp, d_entropy = torch.autograd.grad(out.loss, (logp, entropy), allow_unused=True)
        else:  # nothing depends on the statistics (no rows, or every term off)
            d_logp = d_entropy = None
    d_logp = torch.zeros_like(logp) if d_logp is None else d_logp
    d_entropy = torch.zeros_like(entropy) if d_entropy is None else d_entropy
    return GTPOLossOutput(out.loss.detach(), out.metrics), d_logp, d_entropy
