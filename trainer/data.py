"""A task's rows, as `datasets.Dataset`: the built-in arithmetic generator, or the user's data through ``datasets``.

- ``arithmetic``: a built-in, seeded, unlimited generator of word problems in graded difficulty (columns
  ``prompt``, ``answer``).
- a hub id (``load_dataset(id, --dataset-config, split=--dataset-split)``: needs a network the first time);
- local files: ``.jsonl``, ``.json``, ``.csv``, ``.parquet``, or a glob of them (``data/*.jsonl``);
- a folder written by ``save_to_disk`` (a ``Dataset``, or a ``DatasetDict`` read at ``--dataset-split``).

Every column travels with its row to the reward functions; the prompt column is checked here (`check_prompts`).
"""

from __future__ import annotations

import glob
import random
from pathlib import Path
from typing import AbstractSet, Optional, Tuple

from datasets import Dataset, DatasetDict, load_dataset, load_from_disk
from datasets.utils.logging import disable_progress_bar, enable_progress_bar, is_progress_bar_enabled

from .config import ConfigError, TrainConfig

NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo", "Kofi", "Lena"]
ITEMS = ["apples", "books", "coins", "stickers", "marbles", "pencils", "shells", "cards", "stamps", "eggs"]


def _problem(rng: random.Random, difficulty: int, kind: Optional[int] = None) -> Tuple[str, int]:
    """One problem; its operation ``kind`` (0 to ``difficulty``) drawn after its numbers unless given."""
    name, other = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    hi = [0, 9, 20, 50, 100][difficulty]
    a, b, c = rng.randint(2, hi), rng.randint(2, hi), rng.randint(1, hi)
    if kind is None:
        kind = rng.randrange(difficulty + 1)
    if kind == 0:
        return f"{name} has {a} {item}. {other} gives {name} {b} more. How many {item} does {name} have now?", a + b
    if kind == 1:
        a, b = max(a, b), min(a, b)
        return f"{name} has {a} {item} and gives {b} of them to {other}. How many {item} does {name} have left?", a - b
    if kind == 2:
        a, b = rng.randint(2, min(hi, 12)), rng.randint(2, min(hi, 12))
        return f"{name} buys {a} boxes with {b} {item} in each box. How many {item} does {name} buy?", a * b
    total = a + b
    return (
        f"{name} has {a} {item}, finds {b} more, then loses {min(c, total)}. How many {item} does {name} have now?",
        total - min(c, total),
    )


def arithmetic_problems(
    n: int, seed: int, difficulty: int = 1, balanced: bool = False, exclude: AbstractSet[str] = frozenset()
) -> Dataset:
    """``n`` word problems; the same seed gives the same problems. Difficulty 1 uses one operation
    on small numbers; each level adds an operation type and larger numbers.

    ``balanced``: each block of ``difficulty + 1`` consecutive problems holds every operation once, in a
    shuffled order, so that any run of a training stream mixes the operations evenly (`arithmetic_rows`).
    A problem whose question is in ``exclude`` is drawn again, with the same operation."""
    rng = random.Random(f"arithmetic-{seed}-{difficulty}")
    questions, answers, block = [], [], []
    for _ in range(n):
        kind = None
        if balanced:
            block = block or rng.sample(range(difficulty + 1), difficulty + 1)
            kind = block.pop()
        q, a = _problem(rng, difficulty, kind)
        while q in exclude:
            q, a = _problem(rng, difficulty, kind)
        questions.append(q)
        answers.append(str(a))
    return Dataset.from_dict({"prompt": questions, "answer": answers})


# Local files by suffix, as datasets' builders name them.
FILE_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
HELD_OUT_SEED = 10_000


def _root_cause(exc: BaseException) -> BaseException:
    """The first error of the chain datasets wraps a parse or connection error in: one line instead of pages."""
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__
    return exc


def read_rows(source: str, split: str, config_name: Optional[str] = None) -> Dataset:
    """The rows of ``source`` (a hub id, local files or a ``save_to_disk`` folder) at ``split``, without datasets'
    progress bars (a one-line error stays one line; a small dataset loads in a blink)."""
    shown = is_progress_bar_enabled()
    disable_progress_bar()
    try:
        return _read_rows(source, split, config_name)
    finally:
        if shown:
            enable_progress_bar()


def _read_rows(source: str, split: str, config_name: Optional[str]) -> Dataset:
    path = Path(source).expanduser()
    if path.is_dir() and any(
        (path / name).exists() for name in ("dataset_info.json", "dataset_dict.json", "state.json")
    ):
        ds = load_from_disk(str(path))
        if isinstance(ds, DatasetDict):
            if split not in ds:
                raise ConfigError(f"{source}: no split {split!r} (has {sorted(ds)}): pick one with --dataset-split")
            ds = ds[split]
        return ds
    files = sorted(glob.glob(str(path))) if glob.has_magic(source) else [str(path)] if path.is_file() else []
    if files:
        suffixes = {Path(f).suffix for f in files}
        if len(suffixes) > 1 or not suffixes <= set(FILE_FORMATS):
            raise ConfigError(
                f"{source}: local data files must all end in one of {', '.join(FILE_FORMATS)} (got {sorted(suffixes)})"
            )
        if split != "train":
            raise ConfigError(
                f"{source}: local files hold one split, 'train' (asked for {split!r}): give held-out rows with "
                f"--eval-dataset FILE instead"
            )
        kind = FILE_FORMATS[suffixes.pop()]
        if all(Path(f).stat().st_size == 0 for f in files):
            raise ConfigError(f"{source}: no rows (empty file{'s' if len(files) > 1 else ''})")
        try:
            return load_dataset(kind, data_files=files, split="train")
        except Exception as exc:  # noqa: BLE001 (datasets wraps parse errors in long chains: one line instead)
            root = _root_cause(exc)
            raise ConfigError(f"{source}: cannot be read as {kind}: {type(root).__name__}: {root}") from None
    if glob.has_magic(source) or path.suffix in FILE_FORMATS or path.exists() or source.startswith((".", "/", "~")):
        raise ConfigError(
            f"dataset {source!r}: no such file or folder (local data: {', '.join(FILE_FORMATS)} files, a glob of "
            f"them, or a save_to_disk folder; anything else is read as a hub id)"
        )
    try:
        return load_dataset(source, config_name, split=split)
    except Exception as exc:  # noqa: BLE001 (offline: a long chain of connection errors; one line instead)
        root = _root_cause(exc)
        raise ConfigError(
            f"dataset {source!r} could not be loaded from the hub ({type(root).__name__}: {str(root)[:200]}); a hub "
            f"dataset needs a network the first time (or pass local files or a save_to_disk folder)"
        ) from None


def check_prompts(ds: Dataset, column: str, source: str) -> bool:
    """That ``ds`` has rows and a ``column`` of prompts in one of TRL's two formats: strings, or lists of chat
    messages (``{"role": ..., "content": ...}``). Returns whether they are conversational."""
    if column not in ds.column_names:
        hint = " (the old question/answer files: --prompt-column question)" if "question" in ds.column_names else ""
        raise ConfigError(
            f"{source}: no column {column!r} (has {ds.column_names}): name the prompts' column with "
            f"--prompt-column{hint}"
        )
    if len(ds) == 0:
        raise ConfigError(f"{source}: no rows")
    kinds = set()
    for number, prompt in enumerate(ds[column]):
        if isinstance(prompt, str):
            kinds.add("string")
        elif (
            isinstance(prompt, list)
            and prompt
            and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in prompt
            )
        ):
            kinds.add("conversational")
        else:
            raise ConfigError(
                f"{source}: row {number}: column {column!r} must hold a string or a list of chat messages "
                f"({{'role': ..., 'content': ...}}), got {str(prompt)[:80]!r}"
            )
    if len(kinds) > 1:
        raise ConfigError(f"{source}: column {column!r} mixes strings and chat messages: use one format")
    return kinds == {"conversational"}


def load_rows(config: TrainConfig, train_size: int = 100_000) -> Tuple[Dataset, Dataset]:
    """``(train, held_out)`` rows of the run's task; no held-out row is set apart from the training rows' split.

    ``seed`` orders the training rows only: the held-out rows are the same for every seed, so runs that differ
    only in their seed are scored on the same rows and their spread is the spread of training, not of the test
    set. Held-out rows come from ``--eval-dataset`` (at ``--eval-split``, default ``--dataset-split``), from
    ``--eval-split`` of ``--dataset``, or else ``--eval-size`` rows set apart from the training split; of a given
    held-out split its first ``--eval-size`` rows are used."""
    if config.dataset == "arithmetic":
        return arithmetic_rows(config.seed, config.eval_size, config.difficulty, train_size)
    train = read_rows(config.dataset, config.dataset_split, config.dataset_config)
    if config.eval_dataset is None and config.eval_split is None:
        if len(train) <= config.eval_size:
            raise ConfigError(
                f"{config.dataset}: {len(train)} rows is not more than --eval-size {config.eval_size}: lower it, "
                f"or give held-out rows with --eval-dataset or --eval-split"
            )
        split = train.train_test_split(test_size=config.eval_size, seed=HELD_OUT_SEED)
        return split["train"].shuffle(seed=config.seed), split["test"]
    if config.eval_dataset is not None:
        held_out = read_rows(config.eval_dataset, config.eval_split or config.dataset_split, config.dataset_config)
    else:
        held_out = read_rows(config.dataset, config.eval_split, config.dataset_config)
    return train.shuffle(seed=config.seed), held_out.select(range(min(config.eval_size, len(held_out))))


def arithmetic_rows(
    seed: int, eval_size: int, difficulty: int = 1, train_size: int = 100_000
) -> Tuple[Dataset, Dataset]:
    """The built-in task's ``(train, held_out)``: no held-out question is a training question.

    The training stream is balanced (`arithmetic_problems`): every two problems at difficulty 1 add once and
    subtract once, so each step of the default's 8 prompts adds four times and subtracts four times. Drawn
    freely, the 48 problems of a 12-step run of 4 prompts held 18 to 27 additions (seeds 0-4), and seed 3's,
    with 18, taught the 135M model the subtracting worked example's wording for additions ("gives away 5:
    6 - 5 = 1" for "gives Chen 5 more"; held-out greedy accuracy 0.81 -> 0.67). Balancing makes that drift
    rarer, not impossible (results/README.md). The held-out problems are drawn freely, as before."""
    held_out = arithmetic_problems(eval_size, seed=HELD_OUT_SEED, difficulty=difficulty)
    train = arithmetic_problems(
        train_size, seed=seed, difficulty=difficulty, balanced=True, exclude=set(held_out["prompt"])
    )
    return train, held_out
