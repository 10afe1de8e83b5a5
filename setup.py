"""Build script. Metadata lives in pyproject.toml; this file exists for the C++ extensions (csrc/)
that are built with torch.utils.cpp_extension against the torch already installed, which is why the
README installs with --no-build-isolation."""

from setuptools import setup

setup()
