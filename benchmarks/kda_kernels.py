"""STEPQuant's row-unit KDA codec on a GPU: the split step against vLLM's KDA
decode op (``fused_recurrent_kda_packed_decode``, FP32 ``[slots, H, V, K]``
states), both on vLLM's raw decode inputs, replayed from CUDA graphs.

One KDA layer of Kimi-Linear-48B's shape (32 heads of K = V = 128, no key
sharing) at batch 512, with synthetic row plans at the nominal budgets: @6
rows of 4/6/8 bits in proportions 1:2:1, @4 rows of 2/4/6/8 bits in 6:9:4:1,
and 0.625% FP16 pivot rows (as the paper's plan), widths drawn per row. The
foreground alone (what the layer waits for), the writeback alone, and both in
a row, each over a few launch shapes; the readout and records checked against
the PyTorch reference (``kda.step``) on a few requests.

vLLM 0.32's KimiLinear model is a mixture of experts, and the vLLM bundle on
the GPU machine has no MoE kernels, so the codec is measured at the op level,
not inside vLLM's KimiLinear layer (docs/stepquant.md).

    python -m benchmarks.kda_kernels [--json PATH] [--docs | --render-only] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from evalkit.markdown import splice, table

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "kda_kernels.json"
DOC = REPO / "docs" / "stepquant.md"
BEGIN, END = "<!-- kda:begin -->", "<!-- kda:end -->"
MIX = {"@6": {4: 1, 6: 2, 8: 1}, "@4": {2: 6, 4: 9, 6: 4, 8: 1}}
PIVOT_SHARE = 0.00625
FG_LAUNCHES = [(32, 8), (32, 4), (16, 8), (64, 8)]  # (value columns a tile, warps)
WB_LAUNCHES = [(16, 8), (32, 8), (16, 4)]


def time_ms(fn, dev: str) -> float:
    """Device ms a call, replayed from a CUDA graph (on CPU: wall time of one call)."""
    if dev == "cpu":
        t = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t)
    from triton.testing import do_bench

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return do_bench(g.replay, warmup=10, rep=60)


def vllm_kda_op():
    """vLLM's KDA decode op, from its module file: importing its package would
    load the whole Kimi model (and its MoE layers) first."""
    import importlib.util

    import vllm

    path = Path(vllm.__file__).parent / "models/kimi_k3/nvidia/ops/third_party/kda/fused_recurrent.py"
    spec = importlib.util.spec_from_file_location("vllm_kda_fused_recurrent", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.fused_recurrent_kda_packed_decode


def row_plan(mix: dict, heads: int, k: int, gen: torch.Generator) -> tuple:
    """Widths per head and key row, drawn in the mix's proportions, with the pivot share."""
    widths = torch.tensor([b for b, share in mix.items() for _ in range(share)])
    draw = widths[torch.randint(len(widths), (heads, k), generator=gen)]
    pivots = torch.randperm(heads * k, generator=gen)[: max(1, round(PIVOT_SHARE * heads * k))]
    draw.view(-1)[pivots] = 16
    return tuple(tuple(int(b) for b in row) for row in draw)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=str(RESULTS))
    ap.add_argument("--docs", action="store_true", help="write the table into docs/stepquant.md")
    ap.add_argument("--render-only", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="toy shapes on any device: checks the script")
    args = ap.parse_args()
    path = Path(args.json)
    if args.render_only:
        write_docs(render(json.loads(path.read_text())))
        return
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton

    from vllm_kvq.kernels.stepquant import kda
    from vllm_kvq.kernels.stepquant.triton_kda import KdaPlan, KdaScratch, kda_foreground_, kda_writeback_

    n, h, kd = (4, 2, 32) if args.smoke else (512, 32, 128)
    gen = torch.Generator().manual_seed(0)
    mixed = (torch.randn(n, 3 * h * kd, generator=gen) * 0.7).bfloat16().to(dev)
    raw_g = torch.randn(1, n, h, kd, generator=gen).bfloat16().to(dev)
    raw_beta = torch.randn(1, n, h, generator=gen).bfloat16().to(dev)
    a_log = (torch.empty(h).uniform_(-6.9, -2.3, generator=gen)).to(dev)
    dt_bias = (torch.randn(h * kd, generator=gen) * 0.5).to(dev)
    idx = (torch.randperm(n, generator=gen) + 1).to(torch.int32).to(dev)
    res = {"device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu", "date": time.strftime("%Y-%m-%d"),
           "triton": triton.__version__, "batch": n, "heads": h, "k_dim": kd, "plans": {}}
    try:
        if dev != "cuda":
            raise ImportError("vLLM's Triton ops run on CUDA only")
        fused_recurrent_kda_packed_decode = vllm_kda_op()
    except Exception as e:  # noqa: BLE001 - reported
        res["fp32_error"] = repr(e)[:200]
    else:
        state = torch.randn(n + 1, h, kd, kd, device=dev) * 0.1
        o32 = torch.empty(1, n, h, kd, device=dev, dtype=torch.bfloat16)
        res["fp32_ms"] = time_ms(lambda: fused_recurrent_kda_packed_decode(
            mixed_qkv=mixed, raw_g=raw_g, raw_beta=raw_beta, A_log=a_log, dt_bias=dt_bias, lower_bound=None,
            initial_state=state, state_indices=idx, out=o32), dev)
        del state
    for plan_name, mix in MIX.items():
        lay = kda.KdaLayout(row_plan(mix, h, kd, gen), kd, kd)
        w = torch.exp(torch.randn(h, kd, generator=gen) * 0.4)
        w = (w / w.log().mean(-1, keepdim=True).exp()).to(dev)
        pool = torch.zeros(n + 1, lay.size, dtype=torch.uint8, device=dev)
        for lo in range(0, n, 64):
            m = min(64, n - lo)
            rows = torch.rand(1, h, kd, 1, generator=gen) + 0.1
            x = (torch.randn(m, h, kd, kd, generator=gen) * rows).to(dev)
            pool[1 + lo : 1 + lo + m] = kda.encode(x, lay, w)
        plan = KdaPlan(lay, w, dev)
        scratch = KdaScratch(lay, n, dev)
        out = torch.empty(n, h, kd, device=dev)
        args_fg = (pool, idx, plan, scratch, mixed, raw_g[0], raw_beta[0], a_log, dt_bias, out)
        # the readout and records against the reference on a few requests
        sel = idx[:4]
        x0 = mixed[:4].float()
        q = x0[:, : h * kd].view(4, h, kd)
        k = x0[:, h * kd : 2 * h * kd].view(4, h, kd)
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * kd**-0.5
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        g = -torch.exp(a_log).view(1, h, 1) * torch.nn.functional.softplus(raw_g[0, :4].float() + dt_bias.view(h, kd))
        o_want, r_want = kda.step(pool[sel.long()], lay, w, q, k, x0[:, 2 * h * kd :].view(4, h, kd), g,
                                  torch.sigmoid(raw_beta[0, :4].float()))
        one = pool.clone()
        small = KdaScratch(lay, 4, dev)
        o_got = torch.empty(4, h, kd, device=dev)
        kda_foreground_(one, sel, plan, small, mixed[:4], raw_g[0, :4], raw_beta[0, :4], a_log, dt_bias, o_got)
        kda_writeback_(one, plan, small, 4)
        entry = res["plans"][plan_name] = {
            "record_bytes": lay.size, "bits_per_value": lay.bits_per_value(),
            "check": {"out_max_rel_err": float((o_got - o_want).abs().max() / o_want.abs().max()),
                      "record_bytes_differing": float((one[sel.long()] != r_want).float().mean())}}
        del one
        entry["foreground"] = [{"tile": t, "warps": wp, "ms": time_ms(
            lambda: kda_foreground_(*args_fg, tile=t, num_warps=wp), dev)} for t, wp in FG_LAUNCHES]
        entry["writeback"] = [{"tile": t, "warps": wp, "ms": time_ms(
            lambda: kda_writeback_(pool, plan, scratch, n, tile=t, num_warps=wp), dev)} for t, wp in WB_LAUNCHES]
        fg = min(entry["foreground"], key=lambda r: r["ms"])
        wb = min(entry["writeback"], key=lambda r: r["ms"])
        entry["step_ms"] = time_ms(lambda: (kda_foreground_(*args_fg, tile=fg["tile"], num_warps=fg["warps"]),
                                            kda_writeback_(pool, plan, scratch, n, tile=wb["tile"],
                                                           num_warps=wb["warps"])), dev)
        entry.update(foreground_ms=fg["ms"], writeback_ms=wb["ms"])
        if "fp32_ms" in res:
            entry.update(foreground_speedup=res["fp32_ms"] / fg["ms"], step_speedup=res["fp32_ms"] / entry["step_ms"])
        print(plan_name, json.dumps(entry), flush=True)
        del pool
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))
    text = render(res)
    print(text)
    if args.docs:
        write_docs(text)


def render(res: dict) -> str:
    f32 = f"{res['fp32_ms']:.3f} ms" if "fp32_ms" in res else f"not run ({res.get('fp32_error', '')})"
    rows = []
    for plan, p in res["plans"].items():
        fs = f" ({p['foreground_speedup']:.2f}x)" if "foreground_speedup" in p else ""
        ss = f" ({p['step_speedup']:.2f}x)" if "step_speedup" in p else ""
        rows.append([f"{plan} ({p['bits_per_value']:.2f})", f"{p['foreground_ms']:.3f}{fs}", f"{p['writeback_ms']:.3f}",
                     f"{p['step_ms']:.3f}{ss}",
                     f"{p['check']['out_max_rel_err']:.1e}, {p['check']['record_bytes_differing']:.1e}"])
    return "\n".join([
        f"Measured by `python -m benchmarks.kda_kernels` on {res['device']} ({res['date']}, Triton {res['triton']}),"
        f" replayed from CUDA graphs: one KDA layer of {res['heads']} heads of K = V = {res['k_dim']} at batch"
        f" {res['batch']}. vLLM's FP32 KDA decode op: {f32}.",
        "", *table(["plan (bits/value)", "foreground ms (speed-up)", "writeback ms", "both in a row ms (speed-up)",
                    "check: out rel. err, record bytes differing"], rows)]) + "\n"


def write_docs(text: str) -> None:
    DOC.write_text(splice(DOC.read_text(), BEGIN, BEGIN + "\n" + text + END, END))


if __name__ == "__main__":
    main()
