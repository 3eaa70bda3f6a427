"""Fold the value rotation R_V into the projection weights at load.

With row vectors ``v' = v @ R_V``: the V rows of ``qkv_proj`` become
``R_V^T W_v`` (bias ``b_v @ R_V``), so the cache receives rotated values for
free; the matching ``o_proj`` columns become ``W_o[:, h] @ R_V``, so the rotated
attention output needs no un-rotation. Runs after the checkpoint is loaded and
before vLLM repacks weights (``process_weights_after_loading``).
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.logger import init_logger

from vllm_kvq.backends.oscar import OscarImpl, local_kv_heads

logger = init_logger("vllm." + __name__)


def _oscar_attention_blocks(model: nn.Module):
    """(name, block) for every module whose ``attn`` runs OSCAR."""
    for name, module in model.named_modules():
        attn = getattr(module, "attn", None)
        if isinstance(getattr(attn, "impl", None), OscarImpl):
            yield name, module


def _fold_linear_rows(weight: torch.Tensor, start: int, rotations: torch.Tensor) -> None:
    """``W[rows of head j] <- R_j^T W[rows of head j]`` in place, in fp32."""
    d = rotations.shape[-1]
    for j, r in enumerate(rotations):
        rows = weight.data[start + j * d : start + (j + 1) * d]
        rows.copy_((r.t().to(rows.device) @ rows.float()).to(rows.dtype))


def fold_value_rotations(model: nn.Module) -> int:
    """Fold R_V of every OSCAR layer into its weights; return layers folded."""
    folded = 0
    for name, block in _oscar_attention_blocks(model):
        impl: OscarImpl = block.attn.impl
        impl.bind_layer(block.attn.layer_name)
        if impl.v_identity:
            continue
        qkv, o_proj = getattr(block, "qkv_proj", None), getattr(block, "o_proj", None)
        weight_ok = all(
            isinstance(getattr(p, "weight", None), torch.Tensor) and p.weight.dtype.is_floating_point
            and p.weight.element_size() >= 2
            for p in (qkv, o_proj)
        )
        if not weight_ok:
            raise NotImplementedError(
                f"OSCAR cannot fold the value rotation into {name}: it needs dense "
                "qkv_proj and o_proj weights (use kvq.rotation='none' for this model)"
            )
        d = impl.head_size
        hq, hkv = impl.num_heads, impl.num_kv_heads
        r_v = impl.v_rotation  # [hkv, D, D]
        v_start = (hq + hkv) * d
        with torch.no_grad():
            _fold_linear_rows(qkv.weight, v_start, r_v)
            bias = getattr(qkv, "bias", None)
            if isinstance(bias, torch.Tensor):
                for j, r in enumerate(r_v):
                    b = bias.data[v_start + j * d : v_start + (j + 1) * d]
                    b.copy_((b.float() @ r.to(b.device)).to(b.dtype))
            heads = local_kv_heads(hkv, impl.artifact.num_kv_heads)
            group = impl.heads_per_kv
            q_start = _local_query_start(hq)
            w_o = o_proj.weight.data
            for h in range(hq):
                j = (q_start + h) // group - heads[0]
                cols = w_o[:, h * d : (h + 1) * d]
                cols.copy_((cols.float() @ r_v[j].to(cols.device)).to(cols.dtype))
        impl.v_absorbed = True
        folded += 1
    if folded:
        logger.info("OSCAR: folded value rotations into %d attention layers", folded)
    return folded


def _local_query_start(num_local_heads: int) -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank() * num_local_heads
