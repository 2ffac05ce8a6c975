"""Chapter 09's explorer: bits and group size -> the quantization error of a real weight matrix,
and the bytes per token and memory-bound speedup the roofline predicts for whole models.

Pure functions first (the tests call them directly), then ``QuantExplorer``, a thin widget
over ``quant_view``. Any combination of bits and group size is computed with the package's
one quantization rule (``ar_lab.engine.quant.absmax_quantize``: scale = max |group| / levels,
q = round(w / scale)); 8 bits with one scale per row is exactly ``quantize_int8``, 4 bits
with groups of 32 to 256 exactly ``quantize_int4``. Bytes are counted in the layout of
``ar_lab.engine.quant.QuantizedLinear`` (``SCALE_BYTES``): for the formats that class runs,
``weight_bytes`` equals ``ar_lab.perf.roofline.bytes_per_token`` of the quantized model exactly.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass

import torch

from ar_lab.base.args import positive_int
from ar_lab.base.errors import BadType, BadValue
from ar_lab.course.views.widgets import refuse
from ar_lab.engine.quant import QuantizationError, absmax_quantize, error_between
from ar_lab.model.gpt import GPT, GPTConfig
from ar_lab.perf.roofline import decode_cost, parameter_count

BITS = (8, 4)
# Bytes stored per scale, as QuantizedLinear stores them: int8 one bfloat16 scale per row (or
# group); int4 a bfloat16 scale and a bfloat16 zero (always 0 here) per group: what the CPU kernels
# read.
SCALE_BYTES = {8: 2, 4: 4}


def levels(bits: int) -> int:
    """The largest level of symmetric ``bits``-bit integers: 127 for 8 bits, 7 for 4 (2^(bits-1) -
    1)."""
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in BITS:
        raise BadValue(f"bits must be 8 or 4, got {bits!r}", arg="bits")
    return 2 ** (bits - 1) - 1


def check_group_size(group_size, n_in: int) -> int | None:
    """``group_size`` as the explorer takes it: 0 (or None) for one scale per row, else a whole
    number from 1 to ``n_in`` that divides ``n_in``. Returns None for a row, the size otherwise; a
    ValueError giving the allowed values for anything else (never a nearby value instead)."""
    ok = group_size is None or (isinstance(group_size, int) and not isinstance(group_size, bool))
    if ok and group_size in (None, 0):
        return None
    if not ok or group_size < 1 or group_size > n_in or n_in % group_size:
        raise BadValue(
            f"group size must be 0 (one scale per row) or a whole number from 1 to {n_in} that "
            f"divides {n_in}, got {group_size!r} for group_size",
            arg="group_size",
        )
    return group_size


def quantize_groups(
    weight: torch.Tensor, bits: int, group_size: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric quantization of ``weight`` (out, in) with one scale per row (``group_size`` None)
    or per row and group of ``group_size`` input columns: q (out, in) int8 in [-levels, levels],
    scale (out, groups)."""
    w = weight.detach().float()
    out, n_in = w.shape
    size = n_in if group_size is None else check_group_size(group_size, n_in)
    # (out, groups, size), (out, groups)
    q, scale = absmax_quantize(w.view(out, n_in // size, size), levels(bits))
    return q.view(out, n_in), scale


def dequantize_groups(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q x scale, each scale broadcast over its group: (out, in) float32."""
    out, n_in = q.shape
    return (q.float().view(out, scale.shape[1], -1) * scale[:, :, None]).view(out, n_in)


def group_error(weight: torch.Tensor, bits: int, group_size: int | None) -> QuantizationError:
    """How far the dequantized weights are from ``weight`` (like
    ``ar_lab.engine.quant.quantization_error``, any group)."""
    w = weight.detach().float()
    return error_between(w, dequantize_groups(*quantize_groups(w, bits, group_size)))


def block_matrices(cfg: GPTConfig) -> list[tuple[int, int]]:
    """(out, in) of the four Linear weights of one block: qkv, attention output, MLP in, MLP out."""
    d, qkv = cfg.n_embd, (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim
    return [(qkv, d), (d, d), (4 * d, d), (d, 4 * d)]


def weight_bytes(cfg: GPTConfig, weights: str | int, group_size: int | None = None) -> int:
    """Bytes of weights one batch-1 decode step of ``GPT(cfg)`` reads: ``"fp32"``, ``"bf16"``, or
    the blocks' Linear weights at 8 or 4 bits (one scale of ``SCALE_BYTES[bits]`` per row or group),
    the embeddings, LayerNorms and biases in float32 (what ``ar_lab.engine.quant.quantize_model``
    keeps)."""
    # float32: every parameter once, one row of the position table
    full = int(decode_cost(cfg, 1).weight_bytes)
    if weights in ("fp32", "bf16"):
        return full if weights == "fp32" else full // 2
    if weights not in BITS or isinstance(weights, bool):
        raise BadValue(
            f"weights must be 'fp32', 'bf16' or a number of bits, 8 or 4, got {weights!r}",
            arg="weights",
        )
    total = full
    for out, n_in in block_matrices(cfg):
        groups = 1 if group_size is None else n_in // check_group_size(group_size, n_in)
        total += cfg.n_layer * (
            math.ceil(out * n_in * weights / 8)
            + out * groups * SCALE_BYTES[weights]
            - 4 * out * n_in
        )
    return total


def step_bytes(
    cfg: GPTConfig, weights: str | int, group_size: int | None = None, context: int = 64
) -> int:
    """``weight_bytes`` plus the KV cache and activations a step at ``context`` positions moves
    (float32; bfloat16 for ``"bf16"``, whose whole model computes in it):
    ``ar_lab.perf.roofline.decode_step_bytes``' count."""
    cost = decode_cost(cfg, context, bytes_per_value=2 if weights == "bf16" else 4)
    return weight_bytes(cfg, weights, group_size) + int(cost.kv_bytes + cost.activation_bytes)


@dataclass(frozen=True)
class ModelBytes:
    """One model's bytes per decode step: float32, bfloat16 and the chosen format, and the predicted
    speedup."""

    name: str
    parameters: int
    fp32: int  # bytes a step moves (weights + KV cache + activations), float32 weights
    bf16: int
    chosen: int
    predicted_speedup: float  # fp32 / chosen: the memory-bound prediction


@dataclass(frozen=True)
class QuantView:
    """What the explorer shows for one choice of layer, bits and group size."""

    layer: str
    shape: tuple[int, int]
    bits: int
    group_size: int | None  # None: one scale per row
    error: QuantizationError
    error_int8: QuantizationError  # the same layer at 8 bits, one scale per row, for comparison
    bits_per_weight: float  # bits + the scale's bits shared by its group
    row: torch.Tensor  # the layer's first row, its first ``shown`` columns
    row_dequantized: torch.Tensor
    models: list[ModelBytes]
    context: int

    @property
    def label(self) -> str:
        return f"int{self.bits}, " + (
            "one scale per row" if self.group_size is None else f"groups of {self.group_size}"
        )


def quant_view(
    weights: dict[str, torch.Tensor],
    layer: str,
    bits: int,
    group_size: int | None,
    configs: dict[str, GPTConfig],
    *,
    context: int = 64,
    shown: int = 64,
) -> QuantView:
    """The explorer's numbers: ``weights[layer]`` quantized at ``bits`` with ``group_size`` (0 /
    None: per row), its error, and each model of ``configs`` at that format, in bytes per step and
    predicted speedup."""
    if not isinstance(weights, dict) or not isinstance(configs, dict):
        raise BadType(
            f"weights and configs must be dicts (name -> 2-d tensor, name -> GPTConfig), got "
            f"{type(weights).__name__} and {type(configs).__name__}",
            arg="configs" if isinstance(weights, dict) else "weights",
        )
    if not isinstance(layer, str) or layer not in weights:
        raise BadValue(f"layer must be one of {sorted(weights)}, got {layer!r}", arg="layer")
    if not isinstance(weights[layer], torch.Tensor) or weights[layer].ndim != 2:
        raise BadValue(
            f"weights[{layer!r}] must be a 2-d weight matrix (out, in), got {weights[layer]!r}"[
                :200
            ],
            arg="weights",
        )
    w = weights[layer].detach().float()
    levels(bits)
    context, shown = positive_int("context", context), positive_int("shown", shown)
    size = check_group_size(group_size, w.shape[1])
    models = []
    for name, cfg in configs.items():
        fp32 = step_bytes(cfg, "fp32", context=context)
        try:
            chosen = step_bytes(cfg, bits, size, context)
        except ValueError as e:  # the group size does not divide one of this model's widths
            raise BadValue(f"{name}: {e}", arg=getattr(e, "arg", None) or "group_size") from None
        bf16 = step_bytes(cfg, "bf16", context=context)
        models.append(ModelBytes(name, parameter_count(cfg), fp32, bf16, chosen, fp32 / chosen))
    q, scale = quantize_groups(w, bits, size)
    group = w.shape[1] if size is None else size
    return QuantView(
        layer=layer,
        shape=tuple(w.shape),
        bits=bits,
        group_size=size,
        error=group_error(w, bits, size),
        error_int8=group_error(w, 8, None),
        bits_per_weight=bits + 8 * SCALE_BYTES[bits] / group,
        row=w[0, :shown].clone(),
        row_dequantized=dequantize_groups(q, scale)[0, :shown],
        models=models,
        context=context,
    )


def plot_quant_view(axes, view: QuantView) -> None:
    """Left: one row's weights and the levels they were rounded to; right: MB per step of each
    model."""
    from ar_lab.course.views.plots import COLORS

    a1, a2 = axes
    xs = torch.arange(len(view.row))
    a1.plot(xs, view.row, "o", ms=3.5, color=COLORS["target"], label="weight (float32)")
    a1.step(
        xs,
        view.row_dequantized,
        where="mid",
        color=COLORS["accent"],
        lw=1.2,
        label=f"dequantized ({view.label})",
    )
    if view.group_size is not None and view.group_size < len(view.row):
        for x in range(view.group_size, len(view.row), view.group_size):
            a1.axvline(x - 0.5, color=COLORS["theory"], lw=0.8, ls=":")
    a1.set(xlabel="input column", ylabel="value", title=f"{view.layer}, row 0")
    top = float(torch.cat([view.row, view.row_dequantized]).abs().max())
    a1.set_ylim(-1.15 * top, 1.9 * top)  # room for the legend above the weights
    a1.legend(fontsize=8.5, loc="upper left", ncol=2)
    names = [m.name for m in view.models]
    ys = torch.arange(len(names)).float()
    for off, key, color, label in [
        (-0.27, "fp32", COLORS["theory"], "fp32"),
        (0.0, "bf16", COLORS["draft"], "bf16"),
        (0.27, "chosen", COLORS["accent"], view.label),
    ]:
        a2.barh(
            ys + off,
            [getattr(m, key) / m.fp32 for m in view.models],
            0.27,
            color=color,
            label=label,
        )
    for y, m in zip(ys, view.models, strict=True):
        a2.text(
            m.chosen / m.fp32 + 0.02,
            y + 0.27,
            f"{m.predicted_speedup:.1f}× predicted",
            va="center",
            fontsize=8.5,
        )
    a2.set_yticks(ys, names)
    a2.set(
        xlim=(0, 1.3),
        xlabel="bytes per decode step (× fp32)",
        title=f"Bytes per step, context {view.context}",
    )
    a2.legend(fontsize=8.5, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def view_html(view: QuantView) -> str:
    """The explorer's summary line and table."""
    e, e8 = view.error, view.error_int8
    rows = "".join(
        f"<tr><td>{html.escape(m.name)}</td><td>{m.parameters / 1e6:,.1f} M</td><td>"
        f"{m.fp32 / 1e6:,.2f}</td><td><b>{m.chosen / 1e6:,.2f}</b></td><td><b>"
        f"{m.predicted_speedup:.2f}×</b></td></tr>"
        for m in view.models
    )
    th = "".join(
        f"<th style='padding:1px 8px'>{h}</th>"
        for h in ["model", "parameters", "fp32 MB/step", "this format MB/step", "predicted speedup"]
    )
    return (
        f"<div><b>{html.escape(view.label)}</b> on {html.escape(view.layer)} {view.shape}: "
        f"relative RMS error <b>{e.relative_rms:.2%}</b> ("
        f"{e.relative_rms / max(e8.relative_rms, 1e-30):.1f}× int8 per row), largest error "
        f"{e.max_abs:.2g}; {view.bits_per_weight:.2f} bits per weight with its "
        f"scales.</div><table>{th}{rows}</table>"
    )


class QuantExplorer:
    """Layer, bits and group size -> error, the rounded row, and predicted bytes and speed per
    model.

    Every change calls ``quant_view``. ``view`` holds the last result and ``error`` the message
    for a refused value (shown in the widget; the box keeps what was typed), for headless tests.
    """

    def __init__(
        self,
        weights: dict,
        configs: dict,
        layer: str | None = None,
        bits: int = 4,
        group_size: int = 32,
    ):
        import ipywidgets as W

        self.weights, self.configs = dict(weights), dict(configs)
        levels(bits)  # a dropdown holds only its options: an unknown bits or layer is an error here
        if layer is not None and layer not in self.weights:
            raise BadValue(f"layer must be one of {list(self.weights)}, got {layer!r}", arg="layer")
        style = {"description_width": "90px"}
        box = dict(style=style, layout=W.Layout(width="260px"))
        self.layer = W.Dropdown(
            options=list(self.weights),
            value=layer or next(iter(self.weights)),
            description="layer",
            style=style,
            layout=W.Layout(width="340px"),
        )
        self.bits = W.Dropdown(options=list(BITS), value=bits, description="bits", **box)
        self.group_size = W.IntText(
            group_size,
            description="group size",
            tooltip="0 (one scale per row) or a whole number that divides the layer's input width",
            **box,
        )
        self.status = W.HTML()
        self.image = W.Image(format="png")
        self.view: QuantView | None = None
        self.error, self.refused = "", None
        for c in (self.layer, self.bits, self.group_size):
            c.observe(lambda _change: self.update(), names="value")
        self.widget = W.VBox(
            [W.HBox([self.layer, self.bits, self.group_size]), self.status, self.image]
        )
        self.update()

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    def update(self) -> None:
        import matplotlib.pyplot as plt

        from ar_lab.course.views.plots import png_bytes

        try:
            view = quant_view(
                self.weights, self.layer.value, self.bits.value, self.group_size.value, self.configs
            )
        except ValueError as e:
            self.status.value = refuse(self, e)
            return
        self.view, self.error, self.refused = view, "", None
        self.status.value = view_html(view)
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
        plot_quant_view(axes, view)
        fig.tight_layout()
        self.image.value = png_bytes(fig)


def quant_explorer(model, configs: dict | None = None, **settings) -> QuantExplorer:
    """Build the chapter-09 explorer over ``model``'s block weights (display it by leaving it last
    in a cell). ``configs``: name -> GPTConfig of the models whose bytes it predicts (default:
    ``model``'s own)."""
    if not isinstance(model, GPT):
        raise BadType(
            f"model must be a GPT (e.g. ar_lab.load_pretrained('course')), got {model!r}"[:200],
            arg="model",
        )
    weights = {
        name: p
        for name, p in model.named_parameters()
        if p.ndim == 2 and name.startswith("blocks.")
    }
    return QuantExplorer(weights, configs or {"this model": model.config}, **settings)
