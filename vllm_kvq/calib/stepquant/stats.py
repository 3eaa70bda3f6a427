"""Per-layer GDN statistics for the plan, folded in as tokens stream by.

For every GDN layer and value head (fp64 accumulators, nothing per token kept):

* ``log_decay_sum`` → ℓ_h, the mean log retention (GDN: one scalar gate per head);
* ``omega_sum`` → ω[h, i] = mean_t g_{t,i}² with g_t = decay_t·(q_t − β_t k_t (k_tᵀq_t)),
  the next-read gain of an error in key row i (paper's row impact);
* a seeded reservoir of state snapshots ``[HV, K, V]`` taken every
  ``every`` updates, on which candidate widths are scored with the real codec.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

SNAPSHOT_EVERY = 8
RESERVOIR = 64
SEED = 0


def row_gain(q, k, g, beta) -> torch.Tensor:
    """g_t = decay_t (q_t − β_t k_t (k_tᵀ q_t)) for prepared inputs ``[..., T, K]``: ``[..., T, K]``."""
    kq = (k * q).sum(-1, keepdim=True)
    return g.exp().unsqueeze(-1) * (q - beta.unsqueeze(-1) * k * kq)


@dataclass
class Reservoir:
    """Uniform sample of at most ``size`` offered states (Algorithm R, seeded)."""

    size: int = RESERVOIR
    seed: int = SEED
    items: list = field(default_factory=list)
    steps: list = field(default_factory=list)  # update index of each kept state
    offered: int = 0

    def __post_init__(self):
        self._rng = random.Random(self.seed)

    def slot(self) -> int | None:
        """Where the next offered item goes (None: dropped); counts the offer."""
        i = self.offered
        self.offered += 1
        if i < self.size:
            return i
        j = self._rng.randrange(i + 1)
        return j if j < self.size else None

    def put(self, slot: int, item: torch.Tensor, step: int) -> None:
        if slot == len(self.items):
            self.items.append(None)
            self.steps.append(None)
        self.items[slot], self.steps[slot] = item, step


@dataclass
class LayerStats:
    num_heads: int
    k_dim: int
    log_decay_sum: torch.Tensor = None  # [HV] fp64
    omega_sum: torch.Tensor = None  # [HV, K] fp64
    tokens: int = 0
    updates: int = 0  # updates seen so far (for the snapshot cadence)
    snapshots: Reservoir = None

    def __post_init__(self):
        if self.log_decay_sum is None:
            self.log_decay_sum = torch.zeros(self.num_heads, dtype=torch.float64)
            self.omega_sum = torch.zeros(self.num_heads, self.k_dim, dtype=torch.float64)

    @property
    def log_decay(self) -> torch.Tensor:
        """ℓ_h ``[HV]`` fp64."""
        return self.log_decay_sum / max(self.tokens, 1)

    @property
    def omega(self) -> torch.Tensor:
        """ω ``[HV, K]`` fp64."""
        return self.omega_sum / max(self.tokens, 1)

    def states(self) -> torch.Tensor:
        """Kept snapshots ``[N, HV, K, V]`` fp32."""
        return torch.stack(self.snapshots.items)


class StateStatsCollector:
    """Accumulates LayerStats per global layer id from prepared recurrence inputs."""

    def __init__(self, every: int = SNAPSHOT_EVERY, reservoir: int = RESERVOIR, seed: int = SEED):
        self.every, self.reservoir, self.seed = every, reservoir, seed
        self.layers: dict[int, LayerStats] = {}

    def observe_inputs(self, idx: int, q, k, v, g, beta):
        """Fold one call's gates and row gains in (inputs ``[B, H, T, ...]``
        fp32); returns the ``on_update`` callback of its recurrence, which
        offers every ``every``-th state of each sequence to the reservoir."""
        b, h, t, kd = k.shape
        if idx not in self.layers:
            self.layers[idx] = LayerStats(h, kd, snapshots=Reservoir(self.reservoir, self.seed))
        st = self.layers[idx]
        st.log_decay_sum += g.double().sum((0, 2)).cpu()
        st.omega_sum += row_gain(q, k, g, beta).double().square().sum((0, 2)).cpu()
        st.tokens += b * t
        base, st.updates = st.updates, st.updates + t

        def on_update(t: int, s: torch.Tensor) -> None:
            if (base + t + 1) % self.every:
                return
            for i in range(s.shape[0]):
                slot = st.snapshots.slot()
                if slot is not None:
                    st.snapshots.put(slot, s[i].detach().float().cpu().clone(), base + t + 1)

        return on_update
