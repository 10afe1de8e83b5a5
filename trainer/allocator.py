"""The host allocator's settings for a training process on a CPU.

A step frees about a gigabyte of activations at the end of each backward and allocates it again in the next forward.
glibc's malloc hands freed memory at the top of its heap back to the kernel once more than its trim threshold is free
there, and serves large blocks from mappings of their own, unmapped on free; either way the next step's allocations
fault every page in again, zeroed by the kernel, and the update's decoder forward took about twice as long inside a
step as the same forward run twice in a row (`python -m bench trainer`; bench/results/step-issue64/). Keeping freed
memory in the process removes that: the resident set stays at the step's peak, which it reaches anyway. No block gets
a mapping of its own, however large: the built-in model's embedding gradient (49152 x 576 in float32, 113 MB, one per
embedding call in the update) is above the largest threshold glibc allows (32 MiB), and faulting it in again took
about 0.15 s a call (`python -m bench update_profile`, bench/results/step-issue64/update-profile.md).

What it costs: what training freed stays resident into an evaluation, whose key/value cache for 32 problems x 17
completions is a few GB more; two study cells evaluating at once on a 24 GiB machine ran it out of memory (a cell's
process reached 12.5 GB), and each batch's cache, of a new size, came on top of the last one's. So each evaluation
batch first hands every free page back (`release_freed_memory`, glibc's ``malloc_trim``): the next training step
faults its activations in again, once per evaluation, not once per step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Optional

# mallopt's parameter numbers (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4  # how many blocks may have mappings of their own: 0, every block comes from the heap
# Free memory at the heap's top is kept up to this much: the largest value mallopt's int takes, 2 GiB, above a
# default step's activations.
TRIM_THRESHOLD = 2**31 - 1


@functools.cache
def _libc() -> Optional[ctypes.CDLL]:
    """The C library, looked up once per process (``find_library`` runs a program), or None where it cannot be
    loaded."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"))
    except (OSError, TypeError):
        return None


def keep_freed_memory() -> Optional[str]:
    """Tells glibc's malloc to keep freed memory for the process's next allocations (free memory at the heap's top
    trimmed only past 2 GiB, every block from the heap); returns why it could not, or None. Not glibc (musl,
    macOS): nothing is changed."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return f"no glibc mallopt in {ctypes.util.find_library('c')!r}"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not (mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return "mallopt refused the settings"
    return None


def release_freed_memory() -> bool:
    """Hands the free pages of every malloc arena back to the kernel (glibc's ``malloc_trim(0)``), as before an
    evaluation, whose cache would otherwise come on top of what training freed. Returns whether any was released;
    False where there is no glibc."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))
