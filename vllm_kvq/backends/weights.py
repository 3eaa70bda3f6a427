"""Fold the value rotation R_V into the projection weights at load.

With row vectors ``v' = v @ R_V``: the V rows of ``qkv_proj`` become
``R_V^T W_v`` (bias ``b_v @ R_V``), so the cache receives rotated values for
free; the matching ``o_proj`` columns become ``W_o[:, h] @ R_V``, so the rotated
attention output needs no un-rotation (with an output gate between attention
and ``o_proj``, as in Qwen3-Next, the backend un-rotates instead). Runs after the checkpoint is loaded and
before vLLM repacks weights (``process_weights_after_loading``). FP8 weights
are dequantized, rotated and requantized (``fp8_weights``).
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.logger import init_logger

from vllm_kvq.backends import fp8_weights
from vllm_kvq.backends.oscar import OscarImpl, local_kv_heads

logger = init_logger("vllm." + __name__)


def _oscar_attention_blocks(model: nn.Module):
    """(name, block) for every module whose ``attn`` runs OSCAR."""
    for name, module in model.named_modules():
        attn = getattr(module, "attn", None)
        if isinstance(getattr(attn, "impl", None), OscarImpl):
            yield name, module


def _weight_ok(linear: nn.Module) -> bool:
    weight = getattr(linear, "weight", None)
    return isinstance(weight, torch.Tensor) and (
        fp8_weights.is_fp8(linear) or (weight.dtype.is_floating_point and weight.element_size() >= 2))


def _rotate(linear: nn.Module, rotate_heads, rows: slice, cols: slice) -> None:
    """Apply ``rotate_heads`` (in place; it multiplies one head block at a time
    in fp32) to the weight: directly for dense weights, so only one head block
    is ever held in fp32; on the dequantized weight for FP8, whose touched
    region is then requantized."""
    if fp8_weights.is_fp8(linear):
        dense = fp8_weights.dequantize(linear)
        rotate_heads(dense)
        fp8_weights.requantize(linear, dense, rows, cols)
        return
    rotate_heads(linear.weight.data)


def fold_value_rotations(model: nn.Module) -> int:
    """Fold R_V of every OSCAR layer into its weights; return layers folded."""
    folded = 0
    for name, block in _oscar_attention_blocks(model):
        impl: OscarImpl = block.attn.impl
        impl.bind_layer(block.attn.layer_name)
        if impl.v_identity:
            continue
        qkv, o_proj = getattr(block, "qkv_proj", None), getattr(block, "o_proj", None)
        if not (_weight_ok(qkv) and _weight_ok(o_proj)):
            raise NotImplementedError(
                f"OSCAR cannot fold the value rotation into {name}: it needs qkv_proj and o_proj "
                "weights in bf16/fp16/fp32 or FP8 (use kvq.rotation='none' for this model)"
            )
        d = impl.head_size
        hq, hkv = impl.num_heads, impl.num_kv_heads
        r_v = impl.v_rotation.float()  # [hkv, D, D]
        v_rows = slice(qkv.weight.shape[0] - hkv * d, qkv.weight.shape[0])  # [q (+gate), k, v]: V last
        # An output gate multiplies the attention output channel by channel
        # before o_proj, so R_V cannot pass through it: the backend un-rotates.
        gated = bool(getattr(block, "attn_output_gate", False))
        heads = local_kv_heads(hkv, impl.artifact.num_kv_heads)
        q_start, group = _local_query_start(hq), impl.heads_per_kv

        def rotate_v_rows(w: torch.Tensor) -> None:  # W_v[head j] <- R_j^T W_v[head j], in fp32
            for j, r in enumerate(r_v):
                rows = w[v_rows.start + j * d : v_rows.start + (j + 1) * d]
                rows.copy_(r.t().to(w.device) @ rows.float())

        def rotate_o_cols(w: torch.Tensor) -> None:  # W_o[:, head h] <- W_o[:, head h] R_kv(h), in fp32
            for h in range(hq):
                cols = w[:, h * d : (h + 1) * d]
                cols.copy_(cols.float() @ r_v[(q_start + h) // group - heads[0]].to(w.device))

        with torch.no_grad():
            _rotate(qkv, rotate_v_rows, v_rows, slice(0, qkv.weight.shape[1]))
            bias = getattr(qkv, "bias", None)
            if isinstance(bias, torch.Tensor):
                for j, r in enumerate(r_v):
                    b = bias.data[v_rows.start + j * d : v_rows.start + (j + 1) * d]
                    b.copy_((b.float() @ r.to(b.device)).to(b.dtype))
            if not gated:
                _rotate(o_proj, rotate_o_cols, slice(0, o_proj.weight.shape[0]), slice(0, hq * d))
        impl.v_absorbed = True
        impl.unrotate_output = gated
        folded += 1
    if folded:
        logger.info("OSCAR: folded value rotations into %d attention layers", folded)
    return folded


def _local_query_start(num_local_heads: int) -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank() * num_local_heads
