"""The install when the C++ kernels do not compile: a real ``pip install -e`` of a scratch copy of the project
whose ``cpu_build`` adds a flag the compiler rejects to some variants. The install succeeds, the failing variants
are left out with the compiler's message kept, the others install, and with none the package falls back to the
torch backend with one warning.

The scratch install goes into a venv of its own that sees this environment's packages (torch, setuptools, pip)
through a ``.pth`` line, so the project's own install is not touched.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from gtpo_kernels.backends import cpu_build

ROOT = Path(__file__).resolve().parents[1]
REJECTED_FLAG = "-fgtpo-flag-no-compiler-knows"

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler")


def _scratch_install(tmp_path: Path, failing: list):
    """A copy of the project whose ``failing`` variants get ``REJECTED_FLAG``, installed editable into a fresh venv;
    returns ``(the copy, the venv's python, pip's exit code and output)``."""
    copy = tmp_path / "project"
    copy.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, copy / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "_cpu_build_error.txt")
    for name in ("csrc", "gtpo_kernels", "trainer"):
        shutil.copytree(ROOT / name, copy / name, ignore=ignore)
    build_file = copy / "gtpo_kernels" / "backends" / "cpu_build.py"
    build_file.write_text(
        build_file.read_text() + "".join(f"\n_FLAGS[{v!r}].append({REJECTED_FLAG!r})" for v in failing) + "\n"
    )

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(site, "outer_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {**os.environ, "GTPO_KERNELS_CACHE": str(tmp_path / "jit-cache"), "PIP_NO_INPUT": "1"}
    env.pop("GTPO_NO_EXTENSION", None)
    pip = subprocess.run(
        [str(python), "-m", "pip", "install", "-v", "--no-build-isolation", "--no-deps", "--no-index", "-e", str(copy)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    return copy, python, pip.returncode, pip.stdout + pip.stderr, env


def _built(copy: Path) -> set:
    return {p.name.split(".")[0] for p in (copy / "gtpo_kernels" / "backends").glob("_cpu_*.so")}


# Runs in the scratch venv: the loss with backend="auto" on CPU tensors, against backend="torch", and every warning.
_AUTO_AGAINST_TORCH = """
import warnings, torch, gtpo_kernels
from gtpo_kernels import gtpo_loss
assert gtpo_kernels.__file__.startswith({copy!r}), gtpo_kernels.__file__
torch.manual_seed(0)
logits = 8 * torch.randn(4, 5, 33)  # confident, so that the loss has a signal
ids, mask = torch.randint(0, 33, (4, 5)), torch.ones(4, 5, dtype=torch.bool)
adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    auto = [gtpo_loss(logits, ids, mask, adv, group_size=2, backend="auto").loss for _ in range(2)]
plain = gtpo_loss(logits, ids, mask, adv, group_size=2, backend="torch").loss
assert all(torch.equal(a, plain) for a in auto), (auto, plain)
print("WARNINGS", len(caught))
for w in caught:
    print("WARNING", w.category.__name__, str(w.message).replace(chr(10), " ")[:400])
"""


def test_with_no_variant_compiling_the_editable_install_succeeds_and_auto_falls_back_with_one_warning(tmp_path):
    variants = cpu_build.variants_for_this_platform()
    copy, python, code, output, env = _scratch_install(tmp_path, variants)
    assert code == 0, output[-3000:]
    for variant in variants:
        assert f"building the C++ CPU kernels (gtpo_kernels.backends._cpu_{variant}) failed" in output, output[-3000:]
    assert "no variant of the C++ CPU kernels compiled" in output
    assert _built(copy) == set()
    kept = (copy / "gtpo_kernels" / "backends" / "_cpu_build_error.txt").read_text()
    assert REJECTED_FLAG in kept, kept[-2000:]  # the compiler's own message, which names the flag

    env = {**env, "GTPO_CPU_CAPABILITY": "default"}  # the same variant wanted on any machine
    run = subprocess.run(
        [str(python), "-c", _AUTO_AGAINST_TORCH.format(copy=str(copy))],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    warned = [line for line in run.stdout.splitlines() if line.startswith("WARNING ")]
    assert run.stdout.count("WARNINGS 1") == 1 and len(warned) == 1, run.stdout
    assert "backend='auto' uses the slower 'torch' backend for cpu tensors because 'cpu' is unavailable" in warned[0]
    assert "install-time build failed" in warned[0], warned[0]


@pytest.mark.skipif(len(cpu_build.variants_for_this_platform()) < 2, reason="one variant on this platform")
def test_a_variant_that_does_not_compile_is_left_out_and_the_others_install(tmp_path):
    failing = [v for v in cpu_build.variants_for_this_platform() if v != "default"]
    copy, python, code, output, env = _scratch_install(tmp_path, failing)
    assert code == 0, output[-3000:]
    assert _built(copy) == {"_cpu_default"}, output[-3000:]
    for variant in failing:
        assert f"building the C++ CPU kernels (gtpo_kernels.backends._cpu_{variant}) failed" in output
    assert "no variant of the C++ CPU kernels compiled" not in output

    code = (
        "import torch; from gtpo_kernels.backends.cpu_extension import load_cpu_extension; "
        f"import gtpo_kernels; assert gtpo_kernels.__file__.startswith({str(copy)!r}); "
        "print('LOADED', load_cpu_extension())"
    )
    env = {**env, "GTPO_CPU_CAPABILITY": "default"}
    run = subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert run.returncode == 0 and "LOADED default" in run.stdout, run.stdout + run.stderr[-3000:]
    assert "compiling the C++ CPU kernels" not in run.stderr  # the installed variant, not a JIT build


@pytest.mark.parametrize("variant", cpu_build.VARIANTS)
def test_the_compile_flags_leave_the_standard_to_torch(variant):
    """torch's cpp_extension adds the C++ standard its headers need (C++17 up to 2.11, C++20 from 2.13; 2.15's headers
    refuse anything older) to the install-time and the JIT build alike, unless the flags name one."""
    flags = cpu_build.compile_args(variant)
    assert not [f for f in flags if f.startswith(("-std=", "/std:"))], flags
