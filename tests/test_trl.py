"""`GTPOTrainer` (TRL's GRPOTrainer with the GTPO loss) on a tiny Llama, on the CPU. Skipped without the
``trl`` extra (``pip install -e ".[trl]"``); CI installs it."""

import math

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
    settings = dict(
        per_device_train_batch_size=4 * G // steps_per_generation, max_completion_length=6, max_steps=1, bf16=False
    )
    settings.update(kwargs.pop("trl_args", {}))
    args = trl.GRPOConfig(
        output_dir=str(tmp_path),
        steps_per_generation=steps_per_generation,
        gradient_accumulation_steps=accumulation,
        num_generations=G,
        temperature=0.7,
        report_to="none",
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        **settings,
    )
    data = Dataset.from_dict({"prompt": ["1+2?", "3+4?", "5+6?", "7+8?", "2+2?", "9+1?"]})
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    trainer = cls(
        model=model,
        reward_funcs=[reward_length],
        args=args,
        train_dataset=data,
        processing_class=transformers.AutoTokenizer.from_pretrained(model_dir),
        **kwargs,
    )
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
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages,
        "num_items_in_batch": completion_mask.sum().float(),
    }
    if with_conflict:
        inputs["gtpo_lambda"], inputs["gtpo_n_conflict"] = conflict_weights(
            completion_ids, completion_mask, advantages, G
        )
    return inputs


def completion_logits(model, inputs):
    """``[B, L, V]``: the model's logits that predict each completion token of ``inputs``."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    length = inputs["completion_ids"].shape[1]
    return model(input_ids=ids, attention_mask=attention).logits[:, -length - 1 : -1]


def loss_and_grads(trainer, inputs):
    trainer.model.train()
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in trainer.model.named_parameters() if p.grad is not None}


def assert_same_grads(a, b, rtol=1e-5, at_least=6):
    assert a.keys() == b.keys() and len(a) >= at_least
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=rtol * float(b[k].abs().max()), msg=k)


def assert_equals_loss_on_the_logits(trainer, config, temperature=0.7):
    """The trainer's loss and gradient on a fixed batch equal `gtpo_loss` on the model's own logits (``temperature``
    a tensor: each completion's, as the batch's ``gtpo_temperature``)."""
    trainer._gtpo_initial_entropy = 5.0
    inputs = fixed_inputs(trainer.model.config.vocab_size)
    if isinstance(temperature, torch.Tensor):
        inputs["gtpo_temperature"] = temperature
    loss, grads = loss_and_grads(trainer, inputs)
    model = trainer.model
    model.zero_grad()
    expected = gtpo_loss(
        completion_logits(model, inputs),
        inputs["completion_ids"],
        inputs["completion_mask"],
        inputs["advantages"],
        group_size=G,
        config=config,
        temperature=temperature,
        initial_entropy=5.0,
    )
    # a sum over completions is over every process's (one here)
    (expected.loss * (trainer.accelerator.num_processes if config.loss_reduction == "sum" else 1)).backward()
    torch.testing.assert_close(loss, expected.loss.detach(), rtol=1e-5, atol=1e-7)
    assert any(g.abs().max() > 0 for g in grads.values())  # a gradient to compare, not zeros on both sides
    assert_same_grads(grads, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})


# The official preset without its entropy filter: the tiny random model's completions are all above the filter's
# 0.7 nats, which would leave no gradient to compare (the conflict weights and the entropy shaping still act).
OFFICIAL_UNFILTERED = GTPOConfig(preset="official", entropy_threshold=math.inf)


def with_old_and_ref_logprobs(trainer, inputs, seed, spread=0.3, old_above=False, ref=True):
    """``inputs`` with old (and reference) log-probs off the trainer's model's own, so that ratios are off 1
    (some clipped) and the KL is non-zero."""
    with torch.no_grad():
        logits = completion_logits(trainer.model, inputs) / 0.7
        logp = torch.log_softmax(logits.float(), -1).gather(-1, inputs["completion_ids"][..., None]).squeeze(-1)
    shift = torch.randn(logp.shape, generator=torch.Generator().manual_seed(seed)) * spread
    if old_above:
        shift = shift.abs() + 0.2  # ratio below 0.8 (low-clipped) on most tokens, not all
    inputs = dict(inputs, old_per_token_logps=logp + shift)
    if ref:
        inputs["ref_per_token_logps"] = logp - shift / 2
    return inputs


def test_per_completion_temperatures_from_the_batch(tiny_model_dir, tmp_path):
    """A rollout that samples each completion at its own temperature hands them over as the batch's
    ``gtpo_temperature [B]``: the loss is `gtpo_loss` at those temperatures, and the statistics pass takes them."""
    trainer = make_trainer(tiny_model_dir, tmp_path, gtpo_config=OFFICIAL_UNFILTERED)
    n = fixed_inputs(trainer.model.config.vocab_size)["completion_ids"].shape[0]
    temperature = torch.linspace(0.5, 1.4, n)
    assert_equals_loss_on_the_logits(trainer, OFFICIAL_UNFILTERED, temperature=temperature)
    inputs = fixed_inputs(trainer.model.config.vocab_size)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    length = inputs["completion_ids"].shape[1]
    logp, _, _ = trainer._get_per_token_logps_and_entropies(
        trainer.model, ids, attention, length, batch_size=3, gtpo_temperature=temperature
    )
    with torch.no_grad():
        logits = completion_logits(trainer.model, inputs).float() / temperature[:, None, None]
    expected = torch.log_softmax(logits, -1).gather(-1, inputs["completion_ids"][..., None]).squeeze(-1)
    valid = inputs["completion_mask"].bool()
    torch.testing.assert_close(logp[valid], expected[valid], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("preset", ["paper", "official"])
def test_loss_equals_gtpo_loss_on_the_logits(tiny_model_dir, tmp_path, preset):
    config = GTPOConfig(preset=preset) if preset == "paper" else OFFICIAL_UNFILTERED
    trainer = make_trainer(tiny_model_dir, tmp_path, gtpo_config=config)
    assert_equals_loss_on_the_logits(trainer, config)
    trainer._flush_gtpo_metrics("train")  # what TRL's log() does first
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

    sliced = make_trainer(
        tiny_model_dir, tmp_path / "sliced", steps_per_generation=3, accumulation=3, gtpo_config=config
    )
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
    with pytest.raises(ValueError, match="top_entropy_quantile=0.2.*contradicts"):
        make_trainer(
            tiny_model_dir,
            tmp_path,
            trl_args={"top_entropy_quantile": 0.2},
            gtpo_config=GTPOConfig(top_entropy_quantile=0.5),
        )


def test_two_training_steps_log_gtpo_metrics(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, trl_args={"max_steps": 2}, steps_per_generation=2, accumulation=2)
    trainer.train()
    logged = [row for row in trainer.state.log_history if "gtpo/entropy" in row]
    assert len(logged) == 2
    assert trainer._gtpo_initial_entropy is not None and trainer._gtpo_initial_entropy > 0
    for key in ("gtpo/filtered_fraction", "gtpo/signal_fraction", "gtpo/amplified_fraction", "reward"):
        assert key in logged[0], key


# ---- exact optimiser-step counts, tool masks, metrics without per-call syncs --------------------------------


def window_slices(trainer, inputs, steps_per_generation, seed=0):
    """TRL's split of a generation batch: shuffled rows, ``steps_per_generation`` slices, then the window counts."""
    n = inputs["completion_ids"].shape[0]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    slices = [
        {k: (v if k == "num_items_in_batch" else v[rows]) for k, v in inputs.items()}
        for rows in order.chunk(steps_per_generation)
    ]
    trainer.attach_window_counts(slices)
    return slices


@pytest.mark.parametrize("spg, accumulation", [(2, 1), (2, 2), (4, 2)])
@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean"])
def test_slices_of_one_optimiser_step_add_up_to_its_loss(tiny_model_dir, tmp_path, spg, accumulation, reduction):
    """One generation batch, several optimiser steps (steps_per_generation > gradient_accumulation_steps):
    each step's slices add up to the loss of that step's rows alone, with uneven completion lengths (a
    slice can hold more tokens than the generation batch's average, which the earlier normaliser assumed)."""
    config = GTPOConfig(loss_reduction=reduction)
    inputs = fixed_inputs(100, n=4 * G, seed=4)
    inputs["completion_mask"][:, 1:] *= (torch.arange(4 * G) % 4 != 0).long()[:, None]  # some one-token rows
    trainer = make_trainer(
        tiny_model_dir,
        tmp_path,
        steps_per_generation=spg,
        accumulation=accumulation,
        gtpo_config=config,
        trl_args={"per_device_train_batch_size": 4 * G // spg},
    )
    trainer._gtpo_initial_entropy = 5.0
    trainer.model.train()
    slices = window_slices(trainer, inputs, spg)
    for window in range(spg // accumulation):
        parts = slices[window * accumulation : (window + 1) * accumulation]
        trainer.model.zero_grad()
        total = sum(trainer.compute_loss(trainer.model, part) for part in parts)  # no error: counts are exact
        whole_rows = {
            k: (torch.cat([p[k] for p in parts]) if k != "num_items_in_batch" else v) for k, v in parts[0].items()
        }
        whole = make_trainer(tiny_model_dir, tmp_path / f"whole{window}", gtpo_config=config)
        whole._gtpo_initial_entropy = 5.0
        whole.model.train()
        whole_rows.pop("gtpo_window_tokens")
        whole_rows["num_items_in_batch"] = _tokens(whole_rows)
        expected = whole.compute_loss(whole.model, whole_rows)
        torch.testing.assert_close(total.detach(), expected.detach(), rtol=1e-5, atol=1e-7)


def _tokens(inputs):
    return inputs["completion_mask"].sum().float()


def test_two_processes_windows_are_exact(tiny_model_dir, tmp_path, monkeypatch):
    """Two processes, emulated: each process's window count is the all-reduced sum over both, divided by 2,
    so DDP's average of the two processes' losses is the loss of the window's rows of both."""
    config = GTPOConfig(loss_reduction="token_mean")
    batches = [fixed_inputs(100, n=4 * G, seed=s) for s in (5, 6)]
    batches[1]["completion_mask"][:, 2:] = 0  # process 1's completions are much shorter
    trainers = [
        make_trainer(
            tiny_model_dir,
            tmp_path / f"p{p}",
            steps_per_generation=2,
            accumulation=1,
            gtpo_config=config,
            trl_args={"per_device_train_batch_size": 2 * G},
        )
        for p in (0, 1)
    ]
    # Per-window tokens of each process, in the order TRL feeds them: what the all-reduce adds up.
    local = []
    for trainer, inputs in zip(trainers, batches):
        trainer._gtpo_initial_entropy = 5.0
        trainer.model.train()
        order = torch.randperm(4 * G, generator=torch.Generator().manual_seed(0))
        local.append(torch.stack([inputs["completion_mask"][rows].sum() for rows in order.chunk(2)]).double())
    total = local[0] + local[1]
    accelerator = type(trainers[0].accelerator)
    monkeypatch.setattr(accelerator, "num_processes", property(lambda self: 2))
    monkeypatch.setattr(accelerator, "reduce", lambda self, tensor, reduction="sum": total.to(tensor.dtype))
    slices = [window_slices(trainer, inputs, 2) for trainer, inputs in zip(trainers, batches)]
    for window in range(2):
        ddp = sum(t.compute_loss(t.model, s[window]).detach() for t, s in zip(trainers, slices)) / 2
        rows = [s[window] for s in slices]
        logits_of = [completion_logits(trainer.model, part) for trainer, part in zip(trainers, rows)]
        cat = lambda key, rows=rows: torch.cat([p[key] for p in rows])
        expected = gtpo_loss(
            torch.cat(logits_of),
            cat("completion_ids"),
            cat("completion_mask"),
            cat("advantages"),
            config=config,
            conflict=(cat("gtpo_lambda"), cat("gtpo_n_conflict")),
            temperature=0.7,
            initial_entropy=5.0,
        )
        torch.testing.assert_close(ddp, expected.loss.detach(), rtol=1e-5, atol=1e-7)


def test_tool_mask_takes_tool_outputs_out_of_the_loss(tiny_model_dir, tmp_path):
    """TRL's tool_mask leaves holes inside completions: those tokens take no part in the loss; the conflict
    weights are those of the completions as generated (computed at scoring time on completion_mask)."""
    config = OFFICIAL_UNFILTERED
    trainer = make_trainer(tiny_model_dir, tmp_path, gtpo_config=config)
    inputs = fixed_inputs(trainer.model.config.vocab_size, seed=7)
    tool_mask = torch.ones_like(inputs["completion_mask"])
    tool_mask[::2, 1:3] = 0
    inputs["tool_mask"] = tool_mask
    loss, grads = loss_and_grads(trainer, inputs)
    model = trainer.model
    model.zero_grad()
    expected = gtpo_loss(
        completion_logits(model, inputs),
        inputs["completion_ids"],
        inputs["completion_mask"] * tool_mask,
        inputs["advantages"],
        config=config,
        temperature=0.7,
        conflict=conflict_weights(inputs["completion_ids"], inputs["completion_mask"], inputs["advantages"], G),
    )
    expected.loss.backward()
    torch.testing.assert_close(loss, expected.loss.detach(), rtol=1e-5, atol=1e-7)
    assert any(g.abs().max() > 0 for g in grads.values())
    assert_same_grads(grads, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})


def test_metrics_are_read_once_per_log(tiny_model_dir, tmp_path, monkeypatch):
    """The GTPO metrics of a loss call stay on the device (they used to be all-reduced and read field by
    field in every micro-batch); they are all-reduced and read once when TRL logs, for every call since."""
    from .test_host_syncs import HostReads

    trainer = make_trainer(tiny_model_dir, tmp_path)
    trainer._gtpo_initial_entropy = 5.0
    inputs = fixed_inputs(trainer.model.config.vocab_size)
    trainer.model.train()
    per_call = []
    record = trainer._log_gtpo_metrics

    def counted(metrics, mode):
        with HostReads(monkeypatch) as reads:
            record(metrics, mode)
        per_call.append(reads.count)

    monkeypatch.setattr(trainer, "_log_gtpo_metrics", counted)
    for _ in range(3):
        trainer.compute_loss(trainer.model, inputs)
    assert per_call == [0, 0, 0]
    with HostReads(monkeypatch) as reads:
        trainer._flush_gtpo_metrics("train")
    assert reads.count == 1
    assert len(trainer._metrics["train"]["gtpo/entropy"]) == 1


def test_more_generation_steps_than_accumulation_steps_train(tiny_model_dir, tmp_path):
    """The setting that stopped at the first step: one generation batch, two optimiser steps."""
    trainer = make_trainer(
        tiny_model_dir,
        tmp_path,
        steps_per_generation=2,
        accumulation=1,
        gtpo_config=GTPOConfig(loss_reduction="token_mean"),
        trl_args={"max_steps": 2, "per_device_train_batch_size": 2 * G, "max_completion_length": 8},
    )
    trainer.train()
    assert len([row for row in trainer.state.log_history if "gtpo/entropy" in row]) == 2


def test_moe_router_loss_is_added_as_grpo_trainer_adds_it(tiny_model_dir, tmp_path):
    """A Mixture-of-Experts policy: the decoder pass returns its router logits and the router load-balancing loss is
    added as TRL adds it (it was refused before): from_grpo_config equals GRPOTrainer in loss and gradient, the
    router's own weights included, and TRL's aux_loss metric; with router_aux_loss_coef=0.0 the loss is without it."""
    from gtpo_kernels.integrations.trl_settings import from_grpo_config

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    config = transformers.Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        router_aux_loss_coef=0.5,
    )
    moe_dir = tmp_path / "moe"
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(moe_dir)
    tokenizer.save_pretrained(moe_dir)
    inputs = {k: v for k, v in fixed_inputs(len(tokenizer)).items() if not k.startswith("gtpo_")}
    theirs = make_trainer(str(moe_dir), tmp_path / "grpo", cls=trl.GRPOTrainer)
    ours = make_trainer(str(moe_dir), tmp_path / "gtpo", gtpo_config=from_grpo_config(theirs.args))
    assert ours.aux_loss_enabled and ours.router_aux_loss_coef == 0.5
    inputs = with_old_and_ref_logprobs(theirs, inputs, seed=9, ref=False)
    loss_a, grads_a = loss_and_grads(ours, dict(inputs))
    loss_b, grads_b = loss_and_grads(theirs, dict(inputs))
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=1e-7)
    assert_same_grads(grads_a, grads_b, rtol=1e-4)
    assert ours._metrics["train"]["aux_loss"] == pytest.approx(theirs._metrics["train"]["aux_loss"], rel=1e-5)
    without = make_trainer(
        str(moe_dir),
        tmp_path / "off",
        gtpo_config=from_grpo_config(theirs.args),
        trl_args={"router_aux_loss_coef": 0.0},
    )
    assert not without.aux_loss_enabled
    loss_c, _ = loss_and_grads(without, dict(inputs))
    assert float(loss_a - loss_c) == pytest.approx(0.5 * ours._metrics["train"]["aux_loss"][0], rel=1e-4)


def test_every_grpo_config_field_is_classified():
    """A field of the installed TRL's GRPOConfig that the settings table does not classify fails here, so that
    a new TRL release cannot add a setting GTPOTrainer ignores silently; the docs table is the generated one."""
    import pathlib

    from gtpo_kernels.integrations import trl_settings

    assert trl_settings.unclassified() == []
    assert {s.status for s in trl_settings.SETTINGS.values()} <= {
        trl_settings.HONOURED,
        trl_settings.IRRELEVANT,
        trl_settings.REFUSED,
    }
    # No loss setting of TRL's is refused (8 were): a value is refused only when it contradicts the GTPO config.
    assert [name for name, s in trl_settings.SETTINGS.items() if s.status == trl_settings.REFUSED] == []
    model_checked = {"router_aux_loss_coef"}  # refused by GTPOTrainer from the model (MoE with a router loss)
    assert all(
        s.refuse is not None or name in model_checked
        for name, s in trl_settings.SETTINGS.items()
        if s.status == trl_settings.REFUSED
    )
    docs = pathlib.Path(__file__).resolve().parents[1] / "docs" / "trl-settings.md"
    assert docs.read_text() == trl_settings.markdown(), "regenerate: python -m gtpo_kernels.integrations.trl_settings"


@pytest.mark.parametrize(
    "trl_args,gtpo,match",
    [
        (
            {"beta": 0.1},
            {"kl_beta": 0.1},
            r"use_bias_correction_kl=True\): contradicts "
            r"GTPOConfig\(kl_ratio_weighted=False\)",
        ),
        ({"beta": 0.1}, {"kl_beta": 0.1, "kl_ratio_weighted": True}, None),
        ({"entropy_coef": 0.1}, {}, None),  # TRL's bonus, taken into the GTPO config
        (
            {"entropy_coef": 0.1},
            {"entropy_bonus": 0.2},
            r"entropy_coef=0.1\): contradicts GTPOConfig\(entropy_bonus=0.2\)",
        ),
        ({}, {"entropy_bonus": 0.2}, None),  # a bonus of the GTPO config's own beside TRL's default (none)
        ({"use_adaptive_entropy": True}, {}, None),  # TRL's controller drives the bonus
        ({"use_adaptive_entropy": True}, {"entropy_bonus": 0.1}, r"use_adaptive_entropy=True\): TRL's adaptive"),
        ({"top_entropy_quantile": 0.8}, {}, None),  # TRL's mask, taken into the GTPO config
        (
            {"top_entropy_quantile": 0.8},
            {"top_entropy_quantile": 0.5},
            r"top_entropy_quantile=0.8\): contradicts GTPOConfig\(top_entropy_quantile=0.5\)",
        ),
        ({"delta": 1.5}, {}, r"delta=1.5\): contradicts GTPOConfig\(ratio_cap=None\)"),
        ({"delta": 1.5}, {"ratio_cap": 1.5}, None),
        (
            {"loss_type": "dr_grpo"},
            {},
            r"loss_type='dr_grpo'\): contradicts "
            r"GTPOConfig\(loss_reduction='sequence_mean', ratio_function='clip'\) \(preset 'paper'\)",
        ),
        ({"loss_type": "grpo"}, {}, None),  # TRL's 'grpo' normalisation is the paper preset's sequence_mean
        (
            {"loss_type": "vespo"},
            {"preset": "grpo"},
            r"loss_type='vespo'\): contradicts GTPOConfig\(loss_reduction='sequence_mean', ratio_function='clip'\)",
        ),
        (
            {"loss_type": "grpo"},
            {"preset": "official"},
            r"loss_type='grpo'\): contradicts "
            r"GTPOConfig\(loss_reduction='sum', ratio_function='clip'\) \(preset 'official'\)",
        ),
        ({"epsilon": 0.3}, {}, r"epsilon=0.3\): contradicts GTPOConfig\(clip_eps_low=None\) \(preset 'paper'\)"),
        (
            {"epsilon_high": 0.28},
            {"preset": "grpo"},
            r"epsilon_high=0.28\): contradicts GTPOConfig\(clip_eps_high=0.2\)",
        ),
        ({"scale_rewards": "batch"}, {"preset": "grpo"}, None),  # the batch's std: TRL's, when the config normalises
        ({"scale_rewards": "batch"}, {}, r"scale_rewards='batch'\): contradicts GTPOConfig\(normalize_advantages"),
        ({"scale_rewards": "group"}, {}, None),  # TRL's default: set from the preset, not a user's choice
        (
            {"scale_rewards": "none"},
            {"preset": "grpo"},
            r"scale_rewards='none'\): contradicts "
            r"GTPOConfig\(normalize_advantages_by_std=True\)",
        ),
        ({"beta": 0.1, "use_bias_correction_kl": False}, {"kl_beta": 0.1}, None),
        ({"loss_type": "grpo", "epsilon": 0.2}, {"preset": "grpo"}, None),
        ({"epsilon": 0.3, "epsilon_high": 0.3}, {"clip_eps_low": 0.3, "clip_eps_high": 0.3}, None),
    ],
)
def test_settings_the_loss_would_ignore_are_refused(tiny_model_dir, tmp_path, trl_args, gtpo, match):
    """Each of these values was ignored silently before (TRL's GRPOTrainer would have used it); now refused in
    one line naming the field, or accepted when it agrees with the GTPO config."""
    if match is None:
        make_trainer(tiny_model_dir, tmp_path, trl_args=trl_args, gtpo_config=GTPOConfig(**gtpo))
        return
    with pytest.raises(ValueError, match=match):
        make_trainer(tiny_model_dir, tmp_path, trl_args=trl_args, gtpo_config=GTPOConfig(**gtpo))


class StandInVLLM:
    """vLLM's generation (not installable here) as TRL's trainer calls it: for each prompt, fixed completions and
    the sampler's log-probs of their tokens, the trainer model's own (at TRL's temperature) off by noise, as vLLM's
    kernels and rounding make them, one of them unreported (None)."""

    def __init__(self, model, temperature, **kwargs):
        self.model, self.temperature = model, temperature

    def sync_weights(self):
        pass

    @torch.no_grad()
    def generate(self, prompts, images, num_generations, profiler):
        g = torch.Generator().manual_seed(len(prompts))
        vocab = self.model.config.vocab_size
        completions, logprobs = [], []
        for prompt in prompts[::num_generations]:  # the prompts come G times each; vLLM samples G of each once
            for _ in range(num_generations):
                ids = torch.randint(4, vocab, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
                sequence = torch.tensor([list(prompt) + ids])
                logits = self.model(input_ids=sequence).logits[0, len(prompt) - 1 : -1].float() / self.temperature
                own = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
                sampled = (own + 0.3 * torch.randn(own.shape, generator=g)).tolist()
                if len(completions) == 2:
                    sampled[0] = None
                completions.append(ids)
                logprobs.append([[lp] for lp in sampled])
        return prompts, completions, logprobs, None


def vllm_batch(trainer):
    """The batch TRL's scoring step makes from a (stand-in) vLLM generation: its old log-probs, the sampler's
    log-probs and TRL's importance-sampling ratio among the fields."""
    trainer.model.train()
    prompts = [{"prompt": p} for p in ["1+2?", "3+4?", "5+6?", "7+8?"] for _ in range(G)]
    return trainer._generate_and_score_completions(prompts)


@pytest.mark.parametrize(
    "trl_args",
    [
        {},  # TRL's defaults with vLLM: sequence_mask, clip_max 3
        {"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": 1.2},
        {"vllm_importance_sampling_mode": "token_mask", "vllm_importance_sampling_clip_min": 0.8},
        {"vllm_importance_sampling_mode": "sequence_truncate", "vllm_importance_sampling_clip_max": 1.1},
        {
            "loss_type": "grpo",
            "vllm_importance_sampling_mode": "sequence_mask",
            "vllm_importance_sampling_clip_max": 1.3,
        },
        {
            "loss_type": "sapo",
            "vllm_importance_sampling_mode": "token_truncate",
            "vllm_importance_sampling_clip_max": 1.2,
        },
        {"loss_type": "cispo", "epsilon_high": 1.1, "vllm_importance_sampling_mode": "sequence_truncate"},
        {"off_policy_mask_threshold": 0.01},  # against vLLM's log-probs
        {"loss_type": "vespo", "vllm_importance_sampling_mode": "token_truncate"},  # the weights inside phi
        {"scale_rewards": "batch"},  # TRL's batch-std advantages, made in its scoring step
    ],
    ids=[
        "defaults",
        "token_truncate",
        "token_mask",
        "sequence_truncate",
        "grpo-sequence_mask",
        "sapo",
        "cispo",
        "off-policy-mask",
        "vespo",
        "batch-std",
    ],
)
def test_vllm_importance_sampling_trains_as_grpo_trainer(tiny_model_dir, tmp_path, monkeypatch, trl_args):
    """``GRPOConfig(use_vllm=True)`` with TRL's defaults builds, and ``from_grpo_config(args)`` trains as
    GRPOTrainer does on the batch vLLM's path produces (loss and gradient), in each of TRL's four modes."""
    from trl.trainer import grpo_trainer

    from gtpo_kernels.integrations.trl_settings import from_grpo_config

    monkeypatch.setattr(grpo_trainer, "VLLMGeneration", StandInVLLM)
    settings = {"use_vllm": True, **trl_args}
    theirs = make_trainer(tiny_model_dir, tmp_path / "grpo", cls=trl.GRPOTrainer, trl_args=settings)
    ours = make_trainer(tiny_model_dir, tmp_path / "gtpo", gtpo_config=from_grpo_config(theirs.args), trl_args=settings)
    assert ours.gtpo_config.sampling_correction == theirs.args.vllm_importance_sampling_mode
    batch_a, batch_b = vllm_batch(ours), vllm_batch(theirs)
    ratio = batch_b["importance_sampling_ratio"]
    assert bool(((ratio - 1).abs() > 1e-3).any()), "the correction must change something on this batch"
    loss_a, grads_a = loss_and_grads(ours, batch_a)
    loss_b, grads_b = loss_and_grads(theirs, batch_b)
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=1e-7)
    assert_same_grads(grads_a, grads_b, rtol=1e-4)


def test_vllm_importance_sampling_applies_under_a_gtpo_preset(tiny_model_dir, tmp_path, monkeypatch):
    """The paper preset with vLLM: TRL's correction is taken into the GTPO config, and the loss equals
    gtpo_loss on the model's logits with the sampler's log-probs (the conflict weights and the entropy shift
    as the preset has them); without the correction it differs."""
    from trl.trainer import grpo_trainer

    monkeypatch.setattr(grpo_trainer, "VLLMGeneration", StandInVLLM)
    trainer = make_trainer(
        tiny_model_dir, tmp_path, gtpo_config=GTPOConfig(entropy_threshold=None), trl_args={"use_vllm": True}
    )
    config = trainer.gtpo_config
    assert (config.preset, config.sampling_correction, config.sampling_ratio_max) == ("paper", "sequence_mask", 3.0)
    batch = vllm_batch(trainer)
    loss, _ = loss_and_grads(trainer, batch)
    with torch.no_grad():
        common = dict(
            group_size=G,
            temperature=0.7,
            initial_entropy=trainer._gtpo_initial_entropy,
            old_logprobs=batch["old_per_token_logps"],
        )
        logits = completion_logits(trainer.model, batch)
        ids, mask, adv = batch["completion_ids"], batch["completion_mask"], batch["advantages"]
        expected = gtpo_loss(
            logits, ids, mask, adv, config=config, sampling_logprobs=batch["sampling_per_token_logps"], **common
        )
        uncorrected = gtpo_loss(logits, ids, mask, adv, config=config.replace(sampling_correction=None), **common)
    torch.testing.assert_close(loss, expected.loss, rtol=1e-5, atol=1e-7)
    assert abs(float(loss) - float(uncorrected.loss)) > 1e-4


def test_a_sampling_correction_without_vllm_or_against_trls_is_refused(tiny_model_dir, tmp_path, monkeypatch):
    from trl.trainer import grpo_trainer

    with pytest.raises(
        ValueError,
        match=r"vllm_importance_sampling_correction=True\): GTPOConfig\(sampling_correction='token_mask'\) needs",
    ):
        make_trainer(tiny_model_dir, tmp_path, gtpo_config=GTPOConfig(sampling_correction="token_mask"))
    monkeypatch.setattr(grpo_trainer, "VLLMGeneration", StandInVLLM)
    with pytest.raises(
        ValueError,
        match=r"correction is sampling_correction='sequence_mask' and GTPOConfig\(sampling_correction='token_mask'\)",
    ):
        make_trainer(
            tiny_model_dir,
            tmp_path,
            gtpo_config=GTPOConfig(sampling_correction="token_mask"),
            trl_args={"use_vllm": True},
        )


@pytest.mark.parametrize("all_negative", [False, True])
def test_trl_metrics_kept_and_equal_to_grpo_trainers(tiny_model_dir, tmp_path, all_negative):
    """TRL's own `entropy`, `kl` and `clip_ratio/*` metrics, from the kernels' statistics, equal GRPOTrainer's on
    the same off-policy batch (old log-probs shifted so that both clip sides engage; beta > 0 for the KL). With
    every advantage negative and the old log-probs above the new, every completion has low-clipped tokens, so
    that clip_ratio/low_min (the smallest per-completion fraction) is not 0."""
    inputs = {k: v for k, v in fixed_inputs(100).items() if not k.startswith("gtpo_")}
    if all_negative:
        inputs["advantages"] = -inputs["advantages"].abs() - 0.1
    ours = make_trainer(
        tiny_model_dir,
        tmp_path / "gtpo",
        gtpo_config=GTPOConfig(preset="grpo", kl_beta=0.05),
        trl_args={"beta": 0.05, "use_bias_correction_kl": False, "loss_type": "grpo"},
    )
    theirs = make_trainer(
        tiny_model_dir,
        tmp_path / "grpo",
        cls=trl.GRPOTrainer,
        trl_args={"beta": 0.05, "use_bias_correction_kl": False, "loss_type": "grpo"},
    )
    inputs = with_old_and_ref_logprobs(theirs, inputs, seed=3, spread=0.4, old_above=all_negative)
    for trainer in (ours, theirs):
        loss_and_grads(trainer, dict(inputs))
    ours._flush_gtpo_metrics("train")
    for name in (
        "entropy",
        "kl",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/region_mean",
        "clip_ratio/low_min",
        "clip_ratio/high_max",
    ):
        mine, trls = ours._metrics["train"][name], theirs._metrics["train"][name]
        assert len(mine) == 1 and len(trls) == 1, name
        assert mine[0] == pytest.approx(trls[0], rel=1e-5, abs=1e-7), name
    side = "clip_ratio/low_min" if all_negative else "clip_ratio/high_max"
    assert theirs._metrics["train"]["clip_ratio/low_mean"][0] > 0 and theirs._metrics["train"][side][0] > 0


@pytest.mark.parametrize(
    "trl_args,gtpo",
    [
        ({"delta": 1.1}, {"ratio_cap": 1.1}),
        ({"beta": 0.05, "use_bias_correction_kl": True}, {"kl_beta": 0.05, "kl_ratio_weighted": True}),
        ({"beta": 0.05, "use_bias_correction_kl": False, "delta": 1.15}, {"kl_beta": 0.05, "ratio_cap": 1.15}),
    ],
    ids=["delta", "bias_corrected_kl", "both"],
)
def test_delta_and_bias_corrected_kl_equal_grpo_trainer(tiny_model_dir, tmp_path, trl_args, gtpo):
    """TRL's two-sided clipping (delta) and ratio-weighted KL (use_bias_correction_kl), as GTPOConfig's ratio_cap
    and kl_ratio_weighted: the same loss and gradient as GRPOTrainer on one off-policy batch (loss_type='grpo',
    whose normalisation is the grpo preset's)."""
    inputs = {k: v for k, v in fixed_inputs(100).items() if not k.startswith("gtpo_")}
    settings = {"loss_type": "grpo", **trl_args}
    ours = make_trainer(
        tiny_model_dir, tmp_path / "gtpo", gtpo_config=GTPOConfig(preset="grpo", **gtpo), trl_args=settings
    )
    theirs = make_trainer(tiny_model_dir, tmp_path / "grpo", cls=trl.GRPOTrainer, trl_args=settings)
    inputs = with_old_and_ref_logprobs(theirs, inputs, seed=5, ref="beta" in trl_args)  # some ratios above delta
    loss_a, grads_a = loss_and_grads(ours, dict(inputs))
    loss_b, grads_b = loss_and_grads(theirs, dict(inputs))
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=1e-7)
    assert_same_grads(grads_a, grads_b, rtol=1e-4)


@pytest.mark.parametrize(
    "trl_args",
    [
        {},  # TRL's defaults: loss_type='dapo', epsilon 0.2, scale_rewards='group', beta 0
        {"loss_type": "grpo", "epsilon": 0.1, "epsilon_high": 0.3},
        {"loss_type": "dr_grpo", "beta": 0.04, "use_bias_correction_kl": True},
        {"loss_type": "dapo", "delta": 1.25, "beta": 0.04, "use_bias_correction_kl": False, "scale_rewards": "none"},
        {"loss_type": "cispo", "epsilon_high": 1.1},  # the cap bites on this batch
        {"loss_type": "cispo", "epsilon_high": 1.3, "beta": 0.04, "use_bias_correction_kl": True},
        {"loss_type": "sapo"},
        {"loss_type": "sapo", "sapo_temperature_pos": 0.5, "sapo_temperature_neg": 2.0, "beta": 0.04},
        {"entropy_coef": 0.05},  # TRL's static entropy bonus, on its default dapo
        {"loss_type": "grpo", "entropy_coef": 0.1, "beta": 0.04},
        {"off_policy_mask_threshold": 0.02},  # against the old log-probs (no vLLM)
        {"loss_type": "grpo", "importance_sampling_level": "sequence"},  # GSPO
        {"loss_type": "grpo", "importance_sampling_level": "sequence", "beta": 0.04, "use_bias_correction_kl": True},
        {"loss_type": "sapo", "importance_sampling_level": "sequence"},
        {"loss_type": "bnpo", "beta": 0.04, "use_bias_correction_kl": True},
        {"loss_type": "luspo", "importance_sampling_level": "sequence"},
        {"loss_type": "luspo", "beta": 0.04, "use_bias_correction_kl": False},
        {"loss_type": "vespo"},
        {"loss_type": "vespo", "vespo_k_pos": 1.0, "vespo_lambda_neg": 4.0, "beta": 0.04},
        {"top_entropy_quantile": 0.6},  # TRL's high-entropy tokens, on its default dapo
        {"loss_type": "grpo", "top_entropy_quantile": 0.3, "entropy_coef": 0.05, "beta": 0.04},
    ],
    ids=[
        "defaults",
        "grpo-asymmetric-clip",
        "dr_grpo-bias-corrected-kl",
        "dapo-delta-kl-unscaled",
        "cispo",
        "cispo-kl",
        "sapo",
        "sapo-temperatures-kl",
        "entropy-bonus",
        "grpo-entropy-bonus-kl",
        "off-policy-mask",
        "gspo",
        "gspo-bias-corrected-kl",
        "sapo-gspo",
        "bnpo-kl",
        "luspo-gspo",
        "luspo-kl",
        "vespo",
        "vespo-knobs-kl",
        "top-entropy",
        "grpo-top-entropy-bonus-kl",
    ],
)
def test_from_grpo_config_trains_as_grpo_trainer(tiny_model_dir, tmp_path, trl_args):
    """`from_grpo_config(args)`: GTPOTrainer with the GTPOConfig derived from TRL's settings equals GRPOTrainer
    (loss and gradient, one off-policy batch with reference log-probs), whatever TRL's loss settings say."""
    from gtpo_kernels.integrations.trl_settings import from_grpo_config

    inputs = {k: v for k, v in fixed_inputs(100).items() if not k.startswith("gtpo_")}
    # A slice of a generation batch with more tokens than it holds: the token means that read the generation
    # batch's count (dapo, cispo) and the one that reads the slice's own (bnpo) differ. (Not with TRL's entropy
    # bonus, whose mean is the micro-batch's own, where the GTPO loss's is the optimiser step's: they agree when
    # the micro-batches hold as many tokens, docs/trl.md.)
    if "entropy_coef" not in trl_args:
        inputs["num_items_in_batch"] = inputs["num_items_in_batch"] * 1.5
    theirs = make_trainer(tiny_model_dir, tmp_path / "grpo", cls=trl.GRPOTrainer, trl_args=trl_args)
    ours = make_trainer(tiny_model_dir, tmp_path / "gtpo", gtpo_config=from_grpo_config(theirs.args), trl_args=trl_args)
    assert ours.scale_rewards == theirs.scale_rewards
    inputs = with_old_and_ref_logprobs(theirs, inputs, seed=6, ref=bool(trl_args.get("beta")))
    loss_a, grads_a = loss_and_grads(ours, dict(inputs))
    loss_b, grads_b = loss_and_grads(theirs, dict(inputs))
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=1e-7)
    assert_same_grads(grads_a, grads_b, rtol=1e-4)
    # TRL's own metrics of the loss call, each the same number (those of docs/trl.md's "metrics" aside).
    ours._flush_gtpo_metrics("train")
    mine, trls = ours._metrics["train"], theirs._metrics["train"]
    # policy_loss beside a bonus on the top-entropy tokens only: not logged (docs/trl.md, "metrics").
    not_logged = {"policy_loss"} if trl_args.get("top_entropy_quantile", 1.0) < 1 else set()
    assert set(trls) - set(mine) <= not_logged, set(trls) - set(mine)
    for name in set(trls) & set(mine):
        assert mine[name] == pytest.approx(trls[name], rel=1e-5, abs=1e-7), name
    if trl_args.get("loss_type") == "cispo":
        assert mine["cispo_clip_ratio"][0] > 0 or trl_args["epsilon_high"] > 1.2  # the cap bites on this batch


@pytest.mark.parametrize("entropy", ["below target", "above target"])
def test_the_adaptive_entropy_bonus_trains_as_grpo_trainer(tiny_model_dir, tmp_path, entropy):
    """TRL's adaptive controller (use_adaptive_entropy): from the same controller state, the same loss and gradient
    as GRPOTrainer (the bonus applied when the last entropy was below the target, not above), and the same state
    after the step (coefficient moved up or down, the window's entropy)."""
    from gtpo_kernels.integrations.trl_settings import from_grpo_config

    settings = {
        "use_adaptive_entropy": True,
        "entropy_coef": 0.2,
        "entropy_target": 0.5 if entropy == "below target" else 50.0,
        "entropy_coef_delta": 0.05,
    }
    inputs = {k: v for k, v in fixed_inputs(100).items() if not k.startswith("gtpo_")}
    theirs = make_trainer(tiny_model_dir, tmp_path / "grpo", cls=trl.GRPOTrainer, trl_args=settings)
    ours = make_trainer(tiny_model_dir, tmp_path / "gtpo", gtpo_config=from_grpo_config(theirs.args), trl_args=settings)
    assert ours.gtpo_config.entropy_bonus == 0  # the controller sets it, call by call
    inputs = with_old_and_ref_logprobs(theirs, inputs, seed=8, ref=False)
    for trainer in (ours, theirs):
        trainer._last_world_entropy = 0.1  # below either target: the bonus applies on this step
    loss_a, grads_a = loss_and_grads(ours, dict(inputs))
    loss_b, grads_b = loss_and_grads(theirs, dict(inputs))
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=1e-7)
    assert_same_grads(grads_a, grads_b, rtol=1e-4)
    assert ours.entropy_coef == pytest.approx(theirs.entropy_coef) and ours.entropy_coef != 0.2
    assert ours._last_world_entropy == pytest.approx(theirs._last_world_entropy, rel=1e-5)
    assert ours._metrics["train"]["entropy_coef"] == pytest.approx(theirs._metrics["train"]["entropy_coef"])
    # The next step's gate: off after an entropy above the target, in both
    loss_a, _ = loss_and_grads(ours, dict(inputs))
    loss_b, _ = loss_and_grads(theirs, dict(inputs))
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=1e-7)


def test_a_float32_head_under_bf16_autocast_trains_as_grpo_trainer(tiny_model_dir, tmp_path):
    """``cast_lm_head_to_fp32=True`` under bf16 mixed precision: the fused head's GEMMs and statistics run in float32
    as TRL's head does, so the loss and gradient equal GRPOTrainer's (a bf16 head differs by 1.2e-2)."""
    from gtpo_kernels.integrations.trl_settings import from_grpo_config

    settings = {"loss_type": "grpo", "bf16": True, "cast_lm_head_to_fp32": True}
    inputs = {k: v for k, v in fixed_inputs(100).items() if not k.startswith("gtpo_")}
    theirs = make_trainer(tiny_model_dir, tmp_path / "grpo", cls=trl.GRPOTrainer, trl_args=settings)
    ours = make_trainer(tiny_model_dir, tmp_path / "gtpo", gtpo_config=from_grpo_config(theirs.args), trl_args=settings)
    assert ours.model.lm_head.weight.dtype == torch.float32
    inputs = with_old_and_ref_logprobs(theirs, inputs, seed=7, ref=False)
    with ours.accelerator.autocast():
        assert torch.is_autocast_enabled("cpu")  # the decoder runs in bf16, the head must not
    loss_a, grads_a = loss_and_grads(ours, dict(inputs))
    loss_b, grads_b = loss_and_grads(theirs, dict(inputs))
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=1e-7)
    # The head and the final norm, in float32 from the head's gradient: float32's bar (5e-7 measured; a bf16 head, the
    # bug this guards against, is 1.2e-2 off in the gradients and 2.9e-4 in the loss). The decoder's own backward runs
    # in bf16: on a CPU without bf16 units (an AMD EPYC without AVX-512 BF16, 2026-12-02) its first layer's attention
    # differs by up to 3.1e-3 of the largest entry between two runs that hand it bitwise the same gradient (the second
    # layer's gradients are equal), so the decoder's parameters are held to bf16's resolution, 2^-8, still 3x below
    # the bug.
    head = ("lm_head.weight", "model.norm.weight")
    assert_same_grads({k: grads_a[k] for k in head}, {k: grads_b[k] for k in head}, rtol=1e-5, at_least=2)
    decoder_a, decoder_b = ({k: v for k, v in g.items() if k not in head} for g in (grads_a, grads_b))
    assert_same_grads(decoder_a, decoder_b, rtol=2.0**-8)


def test_from_grpo_config_expresses_every_loss_type():
    """Every loss_type the installed TRL knows has a GTPO counterpart (a new one in a TRL release fails here)."""
    import dataclasses
    import re

    from gtpo_kernels.integrations.trl_settings import LOSS_TYPES, from_grpo_config

    field = {f.name: f for f in dataclasses.fields(trl.GRPOConfig)}["loss_type"]
    supported = field.metadata["help"].split("Supported values are", 1)[1].split(".", 1)[0]
    known = set(re.findall(r"'(\w+)'", supported))  # the help text's list: 'grpo', 'dr_grpo', ... and 'vespo'
    assert len(known) >= 8 and known <= set(LOSS_TYPES), sorted(known - set(LOSS_TYPES))
    for loss_type in sorted(LOSS_TYPES):
        args = trl.GRPOConfig(output_dir="unused", report_to="none", use_cpu=True, loss_type=loss_type)
        reduction, ratio_function = LOSS_TYPES[loss_type]
        config = from_grpo_config(args)
        assert (config.loss_reduction, config.ratio_function) == (reduction, ratio_function)


@pytest.mark.parametrize("family", ["gemma2-softcap", "granite-scaled"])
def test_transformed_logits_take_the_fused_path(tiny_model_dir, tmp_path, family, caplog, monkeypatch):
    """A policy that soft-caps (Gemma 2) or scales (Granite) its logits hands its transform to the fused walk, which
    applies it to each chunk's logits (several chunks here): loss and gradient equal gtpo_loss on
    model(...).logits, with one info line saying so."""
    import logging

    from gtpo_kernels import fused_chunks

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    if family == "gemma2-softcap":
        config = transformers.Gemma2Config(head_dim=8, final_logit_softcapping=3.0, **common)
        model = transformers.Gemma2ForCausalLM(config)
    else:
        config = transformers.GraniteConfig(logits_scaling=4.0, **common)
        model = transformers.GraniteForCausalLM(config)
    model_dir = tmp_path / family
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    gtpo = OFFICIAL_UNFILTERED.replace(max_chunk_bytes=4 * 6 * len(tokenizer) * 4)  # 24 tokens of logits a chunk
    with caplog.at_level(logging.INFO, logger="gtpo_kernels.integrations.trl"):
        trainer = make_trainer(str(model_dir), tmp_path, gtpo_config=gtpo)
    assert any("apply it to each chunk's logits" in r.message for r in caplog.records)
    chunks, real = [], fused_chunks.chunk_logits
    monkeypatch.setattr(fused_chunks, "chunk_logits", lambda *a: chunks.append(a[0].shape[0]) or real(*a))
    assert_equals_loss_on_the_logits(trainer, gtpo)
    assert len(chunks) >= 2, chunks  # 41 tokens: 2 chunks scaled, 4 soft-capped (half the tokens a chunk)


def test_a_reference_model_under_trls_default_bf16_is_accepted(tiny_model_dir, tmp_path):
    """With beta > 0 TRL prepares the reference model at construction, and under its default bf16 accelerate runs
    that model's forward in autocast. The head check compared that bf16 forward with its own float32 one and
    refused every model (found by trying beta > 0 with TRL's defaults); one training step now runs."""
    trainer = make_trainer(
        tiny_model_dir,
        tmp_path,
        gtpo_config=GTPOConfig(kl_beta=0.04, kl_ratio_weighted=True),
        trl_args={"beta": 0.04, "bf16": True},
    )
    assert trainer.ref_model is not None
    trainer.train()
    assert trainer.state.global_step == 1 and "clip_ratio/high_max" in trainer.state.log_history[0]
