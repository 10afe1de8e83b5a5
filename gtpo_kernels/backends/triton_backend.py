"""The ``"triton"`` backend: fused Triton kernels on CUDA tensors (and on CPU tensors under Triton's
interpreter, ``TRITON_INTERPRET=1``, which is how the tests run them without a GPU)."""

from __future__ import annotations

from typing import Optional

import torch

from . import triton_conflict_weights, triton_token_stats
from .base import Backend
from .triton_interpreter import triton_interpreted


def _unavailable(device: torch.device) -> Optional[str]:
    if device.type == "cuda" or triton_interpreted():
        return None
    return (
        f"backend='triton' needs CUDA tensors, got tensors on {device}; use backend='auto' or 'torch' (or set "
        f"TRITON_INTERPRET=1 before importing triton to run the kernels on the CPU, slowly, for testing)"
    )


BACKEND = Backend(
    name="triton",
    description="fused Triton kernels: one read of the logits forward, one read and one write backward",
    devices=("cuda",),
    auto_devices=("cuda",),
    logits_dtypes=(torch.float16, torch.bfloat16, torch.float32),
    forward=triton_token_stats.forward,
    backward=triton_token_stats.backward,
    conflict_weights=triton_conflict_weights.conflict_weights_triton,
    unavailable=_unavailable,
)
