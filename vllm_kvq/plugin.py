"""Everything that touches vLLM's registries and internals (pinned: vLLM 0.32).

``register()`` is the ``vllm.general_plugins`` entry point. vLLM calls it in
every process it starts (API server or ``LLM``, engine core, workers), so it
must be cheap and idempotent. A port to another vLLM version changes this file.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys

BACKEND_CLASS = "vllm_kvq.backends.oscar.OscarBackend"
_done = False


def register() -> None:
    global _done
    if _done:
        return
    _done = True
    _register_backend()
    _register_kv_cache_spec()
    _patch_platforms()
    _patch_weight_loading()
    _patch_gdn_state()


def restore_backend(name: str):
    """Unpickling hook for the dynamic enum member (spawned/Ray processes
    unpickle the config before they load plugins)."""
    register()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum[name]


def _register_backend() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from vllm_kvq.backends.oscar import BACKEND_NAME

    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(BACKEND_NAME, BACKEND_CLASS)
    member = AttentionBackendEnum[BACKEND_NAME]
    member.__reduce_ex__ = lambda proto, _n=BACKEND_NAME: (restore_backend, (_n,))


def _register_kv_cache_spec() -> None:
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    from vllm_kvq.backends.kv_spec import OscarAttentionSpec, OscarKVCacheManager

    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(OscarAttentionSpec, OscarKVCacheManager, OscarAttentionSpec)


def is_oscar(vllm_config) -> bool:
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return backend is not None and getattr(backend, "name", None) == "OSCAR"


def _patch_platforms() -> None:
    from vllm.platforms import current_platform

    platform_cls = type(current_platform)
    if getattr(platform_cls, "_kvq_patched", False):
        return
    platform_cls._kvq_patched = True

    orig_check = platform_cls.check_and_update_config.__func__

    @functools.wraps(orig_check)
    def check_and_update_config(cls, vllm_config) -> None:
        orig_check(cls, vllm_config)
        from vllm_kvq.backends.startup import check_oscar_config, check_state_config

        if is_oscar(vllm_config):
            check_oscar_config(vllm_config)
        check_state_config(vllm_config)

    platform_cls.check_and_update_config = classmethod(check_and_update_config)

    if platform_cls.__name__ == "CpuPlatform":
        orig_get = platform_cls.get_attn_backend_cls.__func__

        @functools.wraps(orig_get)
        def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
            # The CPU platform otherwise always answers CPU_ATTN.
            if getattr(selected_backend, "name", None) == "OSCAR" and not attn_selector_config.use_mla:
                reasons = selected_backend.get_class().validate_configuration(
                    device_capability=None, **attn_selector_config._asdict()
                )
                if reasons:
                    raise ValueError(f"OSCAR cannot serve this model: {', '.join(reasons)}")
                return selected_backend.get_path()
            return orig_get(cls, selected_backend, attn_selector_config, num_heads)

        platform_cls.get_attn_backend_cls = classmethod(get_attn_backend_cls)


def _patch_weight_loading() -> None:
    from vllm.model_executor.model_loader import base_loader

    orig = base_loader.process_weights_after_loading
    if getattr(orig, "_kvq", False):
        return

    @functools.wraps(orig)
    def process_weights_after_loading(model, model_config, target_device):
        from vllm_kvq.backends.weights import fold_value_rotations

        fold_value_rotations(model)
        return orig(model, model_config, target_device)

    process_weights_after_loading._kvq = True
    base_loader.process_weights_after_loading = process_weights_after_loading


# ---------------------------------------------------------------------------
# Gated-delta-net state pool (kvq.state)
# ---------------------------------------------------------------------------

GDN_LAYER_MODULE = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"
GDN_CPU_MODULE = "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention"
GDN_MODEL_CLASSES = {
    "vllm.model_executor.models.qwen3_next": ("Qwen3NextForCausalLM",),
    "vllm.model_executor.models.qwen3_5": ("Qwen3_5ForCausalLMBase", "Qwen3_5ForConditionalGeneration"),
}


def _patch_gdn_state() -> None:
    """Patch the GDN modules when vLLM imports them (importing them here would
    cost every process seconds, hybrid model or not)."""
    after_import(GDN_LAYER_MODULE, _patch_gdn_layer)
    after_import(GDN_CPU_MODULE, _patch_gdn_cpu_step)
    for module, names in GDN_MODEL_CLASSES.items():
        after_import(module, functools.partial(_patch_gdn_model_classes, names=names))


def _patch_gdn_layer(module) -> None:
    import torch

    from vllm_kvq.backends.state_pool import layer_pool, staged_forward_core

    cls = module.QwenGatedDeltaNetAttention
    orig_init, orig_shape, orig_dtype = cls.__init__, cls.get_state_shape, cls.get_state_dtype

    @functools.wraps(orig_init)
    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        layer_pool(self)

    @functools.wraps(orig_shape)
    def get_state_shape(self):
        shapes = orig_shape(self)
        pool = layer_pool(self)
        return shapes if pool is None else (shapes[0], (pool.layout.size,))

    @functools.wraps(orig_dtype)
    def get_state_dtype(self):
        dtypes = orig_dtype(self)
        return dtypes if layer_pool(self) is None else (dtypes[0], torch.uint8)

    cls.__init__, cls.get_state_shape, cls.get_state_dtype = __init__, get_state_shape, get_state_dtype
    cls._kvq_native_dtypes = orig_dtype
    cls._forward_core = staged_forward_core(cls._forward_core)


def _patch_gdn_cpu_step(module) -> None:
    from vllm_kvq.backends.state_pool import staged

    module._cpu_gdn_attention_nonspec = staged(module._cpu_gdn_attention_nonspec)


def _patch_gdn_model_classes(module, names) -> None:
    """vLLM sizes hybrid pages from these class methods, before any layer exists."""
    import torch

    from vllm_kvq.backends import settings as kvq_settings
    from vllm_kvq.backends.resolve import pool_plan

    def plan_of(vllm_config):
        s = kvq_settings.from_vllm_config(vllm_config)
        return pool_plan(s, vllm_config.model_config.hf_config, vllm_config.parallel_config.tensor_parallel_size)

    for name in names:
        cls = getattr(module, name, None)
        if cls is None or "get_mamba_state_shape_from_config" not in cls.__dict__:
            continue
        orig_shape = cls.get_mamba_state_shape_from_config.__func__
        orig_dtype = cls.get_mamba_state_dtype_from_config.__func__

        def shape(klass, vllm_config, _orig=orig_shape):
            shapes = _orig(klass, vllm_config)
            plan = plan_of(vllm_config)
            return shapes if plan is None else (shapes[0], (plan.record_bytes,))

        def dtype(klass, vllm_config, _orig=orig_dtype):
            dtypes = _orig(klass, vllm_config)
            return dtypes if plan_of(vllm_config) is None else (dtypes[0], torch.uint8)

        cls.get_mamba_state_shape_from_config = classmethod(functools.wraps(orig_shape)(shape))
        cls.get_mamba_state_dtype_from_config = classmethod(functools.wraps(orig_dtype)(dtype))


class _PostImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs ``hook(module)`` right after ``name`` is first executed."""

    def __init__(self, name: str, hook):
        self.name, self.hook, self.spec = name, hook, None

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name or self.spec is not None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        self.spec = spec
        self.inner = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        self.hook(module)


def after_import(name: str, hook) -> None:
    """Call ``hook(module)`` once ``name`` is imported (now, if it already is)."""
    if name in sys.modules:
        hook(sys.modules[name])
    else:
        sys.meta_path.insert(0, _PostImport(name, hook))
