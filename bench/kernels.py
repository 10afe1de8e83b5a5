"""The Triton token-statistics kernels alone, against the memory floor: ``python -m bench kernels``.

At the headline shape (T = 16384 tokens, V = 151936, bf16) with every token valid and with 70 % valid,
times the forward kernel (one read of the logits) and the backward kernel (one read, one write), next
to the measured device-to-device copy bandwidth: the floor is 2 T_valid V bytes forward and 4 T_valid V
backward (bf16). Then a sweep of ``BLOCK_V`` (1024, 2048, 4096) x ``num_warps`` (1, 2, 4, 8: Liger's forward
runs 1 warp) x ``num_stages`` (1, 2, 3) for the launch tables in ``gtpo_kernels/backends/triton_token_stats.py``.
Every result is appended to the JSON file as it comes, so a run cut short keeps what it measured.

``--dry-run`` runs the same code on tiny CPU shapes under Triton's interpreter (timings meaningless).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def timer(device):
    """``ms(fn)``: CUDA events through triton.testing.do_bench on a GPU, wall clock on the CPU."""
    if device.type == "cuda":
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=5, rep=20)

    def wall(fn, reps=3):
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(times)

    return wall


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench kernels", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU under the interpreter")
    p.add_argument(
        "--out",
        default=str(Path(__file__).resolve().parent / "results" / "local" / "kernels.json"),
        help="JSON file the rows are appended to (default: bench/results/local/, ignored by git)",
    )
    args = p.parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from gtpo_kernels.backends import triton_token_stats as kernels

    from .common import copy_bandwidth_gbs, environment

    device = torch.device("cpu" if args.dry_run else "cuda")
    tokens, vocab = (8, 300) if args.dry_run else (16384, 151936)
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    record = {"environment": environment(device), "bandwidth_GBps": copy_bandwidth_gbs(device), "rows": []}

    def save(row):
        record["rows"].append(row)
        out_path.write_text(json.dumps(record, indent=1))
        print(row, flush=True)

    ms = timer(device)
    bandwidth = record["bandwidth_GBps"]
    logits = (torch.randn(1, tokens, vocab, device=device) * 2).to(torch.bfloat16)
    ids = torch.randint(0, vocab, (1, tokens), device=device)
    c = torch.randn(1, tokens, device=device)
    out = torch.empty_like(logits)
    for valid_fraction in (1.0, 0.7):
        valid = torch.arange(tokens, device=device)[None] < int(valid_fraction * tokens)
        stats = kernels.forward(logits, ids, valid)
        fwd = ms(lambda: kernels.forward(logits, ids, valid))
        # No entropy gradient (grad_H None): what every preset but the penalty variant asks of the backward.
        bwd = ms(lambda: kernels.backward(logits, ids, valid, *stats, c, None, out))
        n_valid = int(valid.sum())
        row = {
            "step": "headline",
            "valid": valid_fraction,
            "tokens": tokens,
            "vocab": vocab,
            "forward_ms": fwd,
            "backward_ms": bwd,
        }
        if bandwidth:
            floor_fwd = 1e3 * 2 * n_valid * vocab / (bandwidth * 1e9)
            floor_bwd = 1e3 * 4 * n_valid * vocab / (bandwidth * 1e9)
            row.update(
                forward_x_floor=fwd / floor_fwd,
                backward_x_floor=bwd / floor_bwd,
                total_x_floor=(fwd + bwd) / (floor_fwd + floor_bwd),
            )
        save(row)

    valid = torch.ones(1, tokens, dtype=torch.bool, device=device)
    if args.dry_run:  # the plumbing only: the interpreter ignores warps and stages
        grid = [(128, 1, 1), (128, 4, 3), (256, 4, 3)]
    else:
        grid = [(b, w, s) for b in (1024, 2048, 4096) for w in (1, 2, 4, 8) for s in (1, 2, 3)]
    for block, warps, stages in grid:
        tables = kernels._FORWARD_LAUNCH, kernels._BACKWARD_LAUNCH
        kernels._FORWARD_LAUNCH = kernels._BACKWARD_LAUNCH = ((1 << 62, block, warps, stages),)
        config = {"step": "sweep", "BLOCK_V": block, "num_warps": warps, "num_stages": stages}
        try:
            stats = kernels.forward(logits, ids, valid)
            row = {
                **config,
                "forward_ms": ms(lambda: kernels.forward(logits, ids, valid)),
                "backward_ms": ms(lambda: kernels.backward(logits, ids, valid, *stats, c, None, out)),
            }
        except Exception as exc:  # noqa: BLE001 (a configuration that does not compile is a row)
            row = {**config, "error": str(exc)[:200]}
        finally:
            kernels._FORWARD_LAUNCH, kernels._BACKWARD_LAUNCH = tables
        save(row)
    print("wrote", out_path)


if __name__ == "__main__":
    main()
