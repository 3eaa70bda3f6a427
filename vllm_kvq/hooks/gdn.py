"""The gated-delta-net seam: vLLM's GDN layers, their CPU step and the model
classes vLLM sizes hybrid pages from, made to keep every request's recurrent
state as a packed record (``kvq.state``; the pool itself is
:mod:`vllm_kvq.backends.state_pool`).

vLLM 0.32 symbols this relies on:

* ``vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn.QwenGatedDeltaNetAttention``:
  ``__init__``, ``get_state_shape``, ``get_state_dtype``, ``_forward_core(mixed_qkv, b, a, out)``,
  attributes ``kv_cache`` (conv, recurrent), ``prefix``, ``layer_idx``, ``tp_size``, ``model_config``,
  ``conv1d``, ``activation``, ``A_log``, ``dt_bias``, ``num_k_heads``; the module's
  ``fused_sigmoid_gating_delta_rule_update``, which ``_forward_core`` calls once, with keywords, for the
  decode rows it peels off a mixed batch (``split_non_spec``);
* ``vllm.model_executor.layers.mamba.ops.cpu.gdn_attention._cpu_gdn_attention_nonspec``;
* ``Qwen3NextForCausalLM``, ``Qwen3_5ForCausalLMBase``, ``Qwen3_5ForConditionalGeneration``:
  ``get_mamba_state_shape_from_config``, ``get_mamba_state_dtype_from_config``, ``forward``
  (the model's whole step: CUDA decode writebacks are joined at its end);
* the GDN metadata fields ``num_decodes``, ``num_prefills``, ``num_actual_tokens``,
  ``non_spec_state_indices_tensor``, ``prefill_state_indices``, ``has_initial_state``,
  ``spec_sequence_masks``; ``vllm.forward_context.get_forward_context``;
  ``vllm.model_executor.layers.mamba.ops.causal_conv1d.causal_conv1d_update`` and
  ``mamba_utils.is_conv_state_dim_first``.
"""

from __future__ import annotations

import dataclasses
import functools
import types

import torch

from vllm_kvq.backends.state_pool import (decode_plan, decode_states, encode_states, join_writebacks, layer_pool,
                                         packed_decode, packed_step)
from vllm_kvq.hooks.post_import import after_import

GDN_LAYER_MODULE = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"
GDN_CPU_MODULE = "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention"
GDN_MODEL_CLASSES = {
    "vllm.model_executor.models.qwen3_next": ("Qwen3NextForCausalLM",),
    "vllm.model_executor.models.qwen3_5": ("Qwen3_5ForCausalLMBase", "Qwen3_5ForConditionalGeneration"),
}


def install() -> None:
    """Patch the GDN modules when vLLM imports them (importing them here would
    cost every process seconds, hybrid model or not)."""
    after_import(GDN_LAYER_MODULE, _patch_gdn_layer)
    after_import(GDN_CPU_MODULE, _patch_gdn_cpu_step)
    for module, names in GDN_MODEL_CLASSES.items():
        after_import(module, functools.partial(_patch_gdn_model_classes, names=names))


def _patch_gdn_layer(module) -> None:
    cls = module.QwenGatedDeltaNetAttention
    orig_init, orig_shape, orig_dtype = cls.__init__, cls.get_state_shape, cls.get_state_dtype

    @functools.wraps(orig_init)
    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        layer_pool(self)

    def record_bytes(self):
        pool = layer_pool(self)
        return None if pool is None else pool.layout.size

    cls.__init__ = __init__
    cls.get_state_shape, cls.get_state_dtype = _packed(orig_shape, orig_dtype, record_bytes)
    cls._kvq_native_dtypes = orig_dtype
    cls._forward_core = staged_forward_core(cls._forward_core)
    module.fused_sigmoid_gating_delta_rule_update = _divertable(module.fused_sigmoid_gating_delta_rule_update)


def _patch_gdn_cpu_step(module) -> None:
    module._cpu_gdn_attention_nonspec = staged(module._cpu_gdn_attention_nonspec)


def _patch_gdn_model_classes(module, names) -> None:
    """vLLM sizes hybrid pages from these class methods, before any layer exists."""
    from vllm_kvq.backends import settings as kvq_settings
    from vllm_kvq.backends.resolve import pool_plan

    def record_bytes(klass, vllm_config):
        s = kvq_settings.from_vllm_config(vllm_config)
        plan = pool_plan(s, vllm_config.model_config.hf_config, vllm_config.parallel_config.tensor_parallel_size)
        return None if plan is None else plan.record_bytes

    for name in names:
        cls = getattr(module, name, None)
        if cls is None or "get_mamba_state_shape_from_config" not in cls.__dict__:
            continue
        getters = _packed(cls.get_mamba_state_shape_from_config.__func__,
                          cls.get_mamba_state_dtype_from_config.__func__, record_bytes)
        cls.get_mamba_state_shape_from_config, cls.get_mamba_state_dtype_from_config = map(classmethod, getters)
        if "forward" in cls.__dict__:
            cls.forward = _joining(cls.forward)


def _packed(orig_shape, orig_dtype, record_bytes):
    """State shape and dtype getters that declare the recurrent state as
    ``record_bytes(...)`` uint8 bytes (None: vLLM's own) beside the conv state."""

    @functools.wraps(orig_shape)
    def shape(*args):
        shapes, size = orig_shape(*args), record_bytes(*args)
        return shapes if size is None else (shapes[0], (size,))

    @functools.wraps(orig_dtype)
    def dtype(*args):
        dtypes = orig_dtype(*args)
        return dtypes if record_bytes(*args) is None else (dtypes[0], torch.uint8)

    return shape, dtype


def _joining(forward):
    """The model's forward, ending with the stream waiting for the GDN layers'
    writebacks (under a CUDA graph capture: joined into the graph)."""

    @functools.wraps(forward)
    def run(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        join_writebacks()
        return out

    return run


class _StagedLayer:
    """The GDN layer as vLLM's kernels see it, with staged states: attributes
    come from the layer, methods run on this view (so ``self.kv_cache`` inside
    them is the scratch)."""

    def __init__(self, layer, kv_cache):
        self.__dict__["_layer"] = layer
        self.__dict__["kv_cache"] = kv_cache

    def __getattr__(self, name):
        layer = self.__dict__["_layer"]
        for klass in type(layer).__mro__:
            if name in klass.__dict__:
                attr = klass.__dict__[name]
                if isinstance(attr, types.FunctionType):
                    return types.MethodType(attr, self)
                break
        return getattr(layer, name)


def _stage(layer, md, pool, decodes_in_place: bool = False):
    """Decode the active slots' records (and copy their conv states) into a
    scratch indexed 1..n; returns the staged layer, the metadata that points
    at the scratch, and the function that packs the new states back. With
    ``decodes_in_place`` (a mixed batch whose decode rows take the packed
    step, :func:`_diverted_decodes`) only the prefill rows' states are
    staged, indexed 1..p through ``prefill_state_indices``; every row's conv
    state still is (vLLM's prefill conv runs over the whole batch)."""
    n = md.num_decodes + md.num_prefills
    slots = md.non_spec_state_indices_tensor[:n].to(torch.long)
    conv, records = layer.kv_cache
    k, v = pool.layout.k_dim, pool.layout.v_dim
    heads = len(pool.layout.bits)
    live = slots > 0  # slot 0 is vLLM's null block (padding)
    fresh = torch.zeros_like(live)
    if md.num_prefills:
        fresh[md.num_decodes:] = ~md.has_initial_state[md.num_decodes:n].to(torch.bool)
    read = live & ~fresh
    conv_slots, conv_live = slots, live
    if decodes_in_place:
        slots, live, read = slots[md.num_decodes:], live[md.num_decodes:], read[md.num_decodes:]
    rows = len(slots) + 1
    states = torch.empty(rows, heads, k, v, dtype=pool.native_dtype, device=records.device)
    # On CPU (where asking costs no device sync) whole batches skip the masked copies
    cpu = records.device.type == "cpu"
    all_live = cpu and bool(live.all())
    if cpu and states.dtype == torch.float32 and bool(read.all()):  # decode batches: straight into the scratch
        states[0].zero_()
        decode_states(records[slots], pool, out=states[1:])
    else:
        states.zero_()
        if bool(read.any()):
            states[1:][read] = decode_states(records[slots[read]], pool).to(pool.native_dtype)
    conv_scratch = torch.zeros((n + 1, *conv.shape[1:]), dtype=conv.dtype, device=conv.device)
    conv_scratch[1:][conv_live] = conv[conv_slots[conv_live]]
    local = torch.arange(1, n + 1, dtype=md.non_spec_state_indices_tensor.dtype, device=slots.device)
    changes = {"non_spec_state_indices_tensor": local}
    if getattr(md, "prefill_state_indices", None) is not None:
        start = 0 if decodes_in_place else md.num_decodes
        changes["prefill_state_indices"] = local[start : start + md.num_prefills].to(md.prefill_state_indices.dtype)
    # The CPU kernels view the state bytes as [HV, K, V] (key rows): the
    # scratch is laid out that way and declared as vLLM's [HV, V, K]. The CUDA
    # kernels read [HV, V, K] as it is: the scratch is transposed for them.
    if cpu:
        scratch = states.view(rows, heads, v, k)
    else:
        scratch = states.transpose(-1, -2).contiguous()
    proxy = _StagedLayer(layer, (conv_scratch, scratch))

    def finish():
        new = scratch.view(rows, heads, k, v) if cpu else scratch.transpose(-1, -2)
        conv[conv_slots[conv_live]] = conv_scratch[1:][conv_live]
        records[slots[live]] = encode_states(new[1:] if all_live else new[1:][live], pool)

    return proxy, dataclasses.replace(md, **changes), finish


def staged(run_native):
    """Wrap vLLM's CPU GDN step ``run_native(layer, metadata, mixed_qkv, b,
    a, out)`` so that it reads and writes packed records."""

    @functools.wraps(run_native)
    def run(layer, md, mixed_qkv, b, a, core_attn_out):
        pool = layer_pool(layer)
        if pool is None:
            return run_native(layer, md, mixed_qkv, b, a, core_attn_out)
        proxy, staged_md, finish = _stage(layer, md, pool)
        run_native(proxy, staged_md, mixed_qkv, b, a, core_attn_out)
        finish()

    return run


def _split_step_rows(md) -> str | None:
    """Which rows of a batch the split step takes: ``"all"`` (a decode
    batch), ``"decodes"`` (decodes beside prefills), None (nothing decodes,
    or drafts are verified: all staged)."""
    if md.spec_sequence_masks is not None or md.num_decodes == 0:
        return None
    return "decodes" if md.num_prefills else "all"


def fused_decode(layer, md, decoder, mixed_qkv, b, a, core_attn_out) -> None:
    """vLLM's non-speculative decode branch with the packed step: the conv
    update on the native conv state, as vLLM runs it, then :func:`packed_decode`
    on the layer's records (the readout now, the writeback on its stream)."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update

    n = md.num_actual_tokens
    conv, records = layer.kv_cache
    slots = md.non_spec_state_indices_tensor[:n]
    weight = layer.conv1d.weight
    qkv = causal_conv1d_update(
        mixed_qkv[:n], conv if is_conv_state_dim_first() else conv.transpose(-1, -2),
        weight.view(weight.size(0), weight.size(2)), layer.conv1d.bias, layer.activation,
        conv_state_indices=slots, validate_data=False)
    packed_decode(records, slots, decoder, qkv, a[:n], b[:n], layer.A_log, layer.dt_bias,
                  layer.num_k_heads // layer.tp_size, core_attn_out[:n])


def staged_forward_core(forward_core):
    """The CUDA path, ``layer._forward_core(mixed_qkv, b, a, out)``, which
    finds its metadata in vLLM's forward context: decode batches go through
    the split Triton step on the records in place; other batches are staged,
    except that a batch mixing decodes with prefills (no speculation) stages
    only its prefill rows and the decode rows vLLM peels off take the split
    step (:func:`_divertable`)."""

    @functools.wraps(forward_core)
    def run(self, mixed_qkv, b, a, core_attn_out):
        global _DIVERTED
        pool = layer_pool(self)
        table = None
        if pool is not None:
            from vllm.forward_context import get_forward_context

            table = get_forward_context().attn_metadata
        md = table.get(self.prefix) if isinstance(table, dict) else None
        if md is None:
            return forward_core(self, mixed_qkv, b, a, core_attn_out)
        rows, decoder = _split_step_rows(md), None
        if rows is not None:
            decoder = decode_plan(pool, self.kv_cache[1].device, self.num_k_heads // self.tp_size)
            if decoder is not None and rows == "all":
                return fused_decode(self, md, decoder, mixed_qkv, b, a, core_attn_out)
        proxy, staged_md, finish = _stage(self, md, pool, decodes_in_place=decoder is not None)
        table[self.prefix] = staged_md
        if decoder is not None:
            _DIVERTED = _diverted_decodes(self, decoder, md.non_spec_state_indices_tensor[: md.num_decodes])
        try:
            forward_core(proxy, mixed_qkv, b, a, core_attn_out)
            missed = _DIVERTED is not None
        finally:
            table[self.prefix], _DIVERTED = md, None
        if missed:
            raise RuntimeError("vLLM's GDN forward did not run its decode update on a mixed batch's decode rows: "
                               "this vLLM's forward is not the one the GDN seam was written for")
        finish()

    return run


_DIVERTED = None  # while a mixed batch's forward runs: its decode rows' split step (_diverted_decodes)


def _divertable(update):
    """vLLM's recurrent update as its GDN layer module calls it; while a mixed
    batch's forward runs, its one call (the decode rows vLLM peels off the
    batch, ``split_non_spec``) goes to the split step on the records."""

    @functools.wraps(update)
    def run(*args, **kwargs):
        global _DIVERTED
        if _DIVERTED is None:
            return update(*args, **kwargs)
        step, _DIVERTED = _DIVERTED, None  # one call a forward
        return step(**kwargs)

    return run


def _diverted_decodes(layer, decoder, slots):
    """The split step for the decode rows of a mixed batch, called with
    vLLM's arguments (q, k, v ``[1, N, heads, dim]`` after the conv, raw gate
    inputs a, b); returns ``(out [1, N, H, V], None)`` as vLLM's call does."""
    records = layer.kv_cache[1]

    def run(*, q, k, v, a, b, A_log, dt_bias, **_):
        if v.shape[1] != slots.shape[0]:
            raise RuntimeError(f"vLLM's decode update got {v.shape[1]} rows where the batch has {slots.shape[0]} "
                               f"decodes: this vLLM's GDN forward is not the one the seam was written for")
        out = torch.empty(v.shape[1:], dtype=v.dtype, device=v.device)
        packed_step(records, slots, decoder, q[0], k[0], v[0], a, b, A_log, dt_bias, out)
        return out.unsqueeze(0), None

    return run
