"""gtpo_kernels.hf.llama_layers.GroupedPromptAttention: each completion's queries over its group's prompt keys and
its own keys under one softmax, against a float64 softmax over every key of every row written out whole (the
prompt's keys repeated for each completion and each query head), in value and gradient, in float32, bf16 and
fp16, whole groups at a time and a group's completions split across chunks."""

import pytest
import torch

import gtpo_kernels.hf.llama_layers as llama_layers
from gtpo_kernels.hf.llama_layers import GroupedPromptAttention

# B groups of G completions, K key/value heads of r query heads each, L completion and S prompt positions, D dims
B, G, K, R, L, S, D = 3, 4, 2, 3, 5, 7, 8
SCALE = D**-0.5


def inputs(dtype):
    """Fresh random queries, keys and values, and the masks of a step: left-padded prompts, completions that end
    early, causal attention among a completion's own positions."""
    g = torch.Generator().manual_seed(11)
    q = torch.randn(B, K, G, R * L, D, generator=g)
    prompt_k, prompt_v = (torch.randn(B, K, S, D, generator=g) for _ in range(2))
    own_k, own_v = (torch.randn(B, K, G, L, D, generator=g) for _ in range(2))
    prompt_valid = torch.ones(B, S, dtype=torch.bool)
    prompt_valid[1, :3] = False  # left padding
    prompt_valid[2, :1] = False
    lengths = torch.randint(1, L + 1, (B, G), generator=g)
    own_valid = torch.arange(L) < lengths[..., None]  # [B, G, L keys]
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    allowed = torch.cat(
        [
            prompt_valid[:, None, None, None, :].expand(B, G, R, L, S),
            (causal & own_valid[:, :, None, :])[:, :, None].expand(B, G, R, L, L),
        ],
        dim=-1,
    ).reshape(B, 1, G, R * L, S + L)
    bias = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    tensors = [t.to(dtype).requires_grad_() for t in (q, prompt_k, prompt_v, own_k, own_v)]
    return tensors, bias, allowed


def reference(q, prompt_k, prompt_v, own_k, own_v, allowed):
    """Float64: every completion's keys written out whole, ``[prompt | own]``, one softmax over the allowed ones."""
    q, prompt_k, prompt_v, own_k, own_v = (t.double() for t in (q, prompt_k, prompt_v, own_k, own_v))
    keys = torch.cat([prompt_k[:, :, None].expand(B, K, G, S, D), own_k], dim=3)  # [B, K, G, S + L, D]
    values = torch.cat([prompt_v[:, :, None].expand(B, K, G, S, D), own_v], dim=3)
    scores = (q @ keys.transpose(-1, -2)) * SCALE
    scores = scores.masked_fill(~allowed, float("-inf"))
    return scores.softmax(-1) @ values


PER_COMPLETION = K * R * L * (S + L)  # the scores of one completion
# CHUNK_SCORES -> how many chunks the three groups take
CHUNKINGS = {"all-groups": (B * G * PER_COMPLETION, 1), "one-group": (G * PER_COMPLETION, B)}
CHUNKINGS["two-completions"] = (2 * PER_COMPLETION, B * G // 2)


@pytest.mark.parametrize("chunking", sorted(CHUNKINGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_grouped_attention_equals_a_float64_softmax_over_every_key(dtype, chunking, monkeypatch):
    chunk_scores, expected_chunks = CHUNKINGS[chunking]
    monkeypatch.setattr(llama_layers, "CHUNK_SCORES", chunk_scores)
    assert len(llama_layers._chunks((B, K, G, R * L, D), S + L)) == expected_chunks  # the path meant is the one run
    tensors, bias, allowed = inputs(dtype)
    out = GroupedPromptAttention.apply(*tensors, bias, SCALE)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (out.float() * probe).sum().backward()
    leaves = [t.detach().double().requires_grad_() for t in tensors]
    expected = reference(*leaves, allowed)
    (expected * probe.double()).sum().backward()
    # float32 inputs: everything accumulates in float32; bf16/fp16: outputs and gradients rounded to them
    bar = 1e-5 if dtype == torch.float32 else 1e-2
    assert out.dtype == dtype
    expected = expected.detach()
    assert float((out.detach().double() - expected).norm() / expected.norm()) < bar
    for name, t, leaf in zip(("q", "prompt_k", "prompt_v", "own_k", "own_v"), tensors, leaves):
        error = float((t.grad.double() - leaf.grad).norm() / leaf.grad.norm())
        assert error < bar, f"{name}: {error:.2e}"


def test_grouped_attention_passes_gradcheck_in_float64():
    tensors, bias, _ = inputs(torch.float64)
    assert torch.autograd.gradcheck(lambda *t: GroupedPromptAttention.apply(*t, bias.double(), SCALE), tensors)


def test_the_grouped_pass_is_taken_only_where_it_is_exact_and_measured():
    """A Llama on the CPU takes it; the same model on another device (here ``meta``), in training with attention
    dropout, or a model outside the family each say why not, and the update then runs transformers' pass."""
    transformers = pytest.importorskip("transformers")
    from tests.test_hf import tiny_llama

    model = tiny_llama()
    assert llama_layers.grouped_pass_issue(model) is None
    assert "meta" in llama_layers.grouped_pass_issue(tiny_llama().to("meta"))
    dropout = tiny_llama()
    dropout.config.attention_dropout = 0.1
    assert llama_layers.grouped_pass_issue(dropout.eval()) is None  # dropout only draws in training
    assert "dropout" in llama_layers.grouped_pass_issue(dropout.train())
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    assert "gpt2" in llama_layers.grouped_pass_issue(gpt2)
