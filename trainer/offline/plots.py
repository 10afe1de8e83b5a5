"""The run's plot: reward, accuracy, entropy against ln 2, filtered fraction, conflict tokens, step time."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional


def plot_run(metrics_path: Path, png_path: Path, title: str = "") -> Optional[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return None
    rows = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    steps = [r["step"] for r in train]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    (a_reward, a_acc, a_ent), (a_filt, a_conf, a_time) = axes

    a_reward.plot(steps, [r["reward"] for r in train], label="total")
    # each reward function's mean: rewards/NAME (logs before 2026-12-04: the two built-in rewards' bare names)
    # (a --steps 0 run has no train rows: its plot is the held-out figures alone)
    first = train[0] if train else {}
    reward_keys = [k for k in first if k.startswith("rewards/") or k in ("correctness_reward", "format_reward")]
    for key in reward_keys:
        values = [r[key] if r[key] is not None else float("nan") for r in train]
        a_reward.plot(steps, values, label=key.removeprefix("rewards/").replace("_reward", ""), alpha=0.7)
    a_reward.set_title("reward (train rollouts)")

    if train and "accuracy" in train[0]:
        a_acc.plot(steps, [r.get("accuracy", float("nan")) for r in train], label="train rollouts", alpha=0.6)
    if evals and "accuracy" in evals[0]:
        a_acc.plot([r["step"] for r in evals], [r["accuracy"] for r in evals], "o-", label="held-out, greedy")
    for key in sorted({k for r in evals for k in r if k.startswith(("pass@", "maj@"))}):
        a_acc.plot([r["step"] for r in evals], [r[key] for r in evals], "s--", label=f"held-out {key}")
    a_acc.set_title("accuracy")

    a_ent.plot(steps, [r["entropy"] for r in train], label="mean token entropy")
    a_ent.axhline(math.log(2), color="red", linestyle="--", label="ln 2")
    a_ent.set_title("entropy (nats)")

    a_filt.plot(steps, [r["filtered_fraction"] for r in train], label="filtered by entropy")
    a_filt.plot(steps, [r.get("signal_fraction", float("nan")) for r in train], label="carrying signal")
    skipped = [r["step"] for r in train if r.get("updates", 1) == 0]
    if skipped:
        a_filt.scatter(skipped, [0.0] * len(skipped), marker="x", color="red", label="no update (no signal)")
    a_filt.set_title("completions: filtered, with signal")

    a_conf.plot(steps, [r["amplified_fraction"] for r in train], label="amplified (positive conflicts)")
    a_conf.plot(steps, [r["skipped_fraction"] for r in train], label="skipped (negative conflicts)")
    a_conf.set_title("conflict tokens (fraction of tokens)")

    bottom = [0.0] * len(train)
    for key, label in (
        ("time_generation", "generation"),
        ("time_old_logprobs", "old log-probs"),
        ("time_update", "loss + update"),
    ):
        values = [r.get(key, 0.0) for r in train]
        a_time.bar(steps, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    a_time.set_title("step time (s)")

    for ax in axes.flat:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path
