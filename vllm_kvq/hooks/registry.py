"""The registry seam: OSCAR's name for ``--attention-backend``, its pickling
into spawned processes, its KV-cache spec and manager, and the platform hooks
that run the start-up checks and let the CPU platform pick OSCAR.

vLLM 0.32 symbols this relies on:

* ``vllm.v1.attention.backends.registry.AttentionBackendEnum``, ``register_backend(name, path)``;
* ``vllm.v1.kv_cache_spec_registry.KVCacheSpecRegistry._ensure_registered``, ``.register(spec,
  manager, spec)``;
* ``vllm.platforms.current_platform``: its class's ``check_and_update_config(vllm_config)`` and, for
  ``CpuPlatform``, ``get_attn_backend_cls(selected_backend, attn_selector_config, num_heads)``;
* ``vllm_config.attention_config.backend`` (an ``AttentionBackendEnum`` member or None).
"""

from __future__ import annotations

import functools

BACKEND_CLASS = "vllm_kvq.backends.oscar.OscarBackend"


def install() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    from vllm_kvq.backends.kv_spec import OscarAttentionSpec, OscarKVCacheManager
    from vllm_kvq.backends.oscar import BACKEND_NAME

    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(BACKEND_NAME, BACKEND_CLASS)
    AttentionBackendEnum[BACKEND_NAME].__reduce_ex__ = lambda proto, _n=BACKEND_NAME: (restore_backend, (_n,))
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(OscarAttentionSpec, OscarKVCacheManager, OscarAttentionSpec)
    _patch_platforms()


def restore_backend(name: str):
    """Unpickling hook for the dynamic enum member (spawned/Ray processes
    unpickle the config before they load plugins)."""
    from vllm_kvq.plugin import register

    register()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum[name]


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

        if getattr(getattr(vllm_config.attention_config, "backend", None), "name", None) == "OSCAR":
            check_oscar_config(vllm_config)
        check_state_config(vllm_config)

    platform_cls.check_and_update_config = classmethod(check_and_update_config)

    if platform_cls.__name__ == "CpuPlatform":
        orig_get = platform_cls.get_attn_backend_cls.__func__

        @functools.wraps(orig_get)
        def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
            # The CPU platform otherwise always answers CPU_ATTN.
            if getattr(selected_backend, "name", None) == "OSCAR" and not attn_selector_config.use_mla:
                if reasons := selected_backend.get_class().validate_configuration(
                        device_capability=None, **attn_selector_config._asdict()):
                    raise ValueError(f"OSCAR cannot serve this model: {', '.join(reasons)}")
                return selected_backend.get_path()
            return orig_get(cls, selected_backend, attn_selector_config, num_heads)

        platform_cls.get_attn_backend_cls = classmethod(get_attn_backend_cls)
