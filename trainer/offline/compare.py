"""Compare finished runs: ``python -m gtpo_train.offline.compare runs/gtpo-seed* runs/grpo-seed* [--out results/]``.

Runs are grouped by variant: the algorithm, the loss preset and the loss overrides of their ``config.json``
(``--entropy-coef``, ``--no-entropy-filter``, ``--no-conflict-weights``, ``--entropy-threshold``), and any other
setting in which the runs given differ (``precision=fp32``, ``learning_rate=3e-05``, ``steps=64``), apart from the
seed and the settings that do not change what a run learns (`NOT_A_VARIANT`): seeds of one variant differ in their
seed only, so their spread is the seed's. Writes
``comparison.md``, two tables:

- per variant and held-out metric: the mean before and after training over seeds, the gain per seed, the
  spread of the final values across seeds (max - min), whether the mean gain exceeds it, and each seed's
  final value with its 95 % interval over the held-out problems (Wilson, as the run's summary prints it);
- per run: the peak and final held-out metrics and whether the run collapsed, by `COLLAPSE_RULE`;

and ``comparison.png``: per-step curves across seeds (mean, band from min to max) of the train entropy
against ln 2, the train format reward, the held-out greedy accuracy, pass@k, maj@k and format rate (at every evaluation:
``--eval-every``), the filtered fraction and the conflict-token fractions.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ..intervals import is_share, with_interval

LN2 = math.log(2.0)
# A run collapsed when any of these holds (stated in the table's heading; fixed before the study's final runs):
ACCURACY_DROP = 0.15  # final held-out greedy accuracy at least this far below the run's peak
FORMAT_DROP = 0.25  # final held-out format rate at least this far below the run's peak
LOW_ENTROPY = 0.02  # ... or train entropy below this (nats) with train reward below 0.1 on the last 3 steps
COLLAPSE_RULE = (
    f"collapsed: final held-out accuracy >= {ACCURACY_DROP} below its peak, or final held-out format "
    f"rate >= {FORMAT_DROP} below its peak, or train entropy above ln 2 on each of the last 3 steps "
    f"after being below it, or train reward < 0.1 on each of the last 3 steps"
)


# Settings that do not change what a run learns: runs that differ only in these (and the seed) are one variant.
NOT_A_VARIANT = frozenset(
    {
        "seed",
        "output_dir",
        "resume",
        "eval_every",
        "save_every",
        "save_total_limit",
        "merge_lora",
        "report_to",
        "run_name",
        "max_minutes",
        "device",
        "eval_batch_size",
    }
)
# Settings `variant` names in its own words.
LOSS_SETTINGS = frozenset({"algo", "preset", "conflict_weights", "entropy_filter", "entropy_coef", "entropy_threshold"})


def differing_settings(configs: List[Optional[dict]]) -> List[str]:
    """The settings, in every given ``config.json``, whose values differ between the runs, but for `NOT_A_VARIANT`
    and `LOSS_SETTINGS`."""
    known = [with_defaults(c) for c in configs if c]
    if len(known) < 2:
        return []
    shared = set.intersection(*(set(c) for c in known)) - NOT_A_VARIANT - LOSS_SETTINGS
    return sorted(k for k in shared if len({json.dumps(c[k], sort_keys=True) for c in known}) > 1)


def with_defaults(config: dict) -> dict:
    """``config`` with each setting it lacks at the trainer's default: a run saved before a setting existed ran as
    its default does (a LoRA run against older full-training runs differs in ``lora_r``, not only in its rate)."""
    from ..config import TrainConfig

    defaults = {}
    for f in dataclasses.fields(TrainConfig):
        defaults[f.name] = f.default_factory() if f.default is dataclasses.MISSING else f.default
    return {**defaults, **config}


def _setting(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def variant(summary: dict, config: Optional[dict], settings: List[str] = ()) -> str:
    """``grpo``, ``gtpo paper``, ``gtpo official``, with the loss overrides the run was given and its values of
    ``settings`` (`differing_settings`)."""
    config = config or {}
    preset = summary.get("preset") or config.get("preset") or ("paper" if summary["algo"] == "gtpo" else "grpo")
    label = "grpo" if summary["algo"] == "grpo" and preset == "grpo" else f"{summary['algo']} {preset}"
    extras = []
    if config.get("conflict_weights") is False:
        extras.append("no conflict weights")
    if config.get("entropy_filter") is False:
        extras.append("no entropy filter")
    if config.get("entropy_coef") is not None:
        extras.append(f"gamma={config['entropy_coef']:g}")
    if config.get("entropy_threshold") is not None:
        extras.append(f"tau={config['entropy_threshold']:g}")
    extras += [f"{name}={_setting(with_defaults(config).get(name))}" for name in settings]
    return label + (f" ({', '.join(extras)})" if extras else "")


def load(run_dirs: List[str]) -> Dict[str, List[dict]]:
    """Finished runs (those with a ``summary.json``) by variant, each with its metric rows."""
    found = []
    for d in run_dirs:
        summary_path = Path(d) / "summary.json"
        if not summary_path.exists():
            print(f"skipping {d}: no summary.json (unfinished run?)")
            continue
        summary = json.loads(summary_path.read_text())
        config_path = Path(d) / "config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else None
        metrics_path = Path(d) / "metrics.jsonl"
        rows = (
            [json.loads(x) for x in metrics_path.read_text().splitlines() if x.strip()] if metrics_path.exists() else []
        )
        for row in rows:  # logs before 2026-12-04 name the built-in rewards bare, not rewards/NAME
            for name in ("correctness_reward", "format_reward"):
                if name in row:
                    row[f"rewards/{name}"] = row.pop(name)
        summary.update(
            dir=d, train=[r for r in rows if r["kind"] == "train"], evals=[r for r in rows if r["kind"] == "eval"]
        )
        # Summaries written before 2026-12-02 lack the count; their config.json has it.
        summary.setdefault("eval_problems", (config or {}).get("eval_size"))
        found.append((summary, config))
    settings = differing_settings([config for _, config in found])
    by_variant: Dict[str, List[dict]] = defaultdict(list)
    for summary, config in found:
        by_variant[variant(summary, config, settings)].append(summary)
    return by_variant


def _mean(xs: List[float]) -> float:
    return sum(xs) / len(xs)


def collapsed(run: dict) -> Tuple[bool, str]:
    """`COLLAPSE_RULE` on one run: ``(collapsed, the signs seen)``."""
    signs = []
    evals, train = run["evals"], run["train"]
    for key, drop in (("accuracy", ACCURACY_DROP), ("format_rate", FORMAT_DROP)):
        values = [e[key] for e in evals if key in e]
        if values and max(values) - values[-1] >= drop - 1e-9:
            signs.append(f"{key} {max(values):.2f} -> {values[-1]:.2f}")
    last = train[-3:]
    if len(last) == 3:
        was_below = any(t["entropy"] < LN2 for t in train[:-3])
        if was_below and all(t["entropy"] > LN2 for t in last):
            signs.append(f"entropy back above ln 2 ({last[-1]['entropy']:.2f})")
        if all(t["reward"] < 0.1 for t in last):
            signs.append(f"train reward {last[-1]['reward']:.2f}")
    return bool(signs), "; ".join(signs)


def gain_table(by_variant: Dict[str, List[dict]]) -> str:
    lines = [
        "| variant | seeds | metric | before (mean) | after (mean) | gain (mean) | gain per seed | "
        "spread of after across seeds | gain > spread | after per seed, 95 % interval |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in sorted(by_variant.items()):
        for metric in [m for m in runs[0]["after"] if is_share(m)]:  # a reward's mean: in the run's summary only
            before = [r["before"][metric] for r in runs]
            after = [r["after"][metric] for r in runs]
            gains = [a - b for a, b in zip(after, before)]
            spread = max(after) - min(after)
            # one run has no spread to beat: its gain alone says nothing about the seed's part in it
            verdict = ("yes" if _mean(gains) > spread else "no") if len(runs) > 1 else "- (one seed)"
            lines.append(
                f"| {name} | {','.join(str(r['seed']) for r in runs)} | {metric} | {_mean(before):.3f} | "
                f"{_mean(after):.3f} | {_mean(gains):+.3f} | {' '.join(f'{g:+.3f}' for g in gains)} | "
                f"{spread:.3f} | {verdict} | "
                + "; ".join(
                    with_interval(r["after"][metric], r["eval_problems"]) if r["eval_problems"] else "-" for r in runs
                )
                + " |"
            )
    return "\n".join(lines)


def run_table(by_variant: Dict[str, List[dict]]) -> str:
    lines = [
        f"Rule: {COLLAPSE_RULE}.",
        "",
        "| variant | seed | accuracy before / peak / final | format before / peak / final | "
        "entropy first / min / last | collapsed |",
        "|---|---|---|---|---|---|",
    ]
    for name, runs in sorted(by_variant.items()):
        for r in sorted(runs, key=lambda r: r["seed"]):
            cells = []
            for key in ("accuracy", "format_rate"):
                values = [e[key] for e in r["evals"] if key in e]
                cells.append(f"{values[0]:.2f} / {max(values):.2f} / {values[-1]:.2f}" if values else "-")
            entropy = [t["entropy"] for t in r["train"]]
            cells.append(f"{entropy[0]:.2f} / {min(entropy):.2f} / {entropy[-1]:.2f}" if entropy else "-")
            is_collapsed, signs = collapsed(r)
            cells.append(f"yes: {signs}" if is_collapsed else "no")
            lines.append(f"| {name} | {r['seed']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(by_variant: Dict[str, List[dict]]) -> str:
    return gain_table(by_variant) + "\n\n" + run_table(by_variant)


def _band(runs: List[dict], rows: str, key: str):
    """``(steps, mean, low, high)`` over the runs at the steps every run has a value for."""
    series = [{r["step"]: r[key] for r in run[rows] if key in r} for run in runs]
    steps = sorted(set.intersection(*(set(s) for s in series))) if series else []
    values = [[s[step] for s in series] for step in steps]
    return steps, [_mean(v) for v in values], [min(v) for v in values], [max(v) for v in values]


CURVES = (  # (panel title, rows, keys: solid, dashed, dotted; a key ending in "@" stands for each k, y-limits)
    ("train entropy (nats)", "train", ("entropy",), None),
    ("train format reward", "train", ("rewards/format_reward",), None),
    (
        "held-out: greedy (solid), pass@k (dashed), maj@k (dotted)",
        "evals",
        ("accuracy", "pass@", "maj@"),
        (0, 1),
    ),
    ("held-out format rate", "evals", ("format_rate",), (0, 1.05)),
    ("filtered fraction (completions)", "train", ("filtered_fraction",), (0, 1)),
    ("conflict tokens: amplified (solid), skipped (dashed)", "train", ("amplified_fraction", "skipped_fraction"), None),
)


# A panel none of the runs has data for, and what takes its place: a task without a held-out format rate (only the
# built-in task has one) shows the rollouts' accuracy, where a collapse to one answer shows within a run.
FALLBACK = {"held-out format rate": ("train accuracy (rollouts)", "train", ("accuracy",), (0, 1))}


def panels(by_variant: Dict[str, List[dict]]) -> list:
    """`CURVES`, each panel none of the runs has data for replaced by its `FALLBACK`."""

    def drawable(curve) -> bool:
        rows = [row for group in by_variant.values() for run in group for row in run[curve[1]]]
        return any(key in row for key in _curve_keys([{curve[1]: rows}], curve[1], curve[2]) for row in rows)

    return [c if drawable(c) else FALLBACK.get(c[0], c) for c in CURVES]


def _curve_keys(runs: List[dict], rows: str, keys) -> List[str]:
    """``keys`` with each ``"pass@"``-like prefix replaced by the matching key with the largest k the runs' rows hold
    (pass@1, pass@2, ... pass@k come from one evaluation's k samples: the panel draws pass@k)."""
    found = {k for run in runs for row in run[rows] for k in row}

    def largest(prefix: str) -> List[str]:
        ks = [f for f in found if f.startswith(prefix) and f[len(prefix) :].isdigit()]
        return [max(ks, key=lambda f: int(f[len(prefix) :]))] if ks else []

    return [k for key in keys for k in ([key] if not key.endswith("@") else largest(key))]


def plot(by_variant: Dict[str, List[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    palette = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:gray"]
    colors = {name: palette[i % len(palette)] for i, name in enumerate(sorted(by_variant))}

    for ax, (title, rows, keys, ylim) in zip(axes.flat, panels(by_variant)):
        for name, runs in sorted(by_variant.items()):
            for k, style in zip(_curve_keys(runs, rows, keys), ("-", "--", ":")):
                steps, mean, low, high = _band(runs, rows, k)
                if not steps:
                    continue
                marker = "o" if rows == "evals" else None
                ax.plot(
                    steps,
                    mean,
                    style,
                    marker=marker,
                    color=colors[name],
                    label=f"{name} (n={len(runs)})" if style == "-" else None,
                )
                ax.fill_between(steps, low, high, color=colors[name], alpha=0.15)
        if keys == ("entropy",):
            ax.axhline(LN2, color="red", linestyle=":", label="ln 2")
        if ylim:
            ax.set_ylim(*ylim)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    fig.suptitle("mean over seeds, band: min..max")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m gtpo_train.offline.compare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("runs", nargs="+", help="run folders (each with summary.json, metrics.jsonl, config.json)")
    p.add_argument("--out", default="results", help="where comparison.md and comparison.png go")
    args = p.parse_args(argv)
    by_variant = load(args.runs)
    if not by_variant:
        raise SystemExit("no finished runs")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = table(by_variant)
    print(text)
    (out / "comparison.md").write_text(text + "\n")
    plot(by_variant, out / "comparison.png")
    print(f"wrote {out / 'comparison.md'} and {out / 'comparison.png'}")


if __name__ == "__main__":
    main()
