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

from .common import Row, environment, markdown_table, save
from .logits import run as run_logits

SHAPES = [(4096, 32000, torch.float32), (1024, 151936, torch.bfloat16)]
IMPLS = ["reference-eager", "reference-compile", "gtpo-torch", "gtpo-cpu", "gtpo-cpu-inplace"]


def forward_call(tokens: int, vocab: int, dtype: torch.dtype):
    """``(call, logits)``: the C++ forward on fresh random ``[1, tokens, vocab]`` logits, ready to time."""
    from gtpo_kernels.backends import get_backend

    logits = (torch.randn(1, tokens, vocab) * 2).to(dtype)
    ids = torch.randint(0, vocab, (1, tokens))
    valid = torch.ones(1, tokens, dtype=torch.bool)
    forward = get_backend("cpu").forward
    return (lambda: forward(logits, ids, valid, 1.0)), logits


def forward_vs_read(tokens: int, vocab: int, dtype: torch.dtype, reps: int = 15):
    """Median ms of the C++ forward and of ``logits.sum()`` on the same logits, measured alternately."""
    forward, logits = forward_call(tokens, vocab, dtype)
    forward()
    kernel, read = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        logits.sum()
        t1 = time.perf_counter()
        forward()
        t2 = time.perf_counter()
        read.append(t1 - t0)
        kernel.append(t2 - t1)
    return 1e3 * statistics.median(kernel), 1e3 * statistics.median(read)


def forward_ns_per_logit(tokens: int, vocab: int, dtype: torch.dtype, reps: int) -> float:
    """The C++ forward's best time per logit on one thread, on ``[1, tokens, vocab]`` random logits (as
    `forward_vs_read`'s)."""
    forward, logits = forward_call(tokens, vocab, dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        forward()
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            forward()
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return 1e9 * best / logits.numel()


def forward_only(name: str, tokens_scale: float = 1.0) -> None:
    """``--forward-only``: per target shape, the forward against a read (all threads) and, on one thread, its time
    per logit on the shape's logits (streamed from memory) and on logits that stay in the cache (4 MiB or less):
    equal rates say the arithmetic, not the memory, is the limit."""
    rows = []
    for tokens, vocab, dtype in SHAPES:
        tokens = max(2, int(tokens * tokens_scale))
        fwd_ms, read_ms = forward_vs_read(tokens, vocab, dtype)
        streamed = forward_ns_per_logit(tokens, vocab, dtype, reps=5)
        resident_tokens = max(1, (4 << 20) // (vocab * torch.finfo(dtype).bits // 8))
        resident = forward_ns_per_logit(resident_tokens, vocab, dtype, reps=40)
        row = Row("gtpo-cpu forward", tokens, vocab, str(dtype).replace("torch.", ""), forward_ms=fwd_ms)
        row.extra.update(
            {
                "read ms": read_ms,
                "fwd / read": fwd_ms / read_ms,
                "1 thread ns/logit, streamed": streamed,
                "1 thread ns/logit, in cache": resident,
            }
        )
        print(f"{tokens} x {vocab} {dtype}: {row.extra}", flush=True)
        rows.append(row)
    table = markdown_table(rows, list(rows[0].extra))
    print(table)
    notes = (
        "`python -m bench cpu_kernels --forward-only`: the C++ forward against `logits.sum()` on the same logits "
        "(alternately, median of 15, all threads), and its best time per logit on one thread, on the shape's "
        "logits and on logits that fit in 4 MiB (in cache)."
    )
    print("wrote", save(name, environment(torch.device("cpu")), rows, table, notes))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench cpu_kernels", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--name", default=None, help="the table's file name (default cpu-kernels, cpu-forward)")
    p.add_argument("--forward-only", action="store_true", help="only the forward against a read (about a minute)")
    args = p.parse_args(argv)
    if args.forward_only:
        forward_only(args.name or "cpu-forward")
        return
    args.name = args.name or "cpu-kernels"
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
