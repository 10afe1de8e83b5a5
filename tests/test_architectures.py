"""Causal-LM families that transformers ships, as tiny random models: each is served by the fused
``hidden @ lm_head`` path (its logits are exactly its final hidden states through its head) or, when it soft-caps
or scales its logits, by the chunked logits path with that transform; never refused by name, never a silent
mismatch. Families whose tiny config does not build from generic small sizes are not listed."""

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gtpo_kernels.hf import (
    causal_lm_hidden_states,
    check_hidden_states_supported,
    decoder_of,  # noqa: E402
    grouped_completion_hidden_states,
    head_logit_transform,
    shared_prefix_issue,
)
from gtpo_kernels.hf.llama_layers import grouped_pass_issue  # noqa: E402

SMALL = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=67,
    max_position_embeddings=64,
    head_dim=8,
    n_embd=32,
    n_layer=2,
    n_head=4,
    moe_intermediate_size=16,
    num_experts=4,
    num_experts_per_tok=2,
    num_local_experts=4,
    sliding_window=16,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
# model_type -> the path it takes (a transform's description, or "fused")
FAMILIES = {
    "cohere": "scales its logits",
    "gemma2": "soft-caps its logits",
    **{
        name: "fused"
        for name in (
            "ernie4_5",
            "exaone4",
            "falcon",
            "gemma",
            "gemma3_text",
            "glm",
            "glm4",
            "gpt2",
            "gpt_neox",
            "gpt_oss",
            "granite",
            "internlm3",
            "lfm2",
            "llama",
            "llama4_text",
            "mistral",
            "olmo",
            "olmo2",
            "olmoe",
            "phi",
            "phi3",
            "phimoe",
            "qwen2",
            "qwen3",
            "qwen3_moe",
            "smollm3",
            "stablelm",
            "starcoder2",
        )
    },
}


def tiny(model_type):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = transformers.CONFIG_MAPPING[model_type]()
    for key, value in SMALL.items():
        try:
            setattr(config, key, value)
        except AttributeError:  # a derived property (Falcon's head_dim)
            pass
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])(config).eval()


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_family_takes_an_exact_path(model_type):
    model = tiny(model_type)
    ids = torch.randint(3, 60, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        transform = head_logit_transform(model)
        expected = FAMILIES[model_type]
        if expected == "fused":
            assert transform is None
            hidden, weight, bias = causal_lm_hidden_states(model, ids)
            mine = hidden @ weight.T + (0 if bias is None else bias)
        else:
            assert transform is not None and expected in transform[0]
            head = model.get_output_embeddings()
            hidden = decoder_of(model)(input_ids=ids).last_hidden_state
            mine = transform[1](head(hidden))
    torch.testing.assert_close(mine, logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", sorted(name for name, path in FAMILIES.items() if path == "fused"))
def test_family_shares_prompt_passes_exactly(model_type):
    """Two prompts of different lengths that start with the same 17 tokens, two completions each: the grouped
    hidden states (the shared prefix once, then each prompt's own tokens once, where `shared_prefix_issue`
    allows it; else each prompt once, or each row whole) equal the hidden states of each [prompt, completion]
    row run alone. The tiny configs' 16-position window would be shorter than these rows: families with
    sliding-window layers get one longer than the rows, the others none (a family without windows that is
    handed the attribute reads it in one of the two passes only)."""
    model = tiny(model_type)
    sliding = "sliding_attention" in (getattr(model.config, "layer_types", None) or ())
    model.config.sliding_window = 64 if sliding else None
    g = torch.Generator().manual_seed(2)
    prefix = torch.randint(3, 60, (17,), generator=g)
    prompts = [torch.cat([prefix, torch.randint(3, 60, (n,), generator=g)]) for n in (4, 1)]
    prompt_ids = torch.stack([prompts[0], torch.cat([torch.zeros(3, dtype=torch.long), prompts[1]])])
    prompt_mask = (torch.arange(21) >= torch.tensor([[0], [3]])).long()
    completion_ids = torch.randint(3, 60, (4, 3), generator=g)
    lengths = [3, 1, 3, 2]
    completion_mask = torch.arange(3) < torch.tensor(lengths)[:, None]
    check_hidden_states_supported(model)  # its probe runs the model: before counting calls
    calls = []
    hook = decoder_of(model).register_forward_pre_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        hidden, _, _ = grouped_completion_hidden_states(
            model, prompt_ids, prompt_mask, completion_ids, completion_mask, 2
        )
        hook.remove()
        if shared_prefix_issue(model) is None:
            # the prefix, the prompts' own tokens, the completions (through our grouped pass where it applies)
            assert len(calls) == (2 if grouped_pass_issue(model) is None else 3)
        for row in range(4):
            prompt = prompts[row // 2]
            expected, _, _ = causal_lm_hidden_states(
                model, torch.cat([prompt, completion_ids[row, : lengths[row]]])[None]
            )
            torch.testing.assert_close(
                hidden[row, : lengths[row]], expected[0, len(prompt) - 1 : -1], rtol=1e-4, atol=1e-4
            )
