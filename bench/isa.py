"""Static instruction counts of the Triton token-statistics kernels compiled for sm_90 (H100/H200), on any
machine: ``python -m bench isa``. Uses the ptxas/cuobjdump that ship with triton; no GPU needed.

Prints each kernel's SASS instruction count and its main loop's (the largest backward branch: the walk
over the vocabulary, including the rarely taken rescale branch inside it), per element of that loop.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile


def compile_kernel(fn, signature: dict, constexprs: dict, num_warps: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def sass(kernel) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def loop_length(text: str) -> int:
    best = 0
    for line in text.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4})\*/\s+.*BRA 0x([0-9a-f]+)", line)
        if m and int(m.group(2), 16) < int(m.group(1), 16):
            best = max(best, (int(m.group(1), 16) - int(m.group(2), 16)) // 16 + 1)
    return best


def main(argv=None) -> None:
    from gtpo_kernels.backends import triton_token_stats as k

    block, warps = 8192, 16
    common = {"logits_ptr": "*bf16", "ids_ptr": "*i32", "valid_ptr": "*i1", "max_ptr": "*fp32", "log_s_ptr": "*fp32",
              "logp_ptr": "*fp32", "entropy_ptr": "*fp32"}
    forward = compile_kernel(k._token_stats_forward_kernel, {
        **common, "length": "i32", "vocab": "i32", "stride_n": "i64", "stride_l": "i64",
        "inv_temperature": "fp32", "BLOCK_V": "constexpr"}, {"BLOCK_V": block}, warps)
    backward = compile_kernel(k._token_stats_backward_kernel, {
        "logits_ptr": "*bf16", "grad_ptr": "*bf16", "ids_ptr": "*i32", "valid_ptr": "*i1", "max_ptr": "*fp32",
        "log_s_ptr": "*fp32", "logp_ptr": "*fp32", "entropy_ptr": "*fp32", "grad_logp_ptr": "*fp32",
        "grad_entropy_ptr": "*fp32", "length": "i32", "vocab": "i32", "stride_n": "i64", "stride_l": "i64",
        "grad_stride_n": "i64", "grad_stride_l": "i64", "inv_temperature": "fp32", "BLOCK_V": "constexpr",
        "EMULATE_BF16_ROUNDING": "constexpr"}, {"BLOCK_V": block, "EMULATE_BF16_ROUNDING": False}, warps)
    per_thread = block // (warps * 32)
    for name, kernel in (("forward", forward), ("backward", backward)):
        text = sass(kernel)
        body = loop_length(text)
        total = len(re.findall(r"^\s+/\*[0-9a-f]{4}\*/", text, re.MULTILINE))
        print(f"{name}: {total} SASS instructions; main loop {body} for {per_thread} elements per thread "
              f"({body / per_thread:.1f} per element), {text.count('BAR.SYNC')} BAR.SYNC (bf16, BLOCK_V={block}, "
              f"{warps} warps, sm_90)")


if __name__ == "__main__":
    main()
