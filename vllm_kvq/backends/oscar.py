"""The OSCAR attention backend: vLLM-facing classes around the OSCAR kernels.

Keys and queries are rotated by R_K after RoPE; values arrive already rotated
by R_V (folded into ``qkv_proj`` and ``o_proj`` at load, see ``weights.py``),
so the attention output needs no un-rotation. The page formats are the schemes'
(:mod:`vllm_kvq.backends.schemes`; OSCAR's: ``vllm_kvq/kernels/oscar/format.py``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.logger import init_logger
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheLayout, SlidingWindowSpec

from vllm_kvq.artifacts.fingerprint import text_config
from vllm_kvq.backends import settings as kvq_settings
from vllm_kvq.backends.kv_spec import OscarAttentionSpec
from vllm_kvq.backends.resolve import page_format, resolve_artifact
from vllm_kvq.backends.schemes import SCHEMES, LayerCodec
from vllm_kvq.kernels.oscar.format import PagedFormat

logger = init_logger("vllm." + __name__)

BACKEND_NAME = "OSCAR"


class OscarBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "bfloat16", "float16"]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type["OscarImpl"]:
        return OscarImpl

    @staticmethod
    def get_builder_cls() -> type["OscarMetadataBuilder"]:
        return OscarMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        # Small blocks multiply the state blocks each request holds (R grows
        # as 1/KB); 128 keeps R at 18 for the default sink/window.
        return max(default_block_size, 128)

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return True

    @classmethod
    def customize_spec(cls, spec):
        """Declare the real bytes: C per token and head plus R state blocks."""
        if not isinstance(spec, FullAttentionSpec) or isinstance(spec, SlidingWindowSpec):
            return spec
        settings = kvq_settings.current()
        per_token = page_format(spec.head_size, 128, settings).bytes_per_token  # the same for any block size
        if spec.block_size * per_token < 4 * spec.head_size:
            # vLLM's one-token probe (hybrid models size attention blocks from
            # it): too small for a state slot, and only the bytes per token count.
            return OscarAttentionSpec.from_spec(spec, dtype=torch.uint8, state_content_bytes=per_token)
        block_size = draft_sharing_block_size(spec.block_size, spec.num_kv_heads * per_token,
                                              settings.draft_token_bytes)
        fmt = page_format(spec.head_size, block_size, settings)
        return OscarAttentionSpec.from_spec(
            spec,
            block_size=block_size,
            dtype=torch.uint8,
            state_content_bytes=fmt.bytes_per_token,
            state_blocks=fmt.state_blocks,
        )


def draft_sharing_block_size(block_size: int, token_bytes: int, draft_token_bytes: int) -> int:
    """OSCAR's block size beside a draft model's BF16 layers in one block pool.

    vLLM gives every layer one page size: a smaller page whose size divides
    the largest grows its block size, any other is padded to the largest. A
    BF16 page of ``block_size`` tokens is no whole multiple of an OSCAR page of
    as many tokens, so OSCAR's pages would be padded to it (7x fewer tokens at
    72 B). Instead OSCAR takes the smallest multiple of ``block_size`` whose
    page is a whole number of draft pages, and vLLM then grows the draft's
    blocks to it (at 16-token draft blocks and 8 KV heads of 128: 1,024 tokens
    at 72 B, 512 at 80 B, draft blocks of 144 and 80 tokens)."""
    if not draft_token_bytes:
        return block_size
    draft_page = block_size * draft_token_bytes
    return block_size * (draft_page // math.gcd(draft_page, block_size * token_bytes))


def uses_triton(settings: kvq_settings.OscarSettings, device: torch.device) -> bool:
    """The ``kernels`` setting: Triton on CUDA unless told otherwise (or the
    scheme has only reference ops)."""
    if not SCHEMES[settings.scheme].triton:
        return False
    if settings.kernels == "auto":
        return device.type == "cuda"
    return settings.kernels == "triton"


@dataclass
class TokenIndex:
    """Per-token position, request row and request length after this step of
    the multi-token chunks, and their query tiles (CUDA path only)."""

    positions: torch.Tensor
    request: torch.Tensor
    seq_end: torch.Tensor
    extend_tiles: torch.Tensor


@dataclass
class OscarMetadata:
    num_actual_tokens: int
    num_decodes: int  # leading requests of decode_query_len tokens each (the Triton decode path)
    block_table: torch.Tensor
    # reference path (CPU, or kernels "reference"): host copies
    query_start_loc: list[int] | None = None
    seq_lens: list[int] | None = None
    # Triton path: the decodes read vLLM's persistent buffers (views, the same
    # storage every step: what a captured CUDA graph replays) ...
    decode_seq_lens: torch.Tensor | None = None
    decode_slots: torch.Tensor | None = None
    # ... the multi-token chunks an index built per step (never captured)
    chunks: TokenIndex | None = None
    # query tokens of each decode request: 1, or 1 + drafts when verifying
    decode_query_len: int = 1

    @property
    def triton(self) -> bool:
        return self.decode_seq_lens is not None


class OscarMetadataBuilder(AttentionMetadataBuilder[OscarMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        """The Triton path: full CUDA graphs for batches of uniform decode
        requests (one token each, or 1 + k with k speculative tokens; padding
        rows have length 0 and slot -1 and write nothing), other batches
        eager. The reference ops loop over requests on the host: never."""
        from vllm.platforms import current_platform

        s = kvq_settings.from_vllm_config(vllm_config)
        if not uses_triton(s, torch.device(current_platform.device_type)):
            return AttentionCGSupport.NEVER
        return AttentionCGSupport.UNIFORM_BATCH if s.speculative_tokens else cls._cudagraph_support

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        settings = kvq_settings.from_vllm_config(vllm_config)
        self._triton = uses_triton(settings, torch.device(device))
        # Decode requests first: one token each, or on the Triton path up to
        # 1 + k with k speculative tokens (the decode kernel takes them; the
        # ring's k spare slots bound how many).
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=self._triton)
        self._decode_max = 1 + settings.speculative_tokens if self._triton else 1
        # vLLM's host copy of the sequence lengths is exact without speculative decoding
        self._host_seq_lens_exact = getattr(vllm_config, "speculative_config", None) is None

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> OscarMetadata:
        m = common_attn_metadata
        n = m.num_reqs
        num_decodes, _, num_decode_tokens, _ = split_decodes_and_prefills(m, decode_threshold=1)
        if not self._triton:
            return OscarMetadata(
                num_actual_tokens=m.num_actual_tokens,
                num_decodes=num_decodes,
                block_table=m.block_table_tensor[:n],
                query_start_loc=m.query_start_loc_cpu[: n + 1].tolist(),
                seq_lens=m.seq_lens[:n].cpu().tolist(),
            )
        query_len = 1
        if self._decode_max > 1:
            # decodes of one length (1 + drafts, or 1 where none were proposed),
            # then zero-length padding; the rest through the chunk path
            num_decodes, _, num_decode_tokens, _ = split_decodes_and_prefills(
                m, decode_threshold=self._decode_max, require_uniform=True)
            if num_decodes:
                query_len = max(int(m.query_start_loc_cpu[1] - m.query_start_loc_cpu[0]), 1)
        if num_decode_tokens != num_decodes * query_len:
            num_decodes = 0  # a zero-length row among the decodes: all through the chunk path
        # Decode-only batches (the ones replayed from CUDA graphs) take no host
        # step here: the store and decode kernels read seq_lens, the block
        # table and the slot mapping, which vLLM rewrites in place every step.
        return OscarMetadata(
            num_actual_tokens=m.num_actual_tokens,
            num_decodes=num_decodes,
            block_table=m.block_table_tensor[:n],
            decode_seq_lens=m.seq_lens[:num_decodes],
            decode_slots=m.slot_mapping[:num_decodes * query_len],
            chunks=self._chunk_index(m, num_decodes) if num_decodes < n else None,
            decode_query_len=query_len,
        )

    def _chunk_index(self, m: CommonAttentionMetadata, num_decodes: int) -> TokenIndex:
        """Positions, request rows and lengths of the tokens of requests
        ``num_decodes ..`` (eager: batches with a chunk are never captured)."""
        from vllm_kvq.kernels.oscar.triton_extend import query_tiles

        n = m.num_reqs
        qsl = m.query_start_loc_cpu[: n + 1].tolist()
        if self._host_seq_lens_exact and m.seq_lens_cpu_upper_bound is not None:
            seq_lens = m.seq_lens_cpu_upper_bound[:n].tolist()  # no device sync
        else:
            seq_lens = m.seq_lens[:n].cpu().tolist()
        first, nt = qsl[num_decodes], qsl[n]
        loc = m.query_start_loc[: n + 1]
        tok = torch.arange(first, nt, dtype=loc.dtype, device=loc.device)
        req = torch.searchsorted(loc[1:], tok, right=True)
        end = m.seq_lens[:n][req]
        pos = end - (loc[req + 1] - tok)
        chunks = [(i, qsl[i] - first, qsl[i + 1] - qsl[i], seq_lens[i] - (qsl[i + 1] - qsl[i]))
                  for i in range(num_decodes, n) if qsl[i + 1] > qsl[i]]
        return TokenIndex(pos.to(torch.int32), req.to(torch.int32), end.to(torch.int32),
                          query_tiles(chunks, loc.device))


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_index(layer_name: str) -> int:
    match = _LAYER_INDEX.search(layer_name)
    if match is None:
        raise ValueError(f"OSCAR cannot find a layer index in {layer_name!r}")
    return int(match.group(1))


def local_kv_heads(num_local_kv_heads: int, total_kv_heads: int) -> list[int]:
    """Global ids of this tensor-parallel rank's KV heads."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
    replicas = max(1, tp // total_kv_heads)
    start = (rank // replicas) * num_local_kv_heads
    return list(range(start, start + num_local_kv_heads))


class OscarImpl(AttentionImpl):
    """INT2 + BF16 sink/window attention: Triton kernels on CUDA (store, split-KV
    decode, extend), the PyTorch reference ops on CPU."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes=None, sliding_window=None, kv_cache_dtype: str = "auto",
                 logits_soft_cap=None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, **extra) -> None:
        unsupported = {
            "ALiBi slopes": alibi_slopes is not None,
            "sliding-window attention": sliding_window is not None,
            "logit soft-capping": bool(logits_soft_cap),
            f"attention type {attn_type}": attn_type != AttentionType.DECODER,
            "KV-cache sharing between layers": kv_sharing_target_layer_name is not None,
            "attention-sink logits": extra.get("sinks") is not None,
        }
        bad = [name for name, flag in unsupported.items() if flag]
        if bad:
            raise NotImplementedError(
                f"The OSCAR backend does not support {', '.join(bad)}; serve this model "
                "with another --attention-backend"
            )
        from vllm.config import get_current_vllm_config

        vllm_config = get_current_vllm_config()
        self.settings = kvq_settings.from_vllm_config(vllm_config)
        self.hf_config = vllm_config.model_config.hf_config
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.artifact = resolve_artifact(self.settings, self.hf_config)
        text = text_config(self.hf_config)
        self.heads_per_kv = text.num_attention_heads // text.num_key_value_heads
        self.max_model_len = vllm_config.model_config.max_model_len
        self._layer: int | None = None
        self._fmt: PagedFormat | None = None
        self._sm_count: int | None = None
        self.k_rotation: torch.Tensor | None = None  # [H_local, D, D] fp32
        self._k_parts: torch.Tensor | None = None  # the Triton store's bf16 parts of it, made once
        self.v_absorbed = False  # set by the weight folding at load
        self.unrotate_output = False  # set there too: o_proj could not take R_V

    # ------------------------------------------------------------- set-up
    def bind_layer(self, layer_name: str) -> None:
        """Pick this layer's rotations (local KV heads only)."""
        idx = layer_index(layer_name)
        if idx not in self.artifact.layers:
            raise ValueError(
                f"OSCAR artifact {self.artifact.source} has no rotation for layer {idx} ({layer_name})"
            )
        self._layer = idx
        heads, eye = local_kv_heads(self.num_kv_heads, self.artifact.num_kv_heads), torch.eye(self.head_size)
        self.k_rotation = self.artifact.rotation_for("k", idx, heads)
        self._k_parts = None
        if not SCHEMES[self.settings.scheme].rotates_keys:  # per-channel keys: a rotation would mix the channels
            self.k_rotation = eye.expand_as(self.k_rotation).contiguous()
        self.v_rotation = self.artifact.rotation_for("v", idx, heads)
        self.codec = LayerCodec(self.artifact.k_clip[idx], self.artifact.v_clip[idx], self.scale,
                                tuple(self.artifact.fill_for(kind, idx, heads) for kind in "kv"))
        self.k_identity, self.v_identity = (bool(torch.equal(r, eye.expand_as(r)))
                                            for r in (self.k_rotation, self.v_rotation))

    def _format(self, kv_cache: torch.Tensor) -> PagedFormat:
        block_size = kv_cache.shape[2]
        if self._fmt is None or self._fmt.block_size != block_size:
            self._fmt = page_format(self.head_size, block_size, self.settings, self._layer)
            if kv_cache.shape[3] != self._fmt.bytes_per_token:
                raise RuntimeError(
                    f"OSCAR page has {kv_cache.shape[3]} B per token, format expects "
                    f"{self._fmt.bytes_per_token}; settings differ between processes"
                )
        return self._fmt

    def _rotate(self, x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
        """``x [T, H*g, D] @ R[h]`` per KV head, in fp32."""
        t = x.shape[0]
        h = rotation.shape[0]
        xg = x.float().view(t, h, -1, self.head_size)
        return torch.einsum("thgd,hde->thge", xg, rotation).reshape(t, -1, self.head_size)

    # ------------------------------------------------------------ forward
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("OSCAR does not fuse output quantization")
        if attn_metadata is None:
            return output
        if self._layer is None:
            self.bind_layer(layer.layer_name)
        if self.k_rotation.device != query.device:
            self.k_rotation = self.k_rotation.to(query.device)
        if not self.v_identity and not self.v_absorbed:
            raise RuntimeError(
                f"OSCAR value rotation of {layer.layer_name} was not folded into the "
                "weights at load; this model's loader is not supported"
            )
        fmt = self._format(kv_cache)
        n = attn_metadata.num_actual_tokens
        d = self.head_size
        q = query[:n].view(n, self.num_heads, d)
        k = key[:n].view(n, self.num_kv_heads, d)
        v = value[:n].view(n, self.num_kv_heads, d)
        if not self.k_identity:
            q = self._rotate(q, self.k_rotation)
        out = output.view(-1, self.num_heads, d)
        md = attn_metadata
        if md.triton:
            self._forward_triton(q, k, v, kv_cache, fmt, md, out)
            return self._unrotated(output, n)
        if not self.k_identity:
            k = self._rotate(k, self.k_rotation)
        step = SCHEMES[self.settings.scheme].reference_step(kv_cache, fmt, self._codec_on(q.device))
        qsl = md.query_start_loc
        for i, seq_len in enumerate(md.seq_lens):
            start, end = qsl[i], qsl[i + 1]
            if end > start:
                res = step(md.block_table[i], seq_len - (end - start), q[start:end], k[start:end], v[start:end])
                out[start:end] = res.to(out.dtype)
        return self._unrotated(output, n)

    def _codec_on(self, device) -> LayerCodec:
        """The layer's codec with its 0-bit means on ``device`` (moved once)."""
        fills = self.codec.fills
        if any(f is not None and f.device != torch.device(device) for f in fills):
            self.codec = dataclasses.replace(self.codec, fills=tuple(None if f is None else f.to(device)
                                                                     for f in fills))
        return self.codec

    def _unrotated(self, output: torch.Tensor, n: int) -> torch.Tensor:
        """The R_V^T epilogue, for layers whose o_proj could not absorb R_V."""
        if self.unrotate_output:
            out = output[:n].view(n, self.num_heads, self.head_size)
            if self.v_rotation.device != out.device:
                self.v_rotation = self.v_rotation.to(out.device)
            out.copy_(self._rotate(out, self.v_rotation.transpose(1, 2)).to(out.dtype))
        return output

    def _forward_triton(self, q, k, v, kv_cache, fmt, md, out) -> None:
        """CUDA (docs/design.md, "The CUDA path"): decode requests store then
        run the split-KV decode; longer chunks store their INT2 rows, attend,
        then store their BF16 rows. The decode half is what a full CUDA graph
        captures: it reads only device buffers vLLM rewrites in place."""
        from vllm_kvq.kernels.oscar import triton_decode, triton_extend, triton_store

        table = md.block_table
        if self._k_parts is None and not self.k_identity:
            self._k_parts = triton_store.rotation_parts(self.k_rotation)
        rot = self._k_parts  # None: keys stay as they are
        ql, n = md.decode_query_len, md.num_actual_tokens
        nd = md.num_decodes * ql  # decode query rows
        c = self._codec_on(q.device)
        if nd:
            seq = md.decode_seq_lens
            triton_store.store_decode_tokens(kv_cache, fmt, k[:nd], v[:nd], rot, seq, table, c.k_clip,
                                             c.v_clip, slot_mapping=md.decode_slots, query_len=ql)
            if self._sm_count is None:
                self._sm_count = (torch.cuda.get_device_properties(q.device).multi_processor_count
                                  if q.is_cuda else 1)
            splits = triton_decode.num_splits(nd, self.num_kv_heads, self.max_model_len, self._sm_count,
                                              fmt.block_size)
            triton_decode.decode_attention(q[:nd], kv_cache, fmt, table[:md.num_decodes], seq, self.scale, splits,
                                           out[:nd], fills=c.fills, query_len=ql)
        tok = md.chunks
        if tok is not None and n > nd:
            stop = nd + tok.positions.shape[0]  # past the chunks' tokens: padding, if any
            idx = (tok.positions, tok.request, tok.seq_end, table, c.k_clip, c.v_clip)
            k_rot = triton_store.store_tokens(kv_cache, fmt, k[nd:stop], v[nd:stop], rot, *idx, state=False)
            triton_extend.extend_attention(q[nd:stop], k_rot, v[nd:stop], kv_cache, fmt, table, tok.extend_tiles,
                                           self.scale, out[nd:stop], fills=c.fills)
            triton_store.store_tokens(kv_cache, fmt, k_rot, v[nd:stop], None, *idx, data=False)
