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
MAX_REFIT_EVERY = 8  # the held updates take 2 (K + V) bytes a head each
RETIRED = {
    "group_size": "each stored tier of a row is one quantization group; choose the tiers when calibrating "
                  "(`vllm-kvq calibrate --bytes-per-token N` or `--tiers ...`)",
}


class SettingsError(ValueError):
    """A bad ``--additional-config '{"kvq": ...}'`` value."""


@dataclass(frozen=True)
class OscarSettings:
    """Every key of ``additional_config["kvq"]``; docs/configuration.md says
    what each means. ``None``: the artifact's value, else the built-in default."""

    artifact: str | None = None
    rotation: str | None = None  # ROTATION_MODES; default "artifact" with an artifact, else by scheme
    sink: int | None = None
    window: int | None = None
    k_clip: float | None = None
    v_clip: float | None = None
    override_artifact: bool = False  # serve a sink, window or clip other than the artifact's
    kernels: str = "auto"  # KERNELS
    scheme: str = "oscar"  # a key of backends.schemes.SCHEMES
    key_group: int = 32  # kivi only
    key_pairs: str = "fp16"  # kivi only
    state: str | None = None  # STATE_POOLS; None keeps vLLM's own GDN states
    state_artifact: str | None = None
    state_bits: int = 6
    state_refit_every: int = 1  # decode steps a record's fit serves (the others append their rank-1 update)
    speculative_tokens: int = 0  # not a kvq key: vLLM's draft tokens per step (the ring's spare slots)
    draft_token_bytes: int = 0  # not a kvq key: a draft model's BF16 cache, bytes per token of one layer

    @property
    def rotation_mode(self) -> str:
        if self.rotation is not None:
            return self.rotation
        return "artifact" if self.artifact else "hadamard" if SCHEMES[self.scheme].rotates_keys else "none"

    @classmethod
    def from_dict(cls, raw: dict | None) -> "OscarSettings":
        raw = dict(raw or {})
        for key, why in RETIRED.items():
            if key in raw:
                raise SettingsError(f"kvq.{key} is no longer a setting: {why}; drop it")
        known = {f.name for f in dataclasses.fields(cls)} - {"speculative_tokens"}
        if unknown := sorted(set(raw) - known):
            raise SettingsError(f"unknown key(s) {unknown} in additional_config['{CONFIG_KEY}']; valid keys are "
                                f"{sorted(known)}")
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
            raise SettingsError("kvq.rotation='artifact' needs kvq.artifact=<dir> (make one with `vllm-kvq "
                                "calibrate`), or use rotation 'hadamard'/'none'")
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
        if self.state is None and self.state_artifact:
            raise SettingsError("kvq.state_artifact is set but kvq.state is not; add \"state\": \"stepquant\"")
        if self.state is not None and self.state not in STATE_POOLS:
            raise SettingsError(f"kvq.state must be one of {STATE_POOLS} (or absent), got {self.state!r}")
        allowed = BUDGETS if self.state == "stepquant" else UNIFORM_BITS
        if self.state is not None and self.state_bits not in allowed:
            raise SettingsError(f"kvq.state_bits must be one of {allowed} for state {self.state!r}, got "
                                f"{self.state_bits!r}")
        every = self.state_refit_every
        if type(every) is not int or not 1 <= every <= MAX_REFIT_EVERY:
            raise SettingsError(f"kvq.state_refit_every must be an integer from 1 to {MAX_REFIT_EVERY}, got {every!r}")
        if every > 1 and self.state is None:
            raise SettingsError("kvq.state_refit_every is set but kvq.state is not; add \"state\": \"stepquant\"")
        if self.state == "stepquant" and not self.state_artifact:
            raise SettingsError("kvq.state='stepquant' needs kvq.state_artifact=<dir> (make one with `vllm-kvq "
                                "calibrate MODEL --data FILE --out DIR --stepquant`), or use state 'uniform'")


_cached: OscarSettings | None = None


def from_vllm_config(vllm_config) -> OscarSettings:
    """Parse (and cache for this process) the settings of a VllmConfig."""
    global _cached
    spec = getattr(vllm_config, "speculative_config", None)
    drafts = getattr(spec, "num_speculative_tokens", None) or 0
    raw = (getattr(vllm_config, "additional_config", None) or {}).get(CONFIG_KEY)
    _cached = dataclasses.replace(OscarSettings.from_dict(raw), speculative_tokens=drafts,
                                  draft_token_bytes=_draft_token_bytes(spec))
    return _cached


def _draft_token_bytes(spec) -> int:
    """K and V bytes per token of one draft layer on this rank (vLLM's own
    cache, in the draft's dtype); 0 without draft layers (ngram)."""
    draft = getattr(spec, "draft_model_config", None)
    if draft is None:
        return 0
    heads = draft.get_num_kv_heads(spec.draft_parallel_config)
    return 2 * heads * draft.get_head_size() * draft.dtype.itemsize


def current() -> OscarSettings:
    """Settings of this process: from the active vLLM config if there is one,
    else the last ones seen."""
    from vllm.config import get_current_vllm_config_or_none

    cfg = get_current_vllm_config_or_none()
    return from_vllm_config(cfg) if cfg is not None else _cached or OscarSettings()
