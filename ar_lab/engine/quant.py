"""Fewer bytes per token: weights stored in 8 or 4 bits, and what the roofline predicts from it.

A batch-1 decode step is memory-bound (chapter 05): it reads every weight once to produce one token,
so its time is about bytes read / bandwidth. Storing each weight in fewer bits cuts the bytes; the
roofline then predicts the speedup as a ratio of bytes.

**The teaching representation** (``QuantizedTensor``): integers ``q`` and float32 scales, with
weight ~= q x scale.

- ``quantize_int8``: symmetric, one scale per output row, scale = max|row| / 127, q = round(w /
  scale) in [-127, 127] (-128 is left out so that the range is symmetric).
- ``quantize_int4``: symmetric, one scale per row and group of ``group_size`` consecutive input
  columns, scale = max|group| / 7, q = round(w / scale) in [-7, 7] (stored unpacked, as int8). The
  int4 range is [-8, 7]: max / 7 maps the largest weight of the group to +-7, so no weight is ever
  clipped and every error stays within scale / 2; max / 8 would use the level -8 but clip the
  group's largest positive weight by up to a whole step.
- An all-zero row or group gets scale 1 (any positive scale gives exact zeros; 0 would divide by
  zero). Rounding to the nearest level is why |w - q x scale| <= scale / 2 for every weight.

**The fast path** (``QuantizedLinear``): a drop-in for ``nn.Linear`` that keeps only the narrow
weights, in the layout of PyTorch's CPU kernels, and multiplies with them directly:
``torch.ops.aten._weight_int8pack_mm`` (int8 rows, one scale each) and
``_weight_int4pack_mm_for_cpu`` (two 4-bit values per byte, made by
``_convert_weight_to_int4pack_for_cpu``; dequantizes (q - 8) x scale + zero per group, with zero = 0
for our symmetric values; group sizes 32, 64, 128 or 256 only, and output rows a multiple of 16).
What was found when measuring them on a CPU without AVX-512 (the figures are ``python -m
ar_lab.bench quant``'s):

- both are correct against ``dequantize()`` followed by a float32 matrix product, within bfloat16
  rounding;
- both are fast only with **bfloat16 activations and scales**: with float32 activations they take a
  slow path several times slower than float32 ``addmv``. So a quantized layer casts its input to
  bfloat16, keeps its scales in bfloat16 (what the kernel reads), and returns float32 (LayerNorms,
  attention and the residual stream stay float32);
- one row of an M-row product equals the one-row product bit for bit, so the cached decode step and
  the multi-token verify pass of speculative decoding compute the same thing;
- on small matrices (the course model) they about match float32; on matrices that stream from main
  memory they beat it, though by less than the bytes ratio predicts: per byte they stream more
  slowly than float32's product on the same core (their own work per byte: widening, scaling,
  unpacking), which ``ar_lab.bench.quant.kernels_from_memory`` measures. ``_dyn_quant_matmul_4bit``
  targets ARM CPUs and is not used.

Embeddings, LayerNorms and biases stay float32: the tied output projection reads the token embedding
(vocab x C), which is small next to the blocks here, and the blocks' four Linear layers (qkv,
attention output, MLP in and out) hold almost every byte. ``bytes_per_token`` counts what a decode
step actually reads, layer by layer, as stored.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import nn

from ar_lab.base.errors import BadType, BadValue
from ar_lab.model.gpt import GPT
from ar_lab.model.moe import MoE

WEIGHT_FORMATS = ("fp32", "bf16", "int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what _weight_int4pack_mm_for_cpu accepts
_KERNEL_DTYPE = torch.bfloat16  # activations and scales of the fast kernels (their fast path)


@dataclass(frozen=True)
class QuantizedTensor:
    """A weight matrix as integers and scales: weight ~= q x scale (per row, or per row and
    group)."""

    q: torch.Tensor  # (out, in) int8: in [-127, 127] (8 bits) or [-8, 7] (4 bits)
    scale: torch.Tensor  # float32: (out,) for int8, (out, in // group_size) for int4
    bits: int  # 8 or 4
    group_size: int | None  # consecutive input columns sharing a scale (None: the whole row)

    def __post_init__(self) -> None:
        """Refuse what no format here stores: the layer would pack it as something else without a
        word."""
        q, scale, bits, group = self.q, self.scale, self.bits, self.group_size
        if isinstance(bits, bool) or bits not in (8, 4):
            raise BadValue(f"bits must be 8 or 4 (int8 or int4), got {bits!r}", arg="bits")
        if not isinstance(q, torch.Tensor) or q.dtype != torch.int8 or q.ndim != 2:
            what = (
                f"{q.dtype} of shape {tuple(q.shape)}"
                if isinstance(q, torch.Tensor)
                else type(q).__name__
            )
            raise BadValue(f"q must be a 2-D (out, in) int8 tensor, got {what}", arg="q")
        out, n_in = q.shape
        if bits == 8 and group is not None:
            raise BadValue(
                f"int8 uses one scale per row: group_size must be None, got {group!r}",
                arg="group_size",
            )
        if bits == 4:
            check_group_size(group, n_in)
            low, high = int(q.min()), int(q.max())
            if low < -8 or high > 7:
                raise BadValue(
                    f"int4 values must lie in [-8, 7], got q in [{low}, {high}]", arg="q"
                )
        want = (out,) if bits == 8 else (out, n_in // group)
        if (
            not isinstance(scale, torch.Tensor)
            or not scale.is_floating_point()
            or tuple(scale.shape) != want
        ):
            what = (
                f"{scale.dtype} of shape {tuple(scale.shape)}"
                if isinstance(scale, torch.Tensor)
                else repr(scale)
            )
            raise BadValue(
                f"scale must be a floating-point tensor of shape {want} for these q, got {what}",
                arg="scale",
            )
        if not bool((scale > 0).all()) or not bool(torch.isfinite(scale).all()):
            raise BadValue(
                "scale must hold finite positive values (max|w| / levels; 1 for an all-zero row "
                "or group)",
                arg="scale",
            )

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix (out, in) the integers stand for: q x scale, the scale broadcast per
        row/group."""
        out, n_in = self.q.shape
        if self.group_size is None:
            return self.q.float() * self.scale[:, None]
        # (out, groups, group_size)
        groups = self.q.float().view(out, n_in // self.group_size, self.group_size)
        return (groups * self.scale[:, :, None]).view(out, n_in)

    @property
    def nbytes(self) -> int:
        """Bytes of the packed weights (int4: two per byte) plus the scales at their stored
        dtype."""
        weights = self.q.numel() if self.bits == 8 else math.ceil(self.q.numel() / 2)
        return weights + self.scale.numel() * self.scale.element_size()


def dequantize(qt: QuantizedTensor) -> torch.Tensor:
    """``qt.dequantize()``: the float32 matrix (out, in) that ``qt`` stands for."""
    if not isinstance(qt, QuantizedTensor):
        raise BadType(
            "dequantize(qt) takes a QuantizedTensor (from quantize_int8 / quantize_int4), got "
            f"{type(qt).__name__}",
            arg="qt",
        )
    return qt.dequantize()


# arg: the caller's argument it came from
def check_weight(weight, arg: str = "weight") -> torch.Tensor:
    name = {"weight": "weight", "linear": "linear.weight"}.get(arg, f"a weight of {arg}")
    if not isinstance(weight, torch.Tensor):
        raise BadType(f"{name} must be a torch.Tensor, got {type(weight).__name__}", arg=arg)
    if weight.ndim != 2:
        raise BadValue(
            f"{name} must be a 2-D (out, in) matrix, got shape {tuple(weight.shape)}", arg=arg
        )
    if not weight.is_floating_point():
        raise BadValue(f"{name} must hold floating-point values, got {weight.dtype}", arg=arg)
    w = weight.detach().float()
    if not bool(torch.isfinite(w).all()):
        raise BadValue(f"{name} holds NaN or inf values: a scale cannot represent them", arg=arg)
    return w


def absmax_scales(absmax: torch.Tensor, levels: int) -> torch.Tensor:
    """absmax / levels, with 1 where that is 0 (an all-zero row or group, or one too small to
    divide). A NaN or inf absmax stays: the vector then dequantizes to NaN, never to a finite
    stand-in."""
    scale = absmax / levels
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def absmax_quantize(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric quantization along the last dimension: scale = max|x| / levels (1 where that is 0),
    q = round(x / scale) in [-levels, levels] as int8. Returns q (same shape) and scale (one fewer
    dim). The one rule behind int8 weights (levels 127), int4 groups (7) and the int8 KV cache."""
    scale = absmax_scales(x.abs().amax(dim=-1), levels)
    return torch.round(x / scale[..., None]).clamp_(-levels, levels).to(torch.int8), scale


def quantize_int8(weight: torch.Tensor) -> QuantizedTensor:
    """Symmetric int8, one scale per output row: scale = max|row| / 127, q = round(w / scale)."""
    q, scale = absmax_quantize(check_weight(weight), 127)  # (out, in), (out,)
    return QuantizedTensor(q, scale, 8, None)


def check_group_size(group_size, n_in: int) -> int:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise BadValue(f"group_size must be a positive int, got {group_size!r}", arg="group_size")
    if n_in % group_size:
        raise BadValue(
            f"group_size must divide the layer's {n_in} input columns, got {group_size}",
            arg="group_size",
        )
    return group_size


def quantize_int4(weight: torch.Tensor, group_size: int = 32) -> QuantizedTensor:
    """Symmetric int4, one scale per row and group of ``group_size`` input columns: scale =
    max|group| / 7."""
    w = check_weight(weight)
    out, n_in = w.shape
    check_group_size(group_size, n_in)
    # (out, groups, size), (out, groups)
    q, scale = absmax_quantize(w.view(out, n_in // group_size, group_size), 7)
    return QuantizedTensor(q.view(out, n_in), scale, 4, group_size)


def _quantize(weight: torch.Tensor, bits, group_size, arg: str = "weight") -> QuantizedTensor:
    weight = check_weight(weight, arg)  # ``arg``: the caller's argument the weight came from
    if bits == 8 and not isinstance(bits, bool):
        if group_size is not None:
            raise BadValue(
                f"int8 uses one scale per row: group_size must be None, got {group_size!r}",
                arg="group_size",
            )
        return quantize_int8(weight)
    if bits == 4 and not isinstance(bits, bool):
        return quantize_int4(weight, 32 if group_size is None else group_size)
    raise BadValue(f"bits must be 8 or 4, got {bits!r}", arg="bits")


@dataclass(frozen=True)
class QuantizationError:
    """How far dequantize(quantize(w)) is from w."""

    max_abs: float  # the largest |w - w'| of any weight
    rms: float  # root mean square of w - w'
    relative_rms: float  # rms / (root mean square of w); 0 for an all-zero weight


def error_between(weight: torch.Tensor, approx: torch.Tensor) -> QuantizationError:
    """How far ``approx`` (a dequantized matrix) is from ``weight``: the figures
    ``QuantizationError`` holds."""
    diff = weight - approx
    rms = float(diff.square().mean().sqrt())
    norm = float(weight.square().mean().sqrt())
    return QuantizationError(float(diff.abs().max()), rms, rms / norm if norm > 0 else 0.0)


def quantization_error(
    weight: torch.Tensor, bits: int, group_size: int | None = None
) -> QuantizationError:
    """The error of quantizing ``weight`` to ``bits`` (8: per row; 4: per group, ``group_size`` 32
    by default)."""
    w = check_weight(weight)
    return error_between(w, _quantize(w, bits, group_size).dequantize())


# --- the fast path: a Linear layer that multiplies with the narrow weights ---------------


def _int4_nibble_sources(n_out: int, n_in: int) -> torch.Tensor:
    """For each 4-bit slot of the CPU kernel's packed layout (low nibble of each byte first), the
    flat index (row x in + column) of the weight it holds. The layout is the packer's own business:
    it is found by packing the base-16 digits of every weight's index and reading them back."""
    index = torch.arange(n_out * n_in, dtype=torch.int64)
    source = torch.zeros_like(index)
    for d in range(max(1, math.ceil(math.log(n_out * n_in, 16)))):
        digit = ((index >> (4 * d)) & 15).to(torch.int32).view(n_out, n_in)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(digit, 2)
        source |= torch.stack([packed & 15, packed >> 4], dim=-1).flatten().long() << (4 * d)
    return source


class QuantizedLinear(nn.Module):
    """``nn.Linear`` with int8 or int4 weights in the CPU kernels' layout; the input and output stay
    float32.

    Buffers (what a forward pass reads): int8: ``qweight`` (out, in) int8 and ``scales`` (out,)
    bfloat16; int4: ``qweight`` (out, in / 2) uint8, two values per byte, and ``scales_and_zeros``
    (in / group_size, out, 2) bfloat16 (zeros all 0: symmetric). ``quantized()`` gives them back as
    a ``QuantizedTensor``. Every call reads the buffers as they are now, so an edit is seen.
    """

    def __init__(self, qt: QuantizedTensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if not isinstance(qt, QuantizedTensor):
            raise BadType(
                f"QuantizedLinear takes a QuantizedTensor qt, got {type(qt).__name__}", arg="qt"
            )
        if bias is not None and (
            not isinstance(bias, torch.Tensor)
            or not bias.is_floating_point()
            or tuple(bias.shape) != (qt.shape[0],)
        ):
            what = (
                f"shape {tuple(bias.shape)}, {bias.dtype}"
                if isinstance(bias, torch.Tensor)
                else type(bias).__name__
            )
            raise BadValue(
                f"bias must be None or a floating-point tensor of shape ({qt.shape[0]},), got "
                f"{what}",
                arg="bias",
            )
        self.out_features, self.in_features = qt.shape
        self.bits, self.group_size = qt.bits, qt.group_size
        if qt.bits == 8:
            self.register_buffer("qweight", qt.q.contiguous())
            self.register_buffer("scales", qt.scale.to(_KERNEL_DTYPE))
        else:
            _check_int4(qt)
            self.register_buffer(
                "qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(qt.q.int() + 8, 2)
            )
            scales = qt.scale.t()  # (groups, out)
            # (groups, out, 2)
            scales_and_zeros = torch.stack([scales, torch.zeros_like(scales)], dim=-1)
            self.register_buffer("scales_and_zeros", scales_and_zeros.to(_KERNEL_DTYPE))
        self.bias = (
            None
            if bias is None
            else nn.Parameter(bias.detach().float().clone(), requires_grad=False)
        )

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, bits: int, group_size: int | None = None
    ) -> QuantizedLinear:
        """``linear`` quantized to ``bits`` (8: per row; 4: per group of ``group_size``, default
        32)."""
        if not isinstance(linear, nn.Linear):
            raise BadType(f"linear must be an nn.Linear, got {type(linear).__name__}", arg="linear")
        qt = _quantize(linear.weight, bits, group_size, arg="linear")
        _check_int4(qt, "linear")
        return cls(qt, linear.bias)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x (M, in) -> x @ weight.T (M, out) in bfloat16, without the bias: the kernel itself."""
        x = x.to(_KERNEL_DTYPE)
        if self.bits == 8:
            return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.qweight, self.group_size, self.scales_and_zeros
        )

    def addmv(
        self, bias: torch.Tensor | None, x: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """bias + weight @ x for one vector x (in,), float32 (out,): what the lean decode step
        calls."""
        y = self.matmul(x[None])[0]  # (out,) bfloat16
        if bias is None:
            return y.float() if out is None else out.copy_(y)
        return torch.add(bias, y, out=out) if out is not None else torch.add(bias, y)

    def addmm(self, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
        """bias + x @ weight.T for rows x (M, in), float32 (M, out): what the lean multi-token pass
        calls."""
        y = self.matmul(x)
        return y.float() if bias is None else torch.add(bias, y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_floating_point() or x.shape[-1:] != (self.in_features,):
            raise BadValue(
                f"x must be floating-point activations (..., {self.in_features}), "
                f"got {x.dtype} of shape {tuple(x.shape)}", arg="x"
            )
        y = self.addmm(self.bias, x.reshape(-1, self.in_features))  # (B T, out)
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def _apply(self, fn, recurse: bool = True):
        """A cast of the model around the layer (``model.to(torch.bfloat16)``, ``.half()``,
        ``.double()``) leaves the layer's own dtypes as its kernels need them (bfloat16 scales,
        float32 bias; its output follows its input's dtype); a move of device moves them with the
        narrow weights."""
        scales = {
            name: self._buffers.pop(name)
            for name in ("scales", "scales_and_zeros")
            if name in self._buffers
        }
        bias = self._parameters.pop("bias", None)
        try:
            super()._apply(fn, recurse)
        finally:
            device = self.qweight.device
            self._buffers.update({name: t.to(device) for name, t in scales.items()})
            if bias is not None and bias.device != device:
                bias.data = bias.data.to(device)
            self._parameters["bias"] = bias
        return self

    def quantized(self) -> QuantizedTensor:
        """The layer's weights as a ``QuantizedTensor`` (int8 values unpacked; scales as stored, in
        float32)."""
        if self.bits == 8:
            return QuantizedTensor(self.qweight.clone(), self.scales.float(), 8, None)
        n_out, n_in = self.out_features, self.in_features
        nibbles = torch.stack([self.qweight & 15, self.qweight >> 4], dim=-1).flatten()
        q = torch.empty(n_out * n_in, dtype=torch.int8)
        q[_int4_nibble_sources(n_out, n_in)] = nibbles.to(torch.int8) - 8
        return QuantizedTensor(
            q.view(n_out, n_in), self.scales_and_zeros[..., 0].t().float(), 4, self.group_size
        )

    @property
    def nbytes(self) -> int:
        """Bytes of everything the layer reads per call: narrow weights, scales (and zeros),
        bias."""
        return sum(t.nbytes for t in self.buffers()) + (
            0 if self.bias is None else self.bias.nbytes
        )

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.group_size else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}"
            f"{group}"
        )


def _check_int4(qt: QuantizedTensor, arg: str = "qt") -> None:
    """What the int4 CPU kernel takes (int8: nothing); ``arg``: the caller's argument ("qt",
    "linear", "model")."""
    if qt.bits != 4:
        return
    group, group_arg = ("qt.group_size", "qt") if arg == "qt" else ("group_size", "group_size")
    if qt.group_size not in INT4_GROUP_SIZES:
        raise BadValue(
            f"the int4 CPU kernel takes {group} {INT4_GROUP_SIZES}, got {qt.group_size}",
            arg=group_arg,
        )
    rows = {"qt": "qt.shape[0]", "linear": "linear.out_features"}.get(arg, f"a layer of {arg}")
    if qt.shape[0] % 16:
        raise BadValue(
            f"the int4 CPU kernel needs the layer's output rows ({rows}) to be a multiple of 16, "
            f"got {qt.shape[0]}",
            arg=arg,
        )
    if qt.q.device.type != "cpu":
        raise BadValue(
            f"QuantizedLinear runs PyTorch's CPU kernels: quantize on the CPU, got {arg} on "
            f"{qt.q.device}",
            arg=arg,
        )


def quantized_addmv(
    bias: torch.Tensor, weight, x: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``torch.addmv(bias, weight, x)`` where ``weight`` may be a ``QuantizedLinear`` (its kernel
    then runs)."""
    if type(weight) is QuantizedLinear:
        return weight.addmv(bias, x, out)
    return torch.addmv(bias, weight, x, out=out)


def quantized_addmm(bias: torch.Tensor, x: torch.Tensor, weight_t) -> torch.Tensor:
    """``torch.addmm(bias, x, weight_t)`` where ``weight_t`` may be a ``QuantizedLinear`` (standing
    for its own transpose: its kernel takes rows x and returns x @ weight.T)."""
    if type(weight_t) is QuantizedLinear:
        return weight_t.addmm(bias, x)
    return torch.addmm(bias, x, weight_t)


def bf16_addmv(
    bias: torch.Tensor, weight: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None = None
):
    """bias + weight @ x as ``mv`` then ``add``: on a CPU, bfloat16 ``addmv`` takes a slow path that
    ``mv`` does not (``python -m ar_lab.bench quant`` shows the gap), so a bfloat16 model's lean
    step uses this."""
    y = torch.mv(weight, x)
    return y.add_(bias) if out is None else torch.add(y, bias, out=out)


# --- whole models --------------------------------------------------------------------------


def _block_linears(model: GPT) -> list[tuple[nn.Module, str]]:
    """(parent module, attribute) of the Linear layers of every block: attention's two, the MLP's
    two or every expert's (a mixture's router stays in full precision: its logits pick the
    experts, and it is a sliver of the weights)."""
    out = []
    for b in model.blocks:
        mlps = b.mlp.experts if isinstance(b.mlp, MoE) else [b.mlp]
        out += [(b.attn, "qkv"), (b.attn, "proj")] + [(m, n) for m in mlps for n in ("fc", "proj")]
    return out


def _copy(model: GPT, replace: dict[int, nn.Parameter]) -> GPT:
    """A deep copy of ``model`` in which each parameter whose id is in ``replace`` becomes that
    value (never copied first: a large model is not held twice in full precision)."""
    return copy.deepcopy(model, memo=dict(replace))


def _own_quantized(quantizer, weight: torch.Tensor, bits: int, size: int | None) -> QuantizedTensor:
    """A quantizer of one's own on one weight: ``quantizer(w)`` (int8) or ``quantizer(w,
    group_size)`` (int4) on a float32 copy of it, its ``(q, scale)`` checked as ``QuantizedTensor``
    checks them."""
    # a copy: a quantizer that writes into its input leaves the model alone
    w = check_weight(weight, "model").clone()
    answer = quantizer(w) if bits == 8 else quantizer(w, size)
    if not (isinstance(answer, tuple) and len(answer) == 2):
        raise BadValue(
            f"the quantizer must return (q, scale), got {type(answer).__name__}", arg="quantizer"
        )
    q, scale = answer
    try:
        return QuantizedTensor(
            q, scale.float() if isinstance(scale, torch.Tensor) else scale, bits, size
        )
    except ValueError as e:
        raise BadValue(
            f"the quantizer's answer for a {tuple(w.shape)} weight: {e}", arg="quantizer"
        ) from None


def quantize_model(
    model: GPT, *, weights: str, group_size: int | None = None, quantizer=None
) -> GPT:
    """A NEW model with the blocks' weights stored as ``weights``; ``model`` is left untouched.

    ``"fp32"``: a float32 copy. ``"bf16"``: every parameter cast to bfloat16 (the whole model then
    computes in bfloat16, its KV cache too). ``"int8"`` / ``"int4"``: every Linear layer of every
    block (qkv, attention output, MLP in and out) becomes a ``QuantizedLinear`` (int4: one scale per
    ``group_size`` input columns, 32 by default; one of 32, 64, 128, 256); embeddings (the tied
    output head included), LayerNorms and biases stay float32. The copy runs through
    ``ar_lab.generate`` (lean or not) and ``speculative_generate`` as any GPT does. ``quantizer``: a
    function of one's own in place of ``quantize_int8`` / ``quantize_int4`` (chapter 09's learner
    passes theirs): ``quantizer(w) -> (q, scale)`` for int8, ``quantizer(w, group_size) -> (q,
    scale)`` for int4.
    """
    if not isinstance(model, GPT):
        raise BadType(f"quantize_model takes a GPT, got {type(model).__name__}", arg="model")
    if weights not in WEIGHT_FORMATS:
        raise BadValue(
            f"weights must be one of {', '.join(map(repr, WEIGHT_FORMATS))}, got {weights!r}",
            arg="weights",
        )
    if group_size is not None and weights != "int4":
        raise BadValue(
            f"group_size applies to int4 only (weights={weights!r} has none), got {group_size!r}",
            arg="group_size",
        )
    if quantizer is not None and (weights not in ("int8", "int4") or not callable(quantizer)):
        raise BadValue(
            "quantizer must be a function (w -> (q, scale)), for weights 'int8' or 'int4': "
            f"{quantizer!r}", arg="quantizer"
        )
    linears = _block_linears(model)
    if any(isinstance(getattr(m, name), QuantizedLinear) for m, name in linears):
        raise BadValue(
            "this model is already quantized: quantize the full-precision model instead",
            arg="model",
        )
    if weights in ("fp32", "bf16"):
        dtype = torch.float32 if weights == "fp32" else torch.bfloat16
        # copy=True: a float32 model's "fp32" copy must not share storage with it (edits would reach
        # both).
        cast = {
            id(p): nn.Parameter(p.detach().to(dtype, copy=True), p.requires_grad)
            for p in model.parameters()
        }
        return _copy(model, cast)
    if model.device.type != "cpu":
        raise BadValue(
            "int8 and int4 layers run PyTorch's CPU kernels: move the model to the CPU first "
            f"(it is on {model.device})", arg="model"
        )
    bits, size = (8, None) if weights == "int8" else (4, 32 if group_size is None else group_size)
    if bits == 4 and size not in INT4_GROUP_SIZES:
        raise BadValue(
            f"group_size must be one the int4 CPU kernel takes, {INT4_GROUP_SIZES}, got {size!r}",
            arg="group_size",
        )
    placeholder = nn.Parameter(torch.empty(0), requires_grad=False)  # replaced below, never copied
    weights_ids = {id(getattr(m, name).weight) for m, name in linears}
    # The rest stays (or becomes) float32, whatever the model computed in: the residual stream the
    # kernels expect.
    params = [
        p for p in model.parameters() if id(p) not in weights_ids and p.dtype != torch.float32
    ]
    cast = {id(p): nn.Parameter(p.detach().float(), p.requires_grad) for p in params}
    new = _copy(model, {**cast, **dict.fromkeys(weights_ids, placeholder)})
    for (old_parent, name), (parent, _) in zip(linears, _block_linears(new), strict=True):
        weight = getattr(old_parent, name).weight
        if quantizer is None:
            qt = _quantize(weight, bits, size, arg="model")  # checks that size divides the columns
        else:
            qt = _own_quantized(quantizer, weight, bits, None if bits == 8 else size)
        _check_int4(qt, "model")
        setattr(parent, name, QuantizedLinear(qt, getattr(parent, name).bias))
    return new
