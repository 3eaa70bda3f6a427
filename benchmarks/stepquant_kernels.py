"""STEPQuant's split decode step on a GPU, against vLLM's FP32 update timed in
the same run.

Both steps take vLLM's raw decode inputs (the post-conv ``q | k | v`` rows,
the gate inputs ``a``, ``b`` and the layer's ``A_log``, ``dt_bias``). The FP32
update is vLLM's own decode op (``fused_recurrent_gated_delta_rule_packed_decode``
on FP32 ``[slots, H, V, K]`` states); this package's Triton twin of it
(``stepquant_fp32.py``, on prepared inputs) is timed beside it. Everything is
replayed from CUDA graphs, so launch gaps do not count.

* ``op``: one GDN layer at batch 512, K = V = 128: house-qwen3next (4 value
  heads, 2 key heads) and a Qwen3.5-27B-like layer (48 / 16), each with an @6
  and an @4 width plan, and the 27B-like @6 plan with the rowwise fit (one
  absmax scale per key row: about half the writeback's instructions). The foreground alone (the layer's critical path; its
  launch shapes swept), the writeback alone (swept), and the two in a row.
* ``overlap``: 8 decoder layers of the 27B-like model at batch 512 (three GDN
  layers to one full-attention layer, as Qwen3.5) in one CUDA graph: bf16
  projections and MLP (hidden 5120, MLP 17408), the attention layer's decode
  over a 1,024-token context (24 query / 4 KV heads of 256, torch SDPA), and
  in each GDN layer its state update: FP32 in line; packed with the
  foreground in line and the writeback on the writeback stream
  (``state_pool.packed_decode``, vLLM's path), or both in line; or none (the
  load alone). "Update on the critical path" = the sequence minus the load
  alone.

    python -m benchmarks.stepquant_kernels [op] [overlap] [--json PATH] [--docs | --render-only] [--smoke]

Results: ``benchmarks/results/stepquant_kernels.json`` (each section under its
own key, merged into the file, so two device calls can fill it); ``--docs``
(or ``--render-only``) writes the tables into ``docs/stepquant.md``.
``--smoke`` runs both sections at toy shapes on any device (on CPU in Triton's
interpreter, timed without graphs) to check the script itself.
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
RESULTS = REPO / "benchmarks" / "results" / "stepquant_kernels.json"
DOC = REPO / "docs" / "stepquant.md"
BEGIN, END = "<!-- kernels:begin -->", "<!-- kernels:end -->"

# value heads, key heads, {plan: widths}; widths follow the calibrated budget rule (a pivot counts as 8 bits)
SHAPES = {
    "house-qwen3next": (4, 2, {"@6": (4, 6, 6, 8), "@4": (2, 4, 4, 6)}),
    "qwen3.5-27b-like": (48, 16, {"@6": (6,) * 40 + (4,) * 4 + (8,) * 3 + (16,),
                                  "@4": (4,) * 38 + (2,) * 6 + (6,) * 2 + (8,) + (16,),
                                  "@6 rowwise": (6,) * 40 + (4,) * 4 + (8,) * 3 + (16,),
                                  "@6 refit every 4": (6,) * 40 + (4,) * 4 + (8,) * 3 + (16,),
                                  "@4 refit every 4": (4,) * 38 + (2,) * 6 + (6,) * 2 + (8,) + (16,),
                                  "@6 refit every 8": (6,) * 40 + (4,) * 4 + (8,) * 3 + (16,)}),
}
FG_LAUNCHES = [  # most wanted first; later ones are skipped past the time budget
    {"fg_tile": 32, "fg_tiles": 4, "fg_warps": 4},
    {"fg_tile": 32, "fg_tiles": 4, "fg_warps": 2},
    {"fg_tile": 32, "fg_tiles": 2, "fg_warps": 4},
    {"fg_tile": 64, "fg_tiles": 2, "fg_warps": 4},
    {"fg_tile": 32, "fg_tiles": 1, "fg_warps": 4},
]
WB_LAUNCHES = [{"wb_tile": 32, "wb_warps": 4}, {"wb_tile": 32, "wb_warps": 8}, {"wb_tile": 16, "wb_warps": 2}]
# the 27B-like decoder layer around the state update
MODEL = {"hidden": 5120, "mlp": 17408, "heads": 48, "key_heads": 16, "attn_heads": 24, "kv_heads": 4,
         "attn_dim": 256, "context": 1024, "layers": 8}


class Setup:
    def __init__(self, smoke: bool):
        self.smoke = smoke
        self.dev = "cuda" if torch.cuda.is_available() else "cpu"
        self.batch, self.kd = (4, 32) if smoke else (512, 128)
        self.shapes = ({"toy": (4, 2, {"@6": (4, 6, 16, 8), "@4": (2, 4, 6, 4), "@6 rowwise": (4, 6, 16, 8),
                                     "@6 refit every 4": (4, 6, 16, 8)})}
                       if smoke else SHAPES)
        self.model = (dict(MODEL, hidden=64, mlp=96, heads=4, key_heads=2, attn_heads=2, kv_heads=1, attn_dim=32,
                           context=16, layers=4) if smoke else MODEL)

    def time_ms(self, fn, graph: bool = True) -> float:
        """Device ms a call, replayed from a CUDA graph (on CPU: wall time of one call)."""
        if self.dev == "cpu":
            t = time.perf_counter()
            fn()
            return 1e3 * (time.perf_counter() - t)
        from triton.testing import do_bench

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (compiles) outside the capture
            fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        if not graph:
            return do_bench(fn, warmup=10, rep=60)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        ms = do_bench(g.replay, warmup=10, rep=60)
        del g
        return ms


def vllm_fp32_op(dev: str):
    """vLLM's FP32 decode op, or None off CUDA or where vLLM is not importable."""
    if dev != "cuda":
        return None
    try:
        from vllm.third_party.flash_linear_attention.ops.fused_recurrent import (
            fused_recurrent_gated_delta_rule_packed_decode,
        )
    except Exception:  # noqa: BLE001 - reported as absent
        return None
    return fused_recurrent_gated_delta_rule_packed_decode


def raw_inputs(su: Setup, h: int, hk: int, gen: torch.Generator):
    """vLLM's decode inputs for one GDN layer: mixed q|k|v rows (bf16), a, b (bf16), A_log, dt_bias."""
    n, kd, dev = su.batch, su.kd, su.dev
    mixed = torch.randn(n, 2 * hk * kd + h * kd, generator=gen, device=dev).bfloat16()
    a = torch.randn(n, h, generator=gen, device=dev).bfloat16()
    b = torch.randn(n, h, generator=gen, device=dev).bfloat16()
    a_log = torch.empty(h, device=dev).uniform_(-6.9, -2.3, generator=gen)  # long memories (A in 0.001..0.1)
    dt_bias = torch.randn(h, generator=gen, device=dev) * 0.5
    return mixed, a, b, a_log, dt_bias


def prepared(mixed, a, b, a_log, dt_bias, hk: int, kd: int):
    """q, k (per key head), v, g, beta as vLLM's decode op forms them (fp32)."""
    from vllm_kvq.kernels.stepquant.reference import L2_EPS

    n = mixed.shape[0]
    x = mixed.float()
    q, k = x[:, : hk * kd].view(n, hk, kd), x[:, hk * kd : 2 * hk * kd].view(n, hk, kd)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + L2_EPS) * kd**-0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + L2_EPS)
    g = -torch.exp(a_log) * torch.nn.functional.softplus(a.float() + dt_bias)
    return q, k, x[:, 2 * hk * kd :].view(n, -1, kd), g, torch.sigmoid(b.float())


def fit_of(plan_name: str) -> str:
    """A plan named ``... rowwise`` refits one absmax scale per key row (the
    cheaper writeback), the others the STEPQuant fit."""
    return "rowwise" if plan_name.endswith("rowwise") else "stepquant"


def tail_of(plan_name: str) -> int:
    """Updates a record holds (``... refit every N``: N - 1). Such a plan's
    foreground and writeback timed alone see records holding none (a step
    that appends); its step and the overlapped stack cycle through the fits."""
    return int(plan_name.rsplit("refit every ", 1)[1]) - 1 if "refit every " in plan_name else 0


def packed_pool(su: Setup, bits: tuple, h: int, gen: torch.Generator, fit: str = "stepquant", tail: int = 0):
    """A pool of valid records (realistic fitted states) for the batch, slot 0 unused."""
    from vllm_kvq.kernels.stepquant import reference as ref
    from vllm_kvq.kernels.stepquant.format import StateLayout

    lay = StateLayout(bits, su.kd, su.kd, tail=tail)
    w = torch.exp(torch.randn(h, su.kd, device=su.dev, generator=gen) * 0.4)
    w = w / w.log().mean(-1, keepdim=True).exp()
    pool = torch.zeros(su.batch + 1, lay.size, dtype=torch.uint8, device=su.dev)
    for lo in range(0, su.batch, 64):
        m = min(64, su.batch - lo)
        rows = torch.rand(1, h, su.kd, 1, device=su.dev, generator=gen) + 0.1
        x = torch.randn(m, h, su.kd, su.kd, device=su.dev, generator=gen) * rows
        pool[1 + lo : 1 + lo + m] = ref.encode(x, lay, w, fit)
    return lay, w, pool


def op_section(su: Setup, budget_s: float) -> dict:
    from vllm_kvq.kernels.stepquant import reference as ref
    from vllm_kvq.kernels.stepquant import triton_step as ts
    from benchmarks.stepquant_fp32 import fp32_step_

    deadline = time.monotonic() + budget_s
    vllm_op = vllm_fp32_op(su.dev)
    gen = torch.Generator(device=su.dev).manual_seed(0)
    n, kd = su.batch, su.kd
    out = {"fp32_op": "vllm" if vllm_op else "triton twin", "shapes": {}}
    for name, (h, hk, plans) in su.shapes.items():
        raw = raw_inputs(su, h, hk, gen)
        q, k, v, g, beta = prepared(*raw, hk, kd)
        idx = (torch.randperm(n, device=su.dev, generator=gen) + 1).to(torch.int32)
        entry = out["shapes"][name] = {"heads": h, "key_heads": hk, "plans": {}}
        state = torch.randn(n + 1, h, kd, kd, device=su.dev, generator=gen) * 0.1  # [slots, H, V, K] for vLLM
        o_fp32 = torch.empty(n, 1, h, kd, device=su.dev, dtype=torch.bfloat16)
        if vllm_op:
            entry["fp32_vllm_ms"] = su.time_ms(lambda: vllm_op(
                mixed_qkv=raw[0], a=raw[1], b=raw[2], A_log=raw[3], dt_bias=raw[4], scale=kd**-0.5,
                initial_state=state, out=o_fp32, ssm_state_indices=idx, use_qk_l2norm_in_kernel=True))
        twin = state.transpose(-1, -2).contiguous()  # the twin's [slots, H, K, V]
        entry["fp32_triton_ms"] = su.time_ms(lambda: fp32_step_(twin, idx, q, k, v, g, beta, block_v=min(64, kd)))
        del state, twin
        fp32_ms = entry.get("fp32_vllm_ms", entry["fp32_triton_ms"])
        entry["state_bytes_fp32"] = 4 * h * kd * kd
        for plan_name, bits in plans.items():
            fit = fit_of(plan_name)
            lay, w, pool = packed_pool(su, bits, h, gen, fit, tail_of(plan_name))
            plan = ts.StepPlan(lay, w, su.dev, fit)
            qkv = (raw[0][:, : hk * kd].unflatten(1, (hk, kd)), raw[0][:, hk * kd : 2 * hk * kd].unflatten(1, (hk, kd)),
                   raw[0][:, 2 * hk * kd :].unflatten(1, (h, kd)))
            o = torch.empty(n, h, kd, device=su.dev, dtype=torch.bfloat16)

            def fg(lc, scratch):
                return ts.foreground_(pool, idx, plan, scratch, *qkv, raw[1], raw[2], out=o, launch=lc,
                                      raw_gates=(raw[3], raw[4]))

            # the step against the reference at this shape (a few requests)
            sel = idx[:4]
            o_want, r_want = ref.step(pool[sel.long()], lay, w, q[:4].repeat_interleave(h // hk, 1),
                                      k[:4].repeat_interleave(h // hk, 1), v[:4], g[:4], beta[:4], fit=fit)
            one = pool.clone()
            o_got = ts.step_(one, sel, plan, q[:4], k[:4], v[:4], g[:4], beta[:4])
            check = {"out_max_rel_err": float((o_got.cpu() - o_want.cpu()).abs().max() / o_want.abs().max().cpu()),
                     "record_bytes_differing": float((one[sel.long()] != r_want).float().mean())}
            del one
            rows, fg_best = [], None
            for lc in FG_LAUNCHES:
                if rows and time.monotonic() > deadline:
                    rows.append({"launch": lc, "error": "skipped (time budget)"})
                    continue
                scratch = ts.StepScratch(plan, hk, n, su.dev, span=ts.fg_span(lc))
                try:
                    ms = su.time_ms(lambda: fg(lc, scratch))
                except Exception as e:  # noqa: BLE001 - an out-of-resources launch is a result too
                    rows.append({"launch": lc, "error": repr(e)[:200]})
                    continue
                rows.append({"launch": lc, "ms": ms, "speedup": fp32_ms / ms})
                if fg_best is None or ms < fg_best["ms"]:
                    fg_best = rows[-1]
                print(name, plan_name, json.dumps(rows[-1]), flush=True)
            scratch = ts.StepScratch(plan, hk, n, su.dev, span=ts.fg_span(fg_best["launch"]))
            fg(fg_best["launch"], scratch)
            wb_rows, wb_best = [], None
            for lc in WB_LAUNCHES:
                if wb_rows and time.monotonic() > deadline:
                    wb_rows.append({"launch": lc, "error": "skipped (time budget)"})
                    continue
                ms = su.time_ms(lambda: ts.writeback_(pool, plan, scratch, n, launch=lc))
                wb_rows.append({"launch": lc, "ms": ms})
                if wb_best is None or ms < wb_best["ms"]:
                    wb_best = wb_rows[-1]
                print(name, plan_name, json.dumps(wb_rows[-1]), flush=True)
            both = {**fg_best["launch"], **wb_best["launch"]}
            step_ms = su.time_ms(lambda: (fg(both, scratch), ts.writeback_(pool, plan, scratch, n, launch=both)))
            exact_ms = su.time_ms(lambda: ts.foreground_(pool, idx, plan, scratch, *qkv, raw[1], raw[2], out=o,
                                                         launch=both, fast=False, raw_gates=(raw[3], raw[4])))
            refit = {}
            if lay.tail:  # the timings above are of appending steps (fresh records hold none); now the Nth step's
                pool[:, lay.tail_offset : lay.tail_offset + 4] = torch.tensor([lay.tail], dtype=torch.int32,
                                                                               device=su.dev).view(torch.uint8)
                fg(both, scratch)  # the scratch now says every record is due: the writeback refits each replay
                refit = {"foreground_refit_ms": su.time_ms(lambda: fg(both, scratch)),
                         "writeback_refit_ms": su.time_ms(lambda: ts.writeback_(pool, plan, scratch, n, launch=both))}
            entry["plans"][plan_name] = {
                "bits": list(bits), "record_bytes": lay.packed_bytes, "bits_per_value": lay.bits_per_value(),
                "scratch_bytes_per_request": ts.StepScratch.bytes_per_request(lay, hk, ts.fg_span(both)),
                "check": check, "foreground": rows, "writeback": wb_rows, "foreground_ms": fg_best["ms"],
                "foreground_speedup": fp32_ms / fg_best["ms"], "foreground_exact_ms": exact_ms,
                "writeback_ms": wb_best["ms"], "step_ms": step_ms, "step_speedup": fp32_ms / step_ms,
                "launch": both, **refit}
            del pool
            if su.dev == "cuda":
                torch.cuda.empty_cache()
    return out


class Stack:
    """The 27B-like decoder layers around the state updates (bf16 GEMMs, SDPA)."""

    def __init__(self, su: Setup, gen: torch.Generator):
        m, dev, n, kd = su.model, su.dev, su.batch, su.kd
        self.m, self.n, self.kd = m, n, kd
        hid, h, hk = m["hidden"], m["heads"], m["key_heads"]

        def weight(i, o):
            return (torch.randn(o, i, device=dev, generator=gen) * i**-0.5).bfloat16()

        self.qkv_dim = 2 * hk * kd + h * kd
        self.w_in = weight(hid, self.qkv_dim + h * kd)  # q | k | v | z
        self.w_ba = weight(hid, 2 * h)
        self.w_out = weight(h * kd, hid)
        a_q = m["attn_heads"] * m["attn_dim"]
        self.w_attn = weight(hid, 2 * a_q + 2 * m["kv_heads"] * m["attn_dim"])  # q | gate | k | v
        self.w_o = weight(a_q, hid)
        self.w_gu = weight(hid, 2 * m["mlp"])
        self.w_down = weight(m["mlp"], hid)
        kv = (n, m["kv_heads"], m["context"], m["attn_dim"])
        self.k_cache = torch.randn(kv, device=dev, generator=gen).bfloat16()
        self.v_cache = torch.randn(kv, device=dev, generator=gen).bfloat16()
        self.x0 = torch.randn(n, hid, device=dev, generator=gen).bfloat16()
        self.a_log = torch.empty(h, device=dev).uniform_(-6.9, -2.3, generator=gen)
        self.dt_bias = torch.randn(h, device=dev, generator=gen) * 0.5
        self.core = torch.zeros(n, h, kd, device=dev, dtype=torch.bfloat16)
        self.kinds = (["gdn"] * 3 + ["attention"]) * (m["layers"] // 4)

    def mlp(self, x):
        gate, up = torch.nn.functional.linear(x, self.w_gu).chunk(2, dim=-1)
        return x + torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, self.w_down)

    def forward(self, update) -> torch.Tensor:
        """``update(i, mixed_qkv, a, b, out)``: the i-th GDN layer's state update (None: skipped)."""
        m, n, x, gdn = self.m, self.n, self.x0, 0
        for kind in self.kinds:
            if kind == "gdn":
                proj = torch.nn.functional.linear(x, self.w_in)
                ba = torch.nn.functional.linear(x, self.w_ba)
                if update is not None:
                    update(gdn, proj[:, : self.qkv_dim], ba[:, : m["heads"]], ba[:, m["heads"] :], self.core)
                gdn += 1
                core = self.core.flatten(1) * torch.nn.functional.silu(proj[:, self.qkv_dim :])
                x = x + torch.nn.functional.linear(core, self.w_out)
            else:
                a_q, d = m["attn_heads"] * m["attn_dim"], m["attn_dim"]
                qkv = torch.nn.functional.linear(x, self.w_attn)
                q = qkv[:, :a_q].view(n, m["attn_heads"], 1, d)
                o = torch.nn.functional.scaled_dot_product_attention(q, self.k_cache, self.v_cache, enable_gqa=True)
                o = o.view(n, a_q) * torch.sigmoid(qkv[:, a_q : 2 * a_q])
                x = x + torch.nn.functional.linear(o, self.w_o)
            x = self.mlp(x)
        return x


def overlap_section(su: Setup, launch: dict | None) -> dict:
    from vllm_kvq.backends.state_pool import LayerPool, PackedDecoder, join_writebacks, packed_decode
    from vllm_kvq.kernels.stepquant import triton_step as ts
    from benchmarks.stepquant_fp32 import fp32_step_

    gen = torch.Generator(device=su.dev).manual_seed(1)
    m, n, kd = su.model, su.batch, su.kd
    h, hk = m["heads"], m["key_heads"]
    stack = Stack(su, gen)
    gdn_layers = stack.kinds.count("gdn")
    idx = (torch.randperm(n, device=su.dev, generator=gen) + 1).to(torch.int32)
    vllm_op = vllm_fp32_op(su.dev)
    res = {"model": m, "batch": n, "fp32_op": "vllm" if vllm_op else "triton twin", "plans": {}}
    if launch:
        ts.LAUNCH.update(launch)  # the op section's best launch shapes
        res["launch"] = dict(ts.LAUNCH)
    res["load_ms"] = su.time_ms(lambda: stack.forward(None))
    states = [torch.randn(n + 1, h, kd, kd, device=su.dev, generator=gen) * 0.1 for _ in range(gdn_layers)]

    def fp32(i, mixed, a, b, out):
        if vllm_op:
            vllm_op(mixed_qkv=mixed, a=a, b=b, A_log=stack.a_log, dt_bias=stack.dt_bias, scale=kd**-0.5,
                    initial_state=states[i], out=out.unsqueeze(1), ssm_state_indices=idx, use_qk_l2norm_in_kernel=True)
        else:
            q, k, v, g, beta = prepared(mixed, a, b, stack.a_log, stack.dt_bias, hk, kd)
            fp32_step_(states[i], idx, q, k, v, g, beta, out)

    res["fp32_ms"] = su.time_ms(lambda: stack.forward(fp32))
    del states
    widths = SHAPES["qwen3.5-27b-like"][2] if not su.smoke else su.shapes["toy"][2]
    for plan_name, bits in widths.items():
        pools, decoders, serial = [], [], []
        for _ in range(gdn_layers):
            lay, w, pool = packed_pool(su, bits, h, gen, fit_of(plan_name), tail_of(plan_name))
            layer = LayerPool(lay, w, fit_of(plan_name), torch.float32)
            pools.append(pool)
            decoders.append(PackedDecoder(layer, su.dev, hk, n))
            serial.append(PackedDecoder(layer, su.dev, hk, n))
            serial[-1].cuda = False  # both kernels in line

        def packed(decs):
            def update(i, mixed, a, b, out):
                packed_decode(pools[i], idx, decs[i], mixed, a, b, stack.a_log, stack.dt_bias, hk, out)
            return update

        entry = res["plans"][plan_name] = {}
        entry["overlapped_ms"] = su.time_ms(lambda: (stack.forward(packed(decoders)), join_writebacks()))
        entry["in_line_ms"] = su.time_ms(lambda: stack.forward(packed(serial)))
        upd = lambda ms: ms - res["load_ms"]  # noqa: E731
        entry["update_on_critical_path_ms"] = upd(entry["overlapped_ms"])
        entry["speedup_total"] = res["fp32_ms"] / entry["overlapped_ms"]
        entry["speedup_update"] = upd(res["fp32_ms"]) / upd(entry["overlapped_ms"])
        entry["speedup_update_in_line"] = upd(res["fp32_ms"]) / upd(entry["in_line_ms"])
        print(plan_name, json.dumps(entry), flush=True)
        del pools, decoders, serial
    res["fp32_update_ms"] = res["fp32_ms"] - res["load_ms"]
    return res


def render(res: dict) -> str:
    blocks = []
    op = res.get("op")
    if op:
        rows = []
        for name, s in op["shapes"].items():
            f32 = s.get("fp32_vllm_ms", s["fp32_triton_ms"])
            for plan, p in s["plans"].items():
                lc, check = p["launch"], p["check"]
                rows.append([f"{name} ({s['heads']}/{s['key_heads']} heads)", f"{plan} ({p['bits_per_value']:.2f})",
                             f"{f32:.3f} ({s['fp32_triton_ms']:.3f})",
                             f"{p['foreground_ms']:.3f}" + refit_cell(p, "foreground"),
                             f"**{p['foreground_speedup']:.2f}x**",
                             f"{p['writeback_ms']:.3f}" + refit_cell(p, "writeback"),
                             f"{p['step_ms']:.3f} ({p['step_speedup']:.2f}x)", f"{p['foreground_exact_ms']:.3f}",
                             f"fg {lc['fg_tile']}x{lc['fg_tiles']}/w{lc['fg_warps']}, wb {lc['wb_tile']}/w{lc['wb_warps']}",
                             f"{check['out_max_rel_err']:.1e}, {check['record_bytes_differing']:.1e}"])
        blocks.append("\n".join([
            f"Measured by `python -m benchmarks.stepquant_kernels op` on {res['device']} ({op['date']}, Triton"
            f" {res['triton']}), replayed from CUDA graphs. One decode token per request, batch {op['batch']}, one"
            f" GDN layer, K = V = {op['k_dim']}. FP32:"
            f" {'vLLM' if op['fp32_op'] == 'vllm' else 'the Triton twin of vLLM'}'s"
            " decode op on FP32 states (the Triton twin beside it). Foreground: the readout, δ and row partials"
            " (what the layer waits for); writeback: fit and repack; step: both in a row. Speed-ups against FP32."
            " Plans that refit every N steps: foreground and writeback of a step that appends its update, then"
            " (refit) of the Nth step, which fits; their step: N steps' average.",
            "", *table(["layer", "plan (bits/value)", "FP32 ms (twin)", "foreground ms", "**foreground speed-up**",
                        "writeback ms", "step ms (speed-up)", "exact-division foreground ms", "launch",
                        "check: out rel. err, record bytes differing"], rows)]))
    ov = res.get("overlap")
    if ov:
        m = ov["model"]
        rows = [[plan, f"{p['overlapped_ms']:.3f}", f"{p['update_on_critical_path_ms']:.3f}",
                 f"**{p['speedup_update']:.2f}x**", f"{p['speedup_total']:.2f}x",
                 f"{p['in_line_ms']:.3f} ({p['speedup_update_in_line']:.2f}x)"] for plan, p in ov["plans"].items()]
        blocks.append("\n".join([
            f"Measured by `python -m benchmarks.stepquant_kernels overlap` ({ov['date']}): {m['layers']} decoder"
            f" layers of the 27B-like model at batch {ov['batch']} in one CUDA graph (3 GDN layers of"
            f" {m['heads']}/{m['key_heads']} heads to 1 attention layer; bf16 projections and MLP, hidden"
            f" {m['hidden']}, MLP {m['mlp']}; attention decode over {m['context']} tokens). The load alone:"
            f" {ov['load_ms']:.3f} ms; with FP32 state updates: {ov['fp32_ms']:.3f} ms (updates on the critical"
            f" path: {ov['fp32_update_ms']:.3f} ms).",
            "", *table(["plan", "overlapped ms", "updates on the critical path ms", "**update speed-up**",
                        "whole-stack speed-up", "both kernels in line ms (update speed-up)"], rows)]))
    return "\n\n".join(blocks) + "\n"


def refit_cell(p: dict, kernel: str) -> str:
    """`` (refit X ms)`` for a plan with held updates, timed on the step that refits."""
    return f" (refit {p[kernel + '_refit_ms']:.3f})" if kernel + "_refit_ms" in p else ""


def write_docs(text: str) -> None:
    DOC.write_text(splice(DOC.read_text(), BEGIN, BEGIN + "\n" + text + END, END))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("sections", nargs="*", help="op, overlap (default: both)")
    ap.add_argument("--json", action="append", help="results file (written: the first; read and merged: all, in"
                    f" order; default {RESULTS.relative_to(REPO)})")
    ap.add_argument("--docs", action="store_true", help="write the tables into docs/stepquant.md")
    ap.add_argument("--render-only", action="store_true",
                    help=f"merge the --json files into {RESULTS.relative_to(REPO)}, render it into the docs")
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop sweeping launch shapes after this long")
    ap.add_argument("--smoke", action="store_true", help="toy shapes on any device: checks the script")
    args = ap.parse_args()
    if set(args.sections) - {"op", "overlap"}:
        ap.error(f"sections are op and overlap, got {args.sections}")
    paths = [Path(p) for p in args.json or [RESULTS]]
    res: dict = {}
    for p in reversed(paths):  # the first file's sections win
        res.update(json.loads(p.read_text()) if p.exists() else {})
    if args.render_only:
        RESULTS.write_text(json.dumps(res, indent=1))
        write_docs(render(res))
        return
    su = Setup(args.smoke)
    if su.dev == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton

    res.update(device=torch.cuda.get_device_name(0) if su.dev == "cuda" else "cpu", torch=torch.__version__,
               triton=triton.__version__)
    out = paths[0]
    out.parent.mkdir(parents=True, exist_ok=True)
    sections = args.sections or ["op", "overlap"]
    date = time.strftime("%Y-%m-%d")
    if "op" in sections:
        res["op"] = {"date": date, "batch": su.batch, "k_dim": su.kd, **op_section(su, args.budget_s)}
        out.write_text(json.dumps(res, indent=1))
    if "overlap" in sections:
        big = res.get("op", {}).get("shapes", {}).get("qwen3.5-27b-like", {}).get("plans", {}).get("@6")
        res["overlap"] = {"date": date, **overlap_section(su, big and big["launch"])}
        out.write_text(json.dumps(res, indent=1))
    text = render(res)
    print(text)
    if args.docs:
        write_docs(text)


if __name__ == "__main__":
    main()
