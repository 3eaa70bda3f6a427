"""The split STEPQuant decode step (Triton: foreground and writeback)
against the reference: each kernel against its PyTorch twin, and the two
together against ``reference.step``.

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``,
set before Triton compiles anything) at small shapes; on a GPU the same tests
run compiled, and ``STEPQUANT_REAL_SHAPES=1`` adds the serving shapes
(K = V = 128, 4 and 48 value heads with @6 and @4 plans). Tests marked for
CUDA run the writeback on a second stream, as vLLM's decode does, eagerly and
captured in a CUDA graph.

Why not byte equality everywhere: the kernels sum ``Sᵀk``, ``Xᵀq``, the row
magnitudes and the refit sums in another order than torch (and the GPU
contracts ``a*b+c`` into FMAs and uses its own ``exp``), so X differs from the
reference's by a few ulps. A code then flips by one level only where the
scaled value sits within those ulps of a rounding boundary, and an fp16 scale
only where it sits within them of an fp16 rounding boundary. The checks:

* out (read from the unquantized X) to ``1e-5`` of its scale;
* the decoded new state equal on all but a small fraction of elements (1%),
  and nowhere further apart than one quantization step of that element (2 r c
  for INT2's odd levels, r c otherwise) plus 2^-9 of its value (a row or
  column scale one fp16 ulp apart); one fp16 ulp for pivots;
* the records byte-equal on all but 0.5% of their bytes.
"""

import os
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from tests.kernels import compiled_without_gpu  # noqa: E402
from vllm_kvq.kernels.stepquant import reference as ref  # noqa: E402
from vllm_kvq.kernels.stepquant.format import PIVOT, StateLayout  # noqa: E402
from benchmarks.stepquant_fp32 import fp32_step_  # noqa: E402
from vllm_kvq.kernels.stepquant.triton_step import (StepPlan, StepScratch, foreground_, step, step_,  # noqa: E402
                                                     writeback_)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
REAL = DEV == "cuda" and bool(os.environ.get("STEPQUANT_REAL_SHAPES"))
# (bits per value head, K, V, batch, key heads)
SMALL = [((2, 4, 6, 8, 16), 32, 32, 3, 5), ((8, 4, 16, 6), 64, 64, 2, 2),
         ((2, 6, 2), 32, 64, 2, 1)]  # INT2 over two column groups: two row factors per key row
REAL_SHAPES = [((4, 6, 6, 8), 128, 128, 8, 2),
               ((6,) * 40 + (4,) * 4 + (8,) * 3 + (PIVOT,), 128, 128, 4, 16),
               ((4,) * 38 + (2,) * 6 + (6,) * 2 + (8,) + (PIVOT,), 128, 128, 4, 16)]
SHAPES = SMALL + (REAL_SHAPES if REAL else [])


def _ids(s):
    return f"H{len(s[0])}-K{s[1]}-V{s[2]}"


def _inputs(bits, kd, vd, n, hk, seed=0, zero_state=False, fit="stepquant"):
    gen = torch.Generator().manual_seed(seed)
    h = len(bits)
    lay = StateLayout(bits, kd, vd)
    w = torch.exp(torch.randn(h, kd, generator=gen) * 0.4)
    w = w / w.log().mean(-1, keepdim=True).exp()
    rows = torch.rand(1, h, kd, 1, generator=gen) * 3 + 0.05
    cols = torch.rand(1, h, 1, vd, generator=gen) * 2 + 0.05
    x = torch.randn(n, h, kd, vd, generator=gen) * rows * cols
    rec = torch.zeros(n, lay.size, dtype=torch.uint8) if zero_state else ref.encode(x, lay, w, fit)
    q = torch.nn.functional.normalize(torch.randn(n, hk, kd, generator=gen), dim=-1) * kd**-0.5
    k = torch.nn.functional.normalize(torch.randn(n, hk, kd, generator=gen), dim=-1)
    v = torch.randn(n, h, vd, generator=gen) * 2
    g = -torch.rand(n, h, generator=gen) * 0.2
    beta = torch.rand(n, h, generator=gen)
    return lay, w, rec, q, k, v, g, beta


def _expand(t, h):
    return t.repeat_interleave(h // t.shape[1], dim=1)


def _steps(lay, rec):
    """Per-element quantization step of the states in ``rec`` (0 for pivots)."""
    n, kd, vd = rec.shape[0], lay.k_dim, lay.v_dim
    out = torch.zeros(n, len(lay.bits), kd, vd)
    for i, s in enumerate(lay.heads):
        if s.bits == PIVOT:
            continue
        r = rec[:, s.rows : s.rows + 2 * kd * s.row_groups].contiguous().view(torch.float16).float()
        r = r.view(n, kd, s.row_groups).repeat_interleave(vd // s.row_groups, -1)
        c = rec[:, s.cols : s.cols + 2 * vd].contiguous().view(torch.float16).float().view(n, 1, vd)
        out[:, i] = r * c * (2 if s.bits == 2 else 1)
    return out


def assert_close_step(lay, want, got, max_frac=0.01, max_byte_frac=0.005):
    (o_want, r_want), (o_got, r_got) = want, got
    o_got = o_got.cpu()
    scale = o_want.abs().max().item() + 1e-6
    assert (o_got - o_want).abs().max().item() <= 1e-5 * scale
    assert_close_records(lay, r_want, r_got, max_frac, max_byte_frac)


def assert_close_records(lay, r_want, r_got, max_frac=0.01, max_byte_frac=0.005):
    r_got = r_got.cpu()
    d_want, d_got = ref.decode(r_want, lay), ref.decode(r_got, lay)
    diff = (d_got - d_want).abs()
    step_size = torch.maximum(_steps(lay, r_want), _steps(lay, r_got))
    pivot = torch.tensor([b == PIVOT for b in lay.bits]).view(1, -1, 1, 1)
    # one step, plus the value times fp16 rounding of r and c when a scale differs by an ulp; pivots:
    # one fp16 ulp, which below fp16's smallest normal (2^-14) is 2^-24, not 2^-10 of the value
    pivot_ulp = (d_want.abs() * 2**-10).clamp_min(2**-24)
    bound = torch.where(pivot, pivot_ulp, step_size + d_want.abs().maximum(d_got.abs()) * 2**-9)
    bound = bound + 1e-30
    assert bool((diff <= bound).all()), float((diff / bound).max())
    assert (diff > 1e-6 * d_want.abs() + 1e-30).float().mean().item() <= max_frac
    assert (r_got != r_want).float().mean().item() <= max_byte_frac


@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
def test_step_matches_reference(shape, fast):
    bits, kd, vd, n, hk = shape
    lay, w, rec, q, k, v, g, beta = _inputs(bits, kd, vd, n, hk)
    h = len(bits)
    want = ref.step(rec, lay, w, _expand(q, h), _expand(k, h), v, g, beta)
    dev = [t.to(DEV) for t in (rec, q, k, v, g, beta)]
    got = step(dev[0], lay, w, *dev[1:], fast=fast)
    assert_close_step(lay, want, got)


def test_zero_state_and_per_value_head_qk():
    """A fresh request (all-zero record) with q/k already expanded per value head."""
    bits, kd, vd, n = (16, 2, 8), 32, 32, 2
    lay, w, rec, q, k, v, g, beta = _inputs(bits, kd, vd, n, 3, seed=5, zero_state=True)
    want = ref.step(rec, lay, w, q, k, v, g, beta)
    dev = [t.to(DEV) for t in (rec, q, k, v, g, beta)]
    assert_close_step(lay, want, step(dev[0], lay, w, *dev[1:]))
    # from zero: X = k (β v)ᵀ exactly up to the product's rounding
    x = k.unsqueeze(-1) * (beta.unsqueeze(-1) * v).unsqueeze(-2)
    assert torch.allclose(want[0], (x * q.unsqueeze(-1)).sum(-2), rtol=1e-5, atol=1e-7)


def test_pool_in_place_with_padding_slots():
    """Shuffled slots of a pool; indices below ``min_slot`` read and write nothing."""
    bits, kd, vd, n = (4, 6), 32, 32, 4
    lay, w, rec, q, k, v, g, beta = _inputs(bits, kd, vd, n, 1, seed=7)
    slots = [3, 0, 1, -1]  # 0: vLLM's null slot, -1: padding
    pool = torch.randint(0, 256, (5, lay.size), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    for i, s in enumerate(slots):
        if s > 0:
            pool[s] = rec[i]
    before = pool.clone()
    pool_dev = pool.to(DEV)
    idx = torch.tensor(slots, dtype=torch.int32, device=DEV)
    plan = StepPlan(lay, w, DEV)
    out = step_(pool_dev, idx, plan, *[t.to(DEV) for t in (q, k, v, g, beta)]).cpu()
    live = [i for i, s in enumerate(slots) if s > 0]
    o_want, r_want = ref.step(rec[live], lay, w, _expand(q[live], 2), _expand(k[live], 2), v[live], g[live],
                              beta[live])
    after = pool_dev.cpu()
    assert_close_step(lay, (o_want, r_want), (out[live], after[[slots[i] for i in live]]))
    dead = [i for i, s in enumerate(slots) if s <= 0]
    assert out[dead].abs().max() == 0
    for s in (0, 2, 4):
        assert torch.equal(after[s], before[s])


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
def test_rowwise_fit_matches_reference(fast):
    """The uniform pool's fit (one absmax row scale, unit column scales)."""
    bits, kd, vd, n, hk = (8, 6, 4, 16, 6), 32, 64, 3, 1
    lay, w, rec, q, k, v, g, beta = _inputs(bits, kd, vd, n, hk, seed=9, fit="rowwise")
    h = len(bits)
    want = ref.step(rec, lay, w, _expand(q, h), _expand(k, h), v, g, beta, fit="rowwise")
    dev = [t.to(DEV) for t in (rec, q, k, v, g, beta)]
    assert_close_step(lay, want, step(dev[0], lay, w, *dev[1:], fit="rowwise", fast=fast))
    with pytest.raises(ValueError, match="INT2"):
        StepPlan(StateLayout((2, 4), kd, vd), w[:2], DEV, fit="rowwise")


def _state_cache(lay, num_slots, gen, conv_bytes=96, pad=32):
    """Pages as vLLM binds a GDN layer's state cache: per slot the conv state,
    then the record, then padding up to the page size; returns the pages and
    the records' view ``[slots, size]`` (slot stride = page, not the record)."""
    page = conv_bytes + lay.size + pad
    pages = torch.randint(0, 256, (num_slots, page), dtype=torch.uint8, generator=gen)
    return pages, pages[:, conv_bytes : conv_bytes + lay.size]


@pytest.mark.parametrize("fit", ["stepquant", "rowwise"])
def test_strided_state_cache_with_inactive_slots(fit):
    """Records inside vLLM-like pages (slot stride > record size), slot indices
    read from a column of a block table, some requests padded: active slots
    get the reference step, every other byte of the cache stays as it was."""
    bits = (2, 4, 6, 8, 16) if fit == "stepquant" else (4, 6, 8, 16, 6)
    kd = vd = 32
    slots = [5, 0, 2, -1, 6]  # 0: vLLM's null slot, -1: padding
    n = len(slots)
    lay, w, rec, q, k, v, g, beta = _inputs(bits, kd, vd, n, 5, seed=21, fit=fit)
    gen = torch.Generator().manual_seed(22)
    pages, records = _state_cache(lay, 8, gen)
    for i, s in enumerate(slots):
        if s > 0:
            records[s] = rec[i]
    table = torch.randint(1, 8, (n, 3), dtype=torch.int32, generator=gen)
    table[:, 0] = torch.tensor(slots, dtype=torch.int32)
    before = pages.clone()
    pages_dev = pages.to(DEV)
    conv_bytes = 96
    records_dev = pages_dev[:, conv_bytes : conv_bytes + lay.size]
    assert not records_dev.is_contiguous() and records_dev.stride(0) > lay.size
    out = step_(records_dev, table.to(DEV)[:, 0], StepPlan(lay, w, DEV, fit),
                *[t.to(DEV) for t in (q, k, v, g, beta)]).cpu()
    live = [i for i, s in enumerate(slots) if s > 0]
    want = ref.step(rec[live], lay, w, _expand(q[live], len(bits)), _expand(k[live], len(bits)), v[live], g[live],
                    beta[live], fit=fit)
    after = pages_dev.cpu()
    got_records = after[:, conv_bytes : conv_bytes + lay.size][[slots[i] for i in live]]
    assert_close_step(lay, want, (out[live], got_records))
    assert out[[i for i in range(n) if slots[i] <= 0]].abs().max() == 0
    touched = torch.zeros_like(before, dtype=torch.bool)
    for i in live:
        touched[slots[i], conv_bytes : conv_bytes + lay.size] = True
    assert torch.equal(after[~touched], before[~touched])  # conv bytes, padding, inactive and null slots


def _vllm_decode_inputs(mixed_qkv, a, b, a_log, dt_bias, hk, kd, hv, vd):
    """q, k, v, g, beta as vLLM's packed GDN decode kernel forms them for an
    FP32 state (fused_recurrent_gated_delta_rule_packed_decode), per value head."""
    n = mixed_qkv.shape[0]
    x = mixed_qkv.float()
    q = x[:, : hk * kd].view(n, hk, kd)
    k = x[:, hk * kd : 2 * hk * kd].view(n, hk, kd)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * kd**-0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    v = x[:, 2 * hk * kd :].view(n, hv, vd)
    t = a.float() + dt_bias.float()
    g = -torch.exp(a_log.float()) * torch.where(t <= 20, torch.log(1 + torch.exp(t)), t)
    beta = torch.sigmoid(b.float())
    return _expand(q, hv), _expand(k, hv), v, g, beta


@pytest.mark.parametrize("route", ["decode batch", "mixed batch"])
@pytest.mark.parametrize("fit", ["stepquant", "rowwise"])
def test_cuda_decode_path_matches_staged_step(fit, route, monkeypatch):
    """``state_pool.packed_decode`` (what vLLM's CUDA decode batches run on the
    pool: vLLM's bf16 mixed q/k/v after the conv, raw gates, the layer's bf16
    output), or for a mixed batch vLLM's call of its decode update for the
    rows it peels off, diverted by the GDN seam (q, k, v split as vLLM's
    ``rearrange_mixed_qkv`` does), against the staged path: decode the
    records, vLLM's decode math in fp32, the reference codec's fit."""
    from vllm_kvq.backends.state_pool import LayerPool, decode_plan, packed_decode
    from vllm_kvq.hooks import gdn

    bits = (16, 6, 4, 2) if fit == "stepquant" else (8, 6, 4, 16)
    hk, hv, kd, vd = 2, 4, 32, 32
    slots = [3, 0, 1, 5]
    n = len(slots)
    gen = torch.Generator().manual_seed(31)
    lay, w, rec, *_ = _inputs(bits, kd, vd, n, hk, seed=31, fit=fit)
    mixed = (torch.randn(n, 2 * hk * kd + hv * vd, generator=gen) * 0.7).bfloat16()
    a = torch.randn(n, hv, generator=gen).bfloat16()
    b = torch.randn(n, hv, generator=gen).bfloat16()
    a_log = torch.randn(hv, generator=gen) * 0.5
    dt_bias = torch.randn(hv, generator=gen).bfloat16()
    pages, records = _state_cache(lay, 6, gen)
    for i, s in enumerate(slots):
        if s > 0:
            records[s] = rec[i]
    before = pages.clone()
    pages_dev = pages.to(DEV)
    core_attn_out = torch.zeros(n + 2, hv, vd, dtype=torch.bfloat16, device=DEV)  # the layer's, padded
    idx = torch.tensor(slots, dtype=torch.int32, device=DEV)
    decoder = decode_plan(LayerPool(lay, w, fit, torch.float32), DEV, hk, rows=2)  # the batch grows the scratch
    records_dev = pages_dev[:, 96 : 96 + lay.size]
    mixed_d, a_d, b_d, a_log_d, dt_bias_d = [t.to(DEV) for t in (mixed, a, b, a_log, dt_bias)]
    if route == "decode batch":
        packed_decode(records_dev, idx, decoder, mixed_d, a_d, b_d, a_log_d, dt_bias_d, hk, core_attn_out[:n])
    else:
        def vllms_update(**_):
            raise AssertionError("vLLM's own update ran on the packed records")

        q, k, v = (mixed_d[:, lo:hi].reshape(1, n, -1, d).contiguous()
                   for lo, hi, d in ((0, hk * kd, kd), (hk * kd, 2 * hk * kd, kd), (2 * hk * kd, None, vd)))
        monkeypatch.setattr(gdn, "_DIVERTED",  # as the seam sets it for a mixed batch's forward (restored after)
                            gdn._diverted_decodes(SimpleNamespace(kv_cache=(None, records_dev)), decoder, idx))
        o, final = gdn._divertable(vllms_update)(
            A_log=a_log_d, a=a_d, b=b_d, dt_bias=dt_bias_d, q=q, k=k, v=v, initial_state=None,
            inplace_final_state=True, cu_seqlens=None, ssm_state_indices=None, use_qk_l2norm_in_kernel=True)
        assert gdn._DIVERTED is None and final is None and o.shape == (1, n, hv, vd)  # one call a forward
        core_attn_out[:n] = o[0]
    if DEV == "cuda":  # the writeback ran on its own stream: what a forward's end does
        from vllm_kvq.backends.state_pool import join_writebacks

        join_writebacks()
    live = [i for i, s in enumerate(slots) if s > 0]
    q, k, v, g, beta = _vllm_decode_inputs(mixed[live], a[live], b[live], a_log, dt_bias, hk, kd, hv, vd)
    o_want, r_want = ref.step(rec[live], lay, w, q, k, v, g, beta, fit=fit)
    after = pages_dev.cpu()
    assert_close_records(lay, r_want, after[:, 96 : 96 + lay.size][[slots[i] for i in live]])
    out = core_attn_out.cpu().float()
    assert torch.allclose(out[live], o_want.bfloat16().float(), rtol=2**-7, atol=1e-5 * o_want.abs().max())
    assert out[[i for i in range(n + 2) if i not in live]].abs().max() == 0
    touched = torch.zeros_like(before, dtype=torch.bool)
    for i in live:
        touched[slots[i], 96 : 96 + lay.size] = True
    assert torch.equal(after[~touched], before[~touched])


def test_repeated_steps_stay_on_the_reference_trajectory():
    """Feed each side its own records for a few steps: rare code flips must not compound."""
    bits, kd, vd, n = (2, 6, 16), 32, 32, 2
    lay, w, rec, q, k, v, g, beta = _inputs(bits, kd, vd, n, 3, seed=11)
    gen = torch.Generator().manual_seed(12)
    plan = StepPlan(lay, w, DEV)
    r_ref, r_dev = rec, rec.to(DEV)
    for _ in range(4):
        q = torch.nn.functional.normalize(torch.randn(q.shape, generator=gen), dim=-1) * kd**-0.5
        k = torch.nn.functional.normalize(torch.randn(k.shape, generator=gen), dim=-1)
        v = torch.randn(v.shape, generator=gen)
        o_ref, r_ref = ref.step(r_ref, lay, w, q, k, v, g, beta)
        o_dev, r_dev = step(r_dev, lay, w, *[t.to(DEV) for t in (q, k, v, g, beta)], plan=plan)
        err = (o_dev.cpu() - o_ref).abs().max().item()
        assert err <= 1e-3 * o_ref.abs().max().item()
    step_size = _steps(lay, r_ref)
    assert bool(((ref.decode(r_dev.cpu(), lay) - ref.decode(r_ref, lay)).abs()
                 <= 4 * step_size + 1e-3 * ref.decode(r_ref, lay).abs()).all())


def test_reference_step_is_the_delta_rule():
    """``reference.step`` against a per-head float64 loop of the recurrence."""
    bits, kd, vd, n = (4, 16), 32, 32, 2
    lay, w, rec, q, k, v, g, beta = _inputs(bits, kd, vd, n, 2, seed=3)
    out, new = ref.step(rec, lay, w, q, k, v, g, beta)
    x_hat = ref.decode(rec, lay).double()
    for i in range(n):
        for h in range(len(bits)):
            s = torch.exp(g[i, h].double()) * x_hat[i, h]
            kk, qq = k[i, h].double(), q[i, h].double()
            x = s + beta[i, h].double() * torch.outer(kk, v[i, h].double() - s.T @ kk)
            assert torch.allclose(out[i, h].double(), x.T @ qq, rtol=1e-5, atol=1e-6)
            got = ref.decode(new, lay)[i, h].double()
            want = ref.roundtrip(x.float()[None, None], StateLayout((bits[h],), kd, vd), w[h : h + 1])[0, 0]
            assert torch.allclose(got, want.double(), rtol=1e-3, atol=1e-5)


def test_fp32_baseline_kernel():
    n, h, hk, kd, vd = 3, 4, 2, 32, 64
    gen = torch.Generator().manual_seed(2)
    state = torch.randn(n + 1, h, kd, vd, generator=gen)
    q = torch.nn.functional.normalize(torch.randn(n, hk, kd, generator=gen), dim=-1) * kd**-0.5
    k = torch.nn.functional.normalize(torch.randn(n, hk, kd, generator=gen), dim=-1)
    v, g, beta = torch.randn(n, h, vd, generator=gen), -torch.rand(n, h, generator=gen), torch.rand(n, h, generator=gen)
    idx = torch.tensor([1, 3, 2], dtype=torch.int32)
    s = torch.exp(g)[..., None, None] * state[idx.long()]
    ke, qe = _expand(k, h), _expand(q, h)
    x = s + ke.unsqueeze(-1) * (beta.unsqueeze(-1) * (v - (s * ke.unsqueeze(-1)).sum(-2))).unsqueeze(-2)
    dev_state = state.to(DEV)
    out = fp32_step_(dev_state, idx.to(DEV), *[t.to(DEV) for t in (q, k, v, g, beta)]).cpu()
    assert torch.allclose(out, (x * qe.unsqueeze(-1)).sum(-2), rtol=1e-5, atol=1e-6)
    assert torch.allclose(dev_state.cpu()[idx.long()], x, rtol=1e-5, atol=1e-6)
    assert torch.equal(dev_state.cpu()[0], state[0])


def _scratch_from_twin(plan, key_heads, n, slots, k, g, delta, parts):
    """A scratch holding what the reference foreground produced."""
    s = StepScratch(plan, key_heads, n, DEV, span=plan.layout.v_dim)
    s.slots.copy_(torch.as_tensor(slots, dtype=torch.int32))
    s.delta.copy_(delta)
    s.parts.copy_(parts)
    s.keys.copy_(k)
    s.decay.copy_(torch.exp(g))
    return s


@pytest.mark.parametrize("fit", ["stepquant", "rowwise"])
def test_foreground_matches_its_twin(fit):
    """The foreground alone: the readout, δ and row partials of the twin, the
    slot, keys and decay saved, the records not touched."""
    bits = (2, 16, 4, 6, 8) if fit == "stepquant" else (16, 4, 6, 8, 6)
    kd, vd, n, hk = 32, 64, 3, 5
    lay, w, rec, q, k, v, g, beta = _inputs(bits, kd, vd, n, hk, seed=4, fit=fit)
    h = len(bits)
    plan = StepPlan(lay, w, DEV, fit)
    pool = rec.clone().to(DEV)
    idx = torch.tensor([2, 0, 1], dtype=torch.int32, device=DEV)
    scratch = StepScratch(plan, hk, n, DEV, span=64)
    assert scratch.part == (32 if 2 in bits else 64)  # rowwise: the two tiles' partials summed in registers
    out = foreground_(pool, idx, plan, scratch, *[t.to(DEV) for t in (q, k, v, g, beta)], min_slot=0,
                      launch={"fg_tile": 32, "fg_tiles": 2})
    assert torch.equal(pool.cpu(), rec)
    sel = idx.long().cpu()
    o_want, d_want, p_want = ref.foreground(rec[sel], lay, _expand(q, h), _expand(k, h), v, g, beta, fit,
                                            part=scratch.part)
    scale = o_want.abs().max().item()
    assert (out.cpu() - o_want).abs().max().item() <= 1e-5 * scale
    assert torch.allclose(scratch.delta.cpu(), d_want, rtol=1e-5, atol=1e-5 * d_want.abs().max().item())
    # INT2 heads keep a row's sums per 32 columns; the others only their total counts (one program's sum)
    got_parts = scratch.parts.cpu()
    int2 = [i for i, b in enumerate(bits) if b == 2]
    rest = [i for i, b in enumerate(bits) if b != 2]
    assert torch.allclose(got_parts[:, int2], p_want[:, int2], rtol=1e-5, atol=1e-6)
    assert torch.allclose(got_parts[:, rest].sum(2), p_want[:, rest].sum(2), rtol=1e-5, atol=1e-6)
    assert torch.equal(scratch.slots.cpu(), sel.int())
    assert torch.equal(scratch.keys.cpu(), k) and torch.allclose(scratch.decay.cpu(), torch.exp(g), rtol=1e-6)


@pytest.mark.parametrize("fit", ["stepquant", "rowwise"])
def test_writeback_matches_its_twin(fit):
    """The writeback alone, fed what the reference foreground produced, in a
    pool with a padding row: the twin's records, every other slot untouched."""
    bits = (6, 2, 16, 8, 4, 2) if fit == "stepquant" else (6, 16, 8, 4)
    kd, vd, n, hk = 32, 64, 3, 2
    lay, w, rec, q, k, v, g, beta = _inputs(bits, kd, vd, n, hk, seed=8, fit=fit)
    h = len(bits)
    ke = _expand(k, h)
    part = StepScratch.part_width(lay, vd)  # 64 without INT2 heads: one partial a row
    _, delta, parts = ref.foreground(rec, lay, _expand(q, h), ke, v, g, beta, fit, part=part)
    want = ref.writeback(rec, lay, w, ke, torch.exp(g), delta, parts, fit)
    pool = torch.randint(0, 256, (5, lay.size), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    slots = [4, -1, 1]  # -1: padding
    for i, s in enumerate(slots):
        if s > 0:
            pool[s] = rec[i]
    before = pool.clone()
    plan = StepPlan(lay, w, DEV, fit)
    scratch = _scratch_from_twin(plan, hk, n, slots, k, g, delta, parts)
    pool_dev = pool.to(DEV)
    writeback_(pool_dev, plan, scratch, n)
    after = pool_dev.cpu()
    live = [0, 2]
    assert_close_records(lay, want[live], after[[4, 1]], max_frac=0.005, max_byte_frac=0.002)
    for s in (0, 2, 3):
        assert torch.equal(after[s], before[s])


def test_foreground_leaves_the_record_and_gives_the_steps_readout():
    """The foreground on its own (the part on the critical path, timed on its
    own): the record untouched, the readout the whole step's."""
    bits, kd, vd, n = (6, 16), 32, 32, 2
    lay, w, rec, q, k, v, g, beta = _inputs(bits, kd, vd, n, 2, seed=4)
    plan = StepPlan(lay, w, DEV)
    dev = [t.to(DEV) for t in (q, k, v, g, beta)]
    pool = rec.clone().to(DEV)
    idx = torch.arange(n, dtype=torch.int32, device=DEV)
    out = foreground_(pool, idx, plan, StepScratch(plan, 2, n, DEV), *dev, min_slot=0)
    assert torch.equal(pool.cpu(), rec)
    # the same arithmetic up to the readout (two compilations: allow FMA contraction to differ)
    assert torch.allclose(out, step_(pool, idx, plan, *dev, min_slot=0), rtol=1e-5, atol=1e-7)
    assert not torch.equal(pool.cpu(), rec)


@pytest.mark.skipif(DEV != "cuda", reason="streams and CUDA graphs")
def test_two_streams_and_a_cuda_graph_give_the_synchronous_step():
    """vLLM's decode path: foreground on the current stream, writeback on the
    writeback stream, joined at the end of the forward; three layers in a row,
    eagerly and captured in one CUDA graph and replayed, against the same
    kernels run one after the other on one stream (bit for bit)."""
    from vllm_kvq.backends.state_pool import LayerPool, PackedDecoder, decode_plan, join_writebacks, packed_decode

    hk, hv, kd, vd, n = 2, 4, 64, 64, 5
    idx = torch.tensor([3, 1, -1, 6, 2], dtype=torch.int32, device=DEV)
    gen = torch.Generator().manual_seed(41)
    layers, twins, pools = [], [], []
    for i, bits in enumerate([(16, 6, 4, 2), (8, 6, 6, 4), (2, 8, 6, 8)]):
        lay, w, rec, *_ = _inputs(bits, kd, vd, 7, hk, seed=41 + i)
        pool = LayerPool(lay, w, "stepquant", torch.float32)
        layers.append(decode_plan(pool, DEV, hk, rows=n))
        twin = PackedDecoder(pool, DEV, hk, n)
        twin.cuda = False  # the same kernels, one after the other on the current stream
        twins.append(twin)
        pools.append(rec.to(DEV))
    a_log = (torch.randn(hv, generator=gen) * 0.5).to(DEV)
    dt_bias = torch.randn(hv, generator=gen).bfloat16().to(DEV)
    def draw(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).bfloat16().to(DEV)

    steps = [(draw(n, 2 * hk * kd + hv * vd, scale=0.7), draw(n, hv), draw(n, hv)) for _ in range(4)]

    def forward(decoders, records, mixed, a, b, outs, join=True):
        for decoder, rec, out in zip(decoders, records, outs):
            packed_decode(rec, idx, decoder, mixed, a, b, a_log, dt_bias, hk, out)
        if join:
            join_writebacks()

    def check(records, want_records, outs, want_outs):
        torch.cuda.synchronize()
        for r, wr, o, wo in zip(records, want_records, outs, want_outs):
            assert torch.equal(o, wo) and torch.equal(r, wr)

    def zeros():
        return [torch.zeros(n, hv, vd, device=DEV) for _ in layers]

    eager, twin = [p.clone() for p in pools], [p.clone() for p in pools]
    outs, want = zeros(), zeros()
    for mixed, a, b in steps[:2]:  # each layer's second foreground follows its first writeback
        forward(layers, eager, mixed, a, b, outs)
        forward(twins, twin, mixed, a, b, want, join=False)
        check(eager, twin, outs, want)
    graph = torch.cuda.CUDAGraph()
    mixed, a, b = (t.clone() for t in steps[2])
    captured = [p.clone() for p in eager]
    with torch.cuda.graph(graph):
        forward(layers, captured, mixed, a, b, outs)
    for p, e in zip(captured, eager):
        p.copy_(e)
    graph.replay()
    forward(twins, twin, mixed, a, b, want, join=False)
    check(captured, twin, outs, want)
    # an eager step after the capture waits on the layers' own events, not the captured ones
    forward(layers, captured, *steps[3], outs)
    forward(twins, twin, *steps[3], want, join=False)
    check(captured, twin, outs, want)


@pytest.mark.parametrize("shape, fit", [(s, "stepquant") for s in SMALL[:2] + REAL_SHAPES[1:2] * REAL]
                         + [(SMALL[1], "rowwise")], ids=lambda x: x if isinstance(x, str) else _ids(x))
@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
def test_held_updates_match_reference(shape, fit, fast):
    """Records holding up to 3 updates (``tail = 3``): requests at every
    count, so that each step some refit and the others append, four steps
    in a row, each against ``reference.step`` from the same records; the
    STEPQuant fit and the uniform pool's rowwise one."""
    import dataclasses

    bits, kd, vd, _, hk = shape
    n = 4  # one request at each count
    lay0, w, rec0, *_ = _inputs(bits, kd, vd, n, hk, seed=8, fit=fit)
    lay = dataclasses.replace(lay0, tail=3)
    h = len(bits)
    x = ref.decode(rec0, lay0)
    rec = ref.encode(x, lay, w, fit)
    for s in range(lay.tail):  # request r holds r updates
        rows = torch.tensor([r for r in range(n) if r > s])
        _, _, _, q, k, v, g, beta = _inputs(bits, kd, vd, n, hk, seed=40 + s)
        rec[rows] = ref.step(rec[rows], lay, w, *(_expand(t, h)[rows] for t in (q, k)), v[rows], g[rows],
                             beta[rows], fit)[1]
    assert ref._tail_views(rec, lay)[0].tolist() == list(range(n))
    for s in range(4):
        _, _, _, q, k, v, g, beta = _inputs(bits, kd, vd, n, hk, seed=50 + s)
        want = ref.step(rec, lay, w, _expand(q, h), _expand(k, h), v, g, beta, fit)
        dev = [t.to(DEV) for t in (rec, q, k, v, g, beta)]
        got = step(dev[0], lay, w, *dev[1:], fit=fit, fast=fast)
        assert_close_step(lay, want, got)
        assert ref._tail_views(got[1].cpu(), lay)[0].tolist() == [(r + s + 1) % (lay.tail + 1) for r in range(n)]
        rec = want[1]


HELD_COMPILE = """
import json
from benchmarks.kernel_sass import compile_kernel, stepquant_jobs
from vllm_kvq.kernels.stepquant.triton_kda import kda_writeback_kernel
out = {}
for held in (0, 3):
    for label, fn, const, warps, _ in stepquant_jobs([2, 6, 16], held):
        k = compile_kernel(fn, const, warps)
        out[label] = [k["spill_bytes"], k["barriers"]]
k = compile_kernel(kda_writeback_kernel, dict(K=128, V=128, TILE=16, ALIGN=4), 8)
out["kda writeback"] = [k["spill_bytes"], k["barriers"]]
print(json.dumps(out))
"""


def test_step_kernels_compile_for_the_gpu_with_and_without_held_updates():
    """Foreground and writeback at K = V = 128 for INT2, 6-bit and pivot heads,
    without held updates and with 3, compiled for sm_90a (no GPU needed; the
    interpreter runs Python, not what the compiler takes): no error, no spill.
    The writeback keeps its barriers between reading old scales and storing
    new ones (a race between warps that only compiled kernels have, so the
    interpreter's tests cannot see it): one before the row factors (not in
    pivots, which have none) and one a column tile, one more with held
    updates. The KDA writeback (its launch: 16-column tiles, 8 warps) keeps
    its two, before the row factors and a column tile. In a process of its
    own: this module runs Triton's interpreter."""
    got = compiled_without_gpu(HELD_COMPILE)
    assert len(got) == 13 and not any(spill for spill, _ in got.values()), got
    for label, (_, barriers) in got.items():
        if "writeback" in label:
            want = 2 if label == "kda writeback" else (0 if "16-bit" in label else 2) + ("held" in label)
            assert barriers == want, (label, barriers)
