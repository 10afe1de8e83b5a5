"""Build script. Metadata lives in pyproject.toml; this file builds the C++ CPU kernels (csrc/) with
torch.utils.cpp_extension against the torch already installed, which is why the README installs with
--no-build-isolation (an isolated build would download a second torch to compile against).

The kernels are compiled once per instruction set (gtpo_kernels/backends/cpu_build.py) and the package
loads the best variant the running machine supports. A variant that fails to compile does not stop the
install (a plain or an editable one): it is left out of the install, the compiler's message is printed
and kept in gtpo_kernels/backends/_cpu_build_error.txt, and the variants that compiled install. When the
machine's variant is missing the package JIT-compiles it on first use (saying so), or falls back to the
PyTorch backend with one warning. GTPO_NO_EXTENSION=1 skips the build.
"""

import importlib.util
import os
import subprocess
import sys

from setuptools import setup

_HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location(
    "cpu_build", os.path.join(_HERE, "gtpo_kernels", "backends", "cpu_build.py")
)
cpu_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cpu_build)

ext_modules, cmdclass = [], {}
if os.environ.get("GTPO_NO_EXTENSION", "0") == "0":
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print(
            "gtpo_kernels: WARNING: torch is not importable at build time, so the C++ CPU kernels were not "
            "built; they will be JIT-compiled on first use. Install torch first and use "
            "--no-build-isolation.",
            file=sys.stderr,
        )
    else:
        ext_modules = [
            CppExtension(
                f"gtpo_kernels.backends.{cpu_build.module_name(v)}",
                ["csrc/gtpo_cpu.cpp"],
                extra_compile_args=cpu_build.compile_args(v),
            )
            for v in cpu_build.variants_for_this_platform()
        ]

        class OptionalBuildExtension(BuildExtension):
            """Builds every variant; a failing one is reported (with the compiler's message), not fatal, and left
            out of the install's files."""

            failed = ()

            def _error_files(self):
                """Next to the built extensions, and in the source package (editable installs read it there)."""
                targets = {
                    os.path.dirname(self.get_ext_fullpath(ext_modules[0].name)),
                    os.path.join(_HERE, "gtpo_kernels", "backends"),
                }
                for target in targets:
                    os.makedirs(target, exist_ok=True)
                return [os.path.join(target, "_cpu_build_error.txt") for target in sorted(targets)]

            def run(self):
                for path in self._error_files():
                    if os.path.exists(path):
                        os.remove(path)
                super().run()

            def build_extensions(self):
                self.failed = []
                super().build_extensions()
                # What the install copies and records (wheel, editable or not) is read from self.extensions
                # after this: a failed variant listed there is a file that does not exist, which fails it.
                self.extensions = [ext for ext in self.extensions if ext.name not in self.failed]
                if not self.extensions:
                    print(
                        "gtpo_kernels: WARNING: no variant of the C++ CPU kernels compiled; the package installs "
                        "without them and tries a JIT build on first use, else uses backend='torch'",
                        file=sys.stderr,
                    )

            def build_extension(self, ext):
                try:
                    super().build_extension(ext)
                except Exception as exc:  # noqa: BLE001 (any compiler failure: install without this variant)
                    self.failed.append(ext.name)
                    detail, cause = str(exc), exc
                    while cause is not None and not getattr(cause, "cmd", None):
                        cause = cause.__cause__ or cause.__context__
                    if cause is not None:  # the failed compiler call: run it again to keep its message
                        proc = subprocess.run(cause.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                        errors = [line for line in proc.stdout.splitlines() if "error" in line.lower()]
                        detail = "\n".join(errors[:20]) or proc.stdout[-4000:] or detail
                    message = f"gtpo_kernels: WARNING: building the C++ CPU kernels ({ext.name}) failed:\n{detail}"
                    print(message, file=sys.stderr)
                    for path in self._error_files():
                        with open(path, "a") as f:
                            f.write(message + "\n")

        # Without ninja a failed compile raises with the command, which build_extension runs again to keep the
        # compiler's message (ninja prints it and raises without it).
        cmdclass = {"build_ext": OptionalBuildExtension.with_options(use_ninja=False)}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
