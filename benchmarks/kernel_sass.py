"""Registers, spills and SASS instruction counts of the Triton kernels for the
H200 (sm_90a), compiled here without a GPU.

Device time is scarce; what a kernel costs per element can be read before it
runs: Triton compiles for an explicit target, and its wheel carries ``ptxas``
and ``cuobjdump``. Each kernel is compiled at its serving shape (K = V = 128
state heads; OSCAR's formats at 4 and 12 query heads per KV head) with the
specialisations a real launch gets (16-byte aligned pointers and strides);
the report gives registers, spill bytes, the static SASS count, and the
instructions of each loop body (one trip). Its JSON adds each tier plan's
instructions against OSCAR INT2's (``ratio_to_int2``: a decode trip, the
store per element) and, with ``launches``, the decode kernel at its default
launch over every plan kind, head size 64 / 128 / 256 and group up to 16,
listing any shape that spills (``launch_spills``; printed only if one does).

    python -m benchmarks.kernel_sass [--kernels foreground writeback decode store launches] [--bits 6 4] [--json PATH]

The counts depend on the Triton version: the test extra pins the GPU
machine's (3.6).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import tempfile
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from vllm_kvq.kernels.oscar import triton_decode, triton_store
from vllm_kvq.kernels.oscar.format import LayerTiers, OscarFormat
from vllm_kvq.kernels.stepquant import triton_foreground, triton_step, triton_writeback

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
SASS_LINE = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")
# argument types by name (everything else is an i32 scalar)
POINTERS = {
    "pool": "*u8", "pool16": "*fp16", "idx_ptr": "*i32", "heads_ptr": "*i32", "codes_ptr": "*i32",
    "rows_ptr": "*i32", "cols_ptr": "*i32", "tab_bits": "*i32", "tab_off": "*i32", "tab_rows": "*i32",
    "tab_cols": "*i32", "w_ptr": "*fp32", "q_ptr": "*bf16", "k_ptr": "*bf16",
    "v_ptr": "*bf16", "g_ptr": "*fp32", "beta_ptr": "*fp32", "alog_ptr": "*fp32", "dtb_ptr": "*fp32", "out_ptr": "*fp32", "delta_ptr": "*fp32",
    "part_ptr": "*fp32", "keys_ptr": "*fp32", "decay_ptr": "*fp32", "held_ptr": "*i32", "slots_ptr": "*i32", "bt_ptr": "*i32", "seq_ptr": "*i32", "cache_u8": "*u8", "cache_f16": "*fp16", "cache_i32": "*i32",
    "cache_bf16": "*bf16", "o_ptr": "*fp32", "lse_ptr": "*fp32", "rot_ptr": "*bf16", "k_out_ptr": "*bf16",
    "pos_ptr": "*i32", "req_ptr": "*i32", "end_ptr": "*i32", "slot_ptr": "*i32", "kfill": "*fp32", "vfill": "*fp32",
}
FLOATS = {"q_scale"}
ALIGNED = {"slot_stride", "sqn", "skn", "svn", "stride_qb", "stride_qh", "bt_stride", "stride_kt", "stride_kh",
           "stride_vt", "stride_vh"}


def compile_kernel(fn, constexprs: dict, num_warps: int, num_stages: int = 3, maxnreg: int | None = None) -> dict:
    names = list(inspect.signature(fn.fn).parameters)
    sig = {p: ("constexpr" if p in constexprs else POINTERS.get(p, "fp32" if p in FLOATS else "i32")) for p in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(names) if sig[p].startswith("*") or p in ALIGNED}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages,
                                **({"maxnreg": maxnreg} if maxnreg else {})})
    with tempfile.TemporaryDirectory() as d:
        ptx, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(ptx, "w") as f:
            f.write(k.asm["ptx"])
        for tool in ("ptxas-blackwell", "ptxas"):  # Triton >= 3.7 emits PTX only its newer ptxas reads
            run = subprocess.run([os.path.join(BIN, tool), "-v", "-arch=sm_90a", ptx, "-o", cubin],
                                 capture_output=True, text=True)
            if run.returncode == 0:
                break
        else:
            raise RuntimeError(f"ptxas failed on {fn.__name__}: {run.stderr[-400:]}")
        log = run.stderr
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", cubin], capture_output=True, text=True).stdout
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores", log)
    ins = [(int(m.group(1), 16), m.group(2)) for m in map(SASS_LINE.match, sass.splitlines()) if m]
    loops = []
    for at, text in ins:  # a backward branch closes a loop body
        b = re.search(r"BRA\s+(?:`\()?0x([0-9a-f]+)", text)
        if b and int(b.group(1), 16) < at:
            body = [t for a, t in ins if int(b.group(1), 16) <= a <= at]
            ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split(" ")[0].split(".")[0] for t in body)
            loops.append({"instructions": len(body), "top": dict(ops.most_common(8)),
                          "local_memory_ops": ops["STL"] + ops["LDL"]})  # spill traffic inside the loop
    ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split(" ")[0].split(".")[0] for _, t in ins)
    return {"registers": int(regs.group(1)) if regs else None, "spill_bytes": int(spill.group(1)) if spill else 0,
            "barriers": k.asm["ttir"].count("gpu.barrier"),  # the kernel's own tl.debug_barrier()s
            "sass": len(ins), "top": dict(ops.most_common(10)), "loops": loops}


def stepquant_jobs(bits: list[int], held: int = 0) -> list[tuple[str, object, dict, int, int]]:
    """The split step's kernels for each width; ``held``: records holding
    that many updates (kvq.state_refit_every = held + 1)."""
    lc = triton_step.LAUNCH
    jobs = []
    for b in bits:
        common = dict(BITS=b, K=128, V=128, PART=32 if b == 2 else triton_step.fg_span(), FAST=True, ALIGN=4,
                      ROWWISE=False, T=held, TP=triton.next_power_of_2(max(held, 1)))
        tag = f", {held} held" if held else ""
        jobs.append((f"stepquant foreground, {b}-bit{tag}", triton_foreground.foreground_kernel,
                     dict(common, TILE=lc["fg_tile"], TILES=lc["fg_tiles"], ASM=True, RAW=True),
                     lc["fg_warps"], lc["fg_tile"] * 128 // (32 * lc["fg_warps"])))
        jobs.append((f"stepquant writeback, {b}-bit{tag}", triton_writeback.writeback_kernel,
                     dict(common, TILE=lc["wb_tile"], ASM=True), lc["wb_warps"],
                     lc["wb_tile"] * 128 // (32 * lc["wb_warps"])))
    return jobs


PLANS = {"OSCAR INT2": "k=128x2;v=128x2", "tiers 80 B": "k=48x4,80x2;v=48x4,80x0",
         "tiers 72 B": "k=32x4,96x2;v=16x4,32x2,80x0", "big pieces": "k=64x4,64x2;v=64x2,64x0"}
"""The formats compiled at head size 128: OSCAR INT2, the default tier plan (80 B a
token and head), the 72-byte plan, and a plan of whole 32-byte INT4 and INT2 runs."""
HEAD_PLANS = {
    64: {"OSCAR INT2": "k=64x2;v=64x2", "tiers 80 B": "k=16x4,48x2;v=16x4,48x0",
         "tiers 72 B": "k=16x4,48x2;v=16x4,16x2,32x0", "big pieces": "k=32x4,32x2;v=32x2,32x0"},
    128: PLANS,
    256: {"OSCAR INT2": "k=256x2;v=256x2", "tiers 80 B": "k=96x4,160x2;v=96x4,160x0",
          "tiers 72 B": "k=64x4,192x2;v=32x4,64x2,160x0", "big pieces": "k=128x4,128x2;v=128x2,128x0"},
}
"""The same kinds of plan at the other head sizes the launch check covers."""
TIERED = ("tiers 80 B", "tiers 72 B")
"""The plans whose instructions a trip the report compares with OSCAR INT2's."""


def _format(spec: str, head_size: int = 128) -> OscarFormat:
    return OscarFormat(head_size=head_size, block_size=128, sink=64, window=256, tiers=LayerTiers.parse(spec))


def decode_job(name: str, spec: str, group: int, head_size: int = 128, kv_heads: int = 8) -> tuple:
    """The decode kernel at its default launch for ``group`` query heads per
    KV head; a loop trip is one TILE-token slice: its K and V codes per thread."""
    f = _format(spec, head_size)
    lc = triton_decode.default_launch(group, head_size, f)
    n_bf16 = -(-(f.sink + f.window) // lc["bf16_rows"])
    const = dict(HQ=kv_heads * group, GROUP=group, GP=triton.next_power_of_2(group),
                 KP=triton_decode.row_pieces(f.k.code_bytes, f.k.int4 // 2),
                 VP=triton_decode.row_pieces(f.v.code_bytes, f.v.int4 // 2), K4=f.k.int4, K2=f.k.int2,
                 V4=f.v.int4, V2=f.v.int2, D=head_size, KB=f.block_size, BLOCK_BYTES=f.block_bytes,
                 S=kv_heads * f.block_bytes, SINK=f.sink,
                 WINDOW=f.window, RING=f.ring, STATE_BLOCKS=f.state_blocks, ROWS=f.state_rows_per_block,
                 NUM_BF16=n_bf16, BLOCK_N=lc["bf16_rows"], ASM=True, NSTAGE=lc["num_stages"], TILE=lc["tile"], Q=1,
                 MAXNREG=lc.get("maxnreg"))
    return (f"oscar decode, {name}, D {head_size}, group {group}", triton_decode._decode_kernel, const,
            lc["num_warps"], 2 * lc["tile"] * head_size // (32 * lc["num_warps"]))


def decode_jobs() -> list[tuple]:
    """Qwen3-4B's shape (32 query / 8 KV heads) and a 12-wide group (96 / 8), head size 128."""
    return [decode_job(name, spec, group) for group in (4, 12) for name, spec in PLANS.items()]


def launch_jobs() -> list[tuple]:
    """The decode kernel at its default launch for every plan kind, head size
    64 / 128 / 256 and group up to 16 (groups of 9-16 share one 16-wide tile):
    the report's ``launch_spills`` lists any that spill."""
    return [decode_job(name, spec, group, d) for d, plans in HEAD_PLANS.items() for group in (1, 2, 4, 8, 16)
            for name, spec in plans.items()]


def trip(r: dict) -> int:
    """Instructions of one trip of the decode loop that runs most: the inner
    steps (between the two masked edge loops)."""
    return r["loops"][len(r["loops"]) // 2]["instructions"]


def ratios(kernels: dict) -> dict:
    """Each tiered plan's instructions against OSCAR INT2's at the same job:
    decode per loop trip, store per element with 7 clip rounds."""
    out = {}
    for name, r in kernels.items():
        for plan in TIERED:
            if plan not in name or not r["loops"]:
                continue
            base = kernels.get(name.replace(plan, "OSCAR INT2"))
            if not base or not base["loops"]:
                continue
            if name.startswith("oscar decode"):
                out[name] = round(trip(r) / trip(base), 3)
            else:
                out[name] = round(typical_store(r) / typical_store(base), 3)
    return out


def typical_store(r: dict) -> int:
    """The store's instructions a thread: straight-line code plus 6 more clip rounds."""
    return r["sass"] + 6 * r["loops"][0]["instructions"]


def store_jobs() -> list[tuple]:
    """The write path at its default launch, with and without the K rotation
    (its loop is one round of the clip search: 7 a row in the usual case, after
    the round that checks the octave below the row's maximum)."""
    lc = triton_store.default_launch(128)
    jobs = []
    for name, spec in PLANS.items():
        f = _format(spec)
        for rotate in (True, False):
            const = dict(H=8, D=128, KB=128, S=8 * f.block_bytes, K4=f.k.int4, K2=f.k.int2, V4=f.v.int4, V2=f.v.int2, SINK=64,
                         WINDOW=256, RING=256, STATE_BLOCKS=f.state_blocks, ROWS=f.state_rows_per_block,
                         ROTATE=rotate, ROT_PARTS=3, DATA=True, STATE=True, T=lc["rows"], ASM=True,
                         DECODE=False, SLOTS=False)
            jobs.append((f"oscar store, {name} ({'rotated' if rotate else 'unrotated'} K)",
                         triton_store._store_kernel, const, lc["num_warps"], 2 * 128 * lc["rows"] // (32 * lc["num_warps"])))
    return jobs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", nargs="*", default=["foreground", "writeback", "decode", "store", "launches"],
                    choices=["foreground", "writeback", "decode", "store", "launches"])
    ap.add_argument("--bits", nargs="*", type=int, default=[6, 4])
    ap.add_argument("--json")
    args = ap.parse_args()
    jobs = [j for held in (0, 3) for j in stepquant_jobs(args.bits, held) if j[0].split()[1].rstrip(",") in args.kernels]
    if "decode" in args.kernels:
        jobs += decode_jobs()
    if "store" in args.kernels:
        jobs += store_jobs()
    quiet = set()
    if "launches" in args.kernels:  # printed only where they spill
        quiet = {job[0] for job in launch_jobs()} - {job[0] for job in jobs}
        jobs += [job for job in launch_jobs() if job[0] in quiet]
    report = {"triton": triton.__version__, "target": "sm_90a", "kernels": {}}
    print(f"Triton {triton.__version__}, sm_90a")
    for name, fn, const, warps, per_thread in jobs:
        const = dict(const)
        r = compile_kernel(fn, const, warps, const.get("NSTAGE", 3), const.pop("MAXNREG", None))
        r["num_warps"], r["elements_per_thread"] = warps, per_thread
        report["kernels"][name] = r
        if name in quiet and not r["spill_bytes"]:
            continue
        if r["loops"]:  # per trip: one column tile (writeback), one TILE slice (decode)
            work = "; ".join(f"loop of {lp['instructions']} ({lp['instructions'] / per_thread:.1f} an element)"
                             for lp in r["loops"])
            if name.startswith("oscar store"):
                work += f"; {typical_store(r) / per_thread:.1f} an element with 7 clip rounds"
        else:
            work = f"{r['sass'] / per_thread:.0f} an element"
        print(f"{name}: {r['registers']} registers, {r['spill_bytes']} B spilled, {r['sass']} SASS; {work};"
              f" {per_thread} elements a thread (a trip)")
        print(f"    {r['top']}")
    report["ratio_to_int2"] = ratios(report["kernels"])
    for name, ratio in report["ratio_to_int2"].items():
        print(f"{name}: {ratio:.3f}x OSCAR INT2's instructions ({'a decode trip' if 'decode' in name else 'the store'})")
    if "launches" in args.kernels:
        checked = [n for n in report["kernels"] if n.startswith("oscar decode")]
        report["launch_spills"] = {n: {"bytes": r["spill_bytes"],
                                       "in_loops": sum(lp["local_memory_ops"] for lp in r["loops"])}
                                   for n, r in report["kernels"].items() if n in checked and r["spill_bytes"]}
        print(f"decode at its default launch: {len(report['launch_spills'])} of {len(checked)} shapes spill"
              + "".join(f"\n    {n}: {v['bytes']} B, {v['in_loops']} local loads/stores in its loops"
                        for n, v in report["launch_spills"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
