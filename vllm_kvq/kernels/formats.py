"""The page format a layer uses, from the ``scheme`` setting."""

from __future__ import annotations

from vllm_kvq.kernels.kivi.format import KiviFormat
from vllm_kvq.kernels.oscar.format import OscarFormat


def page_format(head_size: int, block_size: int, s) -> OscarFormat:
    """OSCAR's per-token pages, or KIVI's per-channel key pages (``scheme: kivi``)."""
    common = dict(head_size=head_size, group_size=s.group_size, block_size=block_size, sink=s.sink, window=s.window)
    if getattr(s, "scheme", "oscar") == "kivi":
        return KiviFormat(**common, token_group=s.key_group, key_pairs=s.key_pairs)
    return OscarFormat(**common)
