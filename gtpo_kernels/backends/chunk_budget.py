"""The chunk budget: how many tokens' float32 logits one chunk of the vocabulary-sized work may hold.

Two paths walk the logits in chunks, each with a default budget chosen for its own work, and all of them
overridden by ``GTPOConfig.max_chunk_bytes`` (or the ``max_chunk_bytes`` argument of the no-grad functions):

- the ``"torch"`` backend's elementwise passes (``TORCH_BACKEND``): on the CPU a chunk that stays in cache makes them
  several times faster than 64 MiB chunks; on a GPU larger chunks amortise kernel launches. It is the one backend that
  takes a budget (`Backend.chunked`); the Triton and C++ kernels stream each token's row of ``V`` and need none.
- the fused ``hidden @ lm_head`` loss's chunks of whole completions (``FUSED_LINEAR``): the CPU's GEMMs are efficient
  at a few hundred tokens; on a GPU, chunks of a few thousand tokens keep the GEMMs near peak (2 GiB: 3500 tokens at V
  = 151936; the H200's fused loss with it: bench/results/h200-2026-11-30/README.md). A soft-capped head's chunks hold
  half the tokens (the cap's slope beside the logits).

Every budget is a constant, never the device's free memory: the fused loss's chunk plan sets the order in
which ``d_W`` accumulates, so the same inputs give bitwise the same gradients in every call and process. A GPU
short of memory takes a smaller ``max_chunk_bytes``.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

MiB = 2**20
# Per device type ("other": every device type not named).
TORCH_BACKEND: Dict[str, int] = {"cpu": 4 * MiB, "other": 64 * MiB}
FUSED_LINEAR: Dict[str, int] = {"cpu": 256 * MiB, "other": 2048 * MiB}


def chunk_bytes(defaults: Dict[str, int], device: torch.device, max_chunk_bytes: Optional[int]) -> int:
    """``max_chunk_bytes``, or the path's default for ``device``."""
    return max_chunk_bytes or defaults.get(device.type, defaults["other"])


def chunk_tokens(vocab: int, defaults: Dict[str, int], device: torch.device, max_chunk_bytes: Optional[int]) -> int:
    """Tokens whose float32 logits over ``vocab`` fit the budget (at least one)."""
    return max(1, chunk_bytes(defaults, device, max_chunk_bytes) // (4 * vocab))
