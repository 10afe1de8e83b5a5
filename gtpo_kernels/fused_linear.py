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
operator, ``gtpo_kernels::fused_linear_gtpo`` (registered below), which ``torch.compile`` treats as a unit;
the walk itself is `fused_chunks.fused_forward`.

`fused_linear_token_logprobs_and_entropy` is the statistics alone, without gradient: old and reference
log-probs and the initial entropy, from hidden states.
"""

# No `from __future__ import annotations` here: torch.library.custom_op reads the signatures of the operators
# registered in this module, and torch 2.4-2.6 cannot read annotations written as strings (tools/torch-matrix.md).
import dataclasses
import typing
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch import Tensor, nn

from . import validation
from ._autograd import first_derivative_only, is_plain
from .backends import get_backend, kernels_for, resolve_backend_name
from .backends.base import stats_dtype
from .config import GTPOConfig
from .conflict import with_conflict_weights
from .fused_chunks import FusedOutputs, LogitTransform, Walk, fused_forward, token_statistics, unmasked_tokens
from .objective import signal_beyond_advantages
from .operators import Inputs, gradients_for, register_operator, signature_of
from .packed import padded_rows
from .result import ROW_METRICS, SUMS_SIZE, GTPOLossOutput, GTPOMetrics
from .rows import OP_PARAMETERS, LossRows, checked_rows, resolved_config, rows_of_call, takes_row_keywords
from .validation import token_temperature
from .vocab_parallel import VocabParallel, group_name, group_named


@dataclass(frozen=True)
class FusedSettings:
    """The fused operator's arguments that are neither the head nor the rows nor the config: the head's transform
    of its logits (`fused_chunks.LogitTransform`), the backend, the dtype of the matrix products, each row's
    unmasked tokens when the caller has read them (else the operator reads them: one host synchronisation), the
    process groups by the names `vocab_parallel.group_name` gave them (a schema takes no process group) with each
    rank's vocabulary shard size, and which of hidden, weight, bias to compute a gradient for."""

    logit_scale: float
    logit_softcap: Optional[float]
    backend: str
    compute_dtype: torch.dtype
    row_lengths: Optional[List[int]]
    vocab_group: Optional[str]
    shard_sizes: Optional[List[int]]
    entropy_quantile_group: Optional[str]
    need_grads: List[bool]


# The operator's arguments, in order: the head, the rows (`LossRows.op_inputs`), the settings, and every field of
# the config the walk reads (its resolved values, constants for torch.compile). Each group declares its own names
# once. A schema takes at most 64 arguments, so the config's fields that act before the operator stay out of it
# (the operator's config takes their defaults; tests/test_fused_linear.py: the walk reads none of them).
_HEAD = (("hidden", Tensor), ("weight", Tensor), ("bias", Optional[Tensor]), ("hidden_index", Optional[Tensor]))
_SETTINGS = tuple((field.name, field.type) for field in dataclasses.fields(FusedSettings))
CONFIG_NOT_IN_OPERATOR = {
    "preset": "only fills the other fields, which the operator takes resolved",
    "normalize_advantages_by_std": "a trainer's, for its advantages: the loss takes them made",
    "validate_inputs": "the inputs are checked before the operator runs",
    "warn_no_signal": "the warning is queued before the operator runs",
}
_CONFIG = tuple(
    (name, kind) for name, kind in typing.get_type_hints(GTPOConfig).items() if name not in CONFIG_NOT_IN_OPERATOR
)
_SIGNATURE = signature_of(_HEAD, OP_PARAMETERS, _SETTINGS, _CONFIG, returns=List[Tensor])


def _config_inputs(config: GTPOConfig) -> dict:
    """The config as the operator takes it: each field's resolved value (which Dynamo tracks as a constant even for
    a config built inside the compiled function; the object itself it would hand over with the preset's sentinels
    still in place)."""
    return {name: getattr(config, name) for name, _ in _CONFIG}


def _check_linear_inputs(hidden_states, lm_head_weight, lm_head_bias) -> torch.dtype:
    """Shapes, dtypes and devices of ``hidden [N, L, H]``, ``weight [V, H]``, ``bias [V]``; returns the dtype
    of the matrix products (the autocast dtype under autocast)."""
    validation.check_float("hidden_states", hidden_states, hidden_states.shape, "[N, L, H]")
    if hidden_states.dim() != 3:
        raise ValueError(f"hidden_states must be 3-D [N, L, H], got shape {tuple(hidden_states.shape)}")
    if (
        not isinstance(lm_head_weight, torch.Tensor)
        or lm_head_weight.dim() != 2
        or lm_head_weight.shape[1] != hidden_states.shape[2]
    ):
        raise ValueError(
            f"lm_head_weight must be [V, H] with H = {hidden_states.shape[2]} (the hidden size), "
            f"got {tuple(getattr(lm_head_weight, 'shape', ()))}; pass model.lm_head.weight"
        )
    validation.check_float("lm_head_weight", lm_head_weight, lm_head_weight.shape, "[V, H]")
    if lm_head_bias is not None:
        validation.check_float("lm_head_bias", lm_head_bias, (lm_head_weight.shape[0],), "[V]")
    validation.check_same_device(hidden_states=hidden_states, lm_head_weight=lm_head_weight, lm_head_bias=lm_head_bias)
    device = hidden_states.device
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    if lm_head_weight.dtype != hidden_states.dtype:
        raise ValueError(
            f"hidden_states ({hidden_states.dtype}) and lm_head_weight ({lm_head_weight.dtype}) "
            f"must share a dtype; cast one, or run under torch.autocast"
        )
    return hidden_states.dtype


def _queue_no_signal_warning(checks: validation.DeferredChecks, rows: LossRows, config: GTPOConfig) -> None:
    """``warn_no_signal`` from what is known before the statistics: no unmasked token with a non-zero advantage and
    conflict weight, and no other term (the statistics come after the call's one read). GTPO's entropy shift gives a
    tied group ``-gamma Hbar`` (scope "all"), a signal only the statistics decide: no claim then."""
    shift = config.entropy_mode == "advantage_shift" and config.entropy_coef > 0
    shift = shift and config.entropy_shift_scope == "all"  # else a tied group's A = 0 gives none
    if not config.warn_no_signal or shift or signal_beyond_advantages(config, rows.ref_logprobs is not None):
        return
    weight = rows.advantages[:, None] * (1 if rows.lambda_ is None else rows.lambda_)
    checks.add_warning(
        ~((weight != 0) & rows.valid).any(), "no_signal", lambda: validation.no_signal_message(None, config)
    )


def _needed_gradients(hidden, weight, bias) -> List[bool]:
    """Which of hidden, weight, bias the walk computes a gradient for: none under ``torch.no_grad`` (an evaluation,
    TRL's ``prediction_step``)."""
    grad_enabled = torch.is_grad_enabled()
    return [
        grad_enabled and hidden.requires_grad,
        grad_enabled and weight.requires_grad,
        grad_enabled and bias is not None and bias.requires_grad,
    ]


def _read_checks_and_lengths(
    checks: validation.DeferredChecks,
    hidden_states,
    lm_head_weight,
    lm_head_bias,
    completion_ids,
    valid,
    vocab_size,
    stacklevel: int = 5,
) -> Optional[List[int]]:
    """The fused path's one host synchronisation: its value checks and the row lengths that plan its chunks,
    read together (a warning points ``stacklevel`` frames up: the public function's caller). Its logits are finite
    when the hidden states and weights are, so those are checked in place of the statistics (which come only after
    the chunks are planned). ``None`` under torch.compile (the operator reads the lengths itself)."""
    if torch.compiler.is_compiling():
        return None
    validation.add_ids_check(checks, completion_ids, valid, vocab_size)
    for name, tensor in (
        ("hidden_states", hidden_states),
        ("lm_head_weight", lm_head_weight),
        ("lm_head_bias", lm_head_bias),
    ):
        validation.add_finite_check(checks, name, tensor)
    return checks.read(valid.sum(dim=1), stacklevel=stacklevel)


@takes_row_keywords()
def fused_linear_gtpo_loss(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    lm_head_bias: Optional[torch.Tensor] = None,
    logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    config: Optional[GTPOConfig] = None,
    backend: str = "auto",
    cu_seqlens: Optional[torch.Tensor] = None,
    vocab_group=None,
    entropy_quantile_group=None,
    **row_keywords,
) -> GTPOLossOutput:
    """The GTPO loss of ``logits = hidden_states @ lm_head_weight.T + lm_head_bias`` (or a soft cap or scale of
    them), never building them.

    Args:
        hidden_states: ``[N, L, H]`` final hidden states; position ``t`` of row ``i`` predicts
            ``completion_ids[i, t]`` (shifted by the caller, as for `gtpo_loss`).
        lm_head_weight: ``[V, H]``; frozen (``requires_grad=False``, e.g. LoRA) skips ``d_weight``.
        lm_head_bias: optional ``[V]``.
        logit_scale, logit_softcap: for heads that transform their logits ``x``: the loss is then that of
            ``logit_scale * logit_softcap * tanh(x / logit_softcap)`` (``logit_scale * x`` without a soft cap):
            Gemma 2/3's ``final_logit_softcapping``, Cohere's ``logit_scale``, Granite's ``1 / logits_scaling``
            (`gtpo_kernels.hf.logit_transform` reads them from a model's config).
        completion_ids, completion_mask, advantages, group_size, config, old_logprobs, ref_logprobs, sampling_logprobs,
        initial_entropy, conflict, num_sequences, num_tokens, temperature, backend: as for `gtpo_loss`.
            The memory budget is ``config.max_chunk_bytes`` (float32 bytes of one chunk's logits; default
            256 MiB on the CPU, 2 GiB on a GPU, constants: the same inputs give bitwise the same gradients).
        cu_seqlens: ``[N + 1]`` offsets of packed completions: ``hidden_states`` is then ``[T, H]`` and the
            per-token inputs ``[T]``, as for `gtpo_loss` (no padded copy of the hidden states is made).
        vocab_group: the process group over which ``lm_head_weight`` (and ``lm_head_bias``) are sharded by rows
            (vocabulary), this rank's ``[V_r, H]`` (Megatron's ``ColumnParallelLinear`` output layer), every other
            argument the same on every rank: the whole vocabulary's loss on every rank, one all-gather of four
            floats per token per chunk. The gradients are this shard's: ``d_weight``/``d_bias`` of the shard,
            and ``d_hidden`` this shard's share, which the tensor-parallel framework sums over the group (as the
            backward of Megatron's ``copy_to_tensor_model_parallel_region`` does). Tested in eager mode.
        entropy_quantile_group: as for `gtpo_loss` (``config.top_entropy_quantile``). Tested in eager mode.

    Returns:
        `GTPOLossOutput`; ``.loss`` is differentiable w.r.t. ``hidden_states``, ``lm_head_weight``
        and ``lm_head_bias``. ``d_weight`` is accumulated in float32 and returned in the weight's dtype.
        Under ``torch.autocast`` the matrix products run in the autocast dtype.
    """
    packed_hidden, hidden_states = _packed_hidden(hidden_states, cu_seqlens)
    compute_dtype = _check_linear_inputs(hidden_states, lm_head_weight, lm_head_bias)
    transform = LogitTransform.checked(logit_scale, logit_softcap)
    config = resolved_config(config)
    given = rows_of_call("fused_linear_gtpo_loss", completion_ids, completion_mask, advantages, row_keywords)
    packing = hidden_index = None
    layout = hidden_states
    if packed_hidden is not None:
        given, packing = padded_rows(packed_hidden, "hidden_states", given, cu_seqlens)
        hidden_states, hidden_index = packed_hidden, packing.index()
        layout = packed_hidden.new_empty(()).expand(*packing.shape, packed_hidden.shape[-1])
    rows, checks = checked_rows(layout, "hidden_states", given, config)
    backend_ = resolve_backend_name(backend, hidden_states.device.type)
    advantages = rows.advantages.detach().to(stats_dtype(compute_dtype))
    rows = with_conflict_weights(rows.replace(advantages=advantages), config, backend_)
    _queue_no_signal_warning(checks, rows, config)
    head = dict(hidden=hidden_states, weight=lm_head_weight, bias=lm_head_bias, hidden_index=hidden_index)
    vocab_parallel, row_lengths = _shards_and_lengths(checks, head, rows, vocab_group, compute_dtype)
    settings = FusedSettings(
        logit_scale=transform.scale,
        logit_softcap=transform.softcap,
        backend=backend_,
        compute_dtype=compute_dtype,
        row_lengths=row_lengths or None,  # N = 0: an empty list would not match its gradient's structure (None)
        vocab_group=group_name(vocab_group),
        shard_sizes=None if vocab_parallel is None else list(vocab_parallel.shards.sizes),
        entropy_quantile_group=group_name(entropy_quantile_group),
        need_grads=_needed_gradients(hidden_states, lm_head_weight, lm_head_bias),
    )
    return _loss_of_operator(head, rows, settings, config)


def _shards_and_lengths(checks: validation.DeferredChecks, head: dict, rows: LossRows, vocab_group, compute_dtype):
    """``(vocab_parallel, row_lengths)``: the head's vocabulary shards over ``vocab_group`` (``None``: the whole
    vocabulary is here), and each row's unmasked tokens, read with the call's value checks (its one host
    synchronisation, `_read_checks_and_lengths`; warnings point at the loss's caller, two frames up)."""
    hidden, weight, bias = head["hidden"], head["weight"], head["bias"]
    vocab_parallel = None
    if vocab_group is not None:
        vocab_parallel = VocabParallel.of_head(
            vocab_group, weight.shape[0], rows.ids.shape, hidden.shape[-1], compute_dtype, hidden.device
        )
    vocab_size = weight.shape[0] if vocab_parallel is None else vocab_parallel.shards.vocab_size
    lengths = _read_checks_and_lengths(checks, hidden, weight, bias, rows.ids, rows.valid, vocab_size, stacklevel=6)
    return vocab_parallel, lengths


def _packed_hidden(hidden_states, cu_seqlens) -> Tuple[Optional[Tensor], Tensor]:
    """``(packed [T, H] or None, hidden states as checked)``: packed ones are checked as ``[1, T, H]``; the operator
    takes them ``[T, H]``, with each position's row."""
    if cu_seqlens is None:
        return None, hidden_states
    if isinstance(hidden_states, torch.Tensor) and hidden_states.dim() != 2:
        raise ValueError(
            f"with cu_seqlens (packed completions) hidden_states must be 2-D [T, H], got shape "
            f"{tuple(hidden_states.shape)}"
        )
    return hidden_states, hidden_states[None]


def _loss_of_operator(head: dict, rows: LossRows, settings: FusedSettings, config: GTPOConfig) -> GTPOLossOutput:
    """The registered operator on checked inputs (``head``: its head arguments by name), its outputs as the loss and
    the metrics."""
    device = head["hidden"].device

    def as_count(value):  # whole-batch counts travel as 0-d float64 tensors (the operator's signature)
        return None if value is None else torch.as_tensor(value, dtype=torch.float64, device=device)

    rows = rows.replace(num_sequences=as_count(rows.num_sequences), num_tokens=as_count(rows.num_tokens))
    with torch.autocast(device.type, enabled=False):
        outputs = FusedOutputs.of(
            fused_linear_gtpo(**head, **rows.op_inputs(), **_settings_inputs(settings), **_config_inputs(config))
        )
    # The operator's outputs all carry its grad_fn; metrics are reports, never part of the graph.
    metrics = GTPOMetrics.from_sums(
        outputs.metric_sums.detach(),
        has_kl=rows.ref_logprobs is not None,
        has_vespo=config.ratio_function == "vespo",
        per_row=[values.detach() for values in outputs.row_metrics],
    )
    return GTPOLossOutput(outputs.loss, metrics)


# ------------------------------------------------------------------------------------------ the operator


def _settings_inputs(settings: FusedSettings) -> dict:
    return {name: getattr(settings, name) for name, _ in _SETTINGS}  # not asdict: it deep-copies the lists


@register_operator("gtpo_kernels::fused_linear_gtpo", _SIGNATURE)
def fused_linear_gtpo(*inputs) -> List[Tensor]:
    """The fused loss and, computed on the way, its gradients: `fused_chunks.FusedOutputs` as a list (gradients not
    asked for are empty tensors). Its arguments (`_SIGNATURE`): the head ``hidden, weight, bias, hidden_index``
    (``hidden_index``: ``None`` for ``hidden [N, L, H]``; for packed ``hidden [T, H]``, each position's row in it,
    `packed.Packing.index`), a checked `rows.LossRows` as `LossRows.op_inputs` names it, the `FusedSettings` and every
    field of the `GTPOConfig`, each by its own name."""
    given = Inputs(fused_linear_gtpo, inputs)
    rows = LossRows.from_op_inputs(given.pick(name for name, _ in OP_PARAMETERS))
    settings = FusedSettings(**given.pick(name for name, _ in _SETTINGS))
    config = GTPOConfig.from_dict(given.pick(name for name, _ in _CONFIG))
    kernels = kernels_for(get_backend(settings.backend), settings.compute_dtype, config.max_chunk_bytes)
    tokens = unmasked_tokens(rows.valid, settings.row_lengths, given.hidden_index)
    walk = Walk(
        kernels,
        settings.compute_dtype,
        tokens,
        settings.need_grads,
        config.max_chunk_bytes,
        LogitTransform(settings.logit_scale, settings.logit_softcap),
        VocabParallel.named(settings.vocab_group, settings.shard_sizes),
        group_named(settings.entropy_quantile_group),
    )
    return fused_forward(given.hidden, (given.weight, given.bias), rows, config, walk).to_list()


@fused_linear_gtpo.register_fake
def _(*inputs):
    given = Inputs(fused_linear_gtpo, inputs)
    hidden, weight, bias, need_grads = given.hidden, given.weight, given.bias, given.need_grads
    stat = stats_dtype(given.compute_dtype)
    return FusedOutputs(
        loss=hidden.new_empty((), dtype=stat),
        d_hidden=torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_grads[0] else None,
        d_weight=torch.empty_like(weight) if need_grads[1] else None,
        d_bias=torch.empty_like(bias) if bias is not None and need_grads[2] else None,
        metric_sums=hidden.new_empty((SUMS_SIZE,), dtype=torch.float64),
        row_metrics=tuple(hidden.new_empty((given.ids.shape[0],), dtype=stat) for _ in ROW_METRICS),
    ).to_list()


def _fused_setup(ctx, inputs, output):
    # Only the loss is differentiated: no zero gradients materialised for the other outputs (two of them are
    # d_hidden- and d_weight-sized).
    ctx.set_materialize_grads(False)
    given, outputs = Inputs(fused_linear_gtpo, inputs), FusedOutputs.of(output)
    ctx.save_for_backward(outputs.d_hidden, outputs.d_weight, outputs.d_bias)
    ctx.needed = [need and (i != 2 or given.bias is not None) for i, need in enumerate(given.need_grads)]


def _fused_grad(ctx, output_grads):
    return fused_gradients(ctx, output_grads[0])  # a list-returning operator's backward takes them as one list


@first_derivative_only
def fused_gradients(ctx, grad_loss):
    """The fused loss's backward: the gradients its forward stored (``ctx.saved_tensors``: hidden, weight, bias)
    times the loss's incoming gradient; ``None`` for the operator's other inputs.

    In eager mode they are scaled in place and handed on: a copy would cost another ``d_weight`` and
    ``d_hidden`` (1.1 GB at H = 3584, V = 151936 in bf16) at the backward's peak, to multiply by 1. So the
    backward runs once per forward: a second one (``retain_graph=True``) raises instead of scaling twice.
    Traced (``torch.compile``, ``opcheck``'s AOT dispatch) it is the out-of-place product: a functional graph plans
    its memory itself."""
    if getattr(ctx, "gradients_handed_on", False):
        raise RuntimeError(
            "the fused gtpo_kernels loss's backward ran twice on one forward (retain_graph=True): its stored "
            "gradients were handed on the first time; call fused_linear_gtpo_loss again for another backward"
        )
    saved = ctx.saved_tensors
    if grad_loss is None:
        grad_loss = torch.zeros((), device=saved[0].device)
    in_place = not torch.compiler.is_compiling() and all(is_plain(t) for t in (*saved, grad_loss))
    ctx.gradients_handed_on = in_place
    hidden, weight, bias = (
        (g.mul_(grad_loss.to(g.dtype)) if in_place else g * grad_loss.to(g.dtype)) if needed else None
        for g, needed in zip(saved, ctx.needed)
    )
    return gradients_for(fused_linear_gtpo, hidden=hidden, weight=weight, bias=bias)


torch.library.register_autograd("gtpo_kernels::fused_linear_gtpo", _fused_grad, setup_context=_fused_setup)


@torch.no_grad()
def fused_linear_token_logprobs_and_entropy(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: Optional[torch.Tensor] = None,
    *,
    lm_head_bias: Optional[torch.Tensor] = None,
    logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    temperature=1.0,
    backend: str = "auto",
    max_chunk_bytes: Optional[int] = None,
    validate: bool = True,
    vocab_group=None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs and entropies of ``softmax((hidden @ W.T + b) / T)`` without gradient, in chunks of
    tokens, never building ``[N, L, V]``: old and reference log-probs and the initial entropy.

    Args:
        hidden_states: ``[N, L, H]``; ``completion_ids, completion_mask``: ``[N, L]`` (mask default: all).
        logit_scale, logit_softcap: the head's transform of its logits, as for `fused_linear_gtpo_loss`.
        temperature: a float, or ``[N]`` each completion's (as for `gtpo_loss`).
        max_chunk_bytes: float32 bytes of one chunk's logits, and of the ``"torch"`` backend's passes inside a
            chunk (default as in `GTPOConfig.max_chunk_bytes`).
        vocab_group: the head is this rank's ``[V_r, H]`` shard of the vocabulary (`fused_linear_gtpo_loss`).

    Returns:
        ``(logp, H)``, each ``[N, L]`` float32 (float64 for float64 inputs), zeros at masked positions.
    """
    compute_dtype = _check_linear_inputs(hidden_states, lm_head_weight, lm_head_bias)
    transform = LogitTransform.checked(logit_scale, logit_softcap)
    vocab = lm_head_weight.shape[0]
    checks = validation.DeferredChecks(validate and not torch.compiler.is_compiling())
    valid, temperature = validation.check_stats_inputs(
        hidden_states, "hidden_states", completion_ids, completion_mask, temperature, checks
    )
    if max_chunk_bytes is not None and not (isinstance(max_chunk_bytes, int) and max_chunk_bytes > 0):
        raise ValueError(f"max_chunk_bytes must be a positive int or None, got {max_chunk_bytes!r}")
    device = hidden_states.device
    kernels = kernels_for(get_backend(resolve_backend_name(backend, device.type)), compute_dtype, max_chunk_bytes)
    vocab_parallel = None
    if vocab_group is not None:
        vocab_parallel = VocabParallel.of_head(
            vocab_group, vocab, valid.shape, hidden_states.shape[-1], compute_dtype, device
        )
        vocab = vocab_parallel.shards.vocab_size
    tokens = unmasked_tokens(
        valid,
        _read_checks_and_lengths(checks, hidden_states, lm_head_weight, lm_head_bias, completion_ids, valid, vocab),
    )
    walk = Walk(kernels, compute_dtype, tokens, [False] * 3, max_chunk_bytes, transform, vocab_parallel)
    with torch.autocast(device.type, enabled=False):
        return token_statistics(
            hidden_states,
            (lm_head_weight, lm_head_bias),
            completion_ids,
            token_temperature(temperature, valid.shape),
            walk,
        )


class FusedLinearGTPOLoss(nn.Module):
    """`fused_linear_gtpo_loss` as a module:
    ``FusedLinearGTPOLoss(config)(hidden, model.lm_head.weight, ids, mask, advantages, group_size=G)``."""

    def __init__(self, config: Optional[GTPOConfig] = None, backend: str = "auto") -> None:
        super().__init__()
        self.config = config or GTPOConfig()
        self.backend = backend

    def forward(
        self, hidden_states, lm_head_weight, completion_ids, completion_mask, advantages, **kwargs
    ) -> GTPOLossOutput:
        """Every keyword of `fused_linear_gtpo_loss` except ``config`` and ``backend``."""
        return fused_linear_gtpo_loss(
            hidden_states,
            lm_head_weight,
            completion_ids,
            completion_mask,
            advantages,
            config=self.config,
            backend=self.backend,
            **kwargs,
        )

    def extra_repr(self) -> str:
        return f"preset={self.config.preset!r}, backend={self.backend!r}"
