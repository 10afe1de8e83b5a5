"""Benchmark of the loss's input layouts: packed completions (``cu_seqlens``) and vocabulary-parallel logits
(``vocab_group``) against the whole-vocabulary padded call, side by side in one run.

Rows (forward+backward of `gtpo_loss`, the paper preset; peak memory beyond the inputs, per process):
  padded            logits [N, L, V], completions of random lengths right-padded to L (the reference)
  packed            the same completions' tokens packed, logits [T, V] with cu_seqlens (no padding positions)
  vocab-parallel    each of R processes holds logits [N, L, V / R] (vocab_group); time and memory of one rank
  vocab-parallel-packed  both
The script starts R processes itself (torchrun, gloo on the CPU; NCCL, one GPU each, on GPUs) with one thread
each on the CPU; the whole-vocabulary rows run on rank 0 while the others wait, so every row has the same
threads. With ``--ranks 1`` (one GPU) the vocab-parallel rows measure the combination's own cost (a group of one
rank: no communication). The ratios are to the padded row of the same run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Dict

import torch
import torch.distributed as dist

from gtpo_kernels import GTPOConfig, gtpo_loss

from .common import Row, environment, markdown_table, measure_into, model_output, save
from .logits import GROUP_SIZE, make_batch

CONFIG = GTPOConfig(preset="paper")


def rows_for(ids, mask, adv, vocab: int, rank: int, world: int, group) -> Dict[str, tuple]:
    """name -> (logits shape, loss of logits, whether every rank runs it)."""
    n, length = ids.shape
    lengths = mask.sum(dim=1)
    at = mask.reshape(-1).nonzero().squeeze(1)
    cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    packed_ids, packed_mask = ids.reshape(-1)[at], mask.reshape(-1)[at]
    sizes = [vocab // world + (r < vocab % world) for r in range(world)]
    local = sizes[rank]

    def padded(x, vocab_group=None):
        return gtpo_loss(x, ids, mask, adv, group_size=GROUP_SIZE, config=CONFIG, vocab_group=vocab_group).loss

    def packed(x, vocab_group=None):
        return gtpo_loss(
            x,
            packed_ids,
            packed_mask,
            adv,
            group_size=GROUP_SIZE,
            config=CONFIG,
            cu_seqlens=cu,
            vocab_group=vocab_group,
        ).loss

    tokens = at.numel()
    return {
        "padded": ((n, length, vocab), padded, False),
        "packed": ((tokens, vocab), packed, False),
        "vocab-parallel": ((n, length, local), lambda x: padded(x, group), True),
        "vocab-parallel-packed": ((tokens, local), lambda x: packed(x, group), True),
    }


def worker(args) -> None:
    gpu = args.device == "cuda"
    dist.init_process_group("nccl" if gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{rank}" if gpu else "cpu")
    if gpu:
        torch.cuda.set_device(device)
    dtype = getattr(torch, args.dtype)
    ids, mask, adv = make_batch(args.tokens, args.vocab, dtype, device)
    table = []
    for name, (shape, loss_of, everyone) in rows_for(ids, mask, adv, args.vocab, rank, world, dist.group.WORLD).items():
        row = Row(name, args.tokens, args.vocab, args.dtype)
        if everyone or rank == 0:

            def make_input(shape=shape):
                return model_output(torch.randn(shape, device=device, dtype=dtype) * 2)

            measure_into(row, make_input, loss_of, device, args.reps)
        dist.barrier()
        fields = ("forward_ms", "backward_ms", "total_ms", "peak_extra_mib")
        times = torch.tensor([getattr(row, f) or 0.0 for f in fields], dtype=torch.float64, device=device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank's times, the largest peak
        if everyone and row.error is None:
            for f, value in zip(fields, times.tolist()):
                setattr(row, f, value)
        row.extra["ranks"] = world if everyone else 1
        table.append(row)
    if rank == 0:
        base = next(r for r in table if r.impl == "padded")
        for r in table:
            if r.total_ms and base.total_ms:
                r.extra["time vs padded"] = r.total_ms / base.total_ms
                r.extra["peak vs padded"] = r.peak_extra_mib / base.peak_extra_mib if base.peak_extra_mib else None
            print(f"{r.impl:>22}: " + (r.error or f"fwd+bwd {r.total_ms:9.2f} ms, peak +{r.peak_extra_mib:8.1f} MiB"))
        env = environment(device)
        env["processes"] = world
        env["threads_per_process"] = torch.get_num_threads()
        notes = (
            f"T = {args.tokens} positions (N = {ids.shape[0]} completions, {int(mask.sum())} unmasked tokens), "
            f"V = {args.vocab}, {world} process(es); vocab-parallel rows: the slowest rank's time and the largest "
            f"rank's peak; the padded and packed rows run on one process while the others wait."
        )
        path = save(args.name, env, table, markdown_table(table, ["ranks", "time vs padded", "peak vs padded"]), notes)
        print(f"table: {path}")
    dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench layouts", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, help="T = N * L padded positions (default: 16384 on a GPU, 2048 on the CPU)")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--ranks", type=int, help="processes of the vocabulary group (default: 2 on the CPU, the GPUs)")
    p.add_argument("--reps", type=int, help="timed repetitions (median reported; default 10 on a GPU, 3 on the CPU)")
    p.add_argument("--name", help="results file stem (default: layouts-<device>)")
    args = p.parse_args(argv)
    gpu = args.device == "cuda"
    args.tokens = args.tokens or (16384 if gpu else 2048)
    args.reps = args.reps or (10 if gpu else 3)
    args.name = args.name or f"layouts-{args.device}"
    if "RANK" in os.environ:  # a process of the launch below
        worker(args)
        return
    ranks = args.ranks or (torch.cuda.device_count() if gpu else 2)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks)]
    cmd += ["--master_port", str(_free_port()), "-m", "bench", "layouts", *(argv if argv is not None else sys.argv[2:])]
    sys.exit(subprocess.run(cmd, env=env).returncode)
