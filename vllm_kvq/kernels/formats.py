"""The page format a layer uses, from the ``scheme`` setting."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from vllm_kvq.kernels.kivi.format import KiviFormat
from vllm_kvq.kernels.oscar.format import OscarFormat
from vllm_kvq.kernels.tiered.format import TieredFormat


@functools.lru_cache(maxsize=8)
def artifact_tiers(artifact: str) -> dict | None:
    """The ``tiers`` of an artifact's manifest (no tensors read): page sizes are
    needed before any layer loads the artifact."""
    manifest = Path(artifact) / "manifest.json"
    if not manifest.is_file():
        return None
    tiers = json.loads(manifest.read_text()).get("tiers")
    return {kind: tuple((int(w), int(b)) for w, b in t) for kind, t in tiers.items()} if tiers else None


def page_format(head_size: int, block_size: int, s) -> OscarFormat:
    """OSCAR's per-token pages, KIVI's per-channel key pages (``scheme: kivi``)
    or the artifact's tiers (``scheme: tiered``)."""
    common = dict(head_size=head_size, group_size=s.group_size, block_size=block_size, sink=s.sink, window=s.window,
                  ring_slack=getattr(s, "speculative_tokens", 0))
    scheme = getattr(s, "scheme", "oscar")
    if scheme == "kivi":
        return KiviFormat(**common, token_group=s.key_group, key_pairs=s.key_pairs)
    if scheme == "tiered":
        tiers = artifact_tiers(s.artifact) if s.artifact else None
        if tiers is None:
            raise ValueError(
                f"kvq.scheme 'tiered' needs an artifact made with `vllm-kvq calibrate --tiers ...`; "
                f"{s.artifact} has no tiers"
            )
        return TieredFormat(**common, k_tiers=tiers["k"], v_tiers=tiers["v"])
    return OscarFormat(**common)
