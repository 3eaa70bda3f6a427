"""OSCAR Triton kernels on a GPU, against BF16 baselines timed in the same run.

* Decode attention: batch x context x (Hq, Hkv, D); split-KV decode of OSCAR
  INT2 pages and of the tiered pages (the 80-byte plan) at the kernel's
  default launch (what serving runs; store excluded) against the fastest
  BF16 decode in the same run (torch SDPA under each backend that runs, with
  ``enable_gqa``, and vLLM's own TRITON_ATTN kernel on paged BF16 K/V), with
  effective bandwidth over the bytes each really reads, and the device's read
  bandwidth measured here; other launches beside the default; at a hybrid
  model's block sizes (not multiples of the step), decode and extend at the
  default launch against 16-token steps; and decode against the split count.
* Write path: the fused store for a prefill-sized batch of tokens, OSCAR INT2
  and tiered, against the bandwidth ceiling.
* Extend (prefill chunk over INT2 + BF16 history) against torch SDPA (flash)
  over the same context in BF16.
* Model projection: Qwen3-4B at 100K context, batch as the H200's memory
  allows for each cache, from measured attention (the fastest BF16 decode for
  BF16), store and GEMM times.

    python -m benchmarks.oscar_kernels [--quick] [--sections extend ...]

Writes ``benchmarks/results/oscar_kernels.json`` and ``docs/kernels.md`` (or
``$OUT``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

from evalkit.markdown import splice, table
from vllm_kvq.kernels.oscar import reference as ref
from vllm_kvq.kernels.oscar.format import LayerTiers, OscarFormat
from vllm_kvq.kernels.oscar.triton_decode import decode_attention, default_launch, num_splits
from vllm_kvq.kernels.oscar.triton_extend import extend_attention, query_tiles
from vllm_kvq.kernels.oscar.triton_store import default_launch as default_store_launch
from vllm_kvq.kernels.oscar.triton_store import rotation_parts, store_decode_tokens, store_tokens

REPO = Path(__file__).resolve().parents[1]
DEV = "cuda"
SHAPES = [(32, 8, 128), (96, 8, 128)]
BATCHES = [1, 8, 32]
CONTEXTS = [8192, 32768, 100_000]


PLANS = {"OSCAR INT2": None, "tiers 80 B": "k=48x4,80x2;v=48x4,80x0"}  # house-qwen3's calibrated 80 B plan
"""The page formats timed: INT2 everywhere, and the 80-byte tier plan."""


def fmt_for(d: int = 128, block_size: int = 128, plan: str | None = None) -> OscarFormat:
    """OSCAR INT2, or a tier plan of PLANS (head size 128)."""
    tiers = None if plan is None else LayerTiers.parse(plan)
    return OscarFormat(head_size=d, block_size=block_size, sink=64, window=256, tiers=tiers)


def read_bandwidth() -> float:
    """Bytes/s of a large on-device reduction (a pure read)."""
    x = torch.empty(4 << 30, dtype=torch.uint8, device=DEV).view(torch.float32)
    x.fill_(1.0)
    ms = do_bench(lambda: x.sum(), warmup=5, rep=50)
    del x
    return (4 << 30) / (ms * 1e-3)


def make_cache(fmt: OscarFormat, batch: int, ctx: int, hkv: int, gen: torch.Generator):
    """A paged cache of ``batch`` requests of ``ctx`` tokens, blocks shuffled, valid scales."""
    per_req = fmt.state_blocks + math.ceil(ctx / fmt.block_size)
    nblocks = batch * per_req + 1
    cache = torch.randint(0, 256, (nblocks, hkv, fmt.block_size, fmt.bytes_per_token), dtype=torch.uint8,
                          device=DEV, generator=gen)
    pages = ref.PageViews(cache, fmt)
    pages.state.copy_(torch.randn(pages.state.shape, device=DEV, generator=gen) * 0.5)  # spans whole blocks
    for pairs in (pages.k_pairs, pages.v_pairs):
        pairs[..., 0].copy_(torch.rand(pairs[..., 0].shape, device=DEV, generator=gen) * 0.1 + 0.01)
        pairs[..., 1].copy_(torch.rand(pairs[..., 1].shape, device=DEV, generator=gen) * -0.2)
    perm = torch.randperm(nblocks - 1, device=DEV, generator=gen) + 1
    table = perm[: batch * per_req].view(batch, per_req).to(torch.int32)
    return cache, table


def decode_inputs(fmt: OscarFormat, batch: int, ctx: int, hq: int, hkv: int, gen) -> tuple:
    """(cache, block table, queries, sequence lengths, output) of one decode
    step of ``batch`` requests of ``ctx`` tokens."""
    cache, table = make_cache(fmt, batch, ctx, hkv, gen)
    q = torch.randn(batch, hq, fmt.head_size, device=DEV, generator=gen).to(torch.bfloat16)
    seq = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    return cache, table, q, seq, torch.empty_like(q)


def fills(fmt: OscarFormat, hkv: int, gen) -> tuple:
    """Means of the 0-bit tiers (random), K and V."""
    return tuple(torch.randn(hkv, getattr(fmt, kind).zero, device=DEV, generator=gen) if getattr(fmt, kind).zero
                 else None for kind in "kv")


def oscar_bytes(fmt: OscarFormat, batch: int, ctx: int, hkv: int, hq: int) -> int:
    int2 = max(ctx - fmt.sink - fmt.window, 0) * fmt.bytes_per_token
    bf16 = min(ctx, fmt.sink + fmt.window) * fmt.state_row_bytes
    return batch * hkv * (int2 + bf16) + batch * hq * fmt.head_size * 4


LAUNCHES = [{"num_warps": w, "num_stages": st, "tile": t}
            for w, st, t in ((1, 6, 64), (1, 4, 64), (1, 8, 64), (1, 6, 128), (1, 4, 32), (2, 6, 128))]
STORE_LAUNCHES = [{"num_warps": w, "rows": r} for w, r in ((8, 32), (4, 16), (2, 16), (8, 64))]  # besides the default


def sweep_launch(hq: int, sms: int, gen) -> list[dict]:
    """Decode at each launch of LAUNCHES for ``hq`` query heads over 8 KV
    heads, batch 32 and batch 1 at 100K tokens: how the kernel's default
    launch stands among the others in the same run (it does not pick the
    tables' launch: a single request's time moves by 2x between runs)."""
    fmt = fmt_for(128)
    rows = []
    for b, ctx in [(32, 100_000), (1, 100_000)]:
        cache, table, q, seq, out = decode_inputs(fmt, b, ctx, hq, 8, gen)
        splits = num_splits(b, 8, ctx, sms)
        for launch in LAUNCHES:
            ms = do_bench(lambda: decode_attention(q, cache, fmt, table, seq, 0.088, splits, out, launch),
                          warmup=10, rep=100)
            rows.append({**launch, "hq": hq, "batch": b, "context": ctx, "ms": ms})
        del cache, table
        torch.cuda.empty_cache()
    return rows


def sdpa_backends():
    from torch.nn.attention import SDPBackend

    return {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "flash": SDPBackend.FLASH_ATTENTION}


def vllm_triton_decode(q, k, v, ctx: int):
    """vLLM's TRITON_ATTN decode kernel (``unified_attention``) on a paged
    BF16 cache holding ``k, v [B, Hkv, L, D]``, as its metadata builder
    launches it for a decode batch (2D kernel for batches of at least 128 /
    Hkv requests, else 16 softmax segments per request)."""
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    b, hkv, _, d = k.shape
    hq = q.shape[1]
    kb = 16
    pages = -(-ctx // kb)
    cache = torch.empty(b * pages, kb, hkv, 2 * d, dtype=torch.bfloat16, device=DEV)
    cache.view(b, pages * kb, hkv, 2 * d)[:, :ctx, :, :d] = k.transpose(1, 2)
    cache.view(b, pages * kb, hkv, 2 * d)[:, :ctx, :, d:] = v.transpose(1, 2)
    k_cache, v_cache = cache.split(d, dim=-1)
    table = torch.arange(b * pages, dtype=torch.int32, device=DEV).view(b, pages)
    seq = torch.full((b,), ctx, dtype=torch.int32, device=DEV)
    cu = torch.arange(b + 1, dtype=torch.int32, device=DEV)
    threshold, segments = 128 // hkv, 16
    seg_out = torch.empty(threshold, hq, segments, triton.next_power_of_2(d), dtype=torch.float32, device=DEV)
    seg_max = torch.empty(threshold, hq, segments, dtype=torch.float32, device=DEV)
    seg_sum = torch.empty_like(seg_max)
    out = torch.empty(b, hq, d, dtype=torch.bfloat16, device=DEV)
    descale = torch.ones(1, dtype=torch.float32, device=DEV).expand(b, hkv)
    return lambda: unified_attention(
        q=q, k=k_cache, v=v_cache, out=out, cu_seqlens_q=cu, max_seqlen_q=1, seqused_k=seq, max_seqlen_k=ctx,
        softmax_scale=d ** -0.5, causal=True, window_size=(-1, -1), block_table=table, softcap=0,
        q_descale=None, k_descale=descale, v_descale=descale, seq_threshold_3D=threshold,
        num_par_softmax_segments=segments, softmax_segm_output=seg_out, softmax_segm_max=seg_max,
        softmax_segm_expsum=seg_sum)


def best_bf16_decode(hq: int, hkv: int, d: int, batch: int, ctx: int, gen) -> dict:
    """Every BF16 decode that runs here on one query per request over dense
    BF16 K/V: torch SDPA under each backend (``enable_gqa``) and vLLM's
    TRITON_ATTN kernel. Returns the ms of each and the fastest."""
    from torch.nn.attention import sdpa_kernel

    q = torch.randn(batch, hq, 1, d, device=DEV, generator=gen).to(torch.bfloat16)
    k = torch.randn(batch, hkv, ctx, d, device=DEV, generator=gen).to(torch.bfloat16)
    v = torch.randn(batch, hkv, ctx, d, device=DEV, generator=gen).to(torch.bfloat16)
    times = {}
    for name, backend in sdpa_backends().items():
        try:
            with sdpa_kernel(backend):
                run = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
                run()
                times[f"sdpa {name}"] = do_bench(run, warmup=10, rep=100)
        except RuntimeError as e:  # a backend that does not take this shape or device
            times[f"sdpa {name}"] = f"not run: {str(e).splitlines()[0][:120]}"
    try:
        times["vllm TRITON_ATTN"] = do_bench(vllm_triton_decode(q[:, :, 0], k, v, ctx), warmup=10, rep=100)
    except Exception as e:  # noqa: BLE001 - the row records why
        times["vllm TRITON_ATTN"] = f"not run: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    del k, v
    torch.cuda.empty_cache()
    ran = {n: t for n, t in times.items() if isinstance(t, float)}
    best = min(ran, key=ran.get)
    return {"times": times, "best": best, "ms": ran[best], "bytes": 2 * batch * hkv * ctx * d * 2}


def bench_decode(hq: int, hkv: int, d: int, batch: int, ctx: int, sms: int, gen) -> dict:
    bf16 = best_bf16_decode(hq, hkv, d, batch, ctx, gen)
    row = {"hq": hq, "hkv": hkv, "d": d, "batch": batch, "context": ctx,
           "splits": num_splits(batch, hkv, ctx, sms, 128), "bf16": bf16,
           "bf16_ms": bf16["ms"], "bf16_gbps": bf16["bytes"] / bf16["ms"] / 1e6}
    for name, plan in PLANS.items():
        fmt = fmt_for(d, plan=plan)
        ms = time_decode(fmt, hq, hkv, batch, ctx, sms, gen)
        nbytes = oscar_bytes(fmt, batch, ctx, hkv, hq)
        row[name] = {"ms": ms, "bytes": nbytes, "gbps": nbytes / ms / 1e6, "speedup": bf16["ms"] / ms}
    return row


def bench_store(tokens: int, hkv: int, d: int, gen, plan: str | None = None) -> dict:
    """The fused store of ``tokens`` new tokens of one request (a prefill chunk)
    at the kernel's default launch (what serving runs), rotated and unrotated,
    with the other launches of STORE_LAUNCHES beside it."""
    fmt = fmt_for(d, plan=plan)
    cache, table = make_cache(fmt, 1, tokens, hkv, gen)
    k = torch.randn(tokens, hkv, d, device=DEV, generator=gen).to(torch.bfloat16)
    v = torch.randn(tokens, hkv, d, device=DEV, generator=gen).to(torch.bfloat16)
    rot = rotation_parts(torch.linalg.qr(torch.randn(hkv, d, d, device=DEV, generator=gen))[0])
    pos = torch.arange(tokens, dtype=torch.int32, device=DEV)
    req = torch.zeros(tokens, dtype=torch.int32, device=DEV)
    end = torch.full((tokens,), tokens, dtype=torch.int32, device=DEV)
    res = {"tokens": tokens, "hkv": hkv, "d": d, "launch": default_store_launch(d), "sweep": []}
    for launch in [None] + STORE_LAUNCHES:
        row = {"launch": launch or res["launch"], "default": launch is None}
        for name, r in (("store_rotated", rot), ("store_unrotated", None)):
            ms = do_bench(lambda: store_tokens(cache, fmt, k, v, r, pos, req, end, table, 0.96, 0.92, launch=launch),
                          warmup=10, rep=50)
            moved = 2 * k.numel() * 2 + tokens * hkv * fmt.bytes_per_token
            moved += min(tokens, fmt.sink + fmt.window) * hkv * fmt.state_row_bytes
            if r is not None:
                moved += tokens * hkv * d * 2  # rotated keys handed back
            row[name] = {"ms": ms, "bytes": moved, "gbps": moved / ms / 1e6}
        if launch is None:
            res["store_rotated"], res["store_unrotated"] = row["store_rotated"], row["store_unrotated"]
        else:
            res["sweep"].append(row)
    copy_src = torch.empty(2 * k.numel() * 2, dtype=torch.uint8, device=DEV)
    copy_dst = torch.empty_like(copy_src)
    ms = do_bench(lambda: copy_dst.copy_(copy_src), warmup=10, rep=50)
    res["bf16_cache_copy"] = {"ms": ms, "bytes": 2 * copy_src.numel(), "gbps": 2 * copy_src.numel() / ms / 1e6}
    return res


EXTEND_LAUNCHES = [{"rows": r, "block_n": n, "num_warps": w}
                   for r, n, w in ((16, 32, 4), (64, 32, 4), (64, 64, 4), (64, 64, 8), (128, 64, 8), (128, 32, 4))]


def bench_extend(hq: int, hkv: int, d: int, ctx: int, chunk: int, gen) -> dict:
    """One prefill chunk of ``chunk`` tokens after ``ctx`` tokens of history, at
    each launch of EXTEND_LAUNCHES, against flash SDPA over the same keys in
    BF16 (not causal inside the chunk: (ctx + chunk) keys per query against
    ctx + chunk / 2 on average, a few percent more work)."""
    sweep = [{"launch": launch, "ms": ms}
             for launch, ms in zip(EXTEND_LAUNCHES, time_extend(fmt_for(d), hq, hkv, ctx, chunk, gen, EXTEND_LAUNCHES))]
    best = min(sweep, key=lambda r: r["ms"])
    q = torch.randn(chunk, hq, d, device=DEV, generator=gen).to(torch.bfloat16)
    kk = torch.randn(1, hq, ctx + chunk, d, device=DEV, generator=gen).to(torch.bfloat16)
    vv = torch.randn(1, hq, ctx + chunk, d, device=DEV, generator=gen).to(torch.bfloat16)
    qq = q.transpose(0, 1).unsqueeze(0).contiguous()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ms_bf16 = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(qq, kk, vv), warmup=5, rep=30)
    del kk, vv
    torch.cuda.empty_cache()
    return {"hq": hq, "hkv": hkv, "d": d, "context": ctx, "chunk": chunk, "sweep": sweep,
            "launch": best["launch"], "oscar_ms": best["ms"], "bf16_sdpa_ms": ms_bf16,
            "speedup": ms_bf16 / best["ms"]}


def time_extend(fmt: OscarFormat, hq: int, hkv: int, ctx: int, chunk: int, gen, launches: list) -> list[float]:
    """ms of one prefill chunk of ``chunk`` tokens after ``ctx`` tokens of
    history, at each launch (None: the default)."""
    d = fmt.head_size
    cache, table = make_cache(fmt, 1, ctx + chunk, hkv, gen)
    q = torch.randn(chunk, hq, d, device=DEV, generator=gen).to(torch.bfloat16)
    k = torch.randn(chunk, hkv, d, device=DEV, generator=gen).to(torch.bfloat16)
    v = torch.randn(chunk, hkv, d, device=DEV, generator=gen).to(torch.bfloat16)
    tiles = query_tiles([(0, 0, chunk, ctx)], DEV)
    out = torch.empty_like(q)
    zero = fills(fmt, hkv, gen)
    times = [do_bench(lambda: extend_attention(q, k, v, cache, fmt, table, tiles, d ** -0.5, out, launch, zero),
                      warmup=5, rep=30) for launch in launches]
    del cache, table
    torch.cuda.empty_cache()
    return times


def gemm_ms(batch: int, shapes: list[tuple[int, int]], gen) -> float:
    """One decoder layer's linear layers at ``batch`` tokens, bf16."""
    total = 0.0
    for k_in, n_out in shapes:
        x = torch.randn(batch, k_in, device=DEV, generator=gen).to(torch.bfloat16)
        w = torch.randn(n_out, k_in, device=DEV, generator=gen).to(torch.bfloat16)
        total += do_bench(lambda: torch.nn.functional.linear(x, w), warmup=10, rep=50)
    return total


def project_qwen3_4b(sms: int, gen) -> dict:
    """Decode tokens/s of Qwen3-4B at 100K context on one H200: the fastest
    BF16 decode, OSCAR INT2 and the 80-byte tiers, each at the batch its cache
    lets fit."""
    layers, hidden, hq, hkv, d, inter, vocab = 36, 2560, 32, 8, 128, 9728, 151936
    ctx = 100_000
    weights = 8.05e9  # bytes of the bf16 checkpoint
    memory = 0.9 * 141e9 - weights - 4e9  # utilization 0.9, 4 GB activations/workspace
    per_request = {"bf16": layers * hkv * ctx * d * 2 * 2}
    for name, plan in PLANS.items():
        fmt = fmt_for(d, plan=plan)
        per_request[name] = layers * hkv * (ctx * fmt.bytes_per_token + fmt.state_blocks * fmt.block_bytes)
    batches = {name: int(memory // b) for name, b in per_request.items()}
    shapes = [(hidden, (hq + 2 * hkv) * d), (hq * d, hidden), (hidden, 2 * inter), (inter, hidden)]
    res = {"context": ctx, "batch": batches, "bytes_per_request": per_request}
    for name, b in batches.items():
        if name == "bf16":
            best = best_bf16_decode(hq, hkv, d, b, ctx, gen)
            attn, store, store_graph, how = best["ms"], 0.0, 0.0, best["best"]
        else:
            attn = time_decode(fmt_for(d, plan=PLANS[name]), hq, hkv, b, ctx, sms, gen)
            timed = bench_store_decode(b, hkv, d, gen, plan=PLANS[name])
            store, store_graph, how = timed["ms"], timed["graph_ms"], "Triton"
        lin = gemm_ms(b, shapes, gen)
        head = gemm_ms(b, [(hidden, vocab)], gen)
        step = layers * (attn + store + lin) + head
        res[name] = {"attention_ms_per_layer": attn, "attention": how, "store_ms_per_layer": store,
                     "store_graph_ms_per_layer": store_graph, "linear_ms_per_layer": lin,
                     "lm_head_ms": head, "step_ms": step, "tokens_per_s": b / step * 1e3}
    res["speedup"] = {name: res[name]["tokens_per_s"] / res["bf16"]["tokens_per_s"] for name in PLANS}
    return res


def bench_store_decode(batch: int, hkv: int, d: int, gen, launch: dict | None = None,
                       plan: str | None = None) -> dict:
    """The decode step's store (one token per request, rotated), as serving
    calls it: ms per call, and ms per replay of a CUDA graph of it (the
    serving job's decode batches replay full graphs); at the decode default
    launch unless ``launch`` is given."""
    fmt = fmt_for(d, plan=plan)
    cache, table = make_cache(fmt, batch, 1024, hkv, gen)
    k = torch.randn(batch, hkv, d, device=DEV, generator=gen).to(torch.bfloat16)
    v = torch.randn(batch, hkv, d, device=DEV, generator=gen).to(torch.bfloat16)
    rot = rotation_parts(torch.linalg.qr(torch.randn(hkv, d, d, device=DEV, generator=gen))[0])
    seq = torch.full((batch,), 1024, dtype=torch.int32, device=DEV)
    step = lambda: store_decode_tokens(cache, fmt, k, v, rot, seq, table, 0.96, 0.92, launch=launch)  # noqa: E731
    return {"batch": batch, "launch": launch or default_store_launch(d, decode=True), "default": launch is None,
            "ms": do_bench(step, warmup=10, rep=50), "graph_ms": do_bench_cudagraph(step, rep=50)}


def time_decode(fmt: OscarFormat, hq: int, hkv: int, batch: int, ctx: int, sms: int, gen, launch=None) -> float:
    """ms of one decode step of ``batch`` requests of ``ctx`` tokens."""
    cache, table, q, seq, out = decode_inputs(fmt, batch, ctx, hq, hkv, gen)
    splits = num_splits(batch, hkv, ctx, sms, fmt.block_size)
    zero = fills(fmt, hkv, gen)
    ms = do_bench(lambda: decode_attention(q, cache, fmt, table, seq, fmt.head_size ** -0.5, splits, out, launch,
                                           zero), warmup=10, rep=100)
    del cache, table
    torch.cuda.empty_cache()
    return ms


SPLIT_CASES = [(32, 100_000, [8, 12, 16, 17, 20, 24, 28, 32, 33, 40, 48, 64]), (32, 32768, [8, 16, 17, 24, 32, 33, 48]),
               (8, 100_000, [33, 48, 64, 66, 80, 128]), (1, 100_000, [64, 128, 195, 256])]


def bench_splits(sms: int, gen) -> list[dict]:
    """Decode at 32/8/128 against the INT2 split count: whole waves of
    resident programs against one program more (:func:`num_splits`)."""
    fmt = fmt_for(128)
    rows = []
    for b, ctx, counts in SPLIT_CASES:
        cache, table, q, seq, out = decode_inputs(fmt, b, ctx, 32, 8, gen)
        for s in counts:
            ms = do_bench(lambda: decode_attention(q, cache, fmt, table, seq, 0.088, s, out),
                          warmup=10, rep=100)
            rows.append({"batch": b, "context": ctx, "splits": s, "default": num_splits(b, 8, ctx, sms), "ms": ms,
                         "gbps": oscar_bytes(fmt, b, ctx, 8, 32) / ms / 1e6})
            print(json.dumps(rows[-1]), flush=True)
        del cache, table
        torch.cuda.empty_cache()
    return rows


# A hybrid model's attention blocks are sized by its state pages: vLLM gave 464 tokens to the dense
# Qwen3.5-style hybrid of scripts/cuda_state_check.py, 400 to house-qwen3next.
HYBRID_BLOCKS = [128, 464, 400]


def bench_hybrid_blocks(sms: int, gen, batch: int = 32, ctx: int = 32768) -> list[dict]:
    """Decode and extend at 32/8/128 at blocks of HYBRID_BLOCKS: the default
    launch (a partial last step a page where its step does not divide the
    block) against 16-token steps, which divide every block here. Decode:
    ``batch`` requests of ``ctx`` tokens; extend: one 512-token chunk after
    ``ctx`` tokens."""
    rows = []
    for kb in HYBRID_BLOCKS:
        fmt = fmt_for(128, kb)
        nbytes = oscar_bytes(fmt, batch, ctx, 8, 32)
        for name, lc in (("default", None), ("16-token steps", {"tile": 16})):
            ms = time_decode(fmt, 32, 8, batch, ctx, sms, gen, lc)
            rows.append({"op": "decode", "block_size": kb, "launch": name, "ms": ms, "gbps": nbytes / ms / 1e6})
            print(json.dumps(rows[-1]), flush=True)
        for name, ms in zip(("default", "16-token steps"),
                            time_extend(fmt, 32, 8, ctx, 512, gen, [None, {"block_n": 16}])):
            rows.append({"op": "extend", "block_size": kb, "launch": name, "ms": ms})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def default_launches() -> dict:
    """The decode kernel's default launch per shape and page format, as the
    decode table's run records it (the launch depends on the format)."""
    return {f"{hq}/{hkv}/{d}": {name: default_launch(hq // hkv, d, fmt_for(d, plan=plan))
                                for name, plan in PLANS.items()} for hq, hkv, d in SHAPES}


def launch_text(res: dict) -> str:
    return "; ".join(f"{shape}: " + ", ".join(f"{lc} ({name})" for name, lc in by_plan.items())
                     for shape, by_plan in res["launches"].items())


def launch_sweep_lines(res: dict) -> list[str]:
    """The default launch among the others, timed in the decode table's run."""
    rows = res.get("launch_sweep", [])
    if not rows:
        return []
    cells = []
    for hq in sorted({r["hq"] for r in rows}):
        default = res["launches"][f"{hq}/8/128"]["OSCAR INT2"]
        for lc in LAUNCHES:
            ms = {r["batch"]: r["ms"] for r in rows if r["hq"] == hq and all(r[k] == v for k, v in lc.items())}
            mark = " *" if all(default[k] == v for k, v in lc.items()) else ""
            cells.append([hq, f"{lc['num_warps']}/{lc['num_stages']}/{lc['tile']}{mark}",
                          f"{ms.get(32, float('nan')):.3f}", f"{ms.get(1, float('nan')):.3f}"])
    return ["", "Other launches in the same run (100K tokens; `*` the default, which the table above uses):", "",
            *table(["Hq", "warps/stages/tile", "batch 32 ms", "batch 1 ms"], cells)]


BF16_NAMES = ["sdpa cudnn", "sdpa efficient", "sdpa flash", "vllm TRITON_ATTN"]


def gbps(x: dict, bw: float) -> str:
    """A timing's bandwidth and its share of the read bandwidth."""
    return f"{x['gbps']:.0f} ({100 * x['gbps'] / bw:.0f}%)"


def run_stamp(bw: float) -> dict:
    """What a section kept from its own run says about that run."""
    return {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(0), "read_bandwidth_gbps": bw}


def own_run(section: dict) -> str:
    return f"{section['date']} on {section['device']}, read bandwidth {section['read_bandwidth_gbps']:.0f} GB/s"


def render(res: dict) -> str:
    bw = res["read_bandwidth_gbps"]
    shape = lambda r: f"{r['hq']}/{r['hkv']}/{r['d']}"  # noqa: E731
    lines = [
        "# OSCAR kernels on the GPU",
        "",
        f"Measured by `python -m benchmarks.oscar_kernels` on {res['device']} ({res['date']}).",
        f"Device read bandwidth measured in the same run (a 4 GiB reduction): **{bw:.0f} GB/s**.",
        "",
        "## Decode attention (one query token per request, per layer)",
        "",
        f"OSCAR: split-KV decode of the quantized pages + BF16 sink/window + LSE merge (KB=128, S0=64, W=256),"
        f" OSCAR INT2 (72 B per token and head) and the 80-byte tiers (`{res['plans']['tiers 80 B']}`"
        + ("" if res["plans"] == PLANS else f"; today's default is `{PLANS['tiers 80 B']}`, not yet timed")
        + "), at the kernel's"
        f" default launch per Hq/Hkv/D ({launch_text(res)}), what serving ran then."
        " BF16: the fastest decode in the same run over dense BF16 K/V, among torch SDPA under each backend that runs (cuDNN, efficient, flash; with"
        " `enable_gqa`) and vLLM's TRITON_ATTN kernel (`unified_attention` on paged BF16 K/V, launched as its"
        " metadata builder does); the winner is named. Bandwidth = bytes each really reads / time. Rows of a few"
        " tens of microseconds (batch 1 and 8) move by up to 2x between runs.",
        "",
    ]
    rows = []
    for r in res["decode"]:
        a, t = r["OSCAR INT2"], r["tiers 80 B"]
        rows.append([shape(r), r["batch"], f"{r['context']:,}", f"{a['ms']:.3f} ({gbps(a, bw).replace(' (', ', ')}",
                     f"{t['ms']:.3f} ({gbps(t, bw).replace(' (', ', ')}", f"{t['ms'] / a['ms']:.2f}",
                     f"{r['bf16_ms']:.3f} ({r['bf16']['best']})", f"{a['speedup']:.2f}x", f"{t['speedup']:.2f}x"])
    lines += table(["Hq/Hkv/D", "batch", "context", "INT2 ms (GB/s, % of read bw)", "tiers ms (GB/s, %)",
                    "tiers / INT2", "best BF16 ms (which)", "INT2 speed-up", "tiers speed-up"], rows)
    lines += ["", "Every BF16 decode timed (ms; `not run` with the reason where a backend refused):", ""]
    lines += table(["Hq/Hkv/D", "batch", "context", *BF16_NAMES],
                   [[shape(r), r["batch"], f"{r['context']:,}",
                     *(f"{c:.3f}" if isinstance(c, float) else c for c in (r["bf16"]["times"].get(n, "-")
                                                                           for n in BF16_NAMES))]
                    for r in res["decode"]])
    lines += launch_sweep_lines(res)
    if "hybrid_blocks" in res:
        hb = res["hybrid_blocks"]
        lines += ["", f"Decode at a hybrid model's block sizes (32/8/128, batch 32, 32K tokens; vLLM sizes a hybrid's"
                  " attention blocks to its state pages): the default launch, whose last step a page is partial"
                  " and masked where its step does not divide the block, against 16-token steps. Its own run"
                  f" ({own_run(hb)}).", ""]
        lines += table(["block", "launch", "ms", "GB/s (% of read bw)"],
                       [[r["block_size"], r["launch"], f"{r['ms']:.3f}", gbps(r, hb["read_bandwidth_gbps"])]
                        for r in hb["rows"] if r.get("op", "decode") == "decode"])
        ext = [r for r in hb["rows"] if r.get("op") == "extend"]
        if ext:
            lines += ["", "Extend at the same blocks (one 512-token chunk after 32K tokens): INT2 history in the"
                      " default 64-token tiles, a page's last one partial where 64 does not divide the block,"
                      " against 16-token tiles.", ""]
            lines += table(["block", "launch", "ms"], [[r["block_size"], r["launch"], f"{r['ms']:.3f}"] for r in ext])
    if "splits" in res:
        sp = res["splits"]
        lines += ["", f"Decode against the INT2 split count (32/8/128; its own run, {own_run(sp)}). An SM holds 11"
                  " one-warp programs at the default launch (168 registers, 19 KB of shared memory each); the default count (`num_splits`, marked) puts at"
                  " most 32 INT2 programs on an SM, about three waves.", ""]
        lines += table(["batch", "context", "splits", "ms", "GB/s (% of read bw)"],
                       [[r["batch"], f"{r['context']:,}", f"{r['splits']}{' (default)' if r['splits'] == r['default'] else ''}",
                         f"{r['ms']:.3f}", gbps(r, sp["read_bandwidth_gbps"])] for r in sp["rows"]])
    s = res["store"]
    lines += [
        "",
        "## Write path",
        "",
        f"Fused store of {s['tokens']:,} new tokens x {s['hkv']} KV heads (one prefill chunk): read K/V BF16,"
        " write the quantized pages (+ BF16 sink/window rows)"
        + f"; the kernel's default launch {s['launch']} (what serving runs)"
        + f" ({s['date']}, read bandwidth {s['read_bandwidth_gbps']:.0f} GB/s).",
        "",
    ]
    rows = [[plan, name, f"{row[name]['ms']:.3f}", gbps(row[name], s["read_bandwidth_gbps"])]
            for plan, row in [("OSCAR INT2", s)] + list(s.get("tiers", {}).items())
            for name in ("store_rotated", "store_unrotated")]
    rows.append(["-", "bf16_cache_copy", f"{s['bf16_cache_copy']['ms']:.3f}",
                 gbps(s["bf16_cache_copy"], s["read_bandwidth_gbps"])])
    lines += table(["pages", "kernel", "ms", "GB/s (% of read bw)"], rows)
    if s.get("sweep"):
        lines += ["", "Other launches in the same run (ms):", ""]
        lines += table(["launch", "rotated", "unrotated"],
                       [[r["launch"], f"{r['store_rotated']['ms']:.3f}", f"{r['store_unrotated']['ms']:.3f}"]
                        for r in s["sweep"]])
    if s.get("decode"):
        lines += ["", "A decode step's store (one rotated token per request, 8 KV heads), per call and per replay"
                  " of a CUDA graph of it; the decode default launch is marked:", ""]
        lines += table(["batch", "launch", "ms per call", "ms per graph replay"],
                       [[r["batch"], f"{r['launch']}{' (default)' if r['default'] else ''}", f"{r['ms']:.4f}",
                         f"{r['graph_ms']:.4f}"] for r in s["decode"]])
    if "extend" in res:
        lines += [
            "",
            "## Extend (a prefill chunk over INT2 + BF16 history)",
            "",
            "One request's chunk of new tokens after a history of `context` tokens: OSCAR's extend kernel (INT2"
            " history, BF16 sink/window and chunk; best launch of a sweep in the same run) against torch SDPA"
            " (flash) over the same keys in BF16, not causal inside the chunk (a few percent more work for it)."
            f" Its own run ({own_run(res['extend'])}).",
            "",
        ]
        lines += table(["Hq/Hkv/D", "context", "chunk", "OSCAR ms (launch)", "BF16 SDPA ms", "speed-up"],
                       [[shape(r), f"{r['context']:,}", f"{r['chunk']:,}", f"{r['oscar_ms']:.3f} ({r['launch']})",
                         f"{r['bf16_sdpa_ms']:.3f}", f"{r['speedup']:.2f}x"] for r in res["extend"]["rows"]])
    if "projection" in res:
        p = res["projection"]
        lines += [
            "",
            "## Model-level projection: Qwen3-4B, 100K context, one H200's memory",
            "",
            "Batch = requests whose KV fits in one H200's 0.9 x 141 GB minus weights and 4 GB workspace. Step time"
            f" = 36 x (attention + store + the layer's linear layers, each timed above on {res['device']} at that"
            " batch) + lm_head."
            " Norms, RoPE, sampling and scheduling are left out.",
            "",
        ]
        lines += table(["cache", "batch", "attention ms/layer", "store ms/layer", "linear ms/layer", "step ms",
                        "tokens/s"],
                       [[f"{name} ({p[name]['attention']})", p["batch"][name], f"{p[name]['attention_ms_per_layer']:.3f}",
                         f"{p[name]['store_ms_per_layer']:.3f}", f"{p[name]['linear_ms_per_layer']:.3f}",
                         f"{p[name]['step_ms']:.1f}", f"{p[name]['tokens_per_s']:.0f}"] for name in ["bf16", *PLANS]])
        lines += ["", "Projected decode speed-up against the fastest BF16 decode: "
                  + ", ".join(f"{name} **{x:.2f}x**" for name, x in p["speedup"].items()) + "."]
        lines += ["", "The store per call as timed above includes any gap its Python launch leaves; replayed from"
                      " a CUDA graph (as the serving job's decode batches run) it takes "
                      + ", ".join(f"{p[n]['store_graph_ms_per_layer']:.3f} ms ({n})" for n in PLANS)
                      + " per layer. The step above uses the per-call time."]
    for name, section in (("cuda_check", cuda_check_section), ("cuda_graph_check", graph_check_section),
                          ("oscar_vllm_e2e", e2e_section)):
        path = REPO / "benchmarks" / "results" / f"{name}.json"
        if path.exists():
            lines += section(json.loads(path.read_text()))
    return "\n".join(lines) + "\n"


def divergences(x: dict) -> str:
    """``prompt:step (reference margin)`` of every prompt that parts from the reference."""
    steps = [(i, f) for i, f in enumerate(x["first_divergence"]) if f < max(x["first_divergence"])]
    return ", ".join(f"{i}:{f} ({m:.2f})" for (i, f), m in zip(steps, x["ref_margin_at_divergence"])) or "-"


def cuda_check_section(c: dict) -> list[str]:
    lines = [
        "",
        f"## Inside vLLM on {c.get('device', 'the H200')} (`scripts/cuda_check.py`, {c.get('date', 'an earlier run')})",
        "",
        "house-qwen3 (bf16), prompts of code, 32 greedy tokens, OSCAR (sink 64, window 256) against TRITON_ATTN,"
        f" the runs: {', '.join(n for n, r in c.items() if isinstance(r, dict) and 'exact_200_tokens' in r)}"
        " (`hadamard`: Hadamard rotation; `calibrated`: the INT2 artifact; `tiered`: the default 80-byte artifact;"
        " `reference_ops`: the PyTorch ops on CUDA tensors, otherwise the Triton kernels). Divergences are listed"
        " as prompt:step with BF16's own top-1 minus top-2 logprob at that step; |dlogprob| is taken"
        " at BF16's token wherever both runs saw the same context.",
        "",
    ]
    rows = []
    for name, r in c.items():
        if not isinstance(r, dict) or "exact_200_tokens" not in r:
            continue
        for kind, label in (("exact_200_tokens", "200-token prompts (nothing INT2)"),
                            ("int2_1500_tokens", "1500-token prompts (INT2 active)")):
            x = r[kind]
            rows.append([f"{name}, {label}", f"{x['whole_sequences_equal']}/{x['prompts']}", divergences(x),
                         f"{x['dlogprob_mean']:.4f} / {x['dlogprob_max']:.4f}"])
    lines += table(["run", "prompts equal to BF16", "divergences (prompt:step, BF16 margin)",
                    "mean / max abs dlogprob"], rows)
    from scripts.cuda_check import EXACT_RUNS

    runs = [n for n in EXACT_RUNS if n in c]
    exact = c[runs[0]]["exact_200_tokens"]
    lines += ["", f"Exactness criterion: up to BF16's first near tie (top-2 margin < 0.25, found from the BF16 run"
              f" alone) every prompt's tokens must be equal; that covers {exact['tokens_compared']} tokens here."
              f" Result: {', '.join(n + (' equal' if c[n]['exact_200_tokens']['equal_up_to_tie'] == exact['prompts'] else ' NOT equal') for n in runs)}"
              f" (check {'passed' if c['exact_ok'] else 'FAILED'}). Every divergence on the 200-token prompts sits at a"
              " BF16 near tie; on the 1500-token prompts INT2 error moves some clear choices."]
    t = c.get("tiered_triton_vs_reference_long")
    if t:
        lines += ["", f"The tiered artifact through the Triton kernels against the same through the reference ops on"
                  f" the 1500-token prompts: {t['equal_up_to_tie']}/{t['prompts']} prompts equal up to the reference"
                  f" run's first near tie ({t['tokens_compared']} tokens), |dlogprob| mean {t['dlogprob_mean']:.4f},"
                  f" max {t['dlogprob_max']:.4f}."]
    lines += ["", f"KV capacity at gpu_memory_utilization 0.3, max_model_len 4096: BF16 "
              f"{c['bf16']['kv_cache_size_tokens']:,} tokens, OSCAR {c['oscar_hadamard']['kv_cache_size_tokens']:,}"
              f" ({c['oscar_hadamard']['capacity_vs_bf16']:.2f}x; 18 BF16 state blocks per request weigh more at"
              " short max_model_len)."]
    return lines


def graph_check_section(c: dict) -> list[str]:
    o = c["oscar"]
    g = o["graphs"]
    rows = [[kind, f"{o[kind]['whole_sequences_equal']}/{o[kind]['prompts']}",
             "yes" if o[kind]["dlogprob_max"] == 0 else "no", f"{o[kind]['dlogprob_max']:.4f}"]
            for kind in ("short_200", "long_1500") if kind in o]
    run = f"on {c['device']}, {c['date']}" if "device" in c else "the run recorded no device or date"
    return ["", f"## CUDA graphs in vLLM (`scripts/cuda_graph_check.py`; {run})", "",
            f"house-qwen3 with OSCAR (Hadamard) through the Triton kernels, eager against full CUDA graphs for"
            f" decode-only batches (`{c['compilation_config']}`), {c['requests']['short_200']} prompts of 200 tokens"
            f" and {c['requests']['long_1500']} of 1500 (INT2 active), 32 greedy tokens; the request counts are not"
            f" capture sizes, so decode batches are padded. Graphs captured: {g['graphs_captured']}; decode steps"
            f" {g['decode_steps']}, replayed from a graph {g['graph_replays']} ({g['padded_decode_steps']} of them"
            f" padded), OSCAR forwards run eagerly on a decode-only batch: {g['eager_decode_forwards']}.", "",
            *table(["prompts", "sequences equal to eager", "token log-probabilities identical", "max abs dlogprob"],
                   rows),
            *graph_sanity_lines(c), *compiled_lines(c), "", f"Result: {'passed' if c.get('ok') else 'FAILED'}."]


def compiled_lines(c: dict) -> list[str]:
    """OSCAR under vLLM's default compilation (torch.compile, FULL_AND_PIECEWISE), where that mode ran."""
    x = c.get("oscar_compiled")
    if not isinstance(x, dict):
        return []
    if "error" in x:
        return ["", f"OSCAR under vLLM's default (torch.compile, FULL_AND_PIECEWISE): failed ({c['modes']['oscar_compiled'].get('error')})."]
    g = x["graphs"]
    return ["", f"OSCAR under vLLM's default (torch.compile, `{c['modes']['oscar_compiled']['cudagraph_mode']}`) against"
            f" eager: {x['short_200']['whole_sequences_equal']}/{x['short_200']['prompts']} and"
            f" {x['long_1500']['whole_sequences_equal']}/{x['long_1500']['prompts']} sequences equal, equal up to the"
            f" eager run's first near tie: {'yes' if x['ok'] else 'NO'} (max |dlogprob|"
            f" {max(x['short_200']['dlogprob_max'], x['long_1500']['dlogprob_max']):.4f}); decode steps"
            f" {g['decode_steps']}, OSCAR forwards run eagerly on a decode-only batch: {g['eager_decode_forwards']}."]


def graph_sanity_lines(c: dict) -> list[str]:
    """The check's side results: TRITON_ATTN under the same graphs, and OSCAR
    eager against TRITON_ATTN eager where nothing is INT2 yet."""
    lines = []
    b = c.get("bf16")
    if isinstance(b, dict) and "short_200" in b:
        same = b["short_200"]["dlogprob_max"] == b["long_1500"]["dlogprob_max"] == 0
        lines += ["", f"TRITON_ATTN under the same graphs against its eager run:"
                  f" {b['short_200']['whole_sequences_equal']}/{b['short_200']['prompts']} and"
                  f" {b['long_1500']['whole_sequences_equal']}/{b['long_1500']['prompts']} sequences equal"
                  f" (token log-probabilities {'identical' if same else 'not identical'})."]
    x = c.get("oscar_eager_vs_bf16_eager_short_200")
    if x:
        lines += ["", f"OSCAR eager against TRITON_ATTN eager on the 200-token prompts (within sink + window, nothing"
                  f" INT2): {x['whole_sequences_equal']}/{x['prompts']} sequences equal, equal up to each prompt's first"
                  f" near tie ({x['tokens_compared']} tokens): {'yes' if x['equal_up_to_tie'] == x['prompts'] else 'NO'};"
                  f" |dlogprob| mean {x['dlogprob_mean']:.4f}, max {x['dlogprob_max']:.4f}"
                  " (the rotated keys are rounded to bf16 again, and the kernels round operands to fp16)."]
    return lines


STEPQUANT_SECTION = "## STEPQuant state update"  # benchmarks.stepquant_kernels writes it into the same page


def write_page(text: str) -> None:
    """docs/kernels.md: this page, keeping the section benchmarks.stepquant_kernels wrote."""
    path = REPO / "docs" / "kernels.md"
    old = path.read_text() if path.exists() else ""
    if STEPQUANT_SECTION in old:
        text = splice(text, STEPQUANT_SECTION, old[old.index(STEPQUANT_SECTION):])
    path.write_text(text)


def e2e_section(results: dict) -> list[str]:
    from benchmarks.oscar_vllm_e2e import render as render_e2e

    return ["", "## Serving job in vLLM on the GPU (`benchmarks/oscar_vllm_e2e.py`)", "",
            "Random-weight Qwen3-4B shape, same gpu_memory_utilization for both backends of a job (each job names its card), greedy with ignore_eos;"
            " enforce_eager, or where the job says so full CUDA graphs for decode-only batches in both engines"
            " (`compilation_config={\"mode\": 0, \"cudagraph_mode\": \"FULL_DECODE_ONLY\"}`). Decode tok/s counts only"
            " the steps in which every running request decodes and nothing is admitted or prefilled.", "",
            render_e2e(results)] + [f"\nNote: {n}." for n in sorted({job["note"] for job in results.values() if "note" in job})]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one shape, B=32 only")
    ap.add_argument("--first-shape", action="store_true", help="only the first (Hq, Hkv, D), every batch")
    ap.add_argument("--render-only", metavar="JSON")
    ap.add_argument("--sections", nargs="*", default=["decode", "hybrid_blocks", "splits", "store", "extend", "projection"],
                    help="run these; the others are kept from benchmarks/results/oscar_kernels.json")
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", REPO / "benchmarks" / "results"))
    if args.render_only:
        write_page(render(json.loads(Path(args.render_only).read_text())))
        return
    gen = torch.Generator(device=DEV).manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    saved = REPO / "benchmarks" / "results" / "oscar_kernels.json"
    res = json.loads(saved.read_text()) if saved.exists() and set(args.sections) != {
        "decode", "hybrid_blocks", "splits", "store", "extend", "projection"} else {}
    bw = read_bandwidth() / 1e9
    print(f"read bandwidth {bw:.0f} GB/s", flush=True)
    if "decode" in args.sections or "read_bandwidth_gbps" not in res:  # the run the main tables' % refer to
        res.update({"device": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d"),
                    "torch": torch.__version__, "triton": triton.__version__, "sms": sms, "read_bandwidth_gbps": bw})
    out_dir.mkdir(parents=True, exist_ok=True)
    partial = out_dir / "oscar_kernels.partial.json"
    if "decode" in args.sections:
        res["launch_sweep"] = [r for hq, _, _ in SHAPES for r in sweep_launch(hq, sms, gen)]
        print("launches", res["launch_sweep"], flush=True)
        res["decode"], res["plans"], res["launches"] = [], dict(PLANS), default_launches()
        shapes = SHAPES[:1] if args.quick or args.first_shape else SHAPES
        for hq, hkv, d in shapes:
            for b in ([32] if args.quick else BATCHES):
                for ctx in CONTEXTS:
                    r = bench_decode(hq, hkv, d, b, ctx, sms, gen)
                    res["decode"].append(r)
                    print(json.dumps(r), flush=True)
                    partial.write_text(json.dumps(res, indent=2))
    if "hybrid_blocks" in args.sections:
        res["hybrid_blocks"] = {**run_stamp(bw),
                                "rows": bench_hybrid_blocks(sms, gen)}
        partial.write_text(json.dumps(res, indent=2))
    if "splits" in args.sections:
        res["splits"] = {**run_stamp(bw),
                         "rows": bench_splits(sms, gen)}
        partial.write_text(json.dumps(res, indent=2))
    if "store" in args.sections:
        res["store"] = {**bench_store(16384, 8, 128, gen), **run_stamp(bw),
                        "tiers": {name: bench_store(16384, 8, 128, gen, plan) for name, plan in PLANS.items() if plan},
                        "decode": [bench_store_decode(b, 8, 128, gen, launch) for b in (8, 32, 256)
                                   for launch in (None, default_store_launch(128))]}
        print(json.dumps(res["store"]), flush=True)
        partial.write_text(json.dumps(res, indent=2))
    if "extend" in args.sections:
        res["extend"] = {**run_stamp(bw), "rows": [bench_extend(hq, hkv, 128, ctx, 4096, gen) for hq, hkv, _ in SHAPES
                                                    for ctx in (8192, 32768)]}
        print(json.dumps(res["extend"]), flush=True)
        partial.write_text(json.dumps(res, indent=2))
    if "projection" in args.sections:
        res["projection"] = project_qwen3_4b(sms, gen)
        print(json.dumps(res["projection"]), flush=True)
    (out_dir / "oscar_kernels.json").write_text(json.dumps(res, indent=2))
    (out_dir / "kernels.md").write_text(render(res))
    partial.unlink(missing_ok=True)
    print(render(res))


if __name__ == "__main__":
    main()
