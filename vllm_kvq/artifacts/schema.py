"""Artifact schema v1: what calibration writes and the backends load.

An artifact is a directory::

    manifest.json        format, version, model fingerprint, layout, clip ratios
    tensors.safetensors  k_rotation.<layer>, v_rotation.<layer>   (fp32)
                         [k|v]_fill.<layer>  (tiered artifacts only, see below)

Rotations act on row vectors (``x @ R``) after RoPE and are orthogonal. Each is
``[D, D]`` (granularity ``layer``, shared by the layer's KV heads) or
``[H_kv, D, D]`` (granularity ``kv_head``), with H_kv the model's total KV
heads; tensor-parallel ranks slice their own heads. No pickle is involved:
safetensors and JSON only.

A tiered artifact (manifest field ``tiers``, kv_head granularity only) cuts
each rotated row into tiers of columns, strongest directions first:
``{"k": [[width, bits], ...], "v": [...]}`` with widths multiples of 8 summing
to head_dim and bits in {0, 2, 4}. A 0-bit tier is not stored; it reads back
as ``<kind>_fill.<layer>``: fp32 ``[H_kv, total 0-bit width]``, the calibrated
mean row in rotated coordinates (the 0-bit columns, in column order).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

FORMAT_NAME = "vllm-kvq"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TENSORS = "tensors.safetensors"
GRANULARITIES = ("layer", "kv_head")
ORTHOGONALITY_TOL = 1e-3
TIER_BITS = (0, 2, 4)
TIER_WIDTH_STEP = 8
TIER_EXAMPLE = "k=48x4,80x2;v=16x4,48x2,64x0"

Tiers = dict[str, list[tuple[int, int]]]


class ArtifactError(ValueError):
    """An artifact that must not be served; the message names the fix."""


def read_tensors(path: Path, where: str, fix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of an artifact's safetensors file (no pickle involved)."""
    if not (path / TENSORS).is_file():
        raise ArtifactError(f"{where}: no {TENSORS}{fix}")
    from safetensors import safe_open

    with safe_open(str(path / TENSORS), framework="pt") as f:
        return {key: f.get_tensor(key) for key in f.keys()}


def read_manifest(path: Path, fix: str) -> dict:
    """manifest.json of an artifact directory, with format and version checked.

    ``fix`` tells the user what to point where when there is no manifest.
    """
    where = f"artifact {path}"
    if not (path / MANIFEST).is_file():
        raise ArtifactError(f"{where}: no {MANIFEST}; {fix}")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{where}: {MANIFEST} is not valid JSON ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        got = manifest.get("format") if isinstance(manifest, dict) else None
        raise ArtifactError(f"{where}: format {got!r} is not {FORMAT_NAME!r}")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ArtifactError(
            f"{where}: unknown format_version {version!r}; this vllm-kvq reads "
            f"version {FORMAT_VERSION}. Re-run `vllm-kvq calibrate` or upgrade vllm-kvq"
        )
    return manifest


def check_tiers(tiers: Tiers, head_dim: int, where: str = "--tiers") -> None:
    """Raise ArtifactError unless ``tiers`` is a valid plan for rows of ``head_dim``."""
    if not isinstance(tiers, dict) or sorted(tiers) != ["k", "v"]:
        got = sorted(tiers) if isinstance(tiers, dict) else type(tiers).__name__
        raise ArtifactError(f"{where}: tiers need exactly the kinds 'k' and 'v' (got {got}); "
                            f"e.g. {TIER_EXAMPLE!r}, or v=128x2 for one INT2 tier")
    for kind in ("k", "v"):
        plan = tiers[kind]
        if not plan:
            raise ArtifactError(f"{where}: {kind} has no tiers; give (width, bits) pairs, e.g. {TIER_EXAMPLE!r}")
        for width, bits in plan:
            if bits not in TIER_BITS:
                raise ArtifactError(f"{where}: {kind} tier {width}x{bits} has {bits} bits; "
                                    f"bits must be one of {list(TIER_BITS)}")
            if width <= 0 or width % TIER_WIDTH_STEP:
                raise ArtifactError(f"{where}: {kind} tier {width}x{bits} has width {width}; widths must be "
                                    f"positive multiples of {TIER_WIDTH_STEP}")
        total = sum(w for w, _ in plan)
        if total != head_dim:
            raise ArtifactError(f"{where}: {kind} tier widths sum to {total}, not head_dim {head_dim}; "
                                f"make the widths add up to {head_dim}")


def parse_tiers(spec: str) -> Tiers:
    """``"k=48x4,80x2;v=16x4,48x2,64x0"`` -> ``{"k": [(48, 4), (80, 2)], "v": [...]}`` (syntax only;
    :func:`check_tiers` checks the plan against a head_dim)."""
    tiers: Tiers = {}
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        kind, eq, body = part.partition("=")
        kind = kind.strip()
        if not eq or kind not in ("k", "v"):
            raise ArtifactError(f"--tiers: cannot read {part!r}; write KIND=WIDTHxBITS,... for k and v, "
                                f"e.g. {TIER_EXAMPLE!r}")
        if kind in tiers:
            raise ArtifactError(f"--tiers: {kind} is given twice; give each of k and v once")
        plan = []
        for item in body.split(","):
            w, x, b = item.strip().partition("x")
            if not x or not w.strip().isdigit() or not b.strip().isdigit():
                raise ArtifactError(f"--tiers: cannot read tier {item.strip()!r} of {kind}; write WIDTHxBITS, "
                                    f"e.g. 48x4")
            plan.append((int(w), int(b)))
        tiers[kind] = plan
    return tiers


def tiers_from_json(raw, where: str) -> Tiers:
    """The manifest's ``tiers`` field as {kind: [(width, bits), ...]} (structure checked only)."""
    if not isinstance(raw, dict):
        raise ArtifactError(f"{where}: manifest tiers must be an object like "
                            '{"k": [[48, 4], [80, 2]], "v": [[16, 4], [48, 2], [64, 0]]}')
    out: Tiers = {}
    for kind, plan in raw.items():
        if not isinstance(plan, list) or not all(
                isinstance(t, list) and len(t) == 2 and all(type(x) is int for x in t) for t in plan):
            raise ArtifactError(f"{where}: manifest tiers[{kind!r}] must be a list of [width, bits] integer "
                                f"pairs, got {plan!r}")
        out[kind] = [(w, b) for w, b in plan]
    return out


def zero_width(plan: list[tuple[int, int]]) -> int:
    """Total width of the 0-bit (not stored) tiers of one kind."""
    return sum(w for w, b in plan if b == 0)


def zero_columns(plan: list[tuple[int, int]]) -> list[int]:
    """Rotated-row columns of the 0-bit tiers, in column order."""
    cols, start = [], 0
    for w, b in plan:
        if b == 0:
            cols.extend(range(start, start + w))
        start += w
    return cols


def artifact_kind(directory: str | Path) -> str:
    """'oscar' or 'stepquant' (validated manifest header; ArtifactError otherwise)."""
    return read_manifest(Path(directory), "expected a directory made by `vllm-kvq calibrate`").get("kind", "oscar")


@dataclass
class OscarArtifact:
    """Rotations and clip ratios for every full-attention layer of one model."""

    fingerprint: dict
    head_dim: int
    num_kv_heads: int
    layers: list[int]
    granularity: str
    k_rotation: dict[int, torch.Tensor]
    v_rotation: dict[int, torch.Tensor]
    k_clip: dict[int, float]
    v_clip: dict[int, float]
    group_size: int = 128
    sink: int = 64
    window: int = 256
    provenance: dict = field(default_factory=dict)
    eigenvalues: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)
    """Optional spectra of the fitted covariances: {"k"|"v": {layer: [D] or [H, D]}}."""
    tiers: Tiers | None = None
    """Tiered rows: {"k"|"v": [(width, bits), ...]}, strongest columns first; None = plain OSCAR."""
    fill: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)
    """Means of the 0-bit tiers in rotated coordinates: {"k"|"v": {layer: [H, width0]}}."""
    source: str = "<memory>"

    # ------------------------------------------------------------------ I/O
    def save(self, directory: str | Path) -> Path:
        from safetensors.torch import save_file

        self.validate()
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for layer in self.layers:
            tensors[f"k_rotation.{layer}"] = self.k_rotation[layer].float().contiguous()
            tensors[f"v_rotation.{layer}"] = self.v_rotation[layer].float().contiguous()
        for kind, table in self.eigenvalues.items():
            for layer, ev in table.items():
                tensors[f"{kind}_eigenvalues.{layer}"] = ev.float().contiguous()
        if self.tiers is not None:
            for kind, table in self.fill.items():
                for layer, f in table.items():
                    tensors[f"{kind}_fill.{layer}"] = f.float().contiguous()
        save_file(tensors, str(out / TENSORS))
        manifest = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "kind": "oscar",
            "model_fingerprint": self.fingerprint,
            "head_dim": self.head_dim,
            "num_kv_heads": self.num_kv_heads,
            "layers": self.layers,
            "granularity": self.granularity,
            "group_size": self.group_size,
            "sink": self.sink,
            "window": self.window,
            "k_clip": {str(k): v for k, v in self.k_clip.items()},
            "v_clip": {str(k): v for k, v in self.v_clip.items()},
            "provenance": self.provenance,
        }
        if self.tiers is not None:
            manifest["tiers"] = {kind: [[w, b] for w, b in self.tiers[kind]] for kind in ("k", "v")}
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        return out

    @classmethod
    def load(cls, directory: str | Path, expected_fingerprint: dict | None = None) -> "OscarArtifact":
        """Read and validate an artifact; raise ArtifactError on any defect."""
        path = Path(directory)
        where = f"artifact {path}"
        manifest = read_manifest(path, "point kvq.artifact at a directory made by `vllm-kvq calibrate`")
        kind = manifest.get("kind", "oscar")
        if kind == "stepquant":
            raise ArtifactError(
                f"{where} is a STEPQuant state plan (kind 'stepquant'), not an OSCAR KV-cache artifact; "
                "pass it as kvq.state_artifact"
            )
        if kind != "oscar":
            raise ArtifactError(f"{where}: unknown artifact kind {kind!r}; expected 'oscar'")
        required = ("model_fingerprint", "head_dim", "num_kv_heads", "layers", "granularity", "k_clip", "v_clip")
        missing = [k for k in required if k not in manifest]
        if missing:
            raise ArtifactError(f"{where}: manifest lacks {missing}")
        tensors = read_tensors(path, where)
        layers = [int(x) for x in manifest["layers"]]
        tiers = tiers_from_json(manifest["tiers"], where) if "tiers" in manifest else None
        fill = {}
        if tiers is not None:
            for kind, plan in tiers.items():
                if zero_width(plan):
                    fill[kind] = {}
                    for layer in layers:
                        key = f"{kind}_fill.{layer}"
                        if key not in tensors:
                            raise ArtifactError(
                                f"{where}: missing tensor {key!r}: the {kind} tiers have a 0-bit tier, whose "
                                "calibrated mean it holds; re-run `vllm-kvq calibrate --tiers ...`")
                        fill[kind][layer] = tensors[key]

        def per_layer(kind: str) -> dict[int, torch.Tensor]:
            out = {}
            for layer in layers:
                key = f"{kind}.{layer}"
                if key not in tensors:
                    raise ArtifactError(f"{where}: missing tensor {key!r} for layer {layer}")
                out[layer] = tensors[key]
            return out

        def clips(kind: str) -> dict[int, float]:
            raw = manifest[kind]
            if isinstance(raw, (int, float)):
                return {layer: float(raw) for layer in layers}
            return {int(k): float(v) for k, v in raw.items()}

        art = cls(
            fingerprint=manifest["model_fingerprint"],
            head_dim=int(manifest["head_dim"]),
            num_kv_heads=int(manifest["num_kv_heads"]),
            layers=layers,
            granularity=manifest["granularity"],
            k_rotation=per_layer("k_rotation"),
            v_rotation=per_layer("v_rotation"),
            k_clip=clips("k_clip"),
            v_clip=clips("v_clip"),
            group_size=int(manifest.get("group_size", 128)),
            sink=int(manifest.get("sink", 64)),
            window=int(manifest.get("window", 256)),
            provenance=manifest.get("provenance", {}),
            eigenvalues={
                kind: {layer: tensors[f"{kind}_eigenvalues.{layer}"] for layer in layers
                       if f"{kind}_eigenvalues.{layer}" in tensors}
                for kind in ("k", "v")
            },
            tiers=tiers,
            fill=fill,
            source=str(path),
        )
        art.validate()
        if expected_fingerprint is not None:
            art.check_model(expected_fingerprint)
        return art

    # ----------------------------------------------------------- validation
    def validate(self) -> None:
        where = f"artifact {self.source}"
        if self.granularity not in GRANULARITIES:
            raise ArtifactError(f"{where}: granularity {self.granularity!r} not in {GRANULARITIES}")
        d, h = self.head_dim, self.num_kv_heads
        want = (d, d) if self.granularity == "layer" else (h, d, d)
        for kind, table in (("k_rotation", self.k_rotation), ("v_rotation", self.v_rotation)):
            for layer in self.layers:
                r = table[layer]
                name = f"{kind}.{layer}"
                if tuple(r.shape) != want:
                    raise ArtifactError(
                        f"{where}: {name} has shape {tuple(r.shape)}, expected {want} "
                        f"(granularity {self.granularity}, head_dim {d}, {h} KV heads)"
                    )
                # numpy, not torch: vLLM forks its engine after this runs in
                # the parent, and a child hangs if the parent used torch's
                # OpenMP pool (numpy's BLAS threads are fork-safe).
                r64 = r.float().numpy().astype(np.float64)
                if not np.isfinite(r64).all():
                    raise ArtifactError(f"{where}: {name} contains NaN or Inf")
                err = float(np.abs(np.swapaxes(r64, -1, -2) @ r64 - np.eye(d)).max())
                if err > ORTHOGONALITY_TOL:
                    raise ArtifactError(
                        f"{where}: {name} is not orthogonal (max |R^T R - I| = {err:.3g} > "
                        f"{ORTHOGONALITY_TOL}); re-run calibration"
                    )
        for kind, table in (("k_clip", self.k_clip), ("v_clip", self.v_clip)):
            for layer in self.layers:
                if layer not in table:
                    raise ArtifactError(f"{where}: {kind} has no entry for layer {layer}")
                c = table[layer]
                if not (math.isfinite(c) and 0.0 < c <= 1.0):
                    raise ArtifactError(f"{where}: {kind}[{layer}] = {c} is not in (0, 1]")
        if self.tiers is not None:
            self._validate_tiers(where)

    def _validate_tiers(self, where: str) -> None:
        if self.granularity != "kv_head":
            raise ArtifactError(f"{where}: tiers need granularity 'kv_head', not {self.granularity!r}; "
                                "re-run `vllm-kvq calibrate --tiers ... --granularity kv_head`")
        check_tiers(self.tiers, self.head_dim, f"{where}: tiers")
        for kind in ("k", "v"):
            w0 = zero_width(self.tiers[kind])
            if not w0:
                continue
            want = (self.num_kv_heads, w0)
            for layer in self.layers:
                f = self.fill.get(kind, {}).get(layer)
                name = f"{kind}_fill.{layer}"
                if f is None:
                    raise ArtifactError(f"{where}: missing tensor {name!r} for the 0-bit {kind} tier(s); "
                                        "re-run `vllm-kvq calibrate --tiers ...`")
                if tuple(f.shape) != want:
                    raise ArtifactError(f"{where}: {name} has shape {tuple(f.shape)}, expected {want} "
                                        f"({self.num_kv_heads} KV heads, {w0} 0-bit columns)")
                if not np.isfinite(f.float().numpy()).all():
                    raise ArtifactError(f"{where}: {name} contains NaN or Inf")

    def check_model(self, fingerprint: dict) -> None:
        """Fail unless this artifact was made for a model with this fingerprint."""
        where = f"artifact {self.source}"
        diffs = {
            k: (self.fingerprint.get(k), v)
            for k, v in fingerprint.items()
            if k != "attention_layers" and self.fingerprint.get(k) != v
        }
        if diffs:
            detail = ", ".join(f"{k}: artifact {a!r} vs model {b!r}" for k, (a, b) in diffs.items())
            raise ArtifactError(
                f"{where} was calibrated for a different model ({detail}); "
                "calibrate this model with `vllm-kvq calibrate`"
            )
        want_layers = fingerprint.get("attention_layers")
        if want_layers is not None and sorted(self.layers) != sorted(want_layers):
            missing = sorted(set(want_layers) - set(self.layers))
            raise ArtifactError(f"{where}: missing layers {missing} of the model's attention layers")

    # --------------------------------------------------------------- access
    def rotation_for(self, kind: str, layer: int, kv_heads: list[int]) -> torch.Tensor:
        """``[len(kv_heads), D, D]`` fp32 rotations of the given global KV heads."""
        table = self.k_rotation if kind == "k" else self.v_rotation
        if layer not in table:
            raise ArtifactError(f"artifact {self.source}: no rotation for layer {layer}")
        r = table[layer].float()
        if r.dim() == 2:
            return r.unsqueeze(0).expand(len(kv_heads), -1, -1).contiguous()
        return r[kv_heads].contiguous()

    def fill_for(self, kind: str, layer: int, kv_heads: list[int]) -> torch.Tensor | None:
        """``[len(kv_heads), width0]`` fp32 means of the 0-bit columns of the given global
        KV heads (rotated coordinates, column order); None without a 0-bit ``kind`` tier."""
        if self.tiers is None or not zero_width(self.tiers[kind]):
            return None
        table = self.fill.get(kind, {})
        if layer not in table:
            raise ArtifactError(f"artifact {self.source}: no {kind} fill for layer {layer}")
        return table[layer].float()[kv_heads].contiguous()
