"""The course's plotting style and the plot helpers the chapters share (chapter 05's roofline among
them)."""

from __future__ import annotations

import matplotlib as mpl
import torch

from ar_lab.model.tokenizer import EOS_ID
from ar_lab.perf.roofline import attainable_flops, format_si, ridge_point

# One palette for the whole course: the same idea keeps the same colour.
COLORS = {
    "uncached": "#c0392b",
    "cached": "#2471a3",
    "prefill": "#8e44ad",
    "decode": "#16a085",
    "kept": "#2471a3",
    "dropped": "#bfc9ca",
    "target": "#2471a3",
    "draft": "#e67e22",
    "theory": "#7f8c8d",
    "accent": "#c0392b",
}


def use_style() -> None:
    """Apply the course style to every later matplotlib figure."""
    mpl.rcParams.update(
        {
            "figure.figsize": (7.5, 4.0),
            "figure.dpi": 100,
            "savefig.dpi": 110,
            "axes.grid": True,
            "grid.alpha": 0.3,
            "axes.spines.top": False,
            "axes.spines.right": False,
            "axes.titlesize": 12,
            "axes.titleweight": "bold",
            "axes.labelsize": 10.5,
            "legend.frameon": False,
            "font.size": 10,
        }
    )


def token_label(token: int) -> str:
    """A readable label for a byte token: the character, or a name for invisible ones."""
    token = int(token)
    if token == EOS_ID:
        return "EOS"
    names = {10: "\\n", 9: "\\t", 32: "␣", 13: "\\r"}
    if token in names:
        return names[token]
    if 33 <= token < 127:
        return chr(token)
    return f"0x{token:02x}"


def plot_distribution(
    ax, probs: torch.Tensor, top: int = 20, kept: torch.Tensor | None = None, title: str = ""
):
    """Bar chart of the ``top`` most likely tokens; tokens not ``kept`` drawn grey."""
    probs = probs.detach().float().cpu()
    order = probs.argsort(descending=True)[:top]
    colors = [COLORS["kept"] if kept is None or bool(kept[i]) else COLORS["dropped"] for i in order]
    ax.bar(range(len(order)), probs[order].numpy(), color=colors)
    ax.set_xticks(range(len(order)), [token_label(i) for i in order.tolist()])
    ax.set_ylabel("probability")
    ax.set_xlabel(f"next token (the {len(order)} most likely)")
    if title:
        ax.set_title(title)
    return ax


def plot_roofline(
    ax,
    result: dict,
    *,
    label: str | None = None,
    color: str | None = None,
    roof_color: str = "black",
    points: bool = True,
    annotate: bool = True,
):
    """Draw ``result``'s measured roofs (compute roof, bandwidth slope, ridge) and its points on a
    log-log ``ax``.

    ``result`` is what ``ar_lab.perf.measure.run_roofline`` returns (or ``load_result``
    reads). Prefill points are circles, decode points triangles; with ``annotate``
    each is labelled with its prompt length (T=) or batch size (B=), and the ridge
    with its intensity.
    """
    peak, bw = result["peaks"]["matmul_flops_per_s"], result["peaks"]["bandwidth_bytes_per_s"]
    ridge = ridge_point(peak, bw)
    intensities = [p["intensity"] for p in result["points"]] or [ridge]
    lo = min(min(intensities), ridge) / 4
    hi = max(max(intensities), ridge) * 4
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    name = label or result["device"]["name"]
    roof_label = f"roofs of {name}: {format_si(peak, 'FLOP/s')}, {format_si(bw, 'B/s')}"
    ax.plot(
        xs, [attainable_flops(x, peak, bw) for x in xs], color=roof_color, lw=1.8, label=roof_label
    )
    ax.axvline(ridge, color=roof_color, ls=":", lw=1)
    if annotate:
        ax.annotate(
            f"ridge {ridge:.0f} FLOP/B",
            (ridge, peak),
            xytext=(4, 5),
            textcoords="offset points",
            fontsize=8.5,
            color=roof_color,
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per byte moved)")
    ax.set_ylabel("achieved FLOP/s")
    if points:
        for phase, marker in (("prefill", "o"), ("decode", "^")):
            pts = [p for p in result["points"] if p["phase"] == phase]
            if pts:
                _roofline_points(ax, pts, phase, marker, color or COLORS[phase], name, annotate)
    return ax


def _roofline_points(
    ax, pts: list[dict], phase: str, marker: str, color: str, name: str, annotate: bool
) -> None:
    """One phase's measured points, each labelled T= (prompt length) or B= (batch; L= context if
    several)."""
    ax.scatter(
        [p["intensity"] for p in pts],
        [p["flops_per_s"] for p in pts],
        marker=marker,
        s=40,
        color=color,
        zorder=3,
        label=f"{phase} ({name})",
    )
    if not annotate:
        return
    several_contexts = len({q["context"] for q in pts}) > 1
    for p in pts:
        text = f"T={p['tokens']}" if phase == "prefill" else f"B={p['batch']}"
        if phase == "decode" and several_contexts:
            text += f", L={p['context']}"
        offset = (-6, 6) if phase == "prefill" else (6, -11)  # prefill labels above, decode below
        ax.annotate(
            text,
            (p["intensity"], p["flops_per_s"]),
            xytext=offset,
            textcoords="offset points",
            fontsize=7.5,
            color=color,
            ha="right" if phase == "prefill" else "left",
        )


def png_bytes(fig) -> bytes:
    """``fig`` as PNG bytes (what an explorer's Image widget shows), then closed."""
    import io

    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()
