"""Runs the Triton kernels on the CPU through Triton's interpreter (set before triton is imported).

On a CUDA machine set GTPO_TEST_CUDA=1 to run the kernels compiled, on the GPU, instead.
"""

import os

if os.environ.get("GTPO_TEST_CUDA", "0") == "0":
    os.environ.setdefault("TRITON_INTERPRET", "1")
