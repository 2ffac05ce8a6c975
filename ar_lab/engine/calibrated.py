"""int4 weights that look at the data: GPTQ's error feedback and AWQ's activation-aware scales.

Round-to-nearest (``quantize_int4``) rounds every weight on its own. What a layer must preserve is
not its weights but its outputs, W x, on the inputs it actually sees; both methods here measure
those inputs first (``calibration_stats``: for every Linear layer of every block, the second-moment
matrix H = mean(x x^T) of its input rows and each input channel's mean |x|, on windows of text) and
then store the same format as round-to-nearest (``QuantizedTensor``: int4 in [-7, 7], one absmax
scale per row and group), so the quantized model runs the same kernels at the same speed.

The error a layer makes on its calibration inputs is ``output_error``: mean over rows of
||(W' - W) x||^2 = trace((W' - W) H (W' - W)^T), divided by the output rows.

**GPTQ** (Frantar et al. 2022, arXiv:2210.17323): quantize the columns of W one at a time, and
after each, move the columns not yet quantized so that they absorb its error on the calibration
inputs: the least-squares re-fit of the remaining columns given the fixed ones. With U the upper
Cholesky factor of H^-1, column i's error e = (w_i - q_i) / U_ii is fed back as W[:, i+1:] -= e
U[i, i+1:] (Optimal Brain Surgeon's update in the paper's Cholesky form). H is damped first, H +
damp * mean(diag H) * I (the paper's 1 %): without it a near-singular H gives huge updates, or no
factor at all. Columns are processed in blocks of 128 whose updates to later columns are applied
at once (the paper's lazy batch); a group's scale is taken when the group's first column is
reached, from the weights as the feedback has left them (the paper's code does the same, with
``static_groups=False``). Two choices of ours: inputs come from the full-precision model in one
pass (the paper's code feeds each block the quantized earlier blocks' outputs), and a channel the
calibration never activates keeps its rounded weights (the paper's code zeroes them).

**AWQ** (Lin et al. 2023, arXiv:2306.00978): the few input channels with large activations matter
most. Multiply W's input column c by s_c before quantizing, and divide the input x_c by s_c: the
product is unchanged in full precision, while the weights of the salient channels lose less to
rounding. s = (mean |x|)^alpha, normalised by sqrt(max s * min s), with alpha searched on a grid of
[0, 1) for the least output error of round-to-nearest; alpha = 0 is no scaling. The division never
runs at inference: it is folded into the operation that makes the input, exactly (``_fold``): a
norm's weight (and bias) for the attention's qkv and the MLP's first product; the value rows of qkv
for the attention's output projection (with grouped-query heads, one scale per KV head's dimension,
shared by its query heads); the up rows of a SwiGLU MLP for its down projection. A GELU MLP's
second product keeps scale 1 (GELU(x / s) is not GELU(x) / s; AWQ's code divides the activation's
output there instead, an extra operation). Then AWQ's second search (``clip_search``): each row's
group takes the clipping ratio of its absmax, in [0.5, 1], of least error on its own inputs, since
a slightly smaller scale rounds the many small weights finer at the cost of clipping the few large
ones. Alpha 0 and ratio 1 (round to nearest) are candidates of both searches, so neither chooses
worse than round to nearest on what it measures: the layer's output error for alpha, each group's
error on its own inputs for the ratio (which leaves out the groups' cross terms).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch

from ar_lab.base.errors import BadType, BadValue
from ar_lab.engine.quant import (
    INT4_GROUP_SIZES,
    QuantizedLinear,
    QuantizedTensor,
    absmax_scales,
    check_group_size,
    check_weight,
    quantize_int4,
    quantize_model,
)
from ar_lab.model.gpt import GPT

METHODS = ("rtn", "awq", "gptq")
LEVELS = 7  # int4 in [-7, 7], as quantize_int4 stores it


@dataclass(frozen=True)
class LayerStats:
    """What calibration measured at one Linear layer's input: H = mean over rows of x x^T (in, in)
    and each channel's mean |x| (in,), both float64, over ``rows`` input rows."""

    hessian: torch.Tensor
    mean_abs: torch.Tensor
    rows: int


def layer_names(model: GPT) -> list[str]:
    """The names of the Linear layers the methods quantize, in model order: qkv, attention output,
    MLP in and out of every block (``quantize_model`` quantizes the same ones)."""
    return [
        f"blocks.{i}.{part}"
        for i in range(len(model.blocks))
        for part in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
    ]


def calibration_windows(
    tokens: torch.Tensor | None = None, *, windows: int = 64, length: int = 512, seed: int = 0
) -> torch.Tensor:
    """``windows`` random windows of ``length`` tokens (windows, length) from ``tokens`` (default:
    the course corpus's training split, never its validation text), seeded."""
    from ar_lab.model.data import corpus_tokens, get_batch, train_val_split

    for name, value in (("windows", windows), ("length", length)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BadValue(f"{name} must be a positive int, got {value!r}", arg=name)
    if tokens is None:
        tokens = train_val_split(corpus_tokens())[0]
    if not isinstance(tokens, torch.Tensor) or tokens.ndim != 1 or tokens.is_floating_point():
        raise BadValue(
            "tokens must be a 1-D tensor of token ids (the calibration text), got "
            f"{tokens!r:.80}",
            arg="tokens",
        )
    if tokens.numel() < 2:
        raise BadValue(
            f"the calibration set is empty: tokens holds {tokens.numel()} token(s); give at least "
            "a window's worth of text",
            arg="tokens",
        )
    length = min(length, tokens.numel() - 1)
    g = torch.Generator().manual_seed(seed)
    return get_batch(tokens, windows, length, g)[0]


def _record_inputs(model: GPT, tokens, windows: int, length: int, record) -> None:
    """Run ``model`` once on calibration windows, calling ``record(name, rows)`` with each quantized
    layer's input rows (rows, in), in float32 as the model computes."""
    _check_model(model)
    x = calibration_windows(tokens, windows=windows, length=min(length, model.config.block_size))
    modules = dict(model.named_modules())

    def hook(name):
        return lambda _m, inputs, _out: record(name, inputs[0].detach().flatten(0, -2).float())

    handles = [modules[name].register_forward_hook(hook(name)) for name in layer_names(model)]
    try:
        with torch.inference_mode():
            model(x.to(model.device))
    finally:
        for h in handles:
            h.remove()


def _finite(stats: dict[str, LayerStats]) -> dict[str, LayerStats]:
    for name, s in stats.items():
        if not (bool(torch.isfinite(s.hessian).all()) and bool(torch.isfinite(s.mean_abs).all())):
            raise BadValue(
                f"non-finite activations reach {name} on the calibration text: the model's weights "
                "hold NaN or inf, or overflow; calibrate the model before editing it",
                arg="model",
            )
    return stats


def stats_of(rows: torch.Tensor) -> LayerStats:
    """H = mean x x^T and mean |x| per channel of input rows (rows, in), in float64."""
    x = rows.double()
    return LayerStats(x.T @ x / x.shape[0], x.abs().mean(0), x.shape[0])


def calibration_stats(
    model: GPT, tokens: torch.Tensor | None = None, *, windows: int = 64, length: int = 512
) -> dict[str, LayerStats]:
    """Run ``model`` on calibration windows (``calibration_windows``) and measure every quantized
    layer's input: {name: LayerStats}, accumulated without keeping the rows."""
    sums: dict[str, tuple] = {}

    def record(name, rows):  # products in float32 (4x faster), sums in float64
        h, a, n = sums.get(name, (0.0, 0.0, 0))
        sums[name] = (h + (rows.T @ rows).double(), a + rows.abs().double().sum(0),
                      n + rows.shape[0])

    _record_inputs(model, tokens, windows, length, record)
    return _finite({name: LayerStats(h / n, a / n, n) for name, (h, a, n) in sums.items()})


def _check_model(model) -> None:
    if not isinstance(model, GPT):
        raise BadType(f"model must be a GPT, got {type(model).__name__}", arg="model")
    if model.config.n_experts:
        raise BadValue(
            "calibrated quantization (GPTQ, AWQ) here covers dense MLPs; this model is a mixture "
            f"of {model.config.n_experts} experts: quantize it with quantize_model (round to "
            "nearest)",
            arg="model",
        )
    if any(isinstance(m, QuantizedLinear) for m in model.modules()):
        raise BadValue(
            "this model is already quantized: calibrate the full-precision model", arg="model"
        )


def _check_hessian(hessian, n_in: int) -> torch.Tensor:
    if not isinstance(hessian, torch.Tensor) or tuple(hessian.shape) != (n_in, n_in):
        what = tuple(hessian.shape) if isinstance(hessian, torch.Tensor) else type(hessian).__name__
        raise BadValue(
            f"hessian must be the ({n_in}, {n_in}) matrix mean(x x^T) of the layer's inputs "
            f"(LayerStats.hessian), got {what}",
            arg="hessian",
        )
    h = hessian.detach().double()
    if not bool(torch.isfinite(h).all()):
        raise BadValue(
            "hessian holds NaN or inf: the calibration activations were not finite", arg="hessian"
        )
    return h


def output_error(weight: torch.Tensor, approx: torch.Tensor, hessian: torch.Tensor) -> float:
    """Mean squared output error of ``approx`` in place of ``weight`` (out, in) on inputs with
    second moment ``hessian``: trace((W' - W) H (W' - W)^T) / out."""
    w = check_weight(weight).double()
    d = check_weight(approx, "approx").double() - w
    if d.shape != w.shape:
        raise BadValue(f"approx must have the weight's shape {tuple(w.shape)}", arg="approx")
    h = _check_hessian(hessian, w.shape[1])
    return float(((d @ h) * d).sum() / w.shape[0])


def _inverse_factor(h: torch.Tensor, damp: float) -> torch.Tensor:
    """U, the upper Cholesky factor of (H + damp * mean(diag H) * I)^-1, with a channel never
    activated (diag 0) given H_ii = 1 so that it neither feeds back nor receives."""
    if isinstance(damp, bool) or not isinstance(damp, (int, float)) or not damp >= 0:
        raise BadValue(f"damp must be a number >= 0 (GPTQ uses 0.01), got {damp!r}", arg="damp")
    h = h.clone()
    dead = h.diagonal() == 0
    h[dead, :] = 0
    h[:, dead] = 0
    h.diagonal()[dead] = 1
    h.diagonal().add_(damp * float(h.diagonal().mean()))
    factor, info = torch.linalg.cholesky_ex(h)
    if int(info):
        raise BadValue(
            f"H + damp * mean(diag H) * I is not positive definite with damp={damp}: the "
            "calibration inputs leave some direction unseen; raise damp (GPTQ uses 0.01)",
            arg="damp",
        )
    return torch.linalg.cholesky(torch.cholesky_inverse(factor), upper=True)


def gptq_quantize(
    weight: torch.Tensor, hessian: torch.Tensor, group_size: int = 32, *, damp: float = 0.01,
    block: int = 128,
) -> QuantizedTensor:
    """GPTQ: int4 (one absmax scale per row and ``group_size`` columns, as ``quantize_int4``) with
    each column's rounding error fed back to the columns after it through the inverse of the damped
    ``hessian`` (mean x x^T of the layer's inputs). See the module's docstring."""
    w = check_weight(weight).double()
    out, n_in = w.shape
    g = check_group_size(group_size, n_in)
    u = _inverse_factor(_check_hessian(hessian, n_in), damp)
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise BadValue(f"block must be a positive int, got {block!r}", arg="block")
    step = -(-block // g) * g  # whole groups in a block: a group's scale sees its own feedback
    q = torch.empty(out, n_in, dtype=torch.int8)
    scale = torch.empty(out, n_in // g, dtype=torch.float64)
    for b0 in range(0, n_in, step):
        b1 = min(b0 + step, n_in)
        part, errors = w[:, b0:b1].clone(), torch.empty(out, b1 - b0, dtype=torch.float64)
        for j in range(b1 - b0):
            i = b0 + j
            if i % g == 0:
                scale[:, i // g] = absmax_scales(part[:, j : j + g].abs().amax(1), LEVELS)
            s = scale[:, i // g]
            qi = torch.round(part[:, j] / s).clamp_(-LEVELS, LEVELS)
            q[:, i] = qi.to(torch.int8)
            errors[:, j] = (part[:, j] - qi * s) / u[i, i]
            part[:, j + 1 :] -= errors[:, j : j + 1] * u[i : i + 1, i + 1 : b1]
        w[:, b1:] -= errors @ u[b0:b1, b1:]  # the block's feedback to every later column at once
    return QuantizedTensor(q, scale.float(), 4, g)


@dataclass(frozen=True)
class AWQScale:
    """AWQ's search for one layer: the input-channel scales chosen (float32, (in,)), the exponent
    alpha they come from, and the output error at every alpha of the grid (alpha 0: round to
    nearest)."""

    scale: torch.Tensor
    alpha: float
    alphas: tuple[float, ...]
    errors: tuple[float, ...]

    @property
    def error(self) -> float:
        return self.errors[self.alphas.index(self.alpha)]


def awq_candidate(mean_abs: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = (mean |x|)^alpha, clamped away from 0 and normalised by sqrt(max s * min s)."""
    s = mean_abs.double().clamp(min=1e-4).pow(alpha)
    return (s / (s.max() * s.min()).sqrt()).float()


def awq_dequantized(weight: torch.Tensor, s: torch.Tensor, group_size: int) -> torch.Tensor:
    """The weight the layer computes with under AWQ scales s: Q(W diag(s)) diag(s)^-1."""
    return quantize_int4(weight * s[None, :], group_size).dequantize() / s[None, :]


def awq_search(
    weight: torch.Tensor, stats: LayerStats, group_size: int = 32, *, grid: int = 20
) -> AWQScale:
    """AWQ's per-input-channel scales for one layer: alpha in {0, 1/grid, ..., (grid-1)/grid}, the
    one of least ``output_error`` on the calibration statistics ``stats`` (ties: the smaller)."""
    w = check_weight(weight)
    if not isinstance(stats, LayerStats) or stats.mean_abs.shape != (w.shape[1],):
        raise BadValue(
            f"stats must be the LayerStats of this layer's {w.shape[1]} inputs "
            "(calibration_stats(model)[name])",
            arg="stats",
        )
    if isinstance(grid, bool) or not isinstance(grid, int) or grid < 1:
        raise BadValue(f"grid must be a positive int, got {grid!r}", arg="grid")
    check_group_size(group_size, w.shape[1])
    if not bool(torch.isfinite(stats.mean_abs).all()):
        raise BadValue("stats.mean_abs holds NaN or inf: non-finite activations", arg="stats")
    alphas = tuple(k / grid for k in range(grid))
    errors = tuple(
        output_error(w, awq_dequantized(w, awq_candidate(stats.mean_abs, a), group_size),
                     stats.hessian)
        for a in alphas
    )
    best = min(range(grid), key=lambda k: (errors[k], k))
    return AWQScale(awq_candidate(stats.mean_abs, alphas[best]), alphas[best], alphas, errors)


def clip_search(
    weight: torch.Tensor, hessian: torch.Tensor, group_size: int = 32, *, grid: int = 20,
    shrink: float = 0.5,
) -> QuantizedTensor:
    """int4 with AWQ's clipping: each row's group gets scale = ratio * max|group| / 7 (weights past
    it clip to +-7), the ratio in {1, ..., shrink} (``grid`` steps) of least error on the group's
    own inputs, w_g H_gg w_g^T with H_gg the group's block of ``hessian``."""
    w = check_weight(weight).double()
    out, n_in = w.shape
    g = check_group_size(group_size, n_in)
    h = _check_hessian(hessian, n_in)
    if isinstance(grid, bool) or not isinstance(grid, int) or grid < 1:
        raise BadValue(f"grid must be a positive int, got {grid!r}", arg="grid")
    if isinstance(shrink, bool) or not isinstance(shrink, (int, float)) or not 0 < shrink <= 1:
        raise BadValue(f"shrink must be a number in (0, 1], got {shrink!r}", arg="shrink")
    groups = w.view(out, n_in // g, g)
    blocks = torch.stack([h[k : k + g, k : k + g] for k in range(0, n_in, g)])  # (G, g, g)
    absmax = groups.abs().amax(-1)
    best = torch.full_like(absmax, math.inf)
    scale = absmax_scales(absmax, LEVELS)
    for k in range(grid):
        trial = absmax_scales(absmax * (1 - (1 - shrink) * k / grid), LEVELS)
        d = torch.round(groups / trial[..., None]).clamp_(-LEVELS, LEVELS) * trial[..., None]
        d -= groups
        error = torch.einsum("rgi,gij,rgj->rg", d, blocks, d)
        better = error < best
        best, scale = torch.where(better, error, best), torch.where(better, trial, scale)
    q = torch.round(groups / scale[..., None]).clamp_(-LEVELS, LEVELS).to(torch.int8)
    return QuantizedTensor(q.view(out, n_in), scale.float(), 4, g)


def scaled_hessian(stats: LayerStats, scale: torch.Tensor | None) -> torch.Tensor:
    """H of the inputs a layer sees once AWQ's scales divide them: x / s has H / (s s^T)."""
    if scale is None:
        return stats.hessian
    s = scale.double()
    return stats.hessian / (s[:, None] * s[None, :])


def _fold(model: GPT, scales: dict[str, torch.Tensor]) -> None:
    """Multiply each scaled layer's input columns by s and divide what makes its input by s, in
    place (see the module's docstring for where each division goes)."""
    cfg = model.config
    d, h, kv = cfg.head_dim, cfg.n_head, cfg.kv_heads
    with torch.no_grad():
        for i, block in enumerate(model.blocks):
            for name, layer in (("attn.qkv", block.attn.qkv), ("attn.proj", block.attn.proj),
                                ("mlp.fc", block.mlp.fc), ("mlp.proj", block.mlp.proj)):
                s = scales.get(f"blocks.{i}.{name}")
                if s is None:
                    continue
                layer.weight.mul_(s[None, :])
                if name in ("attn.qkv", "mlp.fc"):
                    norm = block.ln1 if name == "attn.qkv" else block.ln2
                    norm.weight.div_(s)
                    if getattr(norm, "bias", None) is not None:
                        norm.bias.div_(s)
                    continue
                if name == "attn.proj":  # value rows: s per (query head, dim), equal in a group
                    rows = slice((h + kv) * d, (h + 2 * kv) * d)
                    grouped = s.view(kv, h // kv, d)
                    if not torch.equal(grouped, grouped[:, :1].expand_as(grouped)):
                        raise BadValue(
                            f"the scales of {name} of block {i} differ between query heads that "
                            "share a KV head: one value row cannot be divided by both",
                            arg="scales",
                        )
                    s = grouped[:, 0].reshape(-1)
                    maker = block.attn.qkv
                else:
                    rows, maker = slice(cfg.hidden, 2 * cfg.hidden), block.mlp.fc
                maker.weight[rows].div_(s[:, None])
                if maker.bias is not None:
                    maker.bias[rows].div_(s)


def _foldable(model: GPT, name: str) -> bool:
    """Whether a division of this layer's input can be folded into the op before it."""
    return not (name.endswith("mlp.proj") and model.config.mlp != "swiglu")


def awq_scales(
    model: GPT, stats: dict[str, LayerStats], group_size: int = 32, *, grid: int = 20
) -> dict[str, AWQScale]:
    """AWQ's search for every layer whose input division folds (``_foldable``); the attention
    output's statistics pooled over the query heads of a KV group first, so that one scale serves
    the group's value rows."""
    cfg = model.config
    found = {}
    modules = dict(model.named_modules())
    for name in layer_names(model):
        if not _foldable(model, name):
            continue
        layer_stats = stats[name]
        if name.endswith("attn.proj") and cfg.kv_heads != cfg.n_head:
            shape = (cfg.kv_heads, cfg.n_head // cfg.kv_heads, cfg.head_dim)
            pooled = layer_stats.mean_abs.view(shape).mean(1, keepdim=True).expand(shape)
            layer_stats = LayerStats(layer_stats.hessian, pooled.reshape(-1), layer_stats.rows)
        found[name] = awq_search(modules[name].weight, layer_stats, group_size, grid=grid)
    return found


def calibrated_model(
    model: GPT, method: str, *, tokens: torch.Tensor | None = None, group_size: int = 32,
    windows: int = 64, length: int = 512, damp: float = 0.01, grid: int = 20, gptq=None, awq=None,
    stats: dict[str, LayerStats] | None = None,
) -> GPT:
    """A NEW int4 model of ``model`` (left untouched) by ``method``: "rtn" (round to nearest,
    ``quantize_model``'s), "awq" or "gptq", calibrated on ``tokens`` (default: the course corpus's
    training split; ``windows`` of ``length`` tokens, 32,768 by default: on the course model, GPTQ
    from 4,096 tokens recovered 22 % of round to nearest's bits/byte loss on the validation text,
    from 32,768 tokens 71 %, 2026-12-07). Same format, same kernels, same speed. ``stats``:
    ``calibration_stats(model)`` already measured (one calibration for several methods);
    ``tokens``, ``windows`` and ``length`` are then unused.

    Functions of one's own (chapter 09b's learner passes theirs) in place of the package's, given
    each layer's weight and its ``LayerStats``: ``gptq(w, stats, group_size, damp) -> (q, scale)``;
    ``awq(w, stats, group_size, grid) -> s``, the input-channel scales (in,)."""
    _check_model(model)
    if method not in METHODS:
        raise BadValue(f"method must be one of {METHODS}, got {method!r}", arg="method")
    if group_size not in INT4_GROUP_SIZES:
        raise BadValue(
            f"group_size must be one the int4 CPU kernel takes, {INT4_GROUP_SIZES}, got "
            f"{group_size!r}",
            arg="group_size",
        )
    own = {"gptq": gptq, "awq": awq}
    for name, fn in own.items():
        if fn is not None and (method != name or not callable(fn)):
            raise BadValue(f"{name} must be a function, given with method={name!r}", arg=name)
    if method == "rtn":
        return quantize_model(model, weights="int4", group_size=group_size)
    fn, names = own[method], layer_names(model)
    if stats is None:
        stats = calibration_stats(model, tokens, windows=windows, length=length)
    elif not isinstance(stats, dict) or set(stats) != set(names):
        raise BadValue(
            "stats must be calibration_stats(model) of this model: one LayerStats per layer of "
            "layer_names(model)",
            arg="stats",
        )
    weights = {n: m.weight for n, m in model.named_modules() if n in stats}
    if method == "awq":
        model, found = _awq(model, stats, group_size, grid, fn)
        answers = iter([(qt.q, qt.scale) for qt in found])
    elif fn is None:
        answers = iter([(qt.q, qt.scale) for qt in (
            gptq_quantize(weights[n], stats[n].hessian, group_size, damp=damp) for n in names)])
    else:  # quantize_model checks each answer as it checks any quantizer's
        answers = iter([fn(weights[n].detach().clone(), stats[n], group_size, damp)
                        for n in names])
    # quantize_model visits the layers in layer_names' order
    return quantize_model(model, weights="int4", group_size=group_size,
                          quantizer=lambda _w, _size: next(answers))


def _awq(model: GPT, stats: dict[str, LayerStats], group_size: int, grid: int, fn):
    """AWQ on every layer: scales (the search's, or ``fn``'s), folded into a copy of ``model``,
    each scaled weight then clipped; the copy and its layers' ``QuantizedTensor``s in order."""
    weights = {n: m.weight for n, m in model.named_modules() if n in stats}
    if fn is None:
        chosen = {k: v.scale for k, v in awq_scales(model, stats, group_size, grid=grid).items()}
    else:
        chosen = {n: _own_scale(fn(weights[n].detach().clone(), stats[n], group_size, grid),
                                weights[n].shape[1])
                  for n in layer_names(model) if _foldable(model, n)}
    model = copy.deepcopy(model)
    _fold(model, chosen)  # columns times s, the op before divided by s
    weights = {n: m.weight for n, m in model.named_modules() if n in stats}
    return model, [clip_search(weights[n], scaled_hessian(stats[n], chosen.get(n)), group_size,
                               grid=grid) for n in layer_names(model)]


def _own_scale(s, n_in: int) -> torch.Tensor:
    """A learner's AWQ scales, checked: (in,) finite and positive."""
    if not isinstance(s, torch.Tensor) or tuple(s.shape) != (n_in,):
        what = tuple(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__
        raise BadValue(f"awq must return the layer's {n_in} input-channel scales, got {what}",
                       arg="awq")
    if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
        raise BadValue("awq's scales must be finite and positive", arg="awq")
    return s.detach().float()


def recovered(rtn: float, method: float, full: float) -> float:
    """The share of round-to-nearest's loss (``rtn - full``) a method recovers: 1 = all of it."""
    lost = rtn - full
    return math.nan if lost <= 0 else (rtn - method) / lost
