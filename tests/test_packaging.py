"""What the installed distribution puts in site-packages: ``gtpo_kernels`` and the trainer as ``gtpo_train``,
never a top-level ``trainer`` (PyPI's ``trainer``, Coqui's, owns that name), and the version in one place."""

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import gtpo_kernels

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_has_no_top_level_trainer_package(tmp_path):
    env = {**os.environ, "GTPO_NO_EXTENSION": "1"}  # the package's files only: no C++ build
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        env=env,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("gtpo_kernels-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names if not name.split("/")[0].endswith((".dist-info", ".data"))}
    assert top_level == {"gtpo_kernels", "gtpo_train"}, top_level
    # Every module of the source tree ships (pyproject lists the packages by hand: a new sub-package left off
    # the list would import from a checkout and be missing from an install).
    sources = [
        f"gtpo_kernels/{p.relative_to(ROOT / 'gtpo_kernels').as_posix()}" for p in (ROOT / "gtpo_kernels").rglob("*.py")
    ]
    sources += [f"gtpo_train/{p.relative_to(ROOT / 'trainer').as_posix()}" for p in (ROOT / "trainer").rglob("*.py")]
    missing = sorted(set(sources) - set(names))
    assert not missing, f"modules missing from the wheel (add their package to pyproject's packages): {missing}"
    assert "gtpo_kernels/py.typed" in names
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert re.search(r"^gtpo-train = gtpo_train\.train:main$", entry_points, re.M), entry_points
    assert wheel.name.startswith(f"gtpo_kernels-{gtpo_kernels.__version__}-")


def test_the_installed_trainer_imports_as_gtpo_train_outside_a_checkout(tmp_path):
    """From any folder (no checkout on sys.path), the install provides ``gtpo_train`` and no ``trainer``."""
    code = (
        "import importlib.util as u, sys; "
        "assert u.find_spec('trainer') is None, u.find_spec('trainer'); "
        "import gtpo_train.config as c; print(c.TrainConfig().steps)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().isdigit()


def test_the_version_is_written_once():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^dynamic = \["version"\]$', pyproject, re.M)
    assert re.search(r'^version = \{ attr = "gtpo_kernels._version.__version__" \}$', pyproject, re.M)
    assert not re.search(r'^version\s*=\s*"', pyproject, re.M)
    written = [p for p in (ROOT / "gtpo_kernels").rglob("*.py") if re.search(r"__version__\s*=", p.read_text())]
    assert [p.name for p in written] == ["_version.py"]
