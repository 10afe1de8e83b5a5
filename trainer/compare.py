"""Compare finished runs: ``python -m trainer.compare runs/gtpo-seed* runs/grpo-seed* [--out results/]``.

Prints a markdown table of held-out metrics before and after training, per algorithm: the mean over
seeds, the spread (max - min across seeds) and the mean gain; writes it with a plot of the held-out
accuracy of every run.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Dict, List


def load(run_dirs: List[str]) -> Dict[str, List[dict]]:
    by_algo: Dict[str, List[dict]] = defaultdict(list)
    for d in run_dirs:
        summary_path = Path(d) / "summary.json"
        if not summary_path.exists():
            print(f"skipping {d}: no summary.json (unfinished run?)")
            continue
        summary = json.loads(summary_path.read_text())
        summary["dir"] = d
        preset = summary.get("preset")
        default = {"gtpo": "paper", "grpo": "grpo"}.get(summary["algo"])
        label = summary["algo"] if preset in (None, default) else f"{summary['algo']} ({preset})"
        by_algo[label].append(summary)
    return by_algo


def table(by_algo: Dict[str, List[dict]]) -> str:
    lines = ["| algo | seeds | metric | before (mean) | after (mean) | gain (mean) | gain per seed | "
             "spread of after across seeds | gain > spread |", "|---|---|---|---|---|---|---|---|---|"]
    for algo, runs in sorted(by_algo.items()):
        metrics = [k for k in runs[0]["after"]]
        for metric in metrics:
            before = [r["before"][metric] for r in runs]
            after = [r["after"][metric] for r in runs]
            gains = [a - b for a, b in zip(after, before)]
            mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
            lines.append(f"| {algo} | {','.join(str(r['seed']) for r in runs)} | {metric} | {mean(before):.3f} | "
                         f"{mean(after):.3f} | {mean(gains):+.3f} | {' '.join(f'{g:+.3f}' for g in gains)} | "
                         f"{max(after) - min(after):.3f} | {'yes' if mean(gains) > max(after) - min(after) else 'no'} |")
    return "\n".join(lines)


def plot(by_algo: Dict[str, List[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    # One colour per label (algo and preset), the same in every panel.
    palette = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]
    colors = {algo: palette[i % len(palette)] for i, algo in enumerate(sorted(by_algo))}
    for algo, runs in by_algo.items():
        for r in runs:
            rows = [json.loads(x) for x in (Path(r["dir"]) / "metrics.jsonl").read_text().splitlines()]
            train = [x for x in rows if x["kind"] == "train"]
            evals = [x for x in rows if x["kind"] == "eval"]
            label = f"{algo} seed {r['seed']}"
            axes[0].plot([e["step"] for e in evals], [e["accuracy"] for e in evals], "o-", color=colors.get(algo),
                         alpha=0.7, label=label)
            axes[1].plot([t["step"] for t in train], [t["reward"] for t in train], color=colors.get(algo), alpha=0.6)
            axes[2].plot([t["step"] for t in train], [t["entropy"] for t in train], color=colors.get(algo), alpha=0.6)
    axes[0].set_title("held-out greedy accuracy")
    axes[1].set_title("train reward")
    axes[2].set_title("mean token entropy (nats)")
    axes[2].axhline(0.6931, color="red", linestyle="--", label="ln 2")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m trainer.compare", description=__doc__)
    p.add_argument("runs", nargs="+")
    p.add_argument("--out", default="results")
    args = p.parse_args(argv)
    by_algo = load(args.runs)
    if not by_algo:
        raise SystemExit("no finished runs")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = table(by_algo)
    print(text)
    (out / "comparison.md").write_text(text + "\n")
    plot(by_algo, out / "comparison.png")
    print(f"wrote {out / 'comparison.md'} and {out / 'comparison.png'}")


if __name__ == "__main__":
    main()
