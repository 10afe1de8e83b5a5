"""trainer.model: in a float32 run on a CPU the trainer has SDPA read each key/value head for its group of query
heads instead of transformers' copies of them; the update's hidden states are the same to the bit, its gradients
the same but for rounding, and the copying path is the one that no longer runs."""

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

import transformers.integrations.sdpa_attention as sdpa_attention  # noqa: E402

from gtpo_kernels.hf import grouped_completion_hidden_states  # noqa: E402
from trainer.model import FORCE_GQA, load_model_and_tokenizer  # noqa: E402


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_float32_run_on_the_cpu_turns_grouped_query_attention_on_and_keeps_a_users_choice(
    tiny_model_dir, tmp_path, monkeypatch, precision
):
    """On for a float32 run; left as transformers has it under bf16 autocast (where the grouped kernel decodes
    slower); a value the user set stays."""
    from trainer.config import TrainConfig
    from trainer.distributed import Distributed
    from trainer.session import load_session
    from trainer.task import load_task

    config = TrainConfig(model=str(tiny_model_dir), output_dir=str(tmp_path), precision=precision, eval_size=4)
    task = load_task(config, train_size=64)
    dist = Distributed.start("cpu")
    monkeypatch.delenv(FORCE_GQA, raising=False)
    load_session(config, dist, task)
    assert os.environ.get(FORCE_GQA) == ("1" if precision == "fp32" else None)
    monkeypatch.setenv(FORCE_GQA, "0")
    load_session(config, dist, task)
    assert os.environ.get(FORCE_GQA) == "0"


def test_grouped_query_attention_gives_the_update_the_same_hidden_states_without_copying_heads(
    tiny_model_dir, monkeypatch
):
    """Left-padded prompts and masked completions, as in a training step: the hidden states of the two paths
    are equal to the bit, the gradients within float32 rounding; with the switch on, transformers' ``repeat_kv``
    (the copies) is never called."""
    model, _ = load_model_and_tokenizer(str(tiny_model_dir), torch.device("cpu"))
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # the test needs grouped heads
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(5, model.config.vocab_size, (2, 9), generator=g)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[1, :3] = 0
    completion_ids = torch.randint(5, model.config.vocab_size, (6, 7), generator=g)
    completion_mask = torch.ones_like(completion_ids, dtype=torch.bool)
    completion_mask[1, 4:] = False
    completion_mask[4, 2:] = False
    weights = torch.randn(6, 7, model.config.hidden_size, generator=g)
    copies = []
    repeat_kv = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda *a: (copies.append(1), repeat_kv(*a))[1])
    results = {}
    for switch in ("0", "1"):
        monkeypatch.setenv(FORCE_GQA, switch)
        copies.clear()
        model.zero_grad()
        hidden, _, _ = grouped_completion_hidden_states(
            model, prompt_ids, prompt_mask, completion_ids, completion_mask, group_size=3
        )
        (hidden * weights)[completion_mask].sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results[switch] = (hidden.detach()[completion_mask], grads, len(copies))
    (h_off, g_off, copies_off), (h_on, g_on, copies_on) = results["0"], results["1"]
    assert copies_off > 0 and copies_on == 0
    assert torch.equal(h_on, h_off)
    assert float((g_on - g_off).norm() / g_off.norm()) <= 1e-6
