"""The end of a run: the trained model saved with ``save_pretrained``, ``summary.json``, and the printed report of
what moved (each held-out share with its 95 % interval)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import numpy as np

from .distributed import full_state
from .intervals import is_share, metric_intervals, with_interval
from .metrics_log import MetricsLog


def save_model(model, tokenizer, model_state: dict, folder: Path) -> None:
    """``save_pretrained`` of ``model`` (a ``PeftModel``: its adapter) and its tokenizer into ``folder``, from
    ``model_state``: the run's `PolicyLoss` state gathered whole (`distributed.full_state`)."""
    prefix = "model."
    model.save_pretrained(
        folder, state_dict={k[len(prefix) :] if k.startswith(prefix) else k: v for k, v in model_state.items()}
    )
    tokenizer.save_pretrained(folder)


def save_final(model, tokenizer, policy, folder: Path, merge_lora: bool = False) -> None:
    """The trained model (or LoRA adapter) in ``folder``, its parameters gathered whole on process 0; with
    ``merge_lora``, ``folder/merged`` holds the base model with the adapter merged in (a plain transformers model)."""
    model_state, _ = full_state(policy, None)
    save_model(model, tokenizer, model_state, folder)
    if merge_lora:
        import copy

        merged = copy.deepcopy(model).merge_and_unload()  # the training copy keeps its adapters
        merged.save_pretrained(folder / "merged")
        tokenizer.save_pretrained(folder / "merged")


def summarise(
    config, state, after: dict, stopped, processes: int, eval_rows: int, minutes: float, wall: float, machine=None
) -> dict:
    """``summary.json``: the run's settings in brief, where it stopped, its held-out figures before and after, and
    the machine it ran on (a `precision.Machine`: its minutes are that machine's)."""
    return {
        "algo": config.algo,
        "preset": config.loss_preset,
        "seed": config.seed,
        "task": config.dataset,
        "steps": state.step,
        "stopped_early": None if stopped is None else stopped.message,
        "processes": processes,
        "minutes": minutes,
        "wall_minutes": wall,
        "machine": None if machine is None else machine.as_dict(),
        "before": state.before,
        "after": after,
        # Each share is of these rows: its 95 % interval (Wilson) says what it can tell.
        "eval_problems": eval_rows,
        "intervals_95": {
            "before": metric_intervals(state.before, eval_rows) if state.before else None,
            "after": metric_intervals(after, eval_rows),
        },
    }


def print_summary(summary: dict, log: MetricsLog, plot: Optional[Path]) -> None:
    before, after, n = summary["before"] or {}, summary["after"], summary["eval_problems"]
    # A gain counts when the after figure's interval lies wholly above the before figure's: a stricter test
    # than needed (the same problems are scored twice), so "within noise" may still hide a small gain. A reward's
    # mean has no interval here: it is printed, not judged.
    width = max([12, *map(len, after)])
    print(f"\nheld-out metric on {n} problems, with 95 % intervals (Wilson)")
    print(f"{'metric':<{width}} {'before':>20} {'after':>20}  verdict")
    for key in after:
        if not is_share(key):
            b = f"{before[key]:.3f}" if key in before and not math.isnan(before[key]) else "-"
            print(f"{key:<{width}} {b:>20} {after[key]:>20.3f}  -")
            continue
        b, verdict = "-", "-"
        if key in before:
            b = with_interval(before[key], n)
            (b_low, b_high), (a_low, a_high) = (summary["intervals_95"][w][key] for w in ("before", "after"))
            verdict = "up" if a_low > b_high else "down" if a_high < b_low else "within noise"
        print(f"{key:<{width}} {b:>20} {with_interval(after[key], n):>20}  {verdict}")
    train_rows = log.rows("train")
    if train_rows:
        mean = lambda k: np.mean([r[k] for r in train_rows])  # noqa: E731
        print(
            f"\n{len(train_rows)} steps, {summary['minutes']:.1f} min of training "
            f"({summary['wall_minutes']:.1f} min in all): mean reward {mean('reward'):.3f}, "
            f"entropy {mean('entropy'):.3f}, filtered "
            f"{mean('filtered_fraction'):.3f}, with signal {mean('signal_fraction'):.3f}, "
            f"step {mean('time_step'):.1f} s "
            f"(generation {mean('time_generation'):.1f}, update {mean('time_update'):.1f})"
        )
    print(f"metrics: {log.path}" + (f"\nplot: {plot}" if plot else ""))
