"""Byte layout of the tiered OSCAR cache: each rotated row cut into tiers of
directions stored at different widths.

The artifact's rotation orders a head's directions strongest first (keys: query
energy, values: the value target) and mixes them only inside a tier, so each
tier is one quantization group with its own fp16 (scale, min). A tier is
``(width, bits)`` with bits 4 (15 levels, unclipped), 2 (3 levels, clipped at
the layer's ratio as OSCAR INT2 is) or 0: not stored, read back as the
calibrated mean of those coordinates (the artifact's ``fill``).

Data block region (per KV head), token-major: token ``t`` owns bytes
``[t * C, (t + 1) * C)``::

    K codes, tier by tier      sum(width * bits / 8) over K's stored tiers
    V codes, tier by tier      sum(width * bits / 8) over V's stored tiers
    K (scale, min) pairs       4 B per stored K tier (fp16)
    V (scale, min) pairs       4 B per stored V tier (fp16)

INT2 codes are packed four to a byte "quartered" (byte ``b`` of a tier holds
elements ``b, b + w/4, b + w/2, b + 3w/4``), INT4 codes two to a byte
"halved" (byte ``b`` holds ``b`` in the low and ``b + w/2`` in the high
nibble). The BF16 sink and window live in state blocks exactly as in
:mod:`vllm_kvq.kernels.oscar.format`.

Worked size (D = 128, keys ``48x4 + 80x2``, values ``16x4 + 48x2 + 64x0``):
K codes 24 + 20 B, V codes 8 + 12 B, pairs 8 + 8 B: C = 80 B per token and
head, 2.5 bits per element (OSCAR INT2: 72 B, 2.25). A 128-token block is
10,240 B per head, so a state block holds 20 BF16 slots and R = 16 state
blocks cover S0 + W = 320.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_kvq.artifacts.schema import check_tiers
from vllm_kvq.kernels.oscar.format import OscarFormat

Tiers = tuple[tuple[int, int], ...]


def stored(tiers: Tiers) -> list[tuple[int, int, int]]:
    """``(start, width, bits)`` of the tiers with codes."""
    out, start = [], 0
    for w, b in tiers:
        if b:
            out.append((start, w, b))
        start += w
    return out


def code_bytes(tiers: Tiers) -> int:
    return sum(w * b // 8 for w, b in tiers)


@dataclass(frozen=True)
class TieredFormat(OscarFormat):
    """Sizes and offsets of one tiered layer's pages."""

    k_tiers: Tiers = ()
    v_tiers: Tiers = ()

    def __post_init__(self) -> None:
        check_tiers({"k": list(self.k_tiers), "v": list(self.v_tiers)}, self.head_size, "tiered format")
        super().__post_init__()

    @property
    def bytes_per_token(self) -> int:
        """C: codes of both kinds plus one fp16 pair per stored tier."""
        pairs = len(stored(self.k_tiers)) + len(stored(self.v_tiers))
        return code_bytes(self.k_tiers) + code_bytes(self.v_tiers) + 4 * pairs

    # Offsets inside one token's C bytes.
    @property
    def v_codes_offset(self) -> int:
        return code_bytes(self.k_tiers)

    @property
    def k_pairs_offset(self) -> int:
        return code_bytes(self.k_tiers) + code_bytes(self.v_tiers)

    @property
    def v_pairs_offset(self) -> int:
        return self.k_pairs_offset + 4 * len(stored(self.k_tiers))
