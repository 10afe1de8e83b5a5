"""Conflict-token weights as one Triton launch: one program per completion, O(G * L) work each.

Each program finds the lengths of its completion's forward and reverse conflict runs (the leading
runs of positions whose token also appears, at the same left- or right-aligned position, in a
positive and a negative completion of the group), then writes ``lambda = lambda_f * lambda_r`` and
``n_conflict = max(|cf|, |cr|)``. A run is a prefix, so its length is the first position that is not
a raw conflict: no scan and no ``[G, G, L]`` table are needed. Results equal
`reference.conflict_weights` bit for bit.
"""

from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from . import triton_interpreter  # noqa: F401 (the interpreter fix, when interpreted)


@triton.jit
def _conflict_weights_kernel(
    ids_ptr,
    lengths_ptr,
    adv_ptr,
    lambda_ptr,
    n_conflict_ptr,
    length,
    group_size,
    weight,
    BLOCK_L: tl.constexpr,
):
    i = tl.program_id(0)
    first_row = (i // group_size) * group_size
    a_i = tl.load(adv_ptr + i)
    len_i = tl.load(lengths_ptr + i)
    row_i = ids_ptr + i.to(tl.int64) * length
    run_f = len_i
    run_r = len_i
    offs = tl.arange(0, BLOCK_L)
    for t0 in range(0, length, BLOCK_L):
        t = t0 + offs
        in_i = t < len_i
        y_f = tl.load(row_i + t, mask=in_i, other=0)
        y_r = tl.load(row_i + (len_i - 1 - t), mask=in_i, other=0)
        pos_f = tl.zeros((BLOCK_L,), tl.int32)
        neg_f = tl.zeros((BLOCK_L,), tl.int32)
        pos_r = tl.zeros((BLOCK_L,), tl.int32)
        neg_r = tl.zeros((BLOCK_L,), tl.int32)
        for j in range(0, group_size):
            r = first_row + j
            a_j = tl.load(adv_ptr + r)
            # Scalar signs as 0/1 integers: the interpreter can't mix vector and scalar booleans.
            j_pos = (a_j > 0).to(tl.int32)
            j_neg = (a_j < 0).to(tl.int32)
            len_j = tl.load(lengths_ptr + r)
            both = in_i & (t < len_j)
            row_j = ids_ptr + r.to(tl.int64) * length
            same_f = (both & (tl.load(row_j + t, mask=both, other=0) == y_f)).to(tl.int32)
            same_r = (both & (tl.load(row_j + (len_j - 1 - t), mask=both, other=0) == y_r)).to(tl.int32)
            pos_f = tl.maximum(pos_f, same_f * j_pos)
            neg_f = tl.maximum(neg_f, same_f * j_neg)
            pos_r = tl.maximum(pos_r, same_r * j_pos)
            neg_r = tl.maximum(neg_r, same_r * j_neg)
        # The run ends at the first position of this row that is not a raw conflict.
        broken_f = in_i & ((pos_f * neg_f) == 0)
        broken_r = in_i & ((pos_r * neg_r) == 0)
        run_f = tl.minimum(run_f, tl.min(tl.where(broken_f, t, length), axis=0))
        run_r = tl.minimum(run_r, tl.min(tl.where(broken_r, t, length), axis=0))

    active = (a_i > 0) | (a_i < 0)
    run_f = tl.where(active, run_f, 0)
    run_r = tl.where(active, run_r, 0)
    on_run = tl.where(a_i > 0, weight, 0.0)
    out_row = lambda_ptr + i.to(tl.int64) * length
    for t0 in range(0, length, BLOCK_L):
        t = t0 + offs
        lambda_f = tl.where(t < run_f, on_run, 1.0)
        lambda_r = tl.where((t >= len_i - run_r) & (t < len_i), on_run, 1.0)
        tl.store(out_row + t, lambda_f * lambda_r, mask=t < length)
    tl.store(n_conflict_ptr + i, tl.maximum(run_f, run_r).to(tl.int64))


def conflict_weights_triton(
    completion_ids: torch.Tensor,
    valid: torch.Tensor,
    advantages: torch.Tensor,
    group_size: int,
    weight: float = 2.0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `reference.conflict_weights` (``valid`` must be a prefix mask); float32 weights."""
    n_rows, length = completion_ids.shape
    ids = completion_ids.contiguous()
    lengths = valid.sum(dim=1, dtype=torch.int32)
    adv = advantages.float().contiguous()
    lambda_ = torch.empty((n_rows, length), dtype=torch.float32, device=ids.device)
    n_conflict = torch.empty(n_rows, dtype=torch.int64, device=ids.device)
    if n_rows and length:
        block = min(1024, triton.next_power_of_2(length))
        _conflict_weights_kernel[(n_rows,)](
            ids,
            lengths,
            adv,
            lambda_,
            n_conflict,
            length,
            group_size,
            float(weight),
            BLOCK_L=block,
        )
    elif n_rows:
        n_conflict.zero_()
    return lambda_, n_conflict
