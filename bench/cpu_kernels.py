"""The C++ CPU kernels against the reference, at the two shapes of their targets, in one run.

  T = 4096, V = 32000, float32    and    T = 1024, V = 151936, bfloat16

Targets (forward + backward): at least 4x faster than the eager reference, faster than the
torch.compile'd reference, and at most a quarter of the eager reference's peak memory.
"""

from __future__ import annotations

import argparse

import torch

from .common import environment, markdown_table, save
from .logits import run as run_logits

SHAPES = [(4096, 32000, torch.float32), (1024, 151936, torch.bfloat16)]
IMPLS = ["reference-eager", "reference-compile", "gtpo-torch", "gtpo-cpu", "gtpo-cpu-inplace"]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench cpu_kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
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
            if r.total_ms and eager and eager.peak_extra_mb:
                r.extra["memory vs eager"] = r.peak_extra_mb / eager.peak_extra_mb
            if r.impl.startswith("gtpo-cpu") and r.total_ms and eager and compiled:
                r.extra["targets met"] = ("yes" if eager.total_ms / r.total_ms >= 4 and r.total_ms < compiled.total_ms
                                          and r.peak_extra_mb <= eager.peak_extra_mb / 4 else "no")
        rows += shape_rows
    env = environment(device)
    table = markdown_table(rows, sorted({k for r in rows for k in r.extra}))
    print(table)
    notes = (f"{__doc__.strip()}\n\nMedian of {args.reps} repetitions, all rows of a shape measured side by side "
             "in one process. Peak memory: the resident set's high-water mark beyond the inputs, in a separate "
             "untimed run.")
    print("wrote", save(args.name, env, rows, table, notes))
