"""Host synchronisations per loss call: at most one, for the forward and backward together, with the default
config (value checks on), every backend and both entry points. A sync drains the launch queue behind the
model's forward; the input checks used to cost five of them per call.

What is counted: reads of a tensor's value by the host (``item``, ``bool``, ``int``, ``float`` all reach
``aten._local_scalar_dense``; ``tolist`` and ``numpy`` are counted where they are called) and copies from a
device to the CPU. On CPU tensors nothing really waits, but the same reads happen: the count is the one a
GPU would see."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gtpo_kernels import (
    GTPOConfig,
    fused_linear_gtpo_loss,
    fused_linear_token_logprobs_and_entropy,
    gtpo_loss,
    token_logprobs_and_entropy,
)
from gtpo_kernels.backends import registered

from .helpers import device_for, random_batch


class HostReads(TorchDispatchMode):
    """Counts the host's reads of tensor values inside the ``with`` block."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.count = 0
        self._inside_list = False
        for name in ("tolist", "numpy"):
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counted(original))

    def _counted(self, original):
        def wrapper(tensor, *args, **kwargs):
            self.count += 1
            self._inside_list = True  # its own device-to-host copy is this one read
            try:
                return original(tensor, *args, **kwargs)
            finally:
                self._inside_list = False

        return wrapper

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._inside_list:
            if func is torch.ops.aten._local_scalar_dense.default:
                self.count += 1
            elif func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
                source = args[1] if func is torch.ops.aten.copy_.default else args[0]
                target = args[0].device if func is torch.ops.aten.copy_.default else kwargs.get("device")
                if (
                    isinstance(source, torch.Tensor)
                    and source.device.type != "cpu"
                    and target is not None
                    and torch.device(target).type == "cpu"
                ):
                    self.count += 1
        return func(*args, **kwargs)


def batch(backend):
    logits, ids, mask, adv = random_batch(2, 4, 6, 37, dtype=torch.float32, seed=3)
    dev = device_for(backend)
    return logits.to(dev), ids.to(dev), mask.to(dev), adv.to(dev)


def hidden_and_weight(ids, device, requires_grad=False):
    """``hidden [N, L, 16]`` and an lm_head ``[37, 16]`` for the fused entry points."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(*ids.shape, 16, generator=g).to(device).requires_grad_(requires_grad)
    weight = torch.randn(37, 16, generator=g).to(device).requires_grad_(requires_grad)
    return hidden, weight


def test_the_counter_sees_each_kind_of_read(monkeypatch):
    t = torch.ones(3)
    with HostReads(monkeypatch) as reads:
        bool(t.any())
        float(t.sum())
        t.tolist()
    assert reads.count == 3


@pytest.mark.parametrize("backend", registered())
@pytest.mark.parametrize("preset", ["paper", "official", "grpo"])
def test_logits_loss_makes_one_host_sync(backend, preset, monkeypatch):
    logits, ids, mask, adv = batch(backend)
    logits.requires_grad_()
    with HostReads(monkeypatch) as reads:
        out = gtpo_loss(
            logits,
            ids,
            mask.long(),
            adv,
            group_size=4,
            config=GTPOConfig(preset=preset),
            num_sequences=torch.tensor(8, device=logits.device),
            num_tokens=mask.sum(),
            backend=backend,
        )
        out.loss.backward()
    assert reads.count <= 1


@pytest.mark.parametrize("backend", registered())
def test_fused_loss_makes_one_host_sync(backend, monkeypatch):
    logits, ids, mask, adv = batch(backend)
    hidden, weight = hidden_and_weight(ids, logits.device, requires_grad=True)
    with HostReads(monkeypatch) as reads:
        out = fused_linear_gtpo_loss(hidden, weight, ids, mask.long(), adv, group_size=4, backend=backend)
        out.loss.backward()
    assert reads.count <= 1


@pytest.mark.parametrize("backend", registered())
def test_statistics_make_one_host_sync(backend, monkeypatch):
    logits, ids, mask, _ = batch(backend)
    hidden, weight = hidden_and_weight(ids, logits.device)
    with HostReads(monkeypatch) as reads:
        token_logprobs_and_entropy(logits, ids, mask, backend=backend)
    assert reads.count <= 1
    with HostReads(monkeypatch) as reads:
        fused_linear_token_logprobs_and_entropy(hidden, weight, ids, mask, backend=backend)
    assert reads.count <= 1
