"""Running a group's prompt once: a key/value cache shared by the ``G`` completions of a prompt, and a prefix
shared by every prompt of a batch (a system prompt, a worked example) run once, for the models where two passes
on a cache are exactly one pass (`shared_prompt_pass_issue`)."""

from __future__ import annotations

import inspect
from typing import Optional, Tuple

import torch

from .head import causal_lm_hidden_states, check_hidden_states_supported, decoder_of
from .llama_layers import grouped_completion_pass, grouped_pass_issue
from .model_config import linear_head, shared_prompt_pass_issue, text_config, unwrap


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
    if issue is None and getattr(text_config(unwrap(model)), "sliding_window", None):
        issue = "its sliding-window attention would count the padding after a shared prefix"
    return issue


def prefix_run_once(module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, share_prefix: bool = True) -> int:
    """How many leading tokens `prompt_pass` runs once for the whole batch: the prefix every prompt shares, if it
    has at least `MIN_SHARED_PREFIX` tokens and ``module`` can share it (`shared_prefix_issue`), else 0."""
    if not share_prefix or shared_prefix_issue(module) is not None:
        return 0
    c = shared_prefix_length(prompt_ids, prompt_mask)
    return c if c >= MIN_SHARED_PREFIX else 0


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
    c = prefix_run_once(module, prompt_ids, prompt_mask, share_prefix)
    if not c:
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


def _check_groups(prompt_ids, prompt_mask, completion_ids, completion_mask, group_size: int) -> None:
    """``G`` completion rows per prompt row, masks of their ids' shapes, prompts left-padded."""
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


def grouped_completion_hidden_states(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    group_size: int,
    *,
    allow_unknown: bool = False,
    head_checked: bool = False,
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

        head_checked: the caller checked the head with `head_logit_transform` and hands its scale or soft cap to
            the fused functions itself (Gemma 2/3, Cohere, Granite): the plain-head check is skipped.

    Returns:
        ``(hidden [N, L, H], lm_head.weight [V, H], lm_head.bias or None)``: ``hidden[:, t]`` gives
        the logits that predict ``completion_ids[:, t]`` (through the head's transform, if any).
    """
    if not head_checked:
        check_hidden_states_supported(model, allow_unknown)
    _check_groups(prompt_ids, prompt_mask, completion_ids, completion_mask, group_size)
    base = unwrap(model)
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
            head_checked=head_checked,
            position_ids=(attention.cumsum(1) - 1).clamp(min=0),
        )
        return hidden[:, prompt_ids.shape[1] - 1 : -1], weight, bias
    prompt, cache, prompt_attention, lengths = prompt_pass(decoder, prompt_ids, prompt_mask)
    positions = lengths.repeat_interleave(group_size, 0) + torch.arange(
        completion_ids.shape[1], device=completion_ids.device
    )
    # Llama-family models on the CPU: each prompt's keys and values read once by its group, only the completions'
    # tokens through the layers (`llama_layers`); others through transformers' forward on the repeated cache.
    take = grouped_completion_pass if grouped_pass_issue(model) is None else model_pass
    completion = take(model, cache, prompt_attention, completion_ids, completion_mask, positions, group_size)
    last_prompt = prompt.last_hidden_state[:, -1:].repeat_interleave(group_size, 0)
    hidden = torch.cat([last_prompt, completion[:, :-1]], dim=1)
    head = linear_head(base)
    return hidden, head.weight, head.bias


def model_pass(model, cache, prompt_attention, completion_ids, completion_mask, positions, group_size: int):
    """`llama_layers.grouped_completion_pass`'s result through transformers' forward instead: the prompt cache
    repeated for each completion (new tensors: gradients still reach the prompt pass), the completions on top."""
    decoder = decoder_of(unwrap(model))
    cache.batch_repeat_interleave(group_size)
    prompt_attention = prompt_attention.repeat_interleave(group_size, 0)
    return decoder(
        input_ids=completion_ids,
        position_ids=positions,
        use_cache=True,
        attention_mask=torch.cat([prompt_attention, completion_mask.long()], 1),
        **{cache_kwarg(decoder): cache},
    ).last_hidden_state
