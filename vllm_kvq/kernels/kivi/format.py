"""Byte layout of the KIVI-style INT2 cache, a reference point for OSCAR.

Keys are quantized **per channel** over groups of ``T = 32`` consecutive
positions (one fp16 (scale, min) pair per channel and group), values **per
token**, one INT2 group a row as in OSCAR INT2. Nothing is rotated. The
request's BF16 sink and window live in state blocks exactly as in
:mod:`vllm_kvq.kernels.oscar.format`.

Data block region (per KV head, ``KB`` a multiple of ``T``)::

    offset                          size            content
    0                               KB * D/4        K codes   [KB, D/4] uint8, quartered
    KB * D/4                        KB * D/4        V codes   [KB, D/4] uint8, quartered
    KB * D/2                        KB * D/8        K (scale, min) [KB/T, D, 2] fp16
    KB * D/2 + KB * D/8             KB * 4          V (scale, min) [KB, 2] fp16
                                    ------------
                                    KB * C,  C = D/2 + D/8 + 4

``T`` is the ``key_group`` setting (32 as in KIVI; 64 gives keys 2.5 bits, 128
gives 2.25). A key group can be quantized only once its ``T`` positions are known: it is
written when its last position is stored. Until then its positions are read
from the BF16 window, which covers them as long as ``W >= T`` (enforced).

With ``key_pairs = "int8"`` a key group stores one fp16 step (its largest
``|k|`` / 120) then, per channel, int8 ``(floor(min/step), ceil(max/step))``:
``2D + 2`` bytes per group, so 9 B per token at D = 128, T = 32 (77 B per token
and head, 2.406 bits per element).

Worked size (D = 128, T = 32): C = 32 + 32 + 16 + 4 = 84 B per token
and head (keys 3 bits, values 2.25 bits, 2.625 bits per element on average),
against 72 B for OSCAR and 512 B for BF16.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_kvq.kernels.oscar.format import PagedFormat

TOKEN_GROUP = 32


@dataclass(frozen=True)
class KiviFormat(PagedFormat):
    """Sizes and offsets of one KIVI-style layer's pages."""

    token_group: int = TOKEN_GROUP
    key_pairs: str = "fp16"  # "fp16" or "int8" (above)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block_size % self.token_group or (4 * self.head_size) % self.token_group:
            raise ValueError(f"KIVI keys are quantized in groups of {self.token_group} positions (kvq.key_group); "
                             f"it must divide the block size {self.block_size} and 4 x head size")
        if self.key_pairs not in ("fp16", "int8"):
            raise ValueError(f"kvq.key_pairs must be 'fp16' or 'int8', got {self.key_pairs!r}")
        if self.window < self.token_group:
            raise ValueError(f"KIVI reads a key group in BF16 until its {self.token_group} positions are known; "
                             f"kvq.window must be >= {self.token_group}, got {self.window}")

    @property
    def code_bytes(self) -> int:
        """Packed INT2 codes of one row (K or V)."""
        return self.head_size // 4

    @property
    def k_group_bytes(self) -> int:
        """Bytes of one key group's per-channel pairs (and its step, for int8)."""
        return 4 * self.head_size if self.key_pairs == "fp16" else 2 * self.head_size + 2

    @property
    def k_scale_bytes(self) -> int:
        """Per-token share of the key pairs, rounded up to whole bytes."""
        return -(-self.k_group_bytes // self.token_group)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.code_bytes + self.k_scale_bytes + 4

    @property
    def v_codes_offset(self) -> int:
        return self.block_size * self.code_bytes

    @property
    def k_scale_offset(self) -> int:
        return 2 * self.block_size * self.code_bytes

    @property
    def v_scale_offset(self) -> int:
        return self.k_scale_offset + self.block_size * self.k_scale_bytes
