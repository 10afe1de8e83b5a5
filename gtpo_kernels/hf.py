"""Hugging Face helpers: a causal LM's final hidden states without its ``lm_head``.

`fused_linear_gtpo_loss` wants ``hidden_states`` and ``lm_head.weight`` instead of logits, so that a
training step never builds the ``[B, T, V]`` logits. That is only equivalent when the model's logits
are exactly ``final_hidden @ lm_head.weight.T (+ bias)``: true for the Llama/Qwen/Mistral family,
false for models that scale or soft-cap their logits (Gemma 2/3, Cohere, Granite, ...).
"""

from __future__ import annotations

import inspect
from typing import Optional, Tuple

import torch

# config.model_type values whose logits are exactly lm_head(final normed hidden state).
SUPPORTED_MODEL_TYPES = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3", "olmo2", "smollm3",
})
# Config attributes that, when set, mean the logits are transformed after lm_head.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def _unwrap(model):
    """The transformers model inside a PEFT wrapper (LoRA layers stay in place)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def check_hidden_states_supported(model, allow_unknown: bool = False) -> None:
    """Raises ``ValueError`` unless ``model``'s logits are ``hidden @ lm_head.weight.T (+ bias)``."""
    base = _unwrap(model)
    config = getattr(base, "config", None)
    model_type = getattr(config, "model_type", None)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear) or not hasattr(base, "get_decoder"):
        raise ValueError(f"{type(base).__name__} has no linear lm_head and decoder (get_output_embeddings(), "
                         f"get_decoder()); use gtpo_loss on model(...).logits instead")
    for attr in _LOGIT_TRANSFORMS:
        value = getattr(config, attr, None)
        if value not in (None, 1, 1.0):
            raise ValueError(f"{type(base).__name__} transforms its logits after lm_head (config.{attr} = {value}); "
                             f"hidden @ lm_head.weight.T would not be its logits: use gtpo_loss on model(...).logits")
    if model_type not in SUPPORTED_MODEL_TYPES and not allow_unknown:
        raise ValueError(f"model type {model_type!r} is not known to compute logits as final_hidden @ "
                         f"lm_head.weight.T; supported: {sorted(SUPPORTED_MODEL_TYPES)}. Use gtpo_loss on "
                         f"model(...).logits, or pass allow_unknown=True if you checked that it does")


# RoPE variants whose frequencies depend on the longest position of the forward call: a prompt pass and a
# completion pass on its cache may pick different frequencies where one row in a single pass would not.
LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})
# Layer kinds whose cache holds a state, not per-position keys and values (hybrid models): not shared here.
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention"})


def shared_prompt_pass_issue(model) -> Optional[str]:
    """Why `grouped_completion_hidden_states` cannot share one prompt pass across a group for ``model`` (it then
    runs each row whole, which is exact), or ``None``."""
    config = getattr(_unwrap(model), "config", None)
    config = getattr(config, "get_text_config", lambda: config)() or config
    for attr in ("rope_parameters", "rope_scaling"):
        rope = getattr(config, attr, None)
        if isinstance(rope, dict):
            kind = rope.get("rope_type", rope.get("type"))
            if kind in LENGTH_DEPENDENT_ROPE:
                return (f"its RoPE ({kind!r}) picks frequencies from the longest position of a forward call, which "
                        f"differs between a prompt pass and a completion pass on its cache")
    layer_types = getattr(config, "layer_types", None) or ()
    other = sorted({t for t in layer_types if t not in ATTENTION_LAYER_TYPES})
    if other:
        return f"it has layers whose cache is a recurrent state ({', '.join(other)}), which one prompt pass cannot share"
    return None


def causal_lm_hidden_states(
    model, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, *,
    allow_unknown: bool = False, **model_kwargs,
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
    outputs = base.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                                 **model_kwargs)
    head = base.get_output_embeddings()
    return outputs.last_hidden_state, head.weight, head.bias


def grouped_completion_hidden_states(
    model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
    completion_mask: torch.Tensor, group_size: int, *, allow_unknown: bool = False,
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
        raise ValueError(f"completion_ids has {n_rows} rows; expected prompt_ids' {n_prompts} rows x "
                         f"group_size {group_size} = {n_prompts * group_size}")
    if prompt_mask.shape != prompt_ids.shape or completion_mask.shape != completion_ids.shape:
        raise ValueError("prompt_mask / completion_mask must have the shapes of prompt_ids / completion_ids")
    if not bool(prompt_mask[:, -1].all()):
        raise ValueError("prompts must be left-padded (prompt_mask[:, -1] all ones): the last prompt position "
                         "predicts the first completion token")
    base = _unwrap(model)
    decoder = base.get_decoder()
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
            model, torch.cat([prompt_ids.repeat_interleave(group_size, 0), completion_ids], dim=1), attention,
            allow_unknown=allow_unknown, position_ids=(attention.cumsum(1) - 1).clamp(min=0))
        return hidden[:, prompt_ids.shape[1] - 1:-1], weight, bias
    prompt = decoder(input_ids=prompt_ids, attention_mask=prompt_mask,
                     position_ids=(prompt_mask.cumsum(1) - 1).clamp(min=0), use_cache=True)
    # transformers >= 5.2x names the cache ``cache``; earlier versions ``past_key_values``.
    cache_kw = "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"
    cache = prompt.cache if cache_kw == "cache" else prompt.past_key_values
    cache.batch_repeat_interleave(group_size)  # new tensors: gradients still reach the prompt pass
    prompt_mask = prompt_mask.repeat_interleave(group_size, 0)
    first = prompt_mask.sum(1, keepdim=True)  # position of the first completion token
    positions = first + torch.arange(completion_ids.shape[1], device=completion_ids.device)
    completion = decoder(input_ids=completion_ids, attention_mask=torch.cat([prompt_mask, completion_mask.long()], 1),
                         position_ids=positions, use_cache=True, **{cache_kw: cache})
    last_prompt = prompt.last_hidden_state[:, -1:].repeat_interleave(group_size, 0)
    hidden = torch.cat([last_prompt, completion.last_hidden_state[:, :-1]], dim=1)
    head = base.get_output_embeddings()
    return hidden, head.weight, head.bias
