"""STEPQuant calibration: reference recurrence, streamed statistics, allocation, plan, CLI."""

import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from evalkit.data import CODE as DATA
from tests.conftest import MODELS
from vllm_kvq.calib.stepquant.allocate import (allocate_layer, impact_factors, knapsack, lifetime_weight,
                                               pivot_count)
from vllm_kvq.calib.stepquant.recurrence import gated_delta_rule


# --------------------------------------------------------------------------- recurrence


def _kernel_inputs(b=2, t=37, hk=2, hv=4, k=16, v=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, hk, k, generator=g)
    key = torch.randn(b, t, hk, k, generator=g)
    val = torch.randn(b, t, hv, v, generator=g)
    logdec = -F.softplus(torch.randn(b, t, hv, generator=g)) * torch.logspace(-2, 0.5, hv)
    beta = torch.rand(b, t, hv, generator=g)
    s0 = torch.randn(b, hv, k, v, generator=g) * 0.1
    return q, key, val, logdec, beta, s0


@pytest.mark.parametrize("kernel", ["torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"])
def test_reference_recurrence_equals_transformers(kernel):
    import transformers.models.qwen3_next.modeling_qwen3_next as qn

    q, k, v, g, beta, s0 = _kernel_inputs()
    rep = lambda x: x.repeat_interleave(2, dim=2)  # noqa: E731  (transformers' GQA expansion)
    want_y, want_s = getattr(qn, kernel)(rep(q), rep(k), v, g=g, beta=beta, initial_state=s0.clone(),
                                         output_final_state=True, use_qk_l2norm_in_kernel=True)
    y, s = gated_delta_rule(rep(q), rep(k), v, g, beta, initial_state=s0, output_final_state=True,
                            use_qk_l2norm_in_kernel=True)
    assert torch.allclose(y, want_y, rtol=1e-4, atol=1e-5)
    assert torch.allclose(s, want_s, rtol=1e-4, atol=1e-5)
    # Key heads given un-expanded map to value heads h -> h // (HV/HK), as transformers does.
    y2, _ = gated_delta_rule(q, k, v, g, beta, initial_state=s0, use_qk_l2norm_in_kernel=True)
    assert torch.equal(y2, y)


def test_reference_recurrence_is_the_math_orientation_update():
    """S ← αS; S ← S + k β (v − Sᵀk)ᵀ; y = Sᵀ q, in fp64 on one head."""
    q, k, v, g, beta, _ = _kernel_inputs(b=1, t=9, hk=1, hv=1, k=8, v=32)
    y, s = gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    S = torch.zeros(8, 32, dtype=torch.float64)
    for t in range(9):
        qt, kt, vt = q[0, t, 0].double() / math.sqrt(8), k[0, t, 0].double(), v[0, t, 0].double()
        S = math.exp(g[0, t, 0].item()) * S
        S = S + torch.outer(kt, beta[0, t, 0].item() * (vt - S.T @ kt))
        assert torch.allclose(y[0, t, 0].double(), S.T @ qt, rtol=1e-5, atol=1e-6)
    assert torch.allclose(s[0, 0].double(), S, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- tiny model statistics


@pytest.fixture(scope="module")
def tiny_next(tmp_path_factory):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(
        vocab_size=8192, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=32,
        linear_conv_kernel_dim=4, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, mlp_only_layers=[0, 1, 2, 3], max_position_embeddings=1024)
    torch.manual_seed(0)
    model = Qwen3NextForCausalLM(cfg).eval()
    with torch.no_grad():  # gates from short- to long-lived, so ℓ spans a wide range
        for layer in (0, 1, 3):
            attn = model.model.layers[layer].linear_attn
            attn.A_log.copy_(torch.log(torch.tensor([1e-3, 1e-2, 0.1, 1.0])))
    path = tmp_path_factory.mktemp("tiny_next") / "model"
    model.save_pretrained(path)
    return path


def _direct_inputs(attn, x):
    """q, k, v, log decay, β of one GDN layer from its weights, independent of transformers' forward.

    The projection packs, per key head j, [q_j | k_j | v of its r value heads | z of them], and
    [b of its r heads | a of them]; value head h = j*r + i reads key head j.
    """
    hk, hv = attn.num_k_heads, attn.num_v_heads
    kd, vd, r = attn.head_k_dim, attn.head_v_dim, hv // hk
    x = x.double()
    proj = (x @ attn.in_proj_qkvz.weight.double().T).view(-1, hk, 2 * kd + 2 * r * vd)
    ba = (x @ attn.in_proj_ba.weight.double().T).view(-1, hk, 2 * r)
    q, k = proj[..., :kd].reshape(-1, hk * kd), proj[..., kd : 2 * kd].reshape(-1, hk * kd)
    v = proj[..., 2 * kd : 2 * kd + r * vd].reshape(-1, hv * vd)
    b, a = ba[..., :r].reshape(-1, hv), ba[..., r:].reshape(-1, hv)
    mixed = torch.cat([q, k, v], -1)  # [T, C]
    w = attn.conv1d.weight.double()[:, 0]  # [C, ksize]
    ks = w.shape[1]
    padded = F.pad(mixed.T, (ks - 1, 0))  # causal
    conv = torch.stack([(padded[:, t : t + ks] * w).sum(-1) for t in range(mixed.shape[0])])
    conv = F.silu(conv)
    q = conv[:, : hk * kd].view(-1, hk, kd)
    k = conv[:, hk * kd : 2 * hk * kd].view(-1, hk, kd)
    v = conv[:, 2 * hk * kd :].view(-1, hv, vd)
    logdec = -attn.A_log.double().exp() * F.softplus(a + attn.dt_bias.double())
    return q, k, v, logdec, torch.sigmoid(b)


def test_statistics_match_a_direct_computation(tiny_next):
    from vllm_kvq.calib.capture import load_model
    from vllm_kvq.calib.stepquant.capture import run_windows
    from vllm_kvq.calib.stepquant.stats import StateStatsCollector

    model = load_model(str(tiny_next), "cpu", torch.float32)
    ids = torch.randint(10, 8000, (120,), generator=torch.Generator().manual_seed(1)).tolist()
    inputs = {}
    hooks = [model.model.layers[i].linear_attn.register_forward_pre_hook(
        lambda m, a, kw, _i=i: inputs.__setitem__(_i, (a[0] if a else kw["hidden_states"])[0].detach().clone()),
        with_kwargs=True) for i in (0, 1, 3)]
    col = StateStatsCollector(every=8, reservoir=5, seed=0)
    run_windows(model, [ids], col, "cpu")
    for h in hooks:
        h.remove()
    assert sorted(col.layers) == [0, 1, 3]
    for layer in (0, 1, 3):
        attn = model.model.layers[layer].linear_attn
        q, k, v, logdec, beta = _direct_inputs(attn, inputs[layer])
        st = col.layers[layer]
        assert st.tokens == 120 and st.updates == 120
        omega = torch.zeros(4, 16, dtype=torch.float64)
        S = torch.zeros(4, 16, 32, dtype=torch.float64)
        states = {}
        for t in range(120):
            for h in range(4):
                j = h // 2  # key head of value head h
                qn = q[t, j] / torch.sqrt((q[t, j] ** 2).sum() + 1e-6) / 4.0  # K^-1/2 = 1/4
                kn = k[t, j] / torch.sqrt((k[t, j] ** 2).sum() + 1e-6)
                alpha, bt = logdec[t, h].exp(), beta[t, h]
                gain = alpha * (qn - bt * kn * (kn @ qn))
                omega[h] += gain**2
                S[h] = alpha * S[h]
                S[h] = S[h] + torch.outer(kn, bt * (v[t, h] - S[h].T @ kn))
            states[t + 1] = S.clone()
        assert torch.allclose(st.log_decay, logdec.mean(0), rtol=1e-5, atol=1e-7)
        assert torch.allclose(st.omega, omega / 120, rtol=1e-4, atol=1e-9)
        # Reservoir: 15 states offered (every 8th update), 5 kept, each the state at its step.
        assert st.snapshots.offered == 15 and len(st.snapshots.items) == 5
        assert all(s % 8 == 0 for s in st.snapshots.steps) and len(set(st.snapshots.steps)) == 5
        for step, snap in zip(st.snapshots.steps, st.snapshots.items):
            assert torch.allclose(snap.double(), states[step], rtol=1e-4, atol=1e-5), (layer, step)


def test_capture_keeps_the_model_output(tiny_next):
    from vllm_kvq.calib.capture import load_model
    from vllm_kvq.calib.stepquant.capture import capture
    from vllm_kvq.calib.stepquant.stats import StateStatsCollector

    model = load_model(str(tiny_next), "cpu", torch.float32)
    ids = torch.randint(10, 8000, (1, 80), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
        with capture(model, StateStatsCollector()):
            got = model(ids, use_cache=False).logits
        again = model(ids, use_cache=False).logits  # patches removed on exit
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(again, want)


def test_reservoir_is_uniform_and_seeded():
    from vllm_kvq.calib.stepquant.stats import Reservoir

    counts = np.zeros(100)
    for seed in range(400):
        res = Reservoir(size=10, seed=seed)
        for i in range(100):
            slot = res.slot()
            if slot is not None:
                res.put(slot, torch.tensor(i), i)
        counts[[int(x) for x in res.items]] += 1
    # each item kept with probability 10/100: 40 of 400 runs, binomial sd ~6
    assert abs(counts[:50].mean() - 40) < 4 and abs(counts[50:].mean() - 40) < 4
    a, b = Reservoir(3, seed=0), Reservoir(3, seed=0)
    assert [a.slot() for _ in range(50)] == [b.slot() for _ in range(50)]


# --------------------------------------------------------------------------- allocation


def test_lifetime_weight_values():
    ell = torch.tensor([0.0, -1e-4, -1e-3, -0.01, -0.1, -0.5, -math.inf])
    got = lifetime_weight(ell, 2048)
    want = [2048.0] + [sum(math.exp(2 * j * x) for j in range(2048)) for x in ell[1:6].tolist()] + [1.0]
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), rtol=1e-9)
    assert abs(got[2].item() - 492.2) < 0.1 and abs(got[5].item() - 1.58) < 0.01
    with pytest.raises(ValueError):
        lifetime_weight(torch.tensor([0.1]))
    with pytest.raises(ValueError):
        lifetime_weight(torch.tensor([float("nan")]))


def test_impact_factors_are_omega_to_the_gamma_half_with_unit_geometric_mean():
    omega = torch.rand(3, 64, dtype=torch.float64) + 1e-3
    w = impact_factors(omega, 0.25)
    assert torch.allclose(w.log().mean(-1), torch.zeros(3, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(w[:, 5] / w[:, 9], (omega[:, 5] / omega[:, 9]) ** 0.125, rtol=1e-12)
    assert torch.isfinite(impact_factors(torch.zeros(1, 8))).all()


def _brute(cost, widths, budget):
    best = (math.inf, None)
    for combo in itertools.product(range(len(widths)), repeat=cost.shape[0]):
        if sum(widths[c] for c in combo) <= budget:
            best = min(best, (sum(cost[u, c] for u, c in enumerate(combo)), combo))
    return best[0]


@pytest.mark.parametrize("seed", range(40))
def test_knapsack_is_exact_against_brute_force(seed):
    rng = np.random.default_rng(seed)
    widths = (2, 4, 6, 8) if seed % 2 else (4, 6, 8)
    n = int(rng.integers(1, 7))
    # distortion falls with width, lifetimes spread over orders of magnitude
    d = np.sort(rng.random((n, len(widths))), axis=1)[:, ::-1] * (10.0 ** rng.uniform(-3, 3, (n, 1)))
    budget = int(rng.integers(min(widths) * n, max(widths) * n + 3))
    bits, cost = knapsack(d, widths, budget)
    assert sum(bits) <= budget and all(b in widths for b in bits)
    assert math.isclose(cost, sum(d[u, widths.index(b)] for u, b in enumerate(bits)), rel_tol=1e-12)
    assert math.isclose(cost, _brute(d, widths, budget), rel_tol=1e-12)


def test_knapsack_refuses_an_impossible_budget():
    with pytest.raises(ValueError, match="cannot hold"):
        knapsack(np.ones((3, 3)), (4, 6, 8), 11)


def test_longer_lived_head_gets_the_bits():
    """Paper's sanity case: equal distortions, ℓ = −0.5 vs −0.001, 12 bits over {4,6,8} → [4, 8]."""
    d = np.array([1.0, 1 / 16, 1 / 256])
    life = lifetime_weight(torch.tensor([-0.5, -0.001])).numpy()
    plan = allocate_layer(life[:, None] * d[None], (4, 6, 8), nominal=6, pivots=0)
    assert plan.bits == [4, 8] and plan.pivots == []


def test_pivots_are_the_heads_of_highest_residual_risk():
    rng = np.random.default_rng(3)
    widths = (4, 6, 8)
    d = np.sort(rng.random((8, 3)), axis=1)[:, ::-1] * (10.0 ** rng.uniform(-2, 2, (8, 1)))
    init, _ = knapsack(d, widths, 6 * 8)
    risk = [d[h, widths.index(b)] for h, b in enumerate(init)]
    want = sorted(np.argsort(risk)[::-1][:2].tolist())
    plan = allocate_layer(d, widths, nominal=6, pivots=2)
    assert plan.pivots == want and [plan.bits[h] for h in want] == [16, 16]
    rest = [h for h in range(8) if h not in want]
    # the other six share 6*8 - 8*2 = 32 bits, optimally
    assert sum(plan.bits[h] for h in rest) <= 32
    assert math.isclose(plan.cost, _brute(d[rest], widths, 32), rel_tol=1e-12)
    assert pivot_count(4, 32 / 2304) == 0 and pivot_count(48, 32 / 2304) == 1 and pivot_count(8, 0.25) == 2


# --------------------------------------------------------------------------- distortion and plan


def test_distortions_score_each_head_as_in_a_mixed_record():
    from vllm_kvq.calib.stepquant.calibrate import distortions
    from vllm_kvq.kernels.stepquant import reference
    from vllm_kvq.kernels.stepquant.format import StateLayout

    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 3, 16, 64, generator=g) * torch.logspace(-2, 0, 16).view(1, 1, 16, 1)
    w = impact_factors(torch.rand(3, 16, generator=g, dtype=torch.float64) + 0.01).float()
    d = distortions(x, w, (2, 4, 6, 8))
    assert (d[:, 1:] < d[:, :-1]).all()  # wider is better
    mixed = StateLayout((2, 8, 6), 16, 64)
    err = (reference.roundtrip(x, mixed, w) - x).double() ** 2 * w.double().view(1, 3, 16, 1) ** 2
    per_head = err.mean((0, 2, 3))
    assert torch.allclose(per_head, torch.stack([d[0, 0], d[1, 3], d[2, 2]]), rtol=1e-9)


def _synthetic_stats(hv=8, k=16, v=32, n=6, seed=5):
    from vllm_kvq.calib.stepquant.stats import LayerStats, Reservoir

    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in (0, 2):
        st = LayerStats(hv, k, snapshots=Reservoir(64, 0))
        st.tokens = 10
        st.log_decay_sum = 10 * -torch.logspace(-4, 0, hv, dtype=torch.float64)
        st.omega_sum = 10 * (torch.rand(hv, k, generator=g, dtype=torch.float64) + 0.05)
        scale = torch.ones(hv, 1, 1)
        scale[:2] = 30.0  # the two longest-lived heads also hold the largest states
        for i in range(n):
            st.snapshots.put(i, torch.randn(hv, k, v, generator=g) * scale, 8 * (i + 1))
        out[layer] = st
    return out


def test_plan_from_synthetic_statistics_with_pivots(tmp_path):
    from vllm_kvq.artifacts.stepquant import StepQuantPlan
    from vllm_kvq.calib.stepquant.calibrate import fit_plan

    fp = {"architecture": "Qwen3NextForCausalLM", "num_hidden_layers": 3, "attention_layers": [1]}
    geo = {"layers": [0, 2], "num_v_heads": 8, "num_k_heads": 2, "k_dim": 16, "v_dim": 32}
    plan = fit_plan(_synthetic_stats(), fp, geo, pivot_fraction=0.25)
    for b in (6, 4):
        for layer in (0, 2):
            bits = plan.head_bits(b, layer)
            assert bits.count(16) == 2  # round(0.25 * 8) pivots in every layer
            assert sum(8 if x == 16 else x for x in bits) <= b * 8
            assert set(bits) - {16} <= set({6: (4, 6, 8), 4: (2, 4, 6, 8)}[b])
            # heads 0 and 1: longest-lived (ℓ closest to 0) and largest, so the highest L·d even at 8 bits
            assert plan.pivots(b, layer) == [0, 1]
    back = StepQuantPlan.load(plan.save(tmp_path / "p"), fp)
    assert back.bits == plan.bits and torch.equal(back.impact(2), plan.impact(2))


# --------------------------------------------------------------------------- CLI


def test_cli_calibrates_and_inspects_the_house_model(tmp_path, capfd):
    from transformers import AutoConfig

    from vllm_kvq.artifacts import model_fingerprint
    from vllm_kvq.artifacts.stepquant import StepQuantPlan
    from vllm_kvq.cli import main

    model = MODELS / "house-qwen3next"
    out = tmp_path / "plan"
    main(["calibrate", str(model), "--data", str(DATA), "--out", str(out), "--stepquant", "--tokens", "512",
          "--seq-len", "256", "--pivot-fraction", "0.25", "--snapshots", "16"])
    done = capfd.readouterr()
    assert "STEPQuant state plan" in done.out and "GDN state statistics" in done.err
    plan = StepQuantPlan.load(out, model_fingerprint(AutoConfig.from_pretrained(model)))
    assert plan.layers == [0, 1, 2, 4, 5, 6] and plan.budgets == [6, 4]
    assert (plan.num_v_heads, plan.k_dim, plan.v_dim) == (4, 128, 128)
    assert plan.provenance["tokens"] == 512 and plan.provenance["seconds"] > 0
    assert plan.provenance["snapshots"] == 16 and plan.settings["pivots_per_layer"] == 1
    for layer in plan.layers:
        for b in (6, 4):  # one FP16 pivot per layer (round(0.25 * 4)), counted as 8 bits
            bits = plan.head_bits(b, layer)
            assert bits.count(16) == 1 and sum(8 if x == 16 else x for x in bits) <= 4 * b
        assert plan.impact(layer).shape == (4, 128)
        assert torch.isfinite(plan.log_decay[layer]).all() and (plan.log_decay[layer] < 0).all()
    main(["inspect", str(out), "--model", str(model)])
    shown = capfd.readouterr().out
    assert "layer 6:" in shown and "bits/value" in shown and "half-life" in shown
    assert "pivots [" in shown
