"""The cache schemes, one registration each: how a scheme lays out its pages,
which ops run it and what it needs. Settings, start-up checks and the backend
ask this table; adding a scheme is one module of kernels and one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from vllm_kvq.kernels.kivi import reference as kivi
from vllm_kvq.kernels.kivi.format import KiviFormat
from vllm_kvq.kernels.oscar import reference as oscar
from vllm_kvq.kernels.oscar.format import OscarFormat


@dataclass(frozen=True)
class LayerCodec:
    """What a layer's step needs besides its pages: clip ratios, softmax
    scale and the 0-bit tiers' means ``(k, v)`` (each ``[H, width]`` or None)."""

    k_clip: float
    v_clip: float
    scale: float
    fills: tuple = (None, None)


@dataclass(frozen=True)
class Scheme:
    name: str
    rotates_keys: bool  # a per-channel key scheme keeps keys unrotated
    triton: bool  # has Triton store, decode and extend ops (else the reference ops everywhere)
    own_keys: tuple[str, ...]  # ``kvq`` settings only this scheme reads
    page_format: Callable  # (head_size, block_size, sink, window, layer tiers, settings) -> format
    reference_step: Callable
    """``(kv_cache, format, LayerCodec) -> step(block_row, ctx, q, k, v) -> rows``:
    attend over the cached context plus the rows, then store them."""
    check_settings: Callable = lambda s, error: None  # raise ``error`` for settings it cannot serve
    takes_tiers: bool = True  # serves an artifact's tiers

    @property
    def foreign_keys(self) -> set[str]:
        return {k for s in SCHEMES.values() if s is not self for k in s.own_keys}

    def keys_of(self, key: str) -> str | None:
        """The scheme that reads settings key ``key``."""
        return next((s.name for s in SCHEMES.values() if key in s.own_keys), None)


def _oscar_step(kv_cache, fmt, c: LayerCodec):
    pages = oscar.PageViews(kv_cache, fmt)
    return lambda row, ctx, q, k, v: oscar.attend_and_write(pages, fmt, row, ctx, q, k, v, c.k_clip, c.v_clip,
                                                            c.scale, c.fills)


def _kivi_step(kv_cache, fmt, c: LayerCodec):
    pages = kivi.KiviPages(kv_cache, fmt)
    return lambda row, ctx, q, k, v: kivi.attend_and_write(pages, fmt, row, ctx, q, k, v, c.v_clip, c.scale)


def _check_kivi(s, error) -> None:
    if not isinstance(s.key_group, int) or isinstance(s.key_group, bool) or s.key_group < 1:
        raise error(f"kvq.key_group must be a positive int, got {s.key_group!r}")
    if s.k_clip not in (None, 1.0):
        raise error("kvq.scheme 'kivi' quantizes keys per channel, so per-token key clipping does not apply: "
                    "drop kvq.k_clip")


SCHEMES: dict[str, Scheme] = {
    s.name: s for s in (
        Scheme("oscar", rotates_keys=True, triton=True, own_keys=(),
               page_format=lambda d, kb, sink, window, tiers, s: OscarFormat(d, kb, sink, window, tiers),
               reference_step=_oscar_step),
        Scheme("kivi", rotates_keys=False, triton=False, own_keys=("key_group", "key_pairs"),
               page_format=lambda d, kb, sink, window, tiers, s: KiviFormat(
                   d, kb, sink, window, token_group=s.key_group, key_pairs=s.key_pairs),
               reference_step=_kivi_step, check_settings=_check_kivi, takes_tiers=False),
    )
}
