"""Sampling ``n`` completions per prompt with the prompt run once: its key/value cache is shared by the n.

``model.generate(num_return_sequences=n)`` repeats every prompt n times before the first forward, so a
200-token prompt with 8 samples costs 8 prompt passes; here it costs one, then a plain decoding loop
(temperature sampling, or greedy) over the n continuations. Measured on the default run (2 CPU cores):
the rollouts and the pass@k evaluation are dominated by those prompt passes.
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import DynamicLayer


class _InPlaceLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values live in a buffer with room for the tokens still to come, so
    that each decoding step writes one position in place. The plain layer concatenates its whole cache at
    every token (``torch.cat``: a quarter of the sampling time of the default run on a 2-core CPU)."""

    def reserve(self, extra: int) -> None:
        batch, heads, length, dim = self.keys.shape
        self._key_buffer = self.keys.new_empty(batch, heads, length + extra, dim)
        self._value_buffer = self.values.new_empty(batch, heads, length + extra, self.values.shape[-1])
        self._key_buffer[:, :, :length] = self.keys
        self._value_buffer[:, :, :length] = self.values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        start = self.keys.shape[-2]  # the keys are always the buffer's filled part
        end = start + key_states.shape[-2]
        if end > self._key_buffer.shape[-2]:  # more tokens than reserved: grow as the plain layer does
            self.__class__ = DynamicLayer
            return self.update(key_states, value_states, *args, **kwargs)
        self._key_buffer[:, :, start:end] = key_states
        self._value_buffer[:, :, start:end] = value_states
        self.keys, self.values = self._key_buffer[:, :, :end], self._value_buffer[:, :, :end]
        return self.keys, self.values


def _reserve(cache, extra: int) -> None:
    """Room for ``extra`` more positions in each plain layer of ``cache`` (other kinds are left as they are)."""
    for layer in getattr(cache, "layers", ()):
        if type(layer) is DynamicLayer and layer.is_initialized and layer.keys.numel():
            layer.__class__ = _InPlaceLayer
            layer.reserve(extra)


def _cache_kwarg(model) -> str:
    """transformers >= 5.2x names the argument ``cache``; earlier versions ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def sample(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, n: int, max_new_tokens: int, *,
           temperature: float = 1.0, greedy: bool = False, greedy_first: bool = False, eos_token_id: int,
           pad_token_id: int, on_token=None, in_place_cache: bool = True) -> torch.Tensor:
    """``[B * n, T]`` completion ids (``T <= max_new_tokens``; after a row's EOS, ``pad_token_id``), the ``n``
    completions of prompt ``b`` in rows ``b * n .. b * n + n - 1``.

    ``prompt_ids, prompt_mask``: ``[B, P]``, left-padded. Sampling draws from ``softmax(logits / temperature)``
    with the global torch generator (seed it for reproducible rollouts); ``greedy`` takes the argmax;
    ``greedy_first`` takes it for the first of each prompt's ``n`` rows only (an evaluation's greedy answer
    and its samples from one prompt pass). ``on_token(t)`` is called after the ``t``-th new token (progress).
    """
    cache_kw = _cache_kwarg(model)
    prompt_mask = prompt_mask.long()
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=(prompt_mask.cumsum(1) - 1).clamp(min=0),
                use_cache=True, logits_to_keep=1)
    cache = out.cache if cache_kw == "cache" else out.past_key_values
    cache.batch_repeat_interleave(n)
    if in_place_cache:
        _reserve(cache, max_new_tokens)
    logits = out.logits[:, -1].repeat_interleave(n, 0)
    attention = prompt_mask.repeat_interleave(n, 0)
    positions = attention.sum(1, keepdim=True)
    finished = torch.zeros(attention.shape[0], dtype=torch.bool, device=prompt_ids.device)
    tokens = []
    first_rows = (torch.arange(attention.shape[0], device=prompt_ids.device) % n == 0) if greedy_first else None
    for step in range(max_new_tokens):
        if greedy:
            next_token = logits.argmax(dim=-1)
        else:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            next_token = torch.multinomial(probs, 1).squeeze(1)
            if first_rows is not None:
                next_token = torch.where(first_rows, logits.argmax(dim=-1), next_token)
        next_token = torch.where(finished, torch.full_like(next_token, pad_token_id), next_token)
        tokens.append(next_token)
        if on_token is not None:
            on_token(step + 1)
        finished |= next_token == eos_token_id
        if bool(finished.all()) or step == max_new_tokens - 1:
            break
        attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
        out = model(input_ids=next_token[:, None], attention_mask=attention, position_ids=positions, use_cache=True,
                    **{cache_kw: cache})
        positions = positions + 1
        logits = out.logits[:, -1]
    return torch.stack(tokens, dim=1)
