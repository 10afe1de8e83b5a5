"""How the C++ CPU kernels are compiled: one variant per instruction set, shared by setup.py and the
JIT build. Imports nothing from torch or the package (setup.py loads this file by path).

ATen's ``at::vec::Vectorized`` is plain scalar code unless a ``CPU_CAPABILITY`` is defined, and code
compiled for AVX-512 dies with SIGILL on a machine without it. So ``csrc/gtpo_cpu.cpp`` is compiled
three times on x86-64 (``default``: baseline x86-64, ``avx2``, ``avx512``, the same split as PyTorch's
own kernels) and `cpu_extension` loads the best one the running machine supports: a wheel or an image
built on one machine runs on any other.
"""

from __future__ import annotations

import platform
from typing import List

VARIANTS = ("avx512", "avx2", "default")  # best first

_FLAGS = {
    "avx512": [
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mfma",
        "-mf16c",
        "-DCPU_CAPABILITY=AVX512",
        "-DCPU_CAPABILITY_AVX512",
    ],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
    "default": ["-DCPU_CAPABILITY=DEFAULT"],
}


def variants_for_this_platform() -> List[str]:
    """Every variant that can be compiled here (the machine that runs them may support fewer)."""
    return list(VARIANTS) if platform.machine() in ("x86_64", "AMD64") else ["default"]


def module_name(variant: str) -> str:
    return f"_cpu_{variant}"


def compile_args(variant: str) -> List[str]:
    """The variant's flags. No ``-std=``: torch's ``cpp_extension`` adds the standard its own headers need (C++17
    in torch 2.11 and before, C++20 from 2.13 on, which the headers of 2.15 require) to the install-time build and
    the JIT build alike, and a standard named here would override it."""
    # at::parallel_for is OpenMP in torch's CPU builds: compile the pragmas and let the symbols resolve
    # to torch's own libgomp at load time (no second OpenMP runtime is linked).
    return ["-O3", "-fopenmp", *_FLAGS[variant]]
