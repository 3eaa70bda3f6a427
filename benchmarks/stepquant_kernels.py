"""STEPQuant fused decode step on a GPU, against the dense FP32 update timed in
the same run.

Per GDN layer at batch 512 (one decode token per request): house-qwen3next
(4 value heads, 2 key heads) and a Qwen3.5-27B-like layer (48 value heads, 16
key heads), K = V = 128, each with an @6 and an @4 width plan. The packed step
is swept over its launch shapes (exact / fast division; row block and warps of
the rows kernel, column tile and warps of the fit kernel) and the best is
compared with the best FP32 tiling. Bytes
moved = state read + written, plus q, k, v, g, beta and out.

    python -m benchmarks.stepquant_kernels [--quick] [--json PATH]

Writes ``benchmarks/results/stepquant_kernels.json`` (or ``--json``) and, with
``--docs``, replaces the "STEPQuant state update" section of ``docs/kernels.md``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

from evalkit.markdown import splice, table
from vllm_kvq.kernels.stepquant import reference as ref
from vllm_kvq.kernels.stepquant import triton_step as ts
from vllm_kvq.kernels.stepquant.format import PIVOT, StateLayout, fp32_state_bytes
from vllm_kvq.kernels.stepquant.triton_fp32 import fp32_step_

REPO = Path(__file__).resolve().parents[1]
DEV = "cuda"
BATCH = 512
KD = VD = 128
# name: (value heads, key heads, {plan: widths}); widths follow the calibrated
# budget rule (a pivot counts as 8 bits against the nominal budget).
SHAPES = {
    "house-qwen3next": (4, 2, {"@6": (4, 6, 6, 8), "@4": (2, 4, 4, 6)}),
    "qwen3.5-27b-like": (48, 16, {"@6": (6,) * 40 + (4,) * 4 + (8,) * 3 + (PIVOT,),
                                  "@4": (4,) * 38 + (2,) * 6 + (6,) * 2 + (8,) + (PIVOT,)}),
}
VARIANTS = [  # (fast, launch), most wanted first (later ones skipped past --budget-s)
    (True, {"rows_block": 8, "rows_warps": 2, "tile": 32, "fit_warps": 4}),
    (True, {"rows_block": 16, "rows_warps": 4, "tile": 32, "fit_warps": 4}),
    (True, {"rows_block": 4, "rows_warps": 1, "tile": 32, "fit_warps": 4}),
    (False, {"rows_block": 8, "rows_warps": 2, "tile": 32, "fit_warps": 4}),
]
FP32_TILES = [(32, 4), (64, 4), (64, 8), (128, 8)]  # (BV, num_warps)
SECTION = "## STEPQuant state update"
DESIGN = (
    "Kernels (`vllm_kvq/kernels/stepquant/triton_step.py`), two per width present in the layer (the width a"
    " constexpr). The rows kernel, one program per (request, value head), streams the record in blocks of key"
    " rows, each block's loads issued one block ahead: pass 1 sums `z (exp(g) r k)` and `z (exp(g) r q)` per"
    " column into per-thread partials (one FMA an element each, the column scale applied once at the end), giving"
    " `delta = beta (v - S^T k)` and the readout `S^T q + (k.q) delta` of the unquantized X; pass 2 rebuilds X"
    " and writes the new row factors (saving the old ones to a scratch row). The fit kernel, one program per"
    " (request, value head, 32 value columns) with all 128 key rows (the FP32 update's own tiling), rebuilds its"
    " columns as `y = X / r` with one FMA an element, takes the absmax column scales, the w^2-weighted refit and"
    " the final codes, and packs them in place. Tiles are `[4, ., .]` so the codes of a byte (a 6-bit word) stay"
    " in one thread; no float/int conversions (levels through the mantissa of 1.5 * 2^23), hardware reciprocals"
    " for the per-row/column scales in the fast fit, scratch from torch's allocator, no host work (the launches"
    " replay from a CUDA graph). vLLM's CUDA decode batches run this step on the pool in place"
    " (`backends/state_pool.py`)."
)
NOTES: list[str] = [  # findings of the measured run
    "**Short of the 3x target; 2.3-6.0x faster than the single-program step it replaces**, replayed from CUDA"
    " graphs (1.1-5.9x with Python launches, which dominate the 4-head layer). That step held a whole 128 x 128"
    " head in one program (255 registers with spills on Triton 3.6, one program per SM) and measured 0.487 ms /"
    " 0.16x for house-qwen3next @6 and 6.68 ms / 0.12x, 3.34 ms / 0.24x for the 48-head layer. The 48-head"
    " layer is now at 0.71x / 0.62x of FP32 at @6 / @4 with the default launch (best launch 0.72x / 0.66x).",
    "Where the time goes (48 heads @6, torch profiler, best launch): rows kernel 0.44 ms (its pass 1, the"
    " readout alone: 0.27 ms, 2.9x faster than the FP32 update), fit kernel 0.68 ms. The fit is bound by"
    " instructions: ~36 SASS instructions an element (Triton 3.6, sm_90: absmax, two level searches, the refit"
    " sums and packing, plus per-row/column scale math), against ~15 for the whole FP32 update, which is bound"
    " by memory (4 TB/s). At 403 M state elements a step, the fit alone needs ~0.43 ms at a full issue rate,"
    " so with this fit the step cannot reach 3x (0.27 ms) by kernel tuning; it can come off the critical"
    " path (the readout alone is 2.9x faster than FP32) if it runs beside later layers, which vLLM's step does not do.",
    "house-qwen3next (4 heads) is too small to fill the GPU at batch 512: its six launches (two per width) take"
    " 0.14-0.17 ms replayed from a CUDA graph against 0.077 ms for FP32's one launch.",
    "Correctness on the H200 (compiled): the step against the reference at the serving shapes (house @6/@4, both"
    " 48-head plans, every width and the pivot): out within 2e-7 of its scale, about 1e-5 of record bytes"
    " different (rounding boundaries). A pivot value in fp16's subnormal range can round one ulp (2^-24) apart,"
    " which the test's bound now allows (it was written as 2^-10 of the value).",
]


def copy_bandwidth() -> float:
    """Bytes/s (read + write) of a large device copy."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=5, rep=50)
    del src, dst
    return 2 * (2 << 30) / (ms * 1e-3)


def make_inputs(h: int, hk: int, gen: torch.Generator):
    q = torch.nn.functional.normalize(torch.randn(BATCH, hk, KD, device=DEV, generator=gen), dim=-1) * KD**-0.5
    k = torch.nn.functional.normalize(torch.randn(BATCH, hk, KD, device=DEV, generator=gen), dim=-1)
    v = torch.randn(BATCH, h, VD, device=DEV, generator=gen)
    g = -torch.rand(BATCH, h, device=DEV, generator=gen) * 0.05
    beta = torch.rand(BATCH, h, device=DEV, generator=gen)
    return q, k, v, g, beta


def io_bytes(h: int, hk: int) -> int:
    return BATCH * (2 * hk * KD + h * VD + 2 * h + h * VD) * 4


def kernel_split(fn, reps: int = 20) -> dict:
    """Device ms per call of each Triton kernel that ``fn`` launches (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    split = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if e.key.startswith("_"):
            split[e.key] = split.get(e.key, 0.0) + us / 1e3 / reps
    return split


def bench_packed(bits: tuple, h: int, hk: int, gen, ms_fp32: float, deadline: float) -> dict:
    lay = StateLayout(bits, KD, VD)
    w = torch.exp(torch.randn(h, KD, device=DEV, generator=gen) * 0.4)
    w = w / w.log().mean(-1, keepdim=True).exp()
    pool = torch.zeros(BATCH + 1, lay.size, dtype=torch.uint8, device=DEV)
    for a in range(0, BATCH, 64):  # valid records of realistic states, in chunks
        m = min(64, BATCH - a)
        rows = torch.rand(1, h, KD, 1, device=DEV, generator=gen) + 0.1
        pool[1 + a : 1 + a + m] = ref.encode(torch.randn(m, h, KD, VD, device=DEV, generator=gen) * rows, lay, w)
    idx = (torch.randperm(BATCH, device=DEV, generator=gen) + 1).to(torch.int32)
    q, k, v, g, beta = make_inputs(h, hk, gen)
    plan = ts.StepPlan(lay, w, DEV)
    out = torch.empty(BATCH, h, VD, device=DEV)
    moved = 2 * BATCH * lay.packed_bytes + io_bytes(h, hk)

    # correctness at this shape against the reference (a few requests)
    sel = idx[:8].long()
    o_want, r_want = ref.step(pool[sel], lay, w, q[:8].repeat_interleave(h // hk, 1),
                              k[:8].repeat_interleave(h // hk, 1), v[:8], g[:8], beta[:8])
    o_got, r_got = ts.step(pool[sel], lay, w, q[:8], k[:8], v[:8], g[:8], beta[:8], plan=plan)
    check = {"out_max_rel_err": float((o_got - o_want).abs().max() / o_want.abs().max()),
             "record_bytes_differing": float((r_got != r_want).float().mean())}

    rows = []
    for i, (fast, launch) in enumerate(VARIANTS):
        head = {"fast": fast, "launch": launch}
        if rows and time.monotonic() > deadline and (fast or i < len(VARIANTS) - 1):
            rows.append({**head, "error": "skipped (time budget)"})
            continue
        fn = lambda: ts.step_(pool, idx, plan, q, k, v, g, beta, out, fast=fast, launch=launch)  # noqa: E731
        try:
            ms = do_bench(fn, warmup=10, rep=60)
        except Exception as e:  # noqa: BLE001 - an out-of-resources launch is a result too
            rows.append({**head, "error": repr(e)[:200]})
            print(rows[-1], flush=True)
            continue
        regs = {f"{name}{b}": [getattr(kern, "n_regs", None), getattr(kern, "n_spills", None)]
                for name, b, kern in ts.LAST_KERNELS}
        rows.append({**head, "ms": ms, "gbps": moved / ms / 1e6, "speedup": ms_fp32 / ms, "regs_spills": regs})
        print(json.dumps(rows[-1]), flush=True)
    ok = [r for r in rows if "ms" in r]
    best = min(ok, key=lambda r: r["ms"])
    best_exact = min((r for r in ok if not r["fast"]), key=lambda r: r["ms"], default=best)

    # the critical path's share: the rows kernel's readout alone (records untouched)
    ms_readout = do_bench(lambda: ts.step_(pool, idx, plan, q, k, v, g, beta, out, fast=best["fast"],
                                           launch=best["launch"], readout_only=True),
                          warmup=10, rep=60)
    print(f"readout only {ms_readout:.3f} ms", flush=True)
    split = kernel_split(lambda: ts.step_(pool, idx, plan, q, k, v, g, beta, out, fast=best["fast"],
                                          launch=best["launch"]))
    print(f"per kernel {split}", flush=True)

    # the best launch replayed from a CUDA graph (no host work inside the step)
    fn = lambda: ts.step_(pool, idx, plan, q, k, v, g, beta, out, fast=best["fast"],  # noqa: E731
                          launch=best["launch"])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms_graph = do_bench(graph.replay, warmup=10, rep=60)
    del pool
    torch.cuda.empty_cache()
    return {"bits": list(bits), "packed_bytes": lay.packed_bytes, "bits_per_value": lay.bits_per_value(),
            "bytes_moved": moved, "check": check, "variants": rows, "best": best, "best_exact": best_exact,
            "graph_ms": ms_graph, "graph_speedup": ms_fp32 / ms_graph, "readout_only_ms": ms_readout,
            "kernel_ms": split}


def bench_fp32(h: int, hk: int, gen) -> dict:
    state = torch.randn(BATCH + 1, h, KD, VD, device=DEV, generator=gen) * 0.1
    idx = (torch.randperm(BATCH, device=DEV, generator=gen) + 1).to(torch.int32)
    q, k, v, g, beta = make_inputs(h, hk, gen)
    out = torch.empty(BATCH, h, VD, device=DEV)
    moved = 2 * BATCH * fp32_state_bytes(h, KD, VD) + io_bytes(h, hk)
    rows = []
    for bv, nw in FP32_TILES:
        ms = do_bench(lambda: fp32_step_(state, idx, q, k, v, g, beta, out, block_v=bv, num_warps=nw),
                      warmup=10, rep=60)
        rows.append({"block_v": bv, "num_warps": nw, "ms": ms, "gbps": moved / ms / 1e6})
        print(json.dumps(rows[-1]), flush=True)
    del state
    torch.cuda.empty_cache()
    return {"bytes_moved": moved, "tiles": rows, "best": min(rows, key=lambda r: r["ms"])}


def compile_job(index: int) -> None:
    """Compile (by running once, tiny) one launch shape for every width, so that
    several processes can fill Triton's cache side by side before the timed run."""
    jobs = [("step", i, True) for i in range(len(VARIANTS))] + [("step", i, False) for i in range(3)]
    jobs += [("fp32", i, True) for i in range(len(FP32_TILES))]
    if index >= len(jobs):
        return
    kind, i, fit = jobs[index]
    gen = torch.Generator(device=DEV).manual_seed(index)
    q, k, v, g, beta = (t[:2] for t in make_inputs(16, 16, gen))
    idx = torch.tensor([1, 2], dtype=torch.int32, device=DEV)
    if kind == "fp32":
        bv, nw = FP32_TILES[i]
        state = torch.zeros(3, 16, KD, VD, device=DEV)
        fp32_step_(state, idx, q, k, v, g, beta, block_v=bv, num_warps=nw)
    else:
        fast, launch = VARIANTS[i]
        lay = StateLayout((2, 4, 6, 8, PIVOT) * 3 + (6,), KD, VD)
        plan = ts.StepPlan(lay, torch.ones(16, KD, device=DEV), DEV)
        pool = torch.zeros(3, lay.size, dtype=torch.uint8, device=DEV)
        ts.step_(pool, idx, plan, q, k, v, g, beta, fast=fast, launch=launch, readout_only=not fit)
    torch.cuda.synchronize()


def _split(p: dict) -> str:
    k = p.get("kernel_ms", {})
    return f"{k['_rows_kernel']:.3f} / {k['_fit_kernel']:.3f}" if "_rows_kernel" in k else "-"


def _launch_name(lc: dict) -> str:
    return f"rows {lc['rows_block']}/w{lc['rows_warps']}, fit {lc['tile']}/w{lc['fit_warps']}"


def render(res: dict) -> str:
    bw = res["copy_bandwidth_gbps"]
    lines = [
        SECTION,
        "",
        f"Measured by `python -m benchmarks.stepquant_kernels` on {res['device']} ({res['date']}, Triton"
        f" {res['triton']}). One decode token per request, batch {res['batch']}, one GDN layer, K = V = 128; device copy"
        f" bandwidth (read + write) in the same run: **{bw:.0f} GB/s**.",
        "",
        "FP32: dense in-place update of an FP32 `[slots, H, K, V]` pool (decay, delta rule, readout; Triton,"
        " best of its tilings). Packed: the fused STEPQuant step (unpack, delta rule, readout from the"
        " unquantized X, dual-axis fit, repack in place), best of its launch shapes; 'exact' divides"
        " element-wise like the reference, 'fast' through per-row/column reciprocals. Bytes = state read +"
        " written + q, k, v, gates and out. 'Readout only': the rows kernel's pass 1 alone (the layer's output;"
        " records untouched). 'Rows / fit': each kernel's device time (profiler). 'Packed bytes at copy bw': the"
        " packed step's memory floor.",
        "",
    ]
    rows = []
    for name, r in res["shapes"].items():
        f = r["fp32"]["best"]
        for plan, p in r["plans"].items():
            b, e = p["best"], p["best_exact"]
            launch = f"{'fast' if b['fast'] else 'exact'}, {_launch_name(b['launch'])}"
            rows.append([f"{name} ({r['heads']}/{r['key_heads']} heads)", f"{plan} ({p['bits_per_value']:.2f})",
                         f"{f['ms']:.3f}", f"{f['gbps']:.0f}", f"{b['ms']:.3f} ({launch})", f"{b['gbps']:.0f}",
                         f"**{b['speedup']:.2f}x**", f"{e['ms']:.3f} ({e['speedup']:.2f}x)", f"{p['graph_ms']:.3f}",
                         f"{p['readout_only_ms']:.3f}", _split(p), f"{p['bytes_moved'] / bw / 1e6:.3f}"])
    lines += table(["layer", "plan (bits/value)", "FP32 ms", "FP32 GB/s", "packed ms (launch)", "packed GB/s",
                    "speed-up", "exact ms (speed-up)", "CUDA-graph ms", "readout only ms", "rows / fit ms",
                    "packed bytes at copy bw ms"], rows)
    lines += ["", DESIGN] + (["", *NOTES] if NOTES else [])
    lines += ["", "Launch shapes of the packed step (ms; fast/exact as above; rows: key rows per block / warps of"
              " the rows kernel; fit: value columns per tile / warps of the fit kernel):", ""]
    rows = []
    for name, r in res["shapes"].items():
        for plan, p in r["plans"].items():
            cells = {(v["fast"], _launch_name(v["launch"])): v for v in p["variants"]}
            rows.append([name, plan, *(f"{cells[(f, _launch_name(lc))]['ms']:.3f}"
                                       if "ms" in cells.get((f, _launch_name(lc)), {}) else "-" for f, lc in VARIANTS)])
    lines += table(["layer", "plan", *(f"{'fast' if f else 'exact'} {_launch_name(lc)}" for f, lc in VARIANTS)], rows)
    return "\n".join(lines) + "\n"


def write_docs(text: str) -> None:
    """Replace (or append) this section of docs/kernels.md, leaving the others as they are."""
    path = REPO / "docs" / "kernels.md"
    path.write_text(splice(path.read_text(), SECTION, text))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="house-qwen3next @6 only")
    ap.add_argument("--only", help="one layer shape by name")
    ap.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "stepquant_kernels.json"))
    ap.add_argument("--docs", action="store_true", help="update docs/kernels.md")
    ap.add_argument("--render-only", action="store_true", help="render --json into docs/kernels.md")
    ap.add_argument("--budget-s", type=float, default=150.0, help="stop sweeping launch shapes after this long")
    ap.add_argument("--compile-only", type=int, metavar="JOB", help="fill Triton's cache for one launch shape")
    args = ap.parse_args()
    if args.compile_only is not None:
        compile_job(args.compile_only)
        return
    out = Path(args.json)
    if args.render_only:
        write_docs(render(json.loads(out.read_text())))
        return
    deadline = time.monotonic() + args.budget_s
    gen = torch.Generator(device=DEV).manual_seed(0)
    res = {"device": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
           "triton": triton.__version__, "batch": BATCH, "k_dim": KD, "v_dim": VD}
    res["copy_bandwidth_gbps"] = copy_bandwidth() / 1e9
    print(f"copy bandwidth {res['copy_bandwidth_gbps']:.0f} GB/s", flush=True)
    res["shapes"] = {}
    out.parent.mkdir(parents=True, exist_ok=True)
    for name, (h, hk, plans) in SHAPES.items():
        if (args.quick and name != "house-qwen3next") or (args.only and name != args.only):
            continue
        fp32 = bench_fp32(h, hk, gen)
        entry = {"heads": h, "key_heads": hk, "fp32": fp32, "plans": {}}
        res["shapes"][name] = entry
        for plan, bits in plans.items():
            if args.quick and plan != "@6":
                continue
            entry["plans"][plan] = bench_packed(bits, h, hk, gen, fp32["best"]["ms"], deadline)
            out.write_text(json.dumps(res, indent=2))  # partial results survive a time limit
    out.write_text(json.dumps(res, indent=2))
    text = render(res)
    print(text)
    if args.docs:
        write_docs(text)


if __name__ == "__main__":
    main()
