"""Turn settings plus the served model into the artifact every layer uses."""

from __future__ import annotations

import dataclasses
import functools
import json

from vllm_kvq.artifacts import ArtifactError, OscarArtifact, builtin_artifact, model_fingerprint
from vllm_kvq.settings import OscarSettings


def resolve_artifact(settings: OscarSettings, hf_config) -> OscarArtifact:
    """The validated artifact for this model, loaded once per process.

    Raises ArtifactError naming the defect: wrong model, missing layers, wrong
    shapes, non-orthogonal or NaN matrices, unknown version.
    """
    fingerprint = json.dumps(model_fingerprint(hf_config), sort_keys=True)
    return _resolve(settings, fingerprint)


@functools.lru_cache(maxsize=8)
def _resolve(settings: OscarSettings, fingerprint_json: str) -> OscarArtifact:
    fingerprint = json.loads(fingerprint_json)
    loaded = OscarArtifact.load(settings.artifact, fingerprint) if settings.artifact else None
    if settings.rotation_mode == "artifact":
        art = loaded
    else:
        art = builtin_artifact(fingerprint, settings.rotation_mode)
        if loaded is not None:
            art.k_clip, art.v_clip = dict(loaded.k_clip), dict(loaded.v_clip)
    if settings.k_clip is not None:
        art = dataclasses.replace(art, k_clip={i: settings.k_clip for i in art.layers})
    if settings.v_clip is not None:
        art = dataclasses.replace(art, v_clip={i: settings.v_clip for i in art.layers})
    if art.head_dim % settings.group_size:
        raise ArtifactError(
            f"kvq.group_size {settings.group_size} does not divide head_dim {art.head_dim}"
        )
    return art
