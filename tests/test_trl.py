"""`GTPOTrainer` (TRL's GRPOTrainer with the GTPO loss) on a tiny Llama, on the CPU. Skipped without the
``trl`` extra (``pip install -e ".[trl]"``); CI installs it."""

import pytest
import torch

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")

from datasets import Dataset  # noqa: E402

from gtpo_kernels import GTPOConfig, conflict_weights, gtpo_loss  # noqa: E402
from gtpo_kernels.integrations.trl import GTPOTrainer  # noqa: E402

G = 3


def reward_length(completions, **kwargs):
    return [float(len(c if isinstance(c, str) else c[-1]["content"]) % 3) for c in completions]


def make_trainer(model_dir, tmp_path, cls=GTPOTrainer, steps_per_generation=1, accumulation=1, **kwargs):
    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4 * G // steps_per_generation,
                          steps_per_generation=steps_per_generation, gradient_accumulation_steps=accumulation,
                          num_generations=G, max_completion_length=6, temperature=0.7, report_to="none", use_cpu=True,
                          logging_steps=1, save_strategy="no", bf16=False,
                          **{"max_steps": 1, **kwargs.pop("trl_args", {})})
    data = Dataset.from_dict({"prompt": ["1+2?", "3+4?", "5+6?", "7+8?", "2+2?", "9+1?"]})
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    trainer = cls(model=model, reward_funcs=[reward_length], args=args, train_dataset=data,
                  processing_class=transformers.AutoTokenizer.from_pretrained(model_dir), **kwargs)
    trainer.current_gradient_accumulation_steps = accumulation
    return trainer


def fixed_inputs(vocab, n=4 * G, prompt=4, length=6, seed=0, with_conflict=True):
    """A batch as TRL's scoring step hands it to the loss (prompt left-padded, completions right-padded)."""
    g = torch.Generator().manual_seed(seed)
    completion_ids = torch.randint(4, vocab, (n, length), generator=g)
    completion_ids[1::G, :2] = completion_ids[0::G, :2]
    lengths = torch.randint(1, length + 1, (n,), generator=g)
    completion_mask = (torch.arange(length)[None] < lengths[:, None]).long()
    prompt_ids = torch.randint(4, vocab, (n // G, prompt), generator=g).repeat_interleave(G, 0)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[:G, :1] = 0
    advantages = torch.tensor([1.0, -0.5, -0.5] * (n // G)) * torch.rand(n, generator=g)
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
              "completion_mask": completion_mask, "advantages": advantages,
              "num_items_in_batch": completion_mask.sum().float()}
    if with_conflict:
        inputs["gtpo_lambda"], inputs["gtpo_n_conflict"] = conflict_weights(completion_ids, completion_mask, advantages, G)
    return inputs


def loss_and_grads(trainer, inputs):
    trainer.model.train()
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in trainer.model.named_parameters() if p.grad is not None}


def assert_same_grads(a, b, rtol=1e-5):
    assert a.keys() == b.keys() and len(a) > 5
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=rtol * float(b[k].abs().max()), msg=k)


@pytest.mark.parametrize("preset", ["paper", "official"])
def test_loss_equals_gtpo_loss_on_the_logits(tiny_model_dir, tmp_path, preset):
    config = GTPOConfig(preset=preset)
    trainer = make_trainer(tiny_model_dir, tmp_path, gtpo_config=config)
    trainer._gtpo_initial_entropy = 5.0
    inputs = fixed_inputs(trainer.model.config.vocab_size)
    loss, grads = loss_and_grads(trainer, inputs)

    model = trainer.model
    model.zero_grad()
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    length = inputs["completion_ids"].shape[1]
    logits = model(input_ids=input_ids, attention_mask=attention).logits[:, -length - 1:-1]
    expected = gtpo_loss(logits, inputs["completion_ids"], inputs["completion_mask"], inputs["advantages"],
                         group_size=G, config=config, temperature=0.7, initial_entropy=5.0)
    (expected.loss * (trainer.accelerator.num_processes if preset == "official" else 1)).backward()
    torch.testing.assert_close(loss, expected.loss.detach(), rtol=1e-5, atol=1e-7)
    assert_same_grads(grads, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
    assert trainer._metrics["train"]["gtpo/entropy"]  # logged through TRL's metrics


def test_grpo_preset_equals_trls_own_grpo_loss(tiny_model_dir, tmp_path):
    inputs = fixed_inputs(100)
    ours = make_trainer(tiny_model_dir, tmp_path / "gtpo", gtpo_config=GTPOConfig(preset="grpo"))
    theirs = make_trainer(tiny_model_dir, tmp_path / "grpo", cls=trl.GRPOTrainer, trl_args={"loss_type": "grpo"})
    loss_a, grads_a = loss_and_grads(ours, {k: v for k, v in inputs.items() if not k.startswith("gtpo_")})
    loss_b, grads_b = loss_and_grads(theirs, {k: v for k, v in inputs.items() if not k.startswith("gtpo_")})
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=1e-7)
    assert_same_grads(grads_a, grads_b, rtol=1e-4)


@pytest.mark.parametrize("reduction", ["sequence_mean", "token_mean"])
def test_slices_through_groups_accumulate_to_the_whole_batch(tiny_model_dir, tmp_path, reduction):
    """TRL shuffles the generation batch and splits it into steps_per_generation slices, one per
    accumulation step: the accumulated gradient equals the whole batch's."""
    config = GTPOConfig(loss_reduction=reduction)
    inputs = fixed_inputs(100, seed=3)
    whole = make_trainer(tiny_model_dir, tmp_path / "whole", gtpo_config=config)
    whole._gtpo_initial_entropy = 5.0
    loss_whole, grads_whole = loss_and_grads(whole, inputs)

    sliced = make_trainer(tiny_model_dir, tmp_path / "sliced", steps_per_generation=3, accumulation=3,
                          gtpo_config=config)
    sliced._gtpo_initial_entropy = 5.0
    sliced.model.train()
    order = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    total = 0.0
    sliced.model.zero_grad()
    for rows in order.chunk(3):  # 4 rows each: every slice cuts through prompt groups
        part = {k: (v if k == "num_items_in_batch" else v[rows]) for k, v in inputs.items()}
        loss = sliced.compute_loss(sliced.model, part)
        loss.backward()
        total = total + loss.detach()
    torch.testing.assert_close(total, loss_whole, rtol=1e-5, atol=1e-7)
    assert_same_grads({k: p.grad for k, p in sliced.model.named_parameters() if p.grad is not None}, grads_whole)


def test_settings_that_disagree_are_refused(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="beta=0.1.*kl_beta=0.0"):
        make_trainer(tiny_model_dir, tmp_path, trl_args={"beta": 0.1})
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        make_trainer(tiny_model_dir, tmp_path, trl_args={"top_entropy_quantile": 0.2})


def test_two_training_steps_log_gtpo_metrics(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, trl_args={"max_steps": 2}, steps_per_generation=2, accumulation=2)
    trainer.train()
    logged = [row for row in trainer.state.log_history if "gtpo/entropy" in row]
    assert len(logged) == 2
    assert trainer._gtpo_initial_entropy is not None and trainer._gtpo_initial_entropy > 0
    for key in ("gtpo/filtered_fraction", "gtpo/signal_fraction", "gtpo/amplified_fraction", "reward"):
        assert key in logged[0], key
