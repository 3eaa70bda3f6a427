"""Run a hook right after vLLM imports a module (importing vLLM's model
modules up front would cost every process seconds)."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys


class _PostImport(importlib.abc.MetaPathFinder):
    """Finds ``name`` through the other finders, once, and has its loader run
    ``hook(module)`` right after executing it."""

    def __init__(self, name: str, hook):
        self.name, self.hook = name, hook

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            exec_module = spec.loader.exec_module

            def exec_then_hook(module):
                exec_module(module)
                self.hook(module)

            spec.loader.exec_module = exec_then_hook
        return spec


def after_import(name: str, hook) -> None:
    """Call ``hook(module)`` once ``name`` is imported (now, if it already is)."""
    if name in sys.modules:
        hook(sys.modules[name])
    else:
        sys.meta_path.insert(0, _PostImport(name, hook))
