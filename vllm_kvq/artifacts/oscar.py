"""The OSCAR KV-cache artifact: what calibration writes and the backend loads.

In the container (:mod:`vllm_kvq.artifacts.container`), kind ``oscar``::

    manifest.json        fingerprint, head_dim, KV heads, layers, granularity,
                         sink, window, clip ratios, tiers per layer
    tensors.safetensors  k_rotation.<layer>, v_rotation.<layer>   (fp32)
                         [k|v]_fill.<layer>  (layers with a 0-bit tier)
                         [k|v]_eigenvalues.<layer>  (optional spectra)

Rotations act on row vectors (``x @ R``) after RoPE and are orthogonal. Each is
``[D, D]`` (granularity ``layer``, shared by the layer's KV heads) or
``[H_kv, D, D]`` (granularity ``kv_head``), with H_kv the model's total KV
heads; tensor-parallel ranks slice their own heads.

``tiers`` (version 2: ``{"<layer>": {"k": [[width, bits], ...], "v": ...}}``;
version 1: one ``{"k": ..., "v": ...}`` for every layer) says how each
layer's rotated rows are stored, strongest directions first
(:class:`~vllm_kvq.kernels.oscar.format.TierPlan`); without it every
direction is INT2 (OSCAR INT2). A 0-bit tier is not stored; it reads back as
``<kind>_fill.<layer>``: fp32 ``[H_kv, its width]``, the calibrated mean row
in rotated coordinates. Every layer's tiers take the same bytes per token
(vLLM gives every layer one page size).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from vllm_kvq.artifacts import container
from vllm_kvq.artifacts.container import ArtifactError
from vllm_kvq.kernels.oscar.format import LayerTiers, TierError

KIND = "oscar"
GRANULARITIES = ("layer", "kv_head")
ORTHOGONALITY_TOL = 1e-3
DEFAULT_SINK, DEFAULT_WINDOW = 64, 256
REQUIRED = ("model_fingerprint", "head_dim", "num_kv_heads", "layers", "granularity", "k_clip", "v_clip")
OPTIONAL = ("sink", "window", "tiers", "provenance", "group_size")


@dataclass
class OscarArtifact:
    """Rotations, clip ratios and tiers for every full-attention layer of one model."""

    fingerprint: dict
    head_dim: int
    num_kv_heads: int
    layers: list[int]
    granularity: str
    k_rotation: dict[int, torch.Tensor]
    v_rotation: dict[int, torch.Tensor]
    k_clip: dict[int, float]
    v_clip: dict[int, float]
    sink: int = DEFAULT_SINK
    window: int = DEFAULT_WINDOW
    provenance: dict = field(default_factory=dict)
    eigenvalues: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)
    """Optional spectra of the fitted covariances: {"k"|"v": {layer: [D] or [H, D]}}."""
    tiers: dict[int, LayerTiers] | None = None
    """Each layer's K and V tiers; None = INT2 everywhere (OSCAR INT2)."""
    fill: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)
    """Means of the 0-bit tiers in rotated coordinates: {"k"|"v": {layer: [H, width0]}}."""
    source: str = "<memory>"

    def layer_tiers(self, layer: int) -> LayerTiers:
        return LayerTiers.int2_only(self.head_dim) if self.tiers is None else self.tiers[layer]

    @property
    def bytes_per_token(self) -> int:
        """Bytes per token and KV head of every layer's rows."""
        return self.layer_tiers(self.layers[0]).bytes_per_token

    def save(self, directory: str | Path) -> Path:
        self.validate()
        tensors = {f"{kind}_rotation.{layer}": getattr(self, f"{kind}_rotation")[layer].float()
                   for kind in "kv" for layer in self.layers}
        for name, table in (("eigenvalues", self.eigenvalues), ("fill", self.fill)):
            tensors.update({f"{kind}_{name}.{layer}": t.float() for kind, per in table.items()
                            for layer, t in per.items()})
        manifest = {
            "model_fingerprint": self.fingerprint, "head_dim": self.head_dim, "num_kv_heads": self.num_kv_heads,
            "layers": self.layers, "granularity": self.granularity, "sink": self.sink, "window": self.window,
            "k_clip": {str(k): v for k, v in self.k_clip.items()},
            "v_clip": {str(k): v for k, v in self.v_clip.items()},
            "provenance": self.provenance,
        }
        if self.tiers is not None:
            manifest["tiers"] = {str(layer): self.tiers[layer].to_json() for layer in self.layers}
        return container.write(directory, KIND, manifest, tensors)

    @classmethod
    def load(cls, directory: str | Path, expected_fingerprint: dict | None = None) -> "OscarArtifact":
        """Read and validate an artifact; raise ArtifactError on any defect."""
        manifest, tensors = container.read(directory, KIND, REQUIRED, OPTIONAL)
        where = f"artifact {directory}"
        page = _page_fields(manifest, where)

        def table(name: str, required: bool = False) -> dict[int, torch.Tensor]:
            return container.per_layer(tensors, name, page["layers"], where, required)

        art = cls(fingerprint=manifest["model_fingerprint"], num_kv_heads=int(manifest["num_kv_heads"]),
                  granularity=manifest["granularity"], k_rotation=table("k_rotation", True),
                  v_rotation=table("v_rotation", True), provenance=manifest.get("provenance", {}),
                  eigenvalues={k: table(f"{k}_eigenvalues") for k in "kv"},
                  fill={k: table(f"{k}_fill") for k in "kv"}, source=str(directory), **page)
        art.validate()
        if expected_fingerprint is not None:
            art.check_model(expected_fingerprint)
        return art

    def validate(self) -> None:
        where = f"artifact {self.source}"
        if self.granularity not in GRANULARITIES:
            raise ArtifactError(f"{where}: granularity {self.granularity!r} not in {GRANULARITIES}")
        if self.sink < 0 or self.window < 0:
            raise ArtifactError(f"{where}: sink {self.sink} and window {self.window} must be >= 0")
        d, h = self.head_dim, self.num_kv_heads
        want = (d, d) if self.granularity == "layer" else (h, d, d)
        for kind in "kv":
            for layer in self.layers:
                name = f"{kind}_rotation.{layer}"
                r64 = container.checked(where, name, getattr(self, f"{kind}_rotation")[layer], want,
                                        f" (granularity {self.granularity}, head_dim {d}, {h} KV heads)")
                err = float(np.abs(np.swapaxes(r64, -1, -2) @ r64 - np.eye(d)).max())
                if err > ORTHOGONALITY_TOL:
                    raise ArtifactError(f"{where}: {name} is not orthogonal (max |R^T R - I| = {err:.3g} > "
                                        f"{ORTHOGONALITY_TOL}); re-run calibration")
                c = getattr(self, f"{kind}_clip").get(layer)
                if c is None:
                    raise ArtifactError(f"{where}: {kind}_clip has no entry for layer {layer}")
                if not (math.isfinite(c) and 0.0 < c <= 1.0):
                    raise ArtifactError(f"{where}: {kind}_clip[{layer}] = {c} is not in (0, 1]")
        if self.tiers is not None:
            self._validate_tiers(where)

    def _validate_tiers(self, where: str) -> None:
        if self.granularity != "kv_head":
            raise ArtifactError(f"{where}: tiers need granularity 'kv_head', not {self.granularity!r}; "
                                "re-run `vllm-kvq calibrate` with --granularity kv_head")
        sizes = {}
        for layer in self.layers:
            if layer not in self.tiers:
                raise ArtifactError(f"{where}: no tiers for layer {layer}")
            try:
                t = self.tiers[layer].check(self.head_dim, f"{where}: layer {layer} tiers")
            except TierError as e:
                raise ArtifactError(str(e)) from e
            sizes[layer] = t.bytes_per_token
            for kind in "kv":
                w0, name = getattr(t, kind).zero, f"{kind}_fill.{layer}"
                if w0:
                    if layer not in self.fill.get(kind, {}):
                        raise ArtifactError(f"{where}: missing tensor {name!r}, the mean of layer {layer}'s 0-bit "
                                            f"{kind} tier; re-run {container.MAKE[KIND]}")
                    container.checked(where, name, self.fill[kind][layer], (self.num_kv_heads, w0),
                                      f" ({self.num_kv_heads} KV heads, {w0} 0-bit columns)")
        if len(set(sizes.values())) > 1:
            raise ArtifactError(f"{where}: layers' tiers take different bytes per token {sizes}; vLLM gives every "
                                f"layer one page size, so re-run {container.MAKE[KIND]}")

    def check_model(self, fingerprint: dict) -> None:
        """Fail unless this artifact was made for a model with this fingerprint."""
        where = f"artifact {self.source}"
        container.check_fingerprint(where, self.fingerprint, fingerprint, KIND)
        want = fingerprint.get("attention_layers")
        if want is not None and sorted(self.layers) != sorted(want):
            raise ArtifactError(f"{where}: missing layers {sorted(set(want) - set(self.layers))} of the model's "
                                "attention layers")

    def rotation_for(self, kind: str, layer: int, kv_heads: list[int]) -> torch.Tensor:
        """``[len(kv_heads), D, D]`` fp32 rotations of the given global KV heads."""
        r = getattr(self, f"{kind}_rotation")[layer].float()
        return (r.expand(len(kv_heads), -1, -1) if r.dim() == 2 else r[kv_heads]).contiguous()

    def fill_for(self, kind: str, layer: int, kv_heads: list[int]) -> torch.Tensor | None:
        """``[len(kv_heads), width0]`` fp32 means of the 0-bit columns of the given global
        KV heads (rotated coordinates, column order); None without a 0-bit ``kind`` tier."""
        if not getattr(self.layer_tiers(layer), kind).zero:
            return None
        return self.fill[kind][layer].float()[kv_heads].contiguous()


def read_page_fields(directory: str | Path) -> dict:
    """What an artifact fixes about its pages (head_dim, layers, sink, window,
    clip ratios, tiers), from its manifest alone: page sizes are needed
    before any layer loads tensors."""
    return _page_fields(container.read_manifest(directory, KIND, REQUIRED, OPTIONAL), f"artifact {directory}")


def _page_fields(manifest: dict, where: str) -> dict:
    def clips(raw) -> dict[int, float]:
        if isinstance(raw, (int, float)):
            return {layer: float(raw) for layer in layers}
        return {int(k): float(v) for k, v in raw.items()}

    try:
        layers = [int(x) for x in manifest["layers"]]
        fields = dict(head_dim=int(manifest["head_dim"]), layers=layers,
                      sink=int(manifest.get("sink", DEFAULT_SINK)), window=int(manifest.get("window", DEFAULT_WINDOW)),
                      k_clip=clips(manifest["k_clip"]), v_clip=clips(manifest["v_clip"]))
    except (TypeError, ValueError, AttributeError) as e:
        raise ArtifactError(f"{where}: malformed manifest field ({e}); re-run {container.MAKE[KIND]}") from e
    group = manifest.get("group_size", fields["head_dim"])
    if group != fields["head_dim"]:
        raise ArtifactError(
            f"{where} quantizes rows in groups of {group}, which this release no longer serves (each stored "
            f"tier is one group); re-run {container.MAKE[KIND]}")
    fields["tiers"] = _tiers(manifest, layers, where) if "tiers" in manifest else None
    return fields


def _tiers(manifest: dict, layers: list[int], where: str) -> dict[int, LayerTiers]:
    raw = manifest["tiers"]
    try:
        if manifest["format_version"] == 1:  # one plan for every layer
            return dict.fromkeys(layers, LayerTiers.from_json(raw, f"{where}: tiers"))
        if not isinstance(raw, dict):
            raise TierError(f"{where}: tiers must map each layer to its tiers")
        return {int(layer): LayerTiers.from_json(t, f"{where}: layer {layer} tiers") for layer, t in raw.items()}
    except (TierError, ValueError) as e:
        raise ArtifactError(str(e)) from e
