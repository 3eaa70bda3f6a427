"""Run a hook right after vLLM imports a module (importing vLLM's model
modules up front would cost every process seconds)."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys


class _PostImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs ``hook(module)`` right after ``name`` is first executed."""

    def __init__(self, name: str, hook):
        self.name, self.hook, self.spec = name, hook, None

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name or self.spec is not None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        self.spec = spec
        self.inner = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        self.hook(module)


def after_import(name: str, hook) -> None:
    """Call ``hook(module)`` once ``name`` is imported (now, if it already is)."""
    if name in sys.modules:
        hook(sys.modules[name])
    else:
        sys.meta_path.insert(0, _PostImport(name, hook))
