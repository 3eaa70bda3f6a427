"""Fold the value rotation R_V into the projection weights at load.

With row vectors ``v' = v @ R_V``: the V rows of ``qkv_proj`` become
``R_V^T W_v`` (bias ``b_v @ R_V``), so the cache receives rotated values for
free; the matching ``o_proj`` columns become ``W_o[:, h] @ R_V``, so the rotated
attention output needs no un-rotation (with an output gate between attention
and ``o_proj``, as in Qwen3-Next, the backend un-rotates instead). FP8 weights
are dequantized, rotated and requantized (``fp8_weights``).
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.logger import init_logger

from vllm_kvq.backends import fp8_weights
from vllm_kvq.backends.oscar import OscarImpl, local_kv_heads

logger = init_logger("vllm." + __name__)


def _weight_ok(linear: nn.Module) -> bool:
    weight = getattr(linear, "weight", None)
    return isinstance(weight, torch.Tensor) and (
        fp8_weights.is_fp8(linear) or (weight.dtype.is_floating_point and weight.element_size() >= 2))


def _rotate(linear: nn.Module, rotate_heads, rows: slice, cols: slice) -> None:
    """``rotate_heads`` (in place, one head block at a time in fp32) on the weight: dense weights
    directly, so no more than one head block is held in fp32; FP8 dequantized, then requantized."""
    if not fp8_weights.is_fp8(linear):
        return rotate_heads(linear.weight.data)
    dense = fp8_weights.dequantize(linear)
    rotate_heads(dense)
    fp8_weights.requantize(linear, dense, rows, cols)


def fold_value_rotations(model: nn.Module) -> int:
    """Fold R_V of every OSCAR layer into its weights; return layers folded."""
    from vllm.distributed import get_tensor_model_parallel_rank

    folded = 0
    for name, block in model.named_modules():
        impl = getattr(getattr(block, "attn", None), "impl", None)
        if not isinstance(impl, OscarImpl):
            continue
        impl.bind_layer(block.attn.layer_name)
        if impl.v_identity:
            continue
        qkv, o_proj = getattr(block, "qkv_proj", None), getattr(block, "o_proj", None)
        if not (_weight_ok(qkv) and _weight_ok(o_proj)):
            raise NotImplementedError(
                f"OSCAR cannot fold the value rotation into {name}: it needs qkv_proj and o_proj "
                "weights in bf16/fp16/fp32 or FP8 (use kvq.rotation='none' for this model)")
        d, hq, hkv = impl.head_size, impl.num_heads, impl.num_kv_heads
        r_v = impl.v_rotation.float()  # [hkv, D, D]
        v0 = qkv.weight.shape[0] - hkv * d  # rows [q (+gate), k, v]: V last
        # An output gate multiplies the attention output channel by channel
        # before o_proj, so R_V cannot pass through it: the backend un-rotates.
        gated = bool(getattr(block, "attn_output_gate", False))
        first_kv = local_kv_heads(hkv, impl.artifact.num_kv_heads)[0]
        q_start = get_tensor_model_parallel_rank() * hq

        def rotate_v_rows(w: torch.Tensor) -> None:  # W_v[head j] <- R_j^T W_v[head j], in fp32
            for j, r in enumerate(r_v):
                rows = w[v0 + j * d : v0 + (j + 1) * d]
                rows.copy_(r.t().to(w.device) @ rows.float())

        def rotate_o_cols(w: torch.Tensor) -> None:  # W_o[:, head h] <- W_o[:, head h] R_kv(h), in fp32
            for h in range(hq):
                cols = w[:, h * d : (h + 1) * d]
                cols.copy_(cols.float() @ r_v[(q_start + h) // impl.heads_per_kv - first_kv].to(w.device))

        with torch.no_grad():
            _rotate(qkv, rotate_v_rows, slice(v0, qkv.weight.shape[0]), slice(0, qkv.weight.shape[1]))
            if isinstance(bias := getattr(qkv, "bias", None), torch.Tensor):
                rotate_v_rows(bias.data.unsqueeze(-1))  # as a column: b_v[head j] <- b_v[head j] R_j
            if not gated:
                _rotate(o_proj, rotate_o_cols, slice(0, o_proj.weight.shape[0]), slice(0, hq * d))
        impl.v_absorbed, impl.unrotate_output = True, gated
        folded += 1
    if folded:
        logger.info("OSCAR: folded value rotations into %d attention layers", folded)
    return folded
