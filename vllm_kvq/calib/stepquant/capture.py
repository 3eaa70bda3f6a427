"""Run a transformers GDN hybrid with every gated-delta-net recurrence routed
through the FP32 reference loop, feeding a StateStatsCollector.

transformers' GDN modules (``Qwen3NextGatedDeltaNet``, ``Qwen3_5GatedDeltaNet``)
call module-level ``torch_chunk_gated_delta_rule`` /
``torch_recurrent_gated_delta_rule`` with post-conv q, k, v, the log decay g and
β = sigmoid(b). While ``capture`` is active those names point at
``recurrence.gated_delta_rule``; a forward pre-hook tells it which layer is
running. The layer output is the reference loop's, equal to transformers' own
to float tolerance.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import torch

from vllm_kvq.calib.stepquant.recurrence import gated_delta_rule
from vllm_kvq.calib.stepquant.stats import StateStatsCollector

KERNEL_NAMES = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")


def gdn_modules(model) -> dict[int, torch.nn.Module]:
    """GDN modules by global layer id (their ``layer_idx``)."""
    out = {int(m.layer_idx): m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")}
    if not out:
        raise ValueError("no gated-delta-net layers found; STEPQuant calibration needs a GDN hybrid "
                         "(Qwen3-Next / Qwen3.5)")
    return out


@contextmanager
def capture(model, collector: StateStatsCollector):
    """Route the model's GDN recurrences through the reference loop while active."""
    modules = gdn_modules(model)
    current = {"layer": None}

    def kernel(*args, **kwargs):
        hook = []  # the state callback, once the inputs are seen
        on_inputs = lambda *x: hook.append(collector.observe_inputs(current["layer"], *x))  # noqa: E731
        return gated_delta_rule(*args, on_inputs=on_inputs, on_update=lambda t, s: hook[0](t, s), **kwargs)

    handles = [m.register_forward_pre_hook(lambda mod, _a, _i=i: current.__setitem__("layer", _i))
               for i, m in modules.items()]
    saved = []
    for mod_name in {type(m).__module__ for m in modules.values()}:
        py_mod = sys.modules[mod_name]
        for name in KERNEL_NAMES:
            if hasattr(py_mod, name):
                saved.append((py_mod, name, getattr(py_mod, name)))
                setattr(py_mod, name, kernel)
    try:
        yield modules
    finally:
        for py_mod, name, fn in saved:
            setattr(py_mod, name, fn)
        for h in handles:
            h.remove()


class _Done(Exception):
    """Raised after the last GDN layer: later layers and the LM head add nothing."""


@torch.no_grad()
def run_windows(model, windows: list[list[int]], collector: StateStatsCollector, device: str,
                desc: str = "GDN state statistics") -> None:
    """Stream windows (batch 1) through the model up to its last GDN layer."""
    from tqdm import tqdm

    def stop(*_):
        raise _Done

    with capture(model, collector) as modules:
        handle = modules[max(modules)].register_forward_hook(stop)
        try:
            for ids in tqdm(windows, desc=desc, unit="window"):
                try:
                    model(torch.tensor([ids], device=device), use_cache=False)
                except _Done:
                    pass
        finally:
            handle.remove()
