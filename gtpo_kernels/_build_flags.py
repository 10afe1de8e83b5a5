"""Compiler flags for the C++ CPU kernels, shared by setup.py and the JIT build (no torch import here).

ATen's ``at::vec::Vectorized`` is plain scalar code unless a ``CPU_CAPABILITY`` is defined, so the
kernels are compiled for the best instruction set of the machine that builds them (they are built on
the machine that runs them: a source install or a JIT build, never a shipped binary).
"""

from __future__ import annotations

import platform
from typing import List


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def vector_flags() -> List[str]:
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    flags = _cpu_flags()
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"} <= flags:
        return ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma",
                "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
    if {"avx2", "fma"} <= flags:
        return ["-mavx2", "-mfma", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return []


def extension_compile_args() -> List[str]:
    # at::parallel_for is OpenMP in torch's CPU builds: compile the pragmas and let the symbols resolve
    # to torch's own libgomp at load time (no second OpenMP runtime is linked).
    return ["-O3", "-fopenmp", *vector_flags()]
