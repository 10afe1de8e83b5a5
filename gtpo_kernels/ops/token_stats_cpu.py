"""The ``"cpu"`` backend: per-token statistics and gradient from the C++ kernels in ``csrc/``.

Same contract as `token_stats_torch` and `token_stats_triton` (see `function.TokenStats`): one pass
over each row of logits forward, one backward, float32 accumulation for fp32/bf16/fp16 logits,
``at::parallel_for`` over tokens and ``at::vec`` in the rows. The extension is built by ``setup.py``
or, failing that, compiled on first use (`gtpo_kernels._extension`).
"""

from __future__ import annotations

import torch

from .._extension import load_cpu_extension


def forward(logits: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, chunk_size=None):
    """``logits [N, L, V]`` -> ``(lse, logp, H)`` float32 ``[N, L]``, zeros where masked."""
    lse, logp, entropy = load_cpu_extension().token_stats_forward(logits, ids, valid)
    return lse, logp, entropy


def backward(logits, ids, valid, lse, entropy, grad_logp, grad_entropy, out, chunk_size=None):
    """Writes ``dlogits`` into ``out`` (may be ``logits`` itself)."""
    load_cpu_extension().token_stats_backward(logits, ids, valid, lse, entropy, grad_logp, grad_entropy, out)
    return out


def conflict_weights_cpu(completion_ids, valid, advantages, group_size, weight=2.0):
    """Same contract as `reference.conflict_weights` (prefix masks), float32 weights."""
    lengths = valid.sum(dim=1)
    return tuple(load_cpu_extension().conflict_weights(completion_ids, lengths, advantages.float(), group_size,
                                                       float(weight)))
