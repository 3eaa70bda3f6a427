"""The plugin entry point vLLM finds."""


def test_entry_point_is_declared():
    from importlib.metadata import entry_points

    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert eps.get("kvq") == "vllm_kvq:register"
