"""Hugging Face helpers: a causal LM's final hidden states without its ``lm_head``.

`fused_linear_gtpo_loss` wants ``hidden_states`` and ``lm_head.weight`` instead of logits, so that a
training step never builds the ``[B, T, V]`` logits. That is only equivalent when the model's logits
are exactly ``final_hidden @ lm_head.weight.T (+ bias)``: true for the Llama/Qwen/Mistral family,
false for models that scale or soft-cap their logits (Gemma 2/3, Cohere, Granite, ...).
"""

from __future__ import annotations

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
