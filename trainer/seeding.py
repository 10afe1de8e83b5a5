"""Randomness needs no saving: every random draw of a step (sampling the rollouts, sampling for pass@k) is
seeded from ``(seed, purpose, step, rank)``, so a step replayed after a resume draws exactly what it drew the
first time, and a resumed run reproduces the uninterrupted one, however it was stopped (even by ``kill -9``:
only the steps since the last checkpoint are lost, and they are run again identically)."""

from __future__ import annotations

import hashlib


def step_seed(seed: int, purpose: str, step: int, rank: int = 0) -> int:
    """A 63-bit seed for one purpose at one step on one rank (independent of everything run before)."""
    digest = hashlib.sha256(f"{seed}/{purpose}/{step}/{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
