"""The course's plotting style and the few plot helpers several chapters share."""

from __future__ import annotations

import matplotlib as mpl
import torch

from ar_lab.tokenizer import EOS_ID

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


def plot_distribution(ax, probs: torch.Tensor, top: int = 20, kept: torch.Tensor | None = None, title: str = ""):
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
