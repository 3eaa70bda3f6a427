"""The quantized gated-delta-net state pool: each GDN layer's packed records
(``kernels/stepquant/format.py``), declared and staged around vLLM's own GDN
step by the GDN seam (:mod:`vllm_kvq.hooks.gdn`). Here: a layer's pool, the
codec calls, and CUDA decode batches on the records in place, the foreground
on the layer's stream and the writeback on a second one; docs/stepquant.md,
"Streams and hazards", gives the ordering rules the events below keep.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_kvq.backends import settings as kvq_settings
from vllm_kvq.backends.resolve import pool_plan
from vllm_kvq.kernels.stepquant import reference as codec
from vllm_kvq.kernels.stepquant.format import StateLayout

@dataclass
class LayerPool:
    layout: StateLayout
    impact: torch.Tensor
    fit: str
    native_dtype: torch.dtype  # what vLLM's GDN kernels compute the state in
    kernels: str = "auto"  # kvq.kernels: "reference" keeps CUDA decode staged
    decoder: object = None  # the split step's PackedDecoder on the records' device (False: layout unsupported)


def layer_pool(layer) -> LayerPool | None:
    """The pool of one vLLM GDN layer, None when its state stays native.

    Resolved once, while the layer is built (vLLM's config and the TP rank are
    known then), and cached on the layer.
    """
    if "_kvq_pool" in layer.__dict__:
        return layer.__dict__["_kvq_pool"]
    s = kvq_settings.current()
    pool = None
    if s.state is not None:
        from vllm.distributed import get_tensor_model_parallel_rank

        plan = pool_plan(s, layer.model_config.hf_config, layer.tp_size)
        layout, impact = plan.local(layer.layer_idx, layer.tp_size, get_tensor_model_parallel_rank())
        pool = LayerPool(layout, impact, plan.fit, layer._kvq_native_dtypes()[1], s.kernels)
        where = getattr(getattr(layer, "A_log", None), "device", None)
        if where is not None and where.type == "cuda":  # now: a CUDA graph capture cannot allocate
            decode_plan(pool, where, layer.num_k_heads // layer.tp_size, _decode_rows())
    layer.__dict__["_kvq_pool"] = pool
    return pool


def encode_states(states: torch.Tensor, pool: LayerPool) -> torch.Tensor:
    return codec.encode(states.float(), pool.layout, pool.impact.to(states.device), pool.fit)


def decode_states(records: torch.Tensor, pool: LayerPool, out: torch.Tensor | None = None) -> torch.Tensor:
    return codec.decode(records, pool.layout, out)


class PackedDecoder:
    """One layer's split decode step on CUDA (or in Triton's interpreter):
    its tables, its scratch, and the events that order its two streams."""

    def __init__(self, pool: LayerPool, device, key_heads: int, rows: int):
        from vllm_kvq.kernels.stepquant.triton_step import StepPlan, StepScratch

        self.plan = StepPlan(pool.layout, pool.impact, device, pool.fit)
        self.scratch = StepScratch(self.plan, key_heads, rows, device)
        self.cuda = torch.device(device).type == "cuda"
        if self.cuda:
            self.stream = _writeback_stream(torch.device(device))
            self.foreground_done, self.writeback_done = torch.cuda.Event(), torch.cuda.Event()

    def scratch_for(self, n: int):
        """The scratch, grown (outside a capture) when a batch exceeds it."""
        if n > self.scratch.capacity:
            if self.cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"a captured decode batch of {n} exceeds the STEPQuant scratch's "
                                   f"{self.scratch.capacity} rows (sized from max_num_seqs)")
            from vllm_kvq.kernels.stepquant.triton_step import StepScratch

            if self.cuda:  # the old scratch goes back to the allocator: nothing may still read it
                torch.cuda.current_stream().wait_stream(self.stream)
            self.scratch = StepScratch(self.plan, self.scratch.key_heads, n, self.plan.impact.device)
        return self.scratch


_STREAMS: dict[int, torch.cuda.Stream] = {}
_UNJOINED: dict[int, torch.cuda.Event] = {}


def _writeback_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _STREAMS:
        _STREAMS[index] = torch.cuda.Stream(device=index)
    return _STREAMS[index]


def join_writebacks() -> None:
    """Make the current stream wait for every writeback started since the
    last join (the end of a forward; inside a CUDA graph capture this joins
    the writeback stream back into the graph)."""
    for index, done in list(_UNJOINED.items()):
        torch.cuda.current_stream(index).wait_event(done)
    _UNJOINED.clear()


def _decode_rows() -> int:
    """The most requests a decode batch can hold (padded under CUDA graphs)."""
    from vllm.config import get_current_vllm_config

    cfg = get_current_vllm_config()
    return max(cfg.scheduler_config.max_num_seqs, cfg.compilation_config.max_cudagraph_capture_size or 0)


def packed_decode(records, slots, decoder: PackedDecoder, mixed_qkv, a, b, A_log, dt_bias, num_k_heads: int,
                  out) -> None:
    """One decode token per request on packed records, in place.

    ``records [slots, size]`` uint8, any slot stride (vLLM's state view);
    ``slots [N]`` the requests' slot indices (below 1: padding, output zero,
    nothing touched); ``mixed_qkv [N, 2 H_k K + H V]`` after the conv; ``a,
    b [N, H]``; ``out [N, H, V]`` contiguous (the layer's output). The
    foreground prepares the inputs as vLLM's decode kernel does for an FP32
    state (q and k L2-normalised, q scaled by K^-1/2, ``g = -exp(A_log)
    softplus(a + dt_bias)``, ``beta = sigmoid(b)``, in fp32) and writes the
    readout of the unquantized new state into ``out`` on the current stream;
    the writeback packs the state back with the plan's fit on the writeback
    stream (on CPU, right after), with the fast fit (reciprocals: within the
    reference's bound and ~20% faster; docs/kernels.md).
    """
    lay = decoder.plan.layout
    kd, vd, hv = lay.k_dim, lay.v_dim, len(lay.bits)
    qk_dim = num_k_heads * kd
    if mixed_qkv.dim() != 2 or mixed_qkv.shape[1] != 2 * qk_dim + hv * vd or mixed_qkv.stride(1) != 1:
        raise ValueError(f"mixed_qkv must be [N, {2 * qk_dim + hv * vd}] ({num_k_heads} key heads of {kd}, {hv} "
                         f"value heads of {vd}) with unit column stride, got {tuple(mixed_qkv.shape)}")
    q, k, v = (mixed_qkv[:, lo:hi].unflatten(1, (-1, d))
               for lo, hi, d in ((0, qk_dim, kd), (qk_dim, 2 * qk_dim, kd), (2 * qk_dim, None, vd)))
    packed_step(records, slots, decoder, q, k, v, a, b, A_log, dt_bias, out)


def packed_step(records, slots, decoder: PackedDecoder, q, k, v, a, b, A_log, dt_bias, out) -> None:
    """:func:`packed_decode` on q, k ``[N, H_k, K]`` and v ``[N, H, V]``
    already split (any strides, a contiguous last dimension)."""
    from vllm_kvq.kernels.stepquant.triton_step import foreground_, writeback_  # Triton: only where it runs

    n = v.shape[0]
    scratch = decoder.scratch_for(n)
    args = (records, slots, decoder.plan, scratch, q, k, v, a, b)
    kw = dict(out=out, raw_gates=(A_log, dt_bias))
    if not decoder.cuda:
        foreground_(*args, **kw)
        writeback_(records, decoder.plan, scratch, n)
        return
    main = torch.cuda.current_stream()
    if torch.cuda.is_current_stream_capturing():  # an event recorded in a capture is waited on only inside it
        started, done = torch.cuda.Event(), torch.cuda.Event()
    else:
        started, done = decoder.foreground_done, decoder.writeback_done
        main.wait_event(done)  # the layer's last writeback: a no-op once the last forward joined it
    foreground_(*args, **kw)
    started.record(main)
    decoder.stream.wait_event(started)
    with torch.cuda.stream(decoder.stream):
        writeback_(records, decoder.plan, scratch, n)
    done.record(decoder.stream)
    _UNJOINED[records.device.index] = done


def decode_plan(pool: LayerPool, device, key_heads: int, rows: int = 256) -> PackedDecoder | None:
    """The split step for this layer's decode batches, or None when they
    stay staged (``kvq.kernels = "reference"``, or a layout the kernels do not
    take). Built once, with a scratch of ``rows`` requests."""
    if pool.kernels == "reference":
        return None
    if pool.decoder is None:
        if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the STEPQuant step's tables must be built before a CUDA graph capture")
        try:
            pool.decoder = PackedDecoder(pool, device, key_heads, rows)
        except ValueError as e:
            from vllm.logger import init_logger

            init_logger(__name__).warning("STEPQuant decode stays staged: %s", e)
            pool.decoder = False
    return pool.decoder or None
