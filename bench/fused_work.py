"""What the fused ``hidden @ lm_head`` loss costs where no gradient is wanted, and in its backward: this checkout
against an earlier commit, side by side in one run.

    python -m bench fused_work --before REV [--tokens 2048 --hidden 576 --vocab 49152 --dtype float32]
    python -m bench fused_work --before REV --before-tree PATH   # REV installed and built at PATH

Rows, for each source (``REV``, checked out in a scratch worktree with this checkout's C++ build, or, when the C++
kernels differ, ``--before-tree``: a checkout of ``REV`` with its own build; and this checkout):
  step              one training step, forward and ``loss.backward()``: wall time, and the largest and peak new
                    tensor storage
  no_grad forward   the loss under ``torch.no_grad()`` with a head that requires grad (an evaluation, TRL's
                    ``prediction_step``): wall time, and the largest and peak new tensor storage of the call
  backward          ``loss.backward()`` after a forward with grad: wall time, and the largest and peak new
                    storage during the backward (the gradients themselves were made by the forward)
  logits_step       (``--what``) ``gtpo_loss`` forward and backward on the ``[N, L, V]`` logits ``h @ W.T``, made once
                    before the timing: the unfused entry point
Memory is counted exactly, per tensor storage created by an operator (`common.PeakTensorMemory`), in a run
of its own; times are medians of ``--reps``, the two sources alternating in separate processes, in the other order
every other time (C++ backend).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import common
from bench.common import PeakTensorMemory

ROOT = Path(__file__).resolve().parents[1]


def worker(tokens: int, hidden: int, vocab: int, dtype_name: str, what: str, inner: int = 1) -> dict:
    """One measurement in this process, with the ``gtpo_kernels`` imported before this module (`measure`): the
    median of ``inner`` timed calls after a warm one (a single call's time moves with the clock by several per cent)."""
    import gtpo_kernels

    assert str(gtpo_kernels.__file__).startswith(os.environ["GTPO_SOURCE"]), gtpo_kernels.__file__

    torch.manual_seed(0)
    dtype = getattr(torch, dtype_name)
    n = 16
    length = tokens // n
    h = torch.randn(n, length, hidden, dtype=dtype).requires_grad_()
    w = (torch.randn(vocab, hidden) / hidden**0.5).to(dtype).requires_grad_()
    ids = torch.randint(0, vocab, (n, length))
    mask = torch.ones(n, length, dtype=torch.bool)
    adv = torch.randn(n)

    def loss():
        return gtpo_kernels.fused_linear_gtpo_loss(h, w, ids, mask, adv, group_size=8, backend="cpu").loss

    if what == "logits_step":  # gtpo_loss on the logits themselves (materialised once, outside the timing)
        logits = (h.detach() @ w.detach().T).requires_grad_()
        h = w = None  # only the logits' memory is the call's

        def loss():
            return gtpo_kernels.gtpo_loss(logits, ids, mask, adv, group_size=8, backend="cpu").loss

    def timed(call, before=lambda: None) -> float:
        times = []
        for _ in range(inner):
            arg = before()
            start = time.perf_counter()
            call(arg)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def resident_peak(call) -> float:
        """MiB: the resident peak of ``call`` (`common.resident_peak`), which sees the operator's own chunks of logits
        (the dispatch mode sees only its outputs)."""
        return common.resident_peak(call).extra / 2**20

    if what in ("step", "logits_step"):
        loss().backward()  # warm
        seconds = timed(lambda _: loss().backward())
        with PeakTensorMemory() as memory:
            loss().backward()
        resident = resident_peak(lambda: loss().backward())
    elif what == "no_grad":
        with torch.no_grad():
            loss()  # warm
            seconds = timed(lambda _: loss())
            with PeakTensorMemory() as memory:
                loss()
            resident = resident_peak(loss)
    else:
        loss().backward()  # warm
        seconds = timed(lambda out: out.backward(), before=loss)
        out = loss()
        with PeakTensorMemory() as memory:
            out.backward()
        out = loss()
        resident = resident_peak(out.backward)
    return {
        "ms": 1e3 * seconds,
        "largest_mib": memory.largest / 2**20,
        "peak_mib": memory.peak / 2**20,
        "resident_mib": resident,
    }


def measure(source: Path, args, what: str) -> dict:
    # The source's gtpo_kernels first (its submodules then come from its own folder), this checkout's bench after.
    code = (
        f"import sys, json; sys.path.insert(0, {str(source)!r}); import gtpo_kernels; "
        f"sys.path[0] = {str(ROOT)!r}; from bench.fused_work import worker; "
        f"print(json.dumps(worker({args.tokens}, {args.hidden}, {args.vocab}, {args.dtype!r}, {what!r}, {args.inner})))"
    )
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), GTPO_SOURCE=str(source))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd="/")
    if proc.returncode:
        raise RuntimeError(f"{source}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def worktree(rev: str, dest: Path) -> Path:
    """``rev`` checked out at ``dest``, with this checkout's built C++ extension (the kernels' source must agree)."""
    subprocess.run(["git", "worktree", "add", "--detach", str(dest), rev], cwd=ROOT, check=True, capture_output=True)
    diff = subprocess.run(["git", "diff", "--quiet", rev, "--", "csrc"], cwd=ROOT)
    if diff.returncode:
        raise SystemExit(f"csrc/ differs between {rev} and this checkout: build {rev} in an environment of its own")
    for built in (ROOT / "gtpo_kernels" / "backends").glob("_cpu_*.so"):
        shutil.copy2(built, dest / "gtpo_kernels" / "backends" / built.name)
    return dest


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench fused_work", description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="the commit to compare with (e.g. HEAD~1)")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--reps", type=int, default=4, help="measurements per source (even: as often first as second)")
    p.add_argument("--inner", type=int, default=3, help="timed calls per process (their median is its measurement)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--name", default="fused-work-cpu", help="the table's file name (in bench/results/local/)")
    p.add_argument("--before-tree", help="a checkout of --before with its own C++ build (when csrc/ differs)")
    p.add_argument(
        "--what",
        nargs="+",
        default=["step", "no_grad", "backward"],
        choices=["step", "no_grad", "backward", "logits_step"],
        help="logits_step: gtpo_loss forward + backward on materialised [N, L, V] logits (the unfused path)",
    )
    args = p.parse_args(argv)
    rev = subprocess.run(["git", "rev-parse", "--short", args.before], cwd=ROOT, capture_output=True, text=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    with tempfile.TemporaryDirectory(prefix="gtpo-before-") as scratch:
        before = Path(args.before_tree) if args.before_tree else worktree(args.before, Path(scratch) / "before")
        if args.before_tree:
            at = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=before, capture_output=True, text=True)
            if at.stdout.strip() != rev.stdout.strip():
                raise SystemExit(f"--before-tree {before} is at {at.stdout.strip()}, not {args.before}")
        try:
            sources = {f"before ({rev.stdout.strip()})": before, f"after ({head.stdout.strip()} + tree)": ROOT}
            results = {name: {w: [] for w in args.what} for name in sources}
            for rep in range(args.reps):
                for what in args.what:
                    # Alternating, and in the other order every other time (ABBA): a CPU's clock drifts within a
                    # pair too (boost, heat), which would otherwise always favour the source measured first.
                    order = list(sources.items()) if rep % 2 == 0 else list(sources.items())[::-1]
                    for name, source in order:
                        results[name][what].append(measure(source, args, what))
        finally:
            if not args.before_tree:
                subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=ROOT, capture_output=True)
    lines = [
        f"`python -m bench fused_work --before {args.before} --what {' '.join(args.what)}`: fused_linear_gtpo_loss "
        f"(and gtpo_loss for logits_step), C++ backend, T = {args.tokens}, "
        f"H = {args.hidden}, V = {args.vocab}, {args.dtype}, {args.threads} threads; times the median of {args.reps} "
        f"processes per source, each the median of "
        f"{args.inner} calls. "
        "Memory: largest and peak new storage are exact, the storage of every tensor an operator made outside the "
        "fused operator plus that operator's outputs (its chunks of logits, internal, are not seen); peak resident is "
        "the process's resident-set high-water mark above its start during the call (Linux's VmHWM, reset before it), "
        "which sees the operator's chunks too: the memory a step needs at once.",
        "",
        "| source | what | ms | largest new storage MiB | peak new storage MiB | peak resident MiB |",
        "|---|---|---|---|---|---|",
    ]
    labels = {
        "step": "forward + backward",
        "no_grad": "no_grad forward",
        "backward": "backward",
        "logits_step": "gtpo_loss on logits, forward + backward",
    }
    for what in args.what:
        for name in sources:
            runs = results[name][what]
            ms = statistics.median(r["ms"] for r in runs)
            lines.append(
                f"| {name} | {labels[what]} | {ms:.1f} | {runs[0]['largest_mib']:.1f} | {runs[0]['peak_mib']:.1f} "
                f"| {statistics.median(r['resident_mib'] for r in runs):.1f} |"
            )
        first, second = (statistics.median(r["ms"] for r in results[name][what]) for name in sources)
        # Each rep's pair was measured back to back: the spread of their ratios says how far the median can be trusted.
        pairs = sorted(b["ms"] / a["ms"] for a, b in zip(*(results[name][what] for name in sources)))
        spread = f" (pairs {pairs[0]:.3f}-{pairs[-1]:.3f})" if len(pairs) > 1 else ""
        lines.append(f"| after / before | {labels[what]} | {second / first:.3f}{spread} | | | |")
    common.write_markdown(args.name, lines)


if __name__ == "__main__":
    main()
