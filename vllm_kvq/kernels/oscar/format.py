"""Byte layout of the OSCAR INT2 KV cache inside vLLM's paged blocks.

vLLM hands the backend one uint8 tensor per layer, ``[num_blocks, H, KB, C]``
(layout LBHNC), so every (block, KV head) pair owns one contiguous region of
``KB * C`` bytes. A request's block table holds two kinds of blocks:

* its first ``R`` entries are **state blocks**: the BF16 sink and recent window
  of that request (O(S0 + W) bytes per request, whatever its length);
* every later entry is a **data block** of ``KB`` tokens, stored INT2.

Data block region (per KV head), with D = head size, G = group size::

    offset                     size            content
    0                          KB * D/4        K codes   [KB, D/4] uint8 (token-major)
    KB * D/4                   KB * D/4        V codes   [D/4, KB] uint8 (byte-major)
    KB * D/2                   KB * 4D/G       K (scale, min) [KB, D/G, 2] fp16
    KB * D/2 + KB * 4D/G       KB * 4D/G       V (scale, min) [KB, D/G, 2] fp16
                               -----------
                               KB * C,  C = D/2 + 8D/G

Codes are packed four to a byte, "quartered": byte ``b`` of a row holds the
codes of elements ``b``, ``b + D/4``, ``b + D/2``, ``b + 3D/4`` in bits 0-1, 2-3,
4-5, 6-7. A kernel unpacks a row with four shifts into four contiguous quarters.
The dequantized value is ``code * scale + min`` (asymmetric min-max, 4 levels).

K codes are stored token by token, V codes byte by byte: V's region holds
byte 0 of the block's KB tokens, then byte 1 of them, and so on (byte ``b`` of
token ``t`` at ``b * KB + t``). Decode multiplies keys by the query along the
head dimension but sums values over tokens, and the tensor cores take both
products' operands in pairs along the summed axis: a 32-bit load then holds
four consecutive head elements of a key and four consecutive tokens of a
value byte, each ready to unpack in registers.

State block region (per KV head): ``rows = (KB * C) // (4D)`` slots of one BF16
K row and one BF16 V row each (``[rows, 2, D]`` bf16, the tail unused). The R
state blocks together give ``S0 + W`` slots: slot ``p`` holds sink position
``p < S0``; slot ``S0 + (p - S0) % W`` holds window position ``p >= S0``
(``W + k`` slots and ``% (W + k)`` with ``k`` speculative tokens a step).

Worked size (the default: D = 128, G = 128, KB = 128, S0 = 64, W = 256):
C = 64 + 8 = 72 B per token and head for K and V together (2.25 bits per
element), against 512 B in BF16 (7.1x). A data block is 128 * 72 = 9216 B per
head; a state block holds 9216 // 512 = 18 slots, so R = ceil(320 / 18) = 18
state blocks (165,888 B per head, 1.25% more than the 320 BF16 rows).

Every token of a request is quantized into its data block when written (sink
and window tokens too), so a row never has to move when it leaves the window.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OscarFormat:
    """Sizes and offsets of one OSCAR layer's pages."""

    head_size: int
    group_size: int
    block_size: int
    sink: int
    window: int
    ring_slack: int = 0
    """Extra ring slots for speculative decoding: a step writes the BF16 rows
    of its draft tokens before they are verified, and with ``k`` spare slots
    a rejected draft only overwrites a row no later query reads."""

    def __post_init__(self) -> None:
        d, g = self.head_size, self.group_size
        if d % 4:
            raise ValueError(f"OSCAR needs head_size divisible by 4, got {d}")
        if g <= 0 or d % g or g % 4:
            raise ValueError(
                f"group_size {g} must divide head_size {d} and be a multiple of 4"
            )
        if self.sink < 0 or self.window < 0:
            raise ValueError(
                f"sink and window must be >= 0, got sink={self.sink} window={self.window}"
            )
        if self.state_rows_per_block < 1:
            raise ValueError(
                f"block_size {self.block_size} is too small to hold one BF16 "
                f"K/V row ({4 * d} B) in a {self.block_bytes} B block; use >= "
                f"{-(-4 * d // self.bytes_per_token)}"
            )

    @property
    def groups(self) -> int:
        return self.head_size // self.group_size

    @property
    def code_bytes(self) -> int:
        """Packed INT2 codes of one row (K or V)."""
        return self.head_size // 4

    @property
    def scale_bytes(self) -> int:
        """fp16 (scale, min) pairs of one row (K or V)."""
        return 4 * self.groups

    @property
    def bytes_per_token(self) -> int:
        """C: bytes per token and KV head, K and V together."""
        return 2 * (self.code_bytes + self.scale_bytes)

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.bytes_per_token

    # Offsets inside a data block region.
    @property
    def k_codes_offset(self) -> int:
        return 0

    @property
    def v_codes_offset(self) -> int:
        return self.block_size * self.code_bytes

    @property
    def k_scale_offset(self) -> int:
        return 2 * self.block_size * self.code_bytes

    @property
    def v_scale_offset(self) -> int:
        return self.k_scale_offset + self.block_size * self.scale_bytes

    # State blocks.
    @property
    def ring(self) -> int:
        """Slots of the window ring: W, plus the speculative slack."""
        return self.window + self.ring_slack

    @property
    def state_slots(self) -> int:
        return self.sink + self.ring

    @property
    def state_row_bytes(self) -> int:
        """One BF16 K row plus one BF16 V row."""
        return 4 * self.head_size

    @property
    def state_rows_per_block(self) -> int:
        return self.block_bytes // self.state_row_bytes

    @property
    def state_blocks(self) -> int:
        """R: blocks per request that hold the BF16 sink and window."""
        return -(-self.state_slots // self.state_rows_per_block)

    def bits_per_element(self, context_len: int) -> float:
        """Effective KV bits per element at a context length, state included."""
        quant = context_len * self.bytes_per_token
        state = self.state_blocks * self.block_bytes
        return 8.0 * (quant + state) / (2 * self.head_size * context_len)
