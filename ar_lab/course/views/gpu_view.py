"""Chapter 05 on a GPU: real models on real GPUs' rooflines, predicted, and measured where a GPU is present.

``gpu_scenario`` is the what-if the chapter's explorer shows (``ar_lab.course.views.gpu_explorer``):
a GPU from ``ar_lab.perf.gpus``, a model from ``ar_lab.perf.llm_costs``, a weight format, a batch,
a prompt and a context -> predicted TTFT, TPOT, tokens/s and memory, or a clear "does
not fit". ``plot_scenario`` and ``plot_decode_intensity`` draw it. ``spec_comparison``
and ``plot_measured_vs_spec`` put a measured roofline result (``ar_lab.perf.measure``'s JSON,
from this GPU or a committed ``data/roofline_gpu_*.json``) beside the datasheet's
prediction for the same GPU; ``measure_gpu`` takes that measurement, ``gpu_measurement`` takes or finds one.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ar_lab.base.args import finite_number, positive_int
from ar_lab.base.errors import BadType, BadValue
from ar_lab.course.views.plots import COLORS
from ar_lab.model.gpt import GPTConfig
from ar_lab.perf import llm_costs as lc
from ar_lab.perf.gpus import GPUSpec, as_gpu, match_gpu
from ar_lab.perf.roofline import PhaseCost, attainable_flops, format_si

PROMPT_LENS = (128, 256, 512, 1024, 2048, 4096, 8192)
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class Scenario:
    """One what-if: ``batch`` sequences of ``model`` on ``gpu``, prompts of ``prompt_len``, decoding at ``context``."""

    gpu: GPUSpec
    model: lc.ModelShape
    weight_dtype: str
    batch: int
    prompt_len: int
    context: int
    prefill: PhaseCost  # the batch's prompts in one pass
    decode: PhaseCost  # one step of the batch at ``context``
    placement: lc.DecodePlacement
    memory: float  # weights + KV cache of max(prompt_len, context) positions per sequence
    weights: float  # bytes of the weights alone

    @property
    def fits(self) -> bool:
        return self.memory <= self.gpu.memory

    @property
    def ttft(self) -> float:
        """Seconds to the first token: the prefill of all ``batch`` prompts, at the datasheet roofs."""
        return lc.predicted_time(self.prefill, self.gpu, self.weight_dtype)

    @property
    def tpot(self) -> float:
        """Seconds per decode step at ``context`` (every sequence of the batch gets one token)."""
        return lc.predicted_time(self.decode, self.gpu, self.weight_dtype)

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.tpot

    def bound(self, cost: PhaseCost) -> str:
        return "compute" if cost.intensity >= self.placement.ridge else "memory"

    @property
    def verdict(self) -> str:
        """ "fits", or why not, in words a learner can act on."""
        if self.fits:
            return "fits"
        if self.weights > self.gpu.memory:
            return (
                f"does not fit: the {self.weight_dtype} weights alone take {self.weights / 1e9:.1f} GB "
                f"of the {self.gpu.name}'s {self.gpu.memory / 1e9:.0f} GB; try smaller weights (int8, int4)"
            )
        return (
            f"does not fit: weights + KV cache need {self.memory / 1e9:.1f} GB of {self.gpu.memory / 1e9:.0f} GB; "
            f"at this context at most {self.placement.max_batch} sequence(s) fit"
        )


def gpu_scenario(
    gpu_name: str, model_name: str, weight_dtype: str = "bf16", batch: int = 1, prompt_len: int = 2000, context=2500
) -> Scenario:
    """The explorer's pure function: predictions for one setting (raises ValueError for impossible input).

    ``gpu_name`` and ``model_name`` are names from ``GPUS`` and ``MODELS`` (or the rows themselves).
    Decoding continues after the prompt, so ``context`` is at least ``prompt_len``."""
    spec, shape = as_gpu(gpu_name, "gpu_name"), lc.as_model(model_name, "model_name")
    weight_dtype = lc.check_dtype(weight_dtype)
    batch, prompt_len = lc.count("batch", batch), lc.count("prompt_len", prompt_len)
    context = lc.count("context", context)
    if context < prompt_len:
        raise BadValue(f"context ({context:,}) must be at least prompt_len ({prompt_len:,}): decoding continues after "
                       f"the prompt, so the context a decode step attends to includes the whole prompt",
                       arg="context")
    longest = max(prompt_len, context)
    return Scenario(
        gpu=spec,
        model=shape,
        weight_dtype=weight_dtype,
        batch=batch,
        prompt_len=prompt_len,
        context=context,
        prefill=lc.prefill_cost(shape, prompt_len, batch, weight_dtype),
        decode=lc.decode_cost(shape, context, batch, weight_dtype),
        placement=lc.place_decode(shape, spec, context, weight_dtype),
        memory=lc.memory_needed(shape, longest, batch, weight_dtype),
        weights=lc.weight_memory(shape, weight_dtype),
    )


# --- drawing ------------------------------------------------------------------------


def plot_gpu_roof(ax, spec: GPUSpec, weight_dtype: str = "bf16", *, lo=0.3, hi=3e4, color="black", label=None, ls="-"):
    """The datasheet roofline of ``spec`` (a ``GPUSpec`` or its name; compute roof for ``weight_dtype``),
    its ridge marked and labelled."""
    spec, weight_dtype = as_gpu(spec, "spec"), lc.check_dtype(weight_dtype)
    peak = spec.peak_flops(weight_dtype)
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    roof = "fp32" if weight_dtype == "fp32" else "16-bit tensor"
    text = label or f"{spec.name} datasheet: {format_si(peak, 'FLOP/s')} {roof}, {format_si(spec.bandwidth, 'B/s')}"
    ax.plot(xs, [attainable_flops(x, peak, spec.bandwidth) for x in xs], color=color, lw=1.8, ls=ls, label=text)
    ridge = peak / spec.bandwidth
    ax.axvline(ridge, color=color, ls=":", lw=1)
    ax.annotate(f"ridge {ridge:.0f} FLOP/B", (ridge, peak), xytext=(4, 5), textcoords="offset points", fontsize=8.5)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per byte moved)")
    ax.set_ylabel("attainable FLOP/s")
    return ax


def _path(ax, costs, fits, spec, weight_dtype, marker, color, label, labels):
    """Points of one phase at the roofline's attainable FLOP/s, joined; filled if they fit in memory."""
    peak = spec.peak_flops(weight_dtype)
    xs = [c.intensity for c in costs]
    ys = [attainable_flops(x, peak, spec.bandwidth) for x in xs]
    ax.plot(xs, ys, "-", color=color, lw=0.8, alpha=0.5)
    for x, y, ok in zip(xs, ys, fits, strict=True):
        ax.scatter([x], [y], marker=marker, s=36, zorder=3, color=color if ok else "white", edgecolors=color)
    ax.scatter([], [], marker=marker, s=36, color=color, label=label)
    if xs[-1] < 2 * xs[0]:  # the path barely moves: one label, not two on top of each other
        labels = {len(xs) - 1: " .. ".join(labels.values())}
    for i, text in labels.items():
        ax.annotate(text, (xs[i], ys[i]), xytext=(5, -11), textcoords="offset points", fontsize=7.5, color=color)


def plot_scenario(ax, s: Scenario, prompt_lens: Sequence[int] = PROMPT_LENS, batches: Sequence[int] = BATCHES):
    """``s``'s GPU roofline with prefill over ``prompt_lens`` and decode over ``batches`` (hollow: does not fit),
    the scenario's own two points ringed, and the batch where the weights stop dominating marked."""
    if not isinstance(s, Scenario):
        raise BadType(f"s must be a Scenario (from gpu_scenario(...)), got {s!r}", arg="s")
    shape, dt = s.model, s.weight_dtype
    lens = sorted({t for t in prompt_lens if t <= shape.max_context} | {s.prompt_len})
    sizes = sorted(set(batches) | {s.batch})
    pre = [lc.prefill_cost(shape, t, s.batch, dt) for t in lens]
    dec = [lc.decode_cost(shape, s.context, b, dt) for b in sizes]
    mem = [lc.memory_needed(shape, max(t, s.context), s.batch, dt) for t in lens]
    dmem = [lc.memory_needed(shape, max(s.prompt_len, s.context), b, dt) for b in sizes]
    plot_gpu_roof(ax, s.gpu, dt, lo=0.3, hi=3 * max(s.placement.ridge, *(c.intensity for c in pre)))
    first_last = {0: f"T={lens[0]}", len(lens) - 1: f"T={lens[-1]}"}
    _path(ax, pre, [m <= s.gpu.memory for m in mem], s.gpu, dt, "o", COLORS["prefill"], "prefill", first_last)
    ends = {0: f"B={sizes[0]}", len(sizes) - 1: f"B={sizes[-1]}"}
    _path(ax, dec, [m <= s.gpu.memory for m in dmem], s.gpu, dt, "^", COLORS["decode"], "decode", ends)
    peak = s.gpu.peak_flops(dt)
    for cost in (s.prefill, s.decode):  # this scenario's two points
        y = attainable_flops(cost.intensity, peak, s.gpu.bandwidth)
        ax.scatter([cost.intensity], [y], s=160, facecolors="none", edgecolors=COLORS["accent"], lw=1.6, zorder=4)
    ax.scatter([], [], s=120, facecolors="none", edgecolors=COLORS["accent"], lw=1.6, label="this setting")
    cross = s.placement.weights_stop_dominating_batch
    x = s.placement.intensity(cross)
    ax.axvline(x, color=COLORS["decode"], ls="--", lw=0.8)
    note = dict(xytext=(-4, 0), textcoords="offset points", fontsize=7.5, color=COLORS["decode"], ha="right")
    ax.annotate(f"KV + activations = weights\nat B={cross}", (x, peak / 30), **note)
    p = s.placement
    if p.compute_bound_batch is None:
        note = f"decode at context {s.context:,} never reaches the ridge:\nits limit is {p.intensity_limit:.0f} FLOP/B"
    else:
        fit = "fits" if p.turns_compute_bound else f"but only B={p.max_batch:,} fits"
        note = f"decode at context {s.context:,} turns\ncompute-bound at B={p.compute_bound_batch:,} ({fit})"
    ax.text(0.02, 0.97, note, transform=ax.transAxes, va="top", fontsize=8.5, color=COLORS["decode"])
    ax.set_title(f"{shape.name} ({dt} weights) on {s.gpu.name}, decode at context {s.context:,}", fontsize=10.5)
    ax.legend(loc="lower right", fontsize=8)
    return ax


def plot_decode_intensity(ax, shape, spec: GPUSpec, contexts: Sequence[int], weight_dtype="bf16", max_b=1024):
    """Decode intensity against the batch, one line per context, solid while the KV cache fits in memory;
    the ridge as a horizontal line. Each line flattens toward its limit: one sequence's FLOPs per its own bytes.
    ``shape`` and ``spec`` may be given by name; ``contexts`` is a list of context lengths."""
    shape, spec, weight_dtype = lc.as_model(shape), as_gpu(spec, "spec"), lc.check_dtype(weight_dtype)
    if isinstance(contexts, (str, numbers.Number)) or not isinstance(contexts, Sequence) or not contexts:
        raise BadType(f"contexts must be a non-empty list of context lengths (e.g. [128, 8192]), got {contexts!r}",
                      arg="contexts")
    batches = [2**i for i in range(positive_int("max_b", max_b).bit_length())]
    colors = ["#16a085", "#2471a3", "#8e44ad", "#c0392b", "#e67e22"]
    ridge = spec.peak_flops(weight_dtype) / spec.bandwidth
    for i, ctx in enumerate(contexts):
        p = lc.place_decode(shape, spec, ctx, weight_dtype)
        c = colors[i % len(colors)]
        fit = [b for b in batches if b <= p.max_batch]
        ax.plot(batches, [p.intensity(b) for b in batches], ":", color=c, lw=1)
        label = f"context {ctx:,}: limit {p.intensity_limit:.0f} FLOP/B, fits up to B={p.max_batch:,}"
        ax.plot(fit, [p.intensity(b) for b in fit], "-o", ms=3, color=c, label=label)
    ax.axhline(ridge, color="black", ls="--", lw=1)
    where = dict(xytext=(0, 4), textcoords="offset points", fontsize=8.5, ha="right")
    ax.annotate(f"{spec.name} ridge {ridge:.0f} FLOP/B", (batches[-1], ridge), **where)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("decode batch size (sequences per step)")
    ax.set_ylabel("FLOP per byte of one decode step")
    ax.set_title(f"{shape.name} decode ({weight_dtype}): batching meets the KV cache", fontsize=10.5)
    ax.legend(loc="lower right", fontsize=7.5)
    return ax


def plot_operators(ax, shape, spec: GPUSpec, context: int, batches: Sequence[int] = (1, 16, 64, 256, 1024)):
    """Decode per operator on ``spec``'s datasheet roofline (bf16): the weight matrix products and attention
    over the cache as separate points, one per batch (hollow: the batch's KV cache does not fit)."""
    shape, spec = lc.as_model(shape), as_gpu(spec, "spec")
    place = lc.place_decode(shape, spec, context)
    plot_gpu_roof(ax, spec, lo=0.3, hi=3e3)
    peak = spec.peak_flops("bf16")
    costs = [lc.decode_cost(shape, context, b) for b in batches]
    xs = [c.matmul_intensity for c in costs]
    ys = [attainable_flops(x, peak, spec.bandwidth) for x in xs]
    ax.plot(xs, ys, "-", color="#2471a3", lw=1, alpha=0.6)
    label = f"weight matmuls (hollow: KV cache exceeds {spec.memory / 1e9:.0f} GB)"
    for b, x, y in zip(batches, xs, ys, strict=True):
        ax.plot(x, y, "s", ms=7, color="#2471a3", mfc="#2471a3" if b <= place.max_batch else "white",
                label=label if b == batches[0] else None)
        ax.annotate(f"B={b:,}", (x, y), xytext=(5, -11), textcoords="offset points", fontsize=8)
    x = place.attention_intensity  # the same at every batch: each sequence reads its own cache
    ax.plot(x, attainable_flops(x, peak, spec.bandwidth), "^", ms=9, color="#c0392b",
            label=f"attention over the cache, at every batch: {x:.1f} FLOP/B")
    ax.set_title(f"{shape.name} decode at context {context:,}, per operator, on {spec.name}", fontsize=10.5)
    ax.legend(loc="upper left", fontsize=8)
    return place


# --- measured beside predicted -------------------------------------------------------


def compact_legend(ax, **kwargs):
    """One legend entry per roofline drawn on ``ax`` (its line's label), the point markers explained once."""
    from matplotlib.lines import Line2D

    roofs = [line for line in ax.get_lines() if not line.get_label().startswith("_")]
    markers = [
        Line2D([], [], ls="", marker="o", color=COLORS["theory"], label="circles: prefill"),
        Line2D([], [], ls="", marker="^", color=COLORS["theory"], label="triangles: decode"),
    ]
    return ax.legend(handles=roofs + markers, **kwargs)


def check_result(result, keys=("device", "dtype", "peaks", "points")) -> dict:
    """``result`` if it looks like a roofline result (``measure.load_result(path)`` or ``measure_gpu(...)``:
    a dict with ``keys``); else a TypeError saying what to pass."""
    if not isinstance(result, dict) or any(k not in result for k in keys):
        raise BadType(f"result must be a roofline result dict with {list(keys)} (measure.load_result(path) or "
                      f"measure_gpu(device)), got {str(result)[:120]}", arg="result")
    return result


def result_label(result: dict) -> str:
    """A measured result's device as a legend says it: name, dtype and, on a CPU, the thread count."""
    d = check_result(result, ("device", "dtype"))["device"]
    threads = f", {d['threads']} thread{'s' if d['threads'] != 1 else ''}" if d["type"] == "cpu" else ""
    return f"{d['name']}, {result['dtype']}{threads}"


def spec_comparison(result: dict, spec: GPUSpec | None = None) -> dict:
    """A measured roofline ``result`` against the datasheet of its GPU (``spec``, else matched by device name).

    Returns {"spec", "roofs": {name: (measured, datasheet, ratio)}, "rows": [...]} where each row is a
    measured point with its predicted time at the datasheet roofs and the ratio measured / predicted.
    Without a tabulated spec, "spec" is None and only the measured roofs predict. ``spec`` may be a name.
    """
    check_result(result)
    spec = match_gpu(result["device"]["name"]) if spec is None else as_gpu(spec, "spec")
    dtype = "fp32" if result["dtype"] in ("float32", "fp32") else "bf16"
    peaks = result["peaks"]
    mp, mb = peaks["matmul_flops_per_s"], peaks["bandwidth_bytes_per_s"]
    roofs, rows = {}, []
    if spec is not None:
        roofs["compute"] = (mp, spec.peak_flops(dtype), mp / spec.peak_flops(dtype))
        roofs["bandwidth"] = (mb, spec.bandwidth, mb / spec.bandwidth)
    for p in result["points"]:
        at_measured = max(p["flops"] / mp, p["bytes"] / mb)
        row = {
            "phase": p["phase"],
            "batch": p["batch"],
            "tokens": p["tokens"],
            "context": p["context"],
            "intensity": p["intensity"],
            "measured_s": p["seconds"],
            "at_measured_roofs_s": at_measured,
            "measured_over_measured_roofs": p["seconds"] / at_measured,
        }
        if spec is not None:
            predicted = max(p["flops"] / spec.peak_flops(dtype), p["bytes"] / spec.bandwidth)
            row.update(predicted_s=predicted, measured_over_predicted=p["seconds"] / predicted)
        rows.append(row)
    return {"spec": spec, "dtype": dtype, "roofs": roofs, "rows": rows}


COMPARISON_HEADERS = ["phase", "B", "T", "context", "FLOP/B", "measured ms", "datasheet ms", "measured/datasheet"]


def comparison_rows(comparison: dict) -> list[list]:
    """Rows under ``COMPARISON_HEADERS`` (datasheet columns "-" when the GPU is not tabulated)."""
    if not isinstance(comparison, dict) or "rows" not in comparison:
        raise BadType(f"comparison must be the dict spec_comparison(result) returns, got {str(comparison)[:120]}",
                      arg="comparison")
    out = []
    for r in comparison["rows"]:
        pred = r.get("predicted_s")
        out.append(
            [
                r["phase"],
                r["batch"],
                r["tokens"],
                r["context"],
                round(r["intensity"], 1),
                round(r["measured_s"] * 1e3, 3),
                "-" if pred is None else round(pred * 1e3, 3),
                "-" if pred is None else round(r["measured_over_predicted"], 2),
            ]
        )
    return out


def roof_lines(comparison: dict) -> list[str]:
    """Each measured roof of ``comparison`` (``spec_comparison``'s) against its datasheet figure, a line each."""
    if not isinstance(comparison, dict) or "roofs" not in comparison:
        raise BadType(f"comparison must be the dict spec_comparison(result) returns, got {str(comparison)[:120]}",
                      arg="comparison")
    if comparison["spec"] is None:
        return ["this GPU is not in ar_lab.perf.gpus: compared with its measured roofs only"]
    return [
        f"{roof} roof: measured {value:.3g}, datasheet {sheet:.3g} -> measured / datasheet = {ratio:.2f}"
        for roof, (value, sheet, ratio) in comparison["roofs"].items()
    ]


def plot_measured_vs_spec(ax, result: dict, spec: GPUSpec | None = None):
    """Measured roofs and points (filled) beside the datasheet roofline and predicted points (hollow)."""
    from ar_lab.course.views.plots import plot_roofline

    comparison = spec_comparison(result, spec)
    spec = comparison["spec"]
    plot_roofline(ax, result, label=f"{result_label(result)}, measured", annotate=False)  # "roofs of ..."
    if spec is not None:
        xs = [p["intensity"] for p in result["points"]]
        plot_gpu_roof(ax, spec, comparison["dtype"], lo=min(xs) / 4, hi=max(xs) * 40, color=COLORS["theory"])
        peak = spec.peak_flops(comparison["dtype"])
        for phase, marker in (("prefill", "o"), ("decode", "^")):
            pts = [p for p in result["points"] if p["phase"] == phase]
            ys = [attainable_flops(p["intensity"], peak, spec.bandwidth) for p in pts]
            ax.scatter(
                [p["intensity"] for p in pts],
                ys,
                marker=marker,
                s=40,
                facecolors="none",
                edgecolors=COLORS[phase],
                label=f"{phase} predicted from the datasheet",
            )
    ax.set_title(f"{result['device']['name']}: measured (filled) and datasheet (hollow)", fontsize=10.5)
    ax.legend(loc="lower right", fontsize=7.5)
    return comparison


# A random-init model per GPU memory size, large enough that a decode step streams its
# weights from memory (far beyond the L2 cache) rather than waiting on kernel launches.
GPU_CONFIGS = {
    40e9: GPTConfig(block_size=4096, n_layer=32, n_head=32, n_embd=4096),  # 6.5 B parameters, 13 GB in bf16
    12e9: GPTConfig(block_size=4096, n_layer=24, n_head=16, n_embd=2048),  # 1.2 B parameters, 2.4 GB in bf16
}


def measure_config(memory: float) -> GPTConfig:
    """The largest of ``GPU_CONFIGS`` for a device with ``memory`` bytes (the smallest below 12 GB)."""
    memory = finite_number("memory (bytes)", memory, arg="memory")
    for need, cfg in sorted(GPU_CONFIGS.items(), reverse=True):
        if memory >= need:
            return cfg
    return min(GPU_CONFIGS.items())[1]


def measure_gpu(
    device,
    cfg: GPTConfig | None = None,
    *,
    prompt_lens: Sequence[int] = (128, 512, 2048),
    batches: Sequence[int] = (1, 8, 32, 128),
    context: int = 512,
    repeats: int = 3,
    progress: Callable[[str], None] | None = None,
    **run_options,
) -> dict:
    """Measure this device's roofs and prefill/decode points of a random-init model (``measure.run_roofline``'s
    result). On CUDA the model is ``measure_config(memory)`` in bf16, every pass replays as a CUDA graph, and
    batches whose weights + KV cache would take more than 60 % of the memory are left out."""
    import torch

    from ar_lab.base.timing import checked_device
    from ar_lab.perf.measure import build_model, run_roofline

    device = checked_device(device)  # "banana", "mps" or "cuda" without a GPU: a ValueError saying what to pass
    cuda = device.type == "cuda"
    memory = torch.cuda.get_device_properties(device).total_memory if cuda else 0
    cfg = measure_config(memory) if cfg is None else cfg
    if cuda:
        shape = lc.from_gpt_config(cfg)
        batches = [b for b in batches if lc.memory_needed(shape, context, b) <= 0.6 * memory] or [1]
    model = build_model(cfg, device)
    try:
        return run_roofline(
            model, prompt_lens, batches, context, repeats=repeats, progress=progress, cuda_graph=cuda, **run_options
        )
    finally:
        del model
        if cuda:
            torch.cuda.empty_cache()


def gpu_measurement(device, *, progress: Callable[[str], None] | None = None) -> tuple[dict | None, str]:
    """A GPU roofline result and where it comes from: measured now (``measure_gpu``) when ``device`` is a CUDA
    GPU, else the newest committed ``data/roofline_gpu_*.json``; without either, None and a sentence saying so."""
    import time

    from ar_lab.base.timing import checked_device, device_name
    from ar_lab.perf.measure import load_result, reference_files

    device = checked_device(device)
    if device.type == "cuda":
        start = time.perf_counter()
        result = measure_gpu(device, progress=progress)
        return result, f"measured now on this GPU, in {time.perf_counter() - start:.0f} s"
    if files := reference_files(device_type="cuda"):
        return load_result(files[-1]), f"committed measurement {files[-1].parent.name}/{files[-1].name}"
    return None, (
        f"This machine has no GPU ({device_name(device)}) and the repository holds no GPU measurement: nothing in "
        "this chapter was measured on a GPU. The GPU figures above are predictions from datasheets."
    )
