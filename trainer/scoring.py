"""Reward functions from ``--reward SPEC`` and scoring completions with them, as TRL's ``GRPOTrainer`` does.

A SPEC is a built-in name (`rewards.BUILTIN_REWARDS`), ``package.module:function`` or ``path/to/file.py:function``.
A function is called once per batch with TRL's keywords, ``fn(prompts=..., completions=..., completion_ids=...,
**columns)``, one list entry per completion (a prompt's row repeated for each of its completions); it returns one
float per completion, or None where it does not apply. Rewards are combined as TRL combines them: the weighted sum
over the functions that apply (``nansum``). A function that raises, returns the wrong count, or a value that is
neither a finite number nor None stops the run with `RewardError`: one line naming the function, the row and
what went wrong.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import math
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch

from .config import ConfigError
from .rewards import BUILTIN_REQUIRES, BUILTIN_REWARDS

# The keywords every reward function is called with; any other parameter without a default names a column.
CALL_KEYWORDS = ("prompts", "completions", "completion_ids")


class RewardError(ConfigError):
    """A reward function failed on a batch: the run stops in one line, its last checkpoint as it was."""


def stop_together(dist, failed: Optional[RewardError]) -> None:
    """Every process raises when a reward failed on any of them: one process's error alone would leave the others
    waiting in their next collective."""
    if dist.any(failed is not None):
        raise failed or RewardError("a reward function failed on another process (its message is in that one's output)")


def reward_name(fn: Callable) -> str:
    """The name a reward is logged under: its function's ``__name__`` (as TRL logs ``rewards/NAME``)."""
    return getattr(fn, "__name__", type(fn).__name__)


def load_reward(spec: str, answer_in_block: bool = True) -> Callable:
    """The function a ``--reward`` SPEC names; a spec that cannot be loaded is a `ConfigError` saying why."""
    if spec in BUILTIN_REWARDS:
        module, package = BUILTIN_REQUIRES.get(spec, (None, None))
        if module is not None and importlib.util.find_spec(module) is None:
            raise ConfigError(f"--reward {spec} needs the package {package}: pip install {package}")
        fn = BUILTIN_REWARDS[spec]
        if spec == "correctness" and not answer_in_block:
            fn = functools.wraps(fn)(functools.partial(fn, answer_in_block=False))
        return fn
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ConfigError(
            f"--reward {spec!r}: give a built-in name ({', '.join(BUILTIN_REWARDS)}), package.module:function or "
            f"path/to/file.py:function"
        )
    if where.endswith(".py"):
        module = _load_file(where, spec)
    else:
        try:
            module = importlib.import_module(where)
        except Exception as exc:  # noqa: BLE001 (a missing or broken module: one line)
            raise ConfigError(f"--reward {spec!r}: cannot import {where}: {type(exc).__name__}: {exc}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"--reward {spec!r}: {where} has no function {name!r}")
    return fn


def _load_file(where: str, spec: str):
    """The module of a reward file, executed once however many rewards name it (they share its globals)."""
    path = Path(where).expanduser()
    if not path.is_file():
        raise ConfigError(f"--reward {spec!r}: no file {where}")
    module_name = f"gtpo_train_reward_{path.stem}"
    loaded = sys.modules.get(module_name)
    if loaded is not None and Path(getattr(loaded, "__file__", "")).resolve() == path.resolve():
        return loaded
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # dataclasses and pickling look a module up by name
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 (the user's file: its first error, in one line)
        del sys.modules[module_name]
        raise ConfigError(f"--reward {spec!r}: {where} failed to import: {type(exc).__name__}: {exc}") from None
    return module


def required_columns(fn: Callable) -> List[str]:
    """The columns ``fn`` cannot be called without: its parameters without a default, other than TRL's keywords."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C function: nothing to read
        return []
    return [
        p.name
        for p in parameters
        if p.name not in CALL_KEYWORDS
        and p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]


def check_columns(rewards: Sequence[Callable], columns: Sequence[str], source: str) -> None:
    """Before the model loads: each reward's required columns are in the data."""
    for fn in rewards:
        missing = [c for c in required_columns(fn) if c not in columns]
        if missing:
            raise ConfigError(
                f"reward {reward_name(fn)} needs the column(s) {missing}, which {source} lacks (has {list(columns)})"
            )


def score(
    rewards: Sequence[Callable],
    prompts: list,
    completions: list,
    completion_ids: List[List[int]],
    columns: Dict[str, list],
) -> torch.Tensor:
    """``[N, R]`` float32: each reward function's value for each of the N completions, NaN where it returned None."""
    n = len(completions)
    out = torch.full((n, len(rewards)), float("nan"), dtype=torch.float32)
    for j, fn in enumerate(rewards):
        values = _call(fn, prompts, completions, completion_ids, columns)
        for i, value in enumerate(values):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise RewardError(
                    f"reward {reward_name(fn)} returned {value!r} for row {i} ({_excerpt(prompts[i])}): each value "
                    f"must be a finite number, or None where the reward does not apply"
                )
            out[i, j] = float(value)
    return out


def combine(scores: torch.Tensor, weights: Sequence[float]) -> torch.Tensor:
    """``[N]``: TRL's combination, the weighted sum of the rewards that apply to each completion (0 if none does)."""
    return (scores * torch.tensor(weights, dtype=scores.dtype)).nansum(dim=1)


def _call(fn, prompts, completions, completion_ids, columns) -> list:
    n = len(completions)
    try:
        values = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
    except Exception as exc:  # noqa: BLE001 (the user's function: which row, and its error, in one line)
        row = _failing_row(fn, prompts, completions, completion_ids, columns)
        where = f"row {row} ({_excerpt(prompts[row])})" if row is not None else f"a batch of {n} rows"
        raise RewardError(f"reward {reward_name(fn)} raised on {where}: {type(exc).__name__}: {exc}") from None
    try:
        values = list(values)
    except TypeError:
        raise RewardError(
            f"reward {reward_name(fn)} returned {type(values).__name__}, not a list of {n} values"
        ) from None
    if len(values) != n:
        raise RewardError(
            f"reward {reward_name(fn)} returned {len(values)} values for {n} completions: one per completion"
        )
    return values


def _failing_row(fn, prompts, completions, completion_ids, columns) -> Optional[int]:
    """The first row on which ``fn``, called on that row alone, raises (None if none does alone)."""
    for i in range(len(completions)):
        try:
            fn(
                prompts=prompts[i : i + 1],
                completions=completions[i : i + 1],
                completion_ids=completion_ids[i : i + 1],
                **{k: v[i : i + 1] for k, v in columns.items()},
            )
        except Exception:  # noqa: BLE001
            return i
    return None


def _excerpt(prompt) -> str:
    text = prompt if isinstance(prompt, str) else prompt[-1].get("content", "")
    text = " ".join(str(text).split())
    return repr(text[:60] + ("..." if len(text) > 60 else ""))
