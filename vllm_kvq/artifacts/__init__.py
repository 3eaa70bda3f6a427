"""Artifacts: what calibration writes and serving loads, in one container."""

from vllm_kvq.artifacts.builtin import builtin_artifact, hadamard
from vllm_kvq.artifacts.container import FORMAT_VERSION, ArtifactError
from vllm_kvq.artifacts.fingerprint import attention_layers, model_fingerprint
from vllm_kvq.artifacts.oscar import OscarArtifact
from vllm_kvq.artifacts.stepquant import StepQuantPlan

__all__ = ["ArtifactError", "FORMAT_VERSION", "OscarArtifact", "StepQuantPlan", "attention_layers", "builtin_artifact",
           "hadamard", "model_fingerprint"]
