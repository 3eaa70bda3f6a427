"""The seams are written for one vLLM version; another is refused at start."""

import pytest


def test_another_vllm_version_is_refused_at_start(monkeypatch):
    import vllm

    from vllm_kvq import hooks

    hooks.check_version()  # the installed one is supported
    monkeypatch.setattr(vllm, "__version__", "0.33.1")
    with pytest.raises(RuntimeError, match="vllm-kvq supports vLLM 0.32 \\(found 0.33.1\\); install vllm==0.32"):
        hooks.check_version()
