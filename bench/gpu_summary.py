"""The GPU check's verdict in a few lines: whether the CUDA tests were green, and which steps failed.

    python -m bench.gpu_summary OUT_DIR [--dry-run] [FAILED_STEP ...]   (called by bench/gpu_check.sh; writes
    OUT_DIR/summary.md; --dry-run: the tests ran under Triton's CPU interpreter, and the summary says so)

Green means: the tests step did not fail, its JUnit file exists, at least one test ran, and none failed or
errored. Anything else is said plainly, with the counts it has.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import List


def tests_verdict(junit: Path, tests_step_failed: bool, what: str = "CUDA tests") -> str:
    if not junit.exists():
        return f"{what}: NOT GREEN: no JUnit file (the tests step was cut short by its timeout or never ran)"
    root = ElementTree.parse(junit).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    ran = counts["tests"] - counts["skipped"]
    numbers = (
        f"{ran - counts['failures'] - counts['errors']} passed, {counts['failures']} failed, "
        f"{counts['errors']} errors, {counts['skipped']} skipped"
    )
    if tests_step_failed or counts["failures"] or counts["errors"] or ran <= 0:
        failed = [
            f"{case.get('classname')}::{case.get('name')}"
            for case in suite.iter("testcase")
            if case.find("failure") is not None or case.find("error") is not None
        ]
        listing = "".join(f"\n  - {name}" for name in failed[:30]) + ("\n  - ..." if len(failed) > 30 else "")
        return f"{what}: NOT GREEN: {numbers}{listing}"
    return f"{what}: GREEN: {numbers}"


def main(argv: List[str]) -> int:
    out, rest = Path(argv[0]), argv[1:]
    dry = "--dry-run" in rest
    failed_steps = [step for step in rest if step != "--dry-run"]
    what = "Dry-run tests (Triton's CPU interpreter: not CUDA)" if dry else "CUDA tests"
    lines = [
        "# GPU check summary" + (" (dry run on the CPU)" if dry else ""),
        "",
        tests_verdict(out / "tests.xml", any(step.startswith("tests ") for step in failed_steps), what),
        "",
        "Failed steps: " + (", ".join(failed_steps) if failed_steps else "none"),
    ]
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
