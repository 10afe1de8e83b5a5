"""The Hugging Face hidden-states helper, on tiny randomly initialised models (no download)."""

import math
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

import gtpo_kernels.hf  # noqa: E402
import gtpo_kernels.hf.head  # noqa: E402
from gtpo_kernels import GTPOConfig, fused_linear_gtpo_loss, gtpo_loss  # noqa: E402
from gtpo_kernels.hf import (
    cache_kwarg,
    causal_lm_hidden_states,
    grouped_completion_hidden_states,  # noqa: E402
    prompt_pass,
    shared_prefix_length,
)


def tiny_llama():
    config = transformers.LlamaConfig(
        vocab_size=67,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_hidden_states_reproduce_the_logits():
    model = tiny_llama()
    ids = torch.randint(0, 67, (4, 9))
    attn = torch.ones_like(ids)
    attn[1, :2] = 0  # left padding
    hidden, weight, bias = causal_lm_hidden_states(model, ids, attn)
    logits = model(input_ids=ids, attention_mask=attn).logits
    assert bias is None and weight is model.lm_head.weight
    torch.testing.assert_close(hidden @ weight.T, logits, rtol=1e-5, atol=1e-5)


def test_fused_loss_on_a_model_matches_the_logits_loss():
    model = tiny_llama()
    prompt, length, group = 3, 5, 2
    ids = torch.randint(0, 67, (4, prompt + length))
    completion_ids = ids[:, prompt:]
    mask = torch.ones(4, length, dtype=torch.bool)
    mask[2, 3:] = False
    adv = torch.tensor([0.5, -0.5, 1.0, -1.0])
    # The official preset without its filter: a random tiny model's entropies are all above the threshold, which
    # would make both losses 0.
    config = GTPOConfig(preset="official", entropy_threshold=math.inf)
    hidden, weight, _ = causal_lm_hidden_states(model, ids)
    fused = fused_linear_gtpo_loss(
        hidden[:, prompt - 1 : -1],
        weight,
        completion_ids,
        mask,
        adv,
        group_size=group,
        config=config.replace(max_chunk_bytes=4 * 67 * 3),
        backend="torch",
    )
    fused.loss.backward()
    fused_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logits = model(input_ids=ids).logits[:, prompt - 1 : -1]
    plain = gtpo_loss(logits, completion_ids, mask, adv, group_size=group, config=config, backend="torch")
    plain.loss.backward()
    assert float(plain.loss.detach()) != 0
    torch.testing.assert_close(fused.loss, plain.loss, rtol=1e-5, atol=1e-6)
    for g_fused, p in zip(fused_grads, model.parameters()):
        torch.testing.assert_close(g_fused, p.grad, rtol=1e-4, atol=1e-6)


def grouped_batch(n_prompts=2, group=3, prompt=5, length=4, shared_prefix=0):
    """Left-padded prompts (the first two positions of prompt 0 are padding); with ``shared_prefix``, every
    prompt starts with the same that many tokens."""
    torch.manual_seed(1)
    prompt_ids = torch.randint(0, 67, (n_prompts, prompt))
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[0, :2] = 0  # left padding
    if shared_prefix:
        prompt_ids[1:, :shared_prefix] = prompt_ids[0, 2 : 2 + shared_prefix]
        prompt_ids[0, 2 + shared_prefix] = (prompt_ids[1, shared_prefix] + 1) % 67  # the prefix ends there
    completion_ids = torch.randint(0, 67, (n_prompts * group, length))
    completion_mask = torch.ones_like(completion_ids, dtype=torch.bool)
    completion_mask[1, 2:] = False  # ended early
    completion_mask[4, 1:] = False  # one token
    return prompt_ids, prompt_mask, completion_ids, completion_mask


@pytest.mark.parametrize("completion_pass", ["auto", "model"])
@pytest.mark.parametrize("shared_prefix", [0, 17], ids=["own-prompts", "shared-prefix"])
def test_grouped_hidden_states_equal_the_full_rows_in_value_and_gradient(shared_prefix, completion_pass, monkeypatch):
    """Each prompt once, its cache shared by the group (and a prefix every prompt starts with once, its cache
    shared by the prompts): same hidden states and the same parameter gradient as running every
    [prompt, completion] row whole (float64, so differences are exact)."""
    if completion_pass == "model":  # what a model `grouped_pass_issue` refuses takes
        monkeypatch.setattr(gtpo_kernels.hf.prompt_cache, "grouped_pass_issue", lambda model: "for the test")
    model = tiny_llama().double()
    group = 3
    prompt_ids, prompt_mask, completion_ids, completion_mask = grouped_batch(
        group=group, prompt=24 if shared_prefix else 5, shared_prefix=shared_prefix
    )
    assert gtpo_kernels.hf.shared_prefix_length(prompt_ids, prompt_mask) == shared_prefix
    prompt = prompt_ids.shape[1]
    gtpo_kernels.hf.check_hidden_states_supported(model)  # its probe runs the model: before counting calls
    calls = []
    hook = gtpo_kernels.hf.decoder_of(model).register_forward_pre_hook(lambda *a: calls.append(1))
    probe = torch.randn(completion_ids.shape[0], completion_ids.shape[1], 32, dtype=torch.float64)
    probe = probe * completion_mask[..., None]  # positions after a completion's end are not used

    hidden, weight, bias = grouped_completion_hidden_states(
        model, prompt_ids, prompt_mask, completion_ids, completion_mask, group
    )
    hook.remove()
    # [prefix,] prompts, completions (``auto``: the completions through `llama_layers`, not the decoder's forward)
    assert len(calls) == (2 if shared_prefix else 1) + (completion_pass == "model")
    assert weight is model.lm_head.weight and bias is None
    (hidden * probe).sum().backward()
    body = [p for name, p in model.named_parameters() if not name.startswith("lm_head")]  # lm_head: not used
    grouped_grads = [p.grad.clone() for p in body]
    model.zero_grad()

    ids = torch.cat([prompt_ids.repeat_interleave(group, 0), completion_ids], 1)
    attn = torch.cat([prompt_mask.repeat_interleave(group, 0), completion_mask.long()], 1)
    full, _, _ = causal_lm_hidden_states(model, ids, attn, position_ids=(attn.cumsum(1) - 1).clamp(min=0))
    full = full[:, prompt - 1 : -1]
    (full * probe).sum().backward()
    mask = completion_mask
    torch.testing.assert_close(hidden[mask], full[mask], rtol=1e-12, atol=1e-12)
    # Gradients agree to ~1e-8 of their norm rather than 1e-15 (HF computes the rotary angles in
    # float32 whatever the model's dtype, and the two paths sum the same terms in different orders).
    # Not flowing into the prompt pass through the shared cache would be off by O(1): the prompt
    # tokens' embedding rows get their whole gradient that way.
    for g, p in zip(grouped_grads, body):
        assert float((g - p.grad).norm() / p.grad.norm()) < 1e-6
    assert any(g.abs().sum() > 0 for g in grouped_grads)


@pytest.mark.parametrize(
    "rows,expected",
    [
        # left-padded rows (0 = padding): the prefix is counted from each row's first token
        ([[0, 0, 5, 6, 7, 8], [5, 6, 7, 9, 9, 9], [0, 5, 6, 7, 1, 2]], 3),
        ([[5, 6, 7], [5, 6, 7]], 2),  # identical prompts keep one token each of their own
        ([[0, 5, 6], [4, 5, 6]], 0),
        ([[5, 6, 7, 8]], 0),  # one prompt: nothing to share
    ],
)
def test_shared_prefix_length(rows, expected):
    ids = torch.tensor(rows)
    mask = (ids != 0).long()
    assert shared_prefix_length(ids, mask) == expected


def test_shared_prefix_pass_gives_each_prompts_own_logits():
    """Prompts of different lengths that share a 20-token prefix: the last-position logits of the prompt pass,
    and of the next token decoded on its cache, equal those of each prompt run alone, unpadded; the prefix
    path is the one taken."""
    tiny_model = tiny_llama()
    g = torch.Generator().manual_seed(3)
    vocab = tiny_model.config.vocab_size
    prefix = torch.randint(4, vocab, (20,), generator=g)
    own = [torch.randint(4, vocab, (n,), generator=g) for n in (5, 1, 3)]
    prompts = [torch.cat([prefix, o]) for o in own]
    width = max(len(p) for p in prompts)
    ids = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long), p]) for p in prompts])
    mask = torch.stack([torch.cat([torch.zeros(width - len(p)), torch.ones(len(p))]).long() for p in prompts])
    assert shared_prefix_length(ids, mask) == 20
    next_tokens = torch.randint(4, vocab, (3,), generator=g)
    with torch.no_grad():
        out, cache, attention, positions = prompt_pass(tiny_model, ids, mask, logits_to_keep=1)
        logits = out.logits[:, -1]
        assert attention.shape[1] == 20 + 5  # the prefix once, then the longest prompt's own tokens
        attention = torch.cat([attention, torch.ones_like(attention[:, :1])], 1)
        step = tiny_model(
            input_ids=next_tokens[:, None],
            attention_mask=attention,
            position_ids=positions,
            use_cache=True,
            **{cache_kwarg(tiny_model): cache},
        ).logits[:, -1]
        for b, p in enumerate(prompts):
            alone = tiny_model(input_ids=torch.cat([p, next_tokens[b : b + 1]])[None]).logits[0]
            torch.testing.assert_close(logits[b], alone[-2], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(step[b], alone[-1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("setting", ["sliding_window", "rope_dynamic", "share_prefix=False"])
def test_prompt_pass_runs_prompts_whole_where_a_prefix_cannot_be_shared(setting):
    """The same shared 20-token prefix as above, but a model whose two passes would not be one pass (a
    sliding window, RoPE whose frequencies depend on the call's length) or a caller that opts out: one call,
    the prompts whole, and the cache spans the padded prompts."""
    model = tiny_llama()
    if setting == "sliding_window":
        model.config.sliding_window = 8
    elif setting == "rope_dynamic":
        model.config.rope_parameters = {**model.config.rope_parameters, "rope_type": "dynamic", "factor": 2.0}
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(4, 67, (20,), generator=g)
    ids = torch.stack([torch.cat([prefix, torch.randint(4, 67, (n,), generator=g)]) for n in (2, 2)])
    mask = torch.ones_like(ids)
    assert shared_prefix_length(ids, mask) == 20
    calls = []
    hook = model.register_forward_pre_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        _, _, attention, _ = prompt_pass(
            model, ids, mask, logits_to_keep=1, share_prefix=setting != "share_prefix=False"
        )
    hook.remove()
    assert len(calls) == 1 and torch.equal(attention, mask)


def test_grouped_hidden_states_check_their_inputs():
    model = tiny_llama()
    prompt_ids, prompt_mask, completion_ids, completion_mask = grouped_batch()
    with pytest.raises(ValueError, match="expected prompt_ids' 2 rows x group_size 2"):
        grouped_completion_hidden_states(model, prompt_ids, prompt_mask, completion_ids, completion_mask, 2)
    right_padded = prompt_mask.flip(1)
    with pytest.raises(ValueError, match="left-padded"):
        grouped_completion_hidden_states(model, prompt_ids, right_padded, completion_ids, completion_mask, 3)
    with pytest.raises(ValueError, match="must have the shapes"):
        grouped_completion_hidden_states(model, prompt_ids, prompt_mask[:, 1:], completion_ids, completion_mask, 3)


def test_models_that_transform_logits_are_refused():
    config = transformers.LlamaConfig(
        vocab_size=67,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    config.final_logit_softcapping = 30.0
    model = transformers.LlamaForCausalLM(config)
    with pytest.raises(ValueError, match="soft-caps its logits .config.final_logit_softcapping = 30.0. after lm_head"):
        causal_lm_hidden_states(model, torch.zeros(1, 3, dtype=torch.long))


def test_any_architecture_whose_logits_are_its_head_is_accepted():
    """No allow-list: GPT-2 (not a Llama-family model) computes its logits as hidden @ W.T, and is accepted; a
    BERT-style head that transforms the hidden states before its linear layer is refused by the probe, even
    though its output embedding is a plain Linear."""
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=67, n_embd=32, n_layer=1, n_head=4, n_positions=16)
    ).eval()
    ids = torch.randint(0, 67, (2, 5))
    hidden, weight, bias = causal_lm_hidden_states(gpt2, ids)
    torch.testing.assert_close(hidden @ weight.T, gpt2(ids).logits, rtol=1e-5, atol=1e-5)
    bert = transformers.BertLMHeadModel(
        transformers.BertConfig(
            vocab_size=67,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            intermediate_size=64,
            is_decoder=True,
        )
    )
    with pytest.raises(ValueError, match="BertLMHeadModel's logits are not final_hidden @ lm_head.weight.T"):
        causal_lm_hidden_states(bert, ids)
    causal_lm_hidden_states(bert, ids, allow_unknown=True)  # the probe skipped on request


def _grouped_against_whole_rows(model, group=3, prompt=5, length=4):
    prompt_ids, prompt_mask, completion_ids, completion_mask = grouped_batch(group=group, prompt=prompt, length=length)
    hidden, _, _ = grouped_completion_hidden_states(
        model, prompt_ids, prompt_mask, completion_ids, completion_mask, group
    )
    ids = torch.cat([prompt_ids.repeat_interleave(group, 0), completion_ids], 1)
    attn = torch.cat([prompt_mask.repeat_interleave(group, 0), completion_mask.long()], 1)
    full, _, _ = causal_lm_hidden_states(model, ids, attn, position_ids=(attn.cumsum(1) - 1).clamp(min=0))
    full = full[:, prompt - 1 : -1]
    return hidden[completion_mask], full[completion_mask]


@pytest.mark.parametrize("family", ["llama-dynamic", "phi3-longrope"])
def test_length_dependent_rope_is_exact(family):
    """RoPE whose frequencies depend on the call's longest position (dynamic NTK, longrope): the prompts (5
    positions) stay below the switch length (6) and prompt + completion (9) passes it. One shared prompt pass
    gave hidden states off by 1e-4..1e-3 (silently); the rows are now run whole, as the model runs them."""
    torch.manual_seed(0)
    if family == "llama-dynamic":
        config = transformers.LlamaConfig(
            vocab_size=67,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=6,
            rope_scaling={"rope_type": "dynamic", "factor": 4.0},
        )
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Phi3Config(
            vocab_size=67,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=24,
            original_max_position_embeddings=6,
            pad_token_id=0,
            rope_scaling={"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [4.0] * 4},
        )
        model = transformers.Phi3ForCausalLM(config)
    model = model.double()
    assert "RoPE" in gtpo_kernels.hf.shared_prompt_pass_issue(model)
    grouped, whole = _grouped_against_whole_rows(model)
    torch.testing.assert_close(grouped, whole, rtol=1e-12, atol=1e-12)


def test_recurrent_state_layers_take_the_row_path():
    config = transformers.LlamaConfig(vocab_size=67, hidden_size=32, num_hidden_layers=2)
    config.layer_types = ["full_attention", "linear_attention"]
    assert "linear_attention" in gtpo_kernels.hf.shared_prompt_pass_issue(transformers.LlamaForCausalLM(config))
    assert gtpo_kernels.hf.shared_prompt_pass_issue(tiny_llama()) is None
    jamba = transformers.JambaConfig(
        vocab_size=67, hidden_size=32, num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1
    )
    assert "mamba" in gtpo_kernels.hf.shared_prompt_pass_issue(types.SimpleNamespace(config=jamba))


def test_get_decoder_returning_the_whole_model_is_handled(monkeypatch):
    """Some causal LMs' get_decoder() returns the causal LM itself (Llama 4 in some transformers versions): the
    hidden states then come from its inner ``model``, not from a second call of the whole model."""
    model = tiny_llama().eval()
    monkeypatch.setattr(model, "get_decoder", lambda: model)
    assert gtpo_kernels.hf.decoder_of(model) is model.model
    ids = torch.randint(0, 67, (2, 5))
    hidden, weight, _ = causal_lm_hidden_states(model, ids)
    torch.testing.assert_close(hidden @ weight.T, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_sharded_models_are_not_probed(monkeypatch):
    """A model whose parameters are sharded across processes (FSDP2, ZeRO-3) is not run by the check: a forward
    outside the step's own would gather and free its parameters out of turn. The trainers check before wrapping."""
    model = tiny_llama()
    monkeypatch.setattr(gtpo_kernels.hf.head, "_sharded", lambda base: True)
    monkeypatch.setattr(gtpo_kernels.hf.head, "_probe_head", lambda *a, **k: pytest.fail("probed a sharded model"))
    gtpo_kernels.hf.check_hidden_states_supported(model)


def test_a_forward_wrapped_in_autocast_is_still_recognised():
    """accelerate runs a prepared model's forward under autocast (TRL prepares its reference model at
    construction); the check compares with the class's own forward then, instead of refusing the model."""
    model = tiny_llama()
    model.forward = types.MethodType(torch.autocast("cpu", dtype=torch.bfloat16)(type(model).forward), model)
    gtpo_kernels.hf.check_hidden_states_supported(model)


def test_a_model_whose_own_forward_crashes_is_refused_for_that_reason():
    """Not with 'its logits are not final_hidden @ lm_head.weight.T', which is not the cause."""
    model = tiny_llama()

    def broken(self, *args, **kwargs):
        raise RuntimeError("CUDA error: device-side assert triggered")

    model.forward = types.MethodType(broken, model)
    with pytest.raises(ValueError, match=r"own forward failed: RuntimeError: CUDA error") as info:
        gtpo_kernels.hf.check_hidden_states_supported(model)
    assert "logits are not" not in str(info.value)
