"""Checkpoints at step boundaries: the model, optimiser and schedule, and the run's state (`RunState`), written
atomically, so that a crash never leaves a half-written one; `--resume` reads them back."""

from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from .config import ConfigError


@dataclass
class RunState:
    """Where a run stands, saved with each checkpoint."""

    step: int = 0  # training steps completed
    eval_step: int = -1  # the step of the last evaluation logged (-1: not even the one before training)
    initial_entropy: Optional[float] = None  # the policy's mean token entropy before any update
    before: Optional[dict] = None  # the evaluation before training
    no_signal_streak: int = 0  # steps in a row without any learning signal

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, saved: dict) -> RunState:
        return cls(**{f.name: saved[f.name] for f in dataclasses.fields(cls) if f.name in saved})


def save_checkpoint(
    path: Path, model_state: dict, optimizer_state: dict, scheduler_state: dict, state: RunState, config: dict
) -> None:
    """Written to a temporary file, then renamed: a crash never leaves a half-written checkpoint. A write that fails
    (a full disk: about 1.5 GB for the built-in model with its optimiser) removes its partial file and leaves the
    previous checkpoint as it was."""
    payload = {
        "model": model_state,
        "optimizer": optimizer_state,
        "scheduler": scheduler_state,
        "state": state.to_dict(),
        "config": config,
    }
    tmp = path.with_name(path.name + ".tmp")
    try:
        torch.save(payload, tmp)
    except (OSError, RuntimeError) as exc:  # torch reports a full disk as "unexpected pos ..." (a RuntimeError)
        tmp.unlink(missing_ok=True)  # a partial file would hold the space the next write needs
        free = shutil.disk_usage(path.parent).free / 2**30
        raise ConfigError(
            f"could not write the checkpoint {path} ({type(exc).__name__}: {str(exc).strip()[:200]}); "
            f"{free:.1f} GiB free on its disk. Free some space (old runs' checkpoint.pt files can go), or pass "
            f"--save-every 0 to write one only at the end; the previous checkpoint, if any, is intact"
        ) from None
    os.replace(tmp, path)


def require_checkpoint(path: Path) -> None:
    """``--resume`` needs ``path``: checked before anything is loaded, and again when it is read."""
    if not path.exists():
        raise ConfigError(
            f"--resume: no checkpoint at {path}; start without --resume, or pass the --output-dir of "
            f"the run to continue"
        )


def load_checkpoint(path: Path) -> dict:
    require_checkpoint(path)
    return torch.load(path, map_location="cpu", weights_only=False)
