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
from pathlib import Path
from typing import Optional

import torch

from .config import ConfigError


def step_seed(seed: int, purpose: str, step: int, rank: int = 0) -> int:
    """A 63-bit seed for one purpose at one step on one rank (independent of everything run before)."""
    import hashlib

    digest = hashlib.sha256(f"{seed}/{purpose}/{step}/{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def save_checkpoint(path: Path, model_state: dict, optimizer_state: dict, scheduler_state: dict, state: dict,
                    config: dict) -> None:
    """Written to a temporary file, then renamed: a crash never leaves a half-written checkpoint."""
    payload = {"model": model_state, "optimizer": optimizer_state, "scheduler": scheduler_state, "state": state,
               "config": config}
    tmp = path.with_name(path.name + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path) -> dict:
    if not path.exists():
        raise ConfigError(f"--resume: no checkpoint at {path}; start without --resume")
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


class StopRequests:
    """While active, SIGINT (Ctrl-C) and SIGTERM only set ``requested``; the loop stops at the next step
    boundary (or between evaluation batches) and writes a checkpoint first. A second Ctrl-C stops at once
    (the last checkpoint and the cut-back log still make the resume exact)."""

    def __init__(self) -> None:
        self.requested: Optional[str] = None
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name
        print(f"\n{self.requested} received: stopping after the current step (Ctrl-C again to stop now)",
              flush=True)

    def __enter__(self) -> "StopRequests":
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals stay as they are
                pass
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
