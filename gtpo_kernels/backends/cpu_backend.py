"""The ``"cpu"`` backend: the C++ kernels in ``csrc/gtpo_cpu.cpp`` (``torch.ops.gtpo_cpu``).

One read of each row of logits forward (blocked online softmax, double-precision totals), one read and
one write backward, float32 accumulation for fp32/bf16/fp16 logits, ``at::parallel_for`` over tokens and
``at::vec`` in the rows, bitwise deterministic across thread counts. `cpu_extension` loads the variant
built for this machine's instruction set.
"""

from __future__ import annotations

from typing import Optional

import torch

from .base import Backend
from .cpu_extension import extension_error, load_cpu_extension


def _ops():
    load_cpu_extension()
    return torch.ops.gtpo_cpu


def _inv_temperature(temperature, device) -> torch.Tensor:
    """The kernels' ``1 / T``: one element for a float, each token's ``[N, L]`` for a tensor."""
    if isinstance(temperature, torch.Tensor):
        return (1.0 / temperature.float()).contiguous()
    return torch.full((1,), 1.0 / temperature, dtype=torch.float32, device=device)


def forward(
    logits: torch.Tensor,
    ids: torch.Tensor,
    valid: torch.Tensor,
    temperature=1.0,
):
    """``logits [N, L, V]`` -> ``(row_max, log_s, logp, H)`` float32 ``[N, L]`` of softmax(logits / T) (``T`` a float
    or each token's ``[N, L]``), zeros where masked."""
    return tuple(_ops().token_stats_forward(logits, ids, valid, _inv_temperature(temperature, logits.device)))


def backward(
    logits,
    ids,
    valid,
    row_max,
    log_s,
    logp,
    entropy,
    grad_logp,
    grad_entropy,
    out,
    temperature=1.0,
):
    """Writes the gradient of the logits into ``out`` (may be ``logits`` itself); ``grad_entropy`` None is zero."""
    if grad_entropy is None:
        grad_entropy = torch.zeros_like(grad_logp)
    _ops().token_stats_backward(
        logits,
        ids,
        valid,
        row_max,
        log_s,
        logp,
        entropy,
        grad_logp,
        grad_entropy,
        _inv_temperature(temperature, logits.device),
        out,
    )
    return out


def conflict_weights(completion_ids, valid, advantages, group_size, weight=2.0):
    """Same contract as the torch backend's (prefix masks), float32 weights."""
    lengths = valid.sum(dim=1)
    return tuple(_ops().conflict_weights(completion_ids, lengths, advantages.float(), group_size, float(weight)))


def _unavailable(device: torch.device) -> Optional[str]:
    if device.type != "cpu":
        return f"backend='cpu' needs CPU tensors, got tensors on {device}; use backend='auto'"
    why = extension_error()
    return None if why is None else f"backend='cpu' is unavailable: {why}"


BACKEND = Backend(
    name="cpu",
    description="C++ kernels (csrc/): all cores, SIMD, bitwise deterministic across thread counts",
    devices=("cpu",),
    auto_devices=("cpu",),
    logits_dtypes=(torch.float16, torch.bfloat16, torch.float32),
    forward=forward,
    backward=backward,
    conflict_weights=conflict_weights,
    unavailable=_unavailable,
)
