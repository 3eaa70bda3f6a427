"""Candidate distortions from the serving codec itself.

d_h(b) = mean over snapshots and elements of w_i² (Ŝ − S)², where Ŝ is what
the pool hands back (``kernels.stepquant.reference.roundtrip``) with every
head at width b. Heads have their own scales, so a uniform-width record scores
each head exactly as it would sit in a mixed one.
"""

from __future__ import annotations

import torch

from vllm_kvq.calib.stepquant.threads import single_thread
from vllm_kvq.kernels.stepquant import reference
from vllm_kvq.kernels.stepquant.format import StateLayout

CHUNK = 4  # snapshots per codec call (bounds temporary memory)


def distortions(states: torch.Tensor, impact: torch.Tensor, widths: tuple[int, ...]) -> torch.Tensor:
    """``states`` ``[N, HV, K, V]`` fp32, ``impact`` w ``[HV, K]`` → d ``[HV, len(widths)]`` fp64."""
    n, hv, k, v = states.shape
    w2 = impact.double().square().view(1, hv, k, 1)
    out = torch.zeros(hv, len(widths), dtype=torch.float64)
    with single_thread():
        for c, b in enumerate(widths):
            layout = StateLayout((b,) * hv, k, v)
            for i in range(0, n, CHUNK):
                x = states[i : i + CHUNK].float()
                err = (reference.roundtrip(x, layout, impact.float()) - x).double()
                out[:, c] += (w2 * err.square()).sum((0, 2, 3))
    return out / (n * k * v)
