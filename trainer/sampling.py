"""Sampling ``n`` completions per prompt with the prompt run once: its key/value cache is shared by the n.

``model.generate(num_return_sequences=n)`` repeats every prompt n times before the first forward, so a
200-token prompt with 8 samples costs 8 prompt passes; here it costs one, then a plain decoding loop
(temperature sampling with optional top-k / top-p / min-p cuts, or greedy) over the n continuations, which ends a
row at any of the model's EOS ids or, if asked, at a stop string. Three more savings, none of which changes what is
sampled beyond float rounding (their measurements: ``python -m bench sampler``, bench/results/):

- the tokens every prompt of a batch starts with (a system prompt, worked examples) run once for the whole
  batch (`gtpo_kernels.hf.prompt_pass`), and while decoding their keys and values are read once for every row;
- the decoding step is our own, on our own preallocated key/value cache (`decode.Decoder`, `decode.KVCache`):
  no transformers module, mask or cache call per token and layer;
- a token is drawn by inverting the cumulative distribution with one uniform number per row
  (`draw_tokens`): ``torch.multinomial`` draws an exponential number per vocabulary entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from gtpo_kernels.hf import cache_kwarg, prefix_run_once, prompt_pass
from gtpo_kernels.hf.model_config import unwrap

from .decode import Decoder, KVCache, decoder_issue


def cut_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """``logits [R, V]`` (already divided by the temperature) with the tokens a truncated sampler leaves out set to
    ``-inf``, in transformers' order: the ``top_k`` most likely tokens (0: all), then the smallest set whose
    probability reaches ``top_p`` (1: all), then those whose probability is at least ``min_p`` times the most likely
    one's (0: all). The most likely token is always kept."""
    logits = logits.float()
    if top_k and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # the probability of the tokens more likely than each
        drop = before >= top_p  # the first token past the mass is kept, the rest dropped
        drop[:, 0] = False
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, float("-inf"))
    return logits


# The vocabulary is searched in blocks of this many entries: the block, then the entry within it.
DRAW_BLOCK = 1024


def draw_tokens(logits: torch.Tensor, temperature: float = 1.0, uniform: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[R]`` token ids, row ``r`` drawn from ``softmax(logits[r] / temperature)`` (``logits: [R, V]``).

    One uniform number per row (``uniform [R, 1]`` float64 in [0, 1); if not given, drawn from the global torch
    generator) is looked up in the row's cumulative
    distribution, summed in float64 so that no token's share is off by more than about 1e-12. The lookup
    goes in two levels: the cumulative sum of the `DRAW_BLOCK`-entry blocks' sums finds the block, then the
    cumulative sum within that block finds the token (a float64 cumulative sum over the whole vocabulary
    was most of a draw's time on a CPU). A
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
    if uniform is None:
        uniform = torch.rand(total.shape, dtype=torch.float64, device=logits.device)
    u = uniform * total
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


def draw_cut(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
    uniform: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """`draw_tokens` from the tempered logits ``[R, V]`` after the cuts of `cut_logits` (none: the plain draw)."""
    if top_k > 0 or top_p < 1.0 or min_p > 0.0:
        return draw_tokens(cut_logits(logits.float() / temperature, top_k, top_p, min_p), uniform=uniform)
    return draw_tokens(logits, temperature, uniform)


@dataclass
class Decoding:
    """What decodes after a prompt pass: ``first [B * n, V]``, each row's first logits; ``next(tokens [A], step) ->
    [A, V]``, the logits after the ``A`` rows still decoding took ``tokens`` as their token ``step``; ``keep(rows
    [A'], step)``, before that call, where rows can leave the batch (``None``: every row decodes to the end): only
    the rows ``rows`` (ascending indices of the ``A``) decode from then on."""

    first: torch.Tensor
    next: Callable[[torch.Tensor, int], torch.Tensor]
    keep: Optional[Callable[[torch.Tensor, int], None]] = None


def start_decoding(
    model, prompt_ids, prompt_mask, n: int, max_new_tokens: int, own_cache: bool, compile: bool, share_prefix: bool
) -> Decoding:
    """The prompt pass of `sample` and what decodes after it, through our step on our cache (`decode.Decoder`,
    where finished rows leave the batch unless the step is compiled) where it takes the model, else through the
    model's forward on transformers' cache (every row to the end)."""
    model = unwrap(model)  # a PeftModel's forward does not take the cache argument by its current name
    out, cache, attention, positions = prompt_pass(
        model, prompt_ids, prompt_mask, logits_to_keep=1, share_prefix=share_prefix
    )
    logits = out.logits[:, -1].repeat_interleave(n, 0)
    positions = positions.repeat_interleave(n, 0)
    if own_cache and decoder_issue(model) is None:
        decoder = Decoder.of(model, compile)
        prefix = prefix_run_once(model, prompt_ids, prompt_mask, share_prefix)  # held once in our cache
        kv = KVCache.from_prompts(cache, attention, n, max_new_tokens, prefix)
        start = attention.shape[1] - prefix  # where each row's own buffer takes the next token

        rows = [positions]  # [A, 1]: the positions of the rows still decoding

        def decode(tokens: torch.Tensor, step: int) -> torch.Tensor:
            index = torch.tensor([start + step], device=tokens.device)
            return decoder(kv, tokens, rows[0] + step, index, used=start + step + 1)

        def keep(kept: torch.Tensor, step: int) -> None:
            kv.keep(kept, used=start + step)  # the prompts' positions and tokens 0 .. step - 1 are written
            rows[0] = rows[0][kept]

        return Decoding(logits, decode, None if decoder.static_shapes else keep)
    cache.batch_repeat_interleave(n)
    cache_kw = cache_kwarg(model)
    attention = attention.repeat_interleave(n, 0)
    grown = [attention]

    def decode_through_the_model(tokens: torch.Tensor, step: int) -> torch.Tensor:
        grown[0] = torch.cat([grown[0], torch.ones_like(grown[0][:, :1])], dim=1)
        out = model(
            input_ids=tokens[:, None],
            attention_mask=grown[0],
            position_ids=positions + step,
            use_cache=True,
            **{cache_kw: cache},
        )
        return out.logits[:, -1]

    return Decoding(logits, decode_through_the_model)


@torch.no_grad()
def sample(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    n: int,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    greedy: bool = False,
    greedy_first: bool = False,
    eos_token_id,
    pad_token_id: int,
    stops: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
    on_token=None,
    own_cache: bool = True,
    compile: bool = False,
    share_prefix: bool = True,
    with_lengths: bool = False,
    compact: bool = True,
):
    """``[B * n, T]`` completion ids (``T <= max_new_tokens``; after a row's end, ``pad_token_id``), the ``n``
    completions of prompt ``b`` in rows ``b * n .. b * n + n - 1``; with ``with_lengths``, also ``[B * n]`` lengths:
    each row's tokens up to and including the one that ended it (``T`` for a row that did not end).

    ``prompt_ids, prompt_mask``: ``[B, P]``, left-padded. Draws from ``softmax(logits / temperature)`` cut by
    `cut_logits` with the global torch generator (seed it); ``greedy`` takes the argmax, ``greedy_first`` for each
    prompt's first row only (an evaluation's greedy answer and samples from one prompt pass). A row ends at any of
    ``eos_token_id`` (one or several) or where ``stops(tokens [R, t], open [R])`` says (`StopStrings`). ``on_token(t)``
    follows progress; ``share_prefix=False`` runs every prompt whole, ``own_cache=False`` decodes through the model's
    forward with transformers' cache (as do models `decode.decoder_issue` names); ``compile`` compiles our step.
    On our cache a row that ended leaves the decoding batch (``compact=False``: every row decodes to the last one's
    end); the rows that go on draw the same numbers either way, so they take the same tokens.
    """
    decoding = start_decoding(model, prompt_ids, prompt_mask, n, max_new_tokens, own_cache, compile, share_prefix)
    logits = decoding.first
    rows = logits.shape[0]
    device = prompt_ids.device
    eos = torch.as_tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id), device=device)
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    lengths = torch.full((rows,), max_new_tokens, dtype=torch.long, device=device)
    tokens = []
    first_rows = (torch.arange(rows, device=device) % n == 0) if greedy_first else None
    alive = torch.arange(rows, device=device)  # the rows in the decoding batch (those of `logits`)
    padding = torch.full((rows,), pad_token_id, dtype=torch.long, device=device)
    for step in range(max_new_tokens):
        if greedy:
            drawn = logits.argmax(dim=-1)
        else:
            # One number per row of the whole batch, as if none had left: a row draws the same one either way.
            uniform = torch.rand((rows, 1), dtype=torch.float64, device=device)[alive]
            drawn = draw_cut(logits, temperature, top_k, top_p, min_p, uniform)
            if first_rows is not None:
                drawn = torch.where(first_rows[alive], logits.argmax(dim=-1), drawn)
        next_token = torch.where(finished, padding, padding.index_copy(0, alive, drawn))
        tokens.append(next_token)
        if on_token is not None:
            on_token(step + 1)
        ended = ~finished & torch.isin(next_token, eos)
        if stops is not None:
            ended |= ~finished & stops(torch.stack(tokens, dim=1), ~finished)
        lengths = torch.where(ended, step + 1, lengths)
        finished |= ended
        if bool(finished.all()) or step == max_new_tokens - 1:
            break
        going_on = ~finished[alive]
        if compact and decoding.keep is not None and not bool(going_on.all()):
            decoding.keep(going_on.nonzero().flatten(), step)
            alive = alive[going_on]
        logits = decoding.next(next_token[alive], step)
    completion = torch.stack(tokens, dim=1)
    return (completion, lengths.clamp(max=completion.shape[1])) if with_lengths else completion


class StopStrings:
    """``stops`` for `sample`: whether each open row's text, decoded so far, contains one of ``strings`` (the row
    then ends with the token that completed it). Only the tail that can hold a new match is decoded: the last
    ``max(len(string)) + 8`` tokens (a token holds at least one character, save a few byte-level pieces)."""

    def __init__(self, tokenizer, strings: Sequence[str]) -> None:
        self.tokenizer, self.strings = tokenizer, list(strings)
        self.window = max(map(len, self.strings)) + 8

    def __call__(self, tokens: torch.Tensor, open_rows: torch.Tensor) -> torch.Tensor:
        hit = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
        for r in open_rows.nonzero().flatten().tolist():
            tail = self.tokenizer.decode(tokens[r, -self.window :], skip_special_tokens=True)
            hit[r] = any(s in tail for s in self.strings)
        return hit
