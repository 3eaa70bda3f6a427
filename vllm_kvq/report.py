"""``vllm-kvq report``: what each KV-cache configuration holds on one model.

The numbers come from the page formats and from vLLM 0.32's own block
accounting, replayed without starting an engine (:class:`Layout`). Accuracy
rows come from results JSON (``--accuracy``), which records each row's name and
numbers but not its settings: a row is this report's when its name is the
benchmark's name for an artifact's rows, alone or ``+`` another setting.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from vllm_kvq.artifacts import ArtifactError, OscarArtifact, model_fingerprint
from vllm_kvq.artifacts.container import kind_of
from vllm_kvq.artifacts.fingerprint import attention_layers, gdn_layers, head_dim, text_config
from vllm_kvq.artifacts.stepquant import StepQuantPlan
from vllm_kvq.backends.resolve import page_format, pool_plan
from vllm_kvq.backends.settings import OscarSettings
from vllm_kvq.kernels.oscar.format import PagedFormat
from vllm_kvq.kernels.stepquant.format import fp32_state_bytes

REPO = Path(__file__).resolve().parents[1]
CONTEXTS = tuple(1024 << i for i in range(8))  # 1K .. 128K
REFERENCES = ("bf16", "FP32 state (vLLM)")  # the benchmarks' unquantized rows
DEFAULT_BLOCK = 128  # vLLM 0.32's CPU block size when none is given
BF16_KERNEL_BLOCK = 32  # CPU_ATTN's kernel blocks are multiples of 32
OSCAR_KERNEL_BLOCK = 16  # OscarBackend.get_supported_kernel_block_sizes


@dataclass(frozen=True)
class Bf16Page(PagedFormat):
    """vLLM's own pages: a BF16 K row and V row per token and KV head, no sink or window."""

    @property
    def bytes_per_token(self) -> int:
        return 4 * self.head_size


@dataclass(frozen=True)
class ModelShape:
    """The config fields the cache sizes depend on (tensor parallel size 1)."""

    name: str
    attention_layers: int
    kv_heads: int
    head_size: int
    gdn_layers: int = 0
    gdn_conv_bytes: int = 0  # one layer's conv state per request (BF16)
    gdn_fp32_bytes: int = 0  # one layer's recurrent state per request in FP32

    @classmethod
    def from_config(cls, name: str, hf_config) -> "ModelShape":
        cfg = text_config(hf_config)
        if getattr(cfg, "kv_lora_rank", None):
            raise ValueError(f"{name} uses MLA, which OSCAR does not serve; the report covers GQA/MHA models")
        attn, gdn = attention_layers(hf_config), gdn_layers(hf_config)
        if not attn:
            raise ValueError(f"{name} has no full-attention layers, so it has no KV cache to report on")
        conv = fp32 = 0
        if gdn:
            hk, hv = int(cfg.linear_num_key_heads), int(cfg.linear_num_value_heads)
            k, v = int(cfg.linear_key_head_dim), int(cfg.linear_value_head_dim)
            conv = (int(cfg.linear_conv_kernel_dim) - 1) * (2 * hk * k + hv * v) * 2
            fp32 = fp32_state_bytes(hv, k, v)
        return cls(name, len(attn), int(cfg.num_key_value_heads), head_dim(cfg), len(gdn), conv, fp32)


@dataclass(frozen=True)
class Format:
    """An attention format (``settings`` None: vLLM's BF16 pages) or a GDN state format (None: vLLM's
    FP32 states, else ``recurrent_bytes`` per layer and request); ``row`` names its accuracy rows."""

    name: str
    settings: OscarSettings | None = None
    row: str | None = None
    recurrent_bytes: int | None = None

    def page(self, head_size: int, block_size: int) -> PagedFormat:
        return (Bf16Page(head_size, block_size, 0, 0) if self.settings is None
                else page_format(head_size, block_size, self.settings))


FP32_STATE = Format("FP32 states")


@dataclass(frozen=True)
class Layout:
    """How vLLM lays one configuration out (``state`` None: a dense model)."""

    model: ModelShape
    attention: Format
    state: Format | None = None

    @property
    def label(self) -> str:
        return self.attention.name if self.state is None else f"{self.attention.name} + {self.state.name}"

    @property
    def state_raw_bytes(self) -> int:
        """One GDN layer's conv and recurrent state per request, unpadded (0: dense)."""
        return 0 if self.state is None else (
            self.model.gdn_conv_bytes + (self.state.recurrent_bytes or self.model.gdn_fp32_bytes))

    @cached_property
    def block_size(self) -> int:
        """Dense: the CPU build's 128 (OSCAR asks for at least 128). Hybrid: vLLM grows the block, in steps
        of the one it started from (128, or with ``kvq.state`` the smallest kernel block), until one
        attention page holds a GDN state, and pads the state page to it."""
        if self.state is None:
            return DEFAULT_BLOCK
        kernel = BF16_KERNEL_BLOCK if self.attention.settings is None else OSCAR_KERNEL_BLOCK
        start = DEFAULT_BLOCK if self.state.settings is None else kernel
        step = max(kernel, start)
        one_token = self.model.kv_heads * self.attention.page(self.model.head_size, DEFAULT_BLOCK).bytes_per_token
        block = step * math.ceil(self.state_raw_bytes / (step * one_token))
        return max(start, kernel * math.ceil(block / kernel))

    @cached_property
    def page(self) -> PagedFormat:
        """One KV head's page at the block size."""
        return self.attention.page(self.model.head_size, self.block_size)

    @property
    def page_bytes(self) -> int:
        """One layer's page (all its KV heads); GDN state pages are padded to it."""
        return self.model.kv_heads * self.page.block_bytes

    @property
    def state_bytes_per_request(self) -> int:
        """Every GDN layer's page as vLLM allocates it (padding included)."""
        return self.model.gdn_layers * self.page_bytes

    @cached_property
    def groups(self) -> tuple[int, int, int]:
        """(layers per KV-cache group, attention groups, GDN groups): vLLM cuts each layer type into
        groups of one size."""
        counts = [n for n in (self.model.attention_layers, self.model.gdn_layers) if n]
        size = max(counts) if max(counts) < 1.5 * min(counts) else min(counts)
        groups = [math.ceil(n / size) for n in counts] + [0]
        return max(math.ceil(n / g) for n, g in zip(counts, groups)), groups[0], groups[1]

    def num_blocks(self, budget: int) -> int:
        return budget // (self.groups[0] * self.page_bytes)

    def concurrency(self, budget: int, context_len: int) -> float:
        """vLLM's "Maximum concurrency" at ``max_model_len = context_len``: a request holds
        ``ceil(L / block) + R`` blocks of each attention group (R: the sink/window blocks) and one block
        of each GDN group."""
        _, attention_groups, gdn_groups = self.groups
        per_group = math.ceil(context_len / self.block_size) + self.page.state_blocks
        return self.num_blocks(budget) / (attention_groups * per_group + gdn_groups)

    def tokens(self, budget: int, context_len: int) -> int:
        """vLLM's "KV cache size" in tokens (``cache_config.kv_cache_size_tokens``)."""
        return int(self.concurrency(budget, context_len) * context_len)


@dataclass
class Inputs:
    model: ModelShape
    attention: list[Format]
    states: list[Format]  # empty for dense models

    @cached_property
    def layouts(self) -> list[Layout]:
        return [Layout(self.model, a, s) for a in self.attention for s in self.states or [None]]


def row_name(art: OscarArtifact) -> str | None:
    """The accuracy benchmark's name for rows served with ``art``: ``OSCAR tiers: K 48x4 + 80x2, V ...``
    (one tier plan on every layer) or ``OSCAR, per-KV-head rotation[, fitted clip]`` (INT2)."""
    plans = set((art.tiers or {}).values())
    if len(plans) == 1:
        plan = plans.pop()
        k, v = (" + ".join(f"{w}x{b}" if b else f"{w} not stored" for w, b in t.pairs) for t in (plan.k, plan.v))
        return f"OSCAR tiers: K {k}, V {v}"
    if plans:
        return None
    name = "OSCAR, " + ("shared per-layer rotation" if art.granularity == "layer" else "per-KV-head rotation")
    name += ", exact value target" if art.provenance.get("value_target") == "exact" else ""
    return name + (", fitted clip" if art.provenance.get("clip") == "fitted" else "")


def load_inputs(model_dir: str, artifacts: list[str]) -> Inputs:
    """Read the model's config and validate every artifact against it."""
    from transformers import AutoConfig

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise ValueError(f"{model_dir} is not a model directory (no config.json); pass a checkpoint directory")
    hf_config = AutoConfig.from_pretrained(str(path))
    model = ModelShape.from_config(path.name, hf_config)
    fingerprint = model_fingerprint(hf_config)
    oscar, tiered, states = None, [], [FP32_STATE] if model.gdn_layers else []
    for art in artifacts:
        if kind_of(art) == "stepquant":
            if not model.gdn_layers:
                raise ArtifactError(f"{art} is a STEPQuant state plan, and {model.name} has no GDN layers; "
                                    "drop that --artifact")
            for b in StepQuantPlan.load(art, fingerprint).budgets:
                settings = OscarSettings(state="stepquant", state_artifact=art, state_bits=b)
                record = pool_plan(settings, hf_config, 1).record_bytes
                states.append(Format(f"STEPQuant @{b}", settings, f"STEPQuant @{b}", record))
            continue
        loaded = OscarArtifact.load(art, fingerprint)
        plans = set((loaded.tiers or {}).values())
        if plans:
            label = str(plans.pop()) if len(plans) == 1 else f"{len(plans)} plans over the layers"
            tiered.append(Format(f"tiered ({label})", OscarSettings(artifact=art), row_name(loaded)))
        elif oscar is None:
            oscar = Format("OSCAR INT2", OscarSettings(artifact=art), row_name(loaded))
        else:
            raise ValueError(f"two OSCAR INT2 artifacts ({oscar.settings.artifact}, {art}) give the same pages; "
                             "pass one")
    return Inputs(model, [Format("BF16"), oscar or Format("OSCAR INT2", OscarSettings())] + tiered, states)


def accuracy_rows(inputs: Inputs, path: str | Path) -> list[tuple[str, dict]] | None:
    """The reference row and the rows served with this report's artifacts, from the results JSON at
    ``path``; None when it has none of the latter."""
    if not Path(path).is_file():
        raise ValueError(f"--accuracy {path}: no such file; point it at a benchmark's results JSON")
    data = json.loads(Path(path).read_text())
    data = data if isinstance(data, dict) else {}
    measured_on = Path(str(data.get("args", {}).get("model", inputs.model.name))).name
    if measured_on != inputs.model.name:
        raise ValueError(f"--accuracy {path} was measured on {measured_on}, not {inputs.model.name}; "
                         "pass this model's results")
    results = data.get("results", {})
    if (ref := next((name for name in REFERENCES if name in results), None)) is None:
        raise ValueError(f"--accuracy {path} has no reference row ({' or '.join(REFERENCES)}); point it at a "
                         "benchmark's results JSON")
    names = [f.row for f in inputs.attention + inputs.states if f.row]
    rows = [(n, r) for n, r in results.items() if any(n == x or n.startswith(f"{x} + ") for x in names)]
    return [(ref, results[ref])] + rows if rows else None


def parse_bytes(text: str) -> int:
    """``1073741824``, ``1GiB``, ``512MiB``."""
    raw = text.strip().upper()
    for unit, scale in {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}.items():
        if raw.endswith(unit):
            return int(float(raw[: -len(unit)]) * scale)
    if raw.isdigit():
        return int(raw)
    raise ValueError(f"--kv-budget {text!r}: give bytes, or a number with KiB, MiB, GiB or TiB")


def show_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % (scale >> 4) == 0:
            return f"{n / scale:g} {unit}"
    return f"{n:,} B"


def show_len(n: int) -> str:
    return f"{n >> 10}K" if n % 1024 == 0 else f"{n:,}"


def figures(plt, inputs: Inputs, budgets: list[int]) -> list:
    """The bits-per-element plot, a capacity plot per budget and, for hybrids, the state memory bars."""
    lays, name = inputs.layouts, inputs.model.name

    def lines(axes, *values):  # colour: attention format; dashes: state format
        for lay in lays:
            dash = ("-", "--", ":", "-.")[inputs.states.index(lay.state) % 4] if lay.state is not None else "-"
            for ax, value in zip(axes, values):
                ax.plot(CONTEXTS, [value(lay, c) for c in CONTEXTS], label=lay.label, linestyle=dash,
                        color=f"C{inputs.attention.index(lay.attention)}", marker="o", markersize=3)
        for ax in axes:
            ax.set_xscale("log", base=2)
            ax.set_xticks(CONTEXTS, [show_len(c) for c in CONTEXTS])
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)

    fig, ax = plt.subplots(figsize=(7, 4.2))
    lines([ax], lambda lay, c: lay.page.bits_per_element(c))
    ax.set_yscale("log", base=2)
    ax.set_yticks((2, 2.5, 3, 4, 6, 8, 16), ["2", "2.5", "3", "4", "6", "8", "16"])
    ax.minorticks_off()
    ax.set(xlabel="tokens per request", ylabel="bits per K/V element",
           title=f"{name}: bits per element, BF16 sink and window included")
    out = [fig]
    for budget in budgets:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        lines(axes, lambda lay, c: lay.tokens(budget, c), lambda lay, c: lay.concurrency(budget, c))
        for ax, title in zip(axes, ("KV capacity (tokens)", "concurrent requests at that length")):
            ax.set(xlabel="tokens per request (max_model_len)", title=title)
        axes[1].set_yscale("log")
        fig.suptitle(f"{name}: KV cache of {show_bytes(budget)}")
        out.append(fig)
    if inputs.model.gdn_layers:
        fig, ax = plt.subplots(figsize=(8, 0.5 * len(lays) + 1.5))
        y = range(len(lays))
        ax.barh(y, [lay.state_bytes_per_request / 2**20 for lay in lays], color="0.8",
                label="allocated (page padded to the attention block)")
        ax.barh(y, [inputs.model.gdn_layers * lay.state_raw_bytes / 2**20 for lay in lays], color="C0", height=0.5,
                label="conv + recurrent state")
        ax.set_yticks(y, [lay.label for lay in lays], fontsize=8)
        ax.invert_yaxis()
        ax.set(xlabel="MiB per request, all GDN layers", title=f"{name}: GDN state memory per request")
        ax.legend(fontsize=7)
        out.append(fig)
    return out


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def markdown(inputs: Inputs, budgets: list[int], command: str, images: list[str], accuracy: dict) -> str:
    m, lays, base = inputs.model, inputs.layouts, inputs.layouts[0]
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
    out += table(["configuration", "B per token and KV head", "block (tokens)", "state blocks per request (R)",
                  "page per layer (B)", "bits/element at 4K", "at 32K", "at 128K"],
                 [[lay.label, str(lay.page.bytes_per_token), str(lay.block_size), str(lay.page.state_blocks),
                   f"{lay.page_bytes:,}"] + [f"{lay.page.bits_per_element(c):.3f}" for c in (4096, 32768, 131072)]
                  for lay in lays])
    out += ["", "Bits per element count the codes, the fp16 scales and the R blocks of BF16 sink and window rows "
            "every request holds, over the request's K and V elements.", "", f"![bits per element]({images[0]})", ""]
    for budget, image in zip(budgets, images[1:]):
        def cell(lay, c):
            ratio = lay.tokens(budget, c) / base.tokens(budget, c) if base.tokens(budget, c) else float("nan")
            return f"{lay.tokens(budget, c):,} / {lay.concurrency(budget, c):.2f} ({ratio:.2f}x)"

        out += [f"## KV capacity at {show_bytes(budget)}", ""]
        out += table(["context"] + [lay.label for lay in lays], [[show_len(c)] + [cell(lay, c) for lay in lays]
                                                                 for c in CONTEXTS])
        out += ["", "Each cell: tokens / concurrent requests at that context length (vLLM's figures: blocks / blocks "
                f"per request, and that times the context length), and tokens against {base.label}. Blocks: "
                + ", ".join(f"{lay.label} {lay.num_blocks(budget):,}" for lay in lays) + ".", "",
                f"![capacity at {show_bytes(budget)}]({image})", ""]
    if m.gdn_layers:
        fp32 = {lay.attention: lay.state_bytes_per_request for lay in lays if lay.state is FP32_STATE}
        out += ["## GDN state memory", ""]
        out += table(["configuration", "state per layer (B)", "page per layer as allocated (B)",
                      "per request, all GDN layers (B)", "smaller than FP32 states"],
                     [[lay.label, f"{lay.state_raw_bytes:,}", f"{lay.page_bytes:,}", f"{lay.state_bytes_per_request:,}",
                       f"{fp32[lay.attention] / lay.state_bytes_per_request:.2f}x"] for lay in lays])
        out += ["", "vLLM pads every GDN state page to one attention page (the block size times the attention "
                "bytes per token), so the page, not the state, is what a request costs.", "",
                f"![state memory]({images[-1]})", ""]
    for shown, rows in accuracy.items():
        ref = rows[0][1]
        if "state_bytes_per_request" in ref:
            out += ["## GDN state accuracy", "", f"From `{shown}`, the rows served with this report's state plans; "
                    "the state bytes are what the measuring engine allocated per request.", ""]
            out += table(["variant", "state per request (B)", "needles", "perplexity", "perplexity vs FP32"],
                         [[name, f"{r['state_bytes_per_request']:,}", f"{r['needle_acc']:.3f}", f"{r['ppl']:.3f}",
                           f"{100 * (r['ppl'] / ref['ppl'] - 1):+.2f}%"] for name, r in rows])
        else:
            out += ["## Accuracy", "", f"From `{shown}`: the unquantized reference and the rows served with this "
                    "report's artifacts.", ""]
            out += table(["variant", "needles", "needles / reference", "perplexity", "perplexity vs reference"],
                         [[name, f"{r['needle_acc']:.3f}", f"{r['needle_acc'] / ref['needle_acc']:.1%}",
                           f"{r['ppl']:.3f}", f"{100 * (r['ppl'] / ref['ppl'] - 1):+.2f}%"] for name, r in rows])
        out.append("")
    if not accuracy:
        out += ["## Accuracy", "", "No rows of the accuracy results (`--accuracy`) were measured with these "
                "artifacts.", ""]
    return "\n".join(out) + "\n"


def write_report(model_dir: str, artifacts: list[str], out_dir: str, budgets: list[int], command: str,
                 accuracy: list[str] | None = None) -> Path:
    """Write ``<out>/<model>.md`` and its PNG plots; return the markdown's path. ``accuracy``: results
    JSON files (None: this checkout's ``benchmarks/results/accuracy-<model>.json``, if there is one)."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("vllm-kvq report draws its plots with matplotlib, which is not installed: "
                         "pip install 'vllm-kvq[report]'")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    inputs = load_inputs(model_dir, artifacts)
    name = inputs.model.name
    if accuracy is None:
        accuracy = [p for p in [REPO / "benchmarks" / "results" / f"accuracy-{name}.json"] if p.is_file()]
    tables = {}
    for path in map(Path, accuracy):  # every file is read before anything is written
        if rows := accuracy_rows(inputs, path):
            tables[path.resolve().relative_to(REPO) if path.resolve().is_relative_to(REPO) else path] = rows
    images = [f"{name}-bits.png"] + [f"{name}-capacity-{show_bytes(b).replace(' ', '')}.png" for b in budgets]
    images += [f"{name}-state.png"] if inputs.model.gdn_layers else []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for image, fig in zip(images, figures(plt, inputs, budgets)):
        fig.tight_layout()
        fig.savefig(out / image, dpi=110, metadata={"Software": None})
        plt.close(fig)
    page = out / f"{name}.md"
    page.write_text(markdown(inputs, budgets, command, images, tables))
    return page
