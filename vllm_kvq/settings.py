"""User settings, read from vLLM's ``additional_config["kvq"]``.

``additional_config`` reaches every process vLLM starts, but some backend hooks
(``customize_spec``) run without a config in context, so the first settings
seen in a process are cached here and served to those hooks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

CONFIG_KEY = "kvq"
ROTATION_MODES = ("artifact", "none", "hadamard")
KERNELS = ("auto", "reference", "triton")
STATE_POOLS = ("stepquant", "uniform")
STEPQUANT_BITS = (6, 4)
UNIFORM_BITS = (4, 6, 8, 16)
SCHEMES = ("oscar", "kivi", "tiered")


class SettingsError(ValueError):
    """A bad ``--additional-config '{"kvq": ...}'`` value."""


@dataclass(frozen=True)
class OscarSettings:
    """Every key of ``additional_config["kvq"]`` (see docs/configuration.md)."""

    artifact: str | None = None
    """Directory of a calibrated artifact (schema v1). Required for rotation
    ``artifact``; with ``none``/``hadamard`` it may still supply clip ratios."""

    rotation: str | None = None
    """``artifact`` (the calibrated R_K/R_V), ``none`` (identity: naive INT2) or
    ``hadamard`` (data-free Sylvester Hadamard). Default: ``artifact`` when an
    artifact is given, else ``hadamard``."""

    group_size: int = 128
    """Elements sharing one fp16 (scale, min) pair; 128 or 64 for D=128."""

    sink: int = 64
    """First tokens of every sequence kept in BF16."""

    window: int = 256
    """Most recent tokens of every sequence kept in BF16."""

    k_clip: float | None = None
    """Per-token clip ratio for keys (1.0 = off). Default: the artifact's, else 1.0."""

    v_clip: float | None = None
    """Per-token clip ratio for values. Default: the artifact's, else 1.0."""

    kernels: str = "auto"
    """``auto``: Triton on CUDA, the PyTorch reference elsewhere. ``reference``:
    the reference everywhere (slow; for debugging). ``triton``: Triton
    everywhere (on CPU only under ``TRITON_INTERPRET=1``, for tests). For the
    ``state`` pool on CUDA: decode steps run the fused STEPQuant step unless
    this is ``reference`` (staged through vLLM's own ops, as prefill always is)."""

    scheme: str = "oscar"
    """``oscar``: rows quantized per token (keys after rotation). ``kivi``: keys
    unrotated and quantized per channel over ``key_group`` positions, values per
    token (rotated only if a rotation is asked for); PyTorch reference ops only.
    ``tiered``: each rotated row cut into tiers of directions at 4, 2 or 0 bits,
    as the artifact says (``vllm-kvq calibrate --tiers``); reference ops only."""

    key_group: int = 32
    """``kivi`` only: positions sharing one per-channel key (scale, min) pair."""

    key_pairs: str = "fp16"
    """``kivi`` only: ``fp16`` (scale, min) per channel and key group, or
    ``int8`` (min, max) in steps of one fp16 step per group and head."""

    state: str | None = None
    """Gated-delta-net state pool: ``None`` keeps vLLM's own (FP32) states,
    ``stepquant`` stores them with the calibrated plan of ``state_artifact``,
    ``uniform`` stores every head at ``state_bits`` with one absmax scale per
    key row (the baseline; 16 = FP16). Independent of the attention backend."""

    state_artifact: str | None = None
    """Directory of a STEPQuant plan (``vllm-kvq calibrate --stepquant``)."""

    state_bits: int = 6
    """Nominal bits per state value: 6 or 4 for ``stepquant`` (the plan holds
    both), 4, 6, 8 or 16 for ``uniform``."""

    speculative_tokens: int = 0
    """Not a kvq key: draft tokens per step, from vLLM's speculative config
    (the BF16 ring keeps that many spare slots)."""

    @property
    def rotation_mode(self) -> str:
        if self.rotation is not None:
            return self.rotation
        if self.artifact:
            return "artifact"
        return "none" if self.scheme == "kivi" else "hadamard"

    @classmethod
    def from_dict(cls, raw: dict | None) -> "OscarSettings":
        raw = dict(raw or {})
        known = {f.name for f in dataclasses.fields(cls)} - {"speculative_tokens"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise SettingsError(
                f"unknown key(s) {unknown} in additional_config['{CONFIG_KEY}']; "
                f"valid keys are {sorted(known)}"
            )
        s = cls(**raw)
        s.validate()
        return s

    def validate(self) -> None:
        if self.rotation is not None and self.rotation not in ROTATION_MODES:
            raise SettingsError(
                f"kvq.rotation must be one of {ROTATION_MODES}, got {self.rotation!r}"
            )
        if self.scheme not in SCHEMES:
            raise SettingsError(f"kvq.scheme must be one of {SCHEMES}, got {self.scheme!r}")
        if self.scheme == "kivi":
            self._validate_kivi()
        if self.kernels not in KERNELS:
            raise SettingsError(f"kvq.kernels must be one of {KERNELS}, got {self.kernels!r}")
        if self.scheme == "tiered" and (self.rotation_mode != "artifact" or self.group_size != 128):
            raise SettingsError(
                "kvq.scheme 'tiered' takes its tiers and rotations from kvq.artifact (made with "
                "`vllm-kvq calibrate --tiers ...`): drop kvq.rotation and kvq.group_size"
            )
        if self.rotation_mode == "artifact" and not self.artifact:
            raise SettingsError(
                "kvq.rotation='artifact' needs kvq.artifact=<dir> "
                "(make one with `vllm-kvq calibrate`), or use rotation 'hadamard'/'none'"
            )
        if self.scheme != "kivi" and (self.key_group != 32 or self.key_pairs != "fp16"):
            raise SettingsError(
                "kvq.key_group and kvq.key_pairs apply to scheme 'kivi' only; drop them or set kvq.scheme 'kivi'"
            )
        for name in ("group_size", "sink", "window"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise SettingsError(f"kvq.{name} must be a non-negative int, got {value!r}")
        if self.group_size == 0:
            raise SettingsError("kvq.group_size must be positive")
        self._validate_state()
        for name in ("k_clip", "v_clip"):
            value = getattr(self, name)
            if value is not None and not (0.0 < float(value) <= 1.0):
                raise SettingsError(f"kvq.{name} must be in (0, 1], got {value!r}")

    def _validate_state(self) -> None:
        if self.state is None:
            if self.state_artifact:
                raise SettingsError("kvq.state_artifact is set but kvq.state is not; add \"state\": \"stepquant\"")
            return
        if self.state not in STATE_POOLS:
            raise SettingsError(f"kvq.state must be one of {STATE_POOLS} (or absent), got {self.state!r}")
        allowed = STEPQUANT_BITS if self.state == "stepquant" else UNIFORM_BITS
        if self.state_bits not in allowed:
            raise SettingsError(f"kvq.state_bits must be one of {allowed} for state {self.state!r}, got {self.state_bits!r}")
        if self.state == "stepquant" and not self.state_artifact:
            raise SettingsError(
                "kvq.state='stepquant' needs kvq.state_artifact=<dir> (make one with "
                "`vllm-kvq calibrate MODEL --data FILE --out DIR --stepquant`), or use state 'uniform'"
            )


    def _validate_kivi(self) -> None:
        if not isinstance(self.key_group, int) or isinstance(self.key_group, bool) or self.key_group < 1:
            raise SettingsError(f"kvq.key_group must be a positive int, got {self.key_group!r}")
        if self.key_pairs not in ("fp16", "int8"):
            raise SettingsError(f"kvq.key_pairs must be 'fp16' or 'int8', got {self.key_pairs!r}")
        if self.k_clip not in (None, 1.0):
            raise SettingsError(
                "kvq.scheme 'kivi' quantizes keys per channel, so per-token key clipping does not "
                "apply: drop kvq.k_clip"
            )


_cached: OscarSettings | None = None


def from_vllm_config(vllm_config) -> OscarSettings:
    """Parse (and cache for this process) the settings of a VllmConfig."""
    global _cached
    extra = getattr(vllm_config, "additional_config", None) or {}
    speculative = getattr(vllm_config, "speculative_config", None)
    drafts = (getattr(speculative, "num_speculative_tokens", None) or 0) if speculative is not None else 0
    _cached = dataclasses.replace(OscarSettings.from_dict(extra.get(CONFIG_KEY)), speculative_tokens=drafts)
    return _cached


def current() -> OscarSettings:
    """Settings of this process: from the active vLLM config if there is one,
    else the last ones seen."""
    from vllm.config import get_current_vllm_config_or_none

    cfg = get_current_vllm_config_or_none()
    if cfg is not None:
        return from_vllm_config(cfg)
    if _cached is None:
        return OscarSettings()
    return _cached
