"""STEPQuant state plan: per-head widths of every GDN layer's state record.

In the container (:mod:`vllm_kvq.artifacts.container`), kind ``stepquant``::

    manifest.json        fingerprint, GDN geometry, budgets, widths per
                         budget / layer / value head, calibration settings
    tensors.safetensors  impact.<layer>     w  [HV, K] fp32 (geo-mean 1 per head)
                         log_decay.<layer>  ℓ  [HV]    fp64 (mean log retention)
                         omega.<layer>      ω  [HV, K] fp64 (row impact before w)
                         distortion.<layer> d  [HV, 4] fp64 (widths 2, 4, 6, 8; optional)

Widths are per value head over all heads of the model (before tensor
parallelism): 2, 4, 6, 8, or 16 for an FP16 pivot. For each nominal budget
b̄, a layer's widths sum to at most b̄·HV with a pivot counted as 8 bits. The
impact w is fixed; the online codec refits row and column scales every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from vllm_kvq.artifacts import container
from vllm_kvq.artifacts.container import MANIFEST, ArtifactError
from vllm_kvq.kernels.stepquant.format import PIVOT, PIVOT_BUDGET_BITS, WIDTHS, StateLayout

KIND = "stepquant"
DISTORTION_WIDTHS = WIDTHS  # columns of distortion.<layer>
GEO_MEAN_TOL = 1e-3
TABLES = ("log_decay", "omega", "distortion")  # optional per-layer tensors besides the impact


@dataclass
class StepQuantPlan:
    """Widths and impact factors for every GDN layer of one model."""

    fingerprint: dict
    layers: list[int]
    num_v_heads: int
    k_dim: int
    v_dim: int
    budgets: list[int]
    bits: dict[int, dict[int, tuple[int, ...]]]  # budget -> layer -> widths per value head
    impacts: dict[int, torch.Tensor]  # layer -> w [HV, K]
    log_decay: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> ℓ [HV]
    omega: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> ω [HV, K]
    distortion: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> d [HV, 4]
    num_k_heads: int | None = None
    settings: dict = field(default_factory=dict)  # horizon, gamma, pivot_fraction, candidates
    provenance: dict = field(default_factory=dict)
    source: str = "<memory>"

    def head_bits(self, budget: int, layer: int) -> tuple[int, ...]:
        """Widths of the layer's value heads at nominal ``budget`` (16 = FP16 pivot)."""
        if budget not in self.bits:
            raise ArtifactError(f"artifact {self.source}: no plan for budget {budget}; it has {self.budgets}")
        return tuple(self.bits[budget][self._gdn_layer(layer)])

    def impact(self, layer: int) -> torch.Tensor:
        """w ``[num_v_heads, k_dim]`` fp32 for the layer."""
        return self.impacts[self._gdn_layer(layer)].float()

    def _gdn_layer(self, layer: int) -> int:
        if layer not in self.layers:
            raise ArtifactError(f"artifact {self.source}: layer {layer} is not a GDN layer of the plan {self.layers}")
        return layer

    def pivots(self, budget: int, layer: int) -> list[int]:
        return [h for h, b in enumerate(self.head_bits(budget, layer)) if b == PIVOT]

    def layout(self, budget: int, layer: int) -> StateLayout:
        """Packed record layout of the layer's full state (all heads, no padding)."""
        return StateLayout(self.head_bits(budget, layer), self.k_dim, self.v_dim)

    def save(self, directory: str | Path) -> Path:
        self.validate()
        tensors = {f"impact.{layer}": self.impacts[layer].float() for layer in self.layers}
        for name in TABLES:
            tensors.update({f"{name}.{layer}": getattr(self, name)[layer].double() for layer in self.layers
                            if layer in getattr(self, name)})
        manifest = {
            "model_fingerprint": self.fingerprint, "layers": self.layers, "num_v_heads": self.num_v_heads,
            "num_k_heads": self.num_k_heads, "k_dim": self.k_dim, "v_dim": self.v_dim, "budgets": self.budgets,
            "bits": {str(b): {str(layer): list(self.bits[b][layer]) for layer in self.layers} for b in self.budgets},
            "settings": self.settings, "provenance": self.provenance,
        }
        return container.write(directory, KIND, manifest, tensors)

    @classmethod
    def load(cls, directory: str | Path, expected_fingerprint: dict | None = None) -> "StepQuantPlan":
        """Read and validate a plan; raise ArtifactError on any defect."""
        where = f"artifact {Path(directory)}"
        manifest, tensors = container.read(
            directory, KIND, ("model_fingerprint", "layers", "num_v_heads", "k_dim", "v_dim", "budgets", "bits"),
            ("num_k_heads", "settings", "provenance"))
        try:
            layers = [int(x) for x in manifest["layers"]]
            budgets = [int(b) for b in manifest["budgets"]]
            raw = manifest["bits"]
            bits = {b: {layer: tuple(int(x) for x in raw[str(b)][str(layer)]) for layer in layers
                        if str(layer) in raw[str(b)]} for b in budgets if str(b) in raw}
        except (TypeError, ValueError, AttributeError) as e:
            raise ArtifactError(f"{where}: malformed layers/budgets/bits in {MANIFEST} ({e})") from e
        plan = cls(
            fingerprint=manifest["model_fingerprint"], layers=layers, num_v_heads=int(manifest["num_v_heads"]),
            k_dim=int(manifest["k_dim"]), v_dim=int(manifest["v_dim"]), budgets=budgets, bits=bits,
            impacts=container.per_layer(tensors, "impact", layers, where),
            **{name: container.per_layer(tensors, name, layers, where) for name in TABLES},
            num_k_heads=manifest.get("num_k_heads"), settings=manifest.get("settings", {}),
            provenance=manifest.get("provenance", {}), source=str(Path(directory)),
        )
        plan.validate()
        if expected_fingerprint is not None:
            plan.check_model(expected_fingerprint)
        return plan

    def validate(self) -> None:
        where = f"artifact {self.source}"
        fix = "re-run `vllm-kvq calibrate --stepquant`"
        if not self.layers:
            raise ArtifactError(f"{where}: the plan covers no GDN layers; {fix} on a GDN hybrid")
        if len(set(self.layers)) != len(self.layers):
            raise ArtifactError(f"{where}: duplicate layers in {self.layers}")
        if not self.budgets:
            raise ArtifactError(f"{where}: no budgets; {fix}")
        hv, k = self.num_v_heads, self.k_dim
        if hv <= 0 or k <= 0 or self.v_dim <= 0:
            raise ArtifactError(f"{where}: bad geometry num_v_heads={hv} k_dim={k} v_dim={self.v_dim}")
        allowed = set(WIDTHS) | {PIVOT}
        for b in self.budgets:
            if b not in self.bits:
                raise ArtifactError(f"{where}: no widths for budget {b}")
            for layer in self.layers:
                widths = self.bits[b].get(layer)
                if widths is None:
                    raise ArtifactError(f"{where}: budget {b} has no widths for layer {layer}")
                if len(widths) != hv:
                    raise ArtifactError(f"{where}: budget {b} layer {layer} has {len(widths)} widths, expected {hv} "
                                        "(one per value head)")
                if bad := sorted({w for w in widths if w not in allowed}):
                    raise ArtifactError(f"{where}: budget {b} layer {layer} has widths {bad}; allowed are "
                                        f"{sorted(allowed)} (16 = pivot)")
                if (spent := sum(PIVOT_BUDGET_BITS if w == PIVOT else w for w in widths)) > b * hv:
                    raise ArtifactError(f"{where}: budget {b} layer {layer} spends {spent} bits > {b}x{hv} = "
                                        f"{b * hv} (a pivot counts as 8); {fix}")
        for layer in self.layers:
            name = f"impact.{layer}"
            if layer not in self.impacts:
                raise ArtifactError(f"{where}: missing tensor {name!r} for layer {layer}")
            w64 = container.checked(where, name, self.impacts[layer], (hv, k))
            if not (w64 > 0).all():
                raise ArtifactError(f"{where}: {name} has non-positive entries; impacts must be > 0; {fix}")
            if (drift := float(np.abs(np.log(w64).mean(-1)).max())) > GEO_MEAN_TOL:
                raise ArtifactError(f"{where}: {name} is not normalised (|mean log w| = {drift:.3g} per head, want "
                                    f"0); {fix}")
            for tname, shape in zip(TABLES, ((hv,), (hv, k), (hv, len(DISTORTION_WIDTHS)))):
                t = getattr(self, tname).get(layer)
                if t is None:
                    continue
                if tuple(t.shape) != shape:
                    raise ArtifactError(f"{where}: {tname}.{layer} has shape {tuple(t.shape)}, expected {shape}")
                t64 = container.as_numpy(t)
                if np.isnan(t64).any() or np.isposinf(t64).any():
                    raise ArtifactError(f"{where}: {tname}.{layer} contains NaN or +Inf")
                if tname == "log_decay" and (t64 > 0).any():
                    raise ArtifactError(f"{where}: log_decay.{layer} has positive entries (a gate above 1)")

    def check_model(self, fingerprint: dict) -> None:
        """Fail unless this plan was made for a model with this fingerprint."""
        where = f"artifact {self.source}"
        container.check_fingerprint(where, self.fingerprint, fingerprint, KIND)
        attn, n = fingerprint.get("attention_layers"), fingerprint.get("num_hidden_layers")
        if attn is not None and n is not None:
            want = [i for i in range(int(n)) if i not in set(attn)]
            if sorted(self.layers) != want:
                raise ArtifactError(f"{where} covers GDN layers {sorted(self.layers)} but the model's are {want}; "
                                    "calibrate this model with `vllm-kvq calibrate MODEL --stepquant`")
