"""What the losses return: the differentiable loss and detached metrics that merge across calls."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import List, NamedTuple, Optional, Sequence

import torch

# Each averaged metric and the count it is averaged over: merging several calls weights each call's
# mean by its count, which is exact (the whole batch's mean is the count-weighted mean of the parts').
_AVERAGED_OVER = {
    "entropy": "num_tokens",
    "filtered_fraction": "num_nonempty",
    "signal_fraction": "num_nonempty",
    "amplified_fraction": "num_tokens",
    "skipped_fraction": "num_tokens",
    "ratio_mean": "num_tokens",
    "clip_fraction": "num_tokens",
    "clip_low_fraction": "num_tokens",
    "clip_high_fraction": "num_tokens",
    "kl": "num_tokens",
    "cov_fraction": "num_tokens",
    "vespo_weight_mean": "num_sequences",
}
_COUNTS = ("num_tokens", "num_sequences", "num_nonempty")
# Layout of `GTPOMetrics.to_sums()`: every mean times its count, then the counts, then whether the optional ones
# (kl, vespo_weight_mean) were there.
_OPTIONAL = {"has_kl": "kl", "has_vespo": "vespo_weight_mean"}
_SUM_LAYOUT = tuple(_AVERAGED_OVER) + _COUNTS + tuple(_OPTIONAL)
SUMS_SIZE = len(_SUM_LAYOUT)
# Per-completion values that `to_dict` leaves out (their mean is not a metric of the call: see the fractions).
_PER_ROW_ONLY = ("completion_clip_low", "completion_clip_high")
# Every per-completion metric ([N]; what `to_sums` cannot carry), in the fused operator's output order.
ROW_METRICS = ("completion_entropy",) + _PER_ROW_ONLY


@dataclass
class GTPOMetrics:
    """Detached diagnostics of one loss call (0-d tensors unless a shape is given).

    Attributes:
        entropy: mean token entropy over unmasked tokens (nats).
        completion_entropy: ``Hbar [N]``, each completion's mean token entropy (``None`` after
            `from_sums`: per-row values do not survive an all-reduce).
        filtered_fraction: fraction of non-empty completions dropped by the entropy filter.
        signal_fraction: fraction of non-empty completions whose loss has a gradient: some unmasked token
            with a non-zero per-token advantage ``lambda * A~``, or an entropy penalty or KL term. 0 means
            the call's gradient is exactly zero (every completion filtered, or every advantage 0).
        amplified_fraction: fraction of unmasked tokens with ``lambda > 1`` (conflicts, positive).
        skipped_fraction: fraction of unmasked tokens with ``lambda = 0`` (conflicts, negative).
        ratio_mean: mean importance ratio ``exp(logp - logp_old)`` over unmasked tokens.
        clip_fraction: fraction of unmasked tokens whose update was clipped (0 without clipping):
            ``clip_low_fraction`` (ratio below ``1 - eps_low`` with a negative advantage) plus
            ``clip_high_fraction`` (above ``1 + eps_high`` with a positive one), TRL's ``clip_ratio/*``.
        completion_clip_low, completion_clip_high: ``[N]``, each completion's clipped fraction on each side (NaN
            for an empty completion); per-row, like ``completion_entropy`` (``None`` after `from_sums`).
        kl: mean k3 estimate of KL(policy || reference) over unmasked tokens, or ``None`` without
            ``ref_logprobs``.
        cov_fraction: fraction of unmasked tokens Clip-Cov or KL-Cov picked (``cov_mode``; 0 without it).
        vespo_weight_mean: VESPO's mean gamma weight ``phi`` over the completions (TRL's ``vespo/phi_seq_mean``), or
            ``None`` unless ``ratio_function='vespo'``.
        num_tokens, num_sequences, num_nonempty: this call's unmasked tokens, completions and non-empty
            completions (float64 0-d tensors): the weights that merge calls exactly.

    Merging: ``GTPOMetrics.merge([m1, m2, ...])`` gives the metrics of the union of the calls' rows (as if
    one call had seen them all). Across processes, all-reduce (sum) ``m.to_sums()`` and rebuild with
    ``GTPOMetrics.from_sums(total)``.
    """

    entropy: torch.Tensor
    completion_entropy: Optional[torch.Tensor]
    filtered_fraction: torch.Tensor
    amplified_fraction: torch.Tensor
    skipped_fraction: torch.Tensor
    ratio_mean: torch.Tensor
    clip_fraction: torch.Tensor
    kl: Optional[torch.Tensor] = None
    signal_fraction: Optional[torch.Tensor] = None
    num_tokens: Optional[torch.Tensor] = None
    num_sequences: Optional[torch.Tensor] = None
    num_nonempty: Optional[torch.Tensor] = None
    clip_low_fraction: Optional[torch.Tensor] = None
    clip_high_fraction: Optional[torch.Tensor] = None
    completion_clip_low: Optional[torch.Tensor] = None
    completion_clip_high: Optional[torch.Tensor] = None
    vespo_weight_mean: Optional[torch.Tensor] = None
    cov_fraction: Optional[torch.Tensor] = None

    def to_dict(self) -> dict:
        """Scalar metrics as Python floats, read in one device sync; ``completion_entropy`` is averaged."""
        names, values = [], []
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or f.name in _PER_ROW_ONLY:
                continue
            names.append(f.name)
            values.append(
                value.detach().to(torch.float64).mean()
                if value.numel()
                else torch.zeros((), dtype=torch.float64, device=value.device)
            )
        if not values:
            return {}
        return dict(zip(names, torch.stack([v.to(values[0].device) for v in values]).tolist()))

    def to_sums(self) -> torch.Tensor:
        """A float64 vector of sums and counts; the elementwise sum of several calls' vectors (for
        example ``torch.distributed.all_reduce``) is the vector of their union (see `from_sums`)."""
        device = self.entropy.device
        values = []
        for name in _SUM_LAYOUT:
            if name in _OPTIONAL:
                present = getattr(self, _OPTIONAL[name]) is not None
                values.append(torch.tensor(1.0 if present else 0.0, dtype=torch.float64, device=device))
            elif name in _COUNTS:
                values.append(getattr(self, name).to(torch.float64))
            else:
                mean = getattr(self, name)
                weight = getattr(self, _AVERAGED_OVER[name]).to(torch.float64)
                values.append(
                    torch.zeros((), dtype=torch.float64, device=device)
                    if mean is None
                    else mean.detach().to(torch.float64) * weight
                )
        return torch.stack(values)

    @classmethod
    def from_sums(
        cls,
        sums: torch.Tensor,
        parts: Optional[int] = None,
        has_kl: Optional[bool] = None,
        has_vespo: Optional[bool] = None,
        per_row: Optional[Sequence[torch.Tensor]] = None,
    ) -> GTPOMetrics:
        """The metrics of the union of the calls whose `to_sums` vectors were added into ``sums``.

        ``kl`` is kept when every part had it (``parts``: how many vectors were added; by default it is
        kept when any part had it), or as ``has_kl`` says (no read of the tensor: no host sync); the same for
        ``vespo_weight_mean`` and ``has_vespo``. ``per_row``: the union's per-completion metrics in `ROW_METRICS`'
        order, each ``None`` if absent (all absent by default, as after an all-reduce)."""
        if sums.shape != (len(_SUM_LAYOUT),):
            raise ValueError(
                f"GTPOMetrics.from_sums: expected a vector of {len(_SUM_LAYOUT)} sums from to_sums(), "
                f"got shape {tuple(sums.shape)}"
            )
        named = dict(zip(_SUM_LAYOUT, sums.unbind()))
        values = {name: named[name] for name in _COUNTS}
        for name, count in _AVERAGED_OVER.items():
            values[name] = named[name] / named[count].clamp(min=1)
        for flag, given in (("has_kl", has_kl), ("has_vespo", has_vespo)):
            if given is None:
                given = bool(named[flag] > 0) if parts is None else bool(named[flag] >= parts)
            if not given:
                values[_OPTIONAL[flag]] = None
        rows = dict(zip(ROW_METRICS, per_row)) if per_row is not None else {name: None for name in ROW_METRICS}
        return cls(**rows, **values)

    @classmethod
    def merge(cls, parts: Sequence[GTPOMetrics]) -> GTPOMetrics:
        """The metrics of several calls' rows taken together, exactly (count-weighted means);
        ``completion_entropy`` is the concatenation, in the order given."""
        parts = list(parts)
        if not parts:
            raise ValueError("GTPOMetrics.merge: nothing to merge")
        per_row = []
        for name in ROW_METRICS:
            rows: List[Optional[torch.Tensor]] = [getattr(p, name) for p in parts]
            per_row.append(None if any(r is None for r in rows) else torch.cat(rows))
        sums = torch.stack([p.to_sums().to(parts[0].entropy.device) for p in parts]).sum(0)
        return cls.from_sums(sums, parts=len(parts), per_row=per_row)


class GTPOLossOutput(NamedTuple):
    loss: torch.Tensor
    metrics: GTPOMetrics
