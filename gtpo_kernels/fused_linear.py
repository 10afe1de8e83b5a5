"""`fused_linear_gtpo_loss`: the GTPO loss from final hidden states and the ``lm_head`` weight,
without ever materialising the ``[N, L, V]`` logits.

The batch is processed in chunks of whole completions. For each chunk (unmasked tokens only):

    logits = hidden @ W.T (+ b)                      one GEMM, 2 T H V FLOPs over the batch
    lse, logp, H = one pass over the chunk's logits  (backend kernels)
    c, e = dloss/dlogp, dloss/dH                      the per-completion step on [rows, L] tensors
    dlogits = c (onehot - p) + e dH/dz               written over the chunk's logits, in place
    d_hidden = dlogits @ W;  d_W += dlogits.T @ hidden;  d_b += sum dlogits

so the work is ``6 T H V`` FLOPs (no second forward GEMM) and memory is one chunk's logits. Whole
completions per chunk matter because ``c`` and ``e`` need each completion's mean entropy; everything
else the coefficients depend on (conflict weights, ``N``, the token count) is known for the batch
before the first chunk. The gradients are computed in the forward pass and stored; the backward only
scales them by the incoming gradient.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from . import validation
from .config import GTPOConfig
from .loss import batch_conflict_weights, prepare_loss_inputs
from .reference import gtpo_loss_from_token_stats
from .result import GTPOLossOutput
from .token_stats import kernels_for, resolve_backend

DEFAULT_CHUNK_BYTES = 256 * 2**20  # float32 bytes of one chunk's logits
WEIGHT_GRAD_SLICE_BYTES = 64 * 2**20  # temporary of one slice of d_W in the weight's dtype


def chunk_rows_for(length: int, vocab: int, max_chunk_bytes: int) -> int:
    """Completions per chunk so that their float32 logits fit ``max_chunk_bytes`` (at least one)."""
    return max(1, max_chunk_bytes // (4 * length * vocab))


class FusedLinearGTPOFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, valid, advantages, lambda_, n_conflict, old_logprobs,
                ref_logprobs, config: GTPOConfig, initial_entropy, kernels, rows_per_chunk: int,
                compute_dtype: torch.dtype, side: dict):
        n_rows, length, hidden_size = hidden.shape
        vocab = weight.shape[0]
        device = hidden.device
        need_hidden = ctx.needs_input_grad[0]
        need_weight = ctx.needs_input_grad[1]
        need_bias = bias is not None and ctx.needs_input_grad[2]
        w = weight.to(compute_dtype)
        b = None if bias is None else bias.to(compute_dtype)
        total_tokens = valid.sum()

        stat_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
        logp_all = torch.zeros((n_rows, length), dtype=stat_dtype, device=device)
        entropy_all = torch.zeros_like(logp_all)
        # Contiguous whatever the input's strides (hidden is often a slice of the model's output).
        d_hidden = torch.zeros(hidden.shape, dtype=hidden.dtype, device=device) if need_hidden else None
        # Accumulated in float32 across chunks (bf16 accumulation visibly shifts training).
        acc_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
        d_weight = torch.zeros((vocab, hidden_size), dtype=acc_dtype, device=device) if need_weight else None
        d_bias = torch.zeros(vocab, dtype=acc_dtype, device=device) if need_bias else None
        slice_rows = max(1, WEIGHT_GRAD_SLICE_BYTES // (hidden_size * torch.finfo(compute_dtype).bits // 8))

        for start in range(0, n_rows, rows_per_chunk):
            rows = slice(start, min(n_rows, start + rows_per_chunk))
            token_index = valid[rows].reshape(-1).nonzero().squeeze(1)  # unmasked tokens of the chunk
            if token_index.numel() == 0:
                continue
            h = hidden[rows].reshape(-1, hidden_size).index_select(0, token_index).to(compute_dtype)
            y = ids[rows].reshape(-1).index_select(0, token_index)
            logits = h @ w.T if b is None else torch.addmm(b, h, w.T)  # [t, V]
            everything = torch.ones((1, logits.shape[0]), dtype=torch.bool, device=device)
            lse, logp, entropy = kernels.forward(logits[None], y[None], everything, None)

            # The per-completion step on this chunk's rows gives the coefficients c and e.
            chunk_logp = torch.zeros((rows.stop - rows.start, length), dtype=stat_dtype, device=device)
            chunk_entropy = torch.zeros_like(chunk_logp)
            chunk_logp.view(-1)[token_index] = logp[0].to(stat_dtype)
            chunk_entropy.view(-1)[token_index] = entropy[0].to(stat_dtype)
            logp_all[rows] = chunk_logp
            entropy_all[rows] = chunk_entropy
            with torch.enable_grad():
                chunk_logp.requires_grad_()
                chunk_entropy.requires_grad_()
                chunk_loss = gtpo_loss_from_token_stats(
                    chunk_logp, chunk_entropy, valid[rows], advantages[rows], lambda_[rows], n_conflict[rows],
                    config, old_logprobs=None if old_logprobs is None else old_logprobs[rows],
                    ref_logprobs=None if ref_logprobs is None else ref_logprobs[rows],
                    initial_entropy=initial_entropy, total_rows=n_rows, total_tokens=total_tokens,
                ).loss
                c, e = torch.autograd.grad(chunk_loss, (chunk_logp, chunk_entropy), allow_unused=True)
            c = torch.zeros_like(chunk_logp) if c is None else c
            e = torch.zeros_like(chunk_logp) if e is None else e
            c_tokens = c.reshape(-1).index_select(0, token_index)[None]
            e_tokens = e.reshape(-1).index_select(0, token_index)[None]

            # The gradient of the chunk's logits replaces them.
            kernels.backward(logits[None], y[None], everything, lse, entropy, c_tokens, e_tokens, logits[None], None)
            if need_hidden:
                d_hidden[rows].view(-1, hidden_size).index_copy_(0, token_index, (logits @ w).to(hidden.dtype))
            if need_weight:
                # d_W += dlogits.T @ h, in slices of the vocabulary so that the temporary in the compute
                # dtype stays small; each slice is added to the float32 accumulator once per chunk.
                for v0 in range(0, vocab, slice_rows):
                    v1 = min(vocab, v0 + slice_rows)
                    d_weight[v0:v1] += (logits[:, v0:v1].T @ h).to(acc_dtype)
            if need_bias:
                d_bias += logits.sum(dim=0, dtype=acc_dtype)
            del logits

        # The loss value and metrics from the whole batch's statistics (cheap, O(N L)).
        full = gtpo_loss_from_token_stats(
            logp_all, entropy_all, valid, advantages, lambda_, n_conflict, config,
            old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, initial_entropy=initial_entropy)
        side["metrics"] = full.metrics
        side["token_stats"] = (logp_all, entropy_all)
        ctx.save_for_backward(
            d_hidden,
            None if d_weight is None else d_weight.to(weight.dtype),
            None if d_bias is None else d_bias.to(bias.dtype),
        )
        return full.loss.detach()

    @staticmethod
    def backward(ctx, grad_loss):
        d_hidden, d_weight, d_bias = ctx.saved_tensors
        grads = []
        for g in (d_hidden, d_weight, d_bias):
            grads.append(None if g is None else g * grad_loss.to(g.dtype))
        return (*grads,) + (None,) * 13


def fused_linear_gtpo_loss(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    group_size: int,
    lm_head_bias: Optional[torch.Tensor] = None,
    config: Optional[GTPOConfig] = None,
    old_logprobs: Optional[torch.Tensor] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    initial_entropy: Optional[float] = None,
    chunk_size: Optional[int] = None,
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    backend: str = "auto",
) -> GTPOLossOutput:
    """The GTPO loss of ``logits = hidden_states @ lm_head_weight.T + lm_head_bias``, never building them.

    Args:
        hidden_states: ``[N, L, H]`` final hidden states; position ``t`` of row ``i`` predicts
            ``completion_ids[i, t]`` (shifted by the caller, as for `gtpo_loss`).
        lm_head_weight: ``[V, H]``; frozen (``requires_grad=False``, e.g. LoRA) skips ``d_weight``.
        completion_ids, completion_mask, advantages, group_size, config, old_logprobs, ref_logprobs,
        initial_entropy: as for `gtpo_loss`.
        lm_head_bias: optional ``[V]``.
        chunk_size: completions per chunk; ``None`` picks the most whose float32 logits fit
            ``max_chunk_bytes`` (256 MiB by default). A completion longer than that budget on its
            own is still processed whole.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``, for the per-token statistics.

    Returns:
        `GTPOLossOutput`; ``.loss`` is differentiable w.r.t. ``hidden_states``, ``lm_head_weight``
        and ``lm_head_bias``. ``d_weight`` is accumulated in float32 and returned in the weight's dtype.
        Under ``torch.autocast`` the matrix products run in the autocast dtype.
    """
    validation.check_float("hidden_states", hidden_states, hidden_states.shape, "[N, L, H]")
    if hidden_states.dim() != 3:
        raise ValueError(f"hidden_states must be 3-D [N, L, H], got shape {tuple(hidden_states.shape)}")
    if not isinstance(lm_head_weight, torch.Tensor) or lm_head_weight.dim() != 2 or \
            lm_head_weight.shape[1] != hidden_states.shape[2]:
        raise ValueError(f"lm_head_weight must be [V, H] with H = {hidden_states.shape[2]} (the hidden size), "
                         f"got {tuple(getattr(lm_head_weight, 'shape', ()))}; pass model.lm_head.weight")
    validation.check_float("lm_head_weight", lm_head_weight, lm_head_weight.shape, "[V, H]")
    vocab = lm_head_weight.shape[0]
    if lm_head_bias is not None:
        validation.check_float("lm_head_bias", lm_head_bias, (vocab,), "[V]")
    validation.check_same_device(hidden_states=hidden_states, lm_head_weight=lm_head_weight,
                                 lm_head_bias=lm_head_bias)
    device = hidden_states.device
    if torch.is_autocast_enabled(device.type):
        compute_dtype = torch.get_autocast_dtype(device.type)
    else:
        compute_dtype = hidden_states.dtype
        if lm_head_weight.dtype != compute_dtype:
            raise ValueError(f"hidden_states ({hidden_states.dtype}) and lm_head_weight ({lm_head_weight.dtype}) "
                             f"must share a dtype; cast one, or run under torch.autocast")
    config, valid, initial_entropy = prepare_loss_inputs(
        hidden_states, completion_ids, completion_mask, advantages, group_size, config, old_logprobs,
        ref_logprobs, initial_entropy, vocab_size=vocab, what="hidden_states [N, L, H]")
    if chunk_size is not None and not (isinstance(chunk_size, int) and chunk_size > 0):
        raise ValueError(f"chunk_size must be a positive int (completions per chunk) or None, got {chunk_size!r}")
    if not (isinstance(max_chunk_bytes, int) and max_chunk_bytes > 0):
        raise ValueError(f"max_chunk_bytes must be a positive int, got {max_chunk_bytes!r}")
    backend = resolve_backend(backend, device)
    kernels = kernels_for(backend, compute_dtype)
    n_rows, length = valid.shape
    rows_per_chunk = chunk_size or chunk_rows_for(length, vocab, max_chunk_bytes)
    stat_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
    lambda_, n_conflict = batch_conflict_weights(config, backend, completion_ids, valid, advantages, group_size,
                                                 stat_dtype)

    side: dict = {}
    with torch.autocast(device.type, enabled=False):
        loss = FusedLinearGTPOFunction.apply(
            hidden_states, lm_head_weight, lm_head_bias, completion_ids, valid, advantages.detach().to(stat_dtype),
            lambda_, n_conflict, old_logprobs, ref_logprobs, config, initial_entropy, kernels, rows_per_chunk,
            compute_dtype, side)
    if config.validate_inputs:
        validation.check_token_stats_finite(*side["token_stats"], valid)
    return GTPOLossOutput(loss, side["metrics"])


class FusedLinearGTPOLoss(nn.Module):
    """`fused_linear_gtpo_loss` as a module:
    ``FusedLinearGTPOLoss(config)(hidden, model.lm_head.weight, ids, mask, advantages, group_size=G)``."""

    def __init__(self, config: Optional[GTPOConfig] = None, chunk_size: Optional[int] = None,
                 max_chunk_bytes: int = DEFAULT_CHUNK_BYTES, backend: str = "auto") -> None:
        super().__init__()
        self.config = config or GTPOConfig()
        self.chunk_size, self.max_chunk_bytes, self.backend = chunk_size, max_chunk_bytes, backend

    def forward(self, hidden_states, lm_head_weight, completion_ids, completion_mask, advantages, *, group_size,
                lm_head_bias=None, old_logprobs=None, ref_logprobs=None, initial_entropy=None) -> GTPOLossOutput:
        return fused_linear_gtpo_loss(
            hidden_states, lm_head_weight, completion_ids, completion_mask, advantages, group_size=group_size,
            lm_head_bias=lm_head_bias, config=self.config, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
            initial_entropy=initial_entropy, chunk_size=self.chunk_size, max_chunk_bytes=self.max_chunk_bytes,
            backend=self.backend)

    def extra_repr(self) -> str:
        return f"preset={self.config.preset!r}, backend={self.backend!r}"
