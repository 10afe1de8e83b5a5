"""`GTPOConfig`: every knob of the GTPO loss, filled from a preset and validated on construction.

A field left at ``None`` takes its value from the preset; any field given explicitly overrides the
preset. See ``docs/method.md`` for what each knob does and ``../shared/SPEC.md`` for the definition.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Optional

PRESETS = ("paper", "official", "grpo")
REDUCTIONS = ("sequence_mean", "sum", "token_mean", "dr_grpo")
ENTROPY_MODES = ("advantage_shift", "penalty")

# Per-preset values of the knobs that depend on the preset (SPEC.md, "Presets").
# `entropy_threshold=None` means "no entropy filter"; `clip_eps_*=None` means "no clipping".
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


@dataclass
class GTPOConfig:
    """Configuration of the GTPO loss.

    Attributes:
        preset: ``"paper"`` (default), ``"official"`` (the authors' released code) or ``"grpo"``
            (a standard GRPO baseline: no filter, no conflict weights, clipping at 0.2).
        normalize_advantages_by_std: how a trainer turns rewards into advantages
            (``compute_advantages(..., normalize_std=...)``); the loss itself takes advantages.
        entropy_threshold: ``tau``. Completions whose mean token entropy exceeds it get no policy
            update (``delta_i = 0``). ``None`` takes the preset's value (no filter for ``"grpo"``);
            ``float("inf")`` switches a preset's filter off.
        entropy_gate: if true and ``initial_entropy`` is passed to the loss and exceeds ``tau``,
            the filter is off (the policy starts too uncertain for the threshold to mean anything).
        entropy_coef: ``gamma``, the weight of the completion entropy, either subtracted from the
            advantage (``entropy_mode="advantage_shift"``) or added to the loss as a penalty.
        entropy_mode: ``"advantage_shift"`` (``A~ = delta (A - gamma Hbar)``, ``Hbar`` detached) or
            ``"penalty"`` (``A~ = delta A`` and ``+gamma H[i,t]`` per token, with gradient, which is
            ``+gamma Hbar_i`` per completion under the sequence mean).
        use_conflict_weights: apply the conflict-token weights ``lambda`` (else ``lambda = 1``).
        conflict_weight: ``W``, the weight of a conflict token in a positive completion.
        divide_by_conflict_count: divide each completion's loss by ``n_i = max(1, max(|cf|, |cr|))``
            (the official code's behaviour).
        loss_reduction: ``"sequence_mean"`` (mean over completions of the per-completion token mean),
            ``"sum"`` (sum over completions), ``"token_mean"`` (sum over tokens / number of tokens)
            or ``"dr_grpo"`` (sum over tokens / (N * L)).
        clip_eps_low, clip_eps_high: PPO clipping range ``[1 - eps_low, 1 + eps_high]``;
            ``None`` for both disables clipping. Giving one sets the other to the same value.
        kl_beta: ``beta``, weight of the k3 KL estimate against ``ref_logprobs`` (0 disables the
            term; the KL is still reported in the metrics when reference log-probs are given).
        chunk_size: tokens per chunk for the ``"torch"`` backend (``None``: chosen so that one
            chunk's float32 logits take at most 4 MiB on the CPU, 64 MiB on a GPU).
        inplace_backward: write the gradient of the logits into the logits' own storage during
            backward, saving one ``[N, L, V]`` buffer. The logits' values are destroyed; autograd
            raises an error if another node still needs them (see README).
        validate_inputs: check shapes, dtypes, masks, ids and finiteness (cheap, on by default).
            Turning it off skips the checks that need a device synchronisation.
    """

    preset: str = "paper"
    normalize_advantages_by_std: Optional[bool] = None
    entropy_threshold: Optional[float] = None
    entropy_gate: Optional[bool] = None
    entropy_coef: Optional[float] = None
    entropy_mode: str = "advantage_shift"
    use_conflict_weights: Optional[bool] = None
    conflict_weight: float = 2.0
    divide_by_conflict_count: Optional[bool] = None
    loss_reduction: Optional[str] = None
    clip_eps_low: Optional[float] = None
    clip_eps_high: Optional[float] = None
    kl_beta: float = 0.0
    chunk_size: Optional[int] = None
    inplace_backward: bool = False
    validate_inputs: bool = True

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"GTPOConfig: preset must be one of {PRESETS}, got {self.preset!r}")
        # `None` means "take the preset's value", so a preset's entropy filter is switched off with
        # entropy_threshold=float("inf") (no completion's entropy exceeds it), not with None.
        clip_given = self.clip_eps_low is not None or self.clip_eps_high is not None
        for name, value in _PRESET_VALUES[self.preset].items():
            if name in ("clip_eps_low", "clip_eps_high") and clip_given:
                continue
            if getattr(self, name) is None:
                setattr(self, name, value)
        if clip_given:
            if self.clip_eps_low is None:
                self.clip_eps_low = self.clip_eps_high
            if self.clip_eps_high is None:
                self.clip_eps_high = self.clip_eps_low
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"GTPOConfig: {name} {why} (got {getattr(self, name)!r})")

        tau = self.entropy_threshold
        if tau is not None and not (isinstance(tau, (int, float)) and tau > 0 and not math.isnan(tau)):
            raise bad("entropy_threshold", "must be a positive number (float('inf') disables the filter)")
        if not (isinstance(self.entropy_coef, (int, float)) and math.isfinite(self.entropy_coef)
                and self.entropy_coef >= 0):
            raise bad("entropy_coef", "must be a finite number >= 0")
        if self.entropy_mode not in ENTROPY_MODES:
            raise bad("entropy_mode", f"must be one of {ENTROPY_MODES}")
        if not (isinstance(self.conflict_weight, (int, float)) and math.isfinite(self.conflict_weight)
                and self.conflict_weight > 0):
            raise bad("conflict_weight", "must be a finite number > 0 (use use_conflict_weights=False for 1)")
        if self.loss_reduction not in REDUCTIONS:
            raise bad("loss_reduction", f"must be one of {REDUCTIONS}")
        for name in ("clip_eps_low", "clip_eps_high"):
            eps = getattr(self, name)
            if eps is not None and not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
                raise bad(name, "must be a finite number >= 0, or None for no clipping")
        if self.clip_eps_low is not None and self.clip_eps_low >= 1:
            raise bad("clip_eps_low", "must be < 1 so that the lower clip bound 1 - eps_low stays positive")
        if not (isinstance(self.kl_beta, (int, float)) and math.isfinite(self.kl_beta) and self.kl_beta >= 0):
            raise bad("kl_beta", "must be a finite number >= 0")
        if self.chunk_size is not None and not (isinstance(self.chunk_size, int) and self.chunk_size > 0):
            raise bad("chunk_size", "must be a positive int, or None to choose automatically")
        for name in ("normalize_advantages_by_std", "entropy_gate", "use_conflict_weights",
                     "divide_by_conflict_count", "inplace_backward", "validate_inputs"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be True or False")

    @property
    def clipping(self) -> bool:
        return self.clip_eps_low is not None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "GTPOConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"GTPOConfig: unknown field(s) {unknown}; known fields are {sorted(known)}")
        return cls(**values)
