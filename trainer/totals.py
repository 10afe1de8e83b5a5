"""Sums that processes add together as one float64 vector, read back by name."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class Totals:
    """A base for dataclasses whose fields are all sums: numbers or 0-d tensors, and 1-D tensors. `to_sums` lays them
    end to end in field order (one ``all_sum`` for all of them); `from_sums` reads them back, told the vectors'
    lengths. Each field being a sum, the vectors of several processes add up to the whole batch's fields."""

    def to_sums(self) -> torch.Tensor:
        parts = [torch.as_tensor(getattr(self, f.name)).double().reshape(-1).cpu() for f in fields(self)]
        return torch.cat(parts)

    @classmethod
    def from_sums(cls, sums: torch.Tensor, **lengths: int):
        """The fields of ``sums`` (`to_sums`' layout); ``lengths``: each vector field's length (others are 0-d)."""
        values, at = {}, 0
        for f in fields(cls):
            n = lengths.get(f.name)
            values[f.name] = sums[at] if n is None else sums[at : at + n]
            at += 1 if n is None else n
        if at != sums.shape[0]:
            raise ValueError(f"{cls.__name__}: {sums.shape[0]} sums for fields of {at}")
        return cls(**values)
