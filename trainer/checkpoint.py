"""Checkpoints at step boundaries, as ``checkpoint-STEP/`` folders that nothing has to unpickle:

    checkpoint-STEP/
        model.safetensors, config.json, ...      the model (LoRA: adapter_model.safetensors, adapter_config.json)
                                                 and the tokenizer, with save_pretrained: from_pretrained loads them
        optimizer.safetensors                    the optimiser's tensors (AdamW's moments and step counts)
        trainer_state.json                       the optimiser's settings, the schedule, the run's state
                                                 (`RunState`), the metrics rows up to the step, the run's config

A folder is written as ``checkpoint-STEP.tmp`` and renamed when whole, so a crash never leaves a half-written one
under the final name; `--save-total-limit` keeps the newest few; ``--resume`` reads the newest. Safetensors and
JSON hold data only: a tampered checkpoint can fail to load, never run code.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .config import ConfigError

FORMAT = 1  # trainer_state.json's "format": a later layout raises it, and an older trainer refuses what it cannot read
STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.safetensors"
NAME = re.compile(r"checkpoint-(\d+)")


@dataclass
class RunState:
    """Where a run stands, saved with each checkpoint."""

    step: int = 0  # training steps completed
    eval_step: int = -1  # the step of the last evaluation logged (-1: not even the one before training)
    initial_entropy: Optional[float] = None  # the policy's mean token entropy before any update
    before: Optional[dict] = None  # the evaluation before training
    after: Optional[dict] = None  # the final evaluation at step after_step, once logged and checkpointed: a run
    after_step: int = -1  # resumed at that step (stopped while saving its model, say) does not run it again
    no_signal_streak: int = 0  # steps in a row without any learning signal

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, saved: dict) -> RunState:
        return cls(**{f.name: saved[f.name] for f in dataclasses.fields(cls) if f.name in saved})


def optimizer_tensors(optimizer_state: dict) -> Tuple[Dict[str, torch.Tensor], dict]:
    """An optimiser's ``state_dict()`` as ``(tensors, plain)``: its per-parameter tensors under ``state/KEY/NAME``
    (KEY: the parameter's index, or its name under torchrun), float32 master weights under ``master/INDEX``, and
    everything else as JSON-ready values."""
    tensors, other = {}, {}
    for key, values in optimizer_state["state"].items():
        for name, value in values.items():
            if torch.is_tensor(value):
                tensors[f"state/{key}/{name}"] = value.detach().cpu().contiguous()
            else:
                other.setdefault(str(key), {})[name] = value
    for index, weight in optimizer_state.get("master", {}).items():  # float32 master weights (`PolicyOptimizer`)
        tensors[f"master/{index}"] = weight.contiguous()
    keys = list(optimizer_state["state"])
    plain = {
        "param_groups": optimizer_state["param_groups"],
        "key_type": "int" if all(isinstance(k, int) for k in keys) else "str",
        "other": other,
    }
    return tensors, plain


def optimizer_state_from(tensors: Dict[str, torch.Tensor], plain: dict) -> dict:
    """The inverse of `optimizer_tensors`."""
    as_key = int if plain["key_type"] == "int" else str
    state: Dict = {}
    master = {int(k[len("master/") :]): v for k, v in tensors.items() if k.startswith("master/")}
    for full, value in tensors.items():
        if full.startswith("state/"):
            key, name = full[len("state/") :].rsplit("/", 1)
            state.setdefault(as_key(key), {})[name] = value
    for key, values in plain["other"].items():
        state.setdefault(as_key(key), {}).update(values)
    groups = [dict(group) for group in plain["param_groups"]]
    for group in groups:
        if isinstance(group.get("betas"), list):
            group["betas"] = tuple(group["betas"])
    return {"state": state, "param_groups": groups, **({"master": master} if master else {})}


def checkpoints(out_dir: Path) -> List[Tuple[int, Path]]:
    """The whole checkpoints in ``out_dir``, oldest first (a ``.tmp`` folder is one a crash left half-written)."""
    if not out_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in out_dir.iterdir() if (m := NAME.fullmatch(p.name)) and p.is_dir()]
    return sorted(found)


def write_checkpoint(
    out_dir: Path,
    step: int,
    save_model: Callable[[Path], None],
    optimizer_state: dict,
    trainer_state: dict,
    save_total_limit: Optional[int],
) -> Path:
    """``out_dir/checkpoint-STEP``: ``save_model(folder)`` writes the model and tokenizer, then the optimiser and
    ``trainer_state`` (JSON-ready) are added; the folder is renamed into place when whole, and the oldest
    checkpoints beyond ``save_total_limit`` are removed. A write that fails (a full disk: about 1.6 GB for the
    built-in model with its optimiser) removes its partial folder and leaves the earlier checkpoints as they were."""
    from safetensors.torch import save_file

    final = out_dir / f"checkpoint-{step}"
    tmp = out_dir / f"checkpoint-{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        save_model(tmp)
        tensors, plain = optimizer_tensors(optimizer_state)
        save_file(tensors, tmp / OPTIMIZER_FILE)
        text = json.dumps({"format": FORMAT, **trainer_state, "optimizer": plain}, indent=1, allow_nan=True)
        (tmp / STATE_FILE).write_text(text)
    except (OSError, RuntimeError, ValueError) as exc:  # torch and safetensors report a full disk variously
        shutil.rmtree(tmp, ignore_errors=True)  # a partial folder would hold the space the next write needs
        free = shutil.disk_usage(out_dir).free / 2**30
        raise ConfigError(
            f"could not write the checkpoint {final} ({type(exc).__name__}: {str(exc).strip()[:200]}); "
            f"{free:.1f} GiB free on its disk. Free some space, lower --save-total-limit, or pass --save-every 0 "
            f"to write one only at the end; the earlier checkpoints are intact"
        ) from None
    if final.exists():  # the same step saved again (a stop request after a scheduled save): the newer replaces it
        old = out_dir / f"checkpoint-{step}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    if save_total_limit:
        for _, stale in checkpoints(out_dir)[:-save_total_limit]:
            shutil.rmtree(stale, ignore_errors=True)
    return final


def latest_checkpoint(out_dir: Path) -> Path:
    """The newest checkpoint folder of ``out_dir``: what ``--resume`` continues from (checked before anything loads)."""
    found = checkpoints(out_dir)
    if found:
        return found[-1][1]
    if (out_dir / "checkpoint.pt").exists():
        raise ConfigError(
            f"--resume: {out_dir / 'checkpoint.pt'} is an older trainer's checkpoint, a pickle, which this one "
            f"does not load (a pickle can run any code); start the run again without --resume"
        )
    raise ConfigError(
        f"--resume: no checkpoint-STEP folder in {out_dir}; start without --resume, or pass the --output-dir of "
        f"the run to continue"
    )


def read_trainer_state(folder: Path) -> dict:
    """``trainer_state.json`` of a checkpoint; a missing or unreadable file, or a format this trainer does not know,
    is one error naming the file."""
    path = folder / STATE_FILE
    try:
        saved = json.loads(path.read_text())
        if not isinstance(saved, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--resume: could not read {path} ({type(exc).__name__}: {exc})") from None
    if saved.get("format") != FORMAT:
        raise ConfigError(
            f"--resume: {path} has format {saved.get('format')!r}; this trainer reads format {FORMAT} (upgrade "
            f"gtpo_kernels, or start again without --resume)"
        )
    missing = [key for key in ("state", "scheduler", "optimizer", "config") if key not in saved]
    if missing:
        raise ConfigError(f"--resume: {path} lacks {', '.join(missing)}: not a whole checkpoint")
    return saved


def read_optimizer_state(folder: Path, plain: dict) -> dict:
    """The optimiser's ``state_dict()`` from ``optimizer.safetensors`` and its settings in trainer_state.json."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = folder / OPTIMIZER_FILE
    try:
        return optimizer_state_from(load_file(path), plain)
    except (OSError, SafetensorError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"--resume: could not read {path} ({type(exc).__name__}: {exc})") from None
