"""The untrained model on reasoning-gym tasks in the reasoning recipe: what a study of them starts from.

    python examples/reasoning_gym/untrained.py --out results/reasoning/untrained [--tasks gcd chain_sum ...]
        [--eval-size 64] [gtpo-train flags ...]

For each task: ``make_data.py --recipe reasoning`` into ``data/TASK-reasoning/`` (with the task's settings below),
then ``gtpo-train --config examples/reasoning_gym/reasoning.yaml --steps 0`` (an evaluation only: greedy accuracy,
pass@1 to pass@16 from 16 samples at T = 1, the reasoning share and length), its summary kept in
``OUT/TASK/``; then ``OUT/README.md``, one table row per task. A task whose summary exists is not run again (the
script resumes after a kill). A study picks its tasks from this table: pass@1 between 0.05 and 0.5.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class TaskSettings:
    dataset: str  # reasoning-gym's dataset name
    config: dict  # its settings


# Each task's reasoning-gym settings: small enough numbers and words that a 135M model's working can get there. A
# label other than the dataset's name is the same dataset at other settings.
TASKS = {
    "chain_sum": TaskSettings("chain_sum", {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}),
    "chain_sum-two-terms": TaskSettings(
        "chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
    ),
    "chain_sum-one-digit": TaskSettings(
        "chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    ),
    "gcd": TaskSettings("gcd", {"min_value": 1, "max_value": 60}),
    "lcm": TaskSettings("lcm", {"min_value": 2, "max_value": 30}),
    "letter_counting": TaskSettings("letter_counting", {"min_words": 3, "max_words": 6}),
    "spell_backward": TaskSettings("spell_backward", {"min_word_len": 3, "max_word_len": 6}),
    "prime_factorization": TaskSettings("prime_factorization", {"min_value": 2, "max_value": 200}),
}
COLUMNS = ("accuracy", "pass@1", "pass@4", "pass@16", "maj@16", "reasoning_share", "mean_reasoning_words")


def run_task(task: str, out: Path, eval_size: int, extra: list) -> dict:
    """The task's untrained summary (run once; read back after)."""
    done = out / task / "summary.json"
    if done.exists():
        return json.loads(done.read_text())
    data = ROOT / "data" / f"{task}-reasoning"
    settings = TASKS[task]
    subprocess.run(
        [sys.executable, str(HERE / "make_data.py"), "--task", settings.dataset, "--recipe", "reasoning"]
        + ["--config", json.dumps(settings.config)]
        + ["--train", "100", "--test", str(2 * eval_size), "--out", str(data)],  # repeats dropped: eval_size left
        check=True,
    )
    run = ROOT / "runs" / f"untrained-{task}-reasoning"
    shutil.rmtree(run, ignore_errors=True)
    start = time.time()
    log = subprocess.run(
        [sys.executable, "-m", "trainer", "--config", str(HERE / "reasoning.yaml"), "--steps", "0"]
        + ["--dataset", str(data / "train.jsonl"), "--eval-dataset", str(data / "test.jsonl")]
        + ["--eval-size", str(eval_size), "--output-dir", str(run), *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if log.returncode:
        sys.exit(f"{task}: gtpo-train failed ({log.returncode}):\n{log.stdout[-2000:]}\n{log.stderr[-2000:]}")
    (out / task).mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "summary.json", "held-out-answers.jsonl"):
        if (run / name).exists():
            shutil.copy(run / name, out / task / name)
    record = {"reasoning_gym": settings.config, "dataset": settings.dataset, "seconds": time.time() - start}
    (out / task / "settings.json").write_text(json.dumps(record))
    (out / task / "end-of-run.txt").write_text(log.stdout[log.stdout.find("held-out metric") :])
    return json.loads(done.read_text())


def table(summaries: dict, machine: str) -> str:
    lines = [
        "# The untrained model in the reasoning recipe",
        "",
        f"SmolLM2-135M-Instruct, no training (`gtpo-train --config examples/reasoning_gym/reasoning.yaml --steps 0`), "
        f"written by `python examples/reasoning_gym/untrained.py`; {machine}. Greedy accuracy; pass@k from 16 samples "
        "a problem at the sampling temperature T (the unbiased estimate); the share of completions writing 10 or more "
        "words besides their answer, and their mean words besides it. Each task's reasoning-gym settings are in its "
        "`settings.json`, its run's in `config.json`.",
        "",
        "| task | T | problems | " + " | ".join(COLUMNS) + " | distinct greedy answers | minutes |",
        "|---|---|---|" + "---|" * (len(COLUMNS) + 2),
    ]
    for task, (summary, seconds, temperature) in summaries.items():
        before = summary.get("before") or summary.get("after") or {}
        cells = [f"{before[c]:.3f}" if c in before else "-" for c in COLUMNS]
        distinct = f"{before.get('distinct_answers', float('nan')):.0f}"
        lines.append(f"| {task} | {temperature:g} | {summary.get('eval_problems')} | " + " | ".join(cells)
                     + f" | {distinct} | {seconds / 60:.1f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="results/reasoning/untrained")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=sorted(TASKS))
    p.add_argument("--eval-size", type=int, default=64)
    p.add_argument("--machine", default="", help="the machine, named in the table (CPU model, bf16 units)")
    args, extra = p.parse_known_args(argv)
    out = Path(args.out)
    summaries = {}
    for task in args.tasks:
        summary = run_task(task, out, args.eval_size, extra)
        seconds = json.loads((out / task / "settings.json").read_text())["seconds"]
        temperature = json.loads((out / task / "config.json").read_text())["temperature"]
        summaries[task] = (summary, seconds, temperature)
        (out / "README.md").write_text(table(summaries, args.machine or "machine not named"))
        print(f"{task}: done", flush=True)


if __name__ == "__main__":
    main()
