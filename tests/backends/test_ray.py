"""vLLM's Ray executor on CPU, end to end: ``distributed_executor_backend="ray"``
at TP=2 on a local Ray cluster gives the multiprocessing executor's greedy
tokens, with OSCAR (house-qwen3) and with the STEPQuant GDN state pool
(house-qwen3next).

vLLM 0.32's CPU platform names no Ray device key, which is all that stops its
Ray executor; ``tests/ray_cpu/sitecustomize.py`` names one in the engine core
and the Ray workers (see there). Everything else is vLLM's own: the default
Ray executor (``RayExecutorV2``) places one ``RayWorkerProc`` actor per rank
in a placement group, ships the pickled config to them, and drives the engine
loop through its message queues; the ranks talk over gloo.
"""

import os

import pytest

from tests.conftest import REPO, make_llm, needles, shutdown
from vllm_kvq.artifacts import OscarArtifact
from vllm_kvq.artifacts.stepquant import StepQuantPlan
from evalkit.probe import allocated_state_bytes

pytestmark = pytest.mark.slow
SHIM = REPO / "tests" / "ray_cpu"
OSCAR_ARTIFACT = REPO / "examples" / "artifacts" / "house-qwen3-oscar"
STATE_PLAN = REPO / "examples" / "artifacts" / "house-qwen3next-stepquant"
SINK, WINDOW = 16, 32  # prompts of ~500 tokens: most of each sequence is read as INT2


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster with one logical GPU slot per rank (the Ray resource
    the shim makes the CPU platform claim), reachable from the engine core
    through RAY_ADDRESS. Engine cores are spawned, not forked: a fork would
    inherit this process's Ray connection."""
    ray = pytest.importorskip("ray")
    env = pytest.MonkeyPatch()
    paths = [str(SHIM), str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.setenv("PYTHONPATH", os.pathsep.join(paths))  # before ray.init: Ray's workers inherit it
    env.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    env.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.setenv("OMP_NUM_THREADS", "1")  # Ray's default for its actors; the mp workers take the same
    env.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model ships a function
    context = ray.init(num_cpus=1, num_gpus=2, include_dashboard=False, log_to_driver=False,
                       object_store_memory=100 << 20)
    env.setenv("RAY_ADDRESS", context.address_info["gcs_address"])
    try:
        yield ray
    finally:
        ray.shutdown()
        env.undo()


def generate(greedy, prompts, executor, inspect, model="house-qwen3", **kwargs):
    """(per-rank ``inspect`` results, greedy token ids) of one TP=2 engine."""
    llm = make_llm(model, tensor_parallel_size=2, distributed_executor_backend=executor, max_model_len=1024,
                   max_num_seqs=4, kv_cache_memory_bytes=64 << 20, **kwargs)
    try:
        ranks = llm.apply_model(inspect)
        outs = llm.generate(prompts, greedy(24), use_tqdm=False)
        return ranks, [o.outputs[0].token_ids for o in outs]
    finally:
        shutdown(llm)


def in_ray_actor() -> bool:
    import ray

    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def oscar_layers(model) -> dict:
    """Runs in each worker: whether it is a Ray actor, and what each OSCAR layer of its rank holds."""
    from vllm.distributed import get_tensor_model_parallel_rank

    from vllm_kvq.backends.oscar import OscarImpl

    rows = [{"layer": int(name.split("layers.")[1].split(".")[0]), "k_rotation": m.impl.k_rotation.clone(),
             "v_absorbed": m.impl.v_absorbed, "num_kv_heads": m.impl.num_kv_heads}
            for name, m in model.named_modules() if isinstance(getattr(m, "impl", None), OscarImpl)]
    return {"ray_actor": in_ray_actor(), "rank": get_tensor_model_parallel_rank(), "layers": rows}


def state_layers(model) -> dict:
    """Runs in each worker: whether it is a Ray actor, and its GDN layers' packed states."""
    from vllm.distributed import get_tensor_model_parallel_rank

    return {"ray_actor": in_ray_actor(), "rank": get_tensor_model_parallel_rank(),
            "layers": allocated_state_bytes(model)}


@pytest.fixture(scope="module")
def prompts():
    return [r["prompt"] for r in needles(max_tokens=520, limit=4)]


def test_oscar_under_the_ray_executor(ray_cluster, greedy, prompts):
    """Each Ray rank loads the plugin, folds R_V and holds its own KV head's
    rotations from the per-KV-head artifact; tokens equal the mp executor's."""
    kvq = {"artifact": str(OSCAR_ARTIFACT), "sink": SINK, "window": WINDOW, "override_artifact": True}
    kw = dict(oscar=kvq, dtype="float32")
    ranks, got = generate(greedy, prompts, "ray", oscar_layers, **kw)
    mp_ranks, ref = generate(greedy, prompts, "mp", oscar_layers, **kw)
    assert got == ref
    assert [r["ray_actor"] for r in ranks] == [True, True]
    assert [r["ray_actor"] for r in mp_ranks] == [False, False]
    art = OscarArtifact.load(OSCAR_ARTIFACT)
    assert [r["rank"] for r in ranks] == [0, 1]
    for rank, info in enumerate(ranks):
        assert len(info["layers"]) == len(art.layers)
        for row in info["layers"]:
            assert row["num_kv_heads"] == 1 and row["v_absorbed"]
            assert row["k_rotation"].equal(art.rotation_for("k", row["layer"], [rank]))
    assert not ranks[0]["layers"][0]["k_rotation"].equal(ranks[1]["layers"][0]["k_rotation"])


def test_state_pool_under_the_ray_executor(ray_cluster, greedy, prompts):
    """STEPQuant on house-qwen3next's GDN layers: each Ray rank packs its own
    two value heads at the plan's widths; tokens equal the mp executor's."""
    kvq = {"state": "stepquant", "state_artifact": str(STATE_PLAN)}
    kw = dict(model="house-qwen3next", dtype="bfloat16", mamba_ssm_cache_dtype="float32",
              additional_config={"kvq": kvq})
    ranks, got = generate(greedy, prompts, "ray", state_layers, **kw)
    _, ref = generate(greedy, prompts, "mp", state_layers, **kw)
    assert got == ref
    assert [(r["ray_actor"], r["rank"]) for r in ranks] == [(True, 0), (True, 1)]
    plan = StepQuantPlan.load(STATE_PLAN)
    for rank, info in enumerate(ranks):
        assert [layer["layer"] for layer in info["layers"]] == list(plan.layers)
        for layer in info["layers"]:
            assert layer["dtype"] == "torch.uint8"
            assert tuple(layer["bits"]) == plan.head_bits(6, layer["layer"])[2 * rank: 2 * rank + 2]
