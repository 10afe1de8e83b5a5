"""The update's decoder runs a prefix every prompt of a micro-batch shares once (then each prompt's own tokens once,
then the completions on their prompt's cache): the same hidden states and gradients as running every
[prompt, completion] row whole, with LoRA adapters too; and the reference pass of ``--beta`` (`update.token_stats`,
no gradient) gives the log-probs of the whole rows."""

from unittest.mock import patch

import pytest
import torch

transformers = pytest.importorskip("transformers")

import gtpo_kernels.hf  # noqa: E402
import gtpo_kernels.hf.prompt_cache as prompt_cache  # noqa: E402
from gtpo_kernels.hf import causal_lm_hidden_states, grouped_completion_hidden_states  # noqa: E402
from tests.test_hf import grouped_batch, tiny_llama  # noqa: E402
from trainer.config import TrainConfig  # noqa: E402
from trainer.rollout import Completions, Rollout  # noqa: E402
from trainer.update import token_stats  # noqa: E402

GROUP, PREFIX = 3, 17


def decoder_calls(model):
    """The rows x tokens of each call of ``model``'s decoder, and what stops recording them."""
    calls = []
    hook = gtpo_kernels.hf.decoder_of(model).register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    return calls, hook


def whole_rows(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    ids = torch.cat([prompt_ids.repeat_interleave(GROUP, 0), completion_ids], 1)
    attn = torch.cat([prompt_mask.repeat_interleave(GROUP, 0), completion_mask.long()], 1)
    full, weight, bias = causal_lm_hidden_states(model, ids, attn, position_ids=(attn.cumsum(1) - 1).clamp(min=0))
    return full[:, prompt_ids.shape[1] - 1 : -1], weight


@pytest.mark.parametrize("completion_pass", ["auto", "model"])
@pytest.mark.parametrize("adapter", ["full", "lora"])
def test_the_update_runs_the_shared_prefix_once_and_equals_the_whole_rows(adapter, completion_pass, monkeypatch):
    """``auto``: the completions through our grouped attention (`llama_layers`), ``model``: transformers' forward
    on the repeated cache (what a model `grouped_pass_issue` refuses takes); either equals the whole rows, LoRA
    adapters applied."""
    if completion_pass == "model":
        monkeypatch.setattr(prompt_cache, "grouped_pass_issue", lambda model: "transformers' pass, for the test")
    model = tiny_llama().double()
    if adapter == "lora":
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        with torch.no_grad():  # B starts at zero: move it, so that the adapters change the hidden states
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.3)
    batch = grouped_batch(group=GROUP, prompt=24, shared_prefix=PREFIX)
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch
    gtpo_kernels.hf.check_hidden_states_supported(model)  # its probe runs the model: before counting calls
    calls, hook = decoder_calls(model)
    grouped_calls, mlp_rows = [], []
    attention = gtpo_kernels.hf.llama_layers.GroupedPromptAttention
    apply = attention.apply
    mlp = gtpo_kernels.hf.decoder_of(model).layers[0].mlp
    packed = mlp.register_forward_pre_hook(lambda m, a: mlp_rows.append(a[0].shape[0]) if a[0].dim() == 2 else None)
    with patch.object(attention, "apply", side_effect=lambda *a: (grouped_calls.append(1), apply(*a))[1]):
        hidden, _, _ = grouped_completion_hidden_states(model, *batch, GROUP)
    hook.remove()
    packed.remove()
    # ours runs the completions' positions under the mask only, packed: not every row to the longest one's end
    assert mlp_rows == ([int(completion_mask.sum())] if completion_pass == "auto" else [])
    assert int(completion_mask.sum()) < completion_mask.numel()
    own = 24 - PREFIX
    expected = [(1, PREFIX), (2, own)]  # the prefix once, for both prompts; then each prompt's own tokens
    if completion_pass == "model":
        expected.append((2 * GROUP, completion_ids.shape[1]))
    assert calls == expected
    assert len(grouped_calls) == (model.config.num_hidden_layers if completion_pass == "auto" else 0)
    probe = torch.randn(hidden.shape, dtype=torch.float64) * completion_mask[..., None]
    trained = [p for p in model.parameters() if p.requires_grad]
    (hidden * probe).sum().backward()
    grouped = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in trained]
    model.zero_grad()
    full, _ = whole_rows(model, *batch)
    (full * probe).sum().backward()
    torch.testing.assert_close(hidden[completion_mask], full[completion_mask], rtol=1e-12, atol=1e-12)
    # To ~1e-8 of each gradient's norm, not 1e-15: transformers computes the rotary angles in float32 whatever the
    # model's dtype, and the two paths sum the same terms in other orders. A gradient that did not flow through
    # the shared prefix's keys and values would be off by O(1).
    moved = 0
    for g, p in zip(grouped, trained):
        expected = p.grad if p.grad is not None else torch.zeros_like(p)
        if expected.abs().sum() > 0:
            moved += 1
            assert float((g - expected).norm() / expected.norm()) < 1e-6
        else:
            assert not g.abs().sum()
    assert moved >= len(trained) // 2  # the comparison is of gradients, not of zeros


def test_the_reference_pass_of_beta_gives_the_whole_rows_log_probs():
    model = tiny_llama()
    prompt_ids, prompt_mask, completion_ids, completion_mask = grouped_batch(
        group=GROUP, prompt=24, shared_prefix=PREFIX
    )
    completions = Completions(prompt_ids, prompt_mask, completion_ids, completion_mask, texts=[])
    batch = Rollout(completions, GROUP, advantages=torch.zeros(completion_ids.shape[0]))
    config = TrainConfig(group_size=GROUP, prompts_per_step=2, temperature=0.7, beta=0.04)
    calls, hook = decoder_calls(model)
    logprobs, entropy = token_stats(model, batch, config)
    hook.remove()
    assert calls[0] == (1, PREFIX)
    with torch.no_grad():
        full, weight = whole_rows(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
        expected = torch.log_softmax((full @ weight.T).double() / 0.7, -1).gather(-1, completion_ids[..., None])[..., 0]
    mask = completion_mask
    assert (logprobs[mask].double() - expected[mask]).abs().max() <= 1e-5
