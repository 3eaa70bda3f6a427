"""Artifact schema v1: what calibration writes and the backends load.

An artifact is a directory::

    manifest.json        format, version, model fingerprint, layout, clip ratios
    tensors.safetensors  k_rotation.<layer>, v_rotation.<layer>   (fp32)

Rotations act on row vectors (``x @ R``) after RoPE and are orthogonal. Each is
``[D, D]`` (granularity ``layer``, shared by the layer's KV heads) or
``[H_kv, D, D]`` (granularity ``kv_head``), with H_kv the model's total KV
heads; tensor-parallel ranks slice their own heads. No pickle is involved:
safetensors and JSON only.
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
