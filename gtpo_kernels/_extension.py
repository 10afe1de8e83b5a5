"""Finding the C++ CPU kernels: the extension built by setup.py, else a JIT build (cached), else none.

`load_cpu_extension()` returns the module or raises; `cpu_extension_available()` answers without
raising and warns once, with the reason, when the kernels cannot be had (``backend="auto"`` then
uses the PyTorch backend).
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path

_SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "gtpo_cpu.cpp"


@functools.lru_cache(maxsize=None)
def _load():
    try:
        from . import _C  # built by setup.py (pip install --no-build-isolation -e .)

        return _C, None
    except ImportError as exc:
        built_error = exc
    if not _SOURCE.exists():
        return None, f"the extension was not built ({built_error}) and csrc/ is not next to the package"
    try:
        from torch.utils.cpp_extension import load

        from ._build_flags import extension_compile_args

        cache = Path(os.environ.get("GTPO_KERNELS_CACHE", Path.home() / ".cache" / "gtpo_kernels"))
        cache.mkdir(parents=True, exist_ok=True)
        module = load(name="gtpo_kernels_cpu", sources=[str(_SOURCE)], extra_cflags=extension_compile_args(),
                      build_directory=str(cache), verbose=False)
        return module, None
    except Exception as exc:  # noqa: BLE001 (compiler missing, ninja missing, build error: all mean "none")
        return None, f"the extension was not built ({built_error}) and the JIT build failed: {exc}"


def load_cpu_extension():
    module, why = _load()
    if module is None:
        raise RuntimeError(f"backend='cpu' is unavailable: {why}. Reinstall with "
                           f"`pip install --no-build-isolation -e .` (needs a C++ compiler), or use backend='torch'")
    return module


@functools.lru_cache(maxsize=None)
def cpu_extension_available() -> bool:
    module, why = _load()
    if module is None:
        warnings.warn(f"gtpo_kernels: the C++ CPU kernels are unavailable ({why}); backend='auto' uses the slower "
                      f"PyTorch backend on CPU tensors", RuntimeWarning, stacklevel=3)
    return module is not None
