"""A study in one command: every (task, variant, seed) cell a plain ``gtpo-train`` run, then a paired report.

    python -m gtpo_train.study SPEC [--jobs N] [--dry-run] [--report-only]

SPEC is a YAML or JSON file::

    name: gtpo-vs-grpo
    out: results/gtpo-vs-grpo      # cells in OUT/runs/TASK/VARIANT/sSEED/, the report in OUT/report.md
    seeds: [0, 1, 2, 3]
    baseline: grpo                 # each other variant is paired with it, seed by seed
    common: [--eval-size, "256"]   # flags every cell takes
    tasks:                         # name: the flags that pick the task
      arithmetic: []
      chain_sum: [--dataset, data/chain_sum.jsonl, --reward, examples/reasoning_gym/reward.py:score]
    variants:                      # name: the flags that make the variant
      grpo: [--algo, grpo]
      gtpo: [--algo, gtpo, --preset, paper]

A seed means the same prompts in the same order and the same held-out problems for every variant (the trainer seeds
its stream and its draws from ``--seed``; the held-out rows never depend on it), so each seed gives one paired
difference per metric. A cell with a ``summary.json`` is finished and skipped; one with a ``checkpoint-STEP/`` was
interrupted and continues with ``--resume``; any other is started afresh (a study survives a kill, or a move to
another machine with its folder). ``--jobs N`` runs N cells side by side, each a process of its own with
``cores / N`` threads. ``--dry-run`` lists the cells, their state and an estimate of their time from the finished
ones. The report (`report`) is written when every cell has finished, or alone with ``--report-only``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .checkpoint import checkpoints
from .config import ConfigError

# The held-out figures each paired difference is taken of (those a run's summary has).
METRICS = ("accuracy", "pass@", "maj@", "format_rate")
BOOTSTRAP_SAMPLES = 10000


@dataclass(frozen=True)
class StudySpec:
    """A study: its tasks and variants (each a name and the ``gtpo-train`` flags that make it), its seeds, the flags
    every cell takes, the variant the others are paired with, and where its cells and report go."""

    name: str
    out: Path
    seeds: Tuple[int, ...]
    tasks: Dict[str, Tuple[str, ...]]
    variants: Dict[str, Tuple[str, ...]]
    baseline: str
    common: Tuple[str, ...] = ()

    @classmethod
    def read(cls, path: Path) -> StudySpec:
        """The spec in ``path`` (YAML or JSON), checked: a mistake is a `ConfigError` naming the key."""
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"study spec {path}: {exc.strerror}") from None
        try:
            if str(path).endswith(".json"):
                raw = json.loads(text)
            else:
                import yaml

                raw = yaml.safe_load(text)
        except Exception as exc:  # noqa: BLE001 (a parser's error, shown in one line)
            raise ConfigError(
                f"study spec {path}: not valid {'JSON' if str(path).endswith('.json') else 'YAML'}: "
                f"{str(exc).splitlines()[0]}"
            ) from None
        if not isinstance(raw, dict):
            raise ConfigError(f"study spec {path}: expected a mapping of name, out, seeds, tasks, variants")
        known = {"name", "out", "seeds", "tasks", "variants", "baseline", "common"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"study spec {path}: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
        for key in ("tasks", "variants"):
            if not isinstance(raw.get(key), dict) or not raw[key]:
                raise ConfigError(f"study spec {path}: {key!r} must map names to lists of gtpo-train flags")
            for name, flags in raw[key].items():
                if not isinstance(flags, list) or not all(isinstance(f, (str, int, float)) for f in flags):
                    raise ConfigError(f"study spec {path}: {key}.{name} must be a list of flags")
                if "/" in str(name) or not str(name):
                    raise ConfigError(f"study spec {path}: {key} name {name!r} must be a plain folder name")
        seeds = raw.get("seeds")
        if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) and s >= 0 for s in seeds):
            raise ConfigError(f"study spec {path}: 'seeds' must be a list of non-negative integers")
        baseline = raw.get("baseline", next(iter(raw["variants"])))
        if baseline not in raw["variants"]:
            raise ConfigError(f"study spec {path}: baseline {baseline!r} is not one of the variants")
        common = raw.get("common", [])
        if not isinstance(common, list):
            raise ConfigError(f"study spec {path}: 'common' must be a list of flags")
        for flags in [common, *raw["tasks"].values(), *raw["variants"].values()]:
            for owned in ("--seed", "--output-dir", "--resume"):
                if owned in map(str, flags):
                    raise ConfigError(f"study spec {path}: {owned} is set by the study for each cell")
        as_flags = lambda flags: tuple(str(f) for f in flags)  # noqa: E731
        return cls(
            name=str(raw.get("name", Path(path).stem)),
            out=Path(raw.get("out", Path(path).with_suffix(""))),
            seeds=tuple(seeds),
            tasks={str(k): as_flags(v) for k, v in raw["tasks"].items()},
            variants={str(k): as_flags(v) for k, v in raw["variants"].items()},
            baseline=str(baseline),
            common=as_flags(common),
        )

    def cells(self) -> List[Cell]:
        """Every (task, variant, seed), seeds outermost: the first seeds of every variant finish first, so a study
        cut short still has pairs."""
        return [
            Cell(
                task,
                variant,
                seed,
                self.out / "runs" / task / variant / f"s{seed}",
                (*self.common, *task_flags, *variant_flags),
            )
            for seed in self.seeds
            for task, task_flags in self.tasks.items()
            for variant, variant_flags in self.variants.items()
        ]


@dataclass(frozen=True)
class Cell:
    """One ``gtpo-train`` run of a study: its task, variant and seed, its folder and its flags."""

    task: str
    variant: str
    seed: int
    folder: Path
    flags: Tuple[str, ...]

    @property
    def state(self) -> str:
        """``finished`` (a summary.json), ``interrupted`` (a checkpoint to resume from) or ``new``."""
        if (self.folder / "summary.json").exists():
            return "finished"
        if self.folder.is_dir() and checkpoints(self.folder):  # the trainer's own list: no half-written folder
            return "interrupted"
        return "new"

    def command(self) -> List[str]:
        resume = ["--resume"] if self.state == "interrupted" else []
        module = __package__ or "trainer"  # gtpo_train when installed, trainer in a checkout
        return [
            sys.executable,
            "-m",
            module,
            *self.flags,
            "--seed",
            str(self.seed),
            "--output-dir",
            str(self.folder),
            *resume,
        ]

    def summary(self) -> Optional[dict]:
        path = self.folder / "summary.json"
        return json.loads(path.read_text()) if path.exists() else None


def run_cell(cell: Cell, threads: int) -> int:
    """Runs ``cell`` (resuming it if it was interrupted, afresh if it had not reached a checkpoint) with ``threads``
    threads; its output goes to ``FOLDER.log``. Returns its exit status."""
    if cell.state == "new" and cell.folder.exists():
        shutil.rmtree(cell.folder)  # a run stopped before its first checkpoint: nothing to keep
    cell.folder.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    with open(cell.folder.with_suffix(".log"), "a") as log:
        return subprocess.run(cell.command(), stdout=log, stderr=subprocess.STDOUT, env=env).returncode


def estimate_minutes(cell: Cell, cells: Sequence[Cell]) -> Optional[float]:
    """``cell``'s time from the finished cells (start to saved model): the mean of its task and variant's, else of
    its task's, else of all; None when none has finished."""
    done = [(c, c.summary()) for c in cells if c.state == "finished"]
    for same in (
        lambda c: c.task == cell.task and c.variant == cell.variant,
        lambda c: c.task == cell.task,
        lambda c: True,
    ):
        minutes = [s["wall_minutes"] for c, s in done if same(c) and "wall_minutes" in s]
        if minutes:
            return sum(minutes) / len(minutes)
    return None


def dry_run(spec: StudySpec, jobs: int) -> List[str]:
    cells = spec.cells()
    lines = [f"study {spec.name}: {len(cells)} cells in {spec.out / 'runs'} ({jobs} at a time)"]
    owed = 0.0
    unknown = 0
    for cell in cells:
        minutes = estimate_minutes(cell, cells)
        if cell.state == "finished":
            took = f"took {cell.summary().get('wall_minutes', float('nan')):.1f} min"
        else:
            took = "about ?" if minutes is None else f"about {minutes:.1f} min"
            owed += minutes or 0.0
            unknown += minutes is None
        lines.append(f"  {cell.task}/{cell.variant}/s{cell.seed}: {cell.state}, {took}")
    left = f"{owed / jobs:.0f} min of wall time at {jobs} at a time" + (
        f" (+ {unknown} cells not estimated)" if unknown else ""
    )
    lines.append(f"left: {sum(c.state != 'finished' for c in cells)} cells, {left}")
    return lines


# ---------------------------------------------------------------------------------------------------------- report
def final_metrics(summary: dict) -> Dict[str, float]:
    """The held-out figures after training (accuracy, pass@k, maj@k, format rate) of a run's summary."""
    after = summary.get("after") or {}
    return {k: float(v) for k, v in after.items() if k.startswith(METRICS) and isinstance(v, (int, float))}


def bootstrap_interval(values: Sequence[float], samples: int = BOOTSTRAP_SAMPLES, seed: int = 0) -> Tuple[float, float]:
    """The 95 % percentile bootstrap interval of the mean of ``values`` (resampled with replacement; a fixed seed,
    so a report is the same each time it is written)."""
    if len(values) < 2:
        return (float("nan"), float("nan"))
    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(rng.choice(values) for _ in range(n)) / n for _ in range(samples))
    return means[int(0.025 * samples)], means[int(0.975 * samples) - 1]


@dataclass
class PairedDifference:
    """``variant`` minus the baseline on one task and metric, seed by seed."""

    task: str
    variant: str
    metric: str
    differences: List[float] = field(default_factory=list)

    @property
    def mean(self) -> float:
        return sum(self.differences) / len(self.differences)

    @property
    def interval(self) -> Tuple[float, float]:
        return bootstrap_interval(self.differences)

    def verdict(self) -> str:
        low, high = self.interval
        if math.isnan(low):
            return "one seed: no interval"
        if low > 0:
            return "higher"
        if high < 0:
            return "lower"
        return "no difference detectable"


def paired_differences(spec: StudySpec) -> List[PairedDifference]:
    """Each non-baseline variant against the baseline, per task and metric, over the seeds both finished."""
    results = []
    for task in spec.tasks:
        base = {c.seed: c.summary() for c in spec.cells() if c.task == task and c.variant == spec.baseline}
        for variant in spec.variants:
            if variant == spec.baseline:
                continue
            other = {c.seed: c.summary() for c in spec.cells() if c.task == task and c.variant == variant}
            pairs = [(base[s], other[s]) for s in spec.seeds if base.get(s) and other.get(s)]
            if not pairs:
                continue
            metrics = sorted(set.intersection(*(set(final_metrics(b)) & set(final_metrics(o)) for b, o in pairs)))
            for metric in metrics:
                results.append(
                    PairedDifference(
                        task, variant, metric, [final_metrics(o)[metric] - final_metrics(b)[metric] for b, o in pairs]
                    )
                )
    return results


def report(spec: StudySpec) -> str:
    """The study's report (markdown): each variant's own figures per task, the paired differences with their
    intervals, collapse counts, wall time; and one figure per task (`compare.plot`)."""
    from . import compare

    cells = spec.cells()
    finished = [c for c in cells if c.state == "finished"]
    lines = [
        f"# Study: {spec.name}",
        "",
        f"{len(finished)} of {len(cells)} cells finished; seeds {', '.join(map(str, spec.seeds))}; baseline "
        f"`{spec.baseline}`. Every cell is a `gtpo-train` run in `runs/TASK/VARIANT/sSEED/`.",
        "",
        "## Paired differences (variant minus baseline, seed by seed)",
        "",
        "Mean over seeds of the difference in each held-out figure after training, with a 95 % percentile bootstrap "
        f"interval over seeds ({BOOTSTRAP_SAMPLES} resamples; the held-out problems are the same for every seed and "
        'variant, so the seeds are the unit resampled). "No difference detectable": the interval holds 0.',
        "",
        "| task | variant | metric | seeds | mean difference | 95 % interval | per seed | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for d in paired_differences(spec):
        low, high = d.interval
        lines.append(
            f"| {d.task} | {d.variant} | {d.metric} | {len(d.differences)} | {d.mean:+.3f} | [{low:+.3f}, {high:+.3f}] "
            f"| {' '.join(f'{x:+.3f}' for x in d.differences)} | {d.verdict()} |"
        )
    lines += [
        "",
        "## Each variant",
        "",
        "| task | variant | seeds | metric | after, mean | 95 % interval over seeds | collapsed | minutes per cell |",
        "|---|---|---|---|---|---|---|---|",
    ]
    total_minutes = 0.0
    for task in spec.tasks:
        by_variant = {}
        for variant in spec.variants:
            mine = [c for c in finished if c.task == task and c.variant == variant]
            if not mine:
                continue
            loaded = [r for group in compare.load([str(c.folder) for c in mine]).values() for r in group]
            by_variant[variant] = loaded
            collapses = sum(compare.collapsed(r)[0] for r in loaded)
            minutes = [c.summary().get("wall_minutes", 0.0) for c in mine]
            total_minutes += sum(minutes)
            for metric in sorted(set.intersection(*(set(final_metrics(c.summary())) for c in mine))):
                values = [final_metrics(c.summary())[metric] for c in mine]
                low, high = bootstrap_interval(values)
                lines.append(
                    f"| {task} | {variant} | {len(mine)} | {metric} | {sum(values) / len(values):.3f} | "
                    f"[{low:.3f}, {high:.3f}] | {collapses} of {len(mine)} | {sum(minutes) / len(minutes):.1f} |"
                )
        if by_variant:  # one figure per task, every variant's curves on it
            compare.plot(by_variant, spec.out / f"{task}.png")
    lines += [
        "",
        f"Collapse: `gtpo_train.compare`'s rule ({compare.COLLAPSE_RULE}). Wall time of the finished cells: "
        f"{total_minutes:.0f} min in all. Figures: " + ", ".join(f"`{t}.png`" for t in spec.tasks) + ".",
    ]
    return "\n".join(lines) + "\n"


def run_study(spec: StudySpec, jobs: int) -> List[Tuple[Cell, int]]:
    """Runs every unfinished cell, ``jobs`` at a time; returns the cells that failed with their exit status."""
    todo = [c for c in spec.cells() if c.state != "finished"]
    threads = max(1, (os.cpu_count() or 1) // jobs)
    failed = []
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for cell, status in zip(todo, pool.map(lambda c: run_cell(c, threads), todo)):
            print(
                f"{cell.task}/{cell.variant}/s{cell.seed}: " + ("done" if status == 0 else f"exit {status}"), flush=True
            )
            if status:
                failed.append((cell, status))
    return failed


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m gtpo_train.study",
        description=__doc__.splitlines()[0],
        epilog="The spec's form: see this module's docstring or docs/studies.md.",
    )
    p.add_argument("spec", help="the study's YAML or JSON file")
    p.add_argument("--jobs", type=int, default=1, help="cells side by side (each with cores / jobs threads)")
    p.add_argument("--dry-run", action="store_true", help="list the cells, their state and estimated time")
    p.add_argument("--report-only", action="store_true", help="write the report from the finished cells")
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error("--jobs must be at least 1")
    try:
        spec = StudySpec.read(Path(args.spec))
    except ConfigError as exc:
        p.error(str(exc))
    if args.dry_run:
        print("\n".join(dry_run(spec, args.jobs)))
        return
    started = time.time()
    failed = [] if args.report_only else run_study(spec, args.jobs)
    spec.out.mkdir(parents=True, exist_ok=True)
    (spec.out / "report.md").write_text(report(spec))
    print(f"report: {spec.out / 'report.md'} ({(time.time() - started) / 60:.1f} min)")
    if failed:
        for cell, status in failed:
            print(f"failed: {cell.folder} (exit {status}; its log: {cell.folder.with_suffix('.log')})", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
