"""Entry point: ``python -m bench [logits|fused_linear|cpu_kernels|accuracy|kernels|isa] [options]``
(``--help`` for each one's options)."""

import sys

BENCHMARKS = {"logits": "bench.logits", "fused_linear": "bench.fused_linear", "cpu_kernels": "bench.cpu_kernels",
              "accuracy": "bench.accuracy", "kernels": "bench.kernels", "isa": "bench.isa"}


def main() -> None:
    argv = sys.argv[1:]
    name = argv.pop(0) if argv and argv[0] in BENCHMARKS else "logits"
    module = __import__(BENCHMARKS[name], fromlist=["main"])
    module.main(argv)


if __name__ == "__main__":
    main()
