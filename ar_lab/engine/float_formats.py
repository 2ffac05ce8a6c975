"""Weights as small floats: FP8 (E4M3, E5M2) and 4-bit floats with block scales (MXFP4, NVFP4).

Integers space their levels evenly; a float's levels are dense near zero and sparse far from it,
which suits weights (most are small, a few large). Current GPUs multiply these formats in their
tensor cores (FP8 from Hopper and MI300, FP4 from Blackwell), so a kernel reads them without
widening them first. This CPU has no such units: here they are *fake-quantized* (each weight
rounded to the nearest value the format holds, then computed with in float32), which measures what
a format costs in quality, not what it saves in time.

- **FP8** (``fp8``): E4M3 (4 exponent bits, 3 mantissa bits, largest 448, no infinities: PyTorch's
  ``float8_e4m3fn``) or E5M2 (largest 57,344, one mantissa bit fewer). A scale per output row maps
  the row's largest |w| to the format's largest value, as FP8 checkpoints store weights ("per
  channel"); the cast rounds to nearest, ties to even.
- **E2M1**, the 4-bit float (``round_e2m1``): the values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their
  negatives (OCP Microscaling Formats (MX) v1.0, section 5.3.3). A block of weights shares a scale.
- **MXFP4** (``mxfp4``, OCP MX v1.0, section 6.3): blocks of 32 along the input dimension, the
  shared scale a power of two stored in 8 bits (E8M0): X = 2^(floor(log2 max|v|) - 2), 2 being
  E2M1's largest exponent; v / X is rounded to E2M1, and the few values that land above 6 saturate
  to 6. 4 + 8/32 = 4.25 bits a weight. gpt-oss ships its MoE weights in it.
- **NVFP4** (``nvfp4``, NVIDIA's Blackwell format): blocks of 16, each scale an E4M3 number (finer
  than a power of two), so a block's largest |v| maps to 6 up to E4M3's rounding; and one float32
  scale for the whole tensor, which keeps the block scales inside E4M3's range. 4 + 8/16 = 4.5 bits
  a weight.

``formats_compared`` sets them beside the course's integers (int8 per row, int4 in groups of 32 with
a 16-bit scale: 4.5 bits a weight) at their bits per weight.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch

from ar_lab.base.errors import BadType, BadValue
from ar_lab.engine.quant import check_weight, quantize_int4, quantize_int8
from ar_lab.model.gpt import GPT

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FORMATS = ("int8", "fp8 e4m3", "fp8 e5m2", "int4", "nvfp4", "mxfp4")


@dataclass(frozen=True)
class Rounded:
    """A weight as a format stores it, given back in float32, and the bits a weight costs in that
    format (values and scales together)."""

    values: torch.Tensor
    bits_per_weight: float


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """x rounded to the nearest E2M1 value (ties to the even mantissa), saturating at +-6."""
    grid = torch.tensor(E2M1_VALUES, dtype=x.dtype)
    a = x.abs().clamp(max=6.0)
    # the two neighbours of each |x| on the grid, then the nearer one
    hi = torch.bucketize(a, grid).clamp(max=len(E2M1_VALUES) - 1)
    lo = (hi - 1).clamp(min=0)
    down, up = grid[lo], grid[hi]
    tie = (a - down) == (up - a)
    # even mantissa: 0, 1, 2, 4, 6 ... (the grid's even indices hold mantissa 0)
    pick_up = torch.where(tie, hi % 2 == 0, (up - a) < (a - down))
    return torch.where(pick_up, up, down).copysign(x)


def _blocks(w: torch.Tensor, block: int) -> torch.Tensor:
    out, n_in = w.shape
    if n_in % block:
        raise BadValue(
            f"the format's block of {block} must divide the weight's {n_in} input columns",
            arg="weight",
        )
    return w.view(out, n_in // block, block)


def fp8(weight: torch.Tensor, kind: str = "e4m3") -> Rounded:
    """FP8 with one float32 scale per output row (row max -> the format's largest value)."""
    if kind not in FP8:
        raise BadValue(f"kind must be one of {sorted(FP8)}, got {kind!r}", arg="kind")
    w = check_weight(weight)
    top = torch.finfo(FP8[kind]).max
    scale = w.abs().amax(1, keepdim=True) / top
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    values = (w / scale).to(FP8[kind]).float() * scale
    return Rounded(values, 8 + 32 / w.shape[1])


def mxfp4(weight: torch.Tensor, block: int = 32) -> Rounded:
    """MXFP4: E2M1 values in blocks of ``block`` sharing a power-of-two (E8M0) scale."""
    w = check_weight(weight)
    v = _blocks(w, block)
    top = v.abs().amax(-1, keepdim=True)
    exponent = torch.floor(torch.log2(torch.where(top == 0, torch.ones_like(top), top))) - 2
    scale = torch.exp2(exponent.clamp(-127, 127))
    return Rounded((round_e2m1(v / scale) * scale).view_as(w), 4 + 8 / block)


def nvfp4(weight: torch.Tensor, block: int = 16) -> Rounded:
    """NVFP4: E2M1 values in blocks of ``block``, each with an E4M3 scale, under one float32 tensor
    scale."""
    w = check_weight(weight)
    v = _blocks(w, block)
    top = v.abs().amax(-1, keepdim=True)
    tensor_scale = float(top.max()) / (6 * torch.finfo(torch.float8_e4m3fn).max) or 1.0
    block_scale = (top / 6 / tensor_scale).to(torch.float8_e4m3fn).float() * tensor_scale
    block_scale = torch.where(block_scale == 0, torch.ones_like(block_scale), block_scale)
    return Rounded((round_e2m1(v / block_scale) * block_scale).view_as(w), 4 + 8 / block)


def rounded(weight: torch.Tensor, fmt: str) -> Rounded:
    """``weight`` in format ``fmt`` (one of ``FORMATS``)."""
    weight = check_weight(weight)
    if fmt == "int8":
        return Rounded(quantize_int8(weight).dequantize(), 8 + 16 / weight.shape[1])
    if fmt == "int4":
        return Rounded(quantize_int4(weight, 32).dequantize(), 4 + 16 / 32)
    if fmt.startswith("fp8 "):
        return fp8(weight, fmt.split()[1])
    if fmt in ("mxfp4", "nvfp4"):
        return (mxfp4 if fmt == "mxfp4" else nvfp4)(weight)
    raise BadValue(f"fmt must be one of {FORMATS}, got {fmt!r}", arg="fmt")


def rounded_model(model: GPT, fmt: str) -> GPT:
    """A NEW float32 model whose blocks' Linear weights hold the values format ``fmt`` can store
    (fake quantization: what the format costs in quality; its speed needs the hardware)."""
    from ar_lab.engine.calibrated import layer_names

    if not isinstance(model, GPT):
        raise BadType(f"model must be a GPT, got {type(model).__name__}", arg="model")
    new = copy.deepcopy(model).float()
    layers = dict(new.named_modules())
    with torch.no_grad():
        for name in layer_names(new):
            weight = layers[name].weight
            weight.copy_(rounded(weight, fmt).values)
    return new


def formats_compared(model: GPT, formats=FORMATS) -> dict[str, dict]:
    """Per format: bits per weight and the relative RMS error over all block weights
    (sqrt(sum (w' - w)^2 / sum w^2))."""
    from ar_lab.engine.calibrated import layer_names

    layers = dict(model.named_modules())
    found = {}
    for fmt in formats:
        err = total = bits = count = 0.0
        for name in layer_names(model):
            w = layers[name].weight.detach().float()
            r = rounded(w, fmt)
            err += float(((r.values - w) ** 2).sum())
            total += float((w**2).sum())
            bits, count = bits + r.bits_per_weight * w.numel(), count + w.numel()
        found[fmt] = {"bits_per_weight": bits / count, "relative_rms": math.sqrt(err / total)}
    return found
