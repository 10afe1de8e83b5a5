"""Hugging Face helpers: a causal LM's final hidden states without its ``lm_head``.

`fused_linear_gtpo_loss` wants ``hidden_states`` and ``lm_head.weight`` instead of logits, so that a
training step never builds the ``[B, T, V]`` logits. That is only equivalent when the model's logits
are exactly ``final_hidden @ lm_head.weight.T (+ bias)``: checked per model (`check_hidden_states_supported`),
not by name; models that scale or soft-cap their logits (Gemma 2, Cohere, Granite, Falcon-H1) are named by
`logit_transform`, for the chunked logits path (`gtpo_kernels.chunked_logits`).
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional, Tuple

import torch

# Config attributes that, when set to something other than 1, transform the logits after lm_head:
# attribute -> (what it does, the transform). Gemma 2/3 soft-cap, Cohere scales, Granite divides, Falcon-H1
# multiplies.
LOGIT_TRANSFORMS = {
    "final_logit_softcapping": ("soft-caps", lambda x, c: torch.tanh(x / c) * c),
    "logit_scale": ("scales", lambda x, c: x * c),
    "logits_scaling": ("divides", lambda x, c: x / c),
    "output_multiplier_scale": ("scales", lambda x, c: x * c),
    "lm_head_multiplier": ("scales", lambda x, c: x * c),
}
_CHECKED = "_gtpo_head_checked"  # set on a model whose logits the probe found to be hidden @ W.T (+ b)


def _unwrap(model):
    """The transformers model inside a PEFT wrapper (LoRA layers stay in place)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _text_config(base):
    config = getattr(base, "config", None)
    get_text = getattr(config, "get_text_config", None)
    return (get_text() if callable(get_text) else None) or config


def decoder_of(model):
    """The module that returns the final hidden states (``last_hidden_state``): ``get_decoder()``, or, where a
    model's ``get_decoder()`` returns the whole causal LM (Llama 4), its inner ``model``."""
    base = _unwrap(model)
    decoder = base.get_decoder()
    if decoder is base:
        decoder = getattr(base, "model", None) or getattr(base, "language_model", None)
        if decoder is None or decoder is base:
            raise ValueError(
                f"{type(base).__name__}.get_decoder() returns the whole model and it has no inner "
                f"'model' to take the hidden states from"
            )
    return decoder


def logit_transform(model) -> Optional[Tuple[str, Callable]]:
    """``(description, f)`` when ``model``'s logits are ``f(hidden @ W.T (+ b))`` for one of the known transforms
    (`LOGIT_TRANSFORMS`), else ``None``."""
    config = _text_config(_unwrap(model))
    found = [(attr, getattr(config, attr, None)) for attr in LOGIT_TRANSFORMS]
    found = [(attr, value) for attr, value in found if value not in (None, 1, 1.0)]
    if not found:
        return None
    if len(found) > 1:
        raise ValueError(f"{type(_unwrap(model)).__name__} sets several logit transforms {found}; not supported")
    attr, value = found[0]
    what, fn = LOGIT_TRANSFORMS[attr]
    return f"{what} its logits (config.{attr} = {value})", lambda x: fn(x, value)


def head_logit_transform(model) -> Optional[Tuple[str, Callable]]:
    """For a trainer that can take either path: ``None`` when ``model``'s logits are ``hidden @ W.T (+ b)`` (the
    fused path), ``(description, f)`` when they are ``f`` of that for a known transform (checked on a few
    tokens like `check_hidden_states_supported`); raises ``ValueError`` for anything else."""
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
            f"{type(_unwrap(model)).__name__} {transform[0]} after lm_head; hidden @ lm_head.weight.T "
            f"would not be its logits: use gtpo_loss on model(...).logits"
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
    base = _unwrap(model)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear) or not hasattr(base, "get_decoder"):
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


# RoPE variants whose frequencies depend on the longest position of the forward call: a prompt pass and a
# completion pass on its cache may pick different frequencies where one row in a single pass would not.
LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})
# Layer kinds whose cache holds a state, not per-position keys and values (hybrid models): not shared here.
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention"})


def shared_prompt_pass_issue(model) -> Optional[str]:
    """Why `grouped_completion_hidden_states` cannot share one prompt pass across a group for ``model`` (it then
    runs each row whole, which is exact), or ``None``."""
    config = _text_config(_unwrap(model))
    for attr in ("rope_parameters", "rope_scaling"):
        rope = getattr(config, attr, None)
        if isinstance(rope, dict):
            kind = rope.get("rope_type", rope.get("type"))
            if kind in LENGTH_DEPENDENT_ROPE:
                return (
                    f"its RoPE ({kind!r}) picks frequencies from the longest position of a forward call, which "
                    f"differs between a prompt pass and a completion pass on its cache"
                )
    layer_types = []
    for attr in ("layer_types", "layers_block_type"):  # Jamba and Falcon-H1 name them layers_block_type
        try:
            layer_types += list(getattr(config, attr, None) or ())
        except (TypeError, AttributeError, ValueError):
            pass
    other = sorted({t for t in layer_types if isinstance(t, str) and t not in ATTENTION_LAYER_TYPES})
    if other:
        return (
            f"it has layers whose cache is a recurrent state ({', '.join(other)}), which one prompt pass cannot share"
        )
    return None


def cache_kwarg(module) -> str:
    """The name of ``module.forward``'s key/value cache argument (and output): ``cache`` in transformers >= 5.2x,
    ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


# A prefix shared by every prompt of a batch (a system prompt, a worked example) runs once when it has at least
# this many tokens; below it, the second forward call costs more than the tokens it saves.
MIN_SHARED_PREFIX = 16


def shared_prefix_length(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> int:
    """How many tokens every prompt of a left-padded batch starts with, leaving each prompt at least one
    token of its own (its last position predicts the completion). ``prompt_ids, prompt_mask: [B, P]``."""
    lengths = prompt_mask.long().sum(1)
    shortest = int(lengths.min())
    if prompt_ids.shape[0] < 2 or shortest < 2:
        return 0
    starts = prompt_ids.shape[1] - lengths  # left padding: row b's tokens are prompt_ids[b, starts[b]:]
    aligned = prompt_ids.gather(1, starts[:, None] + torch.arange(shortest - 1, device=prompt_ids.device))
    differs = (aligned != aligned[:1]).any(0)
    return int(differs.int().argmax()) if bool(differs.any()) else shortest - 1


def shared_prefix_issue(model) -> Optional[str]:
    """Why a batch's shared prompt prefix cannot run once for ``model`` (then each prompt runs whole), or
    ``None``: the reasons of `shared_prompt_pass_issue`, and sliding-window attention, where the padding
    between the prefix and a shorter prompt's own tokens would count against the window."""
    issue = shared_prompt_pass_issue(model)
    if issue is None and getattr(_text_config(_unwrap(model)), "sliding_window", None):
        issue = "its sliding-window attention would count the padding after a shared prefix"
    return issue


def prompt_pass(module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, share_prefix: bool = True, **kwargs):
    """Runs left-padded prompts ``[B, P]`` through ``module`` (a causal LM or its decoder) with a cache.

    A prefix of at least `MIN_SHARED_PREFIX` tokens that every prompt starts with (`shared_prefix_length`)
    runs once, unless ``share_prefix`` is False or the model cannot share it (`shared_prefix_issue`: then the
    prompts run whole, as they would without the option); each prompt's own tokens then run
    on copies of its cache, laid out ``[prefix | padding | own tokens]`` with the padding masked and the
    positions of the whole prompt run alone. Gradients reach the prefix pass through the copies.

    Returns ``(output, cache, attention [B, S], lengths [B, 1])``: the last call's output, whose last position
    is each prompt's last token; the cache (``S`` positions); the attention mask the cache was built with, to
    extend for the tokens that follow; each prompt's length, the position of its first new token.
    """
    cache_kw = cache_kwarg(module)
    prompt_mask = prompt_mask.long()
    lengths = prompt_mask.sum(1, keepdim=True)
    c = shared_prefix_length(prompt_ids, prompt_mask) if share_prefix and shared_prefix_issue(module) is None else 0
    if c < MIN_SHARED_PREFIX:
        out = module(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            use_cache=True,
            position_ids=(prompt_mask.cumsum(1) - 1).clamp(min=0),
            **kwargs,
        )
        return out, getattr(out, cache_kw), prompt_mask, lengths
    batch, width = prompt_ids.shape
    start = width - int(lengths[0])  # row 0's first token; every row starts with the same c tokens
    prefix = prompt_ids[:1, start : start + c]
    out = module(
        input_ids=prefix,
        attention_mask=torch.ones_like(prefix),
        use_cache=True,
        position_ids=torch.arange(c, device=prefix.device)[None],
        **kwargs,
    )
    cache = getattr(out, cache_kw)
    cache.batch_repeat_interleave(batch)
    own = int(lengths.max()) - c  # the longest prompt's own tokens; shorter prompts' are left-padded to it
    own_mask = (torch.arange(own, device=prompt_ids.device) >= own - (lengths - c)).long()  # [B, own]
    attention = torch.cat([torch.ones_like(prompt_mask[:, :c]), own_mask], dim=1)
    out = module(
        input_ids=prompt_ids[:, width - own :],
        attention_mask=attention,
        use_cache=True,
        position_ids=(c + own_mask.cumsum(1) - 1).clamp(min=c),
        **{cache_kw: cache},
        **kwargs,
    )
    return out, cache, attention, lengths


def causal_lm_hidden_states(
    model,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    *,
    allow_unknown: bool = False,
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
    check_hidden_states_supported(model, allow_unknown)
    base = _unwrap(model)
    outputs = decoder_of(base)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **model_kwargs)
    head = base.get_output_embeddings()
    return outputs.last_hidden_state, head.weight, head.bias


def grouped_completion_hidden_states(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    group_size: int,
    *,
    allow_unknown: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The hidden states that predict each completion token, running each prompt once per group.

    The ``G`` completions of a prompt share it, so the decoder runs the ``B`` prompts once, repeats
    their key/value cache ``G`` times and runs the ``N = B * G`` completions on top of it. Gradients
    flow through the cache into the prompt pass, so the result (and its gradient) equals
    ``causal_lm_hidden_states`` on the concatenated ``[prompt, completion]`` rows, for
    ``B * P + N * L`` tokens of work instead of ``N * (P + L)``. Under gradient checkpointing, which cannot
    replay a layer that writes a shared cache, and for models where two passes are not one
    (`shared_prompt_pass_issue`: RoPE whose frequencies depend on the call's length, recurrent-state layers),
    each completion runs with its own copy of the prompt.

    Args:
        prompt_ids, prompt_mask: ``[B, P]``, left-padded, one row per group.
        completion_ids, completion_mask: ``[N, L]``, the ``G`` completions of group ``b`` in rows
            ``b * G .. b * G + G - 1``.

    Returns:
        ``(hidden [N, L, H], lm_head.weight [V, H], lm_head.bias or None)``: ``hidden[:, t]`` gives
        the logits that predict ``completion_ids[:, t]``.
    """
    check_hidden_states_supported(model, allow_unknown)
    n_prompts, n_rows = prompt_ids.shape[0], completion_ids.shape[0]
    if n_rows != n_prompts * group_size:
        raise ValueError(
            f"completion_ids has {n_rows} rows; expected prompt_ids' {n_prompts} rows x "
            f"group_size {group_size} = {n_prompts * group_size}"
        )
    if prompt_mask.shape != prompt_ids.shape or completion_mask.shape != completion_ids.shape:
        raise ValueError("prompt_mask / completion_mask must have the shapes of prompt_ids / completion_ids")
    if not bool(prompt_mask[:, -1].all()):
        raise ValueError(
            "prompts must be left-padded (prompt_mask[:, -1] all ones): the last prompt position "
            "predicts the first completion token"
        )
    base = _unwrap(model)
    decoder = decoder_of(base)
    prompt_mask = prompt_mask.long()
    checkpointing = getattr(decoder, "gradient_checkpointing", False) and decoder.training and torch.is_grad_enabled()
    if checkpointing or shared_prompt_pass_issue(model) is not None:
        # Under gradient checkpointing a layer runs again in backward, and would write its keys and values
        # into the shared cache a second time (transformers turns the cache off there); length-dependent RoPE
        # and recurrent-state caches are not exact across two passes (`shared_prompt_pass_issue`). Run each
        # completion with its prompt instead: the same hidden states, for N * (P + L) tokens of work.
        rows = prompt_mask.repeat_interleave(group_size, 0)
        attention = torch.cat([rows, completion_mask.long()], dim=1)
        hidden, weight, bias = causal_lm_hidden_states(
            model,
            torch.cat([prompt_ids.repeat_interleave(group_size, 0), completion_ids], dim=1),
            attention,
            allow_unknown=allow_unknown,
            position_ids=(attention.cumsum(1) - 1).clamp(min=0),
        )
        return hidden[:, prompt_ids.shape[1] - 1 : -1], weight, bias
    prompt, cache, prompt_attention, lengths = prompt_pass(decoder, prompt_ids, prompt_mask)
    cache.batch_repeat_interleave(group_size)  # new tensors: gradients still reach the prompt pass
    prompt_attention = prompt_attention.repeat_interleave(group_size, 0)
    positions = lengths.repeat_interleave(group_size, 0) + torch.arange(
        completion_ids.shape[1], device=completion_ids.device
    )
    completion = decoder(
        input_ids=completion_ids,
        position_ids=positions,
        use_cache=True,
        attention_mask=torch.cat([prompt_attention, completion_mask.long()], 1),
        **{cache_kwarg(decoder): cache},
    )
    last_prompt = prompt.last_hidden_state[:, -1:].repeat_interleave(group_size, 0)
    hidden = torch.cat([last_prompt, completion.last_hidden_state[:, :-1]], dim=1)
    head = base.get_output_embeddings()
    return hidden, head.weight, head.bias
