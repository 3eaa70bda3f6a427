"""Functions run inside vLLM's workers (``LLM.apply_model``) to see what an
engine really allocated and ran."""

from __future__ import annotations


def allocated_state_bytes(model) -> list[dict]:
    """Per GDN layer of a loaded model: the recurrent state's per-slot shape
    and dtype, the bytes vLLM allocated per slot (the whole page: conv state,
    recurrent state, padding), for a packed pool this rank's head widths, and
    how many decode batches ran the Triton step from Python since
    :func:`count_fused_decodes` (a CUDA graph replay runs it without Python)."""
    out = []
    for module in model.modules():
        if hasattr(module, "_kvq_native_dtypes") and getattr(module, "kv_cache", None):
            conv, ssm = module.kv_cache
            pool = module.__dict__.get("_kvq_pool")
            out.append({"layer": module.layer_idx, "shape": list(ssm.shape[1:]), "dtype": str(ssm.dtype),
                        "page_bytes": conv.stride(0) * conv.element_size(),
                        "bits": list(pool.layout.bits) if pool else None,
                        "triton_calls": module.__dict__.get("_kvq_fused_calls", 0),
                        "mixed_calls": module.__dict__.get("_kvq_mixed_calls", 0)})
    return out


def count_fused_decodes(model) -> None:
    """Count, per GDN layer, the decode batches its packed Triton step runs
    from Python, and the mixed batches whose decode rows it takes (once per
    worker; :func:`allocated_state_bytes` reports them)."""
    from vllm_kvq.hooks import gdn

    if getattr(gdn.fused_decode, "_counted", False):
        return
    for name, key in (("fused_decode", "_kvq_fused_calls"), ("_diverted_decodes", "_kvq_mixed_calls")):
        setattr(gdn, name, _counting(getattr(gdn, name), key))


def _counting(run, key):
    def counted(layer, *args, **kwargs):
        layer.__dict__[key] = layer.__dict__.get(key, 0) + 1
        return run(layer, *args, **kwargs)

    counted._counted = True
    return counted
