"""The one registry of backends for the vocabulary-sized work (per-token log-prob and entropy,
forward and backward) and the conflict weights.

Each backend is a module in this package that defines ``BACKEND = Backend(...)`` (see `base.Backend`).
Adding one is that module plus one line in ``_MODULES``; the order of ``_MODULES`` is the order in which
``backend="auto"`` tries them for a device. Backend modules import only `base` and their own kernel
files, never the rest of the package, so the import graph stays a tree.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from typing import Dict, Optional, Tuple

import torch

from .base import Backend

_MODULES: Dict[str, str] = {
    "triton": "triton_backend",  # fused Triton kernels (CUDA; CPU tensors under TRITON_INTERPRET=1)
    "cpu": "cpu_backend",  # C++ kernels in csrc/
    "torch": "torch_backend",  # plain PyTorch in chunks; the fallback everywhere
}
NAMES: Tuple[str, ...] = ("auto", *_MODULES)


def registered() -> Tuple[str, ...]:
    """Every registered backend's name, in ``"auto"``'s order of preference."""
    return tuple(_MODULES)


@functools.cache
def get_backend(name: str) -> Backend:
    """The registered backend called ``name`` (importing its module on first use)."""
    if name not in _MODULES:
        raise ValueError(f"backend must be one of {NAMES}, got {name!r}")
    return importlib.import_module(f"{__name__}.{_MODULES[name]}").BACKEND


def _importable(name: str) -> bool:
    try:
        get_backend(name)
        return True
    except ImportError:  # e.g. triton not installed
        return False


@functools.cache
def _warn_fallback(device_type: str, preferred: str, why: str) -> None:
    warnings.warn(
        f"gtpo_kernels: backend='auto' uses the slower 'torch' backend for {device_type} tensors because "
        f"'{preferred}' is unavailable: {why}",
        RuntimeWarning,
        stacklevel=4,
    )


def resolve_backend(name: str, device: torch.device) -> Backend:
    """The backend for tensors on ``device``: ``"auto"`` takes the first registered backend that prefers
    this device type and can run (warning once when it falls back to ``"torch"``); a named backend
    must be able to run there, or a ``ValueError`` says why and what to use instead."""
    if name == "auto":
        preferred = None
        for candidate in _MODULES:
            if not _importable(candidate):
                if preferred is None and candidate == "triton" and device.type == "cuda":
                    preferred = (candidate, "the triton package is not installed")
                continue
            backend = get_backend(candidate)
            if device.type not in backend.auto_devices:
                continue
            why = backend.unavailable(device)
            if why is None:
                return backend
            preferred = preferred or (candidate, why)
        if preferred is not None:
            _warn_fallback(device.type, *preferred)
        return get_backend("torch")
    if name not in _MODULES:
        raise ValueError(f"backend must be one of {NAMES}, got {name!r}")
    try:
        backend = get_backend(name)
    except ImportError as exc:
        raise ValueError(
            f"backend={name!r} cannot be imported ({exc}); install what it needs or use backend='torch'"
        ) from exc
    why = backend.unavailable(device)
    if why is not None:
        raise ValueError(why)
    return backend


@torch.compiler.assume_constant_result
def resolve_backend_name(name: str, device_type: str) -> str:
    """`resolve_backend`'s choice, by name: a constant for ``torch.compile`` (decided when tracing)."""
    return resolve_backend(name, torch.device(device_type)).name


def kernels_for(backend: Backend, logits_dtype: torch.dtype, max_chunk_bytes: Optional[int] = None) -> Backend:
    """``backend`` if its token-statistics kernels take ``logits_dtype``, else the ``"torch"`` backend, with the
    chunk budget ``max_chunk_bytes`` set where the kernels take one (`Backend.with_chunk_bytes`)."""
    kernels = backend if logits_dtype in backend.logits_dtypes else get_backend("torch")
    return kernels.with_chunk_bytes(max_chunk_bytes)
