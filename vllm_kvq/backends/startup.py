"""Start-up checks for ``--attention-backend OSCAR``: fail before any engine
process starts, with a message that names the fix."""

from __future__ import annotations

import math

import torch
from vllm.logger import init_logger
from vllm.platforms import current_platform

from vllm_kvq.artifacts.fingerprint import head_dim, text_config
from vllm_kvq.backends import settings as kvq_settings
from vllm_kvq.backends.oscar import draft_sharing_block_size, uses_triton
from vllm_kvq.backends.resolve import cache_plan, page_format, pool_plan, resolve_artifact
from vllm_kvq.backends.schemes import SCHEMES

logger = init_logger("vllm." + __name__)


def check_oscar_config(vllm_config) -> None:
    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    s = kvq_settings.from_vllm_config(vllm_config)
    if model_config.use_mla:
        raise ValueError("OSCAR does not support MLA models; drop --attention-backend OSCAR")
    scheme = SCHEMES[s.scheme]
    device = torch.device(current_platform.device_type)
    if not scheme.triton and (s.kernels == "triton" or (device.type == "cuda" and s.kernels != "reference")):
        raise ValueError(
            f"kvq.scheme {s.scheme!r} is built only in the PyTorch reference ops, not the Triton kernels; serve "
            f"it with --additional-config '{{\"kvq\": {{\"scheme\": \"{s.scheme}\", \"kernels\": \"reference\", ...}}}}'"
        )
    if cache_config.cache_dtype not in ("auto", "bfloat16", "float16"):
        raise ValueError(
            f"OSCAR stores its own format; use --kv-cache-dtype auto, not {cache_config.cache_dtype!r}"
        )
    artifact = resolve_artifact(s, model_config.hf_config)
    d = head_dim(text_config(model_config.hf_config))
    fmt = page_format(d, cache_config.block_size, s)
    if uses_triton(s, device):
        from vllm_kvq.kernels.oscar.triton_store import check_shapes

        why = check_shapes(d)
        if why:
            raise ValueError(f"OSCAR: {why}; pass kvq.kernels 'reference' (the PyTorch reference ops; slow)")
    draft = vllm_config.speculative_config
    if draft is not None and getattr(draft.attention_backend, "name", None) == "OSCAR":
        raise ValueError(
            "OSCAR serves the target model's layers, whose rotations an artifact holds; a draft model's layers "
            "have none: drop attention_backend from the speculative config (the draft keeps vLLM's own cache)"
        )
    if s.draft_token_bytes:
        _small_blocks(vllm_config, draft=True)
        token_bytes = model_config.get_num_kv_heads(vllm_config.parallel_config) * fmt.bytes_per_token
        blocks = draft_sharing_block_size(cache_config.block_size, token_bytes, s.draft_token_bytes)
        fmt = page_format(d, blocks, s)
        draft_blocks = blocks * token_bytes // s.draft_token_bytes
        logger.info("OSCAR: the draft model's layers share the block pool; OSCAR blocks of %d tokens hold as "
                    "many bytes as %d draft tokens, so no page is padded%s", blocks, draft_blocks,
                    f"; prefix-cache hits fall on multiples of {math.lcm(blocks, draft_blocks)} tokens"
                    if cache_config.enable_prefix_caching else "")
    tiers = cache_plan(s).tiers
    logger.info(
        "OSCAR: scheme=%s, rotation=%s (%s), tiers %s, sink=%d, window=%d, %d B/token/head, "
        "%d state blocks/request, %.3f bits/element at %d tokens",
        s.scheme, s.rotation_mode, artifact.source,
        "INT2" if tiers is None else ("per layer" if len(set(tiers.values())) > 1 else next(iter(tiers.values()))),
        fmt.sink, fmt.window, fmt.bytes_per_token, fmt.state_blocks, fmt.bits_per_element(model_config.max_model_len),
        model_config.max_model_len,
    )


def check_state_config(vllm_config) -> None:
    """``kvq.state``: a GDN hybrid, no speculative decoding, no prefix caching."""
    s = kvq_settings.from_vllm_config(vllm_config)
    if s.state is None:
        return
    model_config, cache_config = vllm_config.model_config, vllm_config.cache_config
    tp = vllm_config.parallel_config.tensor_parallel_size
    plan = pool_plan(s, model_config.hf_config, tp)
    if not current_platform.is_cpu():
        _check_state_graphs(vllm_config, s, plan)
    if vllm_config.speculative_config is not None:
        raise ValueError("kvq.state does not support speculative decoding; drop the speculative config")
    if cache_config.enable_prefix_caching or cache_config.mamba_cache_mode != "none":
        logger.warning(
            "kvq.state keeps one packed state per request, which prefix caching cannot "
            "checkpoint: prefix caching is disabled (pass --no-enable-prefix-caching to silence this)."
        )
        cache_config.enable_prefix_caching = False
        cache_config.mamba_cache_mode = "none"
        cache_config.mamba_block_size = model_config.max_model_len
    _small_blocks(vllm_config)
    fp32 = plan.fp32_bytes(tp)
    logger.info(
        "kvq.state: %s, %d B per layer and request against %d B in FP32 (%.2fx)",
        plan.source, plan.record_bytes, fp32, fp32 / plan.record_bytes,
    )


STATE_GRAPHS_FIX = (
    "pass --compilation-config '{\"mode\": 0, \"cudagraph_mode\": \"FULL_DECODE_ONLY\"}' (full CUDA graphs for "
    "decode-only batches, other batches eager) or --enforce-eager"
)


def _check_state_graphs(vllm_config, s, plan) -> None:
    """Decode-only batches run the packed Triton step, which full CUDA graphs
    capture; every other batch stages states around vLLM's GDN kernels (host
    indexing), which no graph can hold. So: no graphs, or full graphs for
    decode-only batches and nothing else."""
    from vllm.config import CUDAGraphMode

    mode = vllm_config.compilation_config.cudagraph_mode
    if mode == CUDAGraphMode.NONE:
        return
    if mode != CUDAGraphMode.FULL_DECODE_ONLY:
        raise ValueError(
            f"kvq.state stages the packed states of batches with a prefill around vLLM's GDN kernels, "
            f"which CUDA graphs cannot capture (cudagraph_mode {mode.name}); {STATE_GRAPHS_FIX}"
        )
    from vllm_kvq.kernels.stepquant.triton_step import shape_error

    why = ("kvq.kernels='reference' stages them" if s.kernels == "reference"
           else shape_error(plan.k_dim, plan.v_dim))
    if why:
        raise ValueError(f"CUDA graphs would capture staged decode batches of kvq.state ({why}); pass --enforce-eager")


def _small_blocks(vllm_config, draft: bool = False) -> None:
    """vLLM pads every GDN state page up to a whole attention block; at its
    default 128-token blocks that padding would eat most of a packed state's
    saving, so unless the user chose a block size, take the smallest one the
    attention backend supports (vLLM then sizes hybrid blocks from the page).
    With a draft model's layers (``draft``) the block must suit the draft's
    backend too, and OSCAR's blocks grow from it to a whole number of draft
    pages (:func:`draft_sharing_block_size`): small here keeps them small."""
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    cache_config = vllm_config.cache_config
    if cache_config.user_specified_block_size:
        return
    backends = [vllm_config.attention_config.backend or AttentionBackendEnum.CPU_ATTN]
    if draft:
        default = AttentionBackendEnum.CPU_ATTN if current_platform.is_cpu() else AttentionBackendEnum.FLASH_ATTN
        backends.append(vllm_config.speculative_config.attention_backend or default)
    cache_config.block_size = math.lcm(*(min(s.base if isinstance(s, MultipleOf) else s
                                             for s in b.get_class().get_supported_kernel_block_sizes())
                                         for b in backends))
    cache_config.user_specified_block_size = True
