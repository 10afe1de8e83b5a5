"""``--precision auto``: bf16 autocast only where a bf16 product of the model's shapes is measured faster than a
float32 one on this CPU (oneDNN's "bf16 supported" is true on CPUs that only emulate bf16), bf16 on a GPU, the
given precision otherwise; the choice is measured once and named in the run's first lines."""

import pytest
import torch

from trainer import precision
from trainer.config import TrainConfig

SHAPE = (576, 1536)


@pytest.fixture(autouse=True)
def fresh_measurements(monkeypatch):
    monkeypatch.setattr(precision, "_measured", {})


def timings(monkeypatch, bf16_s, fp32_s):
    calls = []

    def timed(dtype, shape, repeats=5):
        calls.append((dtype, shape))
        return bf16_s if dtype == torch.bfloat16 else fp32_s

    monkeypatch.setattr(precision, "time_product", timed)
    return calls


class Model:
    class config:
        hidden_size, intermediate_size = SHAPE


@pytest.mark.parametrize(
    "bf16_s, fp32_s, expected",
    [(0.5e-3, 1.0e-3, True), (3.0e-3, 1.0e-3, False), (0.9e-3, 1.0e-3, False)],
    ids=["bf16-units", "emulated-bf16", "bf16-barely-faster"],
)
def test_auto_takes_bf16_only_where_it_is_measured_faster(monkeypatch, bf16_s, fp32_s, expected):
    # oneDNN says yes whatever the CPU: the choice must not follow it.
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True, raising=False)
    calls = timings(monkeypatch, bf16_s, fp32_s)
    choice = precision.choose(TrainConfig(precision="auto"), torch.device("cpu"), Model())
    assert choice.bf16 is expected and choice.name == ("bf16" if expected else "fp32")
    assert f"{bf16_s * 1e3:.2f} ms in bf16" in choice.reason and f"{fp32_s * 1e3:.2f} ms in float32" in choice.reason
    assert {shape for _, shape in calls} == {SHAPE}  # the model's own shapes
    # Measured once: the autocast of every later phase reuses it.
    assert precision.uses_bf16(TrainConfig(precision="auto"), torch.device("cpu")) is expected
    assert len(calls) == 2


@pytest.mark.parametrize(
    "given, device, expected", [("fp32", "cpu", False), ("bf16", "cpu", True), ("auto", "cuda", True)]
)
def test_a_given_precision_or_a_gpu_is_not_timed(monkeypatch, given, device, expected):
    calls = timings(monkeypatch, 1.0, 1.0)
    assert precision.choose(TrainConfig(precision=given), torch.device(device), Model()).bf16 is expected
    assert calls == []


def test_a_tiny_model_runs_in_float32_untimed(monkeypatch):
    calls = timings(monkeypatch, 1e-6, 1.0)

    class Tiny:
        class config:
            hidden_size, intermediate_size = 32, 64

    choice = precision.choose(TrainConfig(precision="auto"), torch.device("cpu"), Tiny())
    assert not choice.bf16 and calls == []


def test_the_product_is_timed_in_the_dtype_asked(monkeypatch):
    seen = []
    real = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: seen.append((a.dtype, a.shape, b.shape)) or real(a, b))
    assert precision.time_product(torch.bfloat16, (64, 96), repeats=2) > 0
    assert set(seen) == {(torch.bfloat16, (precision.TIMED_ROWS, 64), (64, 96))} and len(seen) == 3
