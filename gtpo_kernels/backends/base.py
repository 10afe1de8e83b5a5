"""`Backend`: what a backend of the vocabulary-sized work declares (see the registry in ``__init__``)."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels return (and accumulate) statistics and weights in for inputs of ``dtype``: float64
    for float64 (the oracle's), float32 for everything else."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class Backend:
    """One backend: its kernels and where they run.

    The kernels, over ``logits [N, L, V]`` and ``ids, valid [N, L]`` (``valid`` a bool mask), for
    the distribution ``softmax(logits / temperature)``:

        forward(logits, ids, valid, temperature) -> (row_max, log_s, logp, H)
            each [N, L] float32 (float64 for float64 logits), zeros where masked, NaN logp for an id
            outside [0, V) (never an out-of-bounds read) and for NaN or +inf logits: row_max is the largest
            logit, log_s = log sum_v exp((z_v - row_max) / T) (so lse = row_max / T + log_s)
        backward(logits, ids, valid, row_max, log_s, logp, H, grad_logp, grad_H, out, temperature) -> out
            writes d/dlogits of (sum grad_logp * logp + grad_H * H) into out ([N, L, V], last dimension
            contiguous, may be logits itself), exact zeros where masked; grad_H None means zero (the
            kernels may then skip the entropy term). log p_v = (z_v - row_max) / T - log_s
            keeps its precision near the max (z_v / T - lse would cancel), and the forward's logp gives the
            target's entry grad_logp (1 - p_y) as -grad_logp expm1(logp), without cancellation
        conflict_weights(ids, valid, advantages, group_size, weight) -> (lambda [N, L], n_conflict [N])
            float32 weights (float64 for float64 advantages), int64 counts

    Attributes:
        name: what ``backend=`` takes.
        description: one line for the README's table and error messages.
        devices: device types whose tensors the kernels take (``None``: any).
        auto_devices: device types for which ``backend="auto"`` picks this backend (first in registry
            order among the available ones).
        logits_dtypes: logits dtypes the token-statistics kernels take; other dtypes (float64, the
            oracle's) go to the ``"torch"`` backend.
        unavailable: ``device -> None`` when the backend can run on tensors of that device, else the reason.
        chunked: the kernels walk the logits in chunks and take a keyword ``max_chunk_bytes`` (float32 bytes of
            one chunk's logits; `chunk_budget`), set with `with_chunk_bytes`; others stream each token's row.
    """

    name: str
    description: str
    devices: Optional[Tuple[str, ...]]
    auto_devices: Tuple[str, ...]
    logits_dtypes: Tuple[torch.dtype, ...]
    forward: Callable
    backward: Callable
    conflict_weights: Callable
    unavailable: Callable[[torch.device], Optional[str]]
    chunked: bool = False

    def with_chunk_bytes(self, max_chunk_bytes: Optional[int]) -> Backend:
        """These kernels with their chunk budget set (`chunk_budget`; ``None``: the default); the same backend
        when it takes none."""
        if not self.chunked or max_chunk_bytes is None:
            return self
        return dataclasses.replace(
            self,
            forward=functools.partial(self.forward, max_chunk_bytes=max_chunk_bytes),
            backward=functools.partial(self.backward, max_chunk_bytes=max_chunk_bytes),
        )
