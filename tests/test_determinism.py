"""The fused path's gradients are bitwise reproducible: the chunk plan (which sets the order in which d_W
accumulates) depends on the inputs and the config only, never on the device's free memory."""

import subprocess
import sys

import torch

from gtpo_kernels.fused_chunks import chunk_tokens_for


def test_gpu_chunk_budget_ignores_free_memory(monkeypatch):
    free = iter([80 * 2**30, 3 * 2**30, 700 * 2**20])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (next(free), 141 * 2**30))
    budgets = {chunk_tokens_for(151936, torch.device("cuda"), None) for _ in range(3)}
    assert len(budgets) == 1


GRADIENT_DIGEST = """
import hashlib, torch
from gtpo_kernels import GTPOConfig, fused_linear_gtpo_loss
g = torch.Generator().manual_seed(7)
hidden = torch.randn(8, 12, 24, generator=g).requires_grad_()
weight = torch.randn(301, 24, generator=g).requires_grad_()
ids = torch.randint(0, 301, (8, 12), generator=g)
mask = torch.arange(12)[None] < torch.randint(1, 13, (8,), generator=g)[:, None]
adv = torch.randn(8, generator=g)
# A budget of a few completions: several chunks, and one completion split in pieces.
out = fused_linear_gtpo_loss(hidden, weight, ids, mask, adv, group_size=4,
                             config=GTPOConfig(max_chunk_bytes=4 * 301 * 10))
out.loss.backward()
print(hashlib.sha256(hidden.grad.numpy().tobytes() + weight.grad.numpy().tobytes()).hexdigest())
"""


def test_same_inputs_give_bitwise_equal_gradients_across_calls_and_processes():
    digests = {
        subprocess.run(
            [sys.executable, "-c", GRADIENT_DIGEST], capture_output=True, text=True, check=True
        ).stdout.strip()
        for _ in range(2)
    }
    assert len(digests) == 1
    namespace = {}
    exec(compile(GRADIENT_DIGEST.replace("print(", "digest = ("), "digest", "exec"), namespace)
    exec(compile(GRADIENT_DIGEST.replace("print(", "again = ("), "digest", "exec"), namespace)
    assert namespace["digest"] == namespace["again"] == digests.pop()
