"""vllm-kvq: OSCAR INT2 KV cache (and more) for vLLM, as a plugin."""

__version__ = "0.1.0"


def register() -> None:
    """vLLM ``general_plugins`` entry point: register the OSCAR backend."""
    from vllm_kvq.plugin import register as _register

    _register()
