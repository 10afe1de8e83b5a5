"""Static instruction counts of the Triton token-statistics kernels compiled for sm_90 (H100/H200), on any
machine: ``python -m bench isa``. Uses the ptxas/cuobjdump that ship with triton; no GPU needed.

For each kernel: its SASS instruction count and its main loop's (the largest backward branch: the walk over
the vocabulary; for our forward, the common path that blocks below the running max take), per element of
that loop. Our kernels are compiled at the launch configuration the package picks for ``--vocab`` (bf16
logits); Liger-Kernel's forward kernels (``_grpo_loss_fwd_kernel``, ``_selective_log_softmax_kernel``) at the
configuration Liger launches them with, when liger-kernel is installed. Fewer instructions per element is
what moves an instruction-bound forward towards the read floor; it is a proxy, the GPU's clock is the test.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from typing import List, Optional, Tuple


def compile_kernel(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int = 3):
    """``fn`` compiled for sm_90 with every pointer, size and stride argument marked divisible by 16, as Triton
    specialises a launch at the headline shape (V = 151936, rows of V elements, torch's aligned buffers):
    that is what lets it vectorise the loads of a row."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {
        (fn.arg_names.index(name),): [["tt.divisibility", 16]]
        for name, kind in signature.items()
        if kind.startswith("*") or kind in ("i32", "i64")
    }
    return triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )


def sass(kernel) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def loops(text: str) -> List[Tuple[int, int]]:
    """``(start, end)`` instruction indices of every backward branch's span."""
    spans = []
    for line in text.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+.*BRA (?:`\(\.L_x_\d+\) )?0x([0-9a-f]+)", line)
        if m and int(m.group(2), 16) < int(m.group(1), 16):
            spans.append((int(m.group(2), 16) // 16, int(m.group(1), 16) // 16))
    return spans


def loop_length(text: str) -> int:
    """Instructions in the largest loop (the walk over the vocabulary, every branch inside it included)."""
    return max((end - start + 1 for start, end in loops(text)), default=0)


def common_path_length(text: str) -> int:
    """Instructions a loop iteration executes on its common path: the largest loop less the forward
    branches it jumps over (our forward's rare rescale branch). Counted as the loop's instructions minus the
    span of each forward branch inside it whose target lies inside the loop and past its own position."""
    spans = loops(text)
    if not spans:
        return 0
    start, end = max(spans, key=lambda s: s[1] - s[0])
    skipped = 0
    for line in text.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(@!?U?P\d\s+)?BRA (?:`\(\.L_x_\d+\) )?0x([0-9a-f]+)", line)
        if not m or not m.group(2):
            continue
        at, target = int(m.group(1), 16) // 16, int(m.group(3), 16) // 16
        if start <= at < target <= end:
            skipped = max(skipped, target - at - 1)
    return end - start + 1 - skipped


def instruction_count(text: str) -> int:
    return len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", text, re.MULTILINE))


def ours(vocab: int):
    from gtpo_kernels.backends import triton_token_stats as k

    rows = []
    block, warps, stages = k.launch_config(vocab, k._FORWARD_LAUNCH)
    common = {
        "logits_ptr": "*bf16",
        "ids_ptr": "*i32",
        "valid_ptr": "*i1",
        "max_ptr": "*fp32",
        "log_s_ptr": "*fp32",
        "logp_ptr": "*fp32",
        "entropy_ptr": "*fp32",
    }
    forward = compile_kernel(
        k._token_stats_forward_kernel,
        {
            **common,
            "length": "i32",
            "vocab": "i32",
            "stride_n": "i64",
            "stride_l": "i64",
            "inv_temperature": "fp32",
            "scale": "fp32",
            "inv_temperature_ptr": "*fp32",
            "scale_ptr": "*fp32",
            "BLOCK_V": "constexpr",
            "INTERPRETED": "constexpr",
            "PER_TOKEN_TEMPERATURE": "constexpr",
        },
        {"BLOCK_V": block, "INTERPRETED": False, "PER_TOKEN_TEMPERATURE": False},
        warps,
        stages,
    )
    rows.append(("gtpo forward", forward, block, warps))
    block, warps, stages = k.launch_config(vocab, k._BACKWARD_LAUNCH)
    backward = compile_kernel(
        k._token_stats_backward_kernel,
        {
            "logits_ptr": "*bf16",
            "grad_ptr": "*bf16",
            "ids_ptr": "*i32",
            "valid_ptr": "*i1",
            "max_ptr": "*fp32",
            "log_s_ptr": "*fp32",
            "logp_ptr": "*fp32",
            "entropy_ptr": "*fp32",
            "grad_logp_ptr": "*fp32",
            "grad_entropy_ptr": "*fp32",
            "length": "i32",
            "vocab": "i32",
            "stride_n": "i64",
            "stride_l": "i64",
            "grad_stride_n": "i64",
            "grad_stride_l": "i64",
            "inv_temperature": "fp32",
            "inv_temperature_ptr": "*fp32",
            "BLOCK_V": "constexpr",
            "HAS_GRAD_ENTROPY": "constexpr",
            "INTERPRETED": "constexpr",
            "EMULATE_BF16_ROUNDING": "constexpr",
            "PER_TOKEN_TEMPERATURE": "constexpr",
        },
        {
            "BLOCK_V": block,
            "HAS_GRAD_ENTROPY": False,
            "INTERPRETED": False,
            "EMULATE_BF16_ROUNDING": False,
            "PER_TOKEN_TEMPERATURE": False,
        },
        warps,
        stages,
    )
    rows.append(("gtpo backward", backward, block, warps))
    return rows


def liger(vocab: int):
    """Liger-Kernel's two forward kernels at the launch configuration Liger uses, or [] without it."""
    try:
        from liger_kernel.ops import grpo_loss as lg
    except ImportError:
        return []
    rows = []
    # triton_grpo_loss launches the loss forward with BLOCK_N 4096, 16 warps, 1 stage (liger-kernel 0.8.x);
    # the loss's knobs at TRL's GRPO defaults (no old/ref log-probs, temperature 1, beta 0).
    fwd_sig = {
        "LOGITS": "*bf16",
        "OLD_LOGP": "constexpr",
        "REF_LOGP": "constexpr",
        "INPUT_IDS": "*i64",
        "COMPLETION_MASK": "*i32",
        "ADVANTAGES": "*fp32",
        "VLLM_IS_RATIO": "constexpr",
        "VLLM_IS_RATIO_STRIDE": "i32",
        "PHI_SEQ": "constexpr",
        "LOSS": "*fp32",
        "LSE": "*fp32",
        "KL": "*fp32",
        "IS_CLIPPED": "*fp32",
    }
    fwd_const = {
        "OLD_LOGP": None,
        "REF_LOGP": None,
        "VLLM_IS_RATIO": None,
        "PHI_SEQ": None,
        "TEMPERATURE": 1.0,
        "BETA": 0.0,
        "EPS_LOW": 0.2,
        "EPS_HIGH": 0.2,
        "LOSS_TYPE": 0,
        "SAPO_TEMP_POS": 1.0,
        "SAPO_TEMP_NEG": 1.05,
        "DELTA": 0.0,
        "USE_BIAS_CORRECTION_KL": False,
        "L": 1024,
        "N": vocab,
        "BLOCK_N": 4096,
    }
    names = lg._grpo_loss_fwd_kernel.arg_names
    fwd_sig.update({n: "constexpr" for n in fwd_const if n not in fwd_sig})
    fwd_sig = {n: fwd_sig[n] for n in names if n in fwd_sig}
    fwd_const = {k: v for k, v in fwd_const.items() if k in names}
    rows.append(
        ("liger _grpo_loss_fwd_kernel", compile_kernel(lg._grpo_loss_fwd_kernel, fwd_sig, fwd_const, 16, 1), 4096, 16)
    )
    sel_sig = {
        "LOGITS": "*bf16",
        "INPUT_IDS": "*i64",
        "LOG_P": "*fp32",
        "MASK": "*i32",
        "TEMPERATURE": "constexpr",
        "stride_input_ids_b": "i32",
        "stride_input_ids_l": "i32",
        "stride_mask_b": "i32",
        "stride_mask_l": "i32",
        "L": "constexpr",
        "N": "constexpr",
        "BLOCK_N": "constexpr",
    }
    sel_const = {"TEMPERATURE": 1.0, "L": 1024, "N": vocab, "BLOCK_N": 2048}
    rows.append(
        (
            "liger _selective_log_softmax_kernel",
            compile_kernel(lg._selective_log_softmax_kernel, sel_sig, sel_const, 1, 4),
            2048,
            1,
        )
    )
    return rows


def table(vocab: int) -> str:
    lines = [
        "| kernel | BLOCK | warps | SASS total | loop | loop, common path | elements/thread/iteration | "
        "per element (common path) | BAR.SYNC |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, kernel, block, warps in ours(vocab) + liger(vocab):
        text = sass(kernel)
        per_thread = block // (warps * 32)
        body, common = loop_length(text), common_path_length(text)
        lines.append(
            f"| {name} | {block} | {warps} | {instruction_count(text)} | {body} | {common} | {per_thread} | "
            f"{common / per_thread:.1f} | {text.count('BAR.SYNC')} |"
        )
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench isa", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary size whose launch configuration is compiled")
    args = p.parse_args(argv)
    import triton

    print(f"sm_90 SASS, bf16 logits, V = {args.vocab}, triton {triton.__version__}")
    print(table(args.vocab))


if __name__ == "__main__":
    main()
