"""Vocabulary-parallel logits and heads (`gtpo_kernels.vocab_parallel`): the shards' statistics combine to the
whole vocabulary's (one process, by hand), and `gtpo_loss(..., vocab_group=...)` and
`fused_linear_gtpo_loss(..., vocab_group=...)` under 2 and 3 real processes (torchrun, gloo) equal the
whole-vocabulary float64 oracle: loss and each rank's gradient, every backend and dtype, each preset and reduction,
uneven shards, temperature, sliced batches, packed completions (``cu_seqlens``) with either; two collectives per
forward, none backward; bad input gets the same error on every rank (tests/vocab_parallel_ranks.py runs the
ranks)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gtpo_kernels import gtpo_loss
from gtpo_kernels.reference import token_logprobs_and_entropy
from gtpo_kernels.vocab_parallel import VocabShards, combine_shard_stats, shard_sizes, target_owner

from .helpers import random_batch

ROOT = Path(__file__).resolve().parents[1]


def test_shard_statistics_combine_to_the_whole_vocabulary():
    """Split float64 logits (banned tokens in one shard, a shard of one column) and combine each shard's own
    statistics: the whole vocabulary's log-prob and entropy, at two temperatures."""
    from gtpo_kernels.backends import get_backend

    logits, ids, mask, _ = random_batch(2, 3, 4, 23, dtype=torch.float64, seed=4)
    logits[0, :, 1:6] = -torch.inf
    valid = torch.ones_like(mask, dtype=torch.bool)
    sizes = (7, 1, 15)
    shards = VocabShards(sizes, 0)
    kernels = get_backend("torch")
    for temperature in (1.0, 0.6):
        parts = []
        for rank, start in enumerate(shards.offsets):
            local = logits[..., start : start + sizes[rank]].contiguous()
            parts.append(torch.stack(kernels.forward(local, ids - start, valid, temperature)))
        _, _, logp, entropy = combine_shard_stats(torch.stack(parts), target_owner(ids, shards), temperature)
        want_logp, want_entropy = token_logprobs_and_entropy(logits / temperature, ids)
        torch.testing.assert_close(logp, want_logp, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(entropy, want_entropy, rtol=1e-12, atol=1e-12)


def test_target_owner_by_hand():
    shards = VocabShards((3, 1, 2), 0)
    ids = torch.tensor([0, 2, 3, 4, 5, 6, -1])
    assert target_owner(ids, shards).tolist() == [0, 0, 1, 2, 2, -1, -1]
    assert shard_sizes(151936, 3) == [50646, 50645, 50645]


def test_vocab_group_without_distributed_is_refused():
    logits, ids, mask, adv = random_batch(1, 2, 3, 5)
    with pytest.raises(ValueError, match="torch.distributed is not initialised"):
        gtpo_loss(logits, ids, mask, adv, group_size=2, vocab_group=object())


def test_a_named_group_is_not_kept_alive():
    """The operators find process groups by name; the registry must not keep one alive after its caller let go: a
    gloo group freed only at interpreter exit aborted finished 3-process runs now and then ('terminate called
    without an active exception', exit status -6, after the results were written)."""
    import gc

    from gtpo_kernels import vocab_parallel

    class Group:  # a stand-in: the registry only needs an object it can name
        pass

    group = Group()
    name = vocab_parallel.group_name(group)
    assert vocab_parallel.group_named(name) is group
    del group
    gc.collect()
    assert name not in vocab_parallel._GROUPS


def launch(world: int, out) -> dict:
    from .test_trainer_distributed import free_port

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world)]
    cmd += ["--master_port", str(free_port()), "tests/vocab_parallel_ranks.py", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


def tolerance(case: str, name: str) -> float:
    """float64 cases 1e-10; otherwise what is accumulated in float32 (the loss, log-probs, entropies) 1e-5 whatever
    the logits' dtype, and the gradient of bf16/fp16 logits, rounded to their dtype, 1e-2."""
    if "float64" in case:
        return 1e-10
    return 1e-5 if "float32" in case or name != "grad" else 1e-2


# One test per launch (a fixture shared by several tests would launch once per xdist worker).
@pytest.mark.parametrize("world", [2, 3], ids=["2 ranks", "3 ranks"])
@pytest.mark.cpu_kernels
def test_ranks_against_the_whole_vocabulary_oracle(world, tmp_path):
    """Logits shards (padded and packed) and head shards (the fused path: the shard's weight and bias gradients,
    and the hidden states' summed over the group), each case's oracle gradient non-zero and every shard holding
    targets; a header of a few integers and one gather of the statistics per forward (the fused path: one per chunk of
    its walk), none in the backward; bad input gets the same clear error on every rank."""
    ranks = launch(world, tmp_path / "results.json")
    cases = ranks["cases"]
    assert len(cases) >= (32 if world == 2 else 16)
    assert any("fused" in case for case in cases) and any("packed" in case for case in cases)
    statistics = [case for case in cases if case.endswith(("token_logprobs_and_entropy", "entropy/chunked"))]
    assert len(statistics) == 2, statistics
    for case, errors in cases.items():
        if case in statistics:  # no-grad statistics: the log-probs and entropies themselves, no backward
            assert errors["nonzero"] == 1, case
            names = ("logp", "entropy")
        else:
            assert errors["signal"] == 1, case
            assert errors["shards_without_targets"] == 0, case
            assert errors["backward_collectives"] == 0, case
            names = ("loss", "grad", "entropy")
        for name in names:
            assert errors[name] <= tolerance(case, name), (world, case, name, errors[name])
        if "chunked" in case:
            assert errors["forward_collectives"] > 2, case
        else:
            assert errors["forward_collectives"] == 2, case
    per_rank = ranks["bad_input"]
    assert len(per_rank) == world and all(messages == per_rank[0] for messages in per_rank)
    assert "must lie in [0, V=37)" in per_rank[0]["id outside the whole vocabulary"]
    assert "must lie in [0, V=37)" in per_rank[0]["fused: id outside the whole vocabulary"]
    assert "every rank must pass the same rows" in per_rank[0]["rows differ across ranks"]
