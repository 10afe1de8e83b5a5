"""The sampler's decoding step on a key/value cache the trainer owns (`KVCache`), for Llama-family decoders.

A decoding step of a small model is mostly overhead around small matrix products: transformers' module calls,
attention-mask building and cache bookkeeping at every token and layer. `Decoder` runs one token of every row
through the model's own modules (its projections, norms, MLP and rotary embedding, so LoRA adapters and any
RoPE scaling apply as in the model) with the attention written out here: keys and values go into buffers sized
once for the prompt and every token to come (``index_copy_``, no concatenation, no reallocation), and attention
reads the whole buffer under a mask of the positions written so far, so every step has the same shapes (what
``torch.compile`` and CUDA graphs need). Models outside the family, or with layers this step does not
reproduce (sliding windows, recurrent states), keep transformers' own decoding (`decoder_issue` says why).

``compile`` puts the step under ``torch.compile`` (on a GPU with CUDA graphs, ``mode="reduce-overhead"``; not yet run
on a GPU); a model or platform it cannot take falls back to the eager step with one line saying why, and the
compile's time is reported (`Decoder.compile_seconds`).
"""

from __future__ import annotations

import time
import warnings
import weakref
from dataclasses import dataclass
from typing import List, Optional

import torch

from gtpo_kernels.hf.head import decoder_of
from gtpo_kernels.hf.llama_layers import llama_layers_issue, rotate
from gtpo_kernels.hf.model_config import linear_head, unwrap

# The models this step runs, and why another cannot: the library's check, shared with the update's grouped pass.
decoder_issue = llama_layers_issue


@dataclass
class KVCache:
    """The keys and values a new token attends to, preallocated for the prompt and every token still to come.

    ``prefix_keys, prefix_values``: per layer ``[kv_heads, c, head_dim]``, the ``c`` tokens every prompt starts with
    (a system turn, worked examples), held once for all rows (``c = 0``: none); ``keys, values``: per layer
    ``[R, kv_heads, capacity, head_dim]``, each row's own prompt tokens and those written since; ``valid [R,
    capacity]``: which of a row's positions it attends to (not its left padding, nor the room still empty). Held in
    the dtype the attention products run in (autocast's, where it is on), so a step casts only its new token's."""

    prefix_keys: List[torch.Tensor]
    prefix_values: List[torch.Tensor]
    keys: List[torch.Tensor]
    values: List[torch.Tensor]
    valid: torch.Tensor

    @property
    def prefix(self) -> int:
        return self.prefix_keys[0].shape[1] if self.prefix_keys else 0

    @classmethod
    def from_prompts(cls, cache, attention: torch.Tensor, n: int, extra: int, prefix: int = 0) -> KVCache:
        """The cache of a prompt pass (transformers' ``Cache`` of ``B`` rows built under ``attention [B, S]``, whose
        first ``prefix`` positions are the same tokens in every row), each prompt's own part repeated for its ``n``
        rows, with room for ``extra`` more positions."""
        batch, length = attention.shape
        own = length - prefix
        device = attention.device.type
        # Under autocast the attention products run in its dtype whatever the cache holds: a float32 cache (what a
        # float32 model's rotary embedding leaves) would be cast whole at every layer of every step.
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        prefix_keys, prefix_values, keys, values = [], [], [], []
        for layer in cache.layers:
            for source, shared, into in ((layer.keys, prefix_keys, keys), (layer.values, prefix_values, values)):
                _, heads, _, dim = source.shape
                source = source.to(dtype or source.dtype)
                if prefix:
                    shared.append(source[0, :, :prefix].clone())
                buffer = source.new_zeros(batch, n, heads, own + extra, dim)
                buffer[:, :, :, :own] = source[:, None, :, prefix:]  # one copy, straight into each row's buffer
                into.append(buffer.view(batch * n, heads, own + extra, dim))
        valid = torch.zeros(batch * n, own + extra, dtype=torch.bool, device=attention.device)
        valid[:, :own] = attention[:, prefix:].bool().repeat_interleave(n, 0)
        return cls(prefix_keys, prefix_values, keys, values, valid)

    def keep(self, rows: torch.Tensor, used: int) -> None:
        """Only the rows ``rows`` (ascending indices of the current ones) from now on, in that order: each kept row's
        first ``used`` positions move up to its new index within the same buffers (nothing allocated, the room not
        yet written not copied), and the buffers' first ``len(rows)`` rows become the cache."""
        kept = rows.numel()
        for buffers in (self.keys, self.values):
            for i, buffer in enumerate(buffers):
                buffer[:kept, :, :used] = buffer[rows, :, :used]  # the right side is gathered first: no overlap
                buffers[i] = buffer[:kept]
        self.valid = self.valid[rows]


def attend(q: torch.Tensor, cache: KVCache, layer: int, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """``[R * kv_heads, group, dim]`` attention outputs of the queries ``q [R * kv_heads, group, dim]`` (in the
    cache's dtype, as is ``bias``: `decode_step` makes them so; a key/value
    head's ``group`` query heads in the query-length dimension, so each key/value head is read once, with no
    copies) over the shared prefix and each row's first ``used`` own positions, one softmax over both. ``bias [R *
    kv_heads, group, used]``: 0 where a row attends, -inf elsewhere. Written as batched products: at one query a row
    they beat the CPU's fused attention kernel, and the prefix's keys are read once for every row."""
    used = bias.shape[-1]
    rows, kv_heads, _, dim = cache.keys[layer].shape
    # [R * kv_heads, used, dim] views of the positions written so far (the room still empty is not read)
    keys, values = (c[layer][:, :, :used].flatten(0, 1) for c in (cache.keys, cache.values))
    group = q.shape[1]
    scores = torch.baddbmm(bias, q, keys.transpose(1, 2), alpha=scale)  # [R * kv_heads, group, used]
    c = cache.prefix
    if c:
        by_head = q.view(rows, kv_heads, group, dim).transpose(0, 1).reshape(kv_heads, rows * group, dim)
        shared = torch.bmm(by_head, cache.prefix_keys[layer].transpose(1, 2)) * scale
        shared = shared.view(kv_heads, rows, group, c).transpose(0, 1).reshape(-1, group, c)
        scores = torch.cat([shared, scores], dim=-1)
    probs = scores.softmax(-1)
    out = torch.bmm(probs[..., c:], values)
    if c:
        shared = probs[..., :c].reshape(rows, kv_heads, group, c).transpose(0, 1).reshape(kv_heads, rows * group, c)
        shared = torch.bmm(shared, cache.prefix_values[layer])
        out = out + shared.view(kv_heads, rows, group, dim).transpose(0, 1).reshape(-1, group, dim)
    return out


def decode_step(
    modules, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor, index: torch.Tensor, used: int = 0
):
    """``[R, V]`` logits of the token after ``tokens [R]`` (at ``positions [R, 1]``), whose keys and values are
    written at position ``index [1]`` of each row's own buffer in ``cache`` (and marked valid there). Attention reads
    each row's first ``used`` positions (``index + 1``, the ones written so far; 0: the whole buffer, the same shapes
    at every step, for a compiled step)."""
    decoder, head = modules
    rows = tokens.shape[0]
    cache.valid.index_fill_(1, index, True)
    kv_heads = cache.keys[0].shape[1]
    capacity = used or cache.keys[0].shape[2]
    first = decoder.layers[0].self_attn
    group = first.q_proj.out_features // (kv_heads * first.head_dim)
    x = decoder.embed_tokens(tokens[:, None])  # [R, 1, H]
    kv_dtype = cache.keys[0].dtype  # the attention products' dtype (`KVCache`): q and the mask are made to match
    valid = cache.valid[:, :capacity]
    bias = torch.zeros(valid.shape, dtype=kv_dtype, device=x.device).masked_fill(~valid, float("-inf"))
    bias = bias[:, None, None].expand(rows, kv_heads, group, capacity).reshape(rows * kv_heads, group, capacity)
    cos, sin = decoder.rotary_emb(x, positions)
    cos, sin = cos[:, None], sin[:, None]  # [R, 1, 1, dim]
    for i, layer in enumerate(decoder.layers):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        dim = attn.head_dim
        q = attn.q_proj(h).view(rows, 1, -1, dim).transpose(1, 2)  # [R, heads, 1, dim]
        k = attn.k_proj(h).view(rows, 1, -1, dim).transpose(1, 2)  # [R, kv_heads, 1, dim]
        v = attn.v_proj(h).view(rows, 1, -1, dim).transpose(1, 2)
        if getattr(attn, "q_norm", None) is not None:  # Qwen3: RMSNorm per head before the rotation
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = rotate(q, cos, sin).to(kv_dtype), rotate(k, cos, sin)
        cache.keys[i].index_copy_(2, index, k.to(kv_dtype))
        cache.values[i].index_copy_(2, index, v.to(kv_dtype))
        out = attend(q.reshape(rows * kv_heads, group, dim), cache, i, bias, attn.scaling)
        x = x + attn.o_proj(out.reshape(rows, 1, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return head(decoder.norm(x))[:, -1]


class Decoder:
    """One model's decoding step on a `KVCache`: eager, or compiled with ``compile`` (then `compile_seconds` holds
    the time of each first call of a new shape, where the compiling happens, and `compile_issue` why it fell back
    to the eager step, if it did)."""

    _made: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, model, compile: bool = False) -> Decoder:
        """``model``'s decoder, made once per model and setting (a compiled step keeps its compiled code)."""
        base = unwrap(model)
        made = cls._made.setdefault(base, {})
        if compile not in made:
            made[compile] = cls(base, compile)
        return made[compile]

    def __init__(self, model, compile: bool = False) -> None:
        base = unwrap(model)
        self.modules = (decoder_of(base), linear_head(base))
        self.compile_seconds = 0.0
        self.compile_issue: Optional[str] = None
        self._compiled = None
        self._shapes = set()
        if compile:
            mode = "reduce-overhead" if base.device.type == "cuda" else None
            try:
                # dynamic=None: a second shape (another prompt width) recompiles once with symbolic sizes, not
                # once per width
                self._compiled = torch.compile(decode_step, mode=mode, dynamic=None)
            except Exception as exc:  # noqa: BLE001 (no compiler on this platform: the eager step is the same maths)
                self._fall_back(exc)

    def _fall_back(self, exc: Exception) -> None:
        self.compile_issue = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        warnings.warn(f"the compiled decoding step failed ({self.compile_issue}); decoding eagerly", stacklevel=3)
        self._compiled = None

    @property
    def static_shapes(self) -> bool:
        """Whether every step must have the same shapes (a compiled step): the whole cache read, no rows leaving."""
        return self._compiled is not None

    def __call__(
        self, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor, index: torch.Tensor, used: int = 0
    ):
        """`decode_step` of this model (a compiled one reads the whole cache, whatever ``used`` says)."""
        if self._compiled is not None:
            shape = (tokens.shape[0], cache.keys[0].shape[2], cache.prefix)
            started = time.perf_counter()
            try:
                logits = self._compiled(self.modules, cache, tokens, positions, index)
                return logits.clone() if logits.device.type == "cuda" else logits  # CUDA graphs reuse outputs
            except Exception as exc:  # noqa: BLE001 (a model the compiler cannot take: decode eagerly)
                self._fall_back(exc)
            finally:
                if shape not in self._shapes:
                    self._shapes.add(shape)
                    self.compile_seconds += time.perf_counter() - started
        return decode_step(self.modules, cache, tokens, positions, index, used)
