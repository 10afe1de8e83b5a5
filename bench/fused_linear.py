"""Benchmark of the GTPO loss from hidden states and the lm_head weight (``hidden @ W.T`` inside).

Rows (forward, backward, both, peak memory beyond the inputs):
  materialised-torch   logits = hidden @ W.T, then `gtpo_loss(backend="torch")`: the full logits exist
  fused-torch          `fused_linear_gtpo_loss(backend="torch")`: chunks of completions, no full logits
  fused-cpu            the same with the C++ kernels (CPU only)
  materialised-triton  the same as the first with the Triton loss (GPU only)
  fused-triton         `fused_linear_gtpo_loss(backend="triton")` (GPU only)
  liger-fused-grpo     Liger-Kernel's `LigerFusedLinearGRPOLoss` when installed (GPU only; no entropy)
With --remedies, the settings against one-answer collapse on the device's fused backend (cpu or triton), beside it:
  fused-B+old-logprobs  the paper preset given old log-probs (an update after a rollout's first: the ratio acts)
  fused-B+clip-higher   the same with the clip at [1 - 0.2, 1 + 0.28] (--epsilon 0.2 --epsilon-high 0.28)
  fused-B+shift-scope   entropy_shift_scope="nonzero_advantage" (no entropy shift where A = 0)
  fused-B+clip-cov      cov_mode="clip_cov" given old log-probs (the covariance, its band and the random pick)
  fused-B+kl-cov        cov_mode="kl_cov" given old log-probs (the covariance, the top-k and the |logp - old| term)
On a GPU the table adds achieved TFLOP/s counting the floor of 6 T H V FLOPs (one forward GEMM and two
backward GEMMs) and the ratio to that floor at the bf16 matrix rate given by --peak-tflops.
"""

from __future__ import annotations

import argparse
from typing import Callable, Dict, List

import torch

from gtpo_kernels import GTPOConfig, fused_linear_gtpo_loss, gtpo_loss

from .common import Row, cpu_kernels_available, environment, markdown_table, measure_into, model_output, save
from .logits import GROUP_SIZE, ROWS_PER_BATCH, make_batch


def implementations(device: torch.device, gpu_rows: bool, remedies: bool = False) -> Dict[str, Callable]:
    config = GTPOConfig(preset="paper", warn_no_signal=False)  # random logits: the filter may drop every row

    def materialised(backend):
        return lambda h, w, ids, m, a: (
            gtpo_loss(h @ w.T, ids, m, a, group_size=GROUP_SIZE, config=config, backend=backend).loss
        )

    def fused(backend, config=config, with_old=False):
        olds: Dict[tuple, torch.Tensor] = {}  # old log-probs [N, L] per batch shape, drawn once (not timed after)

        def loss(h, w, ids, m, a):
            old = None
            if with_old:
                if ids.shape not in olds:
                    g = torch.Generator().manual_seed(1)
                    olds[ids.shape] = (-4 * torch.rand(ids.shape, generator=g)).to(h.device)
                old = olds[ids.shape]
            return fused_linear_gtpo_loss(
                h, w, ids, m, a, group_size=GROUP_SIZE, config=config, backend=backend, old_logprobs=old
            ).loss

        return loss

    impls = {"materialised-torch": materialised("torch"), "fused-torch": fused("torch")}
    if device.type == "cpu" and cpu_kernels_available():
        impls["fused-cpu"] = fused("cpu")
    if gpu_rows:
        impls["materialised-triton"] = materialised("triton")
        impls["fused-triton"] = fused("triton")
        try:
            from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
        except ImportError:
            print("liger-kernel not installed: no liger-fused-grpo rows")
        else:
            liger = LigerFusedLinearGRPOLoss(
                beta=0.0, use_ref_model=False, loss_type="grpo", compiled=device.type == "cuda"
            )

            def liger_loss(h, w, ids, m, a):
                out = liger(h, w, ids, m.to(h.dtype), a)
                return out[0] if isinstance(out, tuple) else out

            impls["liger-fused-grpo"] = liger_loss
    if remedies:
        backend = "triton" if device.type == "cuda" else "cpu"
        if backend == "cpu" and not cpu_kernels_available():
            backend = "torch"
        clip_higher = GTPOConfig(preset="paper", clip_eps_low=0.2, clip_eps_high=0.28, warn_no_signal=False)
        scoped = GTPOConfig(preset="paper", entropy_shift_scope="nonzero_advantage", warn_no_signal=False)
        impls[f"fused-{backend}+old-logprobs"] = fused(backend, with_old=True)
        impls[f"fused-{backend}+clip-higher"] = fused(backend, clip_higher, with_old=True)
        impls[f"fused-{backend}+shift-scope"] = fused(backend, scoped)
        for mode in ("clip_cov", "kl_cov"):
            cov = GTPOConfig(preset="paper", cov_mode=mode, warn_no_signal=False)
            impls[f"fused-{backend}+{mode.replace('_', '-')}"] = fused(backend, cov, with_old=True)
    return impls


def run(
    device,
    tokens_list: List[int],
    vocabs: List[int],
    hidden_sizes: List[int],
    dtypes,
    reps: int,
    only: List[str],
    peak_tflops: float,
    gpu_rows=None,
    on_row=None,
    remedies: bool = False,
) -> List[Row]:
    impls = implementations(device, device.type == "cuda" if gpu_rows is None else gpu_rows, remedies)
    if only:
        impls = {k: v for k, v in impls.items() if k in only}
    rows: List[Row] = []
    for dtype in dtypes:
        for tokens in tokens_list:
            for hidden_size in hidden_sizes:
                for vocab in vocabs:
                    ids, mask, adv = make_batch(tokens, vocab, dtype, device)
                    n, length = ids.shape
                    weight = (torch.randn(vocab, hidden_size, device=device) / hidden_size**0.5).to(dtype)
                    weight.requires_grad_()
                    for name, fn in impls.items():

                        def make_input():
                            return model_output(torch.randn(n, length, hidden_size, device=device, dtype=dtype))

                        row = Row(name, tokens, vocab, str(dtype).replace("torch.", ""), extra={"H": hidden_size})
                        t = measure_into(row, make_input, lambda h: fn(h, weight, ids, mask, adv), device, reps)
                        if t is not None:
                            logits_mib = tokens * vocab * 4 / 2**20
                            row.extra["peak/fp32 logits"] = t.peak_extra_mib / logits_mib
                            flops = 6 * int(mask.sum()) * hidden_size * vocab  # unmasked tokens only
                            row.extra["TFLOP/s"] = flops / (t.total_ms / 1e3) / 1e12
                            if device.type == "cuda":
                                row.extra["x floor"] = t.total_ms / (1e3 * flops / (peak_tflops * 1e12))
                        weight.grad = None
                        print(
                            f"{row.impl:>20} T={tokens:>6} H={hidden_size:>5} V={vocab:>6} {row.dtype:>8}: "
                            + (row.error or f"fwd+bwd {row.total_ms:9.1f} ms, peak +{row.peak_extra_mib:8.1f} MiB"),
                            flush=True,
                        )
                        rows.append(row)
                        if on_row is not None:
                            on_row(rows)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench fused_linear", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, nargs="+")
    p.add_argument("--vocab", type=int, nargs="+", default=[151936])
    p.add_argument("--hidden", type=int, nargs="+")
    p.add_argument("--dtype", nargs="+")
    p.add_argument("--reps", type=int)
    p.add_argument("--only", nargs="+", default=[])
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=790.0,
        help="bf16 matrix rate for the floor (H200 measured here: about 790)",
    )
    p.add_argument("--name")
    p.add_argument("--gpu-rows", action="store_true", help="the Triton rows on CPU tensors (TRITON_INTERPRET=1)")
    p.add_argument(
        "--remedies",
        action="store_true",
        help="rows for the clip, old log-probs, the shift's scope, Clip-Cov and KL-Cov",
    )
    args = p.parse_args(argv)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    tokens = args.tokens or ([16384] if gpu else [4096])
    hidden = args.hidden or ([3584] if gpu else [512])
    dtypes = [getattr(torch, d) for d in (args.dtype or (["bfloat16"] if gpu else ["float32"]))]
    reps = args.reps or (5 if gpu else 1)
    env = environment(device)
    name = args.name or f"fused-linear-{device.type}"
    rows = run(
        device,
        tokens,
        args.vocab,
        hidden,
        dtypes,
        reps,
        args.only,
        args.peak_tflops,
        gpu_rows=True if args.gpu_rows else None,
        on_row=lambda done: save(name, env, done, "(partial: the run is still going)"),
        remedies=args.remedies,
    )
    table = markdown_table(rows, sorted({k for r in rows for k in r.extra}))
    print(table)
    notes = (
        f"N = {ROWS_PER_BATCH} completions (groups of {GROUP_SIZE}), L = T / {ROWS_PER_BATCH}, paper preset. "
        f"Median of {reps} repetitions. 'peak extra' is memory beyond the inputs (hidden states, weight); "
        "'peak/fp32 logits' divides it by the size of the full logits in float32 (T V 4 bytes)."
    )
    print("wrote", save(name, env, rows, table, notes))
