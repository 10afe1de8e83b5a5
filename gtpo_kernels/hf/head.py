"""The head check: whether a causal LM's logits are exactly ``final_hidden @ lm_head.weight.T (+ bias)``.

`fused_linear_gtpo_loss` wants ``hidden_states`` and ``lm_head.weight`` instead of logits, so that a
training step never builds the ``[B, T, V]`` logits. That is only equivalent when the model's logits
are exactly ``final_hidden @ lm_head.weight.T (+ bias)``: checked per model (`check_hidden_states_supported`),
not by name; models that scale or soft-cap their logits (Gemma 2, Cohere, Granite, Falcon-H1) are named by
`logit_transform`, whose `LogitTransform` the fused functions take (``logit_scale``, ``logit_softcap``).
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from ..fused_chunks import LogitTransform
from .model_config import linear_head, text_config, unwrap

# Config attributes that, when set to something other than 1, transform the logits after lm_head:
# attribute -> (what it does, its `LogitTransform`). Gemma 2/3 soft-cap, Cohere scales, Granite divides,
# Falcon-H1 multiplies.
LOGIT_TRANSFORMS = {
    "final_logit_softcapping": ("soft-caps", lambda c: LogitTransform(softcap=c)),
    "logit_scale": ("scales", lambda c: LogitTransform(scale=c)),
    "logits_scaling": ("divides", lambda c: LogitTransform(scale=1 / c)),
    "output_multiplier_scale": ("scales", lambda c: LogitTransform(scale=c)),
    "lm_head_multiplier": ("scales", lambda c: LogitTransform(scale=c)),
}
_CHECKED = "_gtpo_head_checked"  # set on a model whose logits the probe found to be hidden @ W.T (+ b)


def decoder_of(model):
    """The module that returns the final hidden states (``last_hidden_state``): ``get_decoder()``, or, where a
    model's ``get_decoder()`` returns the whole causal LM (Llama 4), its inner ``model``."""
    base = unwrap(model)
    decoder = base.get_decoder()
    if decoder is base:
        decoder = getattr(base, "model", None) or getattr(base, "language_model", None)
        if decoder is None or decoder is base:
            raise ValueError(
                f"{type(base).__name__}.get_decoder() returns the whole model and it has no inner "
                f"'model' to take the hidden states from"
            )
    return decoder


def logit_transform(model) -> Optional[Tuple[str, LogitTransform]]:
    """``(description, f)`` when ``model``'s logits are ``f(hidden @ W.T (+ b))`` for one of the known transforms
    (`LOGIT_TRANSFORMS`), else ``None``; ``f.scale``, ``f.softcap`` are the fused functions' ``logit_scale``,
    ``logit_softcap``."""
    config = text_config(unwrap(model))
    found = [(attr, getattr(config, attr, None)) for attr in LOGIT_TRANSFORMS]
    found = [(attr, value) for attr, value in found if value not in (None, 1, 1.0)]
    if not found:
        return None
    if len(found) > 1:
        raise ValueError(f"{type(unwrap(model)).__name__} sets several logit transforms {found}; not supported")
    attr, value = found[0]
    what, transform = LOGIT_TRANSFORMS[attr]
    return f"{what} its logits (config.{attr} = {value})", transform(value)


def head_logit_transform(model) -> Optional[Tuple[str, LogitTransform]]:
    """For a trainer that passes the transform to the fused functions: ``None`` when ``model``'s logits are
    ``hidden @ W.T (+ b)``, ``(description, f)`` when they are ``f`` of that for a known transform (checked on a
    few tokens like `check_hidden_states_supported`); raises ``ValueError`` for anything else."""
    transform = logit_transform(model)
    if transform is None:
        check_hidden_states_supported(model)
    else:
        _check_head(model, transform[1], f"{transform[0]} applied to final_hidden @ lm_head.weight.T", advice="")
    return transform


def check_hidden_states_supported(model, allow_unknown: bool = False) -> None:
    """Raises ``ValueError`` unless ``model``'s logits are ``hidden @ lm_head.weight.T (+ bias)``.

    Not an allow-list of architectures: the model must have a linear ``lm_head`` and a decoder, no known
    logit transform (`logit_transform`), and, checked once per model on a few tokens, its own logits must be
    those of its final hidden states through the head (a head with a transform of its own, as BERT's,
    fails there). ``allow_unknown=True`` skips that probe."""
    transform = logit_transform(model)
    if transform is not None:
        raise ValueError(
            f"{type(unwrap(model)).__name__} {transform[0]} after lm_head; hidden @ lm_head.weight.T "
            f"would not be its logits: pass logit_scale={transform[1].scale}, logit_softcap={transform[1].softcap} "
            f"to the fused functions, or use gtpo_loss on model(...).logits"
        )
    _check_head(
        model,
        lambda x: x,
        "final_hidden @ lm_head.weight.T",
        advice="; use gtpo_loss on model(...).logits",
        probe=not allow_unknown,
    )


def _check_head(model, transform: Callable, what: str, advice: str, probe: bool = True) -> None:
    """A linear head and a decoder, and (once per model, unless ``probe`` is off) the model's logits equal to
    ``transform(head(final hidden states))`` on a few tokens; ``what`` and ``advice`` word the errors."""
    base = unwrap(model)
    head = linear_head(base)
    if head is None or not hasattr(base, "get_decoder"):
        raise ValueError(
            f"{type(base).__name__} has no linear lm_head and decoder (get_output_embeddings(), "
            f"get_decoder()){advice + ' instead' if advice else ''}"
        )
    if not probe or getattr(base, _CHECKED, False):
        return
    if not _sharded(base):
        # (FSDP2 / ZeRO-3 parameters are not probed: a forward outside the training step's own would gather and
        # release them out of turn on each process. The trainers check the model before wrapping it.)
        try:
            error = _probe_head(base, head, transform)
        except ModelForwardError as exc:  # the model itself does not run: not a question of its head
            raise ValueError(f"{exc}; fix the model or its inputs (the head check runs it on 2 x 4 tokens)") from exc
        if error is not None:
            raise ValueError(f"{type(base).__name__}'s logits are not {what} ({error}){advice}")
    setattr(base, _CHECKED, True)


class ModelForwardError(RuntimeError):
    """The model's own forward raised during the head check."""


def _sharded(base) -> bool:
    """Whether ``base``'s parameters are sharded across processes (FSDP2 DTensors, DeepSpeed ZeRO-3)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        DTensor = ()
    return any(isinstance(p, DTensor) or hasattr(p, "ds_id") for p in base.parameters())


@torch.no_grad()
def _probe_head(base, head, transform: Callable = lambda x: x) -> Optional[str]:
    """Compares the model's logits with its decoder's hidden states through ``head`` (and ``transform``) on 2 x 4
    tokens (eval mode, so that dropout does not differ). ``None`` when they agree."""
    was_training = base.training
    base.eval()
    try:
        vocab = head.weight.shape[0]
        ids = (torch.arange(8, device=head.weight.device) * 7 % max(1, vocab - 1) + 1).reshape(2, 4)
        hidden = decoder_of(base)(input_ids=ids, use_cache=False).last_hidden_state
        mine = transform(head(hidden).float())
        try:
            logits = base(input_ids=ids, use_cache=False).logits.float()
        except Exception as exc:
            raise ModelForwardError(f"{type(base).__name__}'s own forward failed: {type(exc).__name__}: {exc}") from exc
        error = _compare(mine, logits)
        if error is not None:
            # The instance's forward may be wrapped (accelerate runs a prepared model's forward under autocast,
            # which the decoder called here is not): the class's own forward is the architecture's maths.
            error = _compare(mine, type(base).forward(base, input_ids=ids, use_cache=False).logits.float())
    except ModelForwardError:
        raise
    except Exception as exc:  # a decoder or head that cannot run this probe cannot be checked
        return f"the check on 2 x 4 tokens failed: {type(exc).__name__}: {exc}"
    finally:
        base.train(was_training)
    return error


def _compare(mine: torch.Tensor, logits: torch.Tensor) -> Optional[str]:
    if mine.shape != logits.shape:
        return f"shapes {tuple(mine.shape)} and {tuple(logits.shape)}"
    err = float((mine - logits).abs().max()) / max(float(logits.abs().max()), 1e-30)
    return None if err <= 1e-3 else f"they differ by {err:.1e} relative on 2 x 4 tokens"


def causal_lm_hidden_states(
    model,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    *,
    allow_unknown: bool = False,
    head_checked: bool = False,
    **model_kwargs,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Runs the decoder of a Llama/Qwen2-style causal LM and stops before ``lm_head``.

    Args:
        model: a transformers ``*ForCausalLM`` (or a PEFT wrapper of one).
        input_ids, attention_mask: ``[B, T]``, as for ``model(...)``.

    Returns:
        ``(hidden [B, T, H], lm_head.weight [V, H], lm_head.bias or None)``: position ``t`` of
        ``hidden`` gives the logits that predict token ``t + 1``, as ``model(...).logits[:, t]`` would.
    """
    if not head_checked:  # (a caller that checked it with `head_logit_transform` applies the transform itself)
        check_hidden_states_supported(model, allow_unknown)
    base = unwrap(model)
    outputs = decoder_of(base)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **model_kwargs)
    head = linear_head(base)
    return outputs.last_hidden_state, head.weight, head.bias
