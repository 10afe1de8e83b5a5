"""``metrics.jsonl``, the run's log: one JSON row per training step or evaluation, cut back to the checkpoint
on resume so that the steps run again are not logged twice."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional


class MetricsLog:
    """``metrics.jsonl``: one JSON row per training step (``kind: train``) or evaluation (``kind: eval``), each
    also sent to the run's ``trackers`` (`tracking.Trackers`) if any."""

    def __init__(self, path: Path, enabled: bool = True, trackers=None) -> None:
        self.path, self.enabled, self.trackers = path, enabled, trackers

    def start(self) -> None:
        if self.enabled:
            self.path.write_text("")

    def append(self, row: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
            if self.trackers is not None:
                self.trackers.log(row)

    def close(self) -> None:
        if self.trackers is not None:
            self.trackers.close()

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
