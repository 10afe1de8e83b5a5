"""The trainer's host allocator settings (trainer/allocator.py): freed activations stay in the process.

Each case runs in a fresh interpreter, since mallopt changes the whole process for good."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# Allocates and touches 192 MiB in blocks of {mib} MiB (8: a step's activations, above glibc's default 128 KiB mmap
# threshold and below its 32 MiB maximum; 64: the built-in model's embedding gradient, above it), frees them, and
# prints how many MiB of them the process still holds.
FREED_AND_KEPT = textwrap.dedent(
    """
    import ctypes, os, sys
    sys.path.insert(0, {root!r})
    if {keep}:
        from trainer.allocator import keep_freed_memory
        reason = keep_freed_memory()
        assert reason is None, reason
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    page = os.sysconf("SC_PAGE_SIZE")
    def resident_mib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page / 2**20
    before = resident_mib()
    blocks = [libc.malloc({mib} * 2**20) for _ in range(192 // {mib})]
    for b in blocks:
        ctypes.memset(b, 1, {mib} * 2**20)
    for b in reversed(blocks):
        libc.free(b)
    if {release}:
        from trainer.allocator import release_freed_memory
        release_freed_memory()
    print(resident_mib() - before)
    """
)


def kept_mib(keep: bool, mib: int, release: bool = False) -> float:
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    out = subprocess.run(
        [sys.executable, "-c", FREED_AND_KEPT.format(root=root, keep=keep, mib=mib, release=release)],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and /proc: Linux only")
@pytest.mark.parametrize("mib", [8, 64])
def test_freed_blocks_stay_in_the_process(mib):
    # glibc's defaults give the 192 MiB back on free (each block its own mapping); the trainer's settings keep it
    # for the next step's allocations.
    assert kept_mib(keep=False, mib=mib) < 32
    assert kept_mib(keep=True, mib=mib) > 160
    # Before an evaluation (whose cache comes on top), every free page goes back to the kernel.
    assert kept_mib(keep=True, mib=mib, release=True) < 32


def test_a_cpu_session_sets_the_allocator(tiny_model_dir, tmp_path, monkeypatch):
    """load_session is where a training process starts on the CPU: the settings are applied there."""
    pytest.importorskip("transformers")
    import trainer.session as session
    from trainer.config import TrainConfig
    from trainer.distributed import Distributed
    from trainer.task import load_task

    called = []
    monkeypatch.setattr(session, "keep_freed_memory", lambda: called.append(True))
    config = TrainConfig(model=str(tiny_model_dir), output_dir=str(tmp_path), precision="fp32", eval_size=4)
    session.load_session(config, Distributed.start("cpu"), load_task(config, train_size=16))
    assert called == [True]


def test_an_evaluation_on_the_cpu_first_releases_what_training_freed(tiny_model_dir, tmp_path, monkeypatch):
    """Two study cells evaluating at once ran a 24 GiB machine out of memory: training's freed memory stayed
    resident under the evaluation's cache, and a resumed cell's evaluation alone grew from 5.6 to 12.5 GB over its
    batches (each batch's cache a new size, the old ones' memory kept). Each batch of an evaluation on the CPU hands
    the freed memory back first."""
    pytest.importorskip("transformers")
    import trainer.evaluation as evaluation
    import trainer.session as session
    from trainer.config import TrainConfig
    from trainer.distributed import Distributed
    from trainer.task import load_task

    config = TrainConfig(
        model=str(tiny_model_dir), output_dir=str(tmp_path), precision="fp32", eval_size=4, eval_batch_size=2
    )
    loaded = session.load_session(config, Distributed.start("cpu"), load_task(config, train_size=16))
    called = []
    monkeypatch.setattr(evaluation, "release_freed_memory", lambda: called.append(True))
    assert loaded.evaluate(seed=0, desc="eval") is not None
    assert called == [True, True]  # two batches of two problems
