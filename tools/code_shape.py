"""The shape of the code at two revisions: lines per package and the longest functions, side by side.

    python -m tools.code_shape BEFORE [AFTER]      # AFTER: the working tree (default) or a revision

Prints a markdown table (``wc -l`` of ``gtpo_kernels/`` and ``trainer/``, their files, and the ten longest functions
of each revision, as tests/test_structure.py measures them: ``def`` line to last line). Files are read with
``git show REV:PATH``, so nothing is checked out.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
from pathlib import Path
from typing import Dict, Optional

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gtpo_kernels", "trainer")


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def sources(rev: Optional[str]) -> Dict[str, str]:
    """``{path: text}`` of every ``.py`` file of the packages at ``rev`` (``None``: the working tree)."""
    if rev is None:
        return {
            p.relative_to(ROOT).as_posix(): p.read_text() for d in PACKAGES for p in sorted((ROOT / d).rglob("*.py"))
        }
    paths = [p for p in _git("ls-tree", "-r", "--name-only", rev, *PACKAGES).splitlines() if p.endswith(".py")]
    return {p: _git("show", f"{rev}:{p}") for p in paths}


def function_lengths(files: Dict[str, str]) -> Dict[str, int]:
    lengths = {}
    for path, text in files.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                key = f"{path}:{node.name}"
                lengths[key] = max(lengths.get(key, 0), node.end_lineno - node.lineno + 1)
    return lengths


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.code_shape", description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after", nargs="?", help="a revision (default: the working tree)")
    args = parser.parse_args(argv)
    sides = {args.before: sources(args.before), args.after or "working tree": sources(args.after)}
    names = list(sides)
    print(f"| | {names[0]} | {names[1]} |\n|---|---|---|")
    for package in PACKAGES:
        counts = []
        for files in sides.values():
            mine = [text for path, text in files.items() if path.startswith(package + "/")]
            counts.append(f"{sum(t.count(chr(10)) for t in mine)} lines, {len(mine)} files")
        print(f"| `{package}/` | {counts[0]} | {counts[1]} |")
    longest = [sorted(function_lengths(files).items(), key=lambda kv: -kv[1])[:10] for files in sides.values()]
    print(f"\nThe ten longest functions (lines)\n\n| {names[0]} | | {names[1]} | |\n|---|---|---|---|")
    for (a, na), (b, nb) in zip(*longest):
        print(f"| `{a}` | {na} | `{b}` | {nb} |")


if __name__ == "__main__":
    main()
