"""What ``--report-to`` costs a run: each tracker replays a real run's ``metrics.jsonl`` row by row, as the trainer
logs them (`trainer.tracking.Trackers`), timed per row, against that run's own step time.

    python -m bench tracking [--metrics RUN/metrics.jsonl] [--trackers tensorboard wandb trackio] [--out FILE]

W&B runs offline and trackio in a scratch folder (nothing leaves the machine). Start-up and close are once per
run and reported apart from the per-row cost.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_METRICS = ROOT / "results/trainer-cpu/default-2026-12-03-v2/8x4-bf16-s0/metrics.jsonl"


def replay(tracker: list, rows: list, folder: Path) -> dict:
    from trainer.tracking import Trackers

    t0 = time.perf_counter()
    trackers = Trackers(tracker, "bench-tracking", folder, {"bench": True}, enabled=True)
    started = time.perf_counter() - t0
    per_row = []
    for row in rows:
        t = time.perf_counter()
        trackers.log(row)
        per_row.append(time.perf_counter() - t)
    t = time.perf_counter()
    trackers.close()
    return {"start": started, "per_row": per_row, "close": time.perf_counter() - t}


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench tracking", description=__doc__.splitlines()[0])
    p.add_argument("--metrics", default=str(DEFAULT_METRICS), help="a run's metrics.jsonl to replay")
    p.add_argument("--trackers", nargs="+", default=["tensorboard", "wandb", "trackio"])
    p.add_argument("--out", default=str(ROOT / "bench/results/local/tracking-cpu.md"))
    args = p.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="bench-tracking-"))
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", TRACKIO_DIR=str(scratch / "trackio"))
    rows = [json.loads(line) for line in Path(args.metrics).read_text().splitlines() if line.strip()]
    steps = [r["time_step"] for r in rows if r["kind"] == "train"]
    step = statistics.median(steps)
    lines = [
        f"# What --report-to costs a step ({time.strftime('%Y-%m-%d')})",
        "",
        f'Machine: "{cpu_name()}", {os.cpu_count()} CPUs. `python -m bench tracking '
        f"--metrics {os.path.relpath(args.metrics, ROOT)}`: its {len(rows)} rows ({len(steps)} steps) logged in order; "
        f"that run's median step {step:.1f} s (on its own machine: results/README.md). A step logs one row (two when "
        f"an evaluation falls on it). Timed: the trainer's call per row; the trackers' own background threads (W&B's "
        f"service, trackio's system metrics) run beside the step and are not in these figures.",
        "",
        "| trackers | start (s, once) | per row, mean (ms) | per row, max (ms) | close (s, once) "
        "| two rows / median step |",
        "|---|---|---|---|---|---|",
    ]
    for tracker in [[t] for t in args.trackers] + ([args.trackers] if len(args.trackers) > 1 else []):
        result = replay(tracker, rows, scratch / "-".join(tracker))
        mean, worst = statistics.mean(result["per_row"]), max(result["per_row"])
        lines.append(
            f"| {' + '.join(tracker)} | {result['start']:.2f} | {1e3 * mean:.2f} | {1e3 * worst:.2f} | "
            f"{result['close']:.2f} | {100 * 2 * mean / step:.3f} % |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
