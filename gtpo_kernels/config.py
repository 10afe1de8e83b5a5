"""`GTPOConfig`: every knob of the GTPO loss, filled from a preset, validated, immutable.

One rule, and no state beyond the fields: a preset fills the knobs left unset at construction. A knob left at its
default (``PRESET``, the string ``"<from the preset>"``, in the class's signature, never in an instance) takes the
preset's value; any value given, ``None`` included, wins. An instance holds only resolved values, so configs with
equal fields are equal and behave the same everywhere.

Changing a config (it is frozen, validated once):

* ``config.replace(**changes)``: ``changes`` win; when ``preset`` changes, every knob the old preset governs whose
  value is still the old preset's follows the new preset, and the others are kept (the user's choices):
  ``GTPOConfig(entropy_coef=0.05).replace(preset="grpo")`` is the ``grpo`` preset with ``entropy_coef=0.05``.
* ``dataclasses.replace(config, **changes)``: a copy of every field with ``changes`` (nothing is unset in a copy,
  so a new ``preset`` fills nothing: it only relabels); use ``config.replace`` to switch presets.

The fields come in three groups: the method (GTPO's knobs and the presets'), the terms of other trainers' losses
(TRL's names in the docstrings), and execution (memory, checks).

See ``docs/method.md`` for the definition and what each knob does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Optional, Tuple

PRESETS = ("paper", "official", "grpo")
REDUCTIONS = ("sequence_mean", "sum", "token_mean", "dr_grpo", "sequence_sum")
ENTROPY_MODES = ("advantage_shift", "penalty")
# Which completions the advantage shift reaches: every one (the paper's), or those whose advantage is not 0 (a
# variant: a group whose rewards tie, every A = 0, then gets no signal, as in GRPO).
ENTROPY_SHIFT_SCOPES = ("all", "nonzero_advantage")
# How the sampler's log-probs correct the policy term (TRL's vllm_importance_sampling_mode): the ratio of the
# trainer's to the sampler's probability per token or per completion, truncated at the bounds or zeroed outside.
SAMPLING_CORRECTIONS = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
# Where the importance ratio is taken: per token (PPO's), or per completion (GSPO: the geometric mean of its tokens').
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
# The policy term's function of the ratio (TRL's loss types): PPO's clipped surrogate, CISPO's clipped detached
# weight on the log-prob, SAPO's soft gate.
RATIO_FUNCTIONS = ("clip", "cispo", "sapo", "vespo")
# The covariance-based token controls (Clip-Cov, KL-Cov): the tokens whose centred log-prob x advantage product is
# high lose their policy gradient, or get a KL term to the old policy. The share of tokens each picks by default.
COV_MODES = ("clip_cov", "kl_cov")
COV_RATIO_DEFAULTS = {"clip_cov": 2e-4, "kl_cov": 2e-3}


# Default of the knobs a preset fills: "not given by the user". A string, not a sentinel object, so that
# torch.compile can trace a config built inside a compiled function (Dynamo wraps str constants, not
# instances of a private class).
PRESET: Any = "<from the preset>"

# Per-preset values of the knobs that depend on the preset (docs/method.md, "Presets").
# `entropy_threshold=None`: no entropy filter. `clip_eps_*=None`: that side of the clip is open.
_PRESET_VALUES = {
    "paper": dict(
        normalize_advantages_by_std=False,
        entropy_threshold=math.log(2.0),
        entropy_gate=True,
        entropy_coef=0.1,
        use_conflict_weights=True,
        divide_by_conflict_count=False,
        loss_reduction="sequence_mean",
        clip_eps_low=None,
        clip_eps_high=None,
    ),
    "official": dict(
        normalize_advantages_by_std=False,
        entropy_threshold=0.7,
        entropy_gate=False,
        entropy_coef=0.1,
        use_conflict_weights=True,
        divide_by_conflict_count=True,
        loss_reduction="sum",
        clip_eps_low=None,
        clip_eps_high=None,
    ),
    "grpo": dict(
        normalize_advantages_by_std=True,
        entropy_threshold=None,
        entropy_gate=False,
        entropy_coef=0.0,
        use_conflict_weights=False,
        divide_by_conflict_count=False,
        loss_reduction="sequence_mean",
        clip_eps_low=0.2,
        clip_eps_high=0.2,
    ),
}
PRESET_FIELDS = tuple(_PRESET_VALUES["paper"])


def _same(a, b) -> bool:
    return type(a) is type(b) and a == b


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)


@dataclass(frozen=True)
class GTPOConfig:
    """Configuration of the GTPO loss.

    Attributes:
        preset: ``"paper"`` (default), ``"official"`` (the authors' released code) or ``"grpo"``
            (a standard GRPO baseline: no filter, no conflict weights, clipping at 0.2).
        normalize_advantages_by_std: how a trainer turns rewards into advantages
            (``compute_advantages(..., normalize_std=...)``); the loss itself takes advantages.
        entropy_threshold: ``tau``. Completions whose mean token entropy exceeds it get no policy
            update (``delta_i = 0``). ``None`` or ``float("inf")``: no filter.
        entropy_gate: if true and ``initial_entropy`` is passed to the loss and exceeds ``tau``,
            the filter is off (the policy starts too uncertain for the threshold to mean anything).
        entropy_coef: ``gamma``, the weight of the completion entropy, either subtracted from the
            advantage (``entropy_mode="advantage_shift"``) or added to the loss as a penalty.
        entropy_mode: ``"advantage_shift"`` (``A~ = delta (A - gamma Hbar)``, ``Hbar`` detached) or
            ``"penalty"`` (``A~ = delta A`` and ``+gamma H[i,t]`` per token, with gradient, which is
            ``+gamma Hbar_i`` per completion under the sequence mean).
        entropy_shift_scope: which completions ``advantage_shift`` shifts: ``"all"`` (the paper's: a group whose
            rewards tie, every ``A = 0``, still gets ``A~ = -gamma Hbar``), or ``"nonzero_advantage"`` (a variant,
            not the paper's: ``A~ = delta A`` where ``A = 0``, so a tied group gives no signal, as in GRPO; with 0/1
            rewards that is "only groups whose rewards differ", and with graded rewards a completion whose reward
            is its group's mean is left unshifted too). Refused with ``entropy_mode="penalty"``.
        use_conflict_weights: apply the conflict-token weights ``lambda`` (else ``lambda = 1``, and the
            losses ignore a ``conflict`` argument).
        conflict_weight: ``W``, the weight of a conflict token in a positive completion.
        divide_by_conflict_count: divide each completion's loss by ``n_i = max(1, max(|cf|, |cr|))``
            (the official code's behaviour).
        loss_reduction: ``"sequence_mean"`` (mean over completions of the per-completion token mean),
            ``"sum"`` (sum over completions), ``"token_mean"`` (sum over tokens / number of tokens)
            ``"dr_grpo"`` (sum over tokens / (N * max_completion_length), or (N * L) without it) or
            ``"sequence_sum"`` (mean over completions of the per-completion token sum: LUSPO's length scaling;
            TRL's ``loss_type='luspo'``).
        clip_eps_low, clip_eps_high: PPO clipping range ``[1 - eps_low, 1 + eps_high]``. ``None`` (or
            ``inf``) leaves that side open; both ``None`` switches clipping off, in every preset. A side
            not given takes the preset's value, or, for presets without clipping, the given side's
            value (``clip_eps_low=0.2`` alone clips symmetrically).
        kl_beta: ``beta``, weight of the k3 KL estimate against ``ref_logprobs`` (0 disables the
            term; the KL is still reported in the metrics when reference log-probs are given).
        ratio_cap: ``delta``: two-sided clipping (INTELLECT-2; TRL's ``delta``): the unclipped branch takes
            ``min(rho, delta) a``, so a negative advantage's update stops growing once the ratio passes
            ``delta``. ``None``: no cap. Must be > 1 (TRL recommends > ``1 + eps_high``).
        kl_ratio_weighted: weight the KL term by the importance ratio ``rho`` (with its gradient), which makes
            its gradient the unbiased reverse-KL gradient off-policy (DeepSeek-V3.2; TRL's
            ``use_bias_correction_kl``). On-policy ``rho = 1`` in value but the gradient still changes.
        entropy_bonus: TRL's entropy bonus (its ``entropy_coef``, not GTPO's ``entropy_coef``): the loss gets
            ``- entropy_bonus * sum(H) / num_tokens`` over the unmasked tokens (the whole batch's token mean,
            with its gradient), whatever the reduction. 0: off.
        ratio_function: the policy term as a function of the ratio ``rho`` and the per-token advantage ``a``:
            ``"clip"``, ``-min(min(rho, delta) a, clip(rho) a)`` (PPO's, with the clip range and ``ratio_cap``);
            ``"cispo"``, ``-sg(min(rho, cispo_ratio_max)) a logp`` (MiniMax-M1; TRL's ``loss_type='cispo'``,
            whose cap is its ``epsilon_high``); ``"sapo"``, ``-sigmoid(tau (rho - 1)) 4 / tau a`` with ``tau`` =
            ``sapo_temperature_pos`` where ``a > 0``, else ``sapo_temperature_neg`` (TRL's ``'sapo'``). The clip
            range and ``ratio_cap`` are PPO's: with ``"cispo"`` or ``"sapo"`` the clip metrics are 0 and a
            ``ratio_cap`` is refused.
        importance_sampling_level: ``"token"`` (``rho = exp(logp - old)`` per token) or ``"sequence"`` (GSPO; TRL's
            ``importance_sampling_level='sequence'``): one ratio per completion, ``exp`` of the mean of
            ``logp - old`` over its unmasked tokens, with its gradient, in the policy term of every ratio function
            and in the ratio-weighted KL.
        vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: VESPO's gamma weight
            ``phi(w) = exp(lambda + k log w - lambda w)`` (``phi(1) = 1``) of the completion's ratio
            ``w = exp(sum_t (logp - old))`` (the sampler's token weights' logs added, instead of multiplying the
            term), detached, ``k, lambda`` by the sign of the completion's shaped advantage; the policy term is
            ``-phi a logp`` (``ratio_function="vespo"``; TRL's ``loss_type='vespo'``, its defaults 2, 3, 3, 2).
        cispo_ratio_max: CISPO's cap on the detached ratio (``None``: uncapped).
        sapo_temperature_pos, sapo_temperature_neg: SAPO's gate temperatures (> 0; TRL's defaults 1 and 1.05).
        sampling_correction: the correction for a sampler whose probabilities differ from the trainer's (vLLM,
            SGLang), from the sampler's per-token log-probs (``sampling_logprobs``, a per-row input): each
            token's policy term is multiplied by the detached weight ``w = exp(old - sampling)`` per token
            (``"token_*"``) or ``exp(sum over the completion's tokens)`` per completion (``"sequence_*"``),
            ``old`` being ``old_logprobs`` (or the current log-probs, detached, without them); ``"*_truncate"``
            clamps ``w`` to ``[sampling_ratio_min, sampling_ratio_max]``, ``"*_mask"`` sets it to 0 outside.
            A sampler log-prob that is NaN (not reported) counts as equal to the trainer's. The KL and the
            entropy penalty are not weighted (TRL's ``vllm_importance_sampling_correction``). ``None``: off.
        sampling_ratio_min, sampling_ratio_max: the bounds of ``w`` (``None``: open); TRL's
            ``vllm_importance_sampling_clip_min`` / ``_max`` (defaults ``None`` and 3).
        off_policy_mask_threshold: DeepSeek-V3.2's off-policy sequence masking (TRL's ``off_policy_mask_threshold``):
            a completion whose shaped advantage is negative and whose mean ``sampling - logp`` over its tokens (the
            sampler's log-probs, else the old ones) exceeds this gets no policy term. ``None``: off.
        top_entropy_quantile: ``rho``: the policy term acts only on the tokens whose entropy is at least the
            ``1 - rho`` quantile of the call's unmasked tokens' entropies (torch.quantile's linear interpolation;
            across the processes of ``entropy_quantile_group`` when the loss is given one), the "80/20" forking
            tokens (TRL's ``top_entropy_quantile``); the entropy bonus then averages over the same tokens (its
            denominator scaled by the call's share of them). The KL and the entropy penalty stay on every token.
            A quantile of one call's tokens: calls over a partition of a batch differ from one call over it.
            1.0: off (every token).
        cov_mode: a covariance-based token control, from the call's tokens' ``cov_t = (a_t - mean a) (logp_t - mean
            logp)`` (``a``: the per-token advantage of the policy term, ``lambda A~``; the means over the call's
            unmasked tokens, detached): ``"clip_cov"`` (Clip-Cov) picks ``k`` tokens at random among those with
            ``clip_cov_low < cov_t < clip_cov_high`` that PPO's clip does not already hold, and their policy term
            is 0 (no gradient, no value); ``"kl_cov"`` (KL-Cov) picks the ``k`` tokens of highest ``cov_t`` and adds
            ``kl_cov_coef * |logp - old|`` to their policy term (with its gradient: 0 on-policy, where
            ``logp = old``, so it needs several updates per rollout). ``k = max(1, floor(cov_ratio * tokens))``
            of the call's unmasked tokens. Clip-Cov's draw is ``[N, L]`` uniform numbers from torch's CPU
            generator, once per call (seed torch for a reproducible run). ``None``: off.
        cov_ratio: the share of tokens ``cov_mode`` picks; ``None``: 2e-4 for ``clip_cov``, 2e-3 for ``kl_cov``
            (the values of the method's authors for a 7B model; a small batch may want more: ``k`` is at least 1).
        clip_cov_low, clip_cov_high: Clip-Cov's band of ``cov_t`` (defaults 1 and 5).
        kl_cov_coef: KL-Cov's weight of ``|logp - old|`` (default 1).
        max_completion_length: the generation cap. When set, ``dr_grpo`` divides by
            ``num_sequences * max_completion_length`` (TRL's and Liger's convention), so the loss does
            not depend on how much padding a batch happens to carry.
        max_chunk_bytes: bytes of float32 logits that one chunk of work may hold: the ``"torch"`` backend's
            token chunks in `gtpo_loss`, and the chunks of ``hidden @ lm_head`` in `fused_linear_gtpo_loss`
            and the ``"torch"`` backend's passes inside each fused chunk (the statistics functions,
            `token_logprobs_and_entropy` and `fused_linear_token_logprobs_and_entropy`, take the same budget as
            their own ``max_chunk_bytes=``). ``None``: 4 MiB on the CPU for the torch backend's elementwise
            passes, and 256 MiB for the fused path's GEMMs on the CPU or 2 GiB on a GPU (a constant,
            never the free memory, so that gradients are bitwise reproducible; lower it on a small GPU).
        inplace_backward: write the gradient of the logits into the logits' own storage during
            backward, saving one ``[N, L, V]`` buffer. The logits' values are destroyed; autograd
            raises an error if another node still needs them (see README).
        validate_inputs: check shapes, dtypes, masks, ids and finiteness (cheap, on by default).
            Turning it off skips the checks that need a device synchronisation.
        warn_no_signal: warn (once per process) when a loss call has no learning signal at all (every
            completion filtered, or every advantage 0): its loss and gradient are then exactly 0, which
            looks like a broken loss. Read with the input checks (no synchronisation of its own; off with
            ``validate_inputs=False``). The fused path sees zero advantages, not the entropy filter (its
            statistics come after its one read); ``metrics.filtered_fraction`` says so.
    """

    # ---- the method: GTPO's knobs (a preset fills those at PRESET)
    preset: str = "paper"
    normalize_advantages_by_std: Optional[bool] = PRESET
    entropy_threshold: Optional[float] = PRESET
    entropy_gate: Optional[bool] = PRESET
    entropy_coef: Optional[float] = PRESET
    entropy_mode: str = "advantage_shift"
    entropy_shift_scope: str = "all"
    use_conflict_weights: Optional[bool] = PRESET
    conflict_weight: float = 2.0
    divide_by_conflict_count: Optional[bool] = PRESET
    loss_reduction: Optional[str] = PRESET
    clip_eps_low: Optional[float] = PRESET
    clip_eps_high: Optional[float] = PRESET
    kl_beta: float = 0.0
    max_completion_length: Optional[int] = None
    # ---- the terms of other trainers' losses (TRL's GRPOTrainer and its relatives)
    ratio_cap: Optional[float] = None
    kl_ratio_weighted: bool = False
    entropy_bonus: float = 0.0
    ratio_function: str = "clip"
    importance_sampling_level: str = "token"
    cispo_ratio_max: Optional[float] = 5.0
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    sampling_correction: Optional[str] = None
    sampling_ratio_min: Optional[float] = None
    sampling_ratio_max: Optional[float] = 3.0
    off_policy_mask_threshold: Optional[float] = None
    top_entropy_quantile: float = 1.0
    cov_mode: Optional[str] = None
    cov_ratio: Optional[float] = None
    clip_cov_low: float = 1.0
    clip_cov_high: float = 5.0
    kl_cov_coef: float = 1.0
    # ---- execution: memory and checks (the loss's value does not depend on them)
    max_chunk_bytes: Optional[int] = None
    inplace_backward: bool = False
    validate_inputs: bool = True
    warn_no_signal: bool = True

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"GTPOConfig: preset must be one of {PRESETS}, got {self.preset!r}")
        given = {name for name in PRESET_FIELDS if getattr(self, name) is not PRESET}
        preset = _PRESET_VALUES[self.preset]
        for name in PRESET_FIELDS:
            if name not in given:
                object.__setattr__(self, name, preset[name])
        low_given, high_given = "clip_eps_low" in given, "clip_eps_high" in given
        if low_given != high_given and preset["clip_eps_low"] is None:
            # A preset without clipping: one side given means symmetric clipping.
            one = self.clip_eps_low if low_given else self.clip_eps_high
            object.__setattr__(self, "clip_eps_high" if low_given else "clip_eps_low", one)
        self._validate()

    def _bad(self, name: str, why: str) -> ValueError:
        return ValueError(f"GTPOConfig: {name} {why} (got {getattr(self, name)!r})")

    def _validate(self) -> None:
        """GTPO's own knobs (entropy, conflict weights, reduction, clipping, KL) and the flags; then the policy
        term's (`_validate_policy_term`)."""
        bad, is_number = self._bad, _is_number

        tau = self.entropy_threshold
        if tau is not None and not (is_number(tau) and tau > 0):
            raise bad("entropy_threshold", "must be a positive number, or None / float('inf') for no filter")
        if not (is_number(self.entropy_coef) and math.isfinite(self.entropy_coef) and self.entropy_coef >= 0):
            raise bad("entropy_coef", "must be a finite number >= 0")
        if self.entropy_mode not in ENTROPY_MODES:
            raise bad("entropy_mode", f"must be one of {ENTROPY_MODES}")
        if self.entropy_shift_scope not in ENTROPY_SHIFT_SCOPES:
            raise bad("entropy_shift_scope", f"must be one of {ENTROPY_SHIFT_SCOPES}")
        if self.entropy_shift_scope != "all" and self.entropy_mode != "advantage_shift":
            raise bad("entropy_shift_scope", "scopes the advantage shift: it needs entropy_mode='advantage_shift'")
        if not (is_number(self.conflict_weight) and math.isfinite(self.conflict_weight) and self.conflict_weight > 0):
            raise bad("conflict_weight", "must be a finite number > 0 (use use_conflict_weights=False for 1)")
        if self.loss_reduction not in REDUCTIONS:
            raise bad("loss_reduction", f"must be one of {REDUCTIONS}")
        if self.clip_eps_low is not None and not (
            is_number(self.clip_eps_low)
            and self.clip_eps_low >= 0
            and (self.clip_eps_low < 1 or math.isinf(self.clip_eps_low))
        ):
            raise bad(
                "clip_eps_low",
                "must be a number in [0, 1) (the lower clip bound 1 - eps_low stays "
                "positive), or None / float('inf') to leave the lower side open",
            )
        if self.clip_eps_high is not None and not (is_number(self.clip_eps_high) and self.clip_eps_high >= 0):
            raise bad("clip_eps_high", "must be a number >= 0, or None / float('inf') to leave the upper side open")
        if not (is_number(self.kl_beta) and math.isfinite(self.kl_beta) and self.kl_beta >= 0):
            raise bad("kl_beta", "must be a finite number >= 0")
        if self.ratio_cap is not None and not (is_number(self.ratio_cap) and self.ratio_cap > 1):
            raise bad("ratio_cap", "must be a number > 1 (the cap on the unclipped ratio), or None for no cap")
        if not (is_number(self.entropy_bonus) and math.isfinite(self.entropy_bonus) and self.entropy_bonus >= 0):
            raise bad("entropy_bonus", "must be a finite number >= 0")
        self._validate_policy_term()
        for name in ("max_completion_length", "max_chunk_bytes"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
                raise bad(name, "must be a positive int, or None")
        for name in (
            "normalize_advantages_by_std",
            "entropy_gate",
            "use_conflict_weights",
            "divide_by_conflict_count",
            "inplace_backward",
            "validate_inputs",
            "warn_no_signal",
            "kl_ratio_weighted",
        ):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be True or False")

    def _validate_policy_term(self) -> None:
        """The policy term's knobs: the ratio's level and function (CISPO, VESPO, SAPO), the sampler's correction,
        the off-policy mask and the high-entropy token share."""
        bad, is_number = self._bad, _is_number
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise bad("importance_sampling_level", f"must be one of {IMPORTANCE_SAMPLING_LEVELS}")
        if self.ratio_function not in RATIO_FUNCTIONS:
            raise bad("ratio_function", f"must be one of {RATIO_FUNCTIONS}")
        if self.ratio_function != "clip" and self.ratio_cap is not None:
            why = f"is PPO's two-sided clipping, which ratio_function={self.ratio_function!r} has no place for"
            raise bad("ratio_cap", why + "; leave it None")
        if self.cispo_ratio_max is not None and not (is_number(self.cispo_ratio_max) and self.cispo_ratio_max > 0):
            raise bad("cispo_ratio_max", "must be a number > 0, or None for no cap")
        for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            value = getattr(self, name)
            if not (is_number(value) and math.isfinite(value) and value >= 0):
                raise bad(name, "must be a finite number >= 0")
        if self.ratio_function == "vespo" and (self.sampling_correction or "").startswith("sequence"):
            raise bad(
                "sampling_correction",
                "with ratio_function='vespo' must be a token mode: VESPO adds the sampler's token weights to its "
                "own sequence ratio",
            )
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            value = getattr(self, name)
            if not (is_number(value) and math.isfinite(value) and value > 0):
                raise bad(name, "must be a finite number > 0")
        if self.sampling_correction is not None and self.sampling_correction not in SAMPLING_CORRECTIONS:
            raise bad("sampling_correction", f"must be one of {SAMPLING_CORRECTIONS}, or None for no correction")
        for name in ("sampling_ratio_min", "sampling_ratio_max"):
            value = getattr(self, name)
            if value is not None and not (is_number(value) and value >= 0):
                raise bad(name, "must be a number >= 0, or None for an open side")
        low, high = self.sampling_ratio_min, self.sampling_ratio_max
        if low is not None and high is not None and low > high:
            raise bad("sampling_ratio_min", f"must not exceed sampling_ratio_max ({high!r})")
        threshold = self.off_policy_mask_threshold
        if threshold is not None and not (is_number(threshold) and math.isfinite(threshold) and threshold >= 0):
            raise bad("off_policy_mask_threshold", "must be a finite number >= 0 (a mean KL), or None")
        rho = self.top_entropy_quantile
        if not (is_number(rho) and 0 < rho <= 1):
            raise bad("top_entropy_quantile", "must be a number in (0, 1] (the share of tokens kept; 1: all)")
        self._validate_cov()

    def _validate_cov(self) -> None:
        """Clip-Cov's and KL-Cov's knobs."""
        bad, is_number = self._bad, _is_number
        if self.cov_mode is not None and self.cov_mode not in COV_MODES:
            raise bad("cov_mode", f"must be one of {COV_MODES}, or None for neither")
        ratio = self.cov_ratio
        if ratio is not None and not (is_number(ratio) and 0 < ratio <= 1):
            raise bad("cov_ratio", "must be a number in (0, 1] (the share of tokens picked), or None for the default")
        for name in ("clip_cov_low", "clip_cov_high", "kl_cov_coef"):
            if not (is_number(getattr(self, name)) and math.isfinite(getattr(self, name))):
                raise bad(name, "must be a finite number")
        if not self.clip_cov_low < self.clip_cov_high:
            raise bad("clip_cov_low", f"must be below clip_cov_high ({self.clip_cov_high!r}): they bound a band")
        if self.kl_cov_coef < 0:
            raise bad("kl_cov_coef", "must be >= 0")

    # The properties below compare with inf rather than call math.isfinite: torch.compile traces them, and
    # may hold a config's floats as symbols, which math.isfinite does not take.
    @property
    def clipping(self) -> bool:
        """Whether any side of the ratio is clipped (PPO's surrogate only: the other ratio functions have no clip
        range)."""
        if self.ratio_function != "clip":
            return False
        return any(eps is not None and eps < math.inf for eps in (self.clip_eps_low, self.clip_eps_high))

    @property
    def clip_bounds(self) -> Tuple[float, float]:
        """``(1 - eps_low, 1 + eps_high)``, ``-inf`` / ``inf`` for an open side."""
        low = -math.inf if self.clip_eps_low is None or self.clip_eps_low == math.inf else 1.0 - self.clip_eps_low
        high = math.inf if self.clip_eps_high is None else 1.0 + self.clip_eps_high
        return low, high

    @property
    def cov_share(self) -> float:
        """The share of tokens ``cov_mode`` picks: ``cov_ratio``, or the mode's default (0 without a mode)."""
        if self.cov_mode is None:
            return 0.0
        return COV_RATIO_DEFAULTS[self.cov_mode] if self.cov_ratio is None else self.cov_ratio

    @property
    def entropy_filter(self) -> bool:
        """Whether a finite entropy threshold is set (the gate may still switch it off per call)."""
        return self.entropy_threshold is not None and self.entropy_threshold < math.inf

    def replace(self, **changes) -> GTPOConfig:
        """A copy with ``changes``. A new ``preset`` takes over every knob it governs whose value is still the old
        preset's; the knobs set otherwise are kept (see the module's notes)."""
        known = _field_names()
        unknown = sorted(set(changes) - set(known))
        if unknown:
            raise ValueError(f"GTPOConfig.replace: unknown field(s) {unknown}; known fields are {sorted(known)}")
        values = self.to_dict()
        new_preset = changes.get("preset", self.preset)
        if new_preset != self.preset:
            old = _PRESET_VALUES[self.preset]
            for name in PRESET_FIELDS:
                if _same(values[name], old[name]):
                    del values[name]  # the old preset's value: the new preset fills it
        values.update(changes)
        return GTPOConfig(**values)

    def to_dict(self) -> dict:
        """Every knob's resolved value (``GTPOConfig.from_dict`` gives an equal config back)."""
        return {name: getattr(self, name) for name in _field_names()}

    @classmethod
    def from_dict(cls, values: dict) -> GTPOConfig:
        """A config from `to_dict`'s (or an earlier version's) values; an unknown field is refused."""
        known = _field_names()
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"GTPOConfig: unknown field(s) {unknown}; known fields are {sorted(known)}")
        return cls(**values)


FIELD_NAMES = tuple(f.name for f in fields(GTPOConfig))  # every field, in the dataclass's order (a constant, traceable)


def _field_names() -> Tuple[str, ...]:
    return FIELD_NAMES
