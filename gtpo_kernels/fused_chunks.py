"""The chunk loop of the fused ``hidden @ lm_head`` loss: packing the unmasked tokens into chunks of whole
completions, each chunk's logits, statistics and gradients, and the float32 accumulation of ``d_W``.
`fused_forward` is the body of the ``gtpo_kernels::fused_linear_gtpo`` operator, registered in `fused_linear` with
the public functions and the overview; this module does not import it, so the operator can call it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import torch

from .backends import chunk_budget
from .backends.base import Backend, stats_dtype
from .config import GTPOConfig
from .objective import call_covariance_tokens, entropy_floor, loss_and_gradients, loss_from_token_stats
from .result import ROW_METRICS, GTPOMetrics
from .rows import LossRows
from .vocab_parallel import VocabParallel, quantile_gather

WEIGHT_GRAD_SLICE_BYTES = 64 * 2**20  # temporary of one slice of d_W when it cannot accumulate in place


def chunk_tokens_for(vocab: int, device: torch.device, max_chunk_bytes: Optional[int]) -> int:
    """Tokens of one chunk of the fused loss (`chunk_budget.FUSED_LINEAR`, or ``max_chunk_bytes``)."""
    return chunk_budget.chunk_tokens(vocab, chunk_budget.FUSED_LINEAR, device, max_chunk_bytes)


@dataclass
class Tokens:
    """The unmasked tokens of a batch, in row-major order, and where each row's tokens start."""

    flat: torch.Tensor  # [T] int64: i * L + t of each unmasked token
    rows: torch.Tensor  # [T] int64: i
    positions: torch.Tensor  # [T] int64: t
    offsets: List[int]  # [N + 1]: row i's tokens are flat[offsets[i]:offsets[i + 1]]
    packed: Optional[torch.Tensor] = None  # [T] int64: each token's row of packed hidden states [T_all, H]

    def hidden_of(self, hidden: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
        """``[t1 - t0, H]``: tokens ``[t0, t1)``'s hidden states (``hidden [N, L, H]``, or ``[T_all, H]`` packed)."""
        if self.packed is None:
            return hidden[self.rows[t0:t1], self.positions[t0:t1]]
        return hidden[self.packed[t0:t1]]

    def hidden_rows(self, t0: int, t1: int) -> torch.Tensor:
        """Where tokens ``[t0, t1)`` lie in a contiguous gradient of the hidden states viewed ``[-1, H]``."""
        return self.flat[t0:t1] if self.packed is None else self.packed[t0:t1]


def unmasked_tokens(
    valid: torch.Tensor, lengths: Optional[List[int]] = None, hidden_index: Optional[torch.Tensor] = None
) -> Tokens:
    """``lengths``: each row's unmasked tokens, if the caller has read them (else one host synchronisation);
    ``hidden_index [N, L]``: each position's row in packed hidden states (`packed.Packing.index`)."""
    n_rows, length = valid.shape
    if lengths is None:
        lengths = valid.sum(dim=1).tolist()
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    if hasattr(torch, "nonzero_static"):
        flat = torch.nonzero_static(valid.reshape(-1), size=offsets[-1]).squeeze(1)
    else:  # pragma: no cover (torch < 2.1)
        flat = valid.reshape(-1).nonzero().squeeze(1)
    packed = None if hidden_index is None else hidden_index.reshape(-1)[flat]
    return Tokens(flat, flat // max(1, length), flat % max(1, length), offsets, packed)


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


def chunk_logits(h: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
    return h @ w.T if b is None else torch.addmm(b, h, w.T)


@dataclass(frozen=True)
class LogitTransform:
    """What a head does to ``x = h @ W.T + b`` before the softmax: ``logits = scale * softcap * tanh(x / softcap)``,
    or ``scale * x`` without a soft cap (Gemma 2/3 soft-cap, Cohere and Falcon-H1 scale, Granite divides).

    The walk soft-caps each chunk's logits in place and multiplies their gradient by ``1 - (z / softcap)^2``
    (``z`` the capped logit, so the slope is read before the gradient is written over the logits: one more
    chunk-sized buffer, which halves the chunk's tokens). The scale it folds into the temperature:
    ``softmax(scale * z / T) = softmax(z / (T / scale))``, whose gradient with respect to ``z`` is the kernels'
    own, so a scaled head costs nothing."""

    scale: float = 1.0
    softcap: Optional[float] = None

    @classmethod
    def checked(cls, logit_scale, logit_softcap) -> LogitTransform:
        """The arguments ``logit_scale`` and ``logit_softcap`` of the fused functions, checked."""

        def positive(value) -> bool:
            return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value < math.inf

        if not positive(logit_scale):
            raise ValueError(f"logit_scale must be a positive finite float (1.0: none), got {logit_scale!r}")
        if logit_softcap is not None and not positive(logit_softcap):
            raise ValueError(f"logit_softcap must be a positive finite float or None (none), got {logit_softcap!r}")
        return cls(float(logit_scale), None if logit_softcap is None else float(logit_softcap))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The transformed logits (a new tensor; autograd follows it)."""
        if self.softcap is not None:
            x = torch.tanh(x / self.softcap) * self.softcap
        return x if self.scale == 1.0 else x * self.scale


@functools.cache
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


@dataclass(frozen=True)
class Walk:
    """How the fused walk runs: the backend's kernels (their own chunk budget set), the matrix products' dtype, the
    call's tokens (`unmasked_tokens`), which gradients to compute (hidden, weight, bias), the chunks' budget
    (``max_chunk_bytes``, `chunk_tokens_for`), what the head does to its logits (``logit_transform``) and the
    process groups it talks to: ``vocab_parallel``, the head is
    this rank's shard of the vocabulary (each chunk's shard statistics combined over the group: one all-gather per
    chunk, the same chunks on every rank; the gradients the shard's, ``d_hidden`` its share, to be summed over the
    group); ``entropy_quantile_group``, the processes whose tokens ``top_entropy_quantile``'s threshold spans."""

    kernels: Backend
    compute_dtype: torch.dtype
    tokens: Tokens
    need_grads: List[bool]
    max_chunk_bytes: Optional[int] = None
    logit_transform: LogitTransform = LogitTransform()
    vocab_parallel: Optional[VocabParallel] = None
    entropy_quantile_group: object = None


Temperature = Union[float, torch.Tensor]  # one for every token, or each token's ([N, L], float32)


class ChunkWalk:
    """The chunks of one call (whole completions, at most ``budget`` tokens each; a longer completion alone, in
    pieces) and what is done to each: its logits ``h @ W.T + b`` (transformed: `LogitTransform`), their statistics
    into ``stats`` ``[4, N, L]`` (``row_max, log_s, logp, H``), and the gradient ``c (onehot - p) + e dH/dz``
    written over them and taken into ``d_hidden``, ``d_W`` (float32) and ``d_b``. Both fused entry points walk it:
    the loss (`fused_forward`) and the statistics alone (`token_statistics`)."""

    def __init__(self, hidden: torch.Tensor, head, ids: torch.Tensor, temperature: Temperature, walk: Walk) -> None:
        weight, bias = head
        self.hidden, self.walk, self.tokens = hidden, walk, walk.tokens
        self.w = weight.to(walk.compute_dtype)
        self.b = None if bias is None else bias.to(walk.compute_dtype)
        vocab_parallel = walk.vocab_parallel
        self.ids = ids
        self.shard_ids = ids if vocab_parallel is None else ids - vocab_parallel.shards.offset
        # Each token's temperature flat, once (an [N] per completion arrives as an expanded [N, L] view); the head's
        # scale folded in (`LogitTransform`).
        temperature = temperature / walk.logit_transform.scale if walk.logit_transform.scale != 1.0 else temperature
        self.temperature = temperature.reshape(-1) if isinstance(temperature, torch.Tensor) else temperature
        self.softcap = walk.logit_transform.softcap
        self.stat_dtype = stats_dtype(walk.compute_dtype)
        self.stats = torch.zeros((4,) + tuple(ids.shape), dtype=self.stat_dtype, device=hidden.device)
        # Every rank of a vocabulary group walks the same chunks (the largest shard's budget).
        budget_vocab = weight.shape[0] if vocab_parallel is None else vocab_parallel.largest_shard
        self.budget = chunk_tokens_for(budget_vocab, hidden.device, walk.max_chunk_bytes)
        if self.softcap is not None:  # the soft cap's slope beside the logits
            self.budget = max(1, self.budget // 2)
        # Row ranges covering every row (an empty row's objective still counts it), N = 0 one empty range.
        self.chunks = _chunks(self.tokens.offsets, self.budget) or [(0, ids.shape[0])]

    def pieces(self, r0: int, r1: int) -> List[Tuple[int, int]]:
        """Token ranges of rows ``[r0, r1)``: one, unless one completion is over budget."""
        t_start, t_end = self.tokens.offsets[r0], self.tokens.offsets[r1]
        return [(t, min(t_end, t + self.budget)) for t in range(t_start, t_end, self.budget)]

    def _temperature(self, t0: int, t1: int) -> Temperature:
        """Tokens ``[t0, t1)``'s temperature: the call's one, or each token's ``[1, t1 - t0]``."""
        if not isinstance(self.temperature, torch.Tensor):
            return self.temperature
        return self.temperature[self.tokens.flat[t0:t1]][None]

    def _inputs(self, t0: int, t1: int):
        """Tokens ``[t0, t1)``: hidden states in the compute dtype, ids in this shard, temperatures."""
        h = self.tokens.hidden_of(self.hidden, t0, t1).to(self.walk.compute_dtype)
        return h, self.shard_ids.reshape(-1)[self.tokens.flat[t0:t1]], self._temperature(t0, t1)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """``[T, V]``: the head's logits of ``h [T, H]``, soft-capped in place (the scale is in the temperature)."""
        logits = chunk_logits(h, self.w, self.b)
        if self.softcap is not None:
            logits.div_(self.softcap).tanh_().mul_(self.softcap)
        return logits

    def statistics(self, r0: int, r1: int) -> Optional[torch.Tensor]:
        """Rows ``[r0, r1)``'s statistics into ``stats``; returns their logits when they are one piece (else
        ``None``: each piece's logits are computed again for the gradient)."""
        pieces, logits = self.pieces(r0, r1), None
        for t0, t1 in pieces:
            logits = None  # the last piece's logits freed before this piece's are made
            h, y, temperature = self._inputs(t0, t1)
            logits = self.logits(h)
            everything = torch.ones((1, t1 - t0), dtype=torch.bool, device=h.device)
            stats = self.walk.kernels.forward(logits[None], y[None], everything, temperature)
            self.stats.view(4, -1)[:, self.tokens.flat[t0:t1]] = torch.stack([x[0] for x in stats]).to(self.stat_dtype)
        if self.walk.vocab_parallel is not None and pieces:  # the shard's statistics -> the whole vocabulary's
            t0, t1 = pieces[0][0], pieces[-1][1]
            index = self.tokens.flat[t0:t1]
            self.stats.view(4, -1)[:, index] = self.walk.vocab_parallel.combine(
                self.stats.view(4, -1)[:, index], self.ids.reshape(-1)[index], self._temperature(t0, t1)
            )
        return logits if len(pieces) == 1 else None

    def add_gradients(self, grads: Gradients, r0: int, r1: int, c, e, logits: Optional[torch.Tensor]) -> None:
        """Rows ``[r0, r1)``'s gradient from ``c, e [r1 - r0, L]`` (d loss / d logp, d H), written over ``logits``
        (one piece) or over each piece's logits computed again, into ``grads``."""
        length = self.ids.shape[1]
        for t0, t1 in self.pieces(r0, r1):
            h, y, temperature = self._inputs(t0, t1)
            piece_logits = self.logits(h) if logits is None else logits
            index = self.tokens.flat[t0:t1]
            local = index - r0 * length
            everything = torch.ones((1, t1 - t0), dtype=torch.bool, device=h.device)
            stats = self.stats.view(4, -1)[:, index]
            # d z / d x of the soft cap, read before the kernels write d loss / d z over z
            slope = None if self.softcap is None else piece_logits.div(self.softcap).square_().neg_().add_(1)
            self.walk.kernels.backward(
                piece_logits[None],
                y[None],
                everything,
                *(x[None] for x in stats),
                c.reshape(-1)[local][None],
                e.reshape(-1)[local][None],
                piece_logits[None],
                temperature,
            )
            if slope is not None:
                piece_logits.mul_(slope)
            grads.add(self.tokens, t0, t1, piece_logits, h, self.w)
            del piece_logits, slope  # freed before the next piece's logits are made


@dataclass
class Gradients:
    """The fused loss's gradients, filled chunk by chunk: ``d_hidden`` in the hidden states' dtype (contiguous,
    whatever their strides), ``d_weight`` and ``d_bias`` accumulated in float32 (bf16 accumulation visibly shifts
    training); ``None`` where not asked for."""

    d_hidden: Optional[torch.Tensor]
    d_weight: Optional[torch.Tensor]
    d_bias: Optional[torch.Tensor]

    @classmethod
    def allocate(cls, hidden, weight, bias, need_grads: List[bool], stat_dtype: torch.dtype) -> Gradients:
        device = hidden.device
        return cls(
            torch.zeros(hidden.shape, dtype=hidden.dtype, device=device) if need_grads[0] else None,
            torch.zeros(weight.shape, dtype=stat_dtype, device=device) if need_grads[1] else None,
            torch.zeros(weight.shape[0], dtype=stat_dtype, device=device)
            if bias is not None and need_grads[2]
            else None,
        )

    @property
    def any(self) -> bool:
        return any(g is not None for g in (self.d_hidden, self.d_weight, self.d_bias))

    def add(self, tokens: Tokens, t0: int, t1: int, dlogits: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> None:
        if self.d_hidden is not None:
            hidden_size = self.d_hidden.shape[-1]
            self.d_hidden.view(-1, hidden_size).index_copy_(
                0, tokens.hidden_rows(t0, t1), (dlogits @ w).to(self.d_hidden.dtype)
            )
        if self.d_weight is not None:
            _add_weight_grad(self.d_weight, dlogits, h)
        if self.d_bias is not None:
            self.d_bias.add_(dlogits.sum(dim=0, dtype=self.d_bias.dtype))


def token_statistics(hidden: torch.Tensor, head, ids: torch.Tensor, temperature: Temperature, walk: Walk):
    """``(logp, H)`` ``[N, L]`` of the head's logits, zeros where masked: the walk's statistics alone."""
    chunks = ChunkWalk(hidden, head, ids, temperature, walk)
    for r0, r1 in chunks.chunks:
        chunks.statistics(r0, r1)
    return chunks.stats[2], chunks.stats[3]


@dataclass(frozen=True)
class FusedOutputs:
    """What the fused operator returns, by name: the loss (0-d), the gradients it computed on the way (``None``:
    not asked for), the metric sums (`GTPOMetrics.to_sums`) and the per-completion metrics ``[N]`` in
    `result.ROW_METRICS`' order. An operator returns a flat list (`to_list`, `of`)."""

    loss: torch.Tensor
    d_hidden: Optional[torch.Tensor]
    d_weight: Optional[torch.Tensor]
    d_bias: Optional[torch.Tensor]
    metric_sums: torch.Tensor
    row_metrics: Tuple[torch.Tensor, ...]

    def to_list(self) -> List[torch.Tensor]:
        """``[loss, d_hidden, d_weight, d_bias, metric_sums, *row_metrics]``, an empty tensor for a gradient not
        computed (a schema's list holds no ``None``); a fresh one each: an operator's outputs may not alias."""
        gradients = [self.loss.new_empty((0,)) if g is None else g for g in (self.d_hidden, self.d_weight, self.d_bias)]
        return [self.loss, *gradients, self.metric_sums, *self.row_metrics]

    @classmethod
    def of(cls, outputs: Sequence[torch.Tensor]) -> FusedOutputs:
        """The inverse of `to_list` (an empty gradient stays an empty tensor)."""
        loss, d_hidden, d_weight, d_bias, metric_sums, *row_metrics = outputs
        return cls(loss, d_hidden, d_weight, d_bias, metric_sums, tuple(row_metrics))


def fused_forward(
    hidden: torch.Tensor,
    head: Tuple[torch.Tensor, Optional[torch.Tensor]],
    rows: LossRows,
    config: GTPOConfig,
    walk: Walk,
) -> FusedOutputs:
    """The body of ``gtpo_kernels::fused_linear_gtpo`` (`fused_linear`): the loss and its gradients in one walk over
    the chunks of ``walk.tokens`` (``hidden`` ``[N, L, H]``, or ``[T, H]`` packed), for the head ``(weight [V, H],
    bias [V] or None)``; a gradient not in ``walk.need_grads`` is ``None``.

    Each chunk's rows are one evaluation of the objective with the whole call's counts (`loss_and_gradients`): its
    share of the loss, its metrics (merged over the chunks) and ``c, e``, the gradient with respect to its log-probs
    and entropies. With ``top_entropy_quantile < 1`` the objective needs the whole call's entropies (the threshold),
    and with ``cov_mode`` its log-probs (the tokens Clip-Cov or KL-Cov picks): a first walk computes every chunk's
    statistics, a second each chunk's logits again and its gradient (``8 T H V`` FLOPs instead of ``6``)."""
    weight, bias = head
    chunks = ChunkWalk(hidden, head, rows.ids, rows.token_temperature, walk)
    grads = Gradients.allocate(hidden, weight, bias, walk.need_grads, chunks.stat_dtype)
    two_passes = config.top_entropy_quantile < 1 or config.cov_mode is not None
    if two_passes:
        for r0, r1 in chunks.chunks:
            chunks.statistics(r0, r1)
        if config.top_entropy_quantile < 1:
            gather = quantile_gather(walk.entropy_quantile_group)
            rows = rows.replace(entropy_floor=entropy_floor(chunks.stats[3], rows.valid, config, gather))
        if config.cov_mode is not None:
            rows = rows.replace(cov_selected=call_covariance_tokens(chunks.stats[2], chunks.stats[3], rows, config))
    parts = []
    for r0, r1 in chunks.chunks:
        logits = None  # the last chunk's logits freed before this chunk's are made (one alive at a time)
        logits = None if two_passes else chunks.statistics(r0, r1)
        # A slice keeps the whole call's counts: the chunks' losses add up to the call's.
        logp, entropy, part = chunks.stats[2, r0:r1], chunks.stats[3, r0:r1], rows.slice(slice(r0, r1))
        if grads.any:
            out, c, e = loss_and_gradients(logp, entropy, part, config)
            chunks.add_gradients(grads, r0, r1, c, e, logits)
        else:  # under torch.no_grad (an evaluation): the loss and metrics only
            out = loss_from_token_stats(logp, entropy, part, config)
        parts.append(out)
    metrics = GTPOMetrics.merge([p.metrics for p in parts])

    return FusedOutputs(
        loss=torch.stack([p.loss.detach() for p in parts]).sum().to(chunks.stat_dtype),
        d_hidden=grads.d_hidden,
        d_weight=None if grads.d_weight is None else grads.d_weight.to(weight.dtype),
        d_bias=None if grads.d_bias is None else grads.d_bias.to(bias.dtype),
        metric_sums=metrics.to_sums(),
        row_metrics=tuple(getattr(metrics, name).to(chunks.stat_dtype) for name in ROW_METRICS),
    )
