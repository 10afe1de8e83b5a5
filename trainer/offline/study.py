"""A study in one command: every (task, variant, seed) cell a plain ``gtpo-train`` run, then a paired report.

    python -m gtpo_train.offline.study SPEC [--jobs N] [--only PATTERNS] [--dry-run] [--report-only]

SPEC is a YAML or JSON file::

    name: gtpo-vs-grpo
    out: results/gtpo-vs-grpo      # cells in OUT/runs/TASK/VARIANT/sSEED/, the report in OUT/NAME.md
    seeds: [0, 1, 2, 3]
    baseline: grpo                 # each other variant is paired with it, seed by seed
    common: [--eval-size, "256"]   # flags every cell takes
    tasks:                         # name: the flags that pick the task
      arithmetic: []
      chain_sum: [--dataset, data/chain_sum.jsonl, --reward, examples/reasoning_gym/reward.py:score]
    variants:                      # name: the flags that make the variant
      base: {flags: [--steps, "0"], seeds: [0], reference: true}   # the untrained model: not paired
      grpo: [--algo, grpo]
      gtpo: [--algo, gtpo, --preset, paper]

A seed means the same prompts in the same order and the same held-out problems for every variant (the trainer seeds
its stream and its draws from ``--seed``; the held-out rows never depend on it), so each seed gives one paired
difference per metric. A cell with a ``summary.json`` is finished and skipped; one with a ``checkpoint-STEP/`` was
interrupted and continues with ``--resume``; any other is started afresh (a study survives a kill, or a move to
another machine with its folder). ``--jobs N`` runs N cells side by side, each a process of its own with
``cores / N`` threads, or the spec's ``threads`` (then every cell of the study has the same count, whatever
``--jobs`` a session runs it with). ``--only gcd/grpo,gcd/gtpo`` runs those cells only (`chosen`): one
comparison's seeds first, on a study too long for one sitting. ``--dry-run`` lists the cells, their state and an
estimate of their time from the finished ones. The report (`report`) is written when every cell has finished,
or alone with ``--report-only``.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import functools
import io
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from ..checkpoint import checkpoints
from ..config import ConfigError
from ..intervals import is_share, t_interval, wilson, with_interval
from ..precision import Machine

# The held-out figures each paired difference is taken of (those a run's summary has).
METRICS = (
    *("accuracy", "pass@", "maj@", "format_rate", "rewards/format_reward", "train entropy"),
    # one-answer collapse and reasoning (trainer/evaluation.py)
    *("distinct_answers", "top_answer_share", "reasoning_share", "mean_completion_tokens", "mean_reasoning_words"),
)
# What each of the loss's mechanisms did in a cell: the mean over its training steps of these step figures (the
# entropy filter, the conflict tokens, the clip, Clip-Cov's or KL-Cov's picks, the completions that carried any signal).
MECHANISMS = (
    ("filtered", "filtered_fraction"),
    ("conflict: amplified", "amplified_fraction"),
    ("conflict: skipped", "skipped_fraction"),
    ("clipped", "clip_fraction"),
    ("cov-picked", "cov_fraction"),
    ("with signal", "signal_fraction"),
)
BOOTSTRAP_SAMPLES = 10000
MIN_SEEDS_FOR_VERDICT = 3


VARIANT_KEYS = ("flags", "seeds", "tasks", "against", "reference")


@dataclass(frozen=True)
class Variant:
    """One variant of a study: its ``gtpo-train`` flags; the seeds and tasks it runs (None: all the study's); the
    variant it is paired with (None: the study's baseline); a reference (the untrained model, say) is not paired."""

    name: str
    flags: Tuple[str, ...]
    seeds: Optional[Tuple[int, ...]] = None
    tasks: Optional[Tuple[str, ...]] = None
    against: Optional[str] = None
    reference: bool = False


def run_settings(raw: dict, bad) -> Tuple[bool, Optional[int]]:
    """A raw spec's ``keep_models`` and ``threads``, checked (``bad(why)`` makes the error)."""
    keep_models = raw.get("keep_models", True)
    if not isinstance(keep_models, bool):
        raise bad("'keep_models' must be true or false")
    threads = raw.get("threads")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise bad(f"'threads' must be a positive integer, the threads of every cell (got {threads!r})")
    return keep_models, threads


@dataclass(frozen=True)
class StudySpec:
    """A study: its tasks (each a name and the ``gtpo-train`` flags that pick it) and variants, its seeds, the flags
    every cell takes, the variant the others are paired with, and where its cells and report go."""

    name: str
    out: Path
    seeds: Tuple[int, ...]
    tasks: Dict[str, Tuple[str, ...]]
    variants: Dict[str, Variant]
    baseline: str
    common: Tuple[str, ...] = ()
    # False: a finished cell's checkpoints and final model are deleted (its figures and logs stay): 2 GB a cell.
    keep_models: bool = True
    # Threads per cell, whatever --jobs: every cell of a study with the same count, so that a pair differs in its one
    # change only (a product's float32 sums can be split differently over another number of threads). None: the
    # machine's cores / jobs.
    threads: Optional[int] = None

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
        return cls.from_dict(raw, str(path))

    @classmethod
    def from_dict(cls, raw: dict, path: str) -> StudySpec:
        def bad(why: str) -> ConfigError:
            return ConfigError(f"study spec {path}: {why}")

        def seed_list(value, key: str) -> Tuple[int, ...]:
            if not isinstance(value, list) or not value or not all(isinstance(s, int) and s >= 0 for s in value):
                raise bad(f"{key!r} must be a list of non-negative integers")
            return tuple(value)

        def flag_list(value, key: str) -> Tuple[str, ...]:
            if not isinstance(value, list) or not all(isinstance(f, (str, int, float)) for f in value):
                raise bad(f"{key} must be a list of flags")
            for owned in ("--seed", "--output-dir", "--resume"):
                if owned in map(str, value):
                    raise bad(f"{owned} is set by the study for each cell")
            return tuple(str(f) for f in value)

        known = {"name", "out", "seeds", "tasks", "variants", "baseline", "common", "keep_models", "threads"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise bad(f"unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
        for key in ("tasks", "variants"):
            if not isinstance(raw.get(key), dict) or not raw[key]:
                raise bad(f"{key!r} must map names to lists of gtpo-train flags")
            for name in raw[key]:
                if "/" in str(name) or not str(name):
                    raise bad(f"{key} name {name!r} must be a plain folder name")
        seeds = seed_list(raw.get("seeds"), "seeds")
        tasks = {str(k): flag_list(v, f"tasks.{k}") for k, v in raw["tasks"].items()}
        variants = {}
        for name, value in raw["variants"].items():
            key = f"variants.{name}"
            plain = not isinstance(value, dict)
            if plain:
                value = {"flags": value}
            extra = sorted(set(value) - set(VARIANT_KEYS))
            if extra or "flags" not in value:
                raise bad(
                    f"{key} must be a list of flags or a mapping of {', '.join(VARIANT_KEYS)} with flags "
                    f"(got {extra[0]!r})"
                    if extra
                    else f"{key} has no 'flags'"
                )
            own_tasks = value.get("tasks")
            if own_tasks is not None:
                if not isinstance(own_tasks, list) or not own_tasks or not set(own_tasks) <= set(tasks):
                    raise bad(f"{key}.tasks must list some of the tasks ({', '.join(tasks)})")
                own_tasks = tuple(map(str, own_tasks))
            if not isinstance(value.get("reference", False), bool):
                raise bad(f"{key}.reference must be true or false")
            variants[str(name)] = Variant(
                name=str(name),
                flags=flag_list(value["flags"], key if plain else f"{key}.flags"),
                seeds=None if value.get("seeds") is None else seed_list(value["seeds"], f"{key}.seeds"),
                tasks=own_tasks,
                against=None if value.get("against") is None else str(value["against"]),
                reference=value.get("reference", False),
            )
        baseline = str(raw.get("baseline", next(iter(variants))))
        if baseline not in variants:
            raise bad(f"baseline {baseline!r} is not one of the variants")
        if variants[baseline].reference or variants[baseline].seeds or variants[baseline].tasks:
            raise bad(f"baseline {baseline!r} must run every task and seed, and not be a reference")
        for variant in variants.values():
            if variant.against is not None and variant.against not in variants:
                raise bad(f"variants.{variant.name}.against: {variant.against!r} is not one of the variants")
        keep_models, threads = run_settings(raw, bad)
        return cls(
            name=str(raw.get("name", Path(path).stem)),
            out=Path(raw.get("out", Path(path).with_suffix(""))),
            seeds=seeds,
            tasks=tasks,
            variants=variants,
            baseline=baseline,
            common=flag_list(raw.get("common", []), "'common'"),
            keep_models=keep_models,
            threads=threads,
        )

    def threads_per_cell(self, jobs: int) -> int:
        """Each cell's threads with ``jobs`` cells side by side: the spec's ``threads``, else the cores / jobs."""
        return self.threads or max(1, (os.cpu_count() or 1) // jobs)

    @property
    def report_path(self) -> Path:
        """``OUT/NAME.md``: studies that share a folder (and so the cells they have in common) keep their reports."""
        return self.out / f"{self.name}.md"

    def figure(self, task: str) -> Path:
        return self.out / f"{self.name}-{task}.png"

    def check_shared_cells(self) -> None:
        """A finished or interrupted cell run with other flags (another spec sharing this folder, or this one
        edited) is a `ConfigError` naming it: its figures would be passed off as this spec's."""
        for cell in self.cells():
            recorded = cell.recorded_flags()
            if recorded is not None and recorded != list(cell.flags):
                raise ConfigError(
                    f"study {self.name}: {cell.folder} was run with other flags ({' '.join(recorded)}) than this "
                    f"spec gives it ({' '.join(cell.flags)}): give the variant another name, or delete the folder"
                )

    def pairs(self) -> List[Tuple[str, str, str]]:
        """Every ``(task, variant, partner)`` the report compares, tasks outermost."""
        return [
            (task, variant, partner)
            for task in self.tasks
            for variant in self.variants
            if (partner := self.partner(variant)) is not None
        ]

    def seeds_of(self, variant: str) -> Tuple[int, ...]:
        return self.variants[variant].seeds or self.seeds

    def tasks_of(self, variant: str) -> Tuple[str, ...]:
        return self.variants[variant].tasks or tuple(self.tasks)

    def partner(self, variant: str) -> Optional[str]:
        """The variant ``variant`` is paired with: its own ``against``, else the baseline; None for the baseline
        itself and for a reference."""
        mine = self.variants[variant]
        if mine.reference or variant == self.baseline:
            return None
        return mine.against or self.baseline

    def cells(self) -> List[Cell]:
        """Every (task, variant, seed) the variants run, seeds outermost: the first seeds of every variant finish
        first, so a study cut short still has pairs."""
        all_seeds = sorted(set(self.seeds).union(*(v.seeds or () for v in self.variants.values())))
        return [
            Cell(
                task,
                variant.name,
                seed,
                self.out / "runs" / task / variant.name / f"s{seed}",
                (*self.common, *task_flags, *variant.flags),
            )
            for seed in all_seeds
            for task, task_flags in self.tasks.items()
            for variant in self.variants.values()
            if seed in self.seeds_of(variant.name) and task in self.tasks_of(variant.name)
        ]


@functools.cache
def steps_of(flags: Tuple[str, ...]) -> int:
    """The training steps ``gtpo-train`` takes with ``flags`` (its own reading: command line over --config file)."""
    from ..config import parse_args

    return parse_args(list(flags)).steps


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

    @property
    def trains(self) -> bool:
        """Whether the cell takes training steps (``--steps 0``: the untrained model, evaluated only)."""
        return steps_of(self.flags) > 0

    def command(self) -> List[str]:
        resume = ["--resume"] if self.state == "interrupted" else []
        module = (__package__ or "trainer.offline").rpartition(".")[0]  # the trainer: gtpo_train or trainer
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

    def recorded_flags(self) -> Optional[List[str]]:
        """The flags the cell was started with (``study-cell.json``), None before it was."""
        path = self.folder / "study-cell.json"
        return json.loads(path.read_text())["flags"] if path.exists() else None

    def summary(self) -> Optional[dict]:
        path = self.folder / "summary.json"
        return json.loads(path.read_text()) if path.exists() else None


def code_version() -> Optional[str]:
    """The commit the study runs from, ``+changes`` after it where tracked files differ from it (None outside a git
    checkout): a study spanning sessions records what each cell ran, so that a pair run across a code change shows."""
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit + ("+changes" if changed else "")


def run_cell(cell: Cell, threads: int, keep_models: bool = True) -> int:
    """Runs ``cell`` (resuming it if it was interrupted, afresh if it had not reached a checkpoint) with ``threads``
    threads; its output goes to ``FOLDER.log``. Without ``keep_models``, a finished cell's checkpoints and final
    model are deleted. Returns its exit status."""
    if cell.state == "new" and cell.folder.exists():
        shutil.rmtree(cell.folder)  # a run stopped before its first checkpoint: nothing to keep
    cell.folder.mkdir(parents=True, exist_ok=True)
    record = {"flags": list(cell.flags), "threads": threads, "code": code_version(), "machine": str(Machine.this())}
    (cell.folder / "study-cell.json").write_text(json.dumps(record))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    with open(cell.folder.with_suffix(".log"), "a") as log:
        status = subprocess.run(cell.command(), stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    if status == 0 and not keep_models and cell.state == "finished":
        for folder in [*(p for _, p in checkpoints(cell.folder)), cell.folder / "final"]:
            shutil.rmtree(folder, ignore_errors=True)
    return status


def estimate_minutes(cell: Cell, cells: Sequence[Cell]) -> Optional[float]:
    """``cell``'s time from the finished cells (start to saved model): the mean of its task and variant's, else of
    its variant's on other tasks, else of its task's cells of its kind (training, or evaluating only), else of all
    of its kind; None when none has finished (an evaluation-only cell's half hour says nothing of a training
    cell's)."""
    done = [(c, c.summary()) for c in cells if c.state == "finished"]
    for same in (
        lambda c: c.task == cell.task and c.variant == cell.variant,
        lambda c: c.variant == cell.variant,
        lambda c: c.task == cell.task and c.trains == cell.trains,
        lambda c: c.trains == cell.trains,
    ):
        minutes = [s["wall_minutes"] for c, s in done if same(c) and "wall_minutes" in s]
        if minutes:
            return sum(minutes) / len(minutes)
    return None


def check_cells(spec: StudySpec, only: Optional[str] = None) -> None:
    """Every unfinished cell's flags as ``gtpo-train`` reads them, then the trainer's own checks before it loads
    anything (`session.check_before_loading`: prompts over processes, the model's source, trackers) and its task
    as the trainer loads it (data, prompts, rewards), once per distinct set of flags. A mistake that would stop
    every cell in its first second is one `ConfigError` naming a cell before any cell runs. A spec's paths are
    read from the folder the study runs in, as its cells read them. Only the cells ``only`` names are checked: a
    session that runs one task's cells needs no other task's data."""
    from ..config import parse_args
    from ..session import check_before_loading
    from ..task import load_task

    seen = set()
    for cell in chosen(spec.cells(), only):
        if cell.state == "finished" or tuple(cell.flags) in seen:
            continue
        seen.add(tuple(cell.flags))
        name = f"{cell.task}/{cell.variant}"
        said = io.StringIO()
        try:
            with contextlib.redirect_stderr(said):
                config = parse_args(cell.flags)
        except SystemExit:  # gtpo-train's own one-line error
            raise ConfigError(f"cell {name}: {said.getvalue().strip()}") from None
        try:
            check_before_loading(config, world=1)  # a cell is one process
            load_task(config, train_size=config.prompts_per_step)
        except ConfigError as exc:
            raise ConfigError(
                f"cell {name}: {exc} (a spec's paths are read from the folder the study runs in, {Path.cwd()})"
            ) from None


def dry_run(spec: StudySpec, jobs: int, only: Optional[str] = None) -> List[str]:
    every = spec.cells()
    cells = chosen(every, only)
    threads = spec.threads_per_cell(jobs)
    lines = [
        f"study {spec.name}: {len(cells)} cells"
        + (f" of {len(every)}" if len(cells) < len(every) else "")
        + f" in {spec.out / 'runs'} ({jobs} at a time, {threads} thread{'s' if threads > 1 else ''} each)"
    ]
    owed = 0.0
    unknown = 0
    for cell in cells:
        minutes = estimate_minutes(cell, every)
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
FINAL_ENTROPY = "train entropy, last 3 steps"


def cell_final_entropy(cell: Cell) -> Optional[float]:
    """The mean train entropy (nats per token) of the cell's last 3 steps, from its metrics.jsonl; None without
    train rows."""
    path = cell.folder / "metrics.jsonl"
    if not path.exists():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    train = [r for r in rows if r.get("kind") == "train"]
    return final_entropy({"train": train}) if train else None


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
    """``variant`` minus ``partner`` on one task and metric, seed by seed."""

    task: str
    variant: str
    partner: str
    metric: str
    differences: List[float] = field(default_factory=list)

    @property
    def mean(self) -> float:
        return sum(self.differences) / len(self.differences)

    @property
    def interval(self) -> Tuple[float, float]:
        """The 95 % Student's t interval of the mean difference over seeds (what the verdict reads)."""
        return t_interval(self.differences)

    @property
    def bootstrap(self) -> Tuple[float, float]:
        """The 95 % percentile bootstrap interval over seeds: shown beside, too narrow for a few seeds."""
        return bootstrap_interval(self.differences)

    def verdict(self) -> str:
        """ "higher", "lower" or "no difference detectable" by the t interval, from three seeds on: two seeds that
        happen to agree (say one problem apart both times) give an interval of zero width, not evidence."""
        low, high = self.interval
        if math.isnan(low):
            return "one seed: no interval"
        if len(self.differences) < MIN_SEEDS_FOR_VERDICT:
            return "two seeds: no verdict"
        if low > 0:
            return "higher"
        if high < 0:
            return "lower"
        return "no difference detectable"


def paired_differences(spec: StudySpec) -> List[PairedDifference]:
    """Each paired variant against its partner (`StudySpec.partner`), per task and metric, over the seeds both
    finished."""
    summaries = {}
    for c in spec.cells():
        summary = c.summary()
        if summary is not None:
            summaries[(c.task, c.variant, c.seed)] = {**summary, "after": {**(summary.get("after") or {})}}
            entropy = cell_final_entropy(c)
            if entropy is not None:  # paired too: the paper's claim is about entropy
                summaries[(c.task, c.variant, c.seed)]["after"][FINAL_ENTROPY] = entropy
    results = []
    for task, variant, partner in spec.pairs():
        pairs = [
            (summaries[(task, partner, s)], summaries[(task, variant, s)])
            for s in spec.seeds_of(variant)
            if summaries.get((task, partner, s)) and summaries.get((task, variant, s))
        ]
        if not pairs:
            continue
        metrics = sorted(set.intersection(*(set(final_metrics(b)) & set(final_metrics(o)) for b, o in pairs)))
        for metric in metrics:
            results.append(
                PairedDifference(
                    task,
                    variant,
                    partner,
                    metric,
                    [final_metrics(o)[metric] - final_metrics(b)[metric] for b, o in pairs],
                )
            )
    return results


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def interval_text(low: float, high: float, signed: bool = False) -> str:
    if math.isnan(low):
        return "-"
    return f"[{low:+.3f}, {high:+.3f}]" if signed else f"[{low:.3f}, {high:.3f}]"


def load_runs(cells: Sequence[Cell], untrained: Optional[dict]) -> List[dict]:
    """``cells``' runs as `gtpo_train.offline.compare` loads them; where the cells did not evaluate before training
    (``--no-eval-before``), the task's untrained-model figures (``untrained``: a reference cell's final evaluation)
    are their step-0 evaluation, so that the collapse rule's peak and the curves start from it."""
    from . import compare

    runs = [r for group in compare.load([str(c.folder) for c in cells]).values() for r in group]
    for run in runs:
        if untrained is not None and not any(e["step"] == 0 for e in run["evals"]):
            run["evals"].insert(0, {**untrained, "step": 0})
    return runs


def final_entropy(run: dict) -> float:
    """The mean train entropy (nats per token) of a run's last 3 steps."""
    last = [t["entropy"] for t in run["train"][-3:]]
    return mean(last) if last else float("nan")


def reference_section(spec: StudySpec, finished: Sequence[Cell]) -> Tuple[List[str], Dict[str, dict]]:
    """The reference cells' figures (markdown lines), and each task's untrained-model figures (its ``--steps 0``
    reference cell's evaluation)."""
    lines: List[str] = []
    untrained: Dict[str, dict] = {}
    if not any(v.reference for v in spec.variants.values()):
        return lines, untrained
    lines += [
        "",
        "## Reference cells (not paired)",
        "",
        "Held-out figures of each reference cell (95 % Wilson interval over the held-out problems).",
        "",
        "| task | variant | seed | problems | metric | figure |",
        "|---|---|---|---|---|---|",
    ]
    for cell in finished:
        if not spec.variants[cell.variant].reference:
            continue
        summary = cell.summary()
        n = summary.get("eval_problems")
        if summary.get("steps") == 0:  # the untrained model: the task's step-0 evaluation
            untrained.setdefault(cell.task, summary["after"])
        for metric, value in sorted(final_metrics(summary).items()):
            figure = with_interval(value, n) if n and is_share(metric) else f"{value:.3f}"
            lines.append(f"| {cell.task} | {cell.variant} | {cell.seed} | {n} | {metric} | {figure} |")
    return lines, untrained


def paired_section(spec: StudySpec) -> List[str]:
    """The paired differences' table (markdown lines)."""
    lines = [
        "",
        "## Paired differences (variant minus its partner, seed by seed)",
        "",
        "Mean over seeds of the difference in each held-out figure after training, with its 95 % Student's t "
        "interval over the seeds' differences (the held-out problems are the same for every seed and variant, so a "
        "seed's difference already holds the problems' noise; the seeds are the independent unit), and beside it "
        f"the percentile bootstrap over seeds ({BOOTSTRAP_SAMPLES} resamples), which is too narrow for a few seeds. "
        '"No difference detectable": the t interval holds 0; a verdict needs three seeds or more.',
        "",
        "| task | variant | against | metric | seeds | mean difference | 95 % t interval | bootstrap | per seed "
        "| verdict |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for d in paired_differences(spec):
        lines.append(
            f"| {d.task} | {d.variant} | {d.partner} | {d.metric} | {len(d.differences)} | {d.mean:+.3f} "
            f"| {interval_text(*d.interval, signed=True)} | {interval_text(*d.bootstrap, signed=True)} "
            f"| {' '.join(f'{x:+.3f}' for x in d.differences)} | {d.verdict()} |"
        )
    return lines


def held_out_answers(cell: Cell) -> Optional[List[str]]:
    """The cell's final greedy answers, problem by problem (its ``held-out-answers.jsonl``), or None."""
    path = cell.folder / "held-out-answers.jsonl"
    if not path.exists():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [str(row["answer"]) for row in sorted(rows, key=lambda row: row["problem"])]


def cell_machine(cell: Cell) -> Optional[str]:
    """The machine a cell ran on, as text: its summary's (where it finished), else its ``study-cell.json``'s (where
    it last started); None where neither says (cells run before either recorded it)."""
    summary = cell.summary() or {}
    if summary.get("machine"):
        recorded = summary["machine"]
        return str(Machine(**{**recorded, "bf16_units": tuple(recorded["bf16_units"])}))
    path = cell.folder / "study-cell.json"
    return json.loads(path.read_text()).get("machine") if path.exists() else None


def machines_lines(spec: StudySpec, finished: Sequence[Cell]) -> List[str]:
    """Which machines the finished cells ran on, and each pair whose two cells ran on different ones (bf16 rounds
    differently on CPUs with and without bf16 units, and a GPU's kernels differ again: such a pair's difference
    holds the machines' difference too)."""
    machine_of = {(c.task, c.variant, c.seed): cell_machine(c) for c in finished}  # each cell's files read once
    machines = Counter(m or "not recorded" for m in machine_of.values())
    lines = ["Machines: " + "; ".join(f"{m}: {n} cell{'s' if n > 1 else ''}" for m, n in machines.items()) + "."]
    mixed = []
    for task, variant, partner in spec.pairs():
        for seed in spec.seeds_of(variant):
            mine, theirs = machine_of.get((task, variant, seed)), machine_of.get((task, partner, seed))
            if mine and theirs and mine != theirs:
                mixed.append(f"{task}/{variant}/s{seed} against {partner}")
    if mixed:
        lines.append(
            "Pairs run on different machines (their difference holds the machines' too): " + ", ".join(mixed) + "."
        )
    return lines


def agreement_section(spec: StudySpec) -> List[str]:
    """For each paired variant and seed where both cells recorded their answers: the share of held-out problems on
    which the two give the same greedy answer (1.00: the loss made no difference to any greedy answer)."""
    rows = []
    cells = {(c.task, c.variant, c.seed): c for c in spec.cells()}
    for task, variant, partner in spec.pairs():
        shares = []
        for seed in spec.seeds_of(variant):
            mine, theirs = (
                held_out_answers(cells[(task, v, seed)]) if (task, v, seed) in cells else None
                for v in (variant, partner)
            )
            if mine and theirs and len(mine) == len(theirs):
                shares.append(f"s{seed}: {sum(a == b for a, b in zip(mine, theirs)) / len(mine):.2f}")
        if shares:
            rows.append(f"| {task} | {variant} | {partner} | {'; '.join(shares)} |")
    if not rows:
        return []
    return [
        "",
        "## The same greedy answer, problem by problem",
        "",
        "Where both cells of a pair recorded their final greedy answers: the share of held-out problems on which the "
        "variant and its partner give the same answer.",
        "",
        "| task | variant | against | per seed |",
        "|---|---|---|---|",
        *rows,
    ]


def figure_rows(task: str, variant: str, summaries: Sequence[dict], untrained: Optional[dict] = None) -> List[str]:
    """One table row per held-out figure of a variant's finished cells on a task: mean, t interval, seed spread,
    one run's own Wilson interval width, and the change from the untrained model's figure (``untrained``: its
    reference cell's, where the task has one), marked where it is larger than the seed spread: training moved the
    figure by more than the seeds disagree."""
    rows = []
    for metric in sorted(set.intersection(*(set(final_metrics(s)) for s in summaries))):
        values = [final_metrics(s)[metric] for s in summaries]
        widths = [
            wilson(v, s["eval_problems"])[1] - wilson(v, s["eval_problems"])[0]
            for v, s in zip(values, summaries)
            if is_share(metric) and s.get("eval_problems")
        ]
        spread = max(values) - min(values)
        before = (untrained or {}).get(metric)
        if isinstance(before, (int, float)):
            change = mean(values) - before
            beyond = " (> spread)" if len(values) > 1 and abs(change) > spread else ""
            from_untrained = f"{before:.3f} | {change:+.3f}{beyond}"
        else:
            from_untrained = "- | -"
        rows.append(
            f"| {task} | {variant} | {len(summaries)} | {metric} | {mean(values):.3f} | "
            f"{interval_text(*t_interval(values))} | {spread:.3f} | "
            f"{f'{mean(widths):.3f}' if widths else '-'} | {from_untrained} |"
        )
    return rows


# A run whose final greedy answers are one answer on at least this share of the held-out problems has collapsed to
# it (a constant answer scores the share of the problems it happens to fit), whatever its accuracy.
ONE_ANSWER = 0.9


@dataclass(frozen=True)
class AnswerSpread:
    """A cell's final greedy answers (its ``held-out-answers.jsonl``): how many distinct ones, and the most
    common with its share of the problems."""

    distinct: int
    top: str
    share: float

    @classmethod
    def of(cls, cell: Cell) -> Optional[AnswerSpread]:
        """None for a cell without the file (runs before it was written)."""
        answers = held_out_answers(cell)
        if not answers:
            return None
        top, n = Counter(answers).most_common(1)[0]
        return cls(len(set(answers)), top, n / len(answers))

    @property
    def collapsed(self) -> bool:
        return self.share >= ONE_ANSWER

    def __str__(self) -> str:
        return f"{self.distinct} / {self.top[:12]!r} {self.share:.2f}"


def stability_row(
    task: str, variant: str, runs: Sequence[dict], minutes: Sequence[float], cells: Sequence[Cell] = ()
) -> str:
    """A variant's collapses (`gtpo_train.offline.compare`'s rule, each seed's signs), its greedy answers' spread
    (`answer_profile`, per seed where recorded), final and lowest train entropy and minutes per cell on a task, as
    a table row."""
    from . import compare

    spreads = {c.seed: AnswerSpread.of(c) for c in cells}
    verdicts = []
    for run in runs:
        fell, why = compare.collapsed(run)
        spread = spreads.get(run.get("seed"))
        if spread is not None and spread.collapsed:
            why = "; ".join(filter(None, [why, f"one greedy answer ({spread.top[:12]!r}) on {spread.share:.2f}"]))
            fell = True
        verdicts.append((run.get("seed"), fell, why))
    entropies = [final_entropy(r) for r in runs]
    signs = "; ".join(f"s{seed}: {why}" for seed, fell, why in verdicts if fell) or "-"
    profiles = "; ".join(f"s{seed}: {spread}" for seed, spread in spreads.items() if spread) or "-"
    return (
        f"| {task} | {variant} | {sum(fell for _, fell, _ in verdicts)} of {len(runs)} | {signs} | {profiles} | "
        f"{mean(entropies):.3f} {interval_text(*t_interval(entropies))} | "
        f"{min(t['entropy'] for r in runs for t in r['train']):.3f} | {mean(minutes):.1f} |"
    )


def mechanisms_row(task: str, variant: str, runs: Sequence[dict]) -> str:
    """A variant's mechanisms on a task (`MECHANISMS`): each cell's mean over its training steps, then the mean over
    the cells with the smallest and largest cell's, as a table row."""
    cells = []
    for _, key in MECHANISMS:
        per_run = [mean(values) for r in runs if (values := [t[key] for t in r["train"] if t.get(key) is not None])]
        cells.append(f"{mean(per_run):.3f} ({min(per_run):.3f}-{max(per_run):.3f})" if per_run else "-")
    return f"| {task} | {variant} | {len(runs)} | " + " | ".join(cells) + " |"


def report(spec: StudySpec) -> str:
    """The study's report (markdown): the untrained model's figures, the paired differences with their intervals,
    each variant's figures, its collapses and entropy, wall time; and one figure per task (`compare.plot`)."""
    from . import compare

    cells = spec.cells()
    finished = [c for c in cells if c.state == "finished"]
    references, untrained = reference_section(spec, finished)
    figures, stability, mechanisms, drawn, total_minutes = [], [], [], [], 0.0
    for task in spec.tasks:
        by_variant = {}
        for variant in spec.variants:
            mine = [c for c in finished if c.task == task and c.variant == variant]
            summaries = [c.summary() for c in mine]
            minutes = [s.get("wall_minutes", 0.0) for s in summaries]
            total_minutes += sum(minutes)
            if not summaries or spec.variants[variant].reference:
                continue
            by_variant[variant] = runs = load_runs(mine, untrained.get(task))
            figures += figure_rows(task, variant, summaries, untrained.get(task))
            stability.append(stability_row(task, variant, runs, minutes, mine))
            mechanisms.append(mechanisms_row(task, variant, runs))
        if by_variant:  # one figure per task, every variant's curves on it
            compare.plot(by_variant, spec.figure(task))
            drawn.append(spec.figure(task).name)
    lines = [
        f"# Study: {spec.name}",
        "",
        f"{len(finished)} of {len(cells)} cells finished; seeds {', '.join(map(str, spec.seeds))}; baseline "
        f"`{spec.baseline}`. Every cell is a `gtpo-train` run in `runs/TASK/VARIANT/sSEED/`.",
        *references,
        *paired_section(spec),
        *agreement_section(spec),
        "",
        "## Each variant",
        "",
        "After training: the mean over seeds with its 95 % t interval; the seed spread (largest minus smallest); "
        "one run's own 95 % Wilson interval width over the held-out problems (mean over seeds); the untrained "
        "model's figure (the task's reference cell) and the change from it, marked \"> spread\" where it is larger "
        "than the seed spread (training moved the figure by more than the seeds disagree).",
        "",
        "| task | variant | seeds | metric | mean | 95 % t interval | seed spread | one run's interval width | "
        "untrained | change from untrained |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *figures,
        "",
        "## Collapses, entropy, time",
        "",
        f"Collapse: `gtpo_train.offline.compare`'s rule ({compare.COLLAPSE_RULE}); the untrained model's figures "
        f"count as each run's first evaluation; and, where the cell recorded its answers, one greedy answer on at "
        f"least {ONE_ANSWER:.0%} of the held-out problems. Greedy answers (cells that wrote `held-out-answers.jsonl`): "
        "how many distinct answers the final greedy completions gave, and the most common with its share of the "
        "problems. Entropy: the train entropy (nats per token) of the last 3 steps, mean over seeds with its t "
        "interval, and the lowest of any step of any seed.",
        "",
        "| task | variant | collapsed | signs | greedy answers: distinct / most common, share | final entropy "
        "[t interval] | lowest entropy | minutes per cell |",
        "|---|---|---|---|---|---|---|---|",
        *stability,
        "",
        "## What the loss's mechanisms did",
        "",
        "Each cell's mean over its training steps of the share of completions the entropy filter dropped, of tokens "
        "that were conflict tokens (amplified in positive completions, skipped in negative ones), of tokens the clip "
        "bound on, and of completions that carried any signal; the mean over seeds (smallest-largest cell). A "
        "mechanism that stays near 0 was not tested by its cells.",
        "",
        "| task | variant | seeds | " + " | ".join(name for name, _ in MECHANISMS) + " |",
        "|---|---|---|" + "---|" * len(MECHANISMS),
        *mechanisms,
        "",
        f"Wall time of the finished cells: {total_minutes:.0f} min in all (cells side by side overlap). Figures: "
        + (", ".join(f"`{name}`" for name in drawn) or "none yet")
        + ".",
        "",
        *machines_lines(spec, finished),
    ]
    return "\n".join(lines) + "\n"


def chosen(cells: Sequence[Cell], only: Optional[str]) -> List[Cell]:
    """The ``cells`` named by ``only``: comma-separated patterns of ``TASK/VARIANT/sSEED`` (shell wildcards:
    ``gcd/*``, ``*/grpo/s0``, ``letter_counting/gtpo*``; a pattern without a seed takes every seed); all of them
    for None. A pattern that names no cell is a `ConfigError`: a typo must not run nothing, or something else."""
    if only is None:
        return list(cells)
    patterns = [p.strip() for p in only.split(",") if p.strip()]
    if not patterns:
        raise ConfigError("--only: give comma-separated TASK/VARIANT[/sSEED] patterns, such as 'gcd/grpo,gcd/gtpo'")
    names = {cell: f"{cell.task}/{cell.variant}/s{cell.seed}" for cell in cells}

    def named(name: str, pattern: str) -> bool:
        return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, pattern + "/*")  # any seed

    for pattern in patterns:
        if not any(named(name, pattern) for name in names.values()):
            raise ConfigError(f"--only: {pattern!r} names no cell of this study (cells are TASK/VARIANT/sSEED)")
    return [cell for cell in cells if any(named(names[cell], p) for p in patterns)]


def run_study(spec: StudySpec, jobs: int, only: Optional[str] = None) -> List[Tuple[Cell, int]]:
    """Runs every unfinished cell (of those ``only`` names, `chosen`), ``jobs`` at a time, each with the spec's
    ``threads`` (else cores / jobs); returns the cells that failed with their exit status."""
    todo = [c for c in chosen(spec.cells(), only) if c.state != "finished"]
    threads = spec.threads_per_cell(jobs)
    failed = []
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for cell, status in zip(todo, pool.map(lambda c: run_cell(c, threads, spec.keep_models), todo)):
            print(
                f"{cell.task}/{cell.variant}/s{cell.seed}: " + ("done" if status == 0 else f"exit {status}"), flush=True
            )
            if status:
                failed.append((cell, status))
    return failed


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m gtpo_train.offline.study",
        description=__doc__.splitlines()[0],
        epilog="The spec's form: see this module's docstring or docs/studies.md.",
    )
    p.add_argument("spec", help="the study's YAML or JSON file")
    p.add_argument("--jobs", type=int, default=1, help="cells side by side (each with cores / jobs threads)")
    p.add_argument(
        "--only",
        metavar="PATTERNS",
        help="run only these cells: comma-separated TASK/VARIANT[/sSEED] patterns with shell wildcards "
        "('gcd/grpo,gcd/gtpo', '*/base'); the report covers every finished cell",
    )
    p.add_argument("--dry-run", action="store_true", help="list the cells, their state and estimated time")
    p.add_argument("--report-only", action="store_true", help="write the report from the finished cells")
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error("--jobs must be at least 1")
    try:
        spec = StudySpec.read(Path(args.spec))
        spec.check_shared_cells()
        chosen(spec.cells(), args.only)  # a pattern that names no cell: one line, before anything runs
        if not args.report_only:
            check_cells(spec, args.only)
    except ConfigError as exc:
        p.error(str(exc))
    if args.dry_run:
        print("\n".join(dry_run(spec, args.jobs, args.only)))
        return
    started = time.time()
    failed = [] if args.report_only else run_study(spec, args.jobs, args.only)
    spec.out.mkdir(parents=True, exist_ok=True)
    spec.report_path.write_text(report(spec))
    print(f"report: {spec.report_path} ({(time.time() - started) / 60:.1f} min)")
    if failed:
        for cell, status in failed:
            log = cell.folder.with_suffix(".log")
            last = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
            said = f": {last[0]}" if last else ""
            print(f"failed: {cell.folder} (exit {status}; its log: {log}){said}", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
