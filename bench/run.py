"""Entry point: ``python -m bench [NAME] [options]``, NAME one of logits (the default), fused_linear, cpu_kernels,
accuracy, kernels, isa, layouts, fused_work, trainer, sampler, tracking, trainer_memory, update_profile
(``python -m bench --help`` lists them; ``python -m bench NAME --help`` gives one's options)."""

import sys

BENCHMARKS = {
    "logits": "bench.logits",
    "fused_linear": "bench.fused_linear",
    "cpu_kernels": "bench.cpu_kernels",
    "accuracy": "bench.accuracy",
    "kernels": "bench.kernels",
    "isa": "bench.isa",
    "layouts": "bench.layouts",
    "fused_work": "bench.fused_work",
    "trainer": "bench.trainer",
    "sampler": "bench.sampler",
    "tracking": "bench.tracking",
    "trainer_memory": "bench.trainer_memory",
    "update_profile": "bench.update_profile",
}
SUMMARIES = {
    "logits": "the loss on materialised logits: eager and compiled PyTorch, our backends, Liger (the default)",
    "fused_linear": "the fused hidden @ lm_head loss against materialised logits, against the FLOP floor",
    "cpu_kernels": "the C++ kernels at their target shapes, against eager and compiled PyTorch",
    "accuracy": "per-token statistics and the logits' gradient against float64, every backend",
    "kernels": "the Triton kernels alone against the copy bandwidth, and a BLOCK_V x warps x stages sweep (GPU)",
    "isa": "static sm_90 SASS instruction counts of our kernels and Liger's, no GPU needed",
    "layouts": "packed (cu_seqlens) and vocab-parallel (vocab_group) calls against the padded whole-vocabulary one",
    "fused_work": "the fused loss under no_grad and in its backward, against an earlier commit (--before REV)",
    "trainer": "one step of gtpo-train against one of TRL's GRPOTrainer on the same work (TRL: the [trl] extra)",
    "sampler": "the sampler's decoding step against the bare matrix products of its shapes (and torch.compile)",
    "tracking": "what --report-to (TensorBoard, W&B offline, trackio) costs per logged row, against a run's step",
    "trainer_memory": "peak memory of one gtpo-train step: float32, bf16 weights, LoRA, --beta (default, 0.5B-class)",
    "update_profile": "one update's time with our grouped attention and with transformers' pass, and its profile",
}


def usage() -> str:
    lines = [
        "usage: python -m bench [NAME] [options]   (python -m bench NAME --help for NAME's options)",
        "",
        "benchmarks:",
    ]
    lines += [f"  {name:<13} {SUMMARIES[name]}" for name in BENCHMARKS]
    lines += ["", "Results go to bench/results/local/ (ignored by git), never over the committed bench/results/."]
    return "\n".join(lines)


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] in (["-h"], ["--help"]):
        print(usage())
        return
    name = argv.pop(0) if argv and argv[0] in BENCHMARKS else "logits"
    module = __import__(BENCHMARKS[name], fromlist=["main"])
    module.main(argv)


if __name__ == "__main__":
    main()
