"""The Hugging Face hidden-states helper, on tiny randomly initialised models (no download)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gtpo_kernels import GTPOConfig, fused_linear_gtpo_loss, gtpo_loss  # noqa: E402
from gtpo_kernels.hf import causal_lm_hidden_states  # noqa: E402


def tiny_llama():
    config = transformers.LlamaConfig(vocab_size=67, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
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
    config = GTPOConfig(preset="official")
    hidden, weight, _ = causal_lm_hidden_states(model, ids)
    fused = fused_linear_gtpo_loss(hidden[:, prompt - 1:-1], weight, completion_ids, mask, adv, group_size=group,
                                   config=config, backend="torch", chunk_size=1)
    fused.loss.backward()
    fused_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logits = model(input_ids=ids).logits[:, prompt - 1:-1]
    plain = gtpo_loss(logits, completion_ids, mask, adv, group_size=group, config=config, backend="torch")
    plain.loss.backward()
    torch.testing.assert_close(fused.loss, plain.loss, rtol=1e-5, atol=1e-6)
    for g_fused, p in zip(fused_grads, model.parameters()):
        torch.testing.assert_close(g_fused, p.grad, rtol=1e-4, atol=1e-6)


def test_models_that_transform_logits_are_refused():
    config = transformers.LlamaConfig(vocab_size=67, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    config.final_logit_softcapping = 30.0
    model = transformers.LlamaForCausalLM(config)
    with pytest.raises(ValueError, match="transforms its logits after lm_head"):
        causal_lm_hidden_states(model, torch.zeros(1, 3, dtype=torch.long))


def test_unknown_model_types_are_refused_unless_allowed():
    config = transformers.GPT2Config(vocab_size=67, n_embd=32, n_layer=1, n_head=4, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    with pytest.raises(ValueError, match="model type 'gpt2' is not known"):
        causal_lm_hidden_states(model, torch.zeros(1, 3, dtype=torch.long))
