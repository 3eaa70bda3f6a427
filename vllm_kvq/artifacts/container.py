"""The one artifact container: a directory with ``manifest.json`` (format,
version, kind, model fingerprint, fields of the kind) and
``tensors.safetensors``. Every kind is read and checked here, so a bad
directory gets the same message whatever reads it. No pickle is involved:
JSON and safetensors only.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

FORMAT_NAME = "vllm-kvq"
FORMAT_VERSION = 2
READS = (1, 2)
"""Versions this release reads: 1 (tiers, if any, the same for every layer) and 2."""
MANIFEST = "manifest.json"
TENSORS = "tensors.safetensors"
HEAD = ("format", "format_version", "kind")
MAKE = {"oscar": "`vllm-kvq calibrate MODEL --data FILE --out DIR`",
        "stepquant": "`vllm-kvq calibrate MODEL --data FILE --out DIR --stepquant`"}
SETTING = {"oscar": "kvq.artifact", "stepquant": "kvq.state_artifact"}
WHAT = {"oscar": "an OSCAR KV-cache artifact", "stepquant": "a STEPQuant state plan"}


class ArtifactError(ValueError):
    """An artifact that must not be served; the message names the fix."""


def header(directory: str | Path, fix: str = "expected a directory made by `vllm-kvq calibrate`") -> dict:
    """The manifest of an artifact directory, its format and version checked."""
    path = Path(directory)
    where = f"artifact {path}"
    if not (path / MANIFEST).is_file():
        raise ArtifactError(f"{where}: no {MANIFEST}; {fix}")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{where}: {MANIFEST} is not valid JSON ({e}); {fix}") from e
    got = manifest.get("format") if isinstance(manifest, dict) else None
    if got != FORMAT_NAME:
        raise ArtifactError(f"{where}: format {got!r} is not {FORMAT_NAME!r}; {fix}")
    if (version := manifest.get("format_version")) not in READS:
        raise ArtifactError(f"{where}: unknown format_version {version!r}; this vllm-kvq reads versions "
                            f"{list(READS)}. Re-run `vllm-kvq calibrate` or upgrade vllm-kvq")
    return manifest


def kind_of(directory: str | Path) -> str:
    """``oscar`` or ``stepquant``: the kind of the artifact at ``directory``."""
    return header(directory).get("kind", "oscar")


def read_manifest(directory: str | Path, kind: str, required: tuple[str, ...], optional: tuple[str, ...]) -> dict:
    """The manifest of an artifact of ``kind``, with its format, version, kind
    and fields checked: all ``required`` present, nothing but those and ``optional``."""
    where = f"artifact {Path(directory)}"
    manifest = header(directory, f"point {SETTING[kind]} at a directory made by {MAKE[kind]}")
    got = manifest.get("kind", "oscar")
    if got != kind:
        if got in WHAT:
            raise ArtifactError(f"{where} is {WHAT[got]} (kind {got!r}), not {WHAT[kind]}; pass it as "
                                f"{SETTING[got]}, and make {WHAT[kind]} with {MAKE[kind]}")
        raise ArtifactError(f"{where}: unknown artifact kind {got!r}; expected {kind!r}")
    if missing := [k for k in required if k not in manifest]:
        raise ArtifactError(f"{where}: manifest lacks {missing}; re-run {MAKE[kind]}")
    if unknown := sorted(set(manifest) - set(HEAD) - set(required) - set(optional)):
        raise ArtifactError(f"{where}: unknown manifest field(s) {unknown}; this vllm-kvq does not know what they "
                            f"ask for: re-run {MAKE[kind]} or upgrade vllm-kvq")
    return manifest


def read(directory: str | Path, kind: str, required: tuple[str, ...],
         optional: tuple[str, ...]) -> tuple[dict, dict[str, torch.Tensor]]:
    """(manifest, tensors) of an artifact of ``kind`` (see :func:`read_manifest`)."""
    from safetensors import safe_open

    manifest, where = read_manifest(directory, kind, required, optional), Path(directory)
    path = where / TENSORS
    if not path.is_file():
        raise ArtifactError(f"artifact {where}: no {TENSORS}; re-run {MAKE[kind]}")
    try:
        with safe_open(str(path), framework="pt") as f:
            return manifest, {key: f.get_tensor(key) for key in f.keys()}
    except Exception as e:  # safetensors raises its own error types for truncated or foreign files
        raise ArtifactError(f"artifact {where}: {TENSORS} cannot be read ({e}); re-run {MAKE[kind]}") from e


def per_layer(tensors: dict, name: str, layers: list[int], where: str, required: bool = False) -> dict:
    """``{layer: tensors["<name>.<layer>"]}``; a missing one is an error if ``required``."""
    missing = [layer for layer in layers if f"{name}.{layer}" not in tensors]
    if required and missing:
        raise ArtifactError(f"{where}: missing tensor '{name}.{missing[0]}' for layer {missing[0]}")
    return {layer: tensors[f"{name}.{layer}"] for layer in layers if layer not in missing}


def write(directory: str | Path, kind: str, manifest: dict, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / TENSORS))
    head = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "kind": kind}
    (out / MANIFEST).write_text(json.dumps({**head, **manifest}, indent=2) + "\n")
    return out


def check_fingerprint(where: str, calibrated: dict, model: dict, kind: str) -> None:
    """Fail unless the artifact's fingerprint matches the model's (layer
    coverage is each kind's own check)."""
    if diffs := {k: (calibrated.get(k), v) for k, v in model.items()
                 if k != "attention_layers" and calibrated.get(k) != v}:
        detail = ", ".join(f"{k}: artifact {a!r} vs model {b!r}" for k, (a, b) in diffs.items())
        raise ArtifactError(f"{where} was calibrated for a different model ({detail}); calibrate this model "
                            f"with {MAKE[kind]}")


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """fp64 numpy copy without torch kernels: vLLM forks its engine after
    validating in the parent, and a child hangs if the parent used torch's
    OpenMP pool (numpy is fork-safe)."""
    t = t.detach().cpu()
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy().astype(np.float64)


def checked(where: str, name: str, t: torch.Tensor, shape: tuple, detail: str = "") -> np.ndarray:
    """``t`` as fp64 numpy, or ArtifactError unless it has ``shape`` and no NaN or Inf."""
    if tuple(t.shape) != tuple(shape):
        raise ArtifactError(f"{where}: {name} has shape {tuple(t.shape)}, expected {tuple(shape)}{detail}")
    x = as_numpy(t)
    if not np.isfinite(x).all():
        raise ArtifactError(f"{where}: {name} contains NaN or Inf; re-run `vllm-kvq calibrate`")
    return x
