"""The first optimiser step of ``gtpo-train``'s default run, from a given checkout: its loss and gradient norm.

    python -m tools.first_step [--source PATH] [--out FILE] [--precision P]   # PATH: a checkout (default: this one)

Runs ``gtpo-train --steps 1`` (the built-in default otherwise, a one-problem evaluation) with the ``gtpo_kernels`` and
trainer of ``PATH``, and prints ``{"loss": ..., "grad_norm": ...}`` of step 1 as JSON: two checkouts side by side
show whether a change of the core changed the run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m tools.first_step", description=__doc__.splitlines()[0])
    p.add_argument("--source", default=str(Path(__file__).resolve().parents[1]))
    p.add_argument("--out")
    p.add_argument("--precision", help="the run's --precision (default: the default's, auto)")
    args = p.parse_args(argv)
    root = Path(args.source).resolve()
    sys.path.insert(0, str(root))
    spec = importlib.util.spec_from_file_location(
        "gtpo_train", root / "trainer" / "__init__.py", submodule_search_locations=[str(root / "trainer")]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["gtpo_train"] = module
    spec.loader.exec_module(module)
    import gtpo_kernels
    from gtpo_train.train import main as train

    assert str(gtpo_kernels.__file__).startswith(str(root)), gtpo_kernels.__file__
    with tempfile.TemporaryDirectory() as out:
        precision = ["--precision", args.precision] if args.precision else []
        train(["--steps", "1", "--eval-size", "1", "--output-dir", out, *precision])
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if r.get("step") == 1 and "grad_norm" in r)
    result = {"source": str(root), "loss": step["loss"], "grad_norm": step["grad_norm"]}
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
