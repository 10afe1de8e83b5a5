"""The completions' pass of the update through a Llama-family decoder's own modules, with the attention written out
for a group: each prompt's keys and values read once by its ``G`` completions.

transformers' completion pass on a prompt cache repeats each prompt's keys and values for every completion (the
cache's ``batch_repeat_interleave``), concatenates them with the completion's own at every layer, copies them again
for each query head of a grouped-query model (``repeat_kv``), and its CPU attention kernel's backward zero-fills and
transposes gradients of that whole ``[N, heads, prompt + completion, dim]`` block. At the default run's shapes that
was a third of the update's time for under 2 % of its FLOPs (`bench/results/step-issue64/`). Here the queries of a
group's completions and of a key/value head's query heads are stacked into one product against that group's prompt
keys (`GroupedPromptAttention`), next to a product against each completion's own keys, under one softmax; its
backward recomputes the probabilities from the saved log-sum-exp, so what a layer keeps for the backward is its
inputs and output, not its ``[queries, keys]`` scores.

The layers run through the model's own modules (projections, norms, MLP, rotary embedding), so LoRA adapters and
RoPE scaling apply as in its forward. Models outside the family, or whose layers this pass does not reproduce,
keep transformers' own pass (`llama_layers_issue` says why; `grouped_pass_issue` adds what the update needs).
"""

from __future__ import annotations

from typing import Optional

import torch

from .head import decoder_of
from .model_config import linear_head, shared_prompt_pass_issue, text_config, unwrap

# Decoders whose layers are: RMSNorm, attention (q/k/v/o projections, rotary embedding, optional per-head q/k
# norms), RMSNorm, MLP, with residuals around both: the passes written out for them are exactly theirs.
LLAMA_FAMILY = frozenset({"llama", "mistral", "qwen2", "qwen3"})
DECODER_PARTS = ("embed_tokens", "rotary_emb", "layers", "norm")
LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "scaling", "head_dim")


def llama_layers_issue(model) -> Optional[str]:
    """Why ``model``'s layers cannot be run by the passes written out for the Llama family (the sampler's decoding
    step, the update's completion pass), or ``None``."""
    base = unwrap(model)
    config = text_config(base)
    kind = getattr(config, "model_type", None)
    if kind not in LLAMA_FAMILY:
        return f"model type {kind!r} is not one of {', '.join(sorted(LLAMA_FAMILY))}"
    issue = shared_prompt_pass_issue(base)
    if issue is not None:
        return issue
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
        return "it has sliding-window layers"
    if kind == "mistral" and getattr(config, "sliding_window", None):
        return "its attention has a sliding window"
    try:
        decoder = decoder_of(base)
        linear_head(base)
    except (AttributeError, TypeError, ValueError) as exc:
        return f"its modules are not laid out as a Llama decoder's ({exc})"
    needed = {decoder: DECODER_PARTS}
    for layer in getattr(decoder, "layers", ()):
        needed.update({layer: LAYER_PARTS, getattr(layer, "self_attn", None): ATTENTION_PARTS})
    for module, parts in needed.items():
        missing = [p for p in parts if not hasattr(module, p)]
        if missing:
            return f"its modules are not laid out as a Llama decoder's (no {missing[0]})"
    return None


def grouped_pass_issue(model) -> Optional[str]:
    """Why the update's completions cannot take `grouped_completion_pass` (they then run through transformers'
    forward on a repeated cache, which is exact too), or ``None``: `llama_layers_issue`'s reasons; a model off the
    CPU; layers sharded by FSDP, whose hooks gather the weights around whole layers that this pass goes inside;
    attention dropout in training, which this pass does not draw."""
    issue = llama_layers_issue(model)
    if issue is not None:
        return issue
    decoder = decoder_of(unwrap(model))
    weight = next(decoder.parameters(), None)
    if weight is not None and weight.device.type != "cpu":
        # Measured on CPUs only; a GPU keeps transformers' fused attention kernels until this pass is timed there.
        return f"it runs on {weight.device.type}, where this pass has not been measured against the fused kernels"
    if any(isinstance(m, _fsdp_modules()) for m in decoder.modules()):
        return "its layers are sharded by FSDP"
    if decoder.training and float(getattr(text_config(unwrap(model)), "attention_dropout", 0.0) or 0.0) > 0:
        return "its attention has dropout in training"
    return None


def _fsdp_modules() -> tuple:
    """The module classes FSDP (1 and 2) wraps or turns a model's modules into; none where torch has no
    ``torch.distributed``."""
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:
        return ()
    return (FSDPModule, FullyShardedDataParallel)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of ``x [..., heads, T, dim]`` (the half-split layout of Llama-family models), ``cos, sin``
    broadcast to it."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class GroupedPromptAttention(torch.autograd.Function):
    """Attention of each completion's queries over its group's prompt keys and its own keys, one softmax over both.

    Shapes (``B`` groups of ``G`` completions, ``K`` key/value heads, ``M = r * L``: a key/value head's ``r`` query
    heads of ``L`` positions each, ``S`` prompt positions, ``D`` head dim), all in one dtype, that of the products:
    ``q [B, K, G, M, D]``, ``prompt_k, prompt_v [B, K, S, D]``, ``own_k, own_v [B, K, G, L, D]``;
    ``bias [B, 1, G, M, S + L]``: float32 (float64 for float64 inputs), 0 where a query attends (prompt keys
    first), -inf where not (every query attends to at least one key). Returns ``[B, K, G, M, D]``. The softmax and
    its backward run in float32, the products with keys and values in the inputs' dtype. A few completions at a
    time (`CHUNK_SCORES`), and the backward recomputes the probabilities instead of keeping them: a layer keeps its
    inputs and output only."""

    @staticmethod
    def forward(ctx, q, prompt_k, prompt_v, own_k, own_v, bias, scale: float):
        out = torch.empty_like(q)
        for b, g in _chunks(q.shape, bias.shape[-1]):
            probs = _probabilities(q[b, :, g], prompt_k[b], own_k[b, :, g], bias[b, :, g], scale)
            out[b, :, g] = _weighted_values(probs.to(q.dtype), prompt_v[b], own_v[b, :, g])
        ctx.save_for_backward(q, prompt_k, prompt_v, own_k, own_v, bias, out)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, prompt_k, prompt_v, own_k, own_v, bias, out = ctx.saved_tensors
        grad_q, grad_own_k, grad_own_v = (torch.empty_like(t) for t in (q, own_k, own_v))
        grad_prompt_k, grad_prompt_v = torch.zeros_like(prompt_k), torch.zeros_like(prompt_v)  # summed over chunks
        with torch.autocast(q.device.type, enabled=False):
            grad_out = grad_out.to(q.dtype)
            for b, g in _chunks(q.shape, bias.shape[-1]):
                inputs = (q[b, :, g], prompt_k[b], prompt_v[b], own_k[b, :, g], own_v[b, :, g])
                parts = _attention_backward(inputs, bias[b, :, g], out[b, :, g], grad_out[b, :, g], ctx.scale)
                grad_q[b, :, g], prompt_k_part, prompt_v_part, grad_own_k[b, :, g], grad_own_v[b, :, g] = parts
                grad_prompt_k[b] += prompt_k_part
                grad_prompt_v[b] += prompt_v_part
        return grad_q, grad_prompt_k, grad_prompt_v, grad_own_k, grad_own_v, None, None


# The most float32 scores a chunk of `GroupedPromptAttention` holds: small enough that the softmax's passes over
# them run in the CPU's cache (over a layer's whole block they took longer than the products); at the default
# run's shapes a group's scores (466k) make one chunk. Measured on a 2-core AMD EPYC: 2^19 against 2^18 and 2^20.
CHUNK_SCORES = 2**19


def _chunks(shape, keys: int):
    """``(groups, completions)`` slices of `GroupedPromptAttention`'s ``q [B, K, G, M, D]`` over ``keys`` (``S +
    L``) keys: whole groups while a chunk holds at most `CHUNK_SCORES` scores, else a group's completions a few at a
    time."""
    groups, heads, size, queries, _ = shape
    per_completion = heads * queries * keys
    per_chunk = max(1, CHUNK_SCORES // per_completion)
    if per_chunk >= size:
        step = per_chunk // size
        return [(slice(i, min(i + step, groups)), slice(None)) for i in range(0, groups, step)]
    return [
        (slice(i, i + 1), slice(j, min(j + per_chunk, size))) for i in range(groups) for j in range(0, size, per_chunk)
    ]


def _probabilities(q, prompt_k, own_k, bias, scale: float) -> torch.Tensor:
    """``[b, K, G, M, S + L]`` float32: the softmax of a chunk's queries over prompt and own keys."""
    b, k, g, m, d = q.shape
    s = prompt_k.shape[2]
    on_prompt = (q.reshape(b, k, g * m, d) @ prompt_k.transpose(-1, -2)).view(b, k, g, m, s)
    scores = torch.cat([on_prompt, q @ own_k.transpose(-1, -2)], dim=-1).to(_softmax_dtype(q))
    return torch.softmax(scores.mul_(scale).add_(bias), dim=-1)


def _softmax_dtype(q: torch.Tensor) -> torch.dtype:
    """float32, or the inputs' dtype where it is wider (float64)."""
    return torch.promote_types(q.dtype, torch.float32)


def _weighted_values(p, prompt_v, own_v):
    """``[b, K, G, M, D]``: probabilities ``p [b, K, G, M, S + L]`` (the values' dtype) times the prompt's and the
    completions' own values."""
    b, k, g, m, _ = p.shape
    s, d = prompt_v.shape[2], prompt_v.shape[3]
    on_prompt = (p[..., :s].reshape(b, k, g * m, s) @ prompt_v).view(b, k, g, m, d)
    return on_prompt + p[..., s:] @ own_v


def _attention_backward(inputs: tuple, bias, out, grad_out, scale: float):
    """The gradients of one chunk's ``inputs``, ``(q, prompt_k, prompt_v, own_k, own_v)``, its probabilities
    recomputed."""
    q, prompt_k, prompt_v, own_k, own_v = inputs
    b, k, g, m, d = q.shape
    s = prompt_k.shape[2]
    probs = _probabilities(q, prompt_k, own_k, bias, scale)
    p = probs.to(q.dtype)
    flat_grad_out = grad_out.reshape(b, k, g * m, d)
    # dV = P^T dO: a group's prompt values from all its queries, a completion's own values from its own
    grad_prompt_v = p[..., :s].reshape(b, k, g * m, s).transpose(-1, -2) @ flat_grad_out
    grad_own_v = p[..., s:].transpose(-1, -2) @ grad_out
    # dS = P * (dP - rowsum(dO * O)) * scale with dP = dO V^T: the softmax's backward, in float32
    grad_p = torch.cat(
        [(flat_grad_out @ prompt_v.transpose(-1, -2)).view(b, k, g, m, s), grad_out @ own_v.transpose(-1, -2)],
        dim=-1,
    )
    wide = _softmax_dtype(q)
    rowsum = (grad_out.to(wide) * out.to(wide)).sum(-1, keepdim=True)
    grad_s = grad_p.to(wide).sub_(rowsum).mul_(probs).mul_(scale).to(q.dtype)
    grad_prompt_s = grad_s[..., :s].reshape(b, k, g * m, s)
    grad_q = (grad_prompt_s @ prompt_k).view(b, k, g, m, d) + grad_s[..., s:] @ own_k
    grad_prompt_k = grad_prompt_s.transpose(-1, -2) @ q.reshape(b, k, g * m, d)
    grad_own_k = grad_s[..., s:].transpose(-1, -2) @ q
    return grad_q, grad_prompt_k, grad_prompt_v, grad_own_k, grad_own_v


def grouped_completion_pass(
    model,
    cache,
    prompt_attention: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    positions: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """``[N, L, H]`` final hidden states (after the decoder's norm) of completions ``completion_ids [N, L]`` at
    ``positions [N, L]``, on the prompt pass's transformers cache of ``B = N / group_size`` rows (``S`` positions,
    ``prompt_attention [B, S]``), the ``G`` completions of group ``b`` in rows ``b * G .. b * G + G - 1``; equal to
    transformers' pass on the cache repeated for each completion where ``completion_mask`` holds, 0 where not.
    Only the ``T`` positions under the mask run: the layers' per-token work (norms, projections, MLP) on them packed
    ``[T, H]``, attention on the ``[N, L]`` layout with the rest masked, so a batch whose rows end early costs its
    tokens, not its longest row times its rows. Gradients reach the prompt pass through the cache's tensors."""
    decoder = decoder_of(unwrap(model))
    n, length = completion_ids.shape
    g = group_size
    b = n // g
    index = completion_mask.bool().flatten().nonzero().squeeze(1)  # [T]: the positions that run
    x = decoder.embed_tokens(completion_ids.flatten()[index])  # [T, H]
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    cos, sin = decoder.rotary_emb(x[None], positions.flatten()[index][None])
    cos, sin = cos[0, :, None], sin[0, :, None]  # [T, 1, dim]
    first = decoder.layers[0].self_attn
    kv_heads = cache.layers[0].keys.shape[1]
    r = first.q_proj.out_features // (kv_heads * first.head_dim)
    m = r * length
    blocked = torch.tensor(float("-inf"), dtype=torch.promote_types(dtype, torch.float32), device=x.device)
    zero = torch.zeros((), dtype=blocked.dtype, device=x.device)
    # [B, 1, G, M, S + L]: what each query attends to, the same at every layer
    prompt_bias = torch.where(prompt_attention.bool(), zero, blocked).view(b, 1, 1, 1, 1, -1)
    causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
    own_keys = causal[None] & completion_mask.bool()[:, None, :]  # [N, L queries, L keys]
    own_bias = torch.where(own_keys, zero, blocked).view(b, 1, g, 1, length, length)
    shape = (b, 1, g, r, length)
    bias = torch.cat([prompt_bias.expand(*shape, -1), own_bias.expand(*shape, length)], -1).view(b, 1, g, m, -1)

    def grouped(t: torch.Tensor) -> torch.Tensor:
        """Packed ``[T, K * j, D]`` -> ``[B, K, G, j * L, D]``: a group's completions and a key/value head's ``j``
        query heads stacked, the positions not run 0 (and masked)."""
        heads, dim = t.shape[1], t.shape[2]
        padded = t.new_zeros(n * length, heads, dim).index_copy(0, index, t)
        j = heads // kv_heads
        padded = padded.view(b, g, length, kv_heads, j, dim).permute(0, 3, 1, 4, 2, 5)
        return padded.reshape(b, kv_heads, g, j * length, dim)

    for i, layer in enumerate(decoder.layers):
        attn = layer.self_attn
        dim = attn.head_dim
        h = layer.input_layernorm(x)
        q, k, v = (proj(h).view(h.shape[0], -1, dim) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        if getattr(attn, "q_norm", None) is not None:  # Qwen3: RMSNorm per head before the rotation
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)  # [T, heads, dim]
        layer_cache = cache.layers[i]
        with torch.autocast(device, enabled=False):
            out = GroupedPromptAttention.apply(
                grouped(q.to(dtype)),
                layer_cache.keys.to(dtype).contiguous(),
                layer_cache.values.to(dtype).contiguous(),
                grouped(k.to(dtype)),
                grouped(v.to(dtype)),
                bias,
                float(attn.scaling),
            )
        # [B, K, G, r * L, D] -> [N * L, K * r * D] -> the positions that run
        out = out.view(b, kv_heads, g, r, length, dim).permute(0, 2, 4, 1, 3, 5).reshape(n * length, -1)
        x = x + attn.o_proj(out.index_select(0, index))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    x = decoder.norm(x)
    return x.new_zeros(n * length, x.shape[-1]).index_copy(0, index, x).view(n, length, -1)
