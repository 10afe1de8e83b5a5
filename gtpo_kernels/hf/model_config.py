"""What both halves of `gtpo_kernels.hf` read off a model: the transformers model inside a PEFT wrapper, and
its text config (a multimodal model's language half)."""

from __future__ import annotations


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
