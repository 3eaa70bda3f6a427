"""vllm-kvq: OSCAR INT2 KV cache (and more) for vLLM, as a plugin."""

from vllm_kvq.plugin import register  # noqa: F401  (vLLM's ``general_plugins`` entry point)

__version__ = "0.1.0"
