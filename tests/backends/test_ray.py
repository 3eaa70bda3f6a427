"""Ray: vLLM 0.32's CPU platform refuses ``--distributed-executor-backend ray``,
so the worker side of a Ray deployment is run here as vLLM's Ray executor
runs it, with vLLM's own ``RayWorkerWrapper`` as Ray actors on a local Ray
cluster: the OSCAR config travels pickled to fresh actor processes, the
plugin loads there, both TP ranks build the model (gloo group across the
actors), fold R_V, and hold only their own KV head's rotations.

Not run here: the Ray executor's engine loop (scheduling and execute_model
through Ray's compiled graphs), which the CPU platform does not allow.
"""

import pytest

from tests.conftest import REPO, make_llm, model_path

pytestmark = pytest.mark.slow
ARTIFACT = REPO / "examples" / "artifacts" / "house-qwen3-oscar"


def test_cpu_platform_refuses_the_ray_executor(capfd):
    """Pins the limitation the module works around (fails once vLLM lifts it).
    The engine core's own error names the cause; the driver sees a start-up failure."""
    with pytest.raises(Exception):
        make_llm(oscar={"rotation": "hadamard"}, tensor_parallel_size=2, distributed_executor_backend="ray")
    captured = capfd.readouterr()
    assert "current platform cpu does not support ray" in captured.out + captured.err


def oscar_layers(wrapper) -> list[dict]:
    """Runs inside a worker actor: what each OSCAR layer of this rank holds."""
    from vllm.distributed import get_tensor_model_parallel_rank

    from vllm_kvq.backends.oscar import OscarImpl

    model = wrapper.worker.model_runner.model
    rows = []
    for name, module in model.named_modules():
        impl = getattr(module, "impl", None)
        if isinstance(impl, OscarImpl):
            rows.append({"layer": name, "rank": get_tensor_model_parallel_rank(),
                         "k_rotation": impl.k_rotation.clone(), "v_absorbed": impl.v_absorbed,
                         "num_kv_heads": impl.num_kv_heads})
    return rows


def test_tp2_workers_in_ray_actors_load_oscar(monkeypatch):
    ray = pytest.importorskip("ray")
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.network_utils import get_distributed_init_method, get_open_port
    from vllm.v1.executor.ray_utils import RayWorkerWrapper

    from vllm_kvq.artifacts import OscarArtifact

    args = EngineArgs(model=model_path(), dtype="float32", max_model_len=1024, enforce_eager=True,
                      tensor_parallel_size=2, distributed_executor_backend="mp", kv_cache_memory_bytes=64 << 20,
                      attention_backend="OSCAR", additional_config={"kvq": {"artifact": str(ARTIFACT)}})
    config = args.create_engine_config()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_NO_USAGE_STATS": "1"}})
    try:
        workers = [ray.remote(num_cpus=1)(RayWorkerWrapper).remote(rpc_rank=r) for r in range(2)]
        init = get_distributed_init_method("127.0.0.1", get_open_port())
        kwargs = [dict(vllm_config=config, local_rank=r, rank=r, distributed_init_method=init,
                       is_driver_worker=r == 0) for r in range(2)]
        ray.get([w.execute_method.remote("init_worker", kwargs) for w in workers])
        ray.get([w.execute_method.remote("init_device") for w in workers])
        ray.get([w.execute_method.remote("load_model") for w in workers])
        specs = ray.get([w.execute_method.remote("get_kv_cache_spec") for w in workers])
        per_rank = ray.get([w.execute_method.remote(oscar_layers) for w in workers])
    finally:
        ray.shutdown()
    art = OscarArtifact.load(ARTIFACT)
    for rank, layers in enumerate(per_rank):
        assert len(layers) == len(art.layers)
        for row in layers:
            assert row["rank"] == rank and row["num_kv_heads"] == 1 and row["v_absorbed"]
            layer = int(row["layer"].split("layers.")[1].split(".")[0])
            assert row["k_rotation"].shape == (1, 128, 128)
            assert row["k_rotation"].equal(art.rotation_for("k", layer, [rank]))
    assert not per_rank[0][0]["k_rotation"].equal(per_rank[1][0]["k_rotation"])  # really per KV head
    for spec in specs:
        assert {type(s).__name__ for s in spec.values()} == {"OscarAttentionSpec"}
        assert {s.state_blocks for s in spec.values()} == {18}
