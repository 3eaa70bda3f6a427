"""User settings, read from vLLM's ``additional_config["kvq"]``.

``additional_config`` reaches every process vLLM starts, but some backend hooks
(``customize_spec``) run without a config in context, so the first settings
seen in a process are cached here and served to those hooks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from vllm_kvq.backends.schemes import SCHEMES
from vllm_kvq.kernels.stepquant.format import BUDGETS

CONFIG_KEY = "kvq"
ROTATION_MODES = ("artifact", "none", "hadamard")
KERNELS = ("auto", "reference", "triton")
STATE_POOLS = ("stepquant", "uniform")
UNIFORM_BITS = (4, 6, 8, 16)
RETIRED = {
    "group_size": "each stored tier of a row is one quantization group; choose the tiers when calibrating "
                  "(`vllm-kvq calibrate --bytes-per-token N` or `--tiers ...`)",
}


class SettingsError(ValueError):
    """A bad ``--additional-config '{"kvq": ...}'`` value."""


@dataclass(frozen=True)
class OscarSettings:
    """Every key of ``additional_config["kvq"]`` (see docs/configuration.md)."""

    artifact: str | None = None
    """Directory of a calibrated artifact. Required for rotation ``artifact``;
    with ``none``/``hadamard`` it may still supply clip ratios, sink and window."""

    rotation: str | None = None
    """``artifact`` (the calibrated R_K/R_V), ``none`` (identity: naive INT2) or
    ``hadamard`` (data-free Sylvester Hadamard). Default: ``artifact`` when an
    artifact is given, else ``hadamard``."""

    sink: int | None = None
    """First tokens of every sequence kept in BF16. Default: the artifact's, else 64."""

    window: int | None = None
    """Most recent tokens of every sequence kept in BF16. Default: the artifact's, else 256."""

    k_clip: float | None = None
    """Per-token clip ratio of the keys' INT2 tier (1.0 = off). Default: the artifact's, else 1.0."""

    v_clip: float | None = None
    """Per-token clip ratio of the values' INT2 tier. Default: the artifact's, else 1.0."""

    override_artifact: bool = False
    """Serve with a sink, window or clip ratio other than the artifact was
    calibrated with (otherwise such a setting fails at start)."""

    kernels: str = "auto"
    """``auto``: Triton on CUDA, the PyTorch reference elsewhere. ``reference``:
    the reference everywhere (slow; for debugging). ``triton``: Triton
    everywhere (on CPU only under ``TRITON_INTERPRET=1``, for tests). For the
    ``state`` pool on CUDA: decode steps run the fused STEPQuant step unless
    this is ``reference`` (staged through vLLM's own ops, as prefill always is)."""

    scheme: str = "oscar"
    """The cache scheme (:mod:`vllm_kvq.backends.schemes`): ``oscar`` (rows
    stored in the artifact's tiers; INT2 everywhere without tiers) or
    ``kivi`` (a reference point: keys per channel, PyTorch reference ops only)."""

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

    @property
    def rotation_mode(self) -> str:
        if self.rotation is not None:
            return self.rotation
        if self.artifact:
            return "artifact"
        return "hadamard" if SCHEMES[self.scheme].rotates_keys else "none"

    @classmethod
    def from_dict(cls, raw: dict | None) -> "OscarSettings":
        raw = dict(raw or {})
        for key, why in RETIRED.items():
            if key in raw:
                raise SettingsError(f"kvq.{key} is no longer a setting: {why}; drop it")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise SettingsError(
                f"unknown key(s) {unknown} in additional_config['{CONFIG_KEY}']; valid keys are {sorted(known)}"
            )
        s = cls(**raw)
        s.validate()
        return s

    def validate(self) -> None:
        if self.rotation is not None and self.rotation not in ROTATION_MODES:
            raise SettingsError(f"kvq.rotation must be one of {ROTATION_MODES}, got {self.rotation!r}")
        if self.scheme not in SCHEMES:
            raise SettingsError(f"kvq.scheme must be one of {sorted(SCHEMES)}, got {self.scheme!r}"
                                + (": a tiered artifact is served by the default scheme 'oscar'; drop kvq.scheme"
                                   if self.scheme == "tiered" else ""))
        scheme = SCHEMES[self.scheme]
        for f in dataclasses.fields(self):
            if f.name in scheme.foreign_keys and getattr(self, f.name) != f.default:
                raise SettingsError(f"kvq.{f.name} does not apply to scheme {self.scheme!r}; drop it"
                                    + (f" or set kvq.scheme {scheme.keys_of(f.name)!r}" if scheme.keys_of(f.name)
                                       else ""))
        scheme.check_settings(self, SettingsError)
        if self.kernels not in KERNELS:
            raise SettingsError(f"kvq.kernels must be one of {KERNELS}, got {self.kernels!r}")
        if self.rotation_mode == "artifact" and not self.artifact:
            raise SettingsError(
                "kvq.rotation='artifact' needs kvq.artifact=<dir> "
                "(make one with `vllm-kvq calibrate`), or use rotation 'hadamard'/'none'"
            )
        for name in ("sink", "window"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise SettingsError(f"kvq.{name} must be a non-negative int, got {value!r}")
        for name in ("k_clip", "v_clip"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 0.0 < float(value) <= 1.0):
                raise SettingsError(f"kvq.{name} must be a number in (0, 1], got {value!r}")
        if not isinstance(self.override_artifact, bool):
            raise SettingsError(f"kvq.override_artifact must be true or false, got {self.override_artifact!r}")
        self._validate_state()

    def _validate_state(self) -> None:
        if self.state is None:
            if self.state_artifact:
                raise SettingsError("kvq.state_artifact is set but kvq.state is not; add \"state\": \"stepquant\"")
            return
        if self.state not in STATE_POOLS:
            raise SettingsError(f"kvq.state must be one of {STATE_POOLS} (or absent), got {self.state!r}")
        allowed = BUDGETS if self.state == "stepquant" else UNIFORM_BITS
        if self.state_bits not in allowed:
            raise SettingsError(f"kvq.state_bits must be one of {allowed} for state {self.state!r}, got {self.state_bits!r}")
        if self.state == "stepquant" and not self.state_artifact:
            raise SettingsError(
                "kvq.state='stepquant' needs kvq.state_artifact=<dir> (make one with "
                "`vllm-kvq calibrate MODEL --data FILE --out DIR --stepquant`), or use state 'uniform'"
            )


_cached: OscarSettings | None = None


def from_vllm_config(vllm_config) -> OscarSettings:
    """Parse (and cache for this process) the settings of a VllmConfig."""
    global _cached
    extra = getattr(vllm_config, "additional_config", None) or {}
    _cached = OscarSettings.from_dict(extra.get(CONFIG_KEY))
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
