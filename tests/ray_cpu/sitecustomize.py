"""Test-only: lets vLLM's Ray executor schedule workers on the CPU platform.

vLLM 0.32's CPU platform names no Ray device key (``CpuPlatform.ray_device_key``
is ``""``), and the Ray executor refuses a platform without one ("current
platform cpu does not support ray"). That key is the only thing in the way:
it names the Ray resource each worker claims and the accelerator ids it reads
back. Here the CPU platform claims Ray's ``GPU`` resource, and the test's
local Ray cluster declares one logical ``GPU`` slot per rank; no GPU is used,
the workers run vLLM's CPU worker as they would under the multiprocessing
executor.

The engine core and the Ray workers are fresh interpreters, so this file
reaches them as ``sitecustomize`` on their PYTHONPATH; it patches the class
when ``vllm.platforms.cpu`` is first imported (importing vLLM up front would
cost every Ray helper process seconds).
"""

import importlib.abc
import importlib.util
import sys

RAY_DEVICE_KEY = "GPU"
TARGET = "vllm.platforms.cpu"


def patch(module) -> None:
    module.CpuPlatform.ray_device_key = RAY_DEVICE_KEY


class PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds ``vllm.platforms.cpu`` through the other finders and patches it once loaded."""

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def enable() -> None:
    """Patch now if vLLM's CPU platform is loaded, else when it loads."""
    if TARGET in sys.modules:
        patch(sys.modules[TARGET])
    elif not any(isinstance(f, PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, PatchOnImport())


enable()
