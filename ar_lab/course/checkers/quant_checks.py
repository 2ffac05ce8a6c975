"""Chapter 09's exercise checkers: a learner's quantization against ``ar_lab.engine.quant``, with
the usual mistakes named.

``int8_mistakes`` / ``int4_mistakes`` compute what each common mistake gives (a scale from the
largest value instead of the largest magnitude, floor or truncation instead of rounding, no clamp,
128 or 8 levels instead of 127 or 7, groups taken along the wrong axis), and ``check_quantized``
compares a learner's (q, scale) with the package's and, when they differ, says which mistake the
answer matches (``ar_lab.course.checkers.checks.check_matches``). Given the weights, it accepts a q
that differs only where w / scale is an exact half (``ties``): both levels are then as near, and
``round(w * (127 / absmax))`` lands on the other side of a tie now and then.
"""

from __future__ import annotations

import torch

from ar_lab.course.checkers.checks import (
    CheckFailed,
    check_close,
    check_dtype,
    check_matches,
    check_shape,
)


def _quantize(
    w: torch.Tensor, scale: torch.Tensor, rounding, levels: int | None, wrap: bool = False
):
    """w / scale rounded with ``rounding``, clamped to [-levels, levels] (None: not clamped), as
    int8 (``wrap``: as the int8 cast of an unclamped value lands, e.g. 130 -> -126)."""
    x = rounding(w / scale)
    if levels is not None:
        x = x.clamp(-levels, levels)
    return (x.long().remainder(256) - 256 * (x.long().remainder(256) >= 128)) if wrap else x


def _rules(w: torch.Tensor, levels: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Mistake -> (q as floats, scale (..., 1)) for symmetric quantization along the last dim of
    ``w``."""
    absmax = w.abs().amax(-1, keepdim=True)
    right = torch.where(absmax > 0, absmax / levels, torch.ones_like(absmax))
    top = w.amax(-1, keepdim=True).clamp_min(1e-12)
    wider = torch.where(absmax > 0, absmax / (levels + 1), torch.ones_like(absmax))
    return {
        "a scale from the largest value (max w) instead of the largest magnitude (max |w|)": (
            _quantize(w, top / levels, torch.round, levels),
            top / levels,
        ),
        "a scale from max w and no clamp (values past the range wrapped when cast to int8)": (
            _quantize(w, top / levels, torch.round, None, wrap=True),
            top / levels,
        ),
        "rounding down (floor) instead of to the nearest level": (
            _quantize(w, right, torch.floor, None, wrap=True),
            right,
        ),
        "rounding down (floor) instead of to the nearest level, then a clamp": (
            _quantize(w, right, torch.floor, levels),
            right,
        ),
        "truncation (int() / .to(int8) of w / scale) instead of rounding": (
            _quantize(w, right, torch.trunc, levels),
            right,
        ),
        f"{levels + 1} levels (max |w| / {levels + 1}, the range [-{levels + 1}, {levels}]) "
        f"instead of {levels}": (
            torch.round(w / wider).clamp(-levels - 1, levels),
            wider,
        ),
    }


def int8_mistakes(w: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Mistake -> (q (out, in), scale (out,)) that an int8 per-row quantizer with that mistake
    returns."""
    w = w.detach().float()
    found = {k: (q, s[:, 0]) for k, (q, s) in _rules(w, 127).items()}
    col = w.abs().amax(0)
    col_scale = torch.where(col > 0, col / 127, torch.ones_like(col))
    found["one scale per input column instead of per output row"] = (
        torch.round(w / col_scale),
        col_scale,
    )
    whole = w.abs().max() / 127
    found["one scale for the whole tensor instead of one per row"] = (
        torch.round(w / whole),
        whole.expand(w.shape[0]).clone(),
    )
    return found


def int4_mistakes(w: torch.Tensor, group_size: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Mistake -> (q (out, in), scale (out, in / group_size)) of an int4 group-wise quantizer with
    that mistake."""
    w = w.detach().float()
    out, n_in = w.shape
    groups = w.view(out, n_in // group_size, group_size)
    found = {k: (q.reshape(out, n_in), s[..., 0]) for k, (q, s) in _rules(groups, 7).items()}
    # groups of consecutive rows within a column, the scales laid out (out / g, in)
    if out % group_size == 0:
        cols = w.t().reshape(n_in, out // group_size, group_size)
        absmax = cols.abs().amax(-1, keepdim=True)
        scale = torch.where(absmax > 0, absmax / 7, torch.ones_like(absmax))
        q = torch.round(cols / scale).clamp(-7, 7).reshape(n_in, out).t()
        found[
            "groups of consecutive rows (the output axis) instead of consecutive input columns"
        ] = (
            q,
            scale[..., 0].t(),  # (out / g, in)
        )
    return found


def ties(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Where ``w / scale`` is a half (x.5) to within float32 rounding: the two nearest levels are
    equally near, and an answer computed another way (``w * (127 / absmax)``, one rounding
    different) may round to either. ``scale``: one per row (out,), or per group of consecutive
    columns (out, in / g)."""
    w = w.detach().float()
    s = scale.detach().float().reshape(w.shape[0], -1)  # (out, groups)
    x = w / s.repeat_interleave(w.shape[-1] // s.shape[-1], dim=-1)  # (out, in)
    # a few float32 steps at |x|
    tolerance = 8 * torch.finfo(torch.float32).eps * x.abs().clamp_min(1.0)
    return ((x - x.floor()) - 0.5).abs() <= tolerance


def check_dequantized(what: str, got, expected: torch.Tensor, hint: str = "") -> None:
    """A dequantized matrix: the float32 the exercise states (float64 has the same values in twice
    the bytes, the opposite of what quantizing is for), equal to ``expected`` to float32
    rounding."""
    check_dtype(
        what,
        got,
        torch.float32,
        why="the exercise asks for the float32 matrix q and scale stand for",
        hint=hint or "q.float() * scale[:, None]",
    )
    check_close(what, got, expected, atol=0, rtol=1e-6, hint=hint)


def check_quantized(
    what: str,
    got,
    expected: tuple[torch.Tensor, torch.Tensor],
    mistakes: dict[str, tuple[torch.Tensor, torch.Tensor]],
    hint: str = "",
    weights: torch.Tensor | None = None,
) -> None:
    """``got`` = (q, scale) equals ``expected`` (q exactly, scale to float32 rounding); otherwise
    say which mistake of ``mistakes`` it matches (its q, and its scale where the shapes allow a
    comparison), or where it differs.

    ``weights``: the matrix quantized. Given it, q may differ by one level where w / scale is an
    exact half (``ties``): rounding a tie either way is as accurate, and ``round(w * (127 /
    absmax))``, equal to ``round(w / scale)`` up to float rounding, differs only there. Such an
    answer passes, with a note."""
    if not isinstance(got, tuple | list) or len(got) != 2:
        raise CheckFailed(f"{what}: expected a pair (q, scale), got {type(got).__name__}")
    q, scale = got
    want_q, want_scale = expected
    check_shape(f"{what}: q", q, tuple(want_q.shape), hint)
    if q.dtype != torch.int8:
        raise CheckFailed(
            f"{what}: q must be stored as torch.int8 (one byte per weight), got {q.dtype}"
        )
    if not isinstance(scale, torch.Tensor):
        raise CheckFailed(
            f"{what}: scale must be a tensor of shape {tuple(want_scale.shape)}, got "
            f"{type(scale).__name__}"
        )

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=1e-5, atol=0)

    differ = q.long() != want_q.long()
    tie_ok = torch.zeros_like(differ)
    if weights is not None and differ.any() and weights.shape == want_q.shape:
        tie_ok = differ & ties(weights, want_scale) & ((q.long() - want_q.long()).abs() == 1)
    if not (differ & ~tie_ok).any() and close(scale, want_scale):
        if tie_ok.any():
            print(
                f"note: {what}: {int(tie_ok.sum())} weights lie exactly halfway between two "
                "levels (w / scale = x.5 to float rounding) and your q rounds them to the "
                "other, equally near, level: accepted"
            )
        return
    for mistake, (mq, ms) in mistakes.items():
        if torch.equal(q.long(), mq.long()) and (
            close(scale, ms) or scale.shape != want_scale.shape
        ):
            raise CheckFailed(
                f"{what}: your (q, scale) is what {mistake} gives"
                + (f"\nHint: {hint}" if hint else ""),
                mistake,
            )
    check_shape(f"{what}: scale", scale, tuple(want_scale.shape), hint)
    check_matches(
        f"{what}: scale",
        scale.float(),
        want_scale,
        atol=0,
        rtol=1e-5,
        dim=0,
        dim_name="row",
        hint=hint,
    )
    # a tie rounded the other way is not a difference
    want_q = torch.where(tie_ok, q.long(), want_q.long())
    check_matches(
        f"{what}: q", q.float(), want_q.float(), atol=0, rtol=0, dim=0, dim_name="row", hint=hint
    )
