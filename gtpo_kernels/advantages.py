"""Group-relative advantages from rewards (docs/method.md, "Advantages")."""

from __future__ import annotations

import math

import torch


def compute_advantages(
    rewards: torch.Tensor, group_size: int, normalize_std: bool = False, eps: float = 1e-4
) -> torch.Tensor:
    """Group-relative advantages.

    Args:
        rewards: ``[N]`` with ``N = B * G``, rows of a group contiguous.
        group_size: ``G``.
        normalize_std: divide by the group's (unbiased) standard deviation plus ``eps``
            (standard GRPO). A group of one has advantage 0 either way.
        eps: added to the std; a finite number > 0.

    Raises ``ValueError`` for a NaN or infinite reward (one host read of the ``[N]`` rewards).

    Returns:
        ``[N]`` advantages, ``A_i = R_i - mean_group(R)`` (optionally ``/ (std + eps)``).
    """
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1:
        raise ValueError(
            f"compute_advantages: rewards must be a 1-D tensor [N], got "
            f"{tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards).__name__}"
        )
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.float32)
    if (
        isinstance(group_size, bool)
        or not isinstance(group_size, int)
        or group_size < 1
        or rewards.numel() % group_size
    ):
        raise ValueError(
            f"compute_advantages: group_size ({group_size!r}) must be a positive int dividing the "
            f"number of rewards ({rewards.numel()})"
        )
    if normalize_std and (
        isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps > 0)
    ):
        raise ValueError(
            f"compute_advantages: eps must be a finite number > 0 with normalize_std=True (a group whose rewards "
            f"are all equal has std 0), got {eps!r}"
        )
    # One host read of [N] rewards: a NaN or inf reward would make its whole group's advantages NaN.
    if not bool(torch.isfinite(rewards).all()):
        bad = int((~torch.isfinite(rewards)).nonzero()[0, 0])
        raise ValueError(
            f"compute_advantages: rewards must be finite, but rewards[{bad}] = {float(rewards[bad])}; "
            f"check the reward function's output for that completion"
        )
    grouped = rewards.view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std:
        std = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(centred)
        centred = centred / (std + eps)
    return centred.reshape(-1)
