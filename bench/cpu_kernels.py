"""The C++ CPU kernels against the reference, at the two shapes of their targets, in one run.

  T = 4096, V = 32000, float32    and    T = 1024, V = 151936, bfloat16

Targets (forward + backward): at least 4x faster than the eager reference, faster than the
torch.compile'd reference, and at most a quarter of the eager reference's peak memory. The forward is
also timed against a read of the same logits (``logits.sum()``, the memory floor), alternating the two
in one loop so that both see the same machine: the column "fwd / read".
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from .common import environment, markdown_table, save
from .logits import run as run_logits

SHAPES = [(4096, 32000, torch.float32), (1024, 151936, torch.bfloat16)]
IMPLS = ["reference-eager", "reference-compile", "gtpo-torch", "gtpo-cpu", "gtpo-cpu-inplace"]


def forward_vs_read(tokens: int, vocab: int, dtype: torch.dtype, reps: int = 15):
    """Median ms of the C++ forward and of ``logits.sum()`` on the same logits, measured alternately."""
    from gtpo_kernels.backends import get_backend

    logits = (torch.randn(1, tokens, vocab) * 2).to(dtype)
    ids = torch.randint(0, vocab, (1, tokens))
    valid = torch.ones(1, tokens, dtype=torch.bool)
    forward = get_backend("cpu").forward
    forward(logits, ids, valid, 1.0, None)
    kernel, read = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        logits.sum()
        t1 = time.perf_counter()
        forward(logits, ids, valid, 1.0, None)
        t2 = time.perf_counter()
        read.append(t1 - t0)
        kernel.append(t2 - t1)
    return 1e3 * statistics.median(kernel), 1e3 * statistics.median(read)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench cpu_kernels", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--name", default="cpu-kernels")
    args = p.parse_args(argv)
    device = torch.device("cpu")
    rows = []
    for tokens, vocab, dtype in SHAPES:
        shape_rows, _ = run_logits(device, [tokens], [vocab], [dtype], args.reps, True, IMPLS)
        ref = {r.impl: r for r in shape_rows}
        eager, compiled = ref.get("reference-eager"), ref.get("reference-compile")
        for r in shape_rows:
            if r.total_ms and eager and eager.peak_extra_mib:
                r.extra["memory vs eager"] = r.peak_extra_mib / eager.peak_extra_mib
            if r.impl.startswith("gtpo-cpu") and r.total_ms and eager and compiled:
                r.extra["targets met"] = (
                    "yes"
                    if eager.total_ms / r.total_ms >= 4
                    and r.total_ms < compiled.total_ms
                    and r.peak_extra_mib <= eager.peak_extra_mib / 4
                    else "no"
                )
        fwd_ms, read_ms = forward_vs_read(tokens, vocab, dtype)
        print(f"forward {fwd_ms:.1f} ms vs read {read_ms:.1f} ms: {fwd_ms / read_ms:.2f}x", flush=True)
        for r in shape_rows:
            if r.impl == "gtpo-cpu":
                r.extra["fwd / read"] = fwd_ms / read_ms
        rows += shape_rows
    env = environment(device)
    table = markdown_table(rows, sorted({k for r in rows for k in r.extra}))
    print(table)
    notes = (
        f"{__doc__.strip()}\n\nMedian of {args.reps} repetitions, all rows of a shape measured side by side "
        "in one process. Peak memory: the resident set's high-water mark beyond the inputs, in a separate "
        "untimed run."
    )
    print("wrote", save(args.name, env, rows, table, notes))
