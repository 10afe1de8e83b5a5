"""Loading the C++ CPU kernels: the variant built at install time for the best instruction set this
machine supports, else a JIT build of it (cached, said out loud), else nothing.

The kernels register as ``torch.ops.gtpo_cpu.*`` when their library loads. Exactly one variant is
loaded per process. ``GTPO_CPU_CAPABILITY=default|avx2|avx512`` picks a variant by hand (for tests of
the baseline build, or to rule the vector code out); by default it follows PyTorch's own choice,
``torch.backends.cpu.get_cpu_capability()``, which ``ATEN_CPU_CAPABILITY`` also lowers.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from pathlib import Path
from typing import Optional, Tuple

import torch

from . import cpu_build

_SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "gtpo_cpu.cpp"
_BUILD_LOG = Path(__file__).resolve().parent / "_cpu_build_error.txt"  # written by setup.py when it failed


def supported_variant() -> str:
    """The best variant this machine runs, by PyTorch's own CPU detection."""
    if "default" == cpu_build.variants_for_this_platform()[0]:
        return "default"
    capability = torch.backends.cpu.get_cpu_capability().lower()
    return capability if capability in cpu_build.VARIANTS else "default"


def wanted_variant() -> str:
    supported = supported_variant()
    forced = os.environ.get("GTPO_CPU_CAPABILITY", "").strip().lower()
    if not forced:
        return supported
    if forced not in cpu_build.VARIANTS:
        raise ValueError(f"GTPO_CPU_CAPABILITY must be one of {cpu_build.VARIANTS}, got {forced!r}")
    order = cpu_build.VARIANTS
    if order.index(forced) < order.index(supported):
        raise ValueError(
            f"GTPO_CPU_CAPABILITY={forced} asks for instructions this CPU lacks (it supports up to "
            f"{supported}); unset it or choose a lower one"
        )
    return forced


def _import_built(variant: str):
    return importlib.import_module(f"{__package__}.{cpu_build.module_name(variant)}")


def _jit_build(variant: str, why: str) -> None:
    from torch.utils.cpp_extension import load

    cache = Path(os.environ.get("GTPO_KERNELS_CACHE", Path.home() / ".cache" / "gtpo_kernels"))
    build_dir = cache / f"torch-{torch.__version__}" / variant
    build_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"gtpo_kernels: compiling the C++ CPU kernels ({variant}) into {build_dir}, once (about a minute), "
        f"because {why}",
        file=sys.stderr,
        flush=True,
    )
    load(
        name=f"gtpo_cpu_{variant}",
        sources=[str(_SOURCE)],
        extra_cflags=cpu_build.compile_args(variant),
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=False,
    )


@functools.cache
def _load() -> Tuple[Optional[str], Optional[str]]:
    """``(variant loaded, None)`` or ``(None, why not)``."""
    variant = wanted_variant()
    try:
        _import_built(variant)
        return variant, None
    except ImportError as exc:
        reason = f"the {variant} build from the install is missing ({exc})"
    if _BUILD_LOG.exists():
        reason += f"; the install-time build failed:\n{_BUILD_LOG.read_text()[-2000:]}"
    if not _SOURCE.exists():
        return None, f"{reason}, and csrc/ is not next to the package for a JIT build"
    try:
        _jit_build(variant, reason)
        return variant, None
    except Exception as exc:  # noqa: BLE001 (compiler missing, ninja missing, build error: all mean "none")
        return None, f"{reason}; the JIT build failed too: {exc}"


def load_cpu_extension() -> str:
    """Loads the kernels (``torch.ops.gtpo_cpu``) and returns the variant, or raises with the reason."""
    variant, why = _load()
    if variant is None:
        raise RuntimeError(
            f"backend='cpu' is unavailable: {why}. Reinstall with "
            f"`pip install --no-build-isolation -e .` (needs a C++ compiler), or use backend='torch'"
        )
    return variant


def extension_error() -> Optional[str]:
    """``None`` when the kernels load, else why not (building them on first call if needed)."""
    return _load()[1]
