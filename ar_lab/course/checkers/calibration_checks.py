"""Chapter 09b's checkers: a learner's GPTQ and AWQ against ``ar_lab.engine.calibrated``, with the
classic slips named.

``gptq_mistakes`` computes what each slip gives on the exercise's own layer (no error feedback,
which is round to nearest; H from the weights instead of the inputs; no damping; the error not
divided by U_ii; the error added instead of subtracted; group scales fixed before any feedback);
``awq_mistakes`` the same for the scale search (scales not undone on the inputs; s from the
weights' magnitudes; alpha chosen on the weights' error rather than the outputs'). A GPTQ answer
passes when it rounds as GPTQ does on at least 99 % of the weights and its output error is GPTQ's
within 1 % (float32 arithmetic lands on the other side of a rounding tie now and then, and the
feedback carries that on); an AWQ answer when its output error is the search's best.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ar_lab.course.checkers.checks import check_shape, run_answer, verdict
from ar_lab.engine.calibrated import (
    LayerStats,
    awq_candidate,
    awq_dequantized,
    awq_search,
    gptq_quantize,
    output_error,
    stats_of,
)
from ar_lab.engine.quant import QuantizedTensor, absmax_scales, quantize_int4

GROUP, DAMP, GRID = 32, 0.01, 20


def layer_case(seed: int = 0, out: int = 64, n_in: int = 128, rows: int = 512):
    """A weight and input rows like a trained layer's: correlated channels, a few loud ones."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, n_in, generator=g) / math.sqrt(n_in)
    mix = torch.randn(n_in, n_in, generator=g) / math.sqrt(n_in)
    x = torch.randn(rows, n_in, generator=g) @ (torch.eye(n_in) + 2 * mix)
    x[:, :: n_in // 4] *= 10  # four loud channels
    return w, x


_verdict, _run = verdict, run_answer  # (the shared checker helpers, by their short names here)


def _gptq_slip(w, h, group, damp, *, divide=True, sign=1.0, fixed_scales=False) -> torch.Tensor:
    """GPTQ written column by column with one slip switched on; the dequantized weight."""
    w = w.double().clone()
    h = h + damp * h.diagonal().mean() * torch.eye(h.shape[0], dtype=h.dtype)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    fixed = quantize_int4(w.float(), group).scale.double()
    out = torch.empty_like(w)
    for i in range(w.shape[1]):
        if i % group == 0:
            scale = fixed[:, i // group] if fixed_scales else absmax_scales(
                w[:, i : i + group].abs().amax(1), 7)
        out[:, i] = torch.round(w[:, i] / scale).clamp(-7, 7) * scale
        err = (w[:, i] - out[:, i]) / (u[i, i] if divide else 1.0)
        w[:, i + 1 :] -= sign * err[:, None] * u[i, i + 1 :][None, :]
    return out


def gptq_mistakes(w: torch.Tensor, x: torch.Tensor, group: int = GROUP, damp: float = DAMP):
    """Slip -> the dequantized weight it gives."""
    h = stats_of(x).hessian
    return {
        "no error feedback: every column rounded on its own (that is round to nearest)":
            quantize_int4(w, group).dequantize(),
        "H from the weights (W^T W) instead of the layer's inputs (mean of x x^T)":
            gptq_quantize(w, w.double().T @ w.double() / w.shape[0], group, damp=damp).dequantize(),
        "H not damped (no damp * mean(diag H) added to its diagonal)":
            gptq_quantize(w, h, group, damp=0.0).dequantize(),
        "the error fed back without dividing by U[i, i]": _gptq_slip(w, h, group, damp,
                                                                     divide=False),
        "the error added to the later columns instead of subtracted": _gptq_slip(w, h, group, damp,
                                                                                 sign=-1.0),
        "each group's scale fixed from the original weights, before the feedback moved them":
            _gptq_slip(w, h, group, damp, fixed_scales=True),
    }


def _same_rounding(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, group: int) -> float:
    """The share of weights on the same level: |a - b| below half the group's step."""
    step = scale.float().repeat_interleave(group, dim=1)
    return float(((a.float() - b.float()).abs() < step / 2).float().mean())


def check_gptq(fn: Callable, seed: int = 0, hint: str = "") -> None:
    """``fn(w, stats, group_size, damp) -> (q, scale)`` is GPTQ, on a layer with loud input
    channels (``stats``: the ``LayerStats`` of its inputs)."""
    what = "my_gptq"
    w, x = layer_case(seed)
    got = _run(what, fn, w.clone(), stats_of(x), GROUP, DAMP, hint=hint)
    if not isinstance(got, tuple | list) or len(got) != 2:
        raise _verdict(what, f"expected a pair (q, scale), got {type(got).__name__}", hint)
    q, scale = got
    check_shape(f"{what}: q", q, tuple(w.shape), hint)
    check_shape(f"{what}: scale", scale, (w.shape[0], w.shape[1] // GROUP), hint)
    try:
        mine = QuantizedTensor(q, scale.float(), 4, GROUP).dequantize()
    except ValueError as e:
        raise _verdict(what, str(e), hint) from None
    h = stats_of(x).hessian
    ref = gptq_quantize(w, h, GROUP, damp=DAMP)
    want = ref.dequantize()
    err, best = output_error(w, mine, h), output_error(w, want, h)
    if _same_rounding(mine, want, ref.scale, GROUP) >= 0.99 and err <= 1.01 * best:
        return
    for mistake, output in gptq_mistakes(w, x).items():
        if _same_rounding(mine, output, ref.scale, GROUP) >= 0.99:
            raise _verdict(what, f"your output is what {mistake} gives", hint, mistake)
    rtn = output_error(w, quantize_int4(w, GROUP).dequantize(), h)
    raise _verdict(
        what,
        f"output error {err:.3e} on the layer's inputs, where GPTQ reaches {best:.3e} (round to "
        f"nearest: {rtn:.3e})",
        hint,
    )


# --- exercise 2: AWQ's scale search ----------------------------------------------------------


def _search(w, mean_abs, group, grid, error: Callable) -> torch.Tensor:
    alphas = [k / grid for k in range(grid)]
    best = min(alphas, key=lambda a: error(awq_candidate(mean_abs, a)))
    return awq_candidate(mean_abs, best)


def awq_mistakes(w: torch.Tensor, x: torch.Tensor, group: int = GROUP, grid: int = GRID):
    """Slip -> the weight the layer computes with under the scales that slip chooses."""
    stats = stats_of(x)
    h = stats.hessian

    def output(s):
        return output_error(w, awq_dequantized(w, s, group), h)

    def not_undone(s):  # Q(W s) compared with W: the division by s forgotten
        return output_error(w, quantize_int4(w * s[None, :], group).dequantize(), h)

    def weights_only(s):
        return float(((awq_dequantized(w, s, group) - w) ** 2).sum())

    slips = {
        "scales that change nothing (alpha 0, or all equal: round to nearest; a search that picks "
        "them measures something other than Q(W s) / s against W on the inputs)":
            torch.ones(w.shape[1]),
        "the scales multiplied into the weights but never undone on the inputs (Q(W s) "
        "compared with W)": _search(w, stats.mean_abs, group, grid, not_undone),
        "s from the weights' magnitudes (mean |w| per input column) instead of the "
        "activations'": _search(w, w.abs().mean(0).double(), group, grid, output),
        "alpha chosen on the weights' error ||Q(W s)/s - W||^2 instead of the outputs'":
            _search(w, stats.mean_abs, group, grid, weights_only),
    }
    return {m: awq_dequantized(w, s, group) for m, s in slips.items()}


def check_awq(fn: Callable, seed: int = 0, hint: str = "") -> None:
    """``fn(w, stats, group_size, grid) -> s`` finds AWQ's input-channel scales of least output
    error."""
    what = "my_awq_scales"
    w, x = layer_case(seed)
    s = _run(what, fn, w.clone(), stats_of(x), GROUP, GRID, hint=hint)
    check_shape(what, s, (w.shape[1],), hint)
    if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
        raise _verdict(what, "the scales must be finite and positive", hint)
    stats: LayerStats = stats_of(x)
    mine = awq_dequantized(w, s.detach().float(), GROUP)
    err = output_error(w, mine, stats.hessian)
    best = awq_search(w, stats, GROUP, grid=GRID)
    if err <= best.error * (1 + 1e-4):
        return
    for mistake, output in awq_mistakes(w, x).items():
        if torch.allclose(mine, output, rtol=1e-4, atol=1e-6):
            raise _verdict(what, f"your scales match a known slip: {mistake}", hint, mistake)
    raise _verdict(
        what,
        f"output error {err:.3e}, where the search's best is {best.error:.3e} (alpha = "
        f"{best.alpha}; alpha 0, no scaling: {best.errors[0]:.3e})",
        hint,
    )
