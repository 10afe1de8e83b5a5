"""The run's precision: bf16 autocast for the matrix products, or float32; ``auto`` picks the faster on this machine.

Whether a CPU has bf16 units cannot be read from oneDNN's "bf16 supported" answer: that is true on any AVX-512
CPU, where oneDNN emulates bf16 several times slower than float32. So on a CPU ``auto`` times one matrix product
of the model's shapes in each precision (a fraction of a second, once per process) and takes bf16 only where it is
clearly faster; on a GPU it takes bf16.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Tuple

import torch

from gtpo_kernels.hf.model_config import text_config, unwrap

from .config import TrainConfig

# bf16 is taken where its product takes at most this share of float32's time: a clear win, not timing noise.
BF16_MUST_TAKE = 0.8
# The timed product: this many rows (a micro-batch's tokens), the model's hidden and MLP widths.
TIMED_ROWS = 256
DEFAULT_SHAPE = (576, 1536)  # SmolLM2-135M's hidden and MLP widths, for callers without a model
# A model whose hidden x MLP widths are below this runs in float32 untimed: its products take microseconds either way,
# too short to time reliably, and a choice that flipped between processes would change a resumed run's rounding.
TIMED_BELOW = 2**18


@dataclass(frozen=True)
class PrecisionChoice:
    """What ``--precision`` resolved to, and why (printed in the run's first lines)."""

    bf16: bool
    reason: str

    @property
    def name(self) -> str:
        return "bf16" if self.bf16 else "fp32"


def cpu_bf16_units() -> List[str]:
    """The CPU's bf16 instruction sets from /proc/cpuinfo (``avx512_bf16``, ``amx_bf16``): empty where it has none
    or the file is not there. (oneDNN's "bf16 supported" is true on any AVX-512 CPU, emulated or not.)"""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
    return [flag for flag in ("avx512_bf16", "amx_bf16") if flag in flags]


@dataclass(frozen=True)
class Machine:
    """What a run ran on, for its figures: the CPU's name, cores and bf16 units (CPUs of one name differ in them,
    which changes bf16 timings and rounding), the GPU where it used one, and torch's version."""

    cpu: str
    cores: int
    bf16_units: Tuple[str, ...]
    gpu: Optional[str]
    torch: str

    @classmethod
    def this(cls, device: Optional[torch.device] = None) -> Machine:
        cpu = platform.machine()  # (not platform.processor(): it runs a program where /proc/cpuinfo is absent)
        try:
            with open("/proc/cpuinfo") as f:
                names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
            cpu = names[0] if names else cpu
        except OSError:
            pass
        gpu = torch.cuda.get_device_name(device) if device is not None and device.type == "cuda" else None
        return cls(cpu, os.cpu_count() or 1, tuple(cpu_bf16_units()), gpu, torch.__version__)

    def as_dict(self) -> dict:
        return {**asdict(self), "bf16_units": list(self.bf16_units)}

    def __str__(self) -> str:
        units = ", ".join(self.bf16_units) or "no bf16 units"
        where = f"{self.gpu} on " if self.gpu else ""
        return f"{where}{self.cpu} ({self.cores} cores, {units}), torch {self.torch}"


def time_product(dtype: torch.dtype, shape: Tuple[int, int], repeats: int = 5) -> float:
    """The fastest of ``repeats`` timings (s) of a ``[TIMED_ROWS, hidden] @ [hidden, mlp]`` product in ``dtype``
    on the CPU, after one untimed warm-up (oneDNN builds its kernel on the first call)."""
    hidden, mlp = shape
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(TIMED_ROWS, hidden, generator=generator).to(dtype)
    b = torch.randn(hidden, mlp, generator=generator).to(dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - started)
    return best


_measured: Dict[Tuple[int, int], PrecisionChoice] = {}


def measure_cpu(shape: Tuple[int, int] = DEFAULT_SHAPE) -> PrecisionChoice:
    """bf16 or float32 on this CPU, by timing both on ``shape`` (hidden, MLP width); measured once per shape."""
    if shape not in _measured and shape[0] * shape[1] < TIMED_BELOW:
        _measured[shape] = PrecisionChoice(False, f"auto: float32 for a model this small ({shape[0]}x{shape[1]})")
    if shape not in _measured:
        fp32 = time_product(torch.float32, shape)
        bf16 = time_product(torch.bfloat16, shape)
        faster = bf16 <= BF16_MUST_TAKE * fp32
        _measured[shape] = PrecisionChoice(
            faster,
            f"auto: a {TIMED_ROWS}x{shape[0]} @ {shape[0]}x{shape[1]} product took {bf16 * 1e3:.2f} ms in bf16 and "
            f"{fp32 * 1e3:.2f} ms in float32 on this CPU, so "
            + ("bf16 autocast" if faster else f"float32 (bf16 is taken at {BF16_MUST_TAKE:.0%} of float32's time)"),
        )
    return _measured[shape]


def model_shape(model) -> Optional[Tuple[int, int]]:
    """``(hidden, MLP width)`` of a transformers model's config, or None where it does not say."""
    config = text_config(unwrap(model))
    hidden, mlp = getattr(config, "hidden_size", None), getattr(config, "intermediate_size", None)
    return (int(hidden), int(mlp)) if isinstance(hidden, int) and isinstance(mlp, int) else None


def choose(config: TrainConfig, device: torch.device, model=None) -> PrecisionChoice:
    """``config.precision`` resolved on ``device``: as given, or (``auto``) bf16 on a GPU and, on a CPU, the faster
    of the two on ``model``'s shapes (the last shapes measured in this process if no model is given)."""
    if config.precision == "fp32":
        return PrecisionChoice(False, "--precision fp32")
    if config.precision == "bf16":
        return PrecisionChoice(True, "--precision bf16")
    if device.type != "cpu":
        return PrecisionChoice(True, f"auto: bf16 autocast on {device.type}")
    shape = model_shape(model) if model is not None else None
    if shape is None:
        shape = next(reversed(_measured)) if _measured else DEFAULT_SHAPE
    return measure_cpu(shape)


def choose_together(config: TrainConfig, dist, model) -> PrecisionChoice:
    """`choose` on every process of ``dist``, settled as one answer: a CPU's timing may fall on either side of the
    bar in two processes, and processes that update one model together must round alike (bf16 only if all chose
    it). Every later `uses_bf16` call of this process returns the settled answer."""
    choice = choose(config, dist.device, model)
    if dist.world > 1 and config.precision == "auto" and dist.device.type == "cpu":
        everyone = not dist.any(not choice.bf16)
        if everyone != choice.bf16:
            choice = PrecisionChoice(everyone, choice.reason + "; float32, as another process measured")
        _measured[model_shape(model) or DEFAULT_SHAPE] = choice
    return choice


def uses_bf16(config: TrainConfig, device: torch.device) -> bool:
    """Whether the run takes bf16 autocast (`choose`)."""
    return choose(config, device).bf16


def autocast(config: TrainConfig, device: torch.device):
    """bf16 autocast for the matrix products (the loss kernels accumulate in float32 whatever the dtype) where
    `uses_bf16`."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=uses_bf16(config, device))
