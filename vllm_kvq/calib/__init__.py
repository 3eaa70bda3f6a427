"""Offline statistics that become artifacts (see vllm_kvq.artifacts)."""
