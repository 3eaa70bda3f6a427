"""The STEPQuant decode step on packed records, split in two where the
readout no longer depends on the fit (docs/stepquant.md, "Decode on CUDA: the
split step", gives the kernels, the streams and the hazards):

* :func:`foreground_` (``triton_foreground.py``), what the layer waits for:
  the readout of the unquantized X; the record is only read, and what the
  writeback needs goes to a per-layer :class:`StepScratch`.
* :func:`writeback_` (``triton_writeback.py``), which may run on another
  stream once the foreground is done: the fit and the repack in place.

Records live in a pool ``[slots, size]`` of uint8 whose slot stride may exceed
the record (vLLM's hybrid page); requests whose slot is below ``min_slot``
(vLLM's padding and null slot 0) get a zero output and touch nothing. No host
sync, fixed grids, no allocation given a scratch: CUDA-graph safe.
``fast=True`` multiplies by reciprocals and uses the hardware sqrt/divide;
``fast=False`` keeps the reference's correctly rounded divisions. Either way
codes differ from the reference's only within an ulp or two of a rounding
boundary; the tests bound that.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton

from vllm_kvq.kernels.stepquant.format import FITS, INT2_GROUP, StateLayout
from vllm_kvq.kernels.stepquant.triton_foreground import foreground_kernel
from vllm_kvq.kernels.stepquant.triton_writeback import writeback_kernel

LAUNCH = {"fg_tile": 32, "fg_tiles": 4, "fg_warps": 4, "wb_tile": 32, "wb_warps": 4}
"""fg: value columns a tile, tiles a program (the row partials of a program's
tiles are summed in registers), warps; wb: columns a tile, warps."""


def fg_span(launch: dict | None = None) -> int:
    """Value columns one foreground program covers (a multiple of 32)."""
    lc = {**LAUNCH, **(launch or {})}
    return lc["fg_tile"] * lc["fg_tiles"]


@dataclass
class _Group:
    bits: int
    heads: torch.Tensor
    codes: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor


def shape_error(k: int, v: int) -> str | None:
    """Why the step cannot take heads of K x V, or None."""
    if k & (k - 1) or v & (v - 1) or min(k, v) < INT2_GROUP:
        return f"the Triton step needs power-of-two K and V >= {INT2_GROUP}, got K={k} V={v}"
    return None


class StepPlan:
    """Device-side head tables of one layer's layout and its fit (``stepquant``
    or ``rowwise``, as in :func:`reference.fit_heads`), built once (not per step)."""

    def __init__(self, layout: StateLayout, impact: torch.Tensor, device: torch.device | str,
                 fit: str = "stepquant"):
        k, v = layout.k_dim, layout.v_dim
        if why := shape_error(k, v):
            raise ValueError(why)
        if fit not in FITS:
            raise ValueError(f"fit must be one of {FITS}, got {fit!r}")
        if fit == "rowwise" and 2 in layout.bits:
            raise ValueError("the rowwise fit has no INT2 form (INT2 keeps one row factor per 32 columns)")
        self.layout = layout
        self.rowwise = fit == "rowwise"
        self.impact = impact.to(device=device, dtype=torch.float32).contiguous()
        slots = layout.heads

        def group(bits: int, ids: list[int]) -> _Group:
            col = lambda f: torch.tensor([f(i) for i in ids], dtype=torch.int32, device=device)  # noqa: E731
            return _Group(bits, col(lambda i: i), col(lambda i: slots[i].codes), col(lambda i: slots[i].rows),
                          col(lambda i: slots[i].cols))

        # widest first: the pivot and 8-bit programs are the longest, start them early
        order = sorted(set(layout.bits), reverse=True)
        self.groups = [group(b, [i for i, x in enumerate(layout.bits) if x == b]) for b in order]


class StepScratch:
    """What one layer's foreground leaves its writeback, per batch row: the
    slot, δ ``[H, V]``, the rows' partials ``[H, V/part, K]``, the keys ``[H_k,
    K]`` and decays ``[H]`` (fp32). One per layer, allocated once, so that no
    two layers' writebacks share (or a CUDA graph's pool reuses) it.
    ``part`` is 32 where INT2 heads need one row factor per 32 columns, else
    the columns of a foreground program (``span``: one partial a program)."""

    def __init__(self, plan: StepPlan, key_heads: int, capacity: int, device, span: int | None = None):
        lay = plan.layout
        h, kd, vd = len(lay.bits), lay.k_dim, lay.v_dim
        if h % key_heads:
            raise ValueError(f"{key_heads} key heads must divide the {h} value heads")
        self.part = self.part_width(lay, span or fg_span())
        self.key_heads, self.capacity = key_heads, capacity
        f32 = dict(dtype=torch.float32, device=device)
        self.slots = torch.zeros(capacity, dtype=torch.int32, device=device)
        self.delta = torch.zeros(capacity, h, vd, **f32)
        self.parts = torch.zeros(capacity, h, vd // self.part, kd, **f32)
        self.keys = torch.zeros(capacity, key_heads, kd, **f32)
        self.decay = torch.zeros(capacity, h, **f32)
        self.held = torch.zeros(capacity, dtype=torch.int32, device=device)  # updates each record held

    @staticmethod
    def part_width(layout: StateLayout, span: int) -> int:
        return INT2_GROUP if 2 in layout.bits else min(span, layout.v_dim)

    @staticmethod
    def bytes_per_request(layout: StateLayout, key_heads: int, span: int | None = None) -> int:
        h, kd, vd = len(layout.bits), layout.k_dim, layout.v_dim
        part = StepScratch.part_width(layout, span or fg_span())
        return 4 * (2 + h * (vd + vd // part * kd + 1) + key_heads * kd)


def _check(pool: torch.Tensor, state_indices: torch.Tensor, plan: StepPlan, n: int) -> None:
    lay = plan.layout
    if (pool.dtype != torch.uint8 or pool.dim() != 2 or pool.shape[1] != lay.size or pool.stride(1) != 1
            or (pool.shape[0] > 1 and pool.stride(0) < lay.size)):
        raise ValueError(f"pool must be uint8 [slots, {lay.size}] with unit stride inside a record, got "
                         f"{tuple(pool.shape)} {pool.dtype} strides {pool.stride()}")
    align = 4 if lay.tail else 2
    if pool.stride(0) % align or pool.storage_offset() % align:
        raise ValueError(f"the pool's slot stride ({pool.stride(0)}) and offset ({pool.storage_offset()}) must be "
                         f"multiples of {align} (records hold fp16 scales, and fp32 and int32 with held updates)")
    if state_indices.dim() != 1 or state_indices.shape[0] < n or state_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"state_indices must be an int32/int64 vector of at least {n} slots, got "
                         f"{tuple(state_indices.shape)} {state_indices.dtype}")


def _asm(pool: torch.Tensor) -> bool:
    """Inline PTX (hardware reciprocals) where the kernels are compiled for a GPU."""
    return pool.is_cuda and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def _head(pool: torch.Tensor) -> tuple:
    return pool, pool.view(torch.float16), pool.stride(0), 4 if pool.stride(0) % 4 == 0 else 2


def foreground_(
    pool: torch.Tensor,
    state_indices: torch.Tensor,
    plan: StepPlan,
    scratch: StepScratch,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    out: torch.Tensor | None = None,
    min_slot: int = 1,
    fast: bool = True,
    launch: dict | None = None,
    raw_gates: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The readout of one decode token per request from the packed pool
    ``[slots, size]`` (only read), and the writeback's inputs into ``scratch``.

    ``pool`` is uint8 with a unit byte stride inside a record and any even
    slot stride (a view into vLLM's hybrid pages is fine); ``state_indices
    [N]`` any integer vector. ``q, k [N, H_k, K]`` (key heads are shared by
    ``H / H_k`` consecutive value heads), ``v [N, H, V]``, ``g, beta [N,
    H]``, any strides with a contiguous last dimension. Returns ``out [N, H,
    V]`` fp32, or writes the given contiguous ``out`` (fp32, bf16 or fp16).
    ``launch``: ``fg_tile`` (value columns a tile), ``fg_tiles`` (tiles a
    program) and ``fg_warps``, default ``LAUNCH``; the scratch's ``part``
    must be the program's columns or divide a tile. ``raw_gates = (A_log,
    dt_bias)``: q, k are vLLM's raw post-conv q and k and g, beta its gate
    inputs a and b, normalised and gated in the kernel as vLLM's decode
    kernel does (no preparation launches).
    """
    lay = plan.layout
    n, h = v.shape[0], len(lay.bits)
    kd, vd = lay.k_dim, lay.v_dim
    _check(pool, state_indices, plan, n)
    if q.shape[1] != k.shape[1] or q.shape[1] != scratch.key_heads:
        raise ValueError(f"q/k heads {q.shape[1]}/{k.shape[1]}: the scratch was made for {scratch.key_heads}")
    if n > scratch.capacity:
        raise ValueError(f"a batch of {n} requests exceeds the step scratch's {scratch.capacity} rows")
    if out is None:
        out = torch.empty(n, h, vd, dtype=torch.float32, device=v.device)
    elif (out.shape != (n, h, vd) or not out.is_contiguous()
          or out.dtype not in (torch.float32, torch.bfloat16, torch.float16)):
        raise ValueError(f"out must be a contiguous float [{n}, {h}, {vd}] tensor, got {tuple(out.shape)} {out.dtype}")
    for t in (q, k, v):
        if t.stride(-1) != 1:
            raise ValueError("q, k, v need a contiguous last dimension")
    lc = {**LAUNCH, **(launch or {})}
    tile = min(lc["fg_tile"], vd)
    tiles = max(1, min(lc["fg_tiles"], vd // tile))
    if tile % scratch.part and scratch.part != tile * tiles:
        raise ValueError(f"the scratch's row partials (one per {scratch.part} columns) fit neither the foreground's "
                         f"tile ({tile}) nor its program ({tile * tiles} columns)")
    if n == 0:
        return out
    pool, pool16, stride, align = _head(pool)
    s = scratch
    a_log, dt_bias = raw_gates if raw_gates is not None else (g, g)  # unused without raw gates
    for grp in plan.groups:
        foreground_kernel[(vd // (tile * tiles), grp.heads.numel(), n)](
            pool, pool16, state_indices, state_indices.stride(0), stride, min_slot,
            grp.heads, grp.codes, grp.rows, grp.cols, q, k, v, g, beta, a_log, dt_bias, out,
            s.slots, s.delta, s.parts, s.keys, s.decay, s.held, lay.tail_offset,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), h, h // q.shape[1],
            BITS=grp.bits, K=kd, V=vd, TILE=tile, TILES=tiles, PART=s.part, FAST=fast, ALIGN=align,
            ROWWISE=plan.rowwise, ASM=_asm(pool), RAW=raw_gates is not None, T=lay.tail,
            TP=triton.next_power_of_2(max(lay.tail, 1)), num_warps=lc["fg_warps"])
    return out


def writeback_(pool: torch.Tensor, plan: StepPlan, scratch: StepScratch, n: int, min_slot: int = 1,
               fast: bool = True, launch: dict | None = None) -> None:
    """Fit and pack the new states of the last :func:`foreground_` on this
    scratch (its first ``n`` rows) into ``pool`` in place. ``launch``:
    ``wb_tile`` (value columns an iteration, at most 32) and ``wb_warps``."""
    lay = plan.layout
    h, kd, vd = len(lay.bits), lay.k_dim, lay.v_dim
    if n == 0:
        return
    lc = {**LAUNCH, **(launch or {})}
    tile = min(lc["wb_tile"], INT2_GROUP, vd)
    pool, pool16, stride, align = _head(pool)
    s = scratch
    for grp in plan.groups:
        writeback_kernel[(grp.heads.numel(), n)](
            pool, pool16, s.slots, stride, min_slot, grp.heads, grp.codes, grp.rows, grp.cols, plan.impact,
            s.delta, s.parts, s.keys, s.decay, s.held, lay.tail_offset, h, h // s.key_heads,
            BITS=grp.bits, K=kd, V=vd, TILE=tile, PART=s.part, FAST=fast, ALIGN=align, ROWWISE=plan.rowwise,
            ASM=_asm(pool), T=lay.tail, TP=triton.next_power_of_2(max(lay.tail, 1)), num_warps=lc["wb_warps"])


def step_(pool, state_indices, plan: StepPlan, q, k, v, g, beta, out=None, min_slot: int = 1, fast: bool = True,
          launch: dict | None = None, scratch: StepScratch | None = None) -> torch.Tensor:
    """:func:`foreground_` then :func:`writeback_` on the current stream: one
    decode token per request on the pool, in place (arguments as theirs)."""
    n = v.shape[0]
    scratch = scratch or StepScratch(plan, q.shape[1], max(n, 1), v.device, fg_span(launch))
    out = foreground_(pool, state_indices, plan, scratch, q, k, v, g, beta, out, min_slot, fast, launch)
    writeback_(pool, plan, scratch, n, min_slot, fast, launch)
    return out


def step(records, layout, impact, q, k, v, g, beta, plan: StepPlan | None = None, fit: str = "stepquant", **kw):
    """Out-of-place twin of :func:`reference.step` on gathered records ``[N, size]``."""
    plan = plan or StepPlan(layout, impact, records.device, fit)
    new = records.clone()
    idx = torch.arange(records.shape[0], dtype=torch.int32, device=records.device)
    out = step_(new, idx, plan, q, k, v, g, beta, min_slot=0, **kw)
    return out, new

