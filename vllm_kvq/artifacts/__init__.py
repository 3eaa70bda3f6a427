"""One artifact schema (v1) for everything calibration produces."""

from vllm_kvq.artifacts.builtin import builtin_artifact, hadamard
from vllm_kvq.artifacts.fingerprint import attention_layers, model_fingerprint
from vllm_kvq.artifacts.schema import FORMAT_VERSION, ArtifactError, OscarArtifact, artifact_kind
from vllm_kvq.artifacts.stepquant import StepQuantPlan

__all__ = [
    "ArtifactError",
    "FORMAT_VERSION",
    "OscarArtifact",
    "StepQuantPlan",
    "artifact_kind",
    "attention_layers",
    "builtin_artifact",
    "hadamard",
    "model_fingerprint",
]
