"""The GTPO loss, and the per-token statistics, from final hidden states and the ``lm_head`` weight,
without ever materialising the ``[N, L, V]`` logits.

`fused_linear_gtpo_loss` packs the batch's unmasked tokens into chunks of whole completions, at most
``max_chunk_bytes`` of float32 logits each (`GTPOConfig.max_chunk_bytes`). For each chunk:

    logits = hidden @ W.T (+ b)                      one GEMM, 2 T H V FLOPs over the batch
    logp, H = one pass over the chunk's logits       (backend kernels, at the sampling temperature)
    c, e = dloss/dlogp, dloss/dH                      the per-completion step on the chunk's rows
    dlogits = c (onehot - p) + e dH/dz               written over the chunk's logits, in place
    d_hidden = dlogits @ W;  d_W += dlogits.T @ hidden;  d_b += sum dlogits

so the work is ``6 T H V`` FLOPs (no second forward GEMM). ``c`` and ``e`` need the completion's mean
entropy, so a chunk holds whole completions; a completion longer than the budget on its own is split:
a first pass over its pieces computes only its statistics, then each piece's logits are computed again
for the gradient (``8 T H V`` FLOPs for those completions). Peak extra memory is one chunk's logits
whatever the completion lengths. Everything else the coefficients depend on (conflict weights, the
whole batch's counts) is known before the first chunk. The gradients are computed in the forward pass
and stored; the backward only scales them by the incoming gradient. The whole walk is one registered
operator, ``gtpo_kernels::fused_linear_gtpo`` (`custom_ops`), which ``torch.compile`` treats as a unit.

`fused_linear_token_logprobs_and_entropy` is the statistics alone, without gradient: old and reference
log-probs and the initial entropy, from hidden states.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch import nn

from . import custom_ops, validation
from .backends import Backend, get_backend, kernels_for, resolve_backend_name
from .config import GTPOConfig
from .loss import Conflict, loss_conflict_weights, prepare_loss_inputs
from .objective import loss_from_token_stats, loss_gradients
from .result import GTPOLossOutput, GTPOMetrics

# Default budget (float32 bytes of one chunk's logits). The CPU's GEMMs are efficient at a few hundred
# tokens; on a GPU, chunks of a few thousand tokens keep the GEMMs near peak, bounded by free memory.
DEFAULT_CHUNK_BYTES_CPU = 256 * 2**20
DEFAULT_CHUNK_BYTES_GPU = 2 * 2**30
WEIGHT_GRAD_SLICE_BYTES = 64 * 2**20  # temporary of one slice of d_W when it cannot accumulate in place


def default_chunk_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(64 * 2**20, min(DEFAULT_CHUNK_BYTES_GPU, free // 4))
    return DEFAULT_CHUNK_BYTES_CPU


def chunk_tokens_for(vocab: int, device: torch.device, max_chunk_bytes: Optional[int]) -> int:
    """Tokens whose float32 logits fit the budget (at least one)."""
    return max(1, (max_chunk_bytes or default_chunk_bytes(device)) // (4 * vocab))


@dataclass
class _Tokens:
    """The unmasked tokens of a batch, in row-major order, and where each row's tokens start."""

    flat: torch.Tensor        # [T] int64: i * L + t of each unmasked token
    rows: torch.Tensor        # [T] int64: i
    positions: torch.Tensor   # [T] int64: t
    offsets: List[int]        # [N + 1]: row i's tokens are flat[offsets[i]:offsets[i + 1]]


def _unmasked_tokens(valid: torch.Tensor) -> _Tokens:
    """One host synchronisation (the row lengths) per batch."""
    n_rows, length = valid.shape
    lengths = valid.sum(dim=1).tolist()
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    if hasattr(torch, "nonzero_static"):
        flat = torch.nonzero_static(valid.reshape(-1), size=offsets[-1]).squeeze(1)
    else:  # pragma: no cover (torch < 2.1)
        flat = valid.reshape(-1).nonzero().squeeze(1)
    return _Tokens(flat, flat // max(1, length), flat % max(1, length), offsets)


def _chunks(offsets: List[int], budget: int) -> List[Tuple[int, int]]:
    """Row ranges ``[r0, r1)`` whose tokens fit ``budget``; a row longer than the budget is a range alone."""
    chunks, start = [], 0
    for row in range(len(offsets) - 1):
        if offsets[row + 1] - offsets[start] > budget and row > start:
            chunks.append((start, row))
            start = row
        if offsets[row + 1] - offsets[start] > budget:  # this row alone is over budget
            chunks.append((start, row + 1))
            start = row + 1
    if start < len(offsets) - 1:
        chunks.append((start, len(offsets) - 1))
    return chunks


def _logits(h: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
    return h @ w.T if b is None else torch.addmm(b, h, w.T)


def _stats(kernels: Backend, logits: torch.Tensor, ids: torch.Tensor, temperature: float):
    """``(row_max, log_s, logp, H)`` ``[t]`` of the rows of ``logits [t, V]`` (see `backends.base.Backend`)."""
    everything = torch.ones((1, logits.shape[0]), dtype=torch.bool, device=logits.device)
    return tuple(x[0] for x in kernels.forward(logits[None], ids[None], everything, temperature, None))


def _gradient_in_place(kernels: Backend, logits, ids, stats, c, e, temperature: float) -> torch.Tensor:
    """Overwrites ``logits [t, V]`` with the gradient ``c (onehot - p) + e dH/dz`` (for ``z / T``), from the
    forward's ``stats = (row_max, log_s, logp, H)``."""
    everything = torch.ones((1, logits.shape[0]), dtype=torch.bool, device=logits.device)
    kernels.backward(logits[None], ids[None], everything, *(x[None] for x in stats), c[None], e[None],
                     logits[None], temperature, None)
    return logits


@functools.lru_cache(maxsize=None)
def _addmm_out_dtype_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``addmm(acc, a, b, out_dtype=float32, out=acc)`` accumulates low-precision products into a
    float32 tensor in place on this device (tried once on a small case and checked)."""
    try:
        a = torch.randn(8, 16, device=device).to(dtype)
        b = torch.randn(16, 8, device=device).to(dtype)
        acc = torch.randn(8, 8, device=device)
        expected = acc + a.float() @ b.float()
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        return bool(torch.allclose(acc, expected, rtol=1e-2, atol=1e-2))
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _add_weight_grad(d_weight: torch.Tensor, dlogits: torch.Tensor, h: torch.Tensor) -> None:
    """``d_weight [V, H] += dlogits.T @ h`` with ``d_weight`` float32 (or float64) and the product in the
    compute dtype: in place in the GEMM where possible, else in 128-row slices of the vocabulary."""
    if dlogits.dtype == d_weight.dtype:
        d_weight.addmm_(dlogits.T, h)
        return
    if dlogits.device.type == "cuda" and _addmm_out_dtype_works(dlogits.device, dlogits.dtype):
        torch.addmm(d_weight, dlogits.T, h, out_dtype=d_weight.dtype, out=d_weight)
        return
    vocab, hidden = d_weight.shape
    rows = max(128, WEIGHT_GRAD_SLICE_BYTES // (hidden * dlogits.element_size()) // 128 * 128)
    for v0 in range(0, vocab, rows):
        v1 = min(vocab, v0 + rows)
        d_weight[v0:v1] += (dlogits[:, v0:v1].T @ h).to(d_weight.dtype)


def fused_forward(hidden, weight, bias, ids, valid, advantages, lambda_, n_conflict, old_logprobs, ref_logprobs,
                  config: GTPOConfig, initial_entropy, kernels: Backend, compute_dtype: torch.dtype, temperature: float,
                  num_sequences, num_tokens, need_grads) -> List[torch.Tensor]:
    """The body of ``gtpo_kernels::fused_linear_gtpo`` (`custom_ops`): the loss and its gradients in one walk over
    the chunks. Returns ``[loss, d_hidden, d_weight, d_bias, logp, H, metric sums, completion entropy]``; a
    gradient not in ``need_grads`` is an empty tensor."""
    if True:  # (indentation of the former autograd Function's forward)
        n_rows, length, hidden_size = hidden.shape
        vocab = weight.shape[0]
        device = hidden.device
        need_hidden, need_weight = need_grads[0], need_grads[1]
        need_bias = bias is not None and need_grads[2]
        w = weight.to(compute_dtype)
        b = None if bias is None else bias.to(compute_dtype)
        stat_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32

        tokens = _unmasked_tokens(valid)
        sequences = n_rows if num_sequences is None else num_sequences
        token_total = tokens.offsets[-1] if num_tokens is None else num_tokens
        # Per token: row_max, log_s, logp, H (the backends' forward), for the whole call.
        stats_all = torch.zeros((4, n_rows, length), dtype=stat_dtype, device=device)
        logp_all, entropy_all = stats_all[2], stats_all[3]
        # Contiguous whatever the input's strides (hidden is often a slice of the model's output).
        d_hidden = torch.zeros(hidden.shape, dtype=hidden.dtype, device=device) if need_hidden else None
        # Accumulated in float32 across chunks (bf16 accumulation visibly shifts training).
        d_weight = torch.zeros((vocab, hidden_size), dtype=stat_dtype, device=device) if need_weight else None
        d_bias = torch.zeros(vocab, dtype=stat_dtype, device=device) if need_bias else None

        def rows_of(t0: int, t1: int):
            return hidden[tokens.rows[t0:t1], tokens.positions[t0:t1]].to(compute_dtype), ids.reshape(-1)[tokens.flat[t0:t1]]

        def coefficients(r0: int, r1: int):
            """``(c, e)`` ``[r1 - r0, L]``: the gradient of the batch loss w.r.t. these rows' logp and H."""
            rows = slice(r0, r1)
            return loss_gradients(
                logp_all[rows], entropy_all[rows], valid[rows], advantages[rows],
                None if lambda_ is None else lambda_[rows], None if n_conflict is None else n_conflict[rows],
                config, old_logprobs=None if old_logprobs is None else old_logprobs[rows],
                ref_logprobs=None if ref_logprobs is None else ref_logprobs[rows],
                initial_entropy=initial_entropy, num_sequences=sequences, num_tokens=token_total)

        def gradients(t0: int, t1: int, r0: int, c, e, logits=None):
            """The gradient of tokens ``[t0, t1)`` (rows from ``r0``), into d_hidden, d_W and d_b."""
            h, y = rows_of(t0, t1)
            if logits is None:  # a piece of a completion longer than the budget: compute its logits again
                logits = _logits(h, w, b)
            index = tokens.flat[t0:t1]
            local = index - r0 * length
            dlogits = _gradient_in_place(kernels, logits, y, stats_all.view(4, -1)[:, index], c.reshape(-1)[local],
                                         e.reshape(-1)[local], temperature)
            if need_hidden:
                d_hidden.view(-1, hidden_size).index_copy_(0, tokens.flat[t0:t1], (dlogits @ w).to(hidden.dtype))
            if need_weight:
                _add_weight_grad(d_weight, dlogits, h)
            if need_bias:
                d_bias.add_(dlogits.sum(dim=0, dtype=stat_dtype))

        budget = chunk_tokens_for(vocab, device, config.max_chunk_bytes)
        for r0, r1 in _chunks(tokens.offsets, budget):
            t_start, t_end = tokens.offsets[r0], tokens.offsets[r1]
            if t_start == t_end:
                continue
            pieces = [(t, min(t_end, t + budget)) for t in range(t_start, t_end, budget)]
            logits = None
            for t0, t1 in pieces:  # statistics (one piece, unless one completion is over budget)
                h, y = rows_of(t0, t1)
                logits = _logits(h, w, b)
                stats_all.view(4, -1)[:, tokens.flat[t0:t1]] = torch.stack(_stats(kernels, logits, y, temperature)).to(
                    stat_dtype)
            c, e = coefficients(r0, r1)
            if len(pieces) == 1:
                gradients(t_start, t_end, r0, c, e, logits)
                del logits
            else:
                del logits
                for t0, t1 in pieces:
                    gradients(t0, t1, r0, c, e)

        # The loss value and metrics from the whole call's statistics (cheap, O(N L)).
        full = loss_from_token_stats(
            logp_all, entropy_all, valid, advantages, lambda_, n_conflict, config, old_logprobs=old_logprobs,
            ref_logprobs=ref_logprobs, initial_entropy=initial_entropy, num_sequences=num_sequences,
            num_tokens=num_tokens)
        empty = hidden.new_empty((0,))
        return [full.loss.detach().to(stat_dtype),
                empty if d_hidden is None else d_hidden,
                empty if d_weight is None else d_weight.to(weight.dtype),
                empty if d_bias is None else d_bias.to(bias.dtype),
                logp_all.clone(), entropy_all.clone(), full.metrics.to_sums(),
                full.metrics.completion_entropy.to(stat_dtype)]


@torch.compiler.assume_constant_result
def _config_json(config: GTPOConfig) -> str:
    """The config as the operator takes it (a string); a constant for ``torch.compile``."""
    return json.dumps(config.to_dict())


def _check_linear_inputs(hidden_states, lm_head_weight, lm_head_bias) -> torch.dtype:
    """Shapes, dtypes and devices of ``hidden [N, L, H]``, ``weight [V, H]``, ``bias [V]``; returns the dtype
    of the matrix products (the autocast dtype under autocast)."""
    validation.check_float("hidden_states", hidden_states, hidden_states.shape, "[N, L, H]")
    if hidden_states.dim() != 3:
        raise ValueError(f"hidden_states must be 3-D [N, L, H], got shape {tuple(hidden_states.shape)}")
    if not isinstance(lm_head_weight, torch.Tensor) or lm_head_weight.dim() != 2 or \
            lm_head_weight.shape[1] != hidden_states.shape[2]:
        raise ValueError(f"lm_head_weight must be [V, H] with H = {hidden_states.shape[2]} (the hidden size), "
                         f"got {tuple(getattr(lm_head_weight, 'shape', ()))}; pass model.lm_head.weight")
    validation.check_float("lm_head_weight", lm_head_weight, lm_head_weight.shape, "[V, H]")
    if lm_head_bias is not None:
        validation.check_float("lm_head_bias", lm_head_bias, (lm_head_weight.shape[0],), "[V]")
    validation.check_same_device(hidden_states=hidden_states, lm_head_weight=lm_head_weight,
                                 lm_head_bias=lm_head_bias)
    device = hidden_states.device
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    if lm_head_weight.dtype != hidden_states.dtype:
        raise ValueError(f"hidden_states ({hidden_states.dtype}) and lm_head_weight ({lm_head_weight.dtype}) "
                         f"must share a dtype; cast one, or run under torch.autocast")
    return hidden_states.dtype


def fused_linear_gtpo_loss(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    group_size: Optional[int] = None,
    lm_head_bias: Optional[torch.Tensor] = None,
    config: Optional[GTPOConfig] = None,
    old_logprobs: Optional[torch.Tensor] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    initial_entropy: Optional[float] = None,
    conflict: Optional[Conflict] = None,
    num_sequences=None,
    num_tokens=None,
    temperature: float = 1.0,
    backend: str = "auto",
) -> GTPOLossOutput:
    """The GTPO loss of ``logits = hidden_states @ lm_head_weight.T + lm_head_bias``, never building them.

    Args:
        hidden_states: ``[N, L, H]`` final hidden states; position ``t`` of row ``i`` predicts
            ``completion_ids[i, t]`` (shifted by the caller, as for `gtpo_loss`).
        lm_head_weight: ``[V, H]``; frozen (``requires_grad=False``, e.g. LoRA) skips ``d_weight``.
        lm_head_bias: optional ``[V]``.
        completion_ids, completion_mask, advantages, group_size, config, old_logprobs, ref_logprobs,
        initial_entropy, conflict, num_sequences, num_tokens, temperature, backend: as for `gtpo_loss`.
            The memory budget is ``config.max_chunk_bytes`` (float32 bytes of one chunk's logits; default
            256 MiB on the CPU, 2 GiB on a GPU bounded by a quarter of its free memory).

    Returns:
        `GTPOLossOutput`; ``.loss`` is differentiable w.r.t. ``hidden_states``, ``lm_head_weight``
        and ``lm_head_bias``. ``d_weight`` is accumulated in float32 and returned in the weight's dtype.
        Under ``torch.autocast`` the matrix products run in the autocast dtype.
    """
    compute_dtype = _check_linear_inputs(hidden_states, lm_head_weight, lm_head_bias)
    vocab = lm_head_weight.shape[0]
    inputs = prepare_loss_inputs(
        hidden_states, completion_ids, completion_mask, advantages, group_size, config, old_logprobs,
        ref_logprobs, initial_entropy, conflict, num_sequences, num_tokens, temperature, vocab_size=vocab,
        what="hidden_states [N, L, H]")
    config, valid = inputs.config, inputs.valid
    device = hidden_states.device
    backend_ = resolve_backend_name(backend, device.type)
    stat_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
    lambda_, n_conflict = loss_conflict_weights(config, backend_, completion_ids, valid,
                                                advantages.to(stat_dtype), group_size, conflict)

    def as_count(value):  # whole-batch counts travel as 0-d float64 tensors (the operator's signature)
        return None if value is None else torch.as_tensor(value, dtype=torch.float64, device=device)

    need_grads = [hidden_states.requires_grad, lm_head_weight.requires_grad,
                  lm_head_bias is not None and lm_head_bias.requires_grad]
    with torch.autocast(device.type, enabled=False):
        outputs = custom_ops.fused_linear_gtpo(
            hidden_states, lm_head_weight, lm_head_bias, completion_ids, valid, advantages.detach().to(stat_dtype),
            lambda_, n_conflict, old_logprobs, ref_logprobs, _config_json(config), inputs.initial_entropy,
            backend_, compute_dtype, inputs.temperature, as_count(num_sequences), as_count(num_tokens),
            need_grads)
    loss, logp, entropy, sums, completion_entropy = outputs[0], outputs[4], outputs[5], outputs[6], outputs[7]
    if config.validate_inputs and not torch.compiler.is_compiling():
        validation.check_token_stats_finite(logp, entropy, valid)
    metrics = GTPOMetrics.from_sums(sums, has_kl=ref_logprobs is not None)
    metrics.completion_entropy = completion_entropy
    return GTPOLossOutput(loss, metrics)


@torch.no_grad()
def fused_linear_token_logprobs_and_entropy(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: Optional[torch.Tensor] = None,
    *,
    lm_head_bias: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    backend: str = "auto",
    max_chunk_bytes: Optional[int] = None,
    validate: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs and entropies of ``softmax((hidden @ W.T + b) / T)`` without gradient, in chunks of
    tokens, never building ``[N, L, V]``: old and reference log-probs and the initial entropy.

    Args:
        hidden_states: ``[N, L, H]``; ``completion_ids, completion_mask``: ``[N, L]`` (mask default: all).
        max_chunk_bytes: float32 bytes of one chunk's logits (default as in `GTPOConfig.max_chunk_bytes`).

    Returns:
        ``(logp, H)``, each ``[N, L]`` float32 (float64 for float64 inputs), zeros at masked positions.
    """
    compute_dtype = _check_linear_inputs(hidden_states, lm_head_weight, lm_head_bias)
    vocab = lm_head_weight.shape[0]
    shape = validation.check_ids(completion_ids)
    if tuple(hidden_states.shape[:2]) != shape:
        raise ValueError(f"hidden_states [N, L, H] = {tuple(hidden_states.shape)} and completion_ids [N, L] = "
                         f"{shape} disagree on N or L")
    temperature = validation.check_temperature(temperature)
    if max_chunk_bytes is not None and not (isinstance(max_chunk_bytes, int) and max_chunk_bytes > 0):
        raise ValueError(f"max_chunk_bytes must be a positive int or None, got {max_chunk_bytes!r}")
    device = hidden_states.device
    validation.check_same_device(hidden_states=hidden_states, completion_ids=completion_ids,
                                 completion_mask=completion_mask)
    if completion_mask is None:
        valid = torch.ones(shape, dtype=torch.bool, device=device)
    else:
        valid = validation.check_mask(completion_mask, shape, sync=validate)
    if validate:
        validation.check_ids_in_vocab(completion_ids, valid, vocab)
    kernels = kernels_for(get_backend(resolve_backend_name(backend, device.type)), compute_dtype)
    stat_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
    w = lm_head_weight.to(compute_dtype)
    b = None if lm_head_bias is None else lm_head_bias.to(compute_dtype)
    tokens = _unmasked_tokens(valid)
    logp_all = torch.zeros(shape, dtype=stat_dtype, device=device)
    entropy_all = torch.zeros_like(logp_all)
    budget = chunk_tokens_for(vocab, device, max_chunk_bytes)
    with torch.autocast(device.type, enabled=False):
        for t0 in range(0, tokens.offsets[-1], budget):
            t1 = min(tokens.offsets[-1], t0 + budget)
            h = hidden_states[tokens.rows[t0:t1], tokens.positions[t0:t1]].to(compute_dtype)
            y = completion_ids.reshape(-1)[tokens.flat[t0:t1]]
            _, _, logp, entropy = _stats(kernels, _logits(h, w, b), y, temperature)
            logp_all.view(-1).index_copy_(0, tokens.flat[t0:t1], logp.to(stat_dtype))
            entropy_all.view(-1).index_copy_(0, tokens.flat[t0:t1], entropy.to(stat_dtype))
    if validate:
        validation.check_token_stats_finite(logp_all, entropy_all, valid)
    return logp_all, entropy_all


class FusedLinearGTPOLoss(nn.Module):
    """`fused_linear_gtpo_loss` as a module:
    ``FusedLinearGTPOLoss(config)(hidden, model.lm_head.weight, ids, mask, advantages, group_size=G)``."""

    def __init__(self, config: Optional[GTPOConfig] = None, backend: str = "auto") -> None:
        super().__init__()
        self.config = config or GTPOConfig()
        self.backend = backend

    def forward(self, hidden_states, lm_head_weight, completion_ids, completion_mask, advantages,
                **kwargs) -> GTPOLossOutput:
        """Every keyword of `fused_linear_gtpo_loss` except ``config`` and ``backend``."""
        return fused_linear_gtpo_loss(hidden_states, lm_head_weight, completion_ids, completion_mask, advantages,
                                      config=self.config, backend=self.backend, **kwargs)

    def extra_repr(self) -> str:
        return f"preset={self.config.preset!r}, backend={self.backend!r}"
