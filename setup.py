"""Build script. Metadata lives in pyproject.toml; this file builds the C++ CPU kernels (csrc/) with
torch.utils.cpp_extension against the torch already installed, which is why the README installs with
--no-build-isolation (an isolated build would download a second torch to compile against).

The kernels are compiled once per instruction set (gtpo_kernels/backends/cpu_build.py) and the package
loads the best variant the running machine supports. A variant that fails to compile does not stop the
install: the compiler's message is printed and kept in gtpo_kernels/backends/_cpu_build_error.txt, and
the package then JIT-compiles the kernels on first use (saying so), or falls back to the PyTorch
backend with one warning. GTPO_NO_EXTENSION=1 skips the build.
"""

import importlib.util
import os
import subprocess
import sys

from setuptools import setup

_HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("cpu_build", os.path.join(_HERE, "gtpo_kernels", "backends", "cpu_build.py"))
cpu_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cpu_build)

ext_modules, cmdclass = [], {}
if os.environ.get("GTPO_NO_EXTENSION", "0") == "0":
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print("gtpo_kernels: WARNING: torch is not importable at build time, so the C++ CPU kernels were not "
              "built; they will be JIT-compiled on first use. Install torch first and use "
              "--no-build-isolation.", file=sys.stderr)
    else:
        ext_modules = [
            CppExtension(f"gtpo_kernels.backends.{cpu_build.module_name(v)}", ["csrc/gtpo_cpu.cpp"],
                         extra_compile_args=cpu_build.compile_args(v))
            for v in cpu_build.variants_for_this_platform()
        ]

        class OptionalBuildExtension(BuildExtension):
            """Builds every variant; a failing one is reported, not fatal."""

            def _error_file(self):
                target = self.get_ext_fullpath(ext_modules[0].name)
                return os.path.join(os.path.dirname(target), "_cpu_build_error.txt")

            def run(self):
                error_file = self._error_file()
                if os.path.exists(error_file):
                    os.remove(error_file)
                super().run()

            def build_extension(self, ext):
                captured = []
                spawn = self.compiler.spawn

                def spawn_capturing(cmd, **kwargs):
                    # Run the compiler ourselves so that its message survives pip's quiet mode.
                    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                    if proc.stdout:
                        captured.append(proc.stdout)
                        print(proc.stdout, file=sys.stderr)
                    if proc.returncode:
                        raise RuntimeError(f"command failed with exit code {proc.returncode}: {' '.join(cmd)}")

                self.compiler.spawn = spawn_capturing
                try:
                    super().build_extension(ext)
                except Exception as exc:  # noqa: BLE001 (any compiler failure: install without this variant)
                    message = (f"gtpo_kernels: WARNING: building the C++ CPU kernels ({ext.name}) failed: {exc}\n"
                               + "".join(captured)[-4000:])
                    print(message, file=sys.stderr)
                    with open(self._error_file(), "a") as f:
                        f.write(message + "\n")
                finally:
                    self.compiler.spawn = spawn

        cmdclass = {"build_ext": OptionalBuildExtension}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
