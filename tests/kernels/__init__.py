"""Helpers of the kernel tests."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def compiled_without_gpu(script: str):
    """The JSON that ``script`` prints last, run in a process of its own with
    Triton's interpreter off: it compiles kernels for the GPU (sm_90a) with
    Triton's bundled ptxas, no GPU needed, which a kernel test module running
    the interpreter cannot do in its own process. Skips where that ptxas is
    missing."""
    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("Triton's bundled ptxas is missing")
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])
