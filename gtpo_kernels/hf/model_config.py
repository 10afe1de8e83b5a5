"""What both halves of `gtpo_kernels.hf` read off a model: the transformers model inside a PEFT wrapper, and
its text config (a multimodal model's language half)."""

from __future__ import annotations


def unwrap(model):
    """The transformers model inside a PEFT wrapper (LoRA layers stay in place)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def text_config(base):
    config = getattr(base, "config", None)
    get_text = getattr(config, "get_text_config", None)
    return (get_text() if callable(get_text) else None) or config
