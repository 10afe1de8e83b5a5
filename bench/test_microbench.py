"""Microbenchmarks with pytest-benchmark: ``python -m pytest bench --benchmark-only`` (not part of the test run).

The implementations are those of the ``python -m bench logits`` tables (`bench.logits.implementations`):
the eager and compiled references, the torch and C++ backends, and on a GPU the Triton kernels, forward +
backward at small CPU shapes (on CUDA, the headline shape). Each shape is one pytest-benchmark group, so
its table and ``--benchmark-compare`` show the implementations side by side.
"""

import pytest
import torch

from bench.common import model_output
from bench.logits import implementations, make_batch

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
SHAPES = [(16384, 151936)] if CUDA else [(512, 32000), (256, 151936)]
IMPLS = list(implementations(DEVICE, with_compile=True))


@pytest.mark.parametrize("tokens, vocab", SHAPES, ids=[f"T{t}-V{v}" for t, v in SHAPES])
@pytest.mark.parametrize("impl", IMPLS)
def test_forward_backward(benchmark, impl, tokens, vocab):
    fn = implementations(DEVICE, with_compile=impl == "reference-compile")[impl]
    ids, mask, adv = make_batch(tokens, vocab, torch.bfloat16, DEVICE)
    n, length = ids.shape

    def setup():
        extra = 1 if impl == "liger-grpo" else 0
        logits = model_output(torch.randn(n, length + extra, vocab, device=DEVICE, dtype=torch.bfloat16))
        return (logits,), {}

    def step(logits):
        fn(logits, ids, mask, adv).backward()
        if CUDA:
            torch.cuda.synchronize()

    benchmark.group = f"T={tokens} V={vocab} bf16 forward+backward"
    benchmark.pedantic(step, setup=setup, rounds=3, warmup_rounds=1)
