"""Byte layout of one STEPQuant state record: a GDN layer's recurrent state of
one request, packed.

vLLM keeps a gated-delta-net layer's state per request slot as
``[HV, V, K]`` (FP32 by default). With STEPQuant the slot holds one uint8
record instead. The math orientation is ``S[k, v]``: key rows ``i`` (K of them)
by value columns ``j`` (V). Every local value head ``h`` has a width ``b_h``
fixed by the calibrated plan (or uniform): 2, 4, 6 or 8 bits, or 16 for an
FP16 "pivot" head. Heads follow each other in order::

    integer head, width b (K x V codes, row-major over key rows)
    offset          size                content
    0               K*V*b/8             codes, little-endian bit packing:
                                        8: 1 per byte, 4: 2 per byte (low nibble
                                        first), 2: 4 per byte (bits 0-1 first),
                                        6: 4 codes in 3 bytes (24-bit word)
    K*V*b/8         2*K*n_r             row scales r, fp16 [K, n_r]
                                        (n_r = V/32 for b = 2, else 1)
    ...             2*V                 column scales c, fp16 [V]

    pivot head
    0               2*K*V               fp16 [K, V]

A value is ``r[i, j // (V / n_r)] * c[j] * z[i, j]`` with z the signed code:
``code - (2^(b-1) - 1)`` for b >= 4, and ``2 * code - 3`` (levels -3, -1, 1, 3)
for b = 2. An all-zero record decodes to the zero state.

With ``tail = t > 0`` the record also holds up to t rank-1 updates not yet
fitted into the codes, so that a decode step refits a record only every t + 1
steps (the others append their update, a few hundred bytes, instead of
refitting K x V values). After the heads, at the next multiple of 16::

    offset          size                content
    0               16                  n, int32: updates held (then padding)
    16 + e*h        e = 16*ceil((4 + 4t)/16) + 2t(V + K), for head h:
      0             4                   d, fp32: the decay since the last fit
      4             4*t                 w[t], fp32: each update's decay since
      16*ceil(...)  2*t*V               u[t, V], fp16: the updates' δ
      ...           2*t*K               k[t, K], fp16: their keys

and the state is ``d X̂ + Σ_{e < n} w[e] k[e] u[e]ᵀ`` (X̂ what the codes and
scales give). A fit stores n = 0, d = 1 (the entries stay, unread); an
all-zero record still decodes to the zero state.

The record is padded to ``record_bytes`` (the same for every layer and rank,
because vLLM gives all state pages of a model one size).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

WIDTHS = (2, 4, 6, 8)
PIVOT = 16
"""The width of an FP16 "pivot" head."""
PIVOT_BUDGET_BITS = 8
"""What a pivot head costs a plan's budget (as in the paper)."""
BUDGETS = (6, 4)
"""The nominal bits per value a STEPQuant plan allocates for."""
FITS = ("stepquant", "rowwise")
"""How a record's scales are refitted every step: the plan's weighted
dual-axis fit, or one absmax scale per key row (the uniform pool)."""
INT2_GROUP = 32


@dataclass(frozen=True)
class HeadSlot:
    """Where one head lives inside the record."""

    bits: int
    codes: int  # byte offset of the codes (or of the fp16 pivot)
    codes_bytes: int
    rows: int  # byte offset of the fp16 row scales (-1 for a pivot)
    row_groups: int  # n_r
    cols: int  # byte offset of the fp16 column scales (-1 for a pivot)


@dataclass(frozen=True)
class StateLayout:
    """Offsets of every local head of one layer's record."""

    bits: tuple[int, ...]
    k_dim: int
    v_dim: int
    record_bytes: int = 0  # 0: exactly the packed size
    tail: int = 0  # rank-1 updates a record holds between fits (0: every step refits)

    def __post_init__(self) -> None:
        k, v = self.k_dim, self.v_dim
        if v % INT2_GROUP or k % 2:
            raise ValueError(f"STEPQuant needs V divisible by {INT2_GROUP} and even K, got K={k} V={v}")
        bad = [b for b in self.bits if b not in WIDTHS and b != PIVOT]
        if bad:
            raise ValueError(f"state widths must be in {WIDTHS} or {PIVOT} (pivot), got {bad}")
        if self.tail < 0:
            raise ValueError(f"tail must be >= 0, got {self.tail}")
        if self.record_bytes and self.record_bytes < self.packed_bytes:
            raise ValueError(f"record_bytes {self.record_bytes} < packed size {self.packed_bytes}")

    @cached_property
    def _slots(self) -> tuple[tuple[HeadSlot, ...], int]:
        """Every head's slot, and the bytes of the heads back to back."""
        k, v = self.k_dim, self.v_dim
        out, off = [], 0
        for b in self.bits:
            if b == PIVOT:
                out.append(HeadSlot(b, off, 2 * k * v, -1, 0, -1))
                off += 2 * k * v
                continue
            nbytes = k * v * b // 8
            groups = v // INT2_GROUP if b == 2 else 1
            rows = off + nbytes
            cols = rows + 2 * k * groups
            out.append(HeadSlot(b, off, nbytes, rows, groups, cols))
            off = cols + 2 * v
        return tuple(out), off

    @property
    def heads(self) -> tuple[HeadSlot, ...]:
        return self._slots[0]

    @property
    def heads_bytes(self) -> int:
        """The heads' bytes, back to back."""
        return self._slots[1]

    @property
    def tail_offset(self) -> int:
        """Where the held updates start (the count n; see the module docstring)."""
        return -(-self.heads_bytes // 16) * 16

    @property
    def tail_scalar_bytes(self) -> int:
        """A head's d and w, padded to 16 bytes (its u then starts there)."""
        return -(-(4 + 4 * self.tail) // 16) * 16

    @property
    def tail_head_bytes(self) -> int:
        return self.tail_scalar_bytes + 2 * self.tail * (self.v_dim + self.k_dim)

    @property
    def packed_bytes(self) -> int:
        """Bytes in use: the heads, and the held updates when ``tail > 0``."""
        if not self.tail:
            return self.heads_bytes
        return self.tail_offset + 16 + len(self.bits) * self.tail_head_bytes

    @property
    def size(self) -> int:
        """Bytes per record (what vLLM allocates per slot and layer)."""
        return self.record_bytes or self.packed_bytes

    def bits_per_value(self) -> float:
        return 8 * self.packed_bytes / (len(self.bits) * self.k_dim * self.v_dim)


def fp32_state_bytes(num_heads: int, k_dim: int, v_dim: int) -> int:
    return 4 * num_heads * k_dim * v_dim
