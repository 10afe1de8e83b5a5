"""`GTPOTrainer(..., gtpo_config=from_grpo_config(args))` against TRL's own `GRPOTrainer` through TRL's own training
loop (`trainer.train()`: generation, scoring, its split into micro-batches, accumulation, the optimiser): every
micro-batch's loss and the accumulated gradient after it, to 1e-5, in the settings TRL's own GRPO tests exercise.
Skipped without the ``trl`` extra."""

import pytest
import torch

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")

from gtpo_kernels.integrations.trl import GTPOTrainer  # noqa: E402
from gtpo_kernels.integrations.trl_settings import from_grpo_config  # noqa: E402

from .test_trl import make_trainer  # noqa: E402

EOS = 2  # the tiny model's <|im_end|>
# A bias on EOS while sampling: completions of every length from 1 to max_completion_length (the tiny random
# model would otherwise almost never stop).
UNEVEN = {"generation_kwargs": {"sequence_bias": [[[EOS], 1.5]]}}


def run(cls, model_dir, tmp_path, spg=1, accumulation=1, peft_config=None, **trl_args):
    """Trains ``cls`` for ``max_steps`` through TRL's loop; returns ``(losses, gradient norms, log history)``: each
    micro-batch's loss, and the norm of the gradient accumulated so far after each micro-batch's backward."""
    settings = {"max_steps": 2, "per_device_train_batch_size": 12 // spg, **trl_args}
    kwargs = {} if peft_config is None else {"peft_config": peft_config}
    if cls is GTPOTrainer:
        args = make_trainer(model_dir, tmp_path / "args", trl.GRPOTrainer, spg, accumulation, trl_args=settings).args
        kwargs["gtpo_config"] = from_grpo_config(args)
    trainer = make_trainer(model_dir, tmp_path / cls.__name__, cls, spg, accumulation, trl_args=settings, **kwargs)
    losses, norms = [], []
    compute_loss, training_step = trainer.compute_loss, trainer.training_step

    def recorded_loss(model, inputs, *args, **kw):
        loss = compute_loss(model, inputs, *args, **kw)
        losses.append(float(loss.detach()))
        return loss

    def recorded_step(*args, **kw):
        out = training_step(*args, **kw)
        grads = [p.grad.detach().double().norm() for p in trainer.model.parameters() if p.grad is not None]
        norms.append(float(torch.stack(grads).norm()) if grads else 0.0)
        return out

    trainer.compute_loss, trainer.training_step = recorded_loss, recorded_step
    transformers.set_seed(0)  # the same generations for both trainers
    trainer.train()
    return losses, norms, trainer.state.log_history, trainer


def assert_same_run(ours, theirs, rtol=1e-5):
    """Micro-batch by micro-batch: the losses and the accumulated gradients' norms."""
    (loss_a, norm_a), (loss_b, norm_b) = ours[:2], theirs[:2]
    assert len(loss_a) == len(loss_b) > 0 and len(norm_a) == len(norm_b)
    scale = max(abs(v) for v in loss_b) or 1.0
    for k, (a, b) in enumerate(zip(loss_a, loss_b)):
        assert abs(a - b) <= rtol * scale, (k, loss_a, loss_b)
    for k, (a, b) in enumerate(zip(norm_a, norm_b)):
        assert abs(a - b) <= rtol * max(abs(b), 1e-12), (k, norm_a, norm_b)


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo", "grpo"])
def test_a_step_whose_completions_are_all_truncated_is_a_zero_step(tiny_model_dir, tmp_path, loss_type):
    """mask_truncated_completions with every completion at max_completion_length (EOS never sampled): GRPOTrainer
    clamps the token count at 1 and takes a zero step; so does GTPOTrainer, and the run goes on (it crashed on a
    token count of 0); a warning says that those steps train nothing."""
    settings = dict(mask_truncated_completions=True, loss_type=loss_type)
    settings["generation_kwargs"] = {"suppress_tokens": [EOS]}
    theirs = run(trl.GRPOTrainer, tiny_model_dir, tmp_path, **settings)
    with pytest.warns(RuntimeWarning, match="every completion since the last log was masked"):
        ours = run(GTPOTrainer, tiny_model_dir, tmp_path, **settings)
    assert ours[0] == theirs[0] == [0.0, 0.0] and ours[1] == theirs[1] == [0.0, 0.0]
    start = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    for name, value in ours[3].model.state_dict().items():
        torch.testing.assert_close(value, start[name], rtol=0, atol=0, msg=name)  # a zero step moves nothing


@pytest.mark.parametrize("adaptive", [False, True], ids=["static", "adaptive"])
def test_policy_loss_is_logged_beside_the_entropy_bonus(tiny_model_dir, tmp_path, adaptive):
    """TRL logs ``policy_loss`` (the loss without the bonus) beside its entropy bonus: GTPOTrainer logs the same
    values, log by log, and its loss equals GRPOTrainer's micro-batch by micro-batch."""
    settings = {**UNEVEN, "entropy_coef": 0.05, "loss_type": "dapo"}
    if adaptive:
        settings.update(use_adaptive_entropy=True, entropy_target=10.0)  # below the target: the bonus applies
    theirs = run(trl.GRPOTrainer, tiny_model_dir, tmp_path, **settings)
    ours = run(GTPOTrainer, tiny_model_dir, tmp_path, **settings)
    assert_same_run(ours, theirs)
    logged_a = [row["policy_loss"] for row in ours[2] if "policy_loss" in row]
    logged_b = [row["policy_loss"] for row in theirs[2] if "policy_loss" in row]
    assert len(logged_a) == len(logged_b) == 2
    for a, b in zip(logged_a, logged_b):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-7)
    assert any(abs(b) > 1e-4 for b in logged_b)


def test_a_head_kept_trainable_under_peft_trains_as_grpo_trainer(tiny_model_dir, tmp_path):
    """LoRA on the attention with ``modules_to_save=["lm_head"]``: PEFT wraps the head (ModulesToSaveWrapper); the
    fused loss uses the wrapped copy's weight, trains it, and matches GRPOTrainer micro-batch by micro-batch."""
    peft = pytest.importorskip("peft")
    config = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
    theirs = run(trl.GRPOTrainer, tiny_model_dir, tmp_path, peft_config=peft.LoraConfig(**config), **UNEVEN)
    ours = run(GTPOTrainer, tiny_model_dir, tmp_path, peft_config=peft.LoraConfig(**config), **UNEVEN)
    assert_same_run(ours, theirs)
    heads = [
        dict(t.model.named_parameters())["base_model.model.lm_head.modules_to_save.default.weight"]
        for t in (ours[3], theirs[3])
    ]
    start = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).lm_head.weight
    assert not torch.equal(heads[0], start)  # trained
    torch.testing.assert_close(heads[0], heads[1], rtol=0, atol=1e-6)


def test_a_lora_adapter_on_the_head_is_refused_in_one_line(tiny_model_dir, tmp_path):
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match=r"lm_head.*target_modules"):  # TRL's own refusal, before the loss's
        run(GTPOTrainer, tiny_model_dir, tmp_path, peft_config=lora, max_steps=1)
    # Outside TRL (the lean trainer, a user's loop): the head check says the same in its own words.
    from gtpo_kernels.hf import causal_lm_hidden_states

    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir), lora)
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(ValueError, match=r"lm_head.*carries a LoRA adapter.*modules_to_save=\['lm_head'\]"):
        causal_lm_hidden_states(model, ids, torch.ones_like(ids))


@pytest.mark.parametrize("accumulation", [3, 2])
@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "grpo"])
def test_steps_per_generation_over_accumulation_trains_as_grpo_trainer(
    tiny_model_dir, tmp_path, accumulation, loss_type
):
    """steps_per_generation 4 over gradient_accumulation_steps 3 (windows spanning generation batches: refused
    before) and 2, completions of uneven length: TRL divides each micro-batch of its token means by the generation
    batch's tokens x accumulation / steps_per_generation, and from_grpo_config's loss does too (it divided by each
    window's exact count, 2.6-7.7 % off in the gradient); micro-batch by micro-batch to 1e-5."""
    settings = {**UNEVEN, "loss_type": loss_type, "max_steps": 3}
    theirs = run(trl.GRPOTrainer, tiny_model_dir, tmp_path, spg=4, accumulation=accumulation, **settings)
    ours = run(GTPOTrainer, tiny_model_dir, tmp_path, spg=4, accumulation=accumulation, **settings)
    assert len(ours[0]) > 4  # past the first generation batch's 4 micro-batches
    assert_same_run(ours, theirs)
