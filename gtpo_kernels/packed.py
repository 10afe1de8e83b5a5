"""Packed completions (no padding): flash-attention's varlen layout, verl's ``use_remove_padding``.

A packed batch is ``T`` tokens in a row, completion ``i`` at ``[cu_seqlens[i], cu_seqlens[i + 1])``. The losses
take per-token tensors ``[T]`` (ids, mask, old/reference/sampler log-probs), logits ``[T, V]`` or hidden states
``[T, H]``, and ``advantages [N]``. The vocabulary-sized work runs on the packed tokens as they are (the kernels
see one row of ``T`` positions: no padded copy of the logits or hidden states); only the ``O(T)`` per-token
inputs and statistics are placed in an ``[N, L_max]`` layout, where the per-completion step (conflict weights
of a group's ragged completions, the filter, the reductions) runs exactly as for padded rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .rows import LossRows


@dataclass(frozen=True)
class Packing:
    """Where each packed token sits in the ``[N, L]`` layout (``L``: the longest completion, at least 1)."""

    rows: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    shape: tuple  # (N, L)

    def pad(self, packed: Optional[torch.Tensor], fill=0) -> Optional[torch.Tensor]:
        """``[T, *]`` -> ``[N, L, *]``, ``fill`` where no token is; differentiable (``None`` passes through)."""
        if packed is None:
            return None
        out = packed.new_full(self.shape + tuple(packed.shape[1:]), fill)
        return out.index_put((self.rows, self.positions), packed)

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        """``[N, L, *]`` -> ``[T, *]``: the packed tokens' entries."""
        return padded[self.rows, self.positions]

    def index(self) -> torch.Tensor:
        """``[N, L]`` int64: each position's index in the packed tokens (0 where no token is)."""
        return self.pad(torch.arange(self.rows.numel(), device=self.rows.device))


def packing_of(cu_seqlens: torch.Tensor, total_tokens: int, n_rows: int, device) -> Packing:
    """The `Packing` of ``cu_seqlens [N + 1]`` (int, from 0 to ``T``, non-decreasing), checked against the ``T``
    packed tokens and the ``N`` advantages; one host read of ``cu_seqlens`` (``N + 1`` integers)."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1:
        raise ValueError(
            f"cu_seqlens must be a 1-D integer tensor [N + 1] of completion offsets, got "
            f"{getattr(cu_seqlens, 'shape', type(cu_seqlens).__name__)}"
        )
    if cu_seqlens.is_floating_point() or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must hold integer offsets (int32 or int64), got {cu_seqlens.dtype}")
    if cu_seqlens.numel() != n_rows + 1:
        raise ValueError(
            f"cu_seqlens has {cu_seqlens.numel()} offsets but advantages has N = {n_rows} completions: it must "
            f"be [N + 1] (0, then where each completion ends)"
        )
    offsets = cu_seqlens.tolist()
    lengths = [b - a for a, b in zip(offsets, offsets[1:])]
    if offsets[0] != 0 or offsets[-1] != total_tokens or min(lengths, default=0) < 0:
        raise ValueError(
            f"cu_seqlens must start at 0, never decrease and end at T = {total_tokens} (the packed tokens), got "
            f"{offsets if len(offsets) <= 12 else offsets[:6] + ['...'] + offsets[-3:]}"
        )
    lengths_t = torch.tensor(lengths, dtype=torch.int64, device=device)
    rows = torch.repeat_interleave(torch.arange(n_rows, device=device), lengths_t, output_size=total_tokens)
    starts = torch.tensor(offsets[:-1], dtype=torch.int64, device=device)
    positions = torch.arange(total_tokens, device=device) - starts[rows]
    return Packing(rows, positions, (n_rows, max(lengths, default=0) or 1))


def check_packed(name: str, tensor: Optional[torch.Tensor], total_tokens: int, floating: bool) -> None:
    """A per-token input of a packed call is ``[T]`` (float for log-probs)."""
    if tensor is None:
        return
    if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != (total_tokens,):
        raise ValueError(
            f"with cu_seqlens (packed completions) {name} must be [T] = ({total_tokens},), one entry per packed "
            f"token, got {tuple(getattr(tensor, 'shape', ()))}"
        )
    if floating and not tensor.is_floating_point():
        raise ValueError(f"{name} must be a float tensor, got {tensor.dtype}")


def padded_rows(source: torch.Tensor, name: str, given: LossRows, cu_seqlens) -> Tuple[LossRows, Packing]:
    """A packed call's per-token inputs (``[T]``, ``source`` ``[T, *]``) in the ``[N, L]`` layout of padded rows,
    and the `Packing` that maps between the two."""
    if not isinstance(source, torch.Tensor) or source.dim() != 2:
        raise ValueError(
            f"with cu_seqlens (packed completions) {name} must be 2-D [T, *], one row per packed token, got "
            f"shape {tuple(getattr(source, 'shape', ()))}"
        )
    total = source.shape[0]
    for field, floating in (("completion_ids", False), ("completion_mask", False)):
        check_packed(
            field, getattr(given, {"completion_ids": "ids", "completion_mask": "valid"}[field]), total, floating
        )
    for field in ("old_logprobs", "ref_logprobs", "sampling_logprobs"):
        check_packed(field, getattr(given, field), total, True)
    advantages = given.advantages
    if not isinstance(advantages, torch.Tensor) or advantages.dim() != 1:
        raise ValueError(f"advantages must be [N], one per completion, got {tuple(getattr(advantages, 'shape', ()))}")
    packing = packing_of(cu_seqlens, total, advantages.shape[0], source.device)
    conflict = given.conflict
    if conflict is not None:
        check_packed("conflict's lambda_", conflict[0], total, True)
        conflict = (packing.pad(conflict[0]), conflict[1])
    padded = given.replace(
        ids=packing.pad(given.ids),
        valid=packing.pad(given.valid),
        conflict=conflict,
        old_logprobs=packing.pad(given.old_logprobs),
        ref_logprobs=packing.pad(given.ref_logprobs),
        sampling_logprobs=packing.pad(given.sampling_logprobs),
    )
    return padded, packing
