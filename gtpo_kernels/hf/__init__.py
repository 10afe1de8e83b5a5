"""Hugging Face helpers: a causal LM's final hidden states without its ``lm_head``.

Two parts with one job each: `head` checks that a model's logits are ``final_hidden @ lm_head.weight.T (+ b)``
(or names the transform it applies) and returns the hidden states of ``[B, T]`` rows; `prompt_cache` runs a
group's prompt once for its ``G`` completions (and a batch's shared prompt prefix once), for the trainer's
step and sampler; `llama_layers` runs a Llama-family model's completions on that prompt cache with attention written
out for the group (each prompt's keys and values read once by its completions, only the tokens under the mask run).
"""

from . import llama_layers
from .head import (
    LOGIT_TRANSFORMS,
    ModelForwardError,
    causal_lm_hidden_states,
    check_hidden_states_supported,
    decoder_of,
    head_logit_transform,
    logit_transform,
)
from .prompt_cache import (
    MIN_SHARED_PREFIX,
    cache_kwarg,
    grouped_completion_hidden_states,
    prefix_run_once,
    prompt_pass,
    shared_prefix_issue,
    shared_prefix_length,
    shared_prompt_pass_issue,
)

__all__ = [
    "LOGIT_TRANSFORMS",
    "MIN_SHARED_PREFIX",
    "ModelForwardError",
    "cache_kwarg",
    "causal_lm_hidden_states",
    "check_hidden_states_supported",
    "decoder_of",
    "grouped_completion_hidden_states",
    "head_logit_transform",
    "llama_layers",
    "logit_transform",
    "prefix_run_once",
    "prompt_pass",
    "shared_prefix_issue",
    "shared_prefix_length",
    "shared_prompt_pass_issue",
]
