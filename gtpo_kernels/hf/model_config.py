"""What every part of `gtpo_kernels.hf` reads off a model: the transformers model inside a PEFT wrapper, its text
config (a multimodal model's language half), and whether two passes on a cache are one (`shared_prompt_pass_issue`)."""

from __future__ import annotations

from typing import Optional


def unwrap(model):
    """The transformers model inside a PEFT wrapper (LoRA layers stay in place)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def linear_head(base):
    """The ``nn.Linear`` that computes ``base``'s logits, or ``None``. A head PEFT keeps trainable
    (``modules_to_save=["lm_head"]``: a ``ModulesToSaveWrapper``) is its active adapter's copy, the one its forward
    runs (the original while adapters are disabled, as for TRL's reference pass); a LoRA adapter on the head itself
    is refused: its logits are not one matrix's product."""
    import torch

    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if hasattr(head, "lora_A"):
        raise ValueError(
            "GTPO's fused loss needs the lm_head as one weight matrix, but it carries a LoRA adapter (lm_head is "
            "in LoraConfig.target_modules); leave it out of target_modules, or train it whole with "
            "LoraConfig(modules_to_save=['lm_head'])"
        )
    saved = getattr(head, "modules_to_save", None)
    if saved is not None and hasattr(head, "original_module"):  # PEFT's ModulesToSaveWrapper
        active = [name for name in (getattr(head, "active_adapters", None) or []) if name in saved]
        disabled = getattr(head, "disable_adapters", False) is True
        head = saved[active[0]] if active and not disabled else head.original_module
    return head if isinstance(head, torch.nn.Linear) else None


def text_config(base):
    config = getattr(base, "config", None)
    get_text = getattr(config, "get_text_config", None)
    return (get_text() if callable(get_text) else None) or config


# RoPE variants whose frequencies depend on the longest position of the forward call: a prompt pass and a
# completion pass on its cache may pick different frequencies where one row in a single pass would not.
LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})
# Layer kinds whose cache holds a state, not per-position keys and values (hybrid models): not shared here.
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention"})


def shared_prompt_pass_issue(model) -> Optional[str]:
    """Why `grouped_completion_hidden_states` cannot share one prompt pass across a group for ``model`` (it then
    runs each row whole, which is exact), or ``None``."""
    config = text_config(unwrap(model))
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
