"""The weight-loading seam: the value rotation R_V is folded into the
projections after a checkpoint is loaded, before vLLM repacks the weights.

vLLM 0.32 symbols this relies on:
``vllm.model_executor.model_loader.base_loader.process_weights_after_loading(model, model_config,
target_device)``, called by every model loader.
"""

from __future__ import annotations

import functools


def install() -> None:
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
