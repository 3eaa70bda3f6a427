"""The ``vllm.general_plugins`` entry point.

vLLM calls :func:`register` in every process it starts (API server or
``LLM``, engine core, workers), so it is cheap and idempotent. It checks the
vLLM version and installs the seams of :mod:`vllm_kvq.hooks`.
"""

from __future__ import annotations

_done = False


def register() -> None:
    global _done
    if _done:
        return
    _done = True
    from vllm_kvq import hooks
    from vllm_kvq.hooks import gdn, registry, weights

    hooks.check_version()
    registry.install()
    weights.install()
    gdn.install()
