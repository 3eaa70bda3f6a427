"""``vllm-kvq report``: its numbers against what real vLLM engines report and
allocate, against the worked page sizes of docs/design.md, and its output."""

import json

import pytest

from tests.conftest import REPO, make_llm, model_path, shutdown
from vllm_kvq import report

ARTIFACTS = REPO / "examples" / "artifacts"
QWEN3 = ("house-qwen3", [ARTIFACTS / "house-qwen3-oscar", ARTIFACTS / "house-qwen3-tiered"])
QWEN3NEXT = ("house-qwen3next", [ARTIFACTS / "house-qwen3next-oscar", ARTIFACTS / "house-qwen3next-stepquant"])
PLAN = str(ARTIFACTS / "house-qwen3next-stepquant")
KV_RESULTS = REPO / "benchmarks" / "results" / "accuracy-house-qwen3.json"
STATE_RESULTS = REPO / "benchmarks" / "results" / "stepquant-accuracy.json"


def layouts(model, artifacts) -> dict:
    inputs = report.load_inputs(model_path(model), [str(a) for a in artifacts])
    return {lay.label: lay for lay in inputs.layouts}


@pytest.fixture(scope="module")
def qwen3():
    return layouts(*QWEN3)


@pytest.fixture(scope="module")
def qwen3next():
    return layouts(*QWEN3NEXT)


TIERED = "tiered (k=48x4,80x2;v=16x4,48x2,64x0)"


def test_page_numbers_are_the_worked_sizes(qwen3):
    """docs/design.md: 72 B and R = 18 (OSCAR), 80 B and R = 16 (tiered) at
    128-token blocks; 2.290 bits per element at 128K with the state blocks."""
    bf16, oscar, tiered = qwen3["BF16"], qwen3["OSCAR INT2"], qwen3[TIERED]
    assert (bf16.page.bytes_per_token, bf16.page.state_blocks, bf16.block_size) == (512, 0, 128)
    assert (oscar.page.bytes_per_token, oscar.page.state_blocks, oscar.page.block_bytes) == (72, 18, 9216)
    assert (tiered.page.bytes_per_token, tiered.page.state_blocks) == (80, 16)
    assert round(oscar.page.bits_per_element(131072), 3) == 2.290
    assert bf16.page.bits_per_element(4096) == 16.0
    # 320 BF16 rows in 18 blocks of 72 B x 128 tokens, on top of 4K INT2 tokens
    assert oscar.page.bits_per_element(4096) == pytest.approx(8 * (4096 * 72 + 18 * 128 * 72) / (256 * 4096))


def test_state_pages_equal_the_benchmarks_engines():
    """benchmarks/results/stepquant-accuracy.json records the GDN pages real
    engines allocated (bytes per request, all GDN layers) for three of the
    report's configurations."""
    measured = json.loads(STATE_RESULTS.read_text())["results"]
    lays = layouts("house-qwen3next", [PLAN])
    for row, label in [("FP32 state (vLLM)", "BF16 + FP32 states"), ("STEPQuant @6", "BF16 + STEPQuant @6"),
                       ("STEPQuant @6 + OSCAR INT2 attention", "OSCAR INT2 + STEPQuant @6")]:
        assert lays[label].state_bytes_per_request == measured[row]["state_bytes_per_request"], row


# ---------------------------------------------------------------------------
# Against real engines: one small engine per configuration
# ---------------------------------------------------------------------------

ENGINES = {
    # label: (model, artifacts, engine kwargs, max_model_len, KV budget)
    "BF16": (QWEN3, dict(attention_backend="CPU_ATTN"), 10000, 256 << 20),
    "OSCAR INT2": (QWEN3, dict(oscar={"artifact": str(ARTIFACTS / "house-qwen3-oscar")}), 3000, 256 << 20),
    "OSCAR INT2 + STEPQuant @6": (QWEN3NEXT, dict(oscar={
        "artifact": str(ARTIFACTS / "house-qwen3next-oscar"), "state": "stepquant", "state_artifact": PLAN,
        "state_bits": 6}), 5000, 128 << 20),
}


def engine_figures(label: str) -> dict:
    from evalkit.probe import allocated_state_bytes

    (model, _), kwargs, max_len, budget = ENGINES[label]
    llm = make_llm(model, dtype="bfloat16", mamba_ssm_cache_dtype="float32", max_model_len=max_len,
                   kv_cache_memory_bytes=budget, **kwargs)
    try:
        cfg = llm.llm_engine.vllm_config.cache_config
        pages = [layer["page_bytes"] for layer in llm.apply_model(allocated_state_bytes)[0]]
        return {"tokens": cfg.kv_cache_size_tokens, "concurrency": cfg.kv_cache_max_concurrency,
                "blocks": cfg.num_gpu_blocks, "block_size": cfg.effective_attention_block_size or cfg.block_size,
                "state_pages": pages}
    finally:
        shutdown(llm)


@pytest.mark.slow
@pytest.mark.parametrize("label", list(ENGINES))
def test_capacity_and_state_pages_equal_the_engines(label, qwen3, qwen3next):
    """vLLM's "KV cache size" (tokens at max_model_len), its maximum
    concurrency, its block count and block size, and the GDN state page each
    layer was given, against the report's figures for the same settings."""
    (model, _), _, max_len, budget = ENGINES[label]
    lay = (qwen3 if model == "house-qwen3" else qwen3next)[label]
    got = engine_figures(label)
    assert got["tokens"] == lay.tokens(budget, max_len)
    assert got["concurrency"] == lay.concurrency(budget, max_len)
    assert got["blocks"] == lay.num_blocks(budget)
    assert got["block_size"] == lay.block_size
    assert got["state_pages"] == [lay.page_bytes] * lay.model.gdn_layers


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------


def test_accuracy_rows_are_the_artifacts_rows():
    """Only the reference and the rows served with the given artifacts, with
    the JSON's numbers."""
    inputs = report.load_inputs(model_path("house-qwen3"), [str(ARTIFACTS / "house-qwen3-tiered")])
    rows = report.accuracy_rows(inputs, KV_RESULTS)
    results = json.loads(KV_RESULTS.read_text())["results"]
    assert [name for name, _ in rows] == ["bf16", "OSCAR tiers: K 48x4 + 80x2, V 16x4 + 48x2 + 64 not stored"]
    assert [r for _, r in rows] == [results[name] for name, _ in rows]
    assert report.accuracy_rows(inputs, STATE_RESULTS) is None  # no GDN layers, no plan
    inputs = report.load_inputs(model_path("house-qwen3next"), [PLAN])
    rows = report.accuracy_rows(inputs, STATE_RESULTS)
    assert [name for name, _ in rows] == ["FP32 state (vLLM)", "STEPQuant @6", "STEPQuant @4",
                                          "STEPQuant @6 + OSCAR INT2 attention"]


@pytest.mark.parametrize("model, artifact, row", [
    ("house-qwen3", "house-qwen3-oscar", "OSCAR, per-KV-head rotation"),
    ("house-qwen3", "house-qwen3-oscar-layer", "OSCAR, shared per-layer rotation"),
    ("house-qwen3", "house-qwen3-oscar-fitted", "OSCAR, per-KV-head rotation, fitted clip"),
    ("house-qwen2", "house-qwen2-oscar-exact", "OSCAR, per-KV-head rotation, exact value target"),
    ("house-qwen3", "house-qwen3-tiered-2.25bit", "OSCAR tiers: K 32x4 + 96x2, V 16x4 + 32x2 + 80 not stored"),
])
def test_each_artifact_takes_the_row_measured_with_it(model, artifact, row):
    """benchmarks/accuracy.py names each row after how its artifact was made."""
    inputs = report.load_inputs(model_path(model), [str(ARTIFACTS / artifact)])
    rows = report.accuracy_rows(inputs, KV_RESULTS.with_name(f"accuracy-{model}.json"))
    assert [name for name, _ in rows] == ["bf16", row]


def test_cli_writes_the_page_and_plots(tmp_path, qwen3next):
    from vllm_kvq.cli import main

    main(["report", model_path("house-qwen3next"), "--artifact", PLAN, "--out", str(tmp_path),
          "--kv-budget", "128MiB", "1GiB", "--accuracy", str(STATE_RESULTS)])
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["house-qwen3next-bits.png", "house-qwen3next-capacity-128MiB.png",
                     "house-qwen3next-capacity-1GiB.png", "house-qwen3next-state.png", "house-qwen3next.md"]
    for png in tmp_path.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    page = (tmp_path / "house-qwen3next.md").read_text()
    lay = qwen3next["OSCAR INT2 + STEPQuant @6"]
    assert f"{lay.tokens(1 << 30, 131072):,} / {lay.concurrency(1 << 30, 131072):.2f}" in page
    assert f"| OSCAR INT2 + STEPQuant @6 | {lay.state_raw_bytes:,} | {lay.page_bytes:,} | " in page
    assert "| STEPQuant @6 | 393,216 |" in page  # the benchmark's measured row
    for image in names[:-1]:
        assert f"]({image})" in page


@pytest.mark.parametrize("argv, message", [
    (["--kv-budget", "lots"], "give bytes, or a number with KiB"),
    (["--artifact", PLAN], "STEPQuant state plan, and house-qwen3 has no GDN layers"),
    (["--artifact", str(ARTIFACTS / "house-qwen3next-oscar")], "calibrate"),
    (["--artifact", "/nowhere"], "/nowhere"),
    (["--accuracy", "/nowhere.json"], "/nowhere.json: no such file"),
    (["--accuracy", str(KV_RESULTS.with_name("accuracy-house-qwen2.json"))], "measured on house-qwen2, not house-qwen3"),
    (["--accuracy", str(REPO / "benchmarks" / "results" / "calibration-time.json")], "has no reference row"),
])
def test_bad_input_fails_with_the_fix(argv, message, tmp_path, capsys):
    from vllm_kvq.cli import main

    with pytest.raises(SystemExit):
        main(["report", model_path("house-qwen3"), "--out", str(tmp_path), *argv])
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_missing_matplotlib_names_the_extra(monkeypatch, tmp_path):
    import sys

    from vllm_kvq.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    with pytest.raises(SystemExit, match=r"pip install 'vllm-kvq\[report\]'"):
        main(["report", model_path("house-qwen3"), "--out", str(tmp_path)])
