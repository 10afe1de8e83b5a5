"""The fused ``hidden @ lm_head`` loss holds one chunk of logits at a time: the peak memory of a forward and backward
over several chunks stays below the gradients it returns plus one and a half chunks (two chunks alive at once, the
next one's logits made while the last one's are still bound, is over it).

Measured in a fresh process by its resident set's high-water mark (``bench.common.resident_peak``), which sees the
operator's internal chunks (a dispatch mode sees only its outputs), with glibc handing large frees back at once.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20

# One step in a subprocess: a warm call, then the peak above the resident set of a second, and the persistent bytes.
_STEP = """
import json, torch
from bench.common import MEMORY_MMAP_THRESHOLD, mmap_threshold, resident_peak
from gtpo_kernels import GTPOConfig, fused_linear_gtpo_loss
torch.manual_seed(0)
n, length, hidden, vocab, budget, softcap, quantile = {args}
h = torch.randn(n, length, hidden).requires_grad_()
w = (torch.randn(vocab, hidden) / hidden**0.5).requires_grad_()
ids = torch.randint(0, vocab, (n, length))
mask = torch.ones(n, length, dtype=torch.bool)
adv = torch.randn(n)
config = GTPOConfig(max_chunk_bytes=budget, top_entropy_quantile=quantile)
def step():
    out = fused_linear_gtpo_loss(
        h, w, ids, mask, adv, group_size=2, config=config, backend="cpu", logit_softcap=softcap
    )
    out.loss.backward()
    assert torch.isfinite(out.loss)
    h.grad = w.grad = None
mmap_threshold(MEMORY_MMAP_THRESHOLD)  # the warm step's frees handed back too
step()
peak = resident_peak(step)
print(json.dumps({{"peak": peak.extra, "resident_peak_exact": peak.exact}}))
"""


def _peak(n, length, hidden, vocab, budget, softcap=None, quantile=1.0) -> dict:
    args = (n, length, hidden, vocab, budget, softcap, quantile)
    proc = subprocess.run(
        [sys.executable, "-c", _STEP.format(args=repr(args))],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"OMP_NUM_THREADS": "2", "PATH": "/usr/bin:/bin", "TRITON_INTERPRET": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


CASES = {
    # whole completions, 4 to a chunk, 4 chunks
    "chunks of rows": dict(n=16, length=64, hidden=64, vocab=32768, budget=32 * MiB),
    # one completion 4 budgets long, in pieces
    "pieces of one row": dict(n=2, length=1024, hidden=64, vocab=32768, budget=32 * MiB),
    # the top-entropy quantile's second walk makes every chunk's logits again
    "two walks": dict(n=16, length=64, hidden=64, vocab=32768, budget=32 * MiB, quantile=0.5),
    # a soft-capped head: half the tokens a chunk, the cap's slope beside them
    "soft-capped head": dict(n=16, length=64, hidden=64, vocab=32768, budget=32 * MiB, softcap=30.0),
}


@pytest.mark.cpu_kernels
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's resident-set high-water mark")
@pytest.mark.parametrize("case", list(CASES))
def test_one_chunk_of_logits_alive_at_a_time(case):
    shape = CASES[case]
    n, length, hidden, vocab, budget = (shape[k] for k in ("n", "length", "hidden", "vocab", "budget"))
    assert n * length * vocab * 4 >= 4 * budget  # several chunks' worth of logits
    measured = _peak(n, length, hidden, vocab, budget, shape.get("softcap"), shape.get("quantile", 1.0))
    assert measured["resident_peak_exact"], "no VmHWM reset here: the sampled resident set is not a bound"
    # What any correct walk holds: d_W accumulated in float32 and returned, d_hidden, the statistics.
    persistent = vocab * hidden * 4 * 2 + n * length * hidden * 4 + 8 * n * length * 4
    bound = persistent + 1.5 * budget
    assert measured["peak"] < bound, (
        f"peak {measured['peak'] / MiB:.1f} MiB over {bound / MiB:.1f} MiB (gradients {persistent / MiB:.1f} MiB "
        f"+ 1.5 chunks of {budget / MiB:.0f} MiB): more than one chunk of logits alive at once"
    )
