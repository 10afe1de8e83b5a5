"""What `gtpo_loss` returns: the differentiable loss and detached metrics."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import NamedTuple, Optional

import torch


@dataclass
class GTPOMetrics:
    """Detached diagnostics of one loss evaluation (0-d tensors unless a shape is given).

    Attributes:
        entropy: mean token entropy over unmasked tokens (nats).
        completion_entropy: ``Hbar [N]``, each completion's mean token entropy.
        filtered_fraction: fraction of non-empty completions dropped by the entropy filter.
        amplified_fraction: fraction of unmasked tokens with ``lambda > 1`` (conflicts, positive).
        skipped_fraction: fraction of unmasked tokens with ``lambda = 0`` (conflicts, negative).
        ratio_mean: mean importance ratio ``exp(logp - logp_old)`` over unmasked tokens.
        clip_fraction: fraction of unmasked tokens whose update was clipped (0 without clipping).
        kl: mean k3 estimate of KL(policy || reference) over unmasked tokens, or ``None`` without
            ``ref_logprobs``.
    """

    entropy: torch.Tensor
    completion_entropy: torch.Tensor
    filtered_fraction: torch.Tensor
    amplified_fraction: torch.Tensor
    skipped_fraction: torch.Tensor
    ratio_mean: torch.Tensor
    clip_fraction: torch.Tensor
    kl: Optional[torch.Tensor] = None

    def to_dict(self) -> dict:
        """Scalar metrics as Python floats (one device sync); ``completion_entropy`` is averaged."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            out[f.name] = float(value.float().mean()) if value.numel() else 0.0
        return out


class GTPOLossOutput(NamedTuple):
    loss: torch.Tensor
    metrics: GTPOMetrics
