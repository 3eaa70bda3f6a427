"""vLLM-facing classes: the OSCAR attention backend and its KV-cache spec."""
