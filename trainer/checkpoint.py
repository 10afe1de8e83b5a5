"""What makes a run resumable anywhere: atomic checkpoints at step boundaries, a metrics log that is cut
back to the checkpoint on resume, and stop requests (Ctrl-C, SIGTERM) deferred to the next boundary.

Randomness needs no saving: every random draw of a step (sampling the rollouts, sampling for pass@k)
is seeded from ``(seed, step, rank)``, so a step replayed after a resume draws exactly what it drew
the first time, and a resumed run reproduces the uninterrupted one, however it was stopped (even by
``kill -9``: only the steps since the last checkpoint are lost, and they are run again identically).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Optional

import torch

from .config import ConfigError


def step_seed(seed: int, purpose: str, step: int, rank: int = 0) -> int:
    """A 63-bit seed for one purpose at one step on one rank (independent of everything run before)."""
    import hashlib

    digest = hashlib.sha256(f"{seed}/{purpose}/{step}/{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def save_checkpoint(
    path: Path, model_state: dict, optimizer_state: dict, scheduler_state: dict, state: dict, config: dict
) -> None:
    """Written to a temporary file, then renamed: a crash never leaves a half-written checkpoint."""
    payload = {
        "model": model_state,
        "optimizer": optimizer_state,
        "scheduler": scheduler_state,
        "state": state,
        "config": config,
    }
    tmp = path.with_name(path.name + ".tmp")
    torch.save(payload, tmp)
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


class MetricsLog:
    """``metrics.jsonl``: one JSON row per training step (``kind: train``) or evaluation (``kind: eval``)."""

    def __init__(self, path: Path, enabled: bool = True) -> None:
        self.path, self.enabled = path, enabled

    def start(self) -> None:
        if self.enabled:
            self.path.write_text("")

    def append(self, row: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")

    def cut_back(self, step: int, eval_step: int) -> int:
        """Keeps the rows a checkpoint at ``(step, eval_step)`` accounts for: rows written after it (by steps
        run again on resume) are dropped. Returns how many were dropped."""
        if not self.enabled or not self.path.exists():
            return 0
        kept, dropped = [], 0
        for line in self.path.read_text().splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            limit = step if row["kind"] == "train" else eval_step
            if row["step"] <= limit:
                kept.append(line)
            else:
                dropped += 1
        self.path.write_text("".join(line + "\n" for line in kept))
        return dropped

    def rows(self, kind: Optional[str] = None):
        if not self.path.exists():
            return []
        rows = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        return [r for r in rows if kind is None or r["kind"] == kind]


class Interrupted(Exception):
    """A stop request cut the current phase (sampling, an update, an evaluation) short; nothing of that phase
    was applied, so the run is still at its last completed step."""


EXIT_STATUS = {"SIGINT": 130, "SIGTERM": 143}  # 128 + the signal's number, as shells report it


class StopRequests:
    """While active, SIGINT (Ctrl-C) and SIGTERM set ``requested``. In one process the decoder layers then
    raise `Interrupted` at their next forward or backward (`interrupt_layers`), so sampling, an update or an
    evaluation stops within a layer's time; under torchrun, where the processes must agree, the run stops
    at the next step or evaluation-batch boundary. Either way it saves the last completed step and exits with
    ``exit_status``. A second Ctrl-C stops at once (`KeyboardInterrupt`; the last checkpoint and the
    cut-back log still make the resume exact)."""

    def __init__(self) -> None:
        self.requested: Optional[str] = None
        self._previous = {}
        self._hooks = []
        self.paused = False  # set while a step has applied part of itself (see train.update)

    @property
    def exit_status(self) -> int:
        return EXIT_STATUS.get(self.requested, 1)

    def _handle(self, signum, frame) -> None:
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name
        print(
            f"\n{self.requested} received: saving the last completed step and stopping (Ctrl-C again to stop at once)",
            file=sys.stderr,
            flush=True,
        )

    def check(self) -> None:
        """Raises `Interrupted` if a stop was requested (and the current phase may be abandoned)."""
        if self.requested is not None and not self.paused:
            raise Interrupted(self.requested)

    def interrupt_layers(self, layers) -> None:
        """Hooks on ``layers`` (the decoder's blocks) that call `check` before each one's forward, and before its
        backward (a hook on its output: lighter than a module backward hook, which rewraps inputs and outputs)."""

        def before_backward(grad):
            self.check()

        def after_forward(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
                hidden.register_hook(before_backward)

        for layer in layers:
            self._hooks.append(layer.register_forward_pre_hook(lambda module, args: self.check()))
            self._hooks.append(layer.register_forward_hook(after_forward))

    def __enter__(self) -> StopRequests:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals stay as they are
                pass
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
