"""STEPQuant's row-unit KDA codec (``kernels/stepquant/kda.py``) against a
loop-by-loop hand computation, its byte layout, and its decode step against
KDA's recurrence; the Triton step (``triton_kda.py``) against it."""

import os

import pytest
import torch

from vllm_kvq.kernels.stepquant import kda

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _states(n, h, k, v, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = torch.rand(1, h, k, 1, generator=g) * 3 + 0.05
    cols = torch.rand(1, h, 1, v, generator=g) * 2 + 0.05
    return torch.randn(n, h, k, v, generator=g) * rows * cols


def _impact(h, k, seed=1):
    g = torch.Generator().manual_seed(seed)
    w = torch.exp(torch.randn(h, k, generator=g) * 0.4)
    return w / w.log().mean(-1, keepdim=True).exp()


def _fit_by_hand(x, widths, w):
    """One head's fit, loop by loop, in float64 (scales rounded to fp16 as stored)."""
    k, v = x.shape

    def f16(t):
        return float(torch.tensor(min(max(t, 2.0**-24), 65504.0)).half())

    ints = [i for i in range(k) if widths[i] != 16]
    qm = {i: 2 ** (widths[i] - 1) - 1 for i in ints}
    nb = {i: 2.0 ** (8 - widths[i]) for i in ints}
    r = {i: f16((max(sum(abs(float(x[i, j])) for j in range(v)) / v, 1e-20) / float(w[i])) ** 0.5) for i in ints}

    def code(y, i):
        return float(max(-qm[i], min(qm[i], round(y))))

    out = torch.zeros(k, v, dtype=torch.float64)
    for j in range(v):
        c = f16(max(abs(float(x[i, j])) / r[i] / (qm[i] * nb[i]) for i in ints))
        q0 = {i: code(float(x[i, j]) / r[i] / (c * nb[i]), i) for i in ints}
        num = sum(float(w[i]) ** 2 * r[i] * nb[i] * q0[i] * float(x[i, j]) for i in ints)
        den = sum(float(w[i]) ** 2 * (r[i] * nb[i] * q0[i]) ** 2 for i in ints)
        if den > 0:
            c = f16(num / den)
        for i in range(k):
            if i in ints:
                out[i, j] = r[i] * c * nb[i] * code(float(x[i, j]) / r[i] / (c * nb[i]), i)
            else:
                out[i, j] = float(torch.tensor(float(x[i, j])).half())
    return out


WIDTHS = (8, 2, 6, 16, 4, 6, 2, 8, 4, 16, 6, 4, 2, 8, 6, 4)


@pytest.mark.parametrize("seed", [0, 1])
def test_fit_matches_a_hand_computation(seed):
    x = _states(1, 1, 16, 32, seed=seed)
    w = _impact(1, 16, seed=seed + 5)
    lay = kda.KdaLayout((WIDTHS,), 16, 32)
    got = kda.decode(kda.encode(x, lay, w), lay)[0, 0].double()
    want = _fit_by_hand(x[0, 0], WIDTHS, w[0])
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-9)
    # the rows really differ in precision: error per row shrinks with its width
    err = ((got - x[0, 0].double()) ** 2).mean(-1) / (x[0, 0].double() ** 2).mean(-1)
    by_width = {b: float(err[[i for i, wd in enumerate(WIDTHS) if wd == b]].mean()) for b in (2, 4, 6, 8, 16)}
    assert by_width[2] > by_width[4] > by_width[6] > by_width[8] > by_width[16]


def test_layout_bytes():
    lay = kda.KdaLayout((WIDTHS, (6,) * 16), 16, 32)
    rows, scales, cols, size = lay.tables
    head0_codes = sum(32 * b // 8 for b in WIDTHS)
    assert scales[0] == head0_codes and cols[0] == head0_codes + 32
    assert rows[1][0] == head0_codes + 32 + 64 and size == rows[1][0] + 16 * 24 + 32 + 64
    # widths grouped in order 2, 4, 6, 8, 16, key order within a width
    order = sorted(range(16), key=lambda i: ((2, 4, 6, 8, 16).index(WIDTHS[i]), i))
    assert [rows[0][i] for i in order] == sorted(rows[0])
    # a pivot row's bytes are its fp16 values; its row factor slot is 0
    x = _states(2, 2, 16, 32, seed=3)
    rec = kda.encode(x, lay, _impact(2, 16))
    at = rows[0][3]
    assert torch.equal(rec[:, at : at + 64].contiguous().view(torch.float16), x[:, 0, 3].half())
    assert rec[:, scales[0] + 6 : scales[0] + 8].abs().max() == 0
    assert kda.decode(torch.zeros(1, size, dtype=torch.uint8), lay).abs().max() == 0
    with pytest.raises(ValueError, match="widths"):
        kda.KdaLayout(((5,) * 16,), 16, 32)


def test_step_is_kdas_recurrence():
    """``kda.step`` against a float64 loop of KDA's per-channel-gated delta rule."""
    n, h, kd, vd = 2, 2, 16, 32
    lay = kda.KdaLayout((WIDTHS, WIDTHS[::-1]), kd, vd)
    w = _impact(h, kd)
    rec = kda.encode(_states(n, h, kd, vd, seed=4), lay, w)
    g = torch.Generator().manual_seed(9)
    q = torch.nn.functional.normalize(torch.randn(n, h, kd, generator=g), dim=-1) * kd**-0.5
    k = torch.nn.functional.normalize(torch.randn(n, h, kd, generator=g), dim=-1)
    v, gate = torch.randn(n, h, vd, generator=g), -torch.rand(n, h, kd, generator=g)
    beta = torch.rand(n, h, generator=g)
    out, new = kda.step(rec, lay, w, q, k, v, gate, beta)
    old = kda.decode(rec, lay).double()
    for i in range(n):
        for hd in range(h):
            s = torch.diag(torch.exp(gate[i, hd].double())) @ old[i, hd]
            kk = k[i, hd].double()
            x = s + beta[i, hd].double() * torch.outer(kk, v[i, hd].double() - s.T @ kk)
            assert torch.allclose(out[i, hd].double(), x.T @ q[i, hd].double(), rtol=1e-5, atol=1e-6)
            one = kda.KdaLayout((lay.bits[hd],), kd, vd)
            want = kda.decode(kda.encode(x.float()[None, None], one, w[hd : hd + 1]), one)[0, 0]
            assert torch.allclose(kda.decode(new, lay)[i, hd], want, rtol=1e-4, atol=1e-6)


def _raw(n, h, kd, vd, seed):
    g = torch.Generator().manual_seed(seed)
    mixed = (torch.randn(n, 2 * h * kd + h * vd, generator=g) * 0.7).bfloat16()
    raw_g = torch.randn(n, h, kd, generator=g).bfloat16()
    raw_beta = torch.randn(n, h, generator=g).bfloat16()
    return mixed, raw_g, raw_beta, torch.randn(h, generator=g) * 0.5, torch.randn(h * kd, generator=g) * 0.5


def _prepared(mixed, raw_g, raw_beta, a_log, dt_bias, h, kd, lower_bound):
    """q, k, v, g, beta as vLLM's KDA decode kernel forms them."""
    n = mixed.shape[0]
    x = mixed.float()
    q, k = x[:, : h * kd].view(n, h, kd), x[:, h * kd : 2 * h * kd].view(n, h, kd)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * kd**-0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    t = raw_g.float() + dt_bias.view(h, kd)
    a = torch.exp(a_log).view(1, h, 1)
    g = lower_bound * torch.sigmoid(a * t) if lower_bound is not None else -a * torch.nn.functional.softplus(t)
    return q, k, x[:, 2 * h * kd :].view(n, h, -1), g, torch.sigmoid(raw_beta.float())


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_triton_step_matches_the_reference(lower_bound):
    """The Triton foreground + writeback on vLLM's raw KDA inputs, in a pool
    with a padding row, against ``kda.step``: the same readout, the same
    records up to rounding-boundary flips (each at most one step of its row)."""
    pytest.importorskip("triton")
    from vllm_kvq.kernels.stepquant.triton_kda import KdaPlan, kda_step_

    h, kd, vd = 2, 32, 32
    widths = (WIDTHS + WIDTHS[::-1], WIDTHS[::-1] + WIDTHS)
    lay = kda.KdaLayout(widths, kd, vd)
    w = _impact(h, kd, seed=2)
    slots = [3, -1, 1]
    live = [0, 2]
    rec = kda.encode(_states(3, h, kd, vd, seed=6), lay, w)
    pool = torch.randint(0, 256, (5, lay.size), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    for i, s in enumerate(slots):
        if s > 0:
            pool[s] = rec[i]
    before = pool.clone()
    raw = _raw(3, h, kd, vd, seed=7)
    out = torch.zeros(3, h, vd, device=DEV)
    pool_dev = pool.to(DEV)
    kda_step_(pool_dev, torch.tensor(slots, dtype=torch.int32, device=DEV), KdaPlan(lay, w, DEV),
              *[t.to(DEV) for t in raw], out, lower_bound=lower_bound)
    q, k, v, g, beta = (t[live] for t in _prepared(*raw, h, kd, lower_bound))
    o_want, r_want = kda.step(rec[live], lay, w, q, k, v, g, beta)
    after = pool_dev.cpu()
    assert (out.cpu()[live] - o_want).abs().max() <= 1e-5 * o_want.abs().max()
    assert out[1].abs().max() == 0
    for s in (0, 2, 4):
        assert torch.equal(after[s], before[s])
    d_want, d_got = kda.decode(r_want, lay), kda.decode(after[[3, 1]], lay)
    rows, scales, cols, _ = lay.tables
    for hd in range(h):
        r = torch.maximum(*(x[:, scales[hd] : scales[hd] + 2 * kd].contiguous().view(torch.float16).float()
                            for x in (r_want, after[[3, 1]])))
        c = torch.maximum(*(x[:, cols[hd] : cols[hd] + 2 * vd].contiguous().view(torch.float16).float()
                            for x in (r_want, after[[3, 1]])))
        unit = torch.tensor([2.0 ** (8 - b) if b != 16 else 0.0 for b in widths[hd]]).view(1, kd, 1)
        step = r.view(2, kd, 1) * c.view(2, 1, vd) * unit
        ulp = (d_want[:, hd].abs() * 2**-10).clamp_min(2**-24)  # pivot rows: one fp16 ulp
        bound = torch.where(unit > 0, step + d_want[:, hd].abs() * 2**-9, ulp)
        assert bool(((d_got[:, hd] - d_want[:, hd]).abs() <= bound + 1e-30).all())
    # one row factor or column scale an fp16 ulp apart moves its whole row or column (1.6% of a 32 x 32 head)
    assert (d_got != d_want).float().mean() <= 0.02
