"""Per-token log-prob and entropy with a closed-form backward: the only vocabulary-sized work.

`token_stats` runs a backend's kernels through the one registered operator ``gtpo_kernels::token_stats``
(`custom_ops`), whose variants are its inputs: the in-place gradient mode, and logits sharded over a vocabulary
group; `token_logprobs_and_entropy` is the public no-grad forward (old and reference log-probs, the initial
entropy).

``inplace=True`` passes the logits themselves as the backward's output buffer: the gradient replaces the
logits, saving an ``[N, L, V]`` buffer. Their version counter is then bumped, so any other autograd node
that saved the same tensor and runs later raises "modified by an inplace operation" rather than reading
gradients as logits.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import custom_ops, validation
from .backends import resolve_backend_name
from .vocab_parallel import exchange_shards, group_name


def token_stats(
    backend: str,
    logits: torch.Tensor,
    ids: torch.Tensor,
    valid: torch.Tensor,
    *,
    temperature=1.0,
    max_chunk_bytes: Optional[int] = None,
    inplace: bool = False,
    vocab_group=None,
) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """``(logp, H, V)`` ``[N, L]`` from a resolved backend (by name), differentiable w.r.t. ``logits``, and the whole
    vocabulary's size ``V``, through the registered operator ``gtpo_kernels::token_stats`` (what ``torch.compile``
    sees). ``temperature``: a float, or each token's ``[N, L]`` (the kernels' contract, `backends.base.Backend`);
    ``max_chunk_bytes``: the chunk budget of a chunked backend (`chunk_budget`); ``inplace``: the gradient written over
    the logits (eager mode); ``vocab_group``: ``logits`` is this rank's shard of the vocabulary (`vocab_parallel`;
    never in place), the statistics the whole vocabulary's."""
    if inplace and vocab_group is None and logits.requires_grad and logits.is_leaf:
        raise ValueError(
            "inplace_backward=True would write the gradient over a leaf tensor that is its own "
            "parameter (logits.grad would alias logits); use it on logits computed by the "
            "model, or set inplace_backward=False"
        )
    if logits.stride(-1) != 1:
        logits = logits.contiguous()  # the kernels stream rows of V; strided rows are copied once
    shards = None
    if vocab_group is not None:
        shards = exchange_shards(vocab_group, logits.shape[-1], tuple(ids.shape), logits.dtype, logits.device, "logits")
    per_token = isinstance(temperature, torch.Tensor)
    _, _, logp, entropy = custom_ops.token_stats(
        logits,
        ids,
        valid,
        1.0 if per_token else float(temperature),
        temperature if per_token else None,
        backend,
        max_chunk_bytes or 0,
        inplace and shards is None,
        group_name(vocab_group),
        None if shards is None else list(shards.sizes),
    )
    return logp, entropy, logits.shape[-1] if shards is None else shards.vocab_size


def token_logprobs_and_entropy(
    logits: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: Optional[torch.Tensor] = None,
    *,
    temperature=1.0,
    backend: str = "auto",
    validate: bool = True,
    vocab_group=None,
    max_chunk_bytes: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs and entropies without gradient, e.g. for ``old_logprobs``/``ref_logprobs``.

    Args:
        logits: ``[N, L, V]``.
        completion_ids: ``[N, L]`` integer ids.
        completion_mask: ``[N, L]``; masked positions return 0 (default: all unmasked).
        temperature: the statistics are those of ``softmax(logits / temperature)``, computed inside the
            kernels (no scaled copy of the logits): a float, or ``[N]`` each completion's.
        max_chunk_bytes: the ``"torch"`` backend's chunk budget (`GTPOConfig.max_chunk_bytes`; default 4 MiB on
            the CPU, 64 MiB on a GPU); the other backends stream each token's row.
        vocab_group: the process group over which the vocabulary is sharded (``logits`` is this rank's
            ``[N, L, V_r]`` shard; `gtpo_loss`'s argument of the same name).

    Returns:
        ``(logp, H)``, each ``[N, L]`` float32 (float64 for float64 logits), one pass over the logits.
    """
    validation.check_logits(logits)
    checks = validation.DeferredChecks(validate and not torch.compiler.is_compiling())
    valid, temperature = validation.check_stats_inputs(
        logits, "logits", completion_ids, completion_mask, temperature, checks
    )
    if max_chunk_bytes is not None and not (isinstance(max_chunk_bytes, int) and max_chunk_bytes > 0):
        raise ValueError(f"max_chunk_bytes must be a positive int or None, got {max_chunk_bytes!r}")
    backend = resolve_backend_name(backend, logits.device.type)
    with torch.no_grad():
        logp, entropy, vocab_size = token_stats(
            backend,
            logits,
            completion_ids,
            valid,
            temperature=validation.token_temperature(temperature, valid.shape),
            max_chunk_bytes=max_chunk_bytes,
            vocab_group=vocab_group,
        )
    validation.add_stats_check(checks, logp, entropy, valid, completion_ids, vocab_size)
    checks.read()  # one host synchronisation
    return logp, entropy
