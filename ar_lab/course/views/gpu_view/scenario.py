"""Chapter 05's what-if on a GPU: ``gpu_scenario`` (a GPU from ``ar_lab.perf.gpus``, a model from
``ar_lab.perf.llm_costs``, a weight format, a batch, a prompt and a context -> predicted TTFT, TPOT,
tokens/s and memory, or a clear "does not fit") and the plots that draw it (``plot_gpu_roof``,
``plot_scenario``, ``plot_decode_intensity``, ``plot_operators``)."""
from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

from ar_lab.base.args import positive_int
from ar_lab.base.errors import BadType, BadValue
from ar_lab.course.views.plots import COLORS
from ar_lab.perf import llm_costs as lc
from ar_lab.perf.gpus import GPUSpec, as_gpu
from ar_lab.perf.roofline import PhaseCost, attainable_flops, format_si

PROMPT_LENS = (128, 256, 512, 1024, 2048, 4096, 8192)
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class Scenario:
    """One what-if: ``batch`` sequences of ``model`` on ``gpu``, prompts of ``prompt_len``, decoding
    at ``context``."""

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
        """Seconds to the first token: the prefill of all ``batch`` prompts, at the datasheet
        roofs."""
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
                f"does not fit: the {self.weight_dtype} weights alone take "
                f"{self.weights / 1e9:.1f} GB of the {self.gpu.name}'s "
                f"{self.gpu.memory / 1e9:.0f} GB; try smaller weights (int8, int4)"
            )
        return (
            f"does not fit: weights + KV cache need {self.memory / 1e9:.1f} GB of "
            f"{self.gpu.memory / 1e9:.0f} GB; at this context at most {self.placement.max_batch} "
            "sequence(s) fit"
        )


def gpu_scenario(
    gpu_name: str,
    model_name: str,
    weight_dtype: str = "bf16",
    batch: int = 1,
    prompt_len: int = 2000,
    context=2500,
) -> Scenario:
    """The explorer's pure function: predictions for one setting (raises ValueError for impossible
    input).

    ``gpu_name`` and ``model_name`` are names from ``GPUS`` and ``MODELS`` (or the rows themselves).
    Decoding continues after the prompt, so ``context`` is at least ``prompt_len``."""
    spec, shape = as_gpu(gpu_name, "gpu_name"), lc.as_model(model_name, "model_name")
    weight_dtype = lc.check_dtype(weight_dtype)
    batch, prompt_len = lc.count("batch", batch), lc.count("prompt_len", prompt_len)
    context = lc.count("context", context)
    if context < prompt_len:
        raise BadValue(
            f"context ({context:,}) must be at least prompt_len ({prompt_len:,}): decoding "
            "continues after the prompt, so the context a decode step attends to includes the "
            "whole prompt",
            arg="context",
        )
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


def plot_gpu_roof(
    ax,
    spec: GPUSpec,
    weight_dtype: str = "bf16",
    *,
    lo=0.3,
    hi=3e4,
    color="black",
    label=None,
    ls="-",
):
    """The datasheet roofline of ``spec`` (a ``GPUSpec`` or its name; compute roof for
    ``weight_dtype``), its ridge marked and labelled."""
    spec, weight_dtype = as_gpu(spec, "spec"), lc.check_dtype(weight_dtype)
    peak = spec.peak_flops(weight_dtype)
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    roof = "fp32" if weight_dtype == "fp32" else "16-bit tensor"
    text = label or (
        f"{spec.name} datasheet: {format_si(peak, 'FLOP/s')} {roof}, "
        f"{format_si(spec.bandwidth, 'B/s')}"
    )
    ax.plot(
        xs,
        [attainable_flops(x, peak, spec.bandwidth) for x in xs],
        color=color,
        lw=1.8,
        ls=ls,
        label=text,
    )
    ridge = peak / spec.bandwidth
    ax.axvline(ridge, color=color, ls=":", lw=1)
    ax.annotate(
        f"ridge {ridge:.0f} FLOP/B",
        (ridge, peak),
        xytext=(4, 5),
        textcoords="offset points",
        fontsize=8.5,
    )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per byte moved)")
    ax.set_ylabel("attainable FLOP/s")
    return ax


def _path(ax, costs, fits, spec, weight_dtype, marker, color, label, labels):
    """Points of one phase at the roofline's attainable FLOP/s, joined; filled if they fit in
    memory."""
    peak = spec.peak_flops(weight_dtype)
    xs = [c.intensity for c in costs]
    ys = [attainable_flops(x, peak, spec.bandwidth) for x in xs]
    ax.plot(xs, ys, "-", color=color, lw=0.8, alpha=0.5)
    for x, y, ok in zip(xs, ys, fits, strict=True):
        ax.scatter(
            [x],
            [y],
            marker=marker,
            s=36,
            zorder=3,
            color=color if ok else "white",
            edgecolors=color,
        )
    ax.scatter([], [], marker=marker, s=36, color=color, label=label)
    if xs[-1] < 2 * xs[0]:  # the path barely moves: one label, not two on top of each other
        labels = {len(xs) - 1: " .. ".join(labels.values())}
    for i, text in labels.items():
        ax.annotate(
            text,
            (xs[i], ys[i]),
            xytext=(5, -11),
            textcoords="offset points",
            fontsize=7.5,
            color=color,
        )


def _mark_decode_batches(ax, s: Scenario, peak: float) -> None:
    """Mark the batch where the weights stop dominating a decode step, and say where (or whether)
    decode at the scenario's context turns compute-bound."""
    cross = s.placement.weights_stop_dominating_batch
    x = s.placement.intensity(cross)
    ax.axvline(x, color=COLORS["decode"], ls="--", lw=0.8)
    note = dict(
        xytext=(-4, 0), textcoords="offset points", fontsize=7.5, color=COLORS["decode"], ha="right"
    )
    ax.annotate(f"KV + activations = weights\nat B={cross}", (x, peak / 30), **note)
    p = s.placement
    if p.compute_bound_batch is None:
        note = (
            f"decode at context {s.context:,} never reaches the ridge:\nits limit is "
            f"{p.intensity_limit:.0f} FLOP/B"
        )
    else:
        fit = "fits" if p.turns_compute_bound else f"but only B={p.max_batch:,} fits"
        note = (
            f"decode at context {s.context:,} turns\ncompute-bound at B={p.compute_bound_batch:,}"
            f" ({fit})"
        )
    ax.text(
        0.02, 0.97, note, transform=ax.transAxes, va="top", fontsize=8.5, color=COLORS["decode"]
    )


def plot_scenario(
    ax, s: Scenario, prompt_lens: Sequence[int] = PROMPT_LENS, batches: Sequence[int] = BATCHES
):
    """``s``'s GPU roofline with prefill over ``prompt_lens`` and decode over ``batches`` (hollow:
    does not fit), the scenario's own two points ringed, and the batch where the weights stop
    dominating marked."""
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
    _path(
        ax,
        pre,
        [m <= s.gpu.memory for m in mem],
        s.gpu,
        dt,
        "o",
        COLORS["prefill"],
        "prefill",
        first_last,
    )
    ends = {0: f"B={sizes[0]}", len(sizes) - 1: f"B={sizes[-1]}"}
    _path(
        ax, dec, [m <= s.gpu.memory for m in dmem], s.gpu, dt, "^", COLORS["decode"], "decode", ends
    )
    peak = s.gpu.peak_flops(dt)
    for cost in (s.prefill, s.decode):  # this scenario's two points
        y = attainable_flops(cost.intensity, peak, s.gpu.bandwidth)
        ax.scatter(
            [cost.intensity],
            [y],
            s=160,
            facecolors="none",
            edgecolors=COLORS["accent"],
            lw=1.6,
            zorder=4,
        )
    ax.scatter(
        [], [], s=120, facecolors="none", edgecolors=COLORS["accent"], lw=1.6, label="this setting"
    )
    _mark_decode_batches(ax, s, peak)
    ax.set_title(
        f"{shape.name} ({dt} weights) on {s.gpu.name}, decode at context {s.context:,}",
        fontsize=10.5,
    )
    ax.legend(loc="lower right", fontsize=8)
    return ax


def plot_decode_intensity(
    ax, shape, spec: GPUSpec, contexts: Sequence[int], weight_dtype="bf16", max_b=1024
):
    """Decode intensity against the batch, one line per context, solid while the KV cache fits in
    memory; the ridge as a horizontal line. Each line flattens toward its limit: one sequence's
    FLOPs per its own bytes. ``shape`` and ``spec`` may be given by name; ``contexts`` is a list of
    context lengths."""
    shape, spec, weight_dtype = (
        lc.as_model(shape),
        as_gpu(spec, "spec"),
        lc.check_dtype(weight_dtype),
    )
    if (
        isinstance(contexts, (str, numbers.Number))
        or not isinstance(contexts, Sequence)
        or not contexts
    ):
        raise BadType(
            "contexts must be a non-empty list of context lengths (e.g. [128, 8192]), got "
            f"{contexts!r}",
            arg="contexts",
        )
    batches = [2**i for i in range(positive_int("max_b", max_b).bit_length())]
    colors = ["#16a085", "#2471a3", "#8e44ad", "#c0392b", "#e67e22"]
    ridge = spec.peak_flops(weight_dtype) / spec.bandwidth
    for i, ctx in enumerate(contexts):
        p = lc.place_decode(shape, spec, ctx, weight_dtype)
        c = colors[i % len(colors)]
        fit = [b for b in batches if b <= p.max_batch]
        ax.plot(batches, [p.intensity(b) for b in batches], ":", color=c, lw=1)
        label = (
            f"context {ctx:,}: limit {p.intensity_limit:.0f} FLOP/B, fits up to B={p.max_batch:,}"
        )
        ax.plot(fit, [p.intensity(b) for b in fit], "-o", ms=3, color=c, label=label)
    ax.axhline(ridge, color="black", ls="--", lw=1)
    where = dict(xytext=(0, 4), textcoords="offset points", fontsize=8.5, ha="right")
    ax.annotate(f"{spec.name} ridge {ridge:.0f} FLOP/B", (batches[-1], ridge), **where)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("decode batch size (sequences per step)")
    ax.set_ylabel("FLOP per byte of one decode step")
    ax.set_title(
        f"{shape.name} decode ({weight_dtype}): batching meets the KV cache", fontsize=10.5
    )
    ax.legend(loc="lower right", fontsize=7.5)
    return ax


def plot_operators(
    ax, shape, spec: GPUSpec, context: int, batches: Sequence[int] = (1, 16, 64, 256, 1024)
):
    """Decode per operator on ``spec``'s datasheet roofline (bf16): the weight matrix products and
    attention over the cache as separate points, one per batch (hollow: the batch's KV cache does
    not fit)."""
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
        ax.plot(
            x,
            y,
            "s",
            ms=7,
            color="#2471a3",
            mfc="#2471a3" if b <= place.max_batch else "white",
            label=label if b == batches[0] else None,
        )
        ax.annotate(f"B={b:,}", (x, y), xytext=(5, -11), textcoords="offset points", fontsize=8)
    x = place.attention_intensity  # the same at every batch: each sequence reads its own cache
    ax.plot(x, attainable_flops(x, peak, spec.bandwidth), "^", ms=9, color="#c0392b",
            label=f"attention over the cache, at every batch: {x:.1f} FLOP/B")
    ax.set_title(
        f"{shape.name} decode at context {context:,}, per operator, on {spec.name}", fontsize=10.5
    )
    ax.legend(loc="upper left", fontsize=8)
    return place


# --- measured beside predicted -------------------------------------------------------


def compact_legend(ax, **kwargs):
    """One legend entry per roofline drawn on ``ax`` (its line's label), the point markers explained
    once."""
    from matplotlib.lines import Line2D

    roofs = [line for line in ax.get_lines() if not line.get_label().startswith("_")]
    markers = [
        Line2D([], [], ls="", marker="o", color=COLORS["theory"], label="circles: prefill"),
        Line2D([], [], ls="", marker="^", color=COLORS["theory"], label="triangles: decode"),
    ]
    return ax.legend(handles=roofs + markers, **kwargs)
