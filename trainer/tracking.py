"""``--report-to``: the scalars of ``metrics.jsonl`` sent where practitioners watch runs, TensorBoard, Weights &
Biases or trackio (several at once), from process 0. Each tracker is an optional extra, checked before anything
loads (`check_trackers`). Rows become ``train/KEY`` and ``eval/KEY`` at their step, as TRL names them; a value
that is not a number (a skipped step's gradient norm) is left out.

TensorBoard writes to ``OUTPUT_DIR/tensorboard``; W&B to its project (``WANDB_PROJECT``, default ``gtpo-train``;
``WANDB_MODE=offline`` keeps it on disk); trackio to its project (``TRACKIO_PROJECT``, default ``gtpo-train``) in
its local database (``TRACKIO_DIR``).
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path
from typing import Dict, List, Optional

from .config import ConfigError

# tracker -> (module it imports, pip's name for it)
PACKAGES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "trackio": ("trackio", "trackio"),
}


def check_trackers(report_to: List[str]) -> None:
    """Each tracker asked for is installed: otherwise a `ConfigError` with the pip command, before any loading."""
    missing = [PACKAGES[t][1] for t in report_to if t in PACKAGES and importlib.util.find_spec(PACKAGES[t][0]) is None]
    if missing:
        raise ConfigError(
            f"--report-to {' '.join(report_to)}: not installed: {', '.join(missing)}; pip install {' '.join(missing)} "
            f"(or pip install 'gtpo-kernels[tracking]')"
        )


def scalars(row: dict) -> Dict[str, float]:
    """``{"train/loss": ..., ...}``: a metrics row's numbers under its kind; an evaluation's 95 % intervals as
    ``eval/KEY_ci95_low`` and ``eval/KEY_ci95_high``."""
    prefix = row["kind"]
    values = {
        f"{prefix}/{key}": float(value)
        for key, value in row.items()
        if key not in ("kind", "step")
        and isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
    }
    for key, (low, high) in row.get("intervals_95", {}).items():
        values.update({f"{prefix}/{key}_ci95_low": float(low), f"{prefix}/{key}_ci95_high": float(high)})
    return values


class Trackers:
    """The run's trackers: `log` a metrics row, `close` at the end. Does nothing off process 0 or for ``none``."""

    def __init__(self, report_to: List[str], run_name: str, output_dir: Path, config: dict, enabled: bool) -> None:
        self.writers = []
        if not enabled:
            return
        if "tensorboard" in report_to:
            from torch.utils.tensorboard import SummaryWriter

            self.writers.append(_TensorBoard(SummaryWriter(log_dir=str(output_dir / "tensorboard"))))
        if "wandb" in report_to:
            import wandb

            run = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "gtpo-train"), name=run_name, config=config, dir=str(output_dir)
            )
            self.writers.append(_Module(run))
        if "trackio" in report_to:
            import trackio

            trackio.init(project=os.environ.get("TRACKIO_PROJECT", "gtpo-train"), name=run_name, config=config)
            self.writers.append(_Module(trackio))

    def log(self, row: dict) -> None:
        values = scalars(row)
        for writer in self.writers:
            writer.log(values, row["step"])

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
        self.writers = []


class _TensorBoard:
    def __init__(self, writer) -> None:
        self.writer = writer

    def log(self, values: Dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, global_step=step)

    def close(self) -> None:
        self.writer.close()


class _Module:
    """W&B's run and trackio's module share ``log(dict, step=)`` and ``finish()``."""

    def __init__(self, target) -> None:
        self.target = target

    def log(self, values: Dict[str, float], step: Optional[int]) -> None:
        self.target.log(values, step=step)

    def close(self) -> None:
        self.target.finish()
