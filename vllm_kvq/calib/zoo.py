"""Import the OSCAR authors' RotationZoo ``.pt`` files into an OSCAR INT2 artifact.

The files hold plain dicts of tensors (``format_version`` 1: one ``[D, D]``
rotation per layer; 2: ``[H_kv, D, D]`` per KV head). They are read with
``torch.load(weights_only=True)``, which refuses to run pickled code.
"""

from __future__ import annotations

import torch

from vllm_kvq.artifacts import ArtifactError, OscarArtifact


def read_zoo(path: str) -> dict[int, torch.Tensor]:
    import pickle

    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ArtifactError(f"{path}: holds more than plain tensors (pickled objects, which are never run); ask "
                            "for a RotationZoo file of dicts of tensors, or re-save it with tensors only") from e
    if not isinstance(blob, dict) or "layers" not in blob:
        raise ArtifactError(f"{path}: not a RotationZoo file (no 'layers')")
    version = blob.get("format_version", 1)
    if version not in (1, 2):
        raise ArtifactError(f"{path}: unknown RotationZoo format_version {version}")
    return {int(key): torch.as_tensor(entry["rotation"] if isinstance(entry, dict) else entry).float()
            for key, entry in blob["layers"].items()}


def import_zoo(k_path: str, v_path: str, fingerprint: dict, k_clip: float = 0.96, v_clip: float = 0.92,
               out: str | None = None) -> OscarArtifact:
    k, v = read_zoo(k_path), read_zoo(v_path)
    layers = sorted(k)
    if sorted(v) != layers:
        raise ArtifactError(f"{k_path} and {v_path} cover different layers")
    dims = {k[i].dim() for i in layers} | {v[i].dim() for i in layers}
    if len(dims) != 1:
        raise ArtifactError("RotationZoo files mix per-layer and per-KV-head rotations")
    art = OscarArtifact(
        fingerprint=fingerprint, head_dim=fingerprint["head_dim"], num_kv_heads=fingerprint["num_key_value_heads"],
        layers=layers, granularity="layer" if dims == {2} else "kv_head", k_rotation=k, v_rotation=v,
        k_clip={i: k_clip for i in layers}, v_clip={i: v_clip for i in layers},
        provenance={"imported_from": [str(k_path), str(v_path)]}, source=str(k_path),
    )
    art.validate()
    art.check_model(fingerprint)
    if out:
        art.save(out)
    return art
