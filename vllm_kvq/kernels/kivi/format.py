"""Byte layout of the KIVI-style INT2 cache, a reference point for OSCAR
(docs/design.md, "The KIVI-style scheme", draws it): keys per channel over
groups of ``key_group`` positions, values per token, nothing rotated; sink
and window in state blocks as OSCAR's. A key group is written when its last
position is stored and read from the BF16 window until then, so ``W >= T``.
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
