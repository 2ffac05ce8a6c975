"""Weights in the layout a product of a few rows reads fastest (the multi-token pass of
``LeanGPT.extend``).

The verify pass of speculative decoding multiplies gamma + 1 rows by every weight matrix. Reading
each matrix once should make that cost about one decode step (chapter 07), plus the arithmetic of
the rows where it does not overlap the reads; on a CPU a float32 product of a few rows by
nn.Linear's (out, in) weight comes much closer to that after a change of layout. On a CPU with
oneDNN, ``product_copy`` reorders a large matrix once into oneDNN's blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, then ``torch.ops.mkldnn._linear_pointwise``: private
PyTorch operators, so ``packs`` checks they exist); elsewhere, and for small matrices, it makes an
(in, out) copy, which MKL multiplies faster than (out, in) for a few rows. ``python -m ar_lab.bench
selfspec`` measures the pass in decode steps with each.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ar_lab.engine.quant import QuantizedLinear, quantized_addmm


class Packed(NamedTuple):
    """A float32 weight (out, in) reordered once into oneDNN's blocked layout (a CPU kernel's own
    format)."""

    weight: torch.Tensor  # layout torch._mkldnn: only oneDNN's linear kernel reads it


# An operand of extend's products: an (in, out) tensor, a Packed weight, or a QuantizedLinear (its
# own kernel).
ExtendMatrix = torch.Tensor | Packed | QuantizedLinear


def extend_mm(bias: torch.Tensor | None, x: torch.Tensor, w: ExtendMatrix) -> torch.Tensor:
    """bias + x @ W for rows x (M, in), whatever form W takes (see ``ExtendMatrix``); (M, out)."""
    if type(w) is Packed:
        return torch.ops.mkldnn._linear_pointwise(x, w.weight, bias, "none", [], "")
    if bias is None:
        return x @ w if type(w) is not QuantizedLinear else w.addmm(None, x)
    return quantized_addmm(bias, x, w)


# Rows the packed layout is tuned for: a verify pass of speculative decoding (gamma + 1 of them); it
# serves any count.
_PACK_ROWS = 8
# The smallest matrix worth packing. oneDNN's call costs more than MKL's, which a small matrix does
# not win back: on the course model (matrices of at most 262,144 weights) a verify pass took 1.9
# decode steps packed, 1.3-1.9 as (in, out) copies; on the course model widened 3x (2.4 M) and 5x
# (6.6 M), 1.4-1.7 packed against 1.4-2.2.
PACK_MIN_WEIGHTS = 2**20


def packs(weight: torch.Tensor) -> bool:
    """True where ``extend_copies`` reorders ``weight`` for oneDNN: a float32 matrix of at least
    ``PACK_MIN_WEIGHTS`` weights, on a CPU whose PyTorch has oneDNN."""
    return (
        weight.numel() >= PACK_MIN_WEIGHTS
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def product_copy(m: torch.Tensor | QuantizedLinear, *, pack: bool = True) -> ExtendMatrix:
    """What ``extend_mm`` multiplies by for the weight ``m`` (out, in): a ``Packed`` copy where
    ``pack`` and ``packs(m)``, else an (in, out) copy; a ``QuantizedLinear`` itself (its kernel
    reads its buffers: no copy)."""
    if type(m) is QuantizedLinear:
        return m  # its kernel reads the module's buffers at each call: no copy
    w = m.detach()
    if pack and packs(w):
        return Packed(torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), _PACK_ROWS))
    return w.t().contiguous()


