"""Build script. Metadata lives in pyproject.toml; this file builds the C++ CPU kernels (csrc/) with
torch.utils.cpp_extension against the torch already installed, which is why the README installs with
--no-build-isolation (an isolated build would download a second torch to compile against).

If torch is not importable at build time, or the compiler fails, the package installs without the
extension; gtpo_kernels then JIT-compiles it on first use (cached), and if that fails too it falls
back to the PyTorch backend with one warning.
"""

import os
import sys

from setuptools import setup

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gtpo_kernels"))
from _build_flags import extension_compile_args  # noqa: E402  (shared with the JIT build)

ext_modules, cmdclass = [], {}
if os.environ.get("GTPO_NO_EXTENSION", "0") == "0":
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print("gtpo_kernels: torch is not importable at build time; the CPU kernels will be JIT-compiled "
              "on first use", file=sys.stderr)
    else:
        ext_modules = [CppExtension(
            "gtpo_kernels._C", ["csrc/gtpo_cpu.cpp"],
            extra_compile_args=extension_compile_args(),
        )]

        class OptionalBuildExtension(BuildExtension):
            def run(self):
                try:
                    super().run()
                except Exception as exc:  # noqa: BLE001 (any compiler failure: install without it)
                    print(f"gtpo_kernels: building the CPU kernels failed ({exc}); they will be "
                          f"JIT-compiled on first use", file=sys.stderr)

        cmdclass = {"build_ext": OptionalBuildExtension}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
