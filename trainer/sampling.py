"""Sampling ``n`` completions per prompt with the prompt run once: its key/value cache is shared by the n.

``model.generate(num_return_sequences=n)`` repeats every prompt n times before the first forward, so a
200-token prompt with 8 samples costs 8 prompt passes; here it costs one, then a plain decoding loop
(temperature sampling, or greedy) over the n continuations. Three more savings, each measured on the
default run (2 CPU cores), none of which changes what is sampled beyond float rounding:

- the tokens every prompt of a batch starts with (the system prompt and the worked examples: 188 of
  about 218 tokens) run once for the whole batch (`gtpo_kernels.hf.prompt_pass`);
- the key/value cache is written in place (`_InPlaceLayer`) instead of concatenated at every token;
- a token is drawn by inverting the cumulative distribution with one uniform number per row
  (`draw_tokens`): ``torch.multinomial`` draws an exponential number per vocabulary entry, 37 ms a
  token for 32 rows over SmolLM2's 49152 entries, against about 3 ms.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from gtpo_kernels.hf import cache_kwarg, prompt_pass


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


# The vocabulary is searched in blocks of this many entries: the block, then the entry within it.
DRAW_BLOCK = 1024


def draw_tokens(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``[R]`` token ids, row ``r`` drawn from ``softmax(logits[r] / temperature)`` (``logits: [R, V]``).

    One uniform number per row (the global torch generator) is looked up in the row's cumulative
    distribution, summed in float64 so that no token's share is off by more than about 1e-12. The lookup
    goes in two levels: the cumulative sum of the `DRAW_BLOCK`-entry blocks' sums finds the block, then the
    cumulative sum within that block finds the token (a float64 cumulative sum over the whole vocabulary
    was two thirds of a draw's time: 9 of 13 ms for 32 rows of SmolLM2's 49152 entries on 2 CPU cores). A
    token of probability 0 is never drawn: it adds nothing to either sum, and each lookup takes the first
    entry whose sum exceeds the draw, kept within the range its block covers."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    rows, vocab = probs.shape
    blocks = -(-vocab // DRAW_BLOCK)
    if blocks * DRAW_BLOCK != vocab:  # padding copies the probabilities: a tenth of a draw, where none is needed
        probs = torch.nn.functional.pad(probs, (0, blocks * DRAW_BLOCK - vocab))
    probs = probs.view(rows, blocks, DRAW_BLOCK)
    block_sums = probs.sum(-1, dtype=torch.float64)  # [R, blocks]
    block_cdf = block_sums.cumsum(-1)
    total = block_cdf[:, -1:]
    u = torch.rand(total.shape, dtype=torch.float64, device=logits.device) * total
    # u < total in exact arithmetic; rounding may give u == total, which no block's sum exceeds.
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    block = torch.searchsorted(block_cdf, u, right=True)  # [R, 1]: the first block whose sum exceeds u
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)  # <= u
    within = probs.gather(1, block[:, :, None].expand(rows, 1, DRAW_BLOCK)).squeeze(1).cumsum(-1, dtype=torch.float64)
    within = within + before
    # The block's sum taken again, entry by entry, may round below u: keep u under it.
    u = torch.minimum(u, torch.nextafter(within[:, -1:], torch.zeros_like(u)))
    entry = torch.searchsorted(within, u, right=True)
    return (block * DRAW_BLOCK + entry).squeeze(1)


@torch.no_grad()
def sample(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    n: int,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    greedy: bool = False,
    greedy_first: bool = False,
    eos_token_id: int,
    pad_token_id: int,
    on_token=None,
    in_place_cache: bool = True,
    share_prefix: bool = True,
) -> torch.Tensor:
    """``[B * n, T]`` completion ids (``T <= max_new_tokens``; after a row's EOS, ``pad_token_id``), the ``n``
    completions of prompt ``b`` in rows ``b * n .. b * n + n - 1``.

    ``prompt_ids, prompt_mask``: ``[B, P]``, left-padded. Sampling draws from ``softmax(logits / temperature)``
    with the global torch generator (seed it for reproducible rollouts); ``greedy`` takes the argmax;
    ``greedy_first`` takes it for the first of each prompt's ``n`` rows only (an evaluation's greedy answer
    and its samples from one prompt pass). ``on_token(t)`` is called after the ``t``-th new token (progress).
    A prefix every prompt starts with runs once (`gtpo_kernels.hf.prompt_pass`) unless ``share_prefix`` is False.
    """
    cache_kw = cache_kwarg(model)
    out, cache, attention, positions = prompt_pass(
        model, prompt_ids, prompt_mask, logits_to_keep=1, share_prefix=share_prefix
    )
    logits = out.logits[:, -1]
    cache.batch_repeat_interleave(n)
    if in_place_cache:
        _reserve(cache, max_new_tokens)
    logits = logits.repeat_interleave(n, 0)
    attention = attention.repeat_interleave(n, 0)
    positions = positions.repeat_interleave(n, 0)
    finished = torch.zeros(attention.shape[0], dtype=torch.bool, device=prompt_ids.device)
    tokens = []
    first_rows = (torch.arange(attention.shape[0], device=prompt_ids.device) % n == 0) if greedy_first else None
    for step in range(max_new_tokens):
        if greedy:
            next_token = logits.argmax(dim=-1)
        else:
            next_token = draw_tokens(logits, temperature)
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
        out = model(
            input_ids=next_token[:, None],
            attention_mask=attention,
            position_ids=positions,
            use_cache=True,
            **{cache_kw: cache},
        )
        positions = positions + 1
        logits = out.logits[:, -1]
    return torch.stack(tokens, dim=1)
