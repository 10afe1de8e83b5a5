"""Running a function right after a module's first import (verl imports its trainer after its plugins, which
import this package)."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs ``hook(module)`` right after the module ``name`` is first imported (verl imports its trainer after
    its plugins, which import this module)."""

    def __init__(self, name: str, hook) -> None:
        self.name, self.hook, self.spec = name, hook, None

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name or self.spec is not None:
            return None
        sys.meta_path.remove(self)  # find the real module's spec, then stand in for its loader
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return None
        self.spec = spec
        wrapped = importlib.util.spec_from_loader(
            fullname, self, origin=spec.origin, is_package=spec.submodule_search_locations is not None
        )
        wrapped.submodule_search_locations = spec.submodule_search_locations
        wrapped.has_location = spec.has_location
        return wrapped

    def create_module(self, spec):
        return self.spec.loader.create_module(self.spec)

    def exec_module(self, module):
        module.__spec__ = self.spec
        module.__loader__ = self.spec.loader
        self.spec.loader.exec_module(module)
        self.hook(module)


def run_after_import(name: str, hook) -> None:
    """``hook(module)`` now if ``name`` is imported, else right after its first import."""
    if name in sys.modules:
        hook(sys.modules[name])
    elif not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, hook))
