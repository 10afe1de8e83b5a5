"""`python -m trainer.offline.compare`: variants from each run's config, the collapse rule on hand-made runs, the tables
and the plot; the trainer's ablation flags (`--entropy-coef`, `--no-entropy-filter`, `--no-conflict-weights`)."""

import json
import math
from pathlib import Path

import pytest

from trainer.config import ConfigError, TrainConfig, parse_args
from trainer.intervals import with_interval
from trainer.offline import compare


def _run(
    tmp_path,
    name,
    *,
    algo="gtpo",
    preset="paper",
    seed=0,
    config=None,
    entropy=(1.0, 0.5, 0.4, 0.3, 0.3),
    reward=(0.3, 0.5, 0.6, 0.7, 0.7),
    accuracy=(0.4, 0.6, 0.7),
    format_rate=(0.6, 0.9, 1.0),
):
    d = tmp_path / name
    d.mkdir()
    rows = [
        {
            "kind": "train",
            "step": i + 1,
            "entropy": h,
            "reward": r,
            "format_reward": r / 2,
            "filtered_fraction": 0.0,
            "amplified_fraction": 0.1,
            "skipped_fraction": 0.05,
        }
        for i, (h, r) in enumerate(zip(entropy, reward))
    ]
    evals = [
        {"kind": "eval", "step": 2 * i, "accuracy": a, "format_rate": f}
        for i, (a, f) in enumerate(zip(accuracy, format_rate))
    ]
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in evals[:1] + rows + evals[1:]) + "\n")
    summary = {
        "algo": algo,
        "preset": preset,
        "seed": seed,
        "before": {"accuracy": accuracy[0], "format_rate": format_rate[0]},
        "after": {"accuracy": accuracy[-1], "format_rate": format_rate[-1]},
    }
    (d / "summary.json").write_text(json.dumps(summary))
    (d / "config.json").write_text(json.dumps({"algo": algo, "preset": None, **(config or {})}))
    return str(d)


def test_variants_name_the_overrides(tmp_path):
    runs = [
        _run(tmp_path, "a", algo="grpo", preset="grpo"),
        _run(tmp_path, "b"),
        _run(tmp_path, "c", config={"conflict_weights": False}),
        _run(tmp_path, "d", config={"entropy_filter": False, "entropy_coef": 0.0}),
        _run(tmp_path, "e", preset="official"),
    ]
    assert sorted(compare.load(runs)) == [
        "grpo",
        "gtpo official",
        "gtpo paper",
        "gtpo paper (no conflict weights)",
        "gtpo paper (no entropy filter, gamma=0)",
    ]


def test_runs_that_differ_in_more_than_their_seed_are_not_one_variant(tmp_path):
    """Two seeds at one setting are one variant; a run at another precision or learning rate is another, named by
    what differs, so its gain does not enter the first's mean and spread. Settings that do not change what a run
    learns (its folder, its evaluation cadence) do not split."""
    base = {"precision": "bf16", "learning_rate": 2e-5, "steps": 12, "eval_every": 0}
    runs = [
        _run(tmp_path, "s0", seed=0, config={**base, "seed": 0, "output_dir": "runs/s0"}),
        _run(tmp_path, "s1", seed=1, config={**base, "seed": 1, "output_dir": "runs/s1", "eval_every": 4}),
        _run(tmp_path, "fp32", config={**base, "precision": "fp32"}),
        _run(tmp_path, "lr", config={**base, "learning_rate": 3e-5}),
    ]
    by_variant = compare.load(runs)
    assert {name: len(found) for name, found in by_variant.items()} == {
        "gtpo paper (learning_rate=2e-05, precision=bf16)": 2,
        "gtpo paper (learning_rate=2e-05, precision=fp32)": 1,
        "gtpo paper (learning_rate=3e-05, precision=bf16)": 1,
    }
    assert sorted(compare.load(runs[:2])) == ["gtpo paper"]  # seeds alone: the plain name, as before


def test_collapse_rule_by_hand(tmp_path):
    healthy = compare.load([_run(tmp_path, "ok")])["gtpo paper"][0]
    assert compare.collapsed(healthy) == (False, "")
    # accuracy 0.7 at its peak, 0.5 at the end: a drop of 0.2 >= 0.15
    fell = compare.load([_run(tmp_path, "fell", accuracy=(0.4, 0.7, 0.5))])["gtpo paper"][0]
    assert compare.collapsed(fell) == (True, "accuracy 0.70 -> 0.50")
    # a drop of 0.125 (4 of 32 problems) is not a collapse
    noise = compare.load([_run(tmp_path, "noise", accuracy=(0.4, 0.625, 0.5))])["gtpo paper"][0]
    assert not compare.collapsed(noise)[0]
    # entropy below ln 2, then above it on each of the last three steps
    rose = compare.load([_run(tmp_path, "rose", entropy=(1.0, 0.5, 0.8, 0.9, 1.2))])["gtpo paper"][0]
    assert compare.collapsed(rose) == (True, "entropy back above ln 2 (1.20)")
    # never below ln 2 is not a rise
    high = compare.load([_run(tmp_path, "high", entropy=(1.0, 0.9, 0.8, 0.9, 1.2))])["gtpo paper"][0]
    assert not compare.collapsed(high)[0]
    dead = compare.load([_run(tmp_path, "dead", reward=(0.3, 0.2, 0.05, 0.0, 0.0), format_rate=(0.6, 0.9, 0.6))])[
        "gtpo paper"
    ][0]
    assert compare.collapsed(dead) == (True, "format_rate 0.90 -> 0.60; train reward 0.00")


def test_tables_and_plot(tmp_path):
    runs = [_run(tmp_path, f"s{seed}", seed=seed, accuracy=(0.4, 0.6, 0.5 + 0.1 * seed)) for seed in range(3)]
    runs.append(_run(tmp_path, "g", algo="grpo", preset="grpo", accuracy=(0.4, 0.8, 0.5)))
    out = tmp_path / "out"
    compare.main(runs + ["--out", str(out)])
    text = (out / "comparison.md").read_text()
    assert "| gtpo paper | 0,1,2 | accuracy | 0.400 | 0.600 | +0.200 | +0.100 +0.200 +0.300 | 0.200 | no |" in text
    assert "| grpo | 0 | accuracy | 0.400 | 0.500 | +0.100 | +0.100 | 0.000 | - (one seed) |" in text  # nothing to beat
    assert (
        "| grpo | 0 | 0.40 / 0.80 / 0.50 | 0.60 / 1.00 / 1.00 | 1.00 / 0.30 / 0.30 | yes: accuracy 0.80 -> 0.50 |"
        in text
    )
    assert (out / "comparison.png").stat().st_size > 10_000
    steps, mean, low, high = compare._band(compare.load(runs[:3])["gtpo paper"], "evals", "accuracy")
    assert steps == [0, 2, 4] and low[-1] == pytest.approx(0.5) and high[-1] == pytest.approx(0.7)
    assert mean[-1] == pytest.approx(0.6)


def test_the_held_out_panel_draws_pass_and_maj_at_each_k():
    # "pass@" and "maj@" stand for the k the runs were evaluated at (pass@16 of 16 samples, not the pass@1, @2, @4
    # and @8 estimated from them); runs without samples (eval_k 0) draw accuracy.
    passes = {"pass@1": 0.3, "pass@2": 0.5, "pass@4": 0.7, "pass@8": 0.8, "pass@16": 0.9}
    sampled = [{"evals": [{"step": 0, "accuracy": 0.5, **passes, "maj@16": 0.6, "format_rate": 1.0}], "train": []}]
    greedy = [{"evals": [{"step": 0, "accuracy": 0.5, "format_rate": 1.0}]}]
    keys = next(keys for title, rows, keys, _ in compare.CURVES if title.startswith("held-out: greedy"))
    assert compare._curve_keys(sampled, "evals", keys) == ["accuracy", "pass@16", "maj@16"]
    assert compare._curve_keys(greedy, "evals", keys) == ["accuracy"]
    conflict = next(keys for title, rows, keys, _ in compare.CURVES if title.startswith("conflict tokens"))
    assert compare._curve_keys(sampled, "train", conflict) == ["amplified_fraction", "skipped_fraction"]


def test_a_task_without_a_held_out_format_rate_shows_the_rollouts_accuracy_instead():
    builtin = {"a": [{"evals": [{"step": 0, "accuracy": 0.5, "format_rate": 1.0}], "train": [{"accuracy": 0.4}]}]}
    other = {"a": [{"evals": [{"step": 0, "accuracy": 0.5}], "train": [{"accuracy": 0.4}]}]}
    titles = lambda runs: [title for title, *_ in compare.panels(runs)]  # noqa: E731
    assert "held-out format rate" in titles(builtin) and "train accuracy (rollouts)" not in titles(builtin)
    assert "train accuracy (rollouts)" in titles(other) and "held-out format rate" not in titles(other)
    assert len(titles(other)) == len(compare.CURVES)


def test_each_seeds_final_figure_comes_with_its_interval(tmp_path):
    # The count from summary.json, or (summaries written before it was saved) from config.json's eval_size.
    saved = _run(tmp_path, "saved", seed=0, accuracy=(0.4, 0.6, 0.5))
    summary = json.loads((Path(saved) / "summary.json").read_text())
    (Path(saved) / "summary.json").write_text(json.dumps({**summary, "eval_problems": 128}))
    older = _run(tmp_path, "older", seed=1, accuracy=(0.4, 0.6, 0.75), config={"eval_size": 64})
    unknown = _run(tmp_path, "unknown", seed=2, accuracy=(0.4, 0.6, 0.25))
    text = compare.gain_table(compare.load([saved, older, unknown]))
    row = next(line for line in text.splitlines() if "| accuracy |" in line)
    assert row.endswith(f"| {with_interval(0.5, 128)}; {with_interval(0.75, 64)}; - |")


def test_ablation_flags_reach_the_loss():
    conflict_only = parse_args(["--no-entropy-filter", "--entropy-coef", "0"]).loss_config()
    assert conflict_only.entropy_threshold is None and conflict_only.entropy_coef == 0
    assert conflict_only.use_conflict_weights
    entropy_only = parse_args(["--preset", "official", "--no-conflict-weights"]).loss_config()
    assert not entropy_only.use_conflict_weights and not entropy_only.divide_by_conflict_count
    assert entropy_only.entropy_threshold == pytest.approx(0.7) and entropy_only.entropy_coef == pytest.approx(0.1)
    default = TrainConfig().loss_config()
    assert default.entropy_threshold == pytest.approx(math.log(2)) and default.use_conflict_weights
    with pytest.raises(ConfigError, match="--entropy-threshold"):
        TrainConfig(entropy_threshold=0.5, entropy_filter=False)
    with pytest.raises(ConfigError, match="--entropy-coef"):
        TrainConfig(entropy_coef=-1.0)


def test_a_setting_an_older_run_lacks_counts_at_its_default():
    """A run saved before --lora-r existed trained every weight: against a LoRA run the two differ in lora_r (and a
    run that sets a setting to its default does not differ from one that lacks it)."""
    from trainer.offline.compare import differing_settings

    old, lora, plain = (
        {"seed": 0, "learning_rate": 2e-5},
        {"seed": 1, "learning_rate": 2e-5, "lora_r": 16},
        {"lora_r": 0},
    )
    assert differing_settings([old, lora]) == ["lora_r"]
    assert differing_settings([{**old}, {**old, **plain}]) == []
