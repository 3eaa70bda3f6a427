"""TP=2 under vLLM's two executors on CPU: the multiprocessing executor, and
the Ray executor on a local Ray cluster (``distributed_executor_backend="ray"``).

OSCAR with the STEPQuant state pool on house-qwen3next (bf16, the GDN CPU
kernel's dtype, where TP's all-reduce rounds differently; most of each
sequence read as INT2): the mp executor's tokens equal TP=1's up to TP=1's
first near tie, the Ray executor's equal the mp executor's; every rank holds
its own KV head's rotations (R_V folded, un-rotated after the output gate)
and packs its own two value heads at the plan's widths (records padded to the
larger rank).

vLLM 0.32's CPU platform names no Ray device key, which is all that stops its
Ray executor; ``tests/ray_cpu/sitecustomize.py`` names one in the engine core
and the Ray workers (see there). Everything else is vLLM's own: the default
Ray executor (``RayExecutorV2``) places one ``RayWorkerProc`` actor per rank
in a placement group, ships the pickled config to them, and drives the engine
loop through its message queues; the ranks talk over gloo.
"""

import contextlib
import os

import pytest

from evalkit.probe import allocated_state_bytes
from tests.backends.test_state_pool import STEPQUANT_WITH_OSCAR, compare
from tests.conftest import REPO, make_llm, needles, shutdown
from vllm_kvq.artifacts import OscarArtifact
from vllm_kvq.artifacts.stepquant import StepQuantPlan

pytestmark = pytest.mark.slow
SHIM = REPO / "tests" / "ray_cpu"


@contextlib.contextmanager
def served_processes():
    """Engine cores and workers in their own processes, as served; one
    intra-op thread a process (Ray's default for its actors)."""
    env = pytest.MonkeyPatch()
    env.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    env.setenv("OMP_NUM_THREADS", "1")
    try:
        yield
    finally:
        env.undo()


@contextlib.contextmanager
def ray_cluster():
    """A local Ray cluster with one logical GPU slot per rank (the Ray resource
    the shim makes the CPU platform claim), reachable from the engine core
    through RAY_ADDRESS. Engine cores are spawned, not forked: a fork would
    inherit this process's Ray connection."""
    import ray

    env = pytest.MonkeyPatch()
    paths = [str(SHIM), str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.setenv("PYTHONPATH", os.pathsep.join(paths))  # before ray.init: Ray's workers inherit it
    env.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    context = ray.init(num_cpus=1, num_gpus=2, include_dashboard=False, log_to_driver=False,
                       object_store_memory=100 << 20)
    env.setenv("RAY_ADDRESS", context.address_info["gcs_address"])
    try:
        yield
    finally:
        ray.shutdown()
        env.undo()


def run_tp2(config: dict, executor: str, prompts, params, inspect):
    """(per-rank ``inspect`` results, outputs) of one TP=2 engine."""
    llm = make_llm(**config, tensor_parallel_size=2, distributed_executor_backend=executor)
    try:
        return llm.apply_model(inspect), llm.generate(prompts, params, use_tqdm=False)
    finally:
        shutdown(llm)


def tokens(outputs) -> list:
    return [o.outputs[0].token_ids for o in outputs]


def in_ray_actor() -> bool:
    import ray

    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def rank_layers(model) -> dict:
    """Runs in each worker: whether it is a Ray actor, what each OSCAR layer of
    its rank holds, and its GDN layers' packed states."""
    from vllm.distributed import get_tensor_model_parallel_rank

    from vllm_kvq.backends.oscar import OscarImpl

    oscar = [{"layer": int(name.split("layers.")[1].split(".")[0]), "k_rotation": m.impl.k_rotation.clone(),
              "v_absorbed": m.impl.v_absorbed, "unrotate_output": m.impl.unrotate_output,
              "num_kv_heads": m.impl.num_kv_heads}
             for name, m in model.named_modules() if isinstance(getattr(m, "impl", None), OscarImpl)]
    return {"ray_actor": in_ray_actor(), "rank": get_tensor_model_parallel_rank(), "oscar": oscar,
            "states": allocated_state_bytes(model)}


def test_oscar_and_state_pool_under_both_executors(engines, greedy):
    pytest.importorskip("ray")
    kvq = STEPQUANT_WITH_OSCAR["oscar"]
    prompts = [r["prompt"] for r in needles(max_tokens=1500, limit=6)]
    one = engines(**STEPQUANT_WITH_OSCAR).generate(prompts, greedy(24, logprobs=2), use_tqdm=False)
    with served_processes():
        mp_ranks, mp = run_tp2(STEPQUANT_WITH_OSCAR, "mp", prompts, greedy(24, logprobs=2), rank_layers)
        with ray_cluster():  # after the mp engine, whose processes are forked (vLLM's default)
            ray_ranks, ray = run_tp2(STEPQUANT_WITH_OSCAR, "ray", prompts, greedy(24, logprobs=2), rank_layers)
    assert compare(mp, one, "TP=2 vs TP=1")[0] >= 24
    assert tokens(ray) == tokens(mp)
    art, plan = OscarArtifact.load(kvq["artifact"]), StepQuantPlan.load(kvq["state_artifact"])
    for ranks, in_ray in ((mp_ranks, False), (ray_ranks, True)):
        assert [(r["ray_actor"], r["rank"]) for r in ranks] == [(in_ray, 0), (in_ray, 1)]
        for rank, info in enumerate(ranks):
            # each rank holds its own KV head's rotations; R_V folded into v_proj, un-rotated
            # after the output gate (which an o_proj fold could not pass)
            assert [row["layer"] for row in info["oscar"]] == list(art.layers)
            for row in info["oscar"]:
                assert row["num_kv_heads"] == 1 and row["v_absorbed"] and row["unrotate_output"]
                assert row["k_rotation"].equal(art.rotation_for("k", row["layer"], [rank]))
            assert [layer["layer"] for layer in info["states"]] == list(plan.layers)
            for layer in info["states"]:
                assert layer["dtype"] == "torch.uint8"
                assert tuple(layer["bits"]) == plan.head_bits(6, layer["layer"])[2 * rank: 2 * rank + 2]
        assert not ranks[0]["oscar"][0]["k_rotation"].equal(ranks[1]["oscar"][0]["k_rotation"])
        assert len({layer["shape"][0] for info in ranks for layer in info["states"]}) == 1  # one record size
