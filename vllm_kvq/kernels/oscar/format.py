"""Byte layout of the OSCAR cache inside vLLM's paged blocks
(docs/design.md, "The page layout, byte by byte", draws it with worked sizes).

A rotated K or V row is cut into tiers of directions, strongest first: INT4,
INT2, then 0-bit (not stored, read back as the artifact's ``fill`` mean).
A request's block table starts with ``R`` state blocks holding its BF16 sink
and window ring, then its data blocks of codes and fp16 (scale, min) pairs.
Every token is quantized into its data block when written, so nothing moves
when a token leaves the window.
"""

from __future__ import annotations

from dataclasses import dataclass, field

WIDTH_STEP = 16
"""Tier widths are multiples of this (the kernels unpack at least 4 bytes of
INT2 or 8 bytes of INT4 codes at a time)."""
TIER_EXAMPLE = "k=48x4,80x2;v=16x4,48x2,64x0"


class TierError(ValueError):
    """A tier plan the format cannot store; the message names the fix."""


@dataclass(frozen=True)
class TierPlan:
    """One kind's (K or V) directions by storage: ``int4`` strongest, then
    ``int2``, then ``zero`` (not stored)."""

    int4: int = 0
    int2: int = 0
    zero: int = 0

    @classmethod
    def int2_only(cls, head_size: int) -> "TierPlan":
        return cls(int2=head_size)

    @classmethod
    def from_pairs(cls, pairs, where: str = "tiers") -> "TierPlan":
        """From ``[(width, bits), ...]`` strongest first, as manifests and
        ``--tiers`` write them: at most one tier per bit width, 4 before 2
        before 0."""
        if not isinstance(pairs, (list, tuple)) or not pairs:
            raise TierError(f"{where}: give a non-empty list of [width, bits] tiers, e.g. {TIER_EXAMPLE!r}")
        widths, last = {}, None
        for pair in pairs:
            if not (isinstance(pair, (list, tuple)) and len(pair) == 2
                    and all(isinstance(x, int) and not isinstance(x, bool) for x in pair)):
                raise TierError(f"{where}: a tier is a [width, bits] pair of integers, got {pair!r}")
            width, bits = pair
            if bits not in (4, 2, 0):
                raise TierError(f"{where}: tier {width}x{bits} has {bits} bits; bits must be 4, 2 or 0")
            if bits in widths or (last is not None and bits > last):
                raise TierError(f"{where}: tiers go strongest first with one tier per width in bits (4, then "
                                f"2, then 0), got {format_pairs(pairs)}; e.g. {TIER_EXAMPLE!r}")
            widths[bits], last = width, bits
        return cls(widths.get(4, 0), widths.get(2, 0), widths.get(0, 0))

    def check(self, head_size: int, where: str = "tiers") -> "TierPlan":
        for width, bits in self.pairs:
            if width <= 0 or width % WIDTH_STEP:
                raise TierError(f"{where}: tier {width}x{bits} has width {width}; widths must be positive "
                                f"multiples of {WIDTH_STEP}")
        if self.width != head_size:
            raise TierError(f"{where}: tier widths sum to {self.width}, not the head size {head_size}; make "
                            f"them add up to {head_size}")
        if not self.stored:
            raise TierError(f"{where}: every tier is 0-bit, so nothing of the row would be stored")
        return self

    @property
    def pairs(self) -> tuple[tuple[int, int], ...]:
        """``(width, bits)`` of the non-empty tiers, strongest first."""
        return tuple((w, b) for w, b in ((self.int4, 4), (self.int2, 2), (self.zero, 0)) if w)

    @property
    def width(self) -> int:
        return self.int4 + self.int2 + self.zero

    @property
    def stored(self) -> int:
        """Stored tiers: (scale, min) pairs per row."""
        return (self.int4 > 0) + (self.int2 > 0)

    @property
    def code_bytes(self) -> int:
        return self.int4 // 2 + self.int2 // 4

    @property
    def row_bytes(self) -> int:
        """Codes plus fp16 pairs of one row."""
        return self.code_bytes + 4 * self.stored

    def __str__(self) -> str:
        return format_pairs(self.pairs)


def format_pairs(pairs) -> str:
    return ",".join(f"{w}x{b}" for w, b in pairs)


@dataclass(frozen=True)
class LayerTiers:
    """The K and V tier plans of one layer."""

    k: TierPlan
    v: TierPlan

    @classmethod
    def int2_only(cls, head_size: int) -> "LayerTiers":
        return cls(TierPlan.int2_only(head_size), TierPlan.int2_only(head_size))

    @classmethod
    def parse(cls, spec: str) -> "LayerTiers":
        """``"k=48x4,80x2;v=16x4,48x2,64x0"`` (syntax only; :meth:`check`
        checks it against a head size)."""
        plans = {}
        for part in filter(None, (p.strip() for p in spec.split(";"))):
            kind, eq, body = part.partition("=")
            kind = kind.strip()
            if not eq or kind not in ("k", "v") or kind in plans:
                raise TierError(f"--tiers: cannot read {part!r}; write k=WIDTHxBITS,...;v=WIDTHxBITS,... "
                                f"(each kind once), e.g. {TIER_EXAMPLE!r}")
            pairs = []
            for item in body.split(","):
                w, x, b = item.strip().partition("x")
                if not x or not w.strip().isdigit() or not b.strip().isdigit():
                    raise TierError(f"--tiers: cannot read tier {item.strip()!r} of {kind}; write WIDTHxBITS, "
                                    "e.g. 48x4")
                pairs.append((int(w), int(b)))
            plans[kind] = TierPlan.from_pairs(pairs, f"--tiers {kind}")
        if sorted(plans) != ["k", "v"]:
            raise TierError(f"--tiers: give both k and v, e.g. {TIER_EXAMPLE!r}")
        return cls(plans["k"], plans["v"])

    @classmethod
    def from_json(cls, raw, where: str) -> "LayerTiers":
        if not isinstance(raw, dict) or sorted(raw) != ["k", "v"]:
            raise TierError(f"{where}: tiers must be an object with 'k' and 'v' lists of [width, bits], e.g. "
                            '{"k": [[48, 4], [80, 2]], "v": [[16, 4], [48, 2], [64, 0]]}')
        return cls(*(TierPlan.from_pairs(raw[kind], f"{where} {kind}") for kind in ("k", "v")))

    def to_json(self) -> dict:
        return {kind: [list(p) for p in getattr(self, kind).pairs] for kind in ("k", "v")}

    def check(self, head_size: int, where: str = "tiers") -> "LayerTiers":
        self.k.check(head_size, f"{where} k")
        self.v.check(head_size, f"{where} v")
        return self

    @property
    def bytes_per_token(self) -> int:
        return self.k.row_bytes + self.v.row_bytes

    def __str__(self) -> str:
        return f"k={self.k};v={self.v}"


@dataclass(frozen=True)
class PagedFormat:
    """Sink/window state blocks in front of a request's data blocks: the
    part every page format shares. Subclasses say the bytes per token."""

    head_size: int
    block_size: int
    sink: int
    window: int
    ring_slack: int = field(default=0, kw_only=True)
    """Extra ring slots for speculative decoding: a step writes the BF16 rows
    of its draft tokens before they are verified, and with ``k`` spare slots
    a rejected draft only overwrites a row no later query reads."""

    def __post_init__(self) -> None:
        if self.sink < 0 or self.window < 0:
            raise ValueError(f"sink and window must be >= 0, got sink={self.sink} window={self.window}")
        if self.state_rows_per_block < 1:
            raise ValueError(
                f"block_size {self.block_size} is too small to hold one BF16 K/V row "
                f"({4 * self.head_size} B) in a {self.block_bytes} B block; use >= "
                f"{-(-4 * self.head_size // self.bytes_per_token)}"
            )

    @property
    def bytes_per_token(self) -> int:
        raise NotImplementedError

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.bytes_per_token

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

    def check_query_len(self, query_len: int) -> None:
        """A step's query tokens a request write their BF16 rows before any is
        read, so past the first they need the ring's spare slots."""
        if query_len > 1 + self.ring_slack:
            raise ValueError(f"{query_len} query tokens a request need a ring of W + {query_len - 1} slots, "
                             f"the format has W + {self.ring_slack}")

    def bits_per_element(self, context_len: int) -> float:
        """Effective KV bits per element at a context length, state included."""
        quant = context_len * self.bytes_per_token
        state = self.state_blocks * self.block_bytes
        return 8.0 * (quant + state) / (2 * self.head_size * context_len)


@dataclass(frozen=True)
class OscarFormat(PagedFormat):
    """Sizes and offsets of one OSCAR layer's pages (one tier plan per layer)."""

    tiers: LayerTiers | None = None

    def __post_init__(self) -> None:
        if self.tiers is None:
            object.__setattr__(self, "tiers", LayerTiers.int2_only(self.head_size))
        self.tiers.check(self.head_size, "page format")
        super().__post_init__()

    @property
    def k(self) -> TierPlan:
        return self.tiers.k

    @property
    def v(self) -> TierPlan:
        return self.tiers.v

    @property
    def bytes_per_token(self) -> int:
        """C: bytes per token and KV head, K and V together."""
        return self.tiers.bytes_per_token

    # Offsets inside a data block region.
    @property
    def v_codes_offset(self) -> int:
        return self.block_size * self.k.code_bytes

    @property
    def k_pairs_offset(self) -> int:
        return self.block_size * (self.k.code_bytes + self.v.code_bytes)

    @property
    def v_pairs_offset(self) -> int:
        return self.k_pairs_offset + self.block_size * 4 * self.k.stored

    def block_stride(self, kv_cache) -> int:
        """Bytes from one block of a layer's pages ``[blocks, H, KB, C]`` (uint8)
        to the next. vLLM pads a page to the pool's largest when that is no
        whole multiple of it, so blocks may lie further apart than
        ``H * block_bytes``; a block is dense."""
        _, h, kb, c = kv_cache.shape
        if (kv_cache.element_size() != 1 or kb * c != self.block_bytes
                or tuple(kv_cache.stride()[1:]) != (kb * c, c, 1) or kv_cache.stride(0) < h * kb * c):
            raise ValueError(f"OSCAR pages must be uint8 [blocks, H, {self.block_size}, {self.bytes_per_token}] "
                             f"with dense blocks, got {kv_cache.dtype} shape {tuple(kv_cache.shape)} strides "
                             f"{tuple(kv_cache.stride())}")
        return kv_cache.stride(0)
