"""``vllm-kvq report``: what a KV-cache configuration holds on one model.

Every number comes from the page formats and from vLLM 0.32's own block
accounting, replayed here without starting an engine:

* **Block size.** Dense models: the CPU build's 128 tokens (OSCAR asks for at
  least 128 on every platform). Hybrids: vLLM grows the attention block until
  one attention page (its one-token bytes times the block) holds a GDN state
  page, in steps of the block it started from (128, or with ``kvq.state`` the
  backend's smallest kernel block), and pads the state page to it.
* **Blocks.** ``num_blocks = budget // (layers per KV-cache group x page)``;
  vLLM cuts the layers of each type into groups of equal size.
* **Capacity.** A request at ``L`` tokens holds ``ceil(L / block) + R``
  blocks of each attention group (R: OSCAR's per-request sink/window state
  blocks) and one block of each GDN group; vLLM reports
  ``num_blocks / blocks_per_request`` requests and ``int(that x L)`` tokens.

Accuracy rows are read from the benchmarks' JSON results; the benchmark
scripts own the map from a row's name to its settings, so they are read from
there too.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from vllm_kvq.backends.settings import OscarSettings

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"
CONTEXTS = tuple(1024 << i for i in range(8))  # 1K .. 128K
INSTALL_HINT = "pip install 'vllm-kvq[report]'"

# vLLM 0.32 facts the block sizes follow (CPU build).
DEFAULT_BLOCK = 128  # the CPU platform's block size when none is given
BF16_KERNEL_BLOCK = 32  # CPU_ATTN's kernel blocks are multiples of 32
OSCAR_KERNEL_BLOCK = 16  # OscarBackend.get_supported_kernel_block_sizes
BF16_BYTES = 2


# ---------------------------------------------------------------------------
# Page-format numbers: the one place they come from
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PageNumbers:
    """One attention format at one block size, per KV head."""

    bytes_per_token: int  # K and V together
    state_blocks: int  # R: blocks each request holds for its BF16 sink and window
    block_bytes: int
    bits_per_element: Callable[[int], float]  # at a context length, sink/window included


def page_numbers(head_size: int, block_size: int, settings: OscarSettings) -> PageNumbers:
    """Every OSCAR, tiered or KIVI page number of the report comes through here."""
    from vllm_kvq.backends.resolve import page_format

    fmt = page_format(head_size, block_size, settings)
    return PageNumbers(fmt.bytes_per_token, fmt.state_blocks, fmt.block_bytes, fmt.bits_per_element)


def bf16_page_numbers(head_size: int, block_size: int) -> PageNumbers:
    """vLLM's own BF16 pages: a K row and a V row per token and head."""
    per_token = 2 * head_size * BF16_BYTES
    return PageNumbers(per_token, 0, block_size * per_token, lambda context_len: 8.0 * BF16_BYTES)


# ---------------------------------------------------------------------------
# What is being reported on
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """The config fields the cache sizes depend on (tensor parallel size 1)."""

    name: str
    attention_layers: int
    kv_heads: int
    head_size: int
    gdn_layers: int = 0
    gdn_conv_bytes: int = 0  # one layer's conv state per request (model dtype)
    gdn_fp32_bytes: int = 0  # one layer's recurrent state per request in FP32

    @classmethod
    def from_config(cls, name: str, hf_config) -> "ModelShape":
        from vllm_kvq.artifacts.fingerprint import attention_layers, gdn_layers, head_dim, text_config

        cfg = text_config(hf_config)
        if getattr(cfg, "kv_lora_rank", None):
            raise ValueError(f"{name} uses MLA, which OSCAR does not serve; the report covers GQA/MHA models")
        attn = attention_layers(hf_config)
        if not attn:
            raise ValueError(f"{name} has no full-attention layers, so it has no KV cache to report on")
        gdn = gdn_layers(hf_config)
        conv = fp32 = 0
        if gdn:
            hk, hv = int(cfg.linear_num_key_heads), int(cfg.linear_num_value_heads)
            k, v = int(cfg.linear_key_head_dim), int(cfg.linear_value_head_dim)
            conv = (int(cfg.linear_conv_kernel_dim) - 1) * (2 * hk * k + hv * v) * BF16_BYTES
            fp32 = 4 * hv * k * v
        return cls(name, len(attn), int(cfg.num_key_value_heads), head_dim(cfg), len(gdn), conv, fp32)


@dataclass(frozen=True)
class AttentionFormat:
    """BF16 (``settings`` None: vLLM's CPU_ATTN pages) or an OSCAR scheme."""

    name: str
    settings: OscarSettings | None = None

    @property
    def kernel_block(self) -> int:
        return BF16_KERNEL_BLOCK if self.settings is None else OSCAR_KERNEL_BLOCK

    def page(self, head_size: int, block_size: int) -> PageNumbers:
        if self.settings is None:
            return bf16_page_numbers(head_size, block_size)
        return page_numbers(head_size, block_size, self.settings)


@dataclass(frozen=True)
class StateFormat:
    """vLLM's FP32 GDN states (``settings`` None) or a ``kvq.state`` pool."""

    name: str
    settings: OscarSettings | None = None
    hf_config: object = field(default=None, compare=False)

    def recurrent_bytes(self, model: ModelShape) -> int:
        if self.settings is None:
            return model.gdn_fp32_bytes
        from vllm_kvq.backends.resolve import pool_plan

        return pool_plan(self.settings, self.hf_config, 1).record_bytes


FP32_STATE = StateFormat("FP32 states")


@dataclass(frozen=True)
class Layout:
    """How vLLM lays one configuration out: block size, page, groups."""

    model: ModelShape
    attention: AttentionFormat
    state: StateFormat | None
    block_size: int
    page: PageNumbers
    state_raw_bytes: int  # one GDN layer's state per request, unpadded (0: dense)

    @property
    def label(self) -> str:
        return self.attention.name if self.state is None else f"{self.attention.name} + {self.state.name}"

    @property
    def page_bytes(self) -> int:
        """One layer's page (all its KV heads); GDN state pages are padded to it."""
        return self.model.kv_heads * self.page.block_bytes

    @property
    def groups(self) -> tuple[int, int, int]:
        """(layers per group, attention groups, GDN groups), as vLLM cuts them."""
        counts = [self.model.attention_layers] + ([self.model.gdn_layers] if self.model.gdn_layers else [])
        lo, hi = min(counts), max(counts)
        size = hi if hi < 1.5 * lo else lo
        groups = [math.ceil(n / size) for n in counts]
        widest = max(math.ceil(n / g) for n, g in zip(counts, groups))
        return widest, groups[0], groups[1] if len(groups) > 1 else 0

    def num_blocks(self, budget: int) -> int:
        return budget // (self.groups[0] * self.page_bytes)

    def blocks_per_request(self, context_len: int) -> int:
        _, attention_groups, gdn_groups = self.groups
        per_attention = math.ceil(context_len / self.block_size) + self.page.state_blocks
        return attention_groups * per_attention + gdn_groups

    def concurrency(self, budget: int, context_len: int) -> float:
        """vLLM's "Maximum concurrency" at ``max_model_len = context_len``."""
        return self.num_blocks(budget) / self.blocks_per_request(context_len)

    def tokens(self, budget: int, context_len: int) -> int:
        """vLLM's "KV cache size" in tokens (``cache_config.kv_cache_size_tokens``)."""
        return int(self.concurrency(budget, context_len) * context_len)

    @property
    def state_bytes_per_request(self) -> int:
        """Every GDN layer's page as vLLM allocates it (padding included)."""
        return self.model.gdn_layers * self.page_bytes


def layout(model: ModelShape, attention: AttentionFormat, state: StateFormat | None = None) -> Layout:
    """The block size vLLM picks for this configuration, and the pages at it."""
    if not model.gdn_layers:
        block = DEFAULT_BLOCK
        return Layout(model, attention, None, block, attention.page(model.head_size, block), 0)
    state = state or FP32_STATE
    raw = model.gdn_conv_bytes + state.recurrent_bytes(model)
    start = attention.kernel_block if state.settings is not None else DEFAULT_BLOCK
    step = max(attention.kernel_block, start)
    # the one-token probe: bytes per token (any block size gives the same)
    one_token = model.kv_heads * attention.page(model.head_size, DEFAULT_BLOCK).bytes_per_token
    block = step * math.ceil(raw / (step * one_token))
    block = attention.kernel_block * math.ceil(block / attention.kernel_block)
    block = max(start, block)
    return Layout(model, attention, state, block, attention.page(model.head_size, block), raw)


# ---------------------------------------------------------------------------
# Inputs: model, artifacts
# ---------------------------------------------------------------------------


@dataclass
class Inputs:
    model: ModelShape
    model_dir: Path
    attention: list[AttentionFormat]
    states: list[StateFormat]  # empty for dense models
    artifacts: list[Path]  # every artifact named on the command line

    @functools.cached_property
    def layouts(self) -> list[Layout]:
        if not self.model.gdn_layers:
            return [layout(self.model, a) for a in self.attention]
        return [layout(self.model, a, s) for a in self.attention for s in self.states]


def tiers_label(tiers: dict) -> str:
    """One layer's plan (``k=48x4,80x2;v=...``), or that the layers differ."""
    plans = set(tiers.values())
    return str(next(iter(plans))) if len(plans) == 1 else f"{len(plans)} plans over the layers"


def load_inputs(model_dir: str, artifacts: list[str]) -> Inputs:
    """Read the model's config and validate every artifact against it."""
    from transformers import AutoConfig

    from vllm_kvq.artifacts import ArtifactError, OscarArtifact, model_fingerprint
    from vllm_kvq.artifacts.container import kind_of
    from vllm_kvq.artifacts.stepquant import StepQuantPlan

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise ValueError(f"{model_dir} is not a model directory (no config.json); pass a checkpoint directory")
    hf_config = AutoConfig.from_pretrained(str(path))
    model = ModelShape.from_config(path.name, hf_config)
    fingerprint = model_fingerprint(hf_config)
    oscar, tiered, plans = None, [], []
    for art in artifacts:
        if kind_of(art) == "stepquant":
            if not model.gdn_layers:
                raise ArtifactError(f"{art} is a STEPQuant state plan, and {model.name} has no GDN layers; "
                                    "drop that --artifact")
            plans.append((art, StepQuantPlan.load(art, fingerprint)))
            continue
        loaded = OscarArtifact.load(art, fingerprint)
        if loaded.tiers:
            tiered.append((art, loaded.tiers))
        elif oscar is None:
            oscar = art
        else:
            raise ValueError(f"two OSCAR INT2 artifacts ({oscar}, {art}) give the same pages; pass one")
    attention = [AttentionFormat("BF16"), AttentionFormat("OSCAR INT2", OscarSettings(artifact=oscar))]
    attention += [AttentionFormat(f"tiered ({tiers_label(t)})", OscarSettings(artifact=art)) for art, t in tiered]
    states = []
    if model.gdn_layers:
        states.append(FP32_STATE)
        for art, plan in plans:
            states += [StateFormat(f"STEPQuant @{b}", OscarSettings(state="stepquant", state_artifact=art,
                                                                      state_bits=b), hf_config)
                       for b in plan.budgets]
    return Inputs(model, path, attention, states, [Path(a) for a in artifacts])


# ---------------------------------------------------------------------------
# Accuracy rows from the benchmarks' results
# ---------------------------------------------------------------------------


def _benchmark(name: str):
    """A benchmark script as a module (its row -> settings map), or None."""
    path = BENCHMARKS / f"{name}.py"
    if not path.is_file():
        return None
    sys.path.insert(0, str(BENCHMARKS))  # the scripts import each other
    try:
        spec = importlib.util.spec_from_file_location(f"_kvq_benchmark_{name}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))


def _same(a, b) -> bool:
    return a is not None and b is not None and Path(a).resolve() == Path(b).resolve()


def _read_results(path: Path) -> dict | None:
    return json.loads(path.read_text())["results"] if path.is_file() else None


def _served(settings: OscarSettings) -> OscarSettings:
    """Settings with the artifact path made absolute, for comparing."""
    return dataclasses.replace(settings, artifact=str(Path(settings.artifact).resolve()))


def kv_accuracy_rows(inputs: Inputs) -> tuple[Path, list[tuple[str, dict]]] | None:
    """BF16's row and the rows measured with exactly one of the report's
    artifact-backed attention formats."""
    path = BENCHMARKS / "results" / f"accuracy-{inputs.model.name}.json"
    results, script = _read_results(path), _benchmark("accuracy")
    if results is None or script is None:
        return None
    served = {_served(a.settings) for a in inputs.attention if a.settings is not None and a.settings.artifact}
    rows = [(name, results[name]) for name, kvq in script.variants(str(inputs.model_dir)).items()
            if name in results and (kvq is None or (kvq.get("artifact") and _served(OscarSettings(**kvq)) in served))]
    return (path, rows) if len(rows) > 1 else None


def state_accuracy_rows(inputs: Inputs) -> tuple[Path, list[tuple[str, dict]]] | None:
    """The FP32 row and every row served with one of the report's state plans."""
    path = BENCHMARKS / "results" / "stepquant-accuracy.json"
    results, script = _read_results(path), _benchmark("stepquant_accuracy")
    if results is None or script is None or Path(script.MODEL).name != inputs.model.name:
        return None
    rows = [(name, results[name]) for name, (kvq, _) in script.variants().items() if name in results and (
        kvq is None or any(_same(kvq.get("state_artifact"), art) for art in inputs.artifacts))]
    return (path, rows) if len(rows) > 1 else None


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------


def parse_bytes(text: str) -> int:
    """``1073741824``, ``1GiB``, ``512MiB``."""
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}
    raw = text.strip().upper()
    for unit, scale in units.items():
        if raw.endswith(unit):
            return int(float(raw[: -len(unit)]) * scale)
    if not raw.isdigit():
        raise ValueError(f"--kv-budget {text!r}: give bytes, or a number with KiB, MiB, GiB or TiB")
    return int(raw)


def show_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % (scale >> 4) == 0:
            return f"{n / scale:g} {unit}"
    return f"{n:,} B"


def show_len(n: int) -> str:
    return f"{n >> 10}K" if n % 1024 == 0 else f"{n:,}"


def require_matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(f"vllm-kvq report draws its plots with matplotlib, which is not installed: {INSTALL_HINT}")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


STYLES = ("-", "--", ":", "-.")
BITS_TICKS = (2, 2.5, 3, 4, 6, 8, 16)


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    import matplotlib.pyplot as plt

    plt.close(fig)


def _line_style(inputs: Inputs, lay: Layout) -> dict:
    color = f"C{inputs.attention.index(lay.attention)}"
    style = STYLES[inputs.states.index(lay.state) % len(STYLES)] if lay.state is not None else "-"
    return {"color": color, "linestyle": style, "marker": "o", "markersize": 3}


def plot_capacity(plt, inputs: Inputs, budget: int, path: Path) -> None:
    fig, (tok, req) = plt.subplots(1, 2, figsize=(11, 4.2))
    for lay in inputs.layouts:
        style = _line_style(inputs, lay)
        tok.plot(CONTEXTS, [lay.tokens(budget, c) for c in CONTEXTS], label=lay.label, **style)
        req.plot(CONTEXTS, [lay.concurrency(budget, c) for c in CONTEXTS], label=lay.label, **style)
    for ax, title in ((tok, "KV capacity (tokens)"), (req, "concurrent requests at that length")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(CONTEXTS, [show_len(c) for c in CONTEXTS])
        ax.set_xlabel("tokens per request (max_model_len)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    req.set_yscale("log")
    tok.legend(fontsize=7)
    fig.suptitle(f"{inputs.model.name}: KV cache of {show_bytes(budget)}")
    _save(fig, path)


def plot_bits(plt, inputs: Inputs, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for lay in inputs.layouts:
        ax.plot(CONTEXTS, [lay.page.bits_per_element(c) for c in CONTEXTS], label=lay.label,
                **_line_style(inputs, lay))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_yticks(BITS_TICKS, [f"{b:g}" for b in BITS_TICKS])
    ax.minorticks_off()
    ax.set_xticks(CONTEXTS, [show_len(c) for c in CONTEXTS])
    ax.set_xlabel("tokens per request")
    ax.set_ylabel("bits per K/V element")
    ax.set_title(f"{inputs.model.name}: bits per element, BF16 sink and window included")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, path)


def plot_state(plt, inputs: Inputs, path: Path) -> None:
    lays = inputs.layouts
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(lays) + 1.5))
    y = range(len(lays))
    raw = [inputs.model.gdn_layers * lay.state_raw_bytes / 2**20 for lay in lays]
    alloc = [lay.state_bytes_per_request / 2**20 for lay in lays]
    ax.barh(y, alloc, color="0.8", label="allocated (page padded to the attention block)")
    ax.barh(y, raw, color="C0", height=0.5, label="conv + recurrent state")
    ax.set_yticks(list(y), [lay.label for lay in lays], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("MiB per request, all GDN layers")
    ax.set_title(f"{inputs.model.name}: GDN state memory per request")
    ax.legend(fontsize=7)
    _save(fig, path)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def _pct(x: float) -> str:
    return f"{100 * x:+.2f}%"


def markdown(inputs: Inputs, budgets: list[int], command: str, images: dict) -> str:
    m = inputs.model
    lays = inputs.layouts
    out = [f"# KV-cache report: `{m.name}`", "",
           f"Written by `{command}` from the page formats and vLLM 0.32's block accounting (no engine started): "
           "the capacities are what vLLM reports as \"KV cache size\" and \"Maximum concurrency\" when started with "
           "`max_model_len` = the context length and `kv_cache_memory_bytes` = the budget. Assumed: one device "
           "(tensor parallel size 1), model and BF16 KV cache in bfloat16, prefix caching off (OSCAR and the GDN "
           "state pool turn it off), the block sizes vLLM's CPU build picks, default `kvq` settings ("
           "sink 64, window 256).", ""]
    shape = f"{m.attention_layers} full-attention layers x {m.kv_heads} KV heads x head size {m.head_size}"
    if m.gdn_layers:
        shape += (f"; {m.gdn_layers} gated-delta-net layers ({show_bytes(m.gdn_fp32_bytes)} of FP32 recurrent "
                  f"state and {m.gdn_conv_bytes:,} B of conv state per layer and request)")
    out += [f"Model: {shape}.", "", "## Formats", ""]
    rows = []
    for lay in lays:
        p = lay.page
        rows.append([lay.label, str(p.bytes_per_token), str(lay.block_size), str(p.state_blocks),
                     f"{lay.page_bytes:,}"] + [f"{p.bits_per_element(c):.3f}" for c in (4096, 32768, 131072)])
    out += _table(["configuration", "B per token and KV head", "block (tokens)", "state blocks per request (R)",
                   "page per layer (B)", "bits/element at 4K", "at 32K", "at 128K"], rows)
    out += ["", "Bits per element count the codes, the fp16 scales and the R blocks of BF16 sink and window rows "
            "every request holds, over the request's K and V elements.", "",
            f"![bits per element]({images['bits']})", ""]
    for budget in budgets:
        base = lays[0]
        out += [f"## KV capacity at {show_bytes(budget)}", ""]
        rows = []
        for c in CONTEXTS:
            row = [show_len(c)]
            for lay in lays:
                ratio = lay.tokens(budget, c) / base.tokens(budget, c) if base.tokens(budget, c) else float("nan")
                row.append(f"{lay.tokens(budget, c):,} / {lay.concurrency(budget, c):.2f} ({ratio:.2f}x)")
            rows.append(row)
        out += _table(["context"] + [lay.label for lay in lays], rows)
        out += ["", f"Each cell: tokens / concurrent requests at that context length (vLLM's figures: blocks / blocks "
                f"per request, and that times the context length), and tokens against {base.label}. Blocks: "
                + ", ".join(f"{lay.label} {lay.num_blocks(budget):,}" for lay in lays) + ".", "",
                f"![capacity at {show_bytes(budget)}]({images[budget]})", ""]
    if m.gdn_layers:
        out += ["## GDN state memory", ""]
        fp32 = {lay.attention: lay.state_bytes_per_request for lay in lays if lay.state is FP32_STATE}
        rows = [[lay.label, f"{lay.state_raw_bytes:,}", f"{lay.page_bytes:,}", f"{lay.state_bytes_per_request:,}",
                 f"{fp32[lay.attention] / lay.state_bytes_per_request:.2f}x"] for lay in lays]
        out += _table(["configuration", "state per layer (B)", "page per layer as allocated (B)",
                       "per request, all GDN layers (B)", "smaller than FP32 states"], rows)
        out += ["", "vLLM pads every GDN state page to one attention page (the block size times the attention "
                "bytes per token), so the page, not the state, is what a request costs.", "",
                f"![state memory]({images['state']})", ""]
    out += _accuracy_markdown(inputs)
    return "\n".join(out) + "\n"


def _accuracy_markdown(inputs: Inputs) -> list[str]:
    out = []
    kv = kv_accuracy_rows(inputs)
    if kv:
        path, rows = kv
        ref = rows[0][1]
        out += ["## Accuracy", "", f"From `{path.relative_to(REPO)}` (`benchmarks/accuracy.py`, real vLLM on CPU): "
                "the unquantized reference and the rows served with this report's artifacts.", ""]
        out += _table(["variant", "needles", "needles / reference", "perplexity", "perplexity vs reference"],
                      [[name, f"{r['needle_acc']:.3f}", f"{r['needle_acc'] / ref['needle_acc']:.1%}", f"{r['ppl']:.3f}",
                        _pct(r["ppl"] / ref["ppl"] - 1)] for name, r in rows])
        out.append("")
    state = state_accuracy_rows(inputs)
    if state:
        path, rows = state
        ref = rows[0][1]
        out += ["## GDN state accuracy", "", f"From `{path.relative_to(REPO)}` "
                "(`benchmarks/stepquant_accuracy.py`, real vLLM on CPU); the state bytes are what that engine "
                "allocated per request.", ""]
        out += _table(["variant", "state per request (B)", "needles", "perplexity", "perplexity vs FP32"],
                      [[name, f"{r['state_bytes_per_request']:,}", f"{r['needle_acc']:.3f}", f"{r['ppl']:.3f}",
                        _pct(r["ppl"] / ref["ppl"] - 1)] for name, r in rows])
        out.append("")
    if not out:
        out = ["## Accuracy", "", "No rows in `benchmarks/results/` were measured with these artifacts.", ""]
    return out


def write_report(model_dir: str, artifacts: list[str], out_dir: str, budgets: list[int], command: str) -> Path:
    """Write ``<out>/<model>.md`` and its PNG plots; return the markdown's path."""
    plt = require_matplotlib()
    inputs = load_inputs(model_dir, artifacts)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = inputs.model.name
    images = {"bits": f"{name}-bits.png"}
    plot_bits(plt, inputs, out / images["bits"])
    for budget in budgets:
        images[budget] = f"{name}-capacity-{show_bytes(budget).replace(' ', '')}.png"
        plot_capacity(plt, inputs, budget, out / images[budget])
    if inputs.model.gdn_layers:
        images["state"] = f"{name}-state.png"
        plot_state(plt, inputs, out / images["state"])
    page = out / f"{name}.md"
    page.write_text(markdown(inputs, budgets, command, images))
    return page
