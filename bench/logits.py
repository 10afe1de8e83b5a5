"""Benchmark of the GTPO loss on logits: gtpo_kernels' backends against reference PyTorch.

Rows (forward, backward, forward+backward, peak memory beyond the inputs):
  reference-eager    `plain_pytorch_gtpo_loss`: log_softmax over the logits and plain autograd (what a
                     typical trainer does)
  reference-compile  the same under `torch.compile`
  gtpo-torch         `gtpo_loss(backend="torch")`, chunked PyTorch
  gtpo-cpu           `gtpo_loss(backend="cpu")`, the C++ kernels (CPU only), and -inplace with
                     `inplace_backward=True`
  gtpo-triton        `gtpo_loss(backend="triton")`, the fused kernels (GPU only)
  gtpo-triton-inplace  the same with `inplace_backward=True` (GPU only)
  liger-grpo         Liger-Kernel's `triton_grpo_loss` when installed (GPU only; no entropy, no
                     conflict weights: a floor for what a fused GRPO loss costs)
On a GPU the table adds the achieved bandwidth of forward+backward, counting the floor of
3 passes over the logits (read, read, write the gradient: 6 T V bytes in bf16), against the
device-to-device copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
from typing import Callable, Dict, List

import torch

from gtpo_kernels import GTPOConfig, gtpo_loss

from .common import (
    Row,
    copy_bandwidth_gbs,
    cpu_kernels_available,
    environment,
    markdown_table,
    measure_into,
    model_output,
    plain_pytorch_gtpo_loss,
    plot_time_vs_vocab,
    save,
)

GROUP_SIZE = 8
ROWS_PER_BATCH = 16  # N = 2 prompts x 8 completions; L = T / N


def make_batch(tokens: int, vocab: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    n = ROWS_PER_BATCH
    length = tokens // n
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, vocab, (n, length), generator=g).to(device)
    lengths = torch.randint(length // 2, length + 1, (n,), generator=g)
    mask = (torch.arange(length)[None] < lengths[:, None]).to(device)
    rewards = torch.randint(0, 2, (n,), generator=g).float()
    adv = (rewards.view(-1, GROUP_SIZE) - rewards.view(-1, GROUP_SIZE).mean(1, keepdim=True)).view(-1).to(device)
    return ids, mask, adv


def implementations(device: torch.device, with_compile: bool, triton_rows=None) -> Dict[str, Callable]:
    """name -> f(x, ids, mask, adv) returning the loss to backpropagate. Triton rows default to GPUs
    only (tests force them on to exercise the harness under the interpreter)."""
    config = GTPOConfig(preset="paper", warn_no_signal=False)  # random logits: the filter may drop every row
    impls: Dict[str, Callable] = {
        "reference-eager": lambda x, ids, m, a: (
            plain_pytorch_gtpo_loss(x, ids, m, a, group_size=GROUP_SIZE, config=config).loss
        ),
    }
    if with_compile:
        compiled = torch.compile(plain_pytorch_gtpo_loss)
        impls["reference-compile"] = lambda x, ids, m, a: (
            compiled(x, ids, m, a, group_size=GROUP_SIZE, config=config).loss
        )
    impls["gtpo-torch"] = lambda x, ids, m, a: (
        gtpo_loss(x, ids, m, a, group_size=GROUP_SIZE, config=config, backend="torch").loss
    )
    if device.type == "cpu" and cpu_kernels_available():
        inplace_cpu = GTPOConfig(preset="paper", inplace_backward=True, warn_no_signal=False)
        impls["gtpo-cpu"] = lambda x, ids, m, a: (
            gtpo_loss(x, ids, m, a, group_size=GROUP_SIZE, config=config, backend="cpu").loss
        )
        impls["gtpo-cpu-inplace"] = lambda x, ids, m, a: (
            gtpo_loss(x, ids, m, a, group_size=GROUP_SIZE, config=inplace_cpu, backend="cpu").loss
        )
    if device.type == "cuda" if triton_rows is None else triton_rows:
        inplace = GTPOConfig(preset="paper", inplace_backward=True, warn_no_signal=False)
        impls["gtpo-triton"] = lambda x, ids, m, a: (
            gtpo_loss(x, ids, m, a, group_size=GROUP_SIZE, config=config, backend="triton").loss
        )
        impls["gtpo-triton-inplace"] = lambda x, ids, m, a: (
            gtpo_loss(x, ids, m, a, group_size=GROUP_SIZE, config=inplace, backend="triton").loss
        )
        try:
            from liger_kernel.transformers.grpo_loss import triton_grpo_loss
        except ImportError:
            print("liger-kernel not installed: no liger-grpo rows")
        else:

            def liger(x, ids, m, a):
                # Liger takes [N, L + 1, V] logits and drops the last position; pad one position.
                loss, _ = triton_grpo_loss(
                    x,
                    None,
                    None,
                    ids,
                    a,
                    m.to(x.dtype),
                    temperature=1.0,
                    beta=0.0,
                    inplace=True,
                    loss_type="grpo",
                    reduce=True,
                )
                return loss

            impls["liger-grpo"] = liger
    return impls


def run(
    device: torch.device,
    tokens_list: List[int],
    vocabs: List[int],
    dtypes: List[torch.dtype],
    reps: int,
    with_compile: bool,
    only: List[str],
    triton_rows=None,
    on_row=None,
):
    """Every implementation at every shape, side by side; ``on_row(rows)`` after each row (save as it goes)."""
    impls = implementations(device, with_compile, triton_rows)
    if only:
        impls = {k: v for k, v in impls.items() if k in only}
    bandwidth = copy_bandwidth_gbs(device)
    rows: List[Row] = []
    for dtype in dtypes:
        for tokens in tokens_list:
            for vocab in vocabs:
                ids, mask, adv = make_batch(tokens, vocab, dtype, device)
                n, length = ids.shape
                for name, fn in impls.items():
                    extra_pos = 1 if name == "liger-grpo" else 0

                    def make_input():
                        return model_output(torch.randn(n, length + extra_pos, vocab, device=device, dtype=dtype) * 2)

                    row = Row(name, tokens, vocab, str(dtype).replace("torch.", ""))
                    t = measure_into(row, make_input, lambda x: fn(x, ids, mask, adv), device, reps)
                    if t is not None:
                        logits_mib = tokens * vocab * torch.finfo(dtype).bits / 8 / 2**20
                        row.extra["peak/logits"] = t.peak_extra_mib / logits_mib
                        if bandwidth:
                            # The floor counts the unmasked tokens only (masked ones are neither read nor
                            # written beyond zeros): counting all of them would flatter the kernels.
                            valid_tokens = int(mask.sum())
                            floor_bytes = 3 * valid_tokens * vocab * torch.finfo(dtype).bits / 8
                            floor_ms = 1e3 * floor_bytes / (bandwidth * 1e9)
                            row.extra["GB/s"] = floor_bytes / (t.total_ms / 1e3) / 1e9
                            row.extra["x floor"] = t.total_ms / floor_ms
                    print(
                        f"{row.impl:>22} T={tokens:>6} V={vocab:>6} {row.dtype:>8}: "
                        + (row.error or f"fwd+bwd {row.total_ms:9.2f} ms, peak +{row.peak_extra_mib:8.1f} MiB"),
                        flush=True,
                    )
                    rows.append(row)
                    if on_row is not None:
                        on_row(rows)
                # Side-by-side ratios against the references, within this run.
                this = [r for r in rows[-len(impls) :] if r.total_ms]
                refs = {r.impl: r.total_ms for r in this if r.impl.startswith("reference")}
                for r in this:
                    for ref_name, ref_ms in refs.items():
                        r.extra[f"speedup vs {ref_name.split('-')[1]}"] = ref_ms / r.total_ms
    return rows, bandwidth


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench logits", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, nargs="+", help="T = N * L values (default: by device)")
    p.add_argument("--vocab", type=int, nargs="+", help="V values (default: by device)")
    p.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--reps", type=int, help="timed repetitions (median reported)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile reference")
    p.add_argument("--only", nargs="+", default=[], help="run only these implementations")
    p.add_argument("--name", help="results file stem (default: logits-<device>)")
    p.add_argument("--triton-rows", action="store_true", help="Triton rows on CPU tensors (under TRITON_INTERPRET=1)")
    args = p.parse_args(argv)

    device = torch.device(args.device)
    gpu = device.type == "cuda"
    tokens = args.tokens or ([4096, 16384] if gpu else [512, 2048])
    vocabs = args.vocab or ([32000, 128256, 151936, 262144] if gpu else [32000, 151936])
    reps = args.reps or (10 if gpu else 3)
    dtypes = [getattr(torch, d) for d in args.dtype]
    env = environment(device)
    name = args.name or f"logits-{device.type}"
    rows, bandwidth = run(
        device,
        tokens,
        vocabs,
        dtypes,
        reps,
        not args.no_compile,
        args.only,
        triton_rows=True if args.triton_rows else None,
        on_row=lambda done: save(name, env, done, "(partial: the run is still going)"),
    )

    if bandwidth:
        env["copy_bandwidth_GBps"] = round(bandwidth, 1)
    columns = sorted({k for r in rows for k in r.extra})
    table = markdown_table(rows, columns)
    print(table)
    notes = (
        "Loss: paper preset, N = 16 completions (2 groups of 8), L = T / 16, random bf16/fp32 logits. "
        f"Median of {reps} repetitions; 'peak extra' is memory beyond the inputs "
        "(GPU: allocator peak; CPU: resident-set peak, sampled). "
        "'peak/logits' divides it by the size of one copy of the logits in their dtype."
    )
    print("wrote", save(name, env, rows, table, notes))
    plot = plot_time_vs_vocab(name, rows, f"GTPO loss on logits, {env.get('gpu', env['cpu'])}")
    if plot:
        print("wrote", plot)
