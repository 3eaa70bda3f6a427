"""Registration survives every process vLLM starts."""

import multiprocessing
import pickle


def _unpickle_in_fresh_process(payload: bytes, queue) -> None:
    # A spawned process that has not loaded any plugin yet, like vLLM's
    # engine core or a Ray worker receiving the config.
    member = pickle.loads(payload)
    queue.put((member.name, member.get_path()))


def test_backend_member_unpickles_before_plugins_load():
    import vllm_kvq

    vllm_kvq.register()
    vllm_kvq.register()  # idempotent
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    payload = pickle.dumps({"backend": AttentionBackendEnum.OSCAR})
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_unpickle_in_fresh_process, args=(pickle.dumps(AttentionBackendEnum.OSCAR), queue))
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0
    assert queue.get(timeout=5) == ("OSCAR", "vllm_kvq.backends.oscar.OscarBackend")
    assert pickle.loads(payload)["backend"] is AttentionBackendEnum.OSCAR


def test_entry_point_is_declared():
    from importlib.metadata import entry_points

    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert eps.get("kvq") == "vllm_kvq:register"


def test_another_vllm_version_is_refused_at_start(monkeypatch):
    import pytest
    import vllm

    from vllm_kvq import hooks

    hooks.check_version()  # the installed one is supported
    monkeypatch.setattr(vllm, "__version__", "0.33.1")
    with pytest.raises(RuntimeError, match="vllm-kvq supports vLLM 0.32 \\(found 0.33.1\\); install vllm==0.32"):
        hooks.check_version()
