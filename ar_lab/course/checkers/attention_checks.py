"""Chapter 10's checkers: online softmax, tiled causal attention and split-K decode, and their
slips.

Each exercise has a ``*_mistakes`` function: what a classic slip computes on the exercise's own
inputs (the running sum not rescaled when the maximum grows; a causal mask off by one, or built
from positions within the tile; key tiles skipped by the tile's first query; the partial outputs
of a split decode averaged instead of weighted by their log-sum-exps). The ``check_*`` functions
run the learner's code on a case, compare with PyTorch's own computation and name the mistake the
output equals; an output that is no tensor, has the wrong shape, or code that raised gives a short
verdict, not a traceback. ``check_tile_memory`` counts the bytes the learner's tiled attention
holds at once (``ar_lab.perf.peak_bytes``): a T x S score matrix among them is the untiled
computation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ar_lab.course.checkers.checks import (
    check_matches,
    check_shape,
    run_answer,
    verdict,
)
from ar_lab.model.tiled import decode_partials
from ar_lab.perf.peak_bytes import PeakBytes

OVERFLOW = 88.7  # exp(x) overflows float32 above this


_verdict, _run = verdict, run_answer  # (the shared checker helpers, by their short names here)


def _named(what: str, got: torch.Tensor, expected: torch.Tensor, mistakes: dict, hint: str,
           atol: float, rtol: float) -> None:
    """Fail naming the mistake whose output ``got`` equals (``mistakes``: description -> an output,
    or a tuple of them); NaNs in the same places count as equal."""
    g = got.detach().double().cpu()
    if torch.allclose(g, expected.double().cpu(), atol=atol, rtol=rtol):
        return
    want = expected.double().cpu()
    for mistake, outputs in mistakes.items():
        for output in outputs if isinstance(outputs, tuple) else (outputs,):
            out = output.detach().double().cpu()
            same = out.shape == g.shape and torch.allclose(g, out, atol=atol, rtol=rtol,
                                                           equal_nan=True)
            if same and not torch.allclose(out, want, atol=atol, rtol=rtol):
                raise _verdict(what, f"your output is what {mistake} gives", hint, mistake)


# --- exercise 1: online softmax ------------------------------------------------------------


def softmax_mistakes(x: torch.Tensor, chunk: int) -> dict[str, torch.Tensor]:
    """softmax over the last dim of ``x`` seen ``chunk`` values at a time, computed wrongly."""
    x = x.double()
    m = torch.full(x.shape[:-1], -math.inf, dtype=x.dtype)
    unscaled = torch.zeros_like(m)
    for c in x.split(chunk, dim=-1):
        m = torch.maximum(m, c.amax(-1))
        # the slip: the old terms keep the old maximum
        unscaled = unscaled + torch.exp(c - m[..., None]).sum(-1)
    return {
        "a running sum never rescaled when the maximum grows (l + Σ exp(c − m_new), without "
        "l × exp(m_old − m_new))": torch.exp(x - m[..., None]) / unscaled[..., None],
        "a softmax of each chunk on its own (every chunk's weights summing to 1)": torch.cat(
            [c.softmax(-1) for c in x.split(chunk, dim=-1)], dim=-1),
    }


def check_online_softmax(
    what: str, fn: Callable, x: torch.Tensor, chunk: int, hint: str = ""
) -> None:
    """``fn(x, chunk)`` equals ``torch.softmax(x, -1)``, or the verdict names the slip. A row of
    large values (above 88.7, where exp overflows float32) tells an answer that subtracts the
    maximum only at the end (a sum of exp(x) unshifted) by its infinities, NaNs or zeros."""
    got = _run(what, fn, x.clone(), chunk, hint=hint)
    expected = torch.softmax(x.double(), dim=-1)
    check_shape(what, got, tuple(x.shape), hint)
    _named(what, got, expected, softmax_mistakes(x, chunk), hint, atol=1e-6, rtol=1e-4)
    g = got.detach().double().cpu()
    broken = ~torch.isfinite(g).all(-1) | (g.sum(-1) < 0.5)  # (rows) NaN, inf, or every weight 0
    large = x.amax(-1) > OVERFLOW
    if bool((broken & large).any()) and not bool((broken & ~large).any()):
        raise _verdict(
            what,
            "rows whose values exceed 88.7 come out as NaN, infinity or zeros, the others right: "
            "your exp sees the values unshifted (the maximum subtracted only at the end), and "
            "exp(x) overflows float32 above x ≈ 88.7",
            hint,
            "the sum of exp(x) taken unshifted and the maximum subtracted only at the end",
        )
    check_matches(what, got, expected.float(), atol=1e-6, rtol=1e-4, dim=x.ndim - 1,
                  dim_name="value", hint=hint)


# --- exercise 2: tiled causal attention ----------------------------------------------------


def _starts(n: int, tile: int) -> torch.Tensor:
    """(n,) the first index of the tile each index falls in."""
    return torch.arange(n) // tile * tile


def _masked_attention(q, k, v, sees: torch.Tensor, *, heads: str = "group", scale=None):
    """softmax(q k^T * scale, keys where ``sees`` (T, S) is False hidden) v, in float64; query
    head h reads key/value head h // G ("group") or h % H_kv ("cycle", the slip)."""
    G = q.shape[1] // k.shape[1]
    def rep(t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(G, 1) if heads == "group" else t.repeat(1, G, 1, 1)

    q, k, v = q.double(), rep(k.double()), rep(v.double())
    s = q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5 if scale is None else scale)
    return s.masked_fill(~sees, -math.inf).softmax(-1) @ v


def _unrescaled(q, k, v, offset: int, tile_q: int, tile_k: int) -> torch.Tensor:
    """Tiled attention whose running output is never rescaled by exp(m_old - m_new) (l is)."""
    G = q.shape[1] // k.shape[1]
    q, k, v = q.double() * q.shape[-1] ** -0.5, k.double(), v.double()
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    out = torch.empty_like(q)
    T = q.shape[2]
    for i0 in range(0, T, tile_q):
        i1 = min(i0 + tile_q, T)
        pos = torch.arange(offset + i0, offset + i1)[:, None]
        m = torch.full(q.shape[:2] + (i1 - i0,), -math.inf, dtype=q.dtype)
        ell = torch.zeros_like(m)
        acc = torch.zeros(q.shape[:2] + (i1 - i0, q.shape[-1]), dtype=q.dtype)
        for j0 in range(0, offset + i1, tile_k):
            j1 = min(j0 + tile_k, offset + i1)
            s = (q[:, :, i0:i1] @ k[:, :, j0:j1].transpose(-2, -1)).masked_fill(
                torch.arange(j0, j1) > pos, -math.inf)
            m_new = torch.maximum(m, s.amax(-1))
            p = torch.exp(s - m_new[..., None])
            ell = ell * torch.exp(m - m_new) + p.sum(-1)
            acc = acc + p @ v[:, :, j0:j1]  # the slip: acc not multiplied by exp(m - m_new)
            m = m_new
        out[:, :, i0:i1] = acc / ell[..., None]
    return out


def tiled_mistakes(q, k, v, offset: int, tile_q: int, tile_k: int) -> dict[str, Any]:
    """Causal attention of q (B, Hq, T, D) at positions offset .. offset + T - 1 over k, v
    (B, Hkv, S, D), in tiles of tile_q queries and tile_k keys, computed with a slip: description ->
    its output, or a tuple of the outputs of the ways it is written (a slipped mask applied to the
    diagonal's tiles only, to every tile visited, or to the whole row)."""
    T, S = q.shape[2], k.shape[2]
    i, j = torch.arange(T)[:, None], torch.arange(S)[None, :]
    p = offset + i  # (T, 1): each query's position
    i0 = _starts(T, tile_q)[:, None]
    i1 = torch.clamp(i0 + tile_q, max=T)
    j0 = _starts(S, tile_k)[None, :]
    causal = j <= p
    visited = j <= offset + i1 - 1  # the keys of the tiles a right loop visits
    last = torch.minimum(j0 + tile_k, offset + i1) - 1  # a visited key tile's last key
    crossing = (last > offset + i0) & visited  # the tiles a right loop masks

    def ways(rule: torch.Tensor) -> tuple:  # a mask rule on the diagonal's tiles, every tile, all
        return tuple(_masked_attention(q, k, v, sees) for sees in
                     (visited & (~crossing | rule), visited & rule, rule))

    out = {
        "a mask that hides the diagonal (key j hidden when j >= the query's position: a query sees "
        "its own key)": ways(j < p),
        "a mask off by one the other way (each query also sees the next key, j <= position + 1)":
            ways(j <= p + 1),
        "a mask built from positions within the tile (j - j0 > i - i0) instead of absolute "
        "positions": ways(j - j0 <= i - i0)[:1],
        "key tiles skipped when they start after the tile's first query (j0 > offset + i0), so "
        "the tile's later queries lose keys they see": _masked_attention(
            q, k, v, causal & (j0 <= offset + i0)),
        "the diagonal tiles left unmasked (only the tiles wholly above the diagonal skipped)":
            _masked_attention(q, k, v, visited),
        "no causal mask at all (every key visible)": _masked_attention(
            q, k, v, torch.ones_like(causal)),
        "scores not scaled by 1/√D": _masked_attention(q, k, v, causal, scale=1.0),
        "the running output not rescaled by exp(m_old − m_new) when the maximum grows (the sum "
        "l is)": _unrescaled(q, k, v, offset, tile_q, tile_k),
    }
    if offset:
        out["a mask that leaves out the offset (query i compared with key i, not offset + i)"] = (
            ways(j <= i))
        out["key tiles skipped by the query's index without the offset (keys from i1 on never "
            "visited)"] = _masked_attention(q, k, v, causal & (j0 <= i1 - 1))
    if k.shape[1] > 1 and q.shape[1] > k.shape[1]:
        out["query head h reading key/value head h % H_kv (the heads repeated, not grouped: "
            "head h reads h // G)"] = _masked_attention(q, k, v, causal, heads="cycle")
    return out


def check_tiled(what: str, fn: Callable, q, k, v, offset: int, tile_q: int, tile_k: int,
                hint: str = "") -> None:
    """``fn(q, k, v, offset, tile_q, tile_k)`` equals PyTorch's ``scaled_dot_product_attention``
    with the causal mask of queries at offset .. offset + T - 1 (and grouped heads), or the verdict
    names the slip and the first query position that differs."""
    T, S = q.shape[2], k.shape[2]
    sees = torch.arange(S)[None, :] <= offset + torch.arange(T)[:, None]
    expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=sees,
                                              enable_gqa=True)
    got = _run(what, fn, q.clone(), k.clone(), v.clone(), offset, tile_q, tile_k, hint=hint)
    check_shape(what, got, tuple(q.shape), hint)
    _named(what, got, expected, tiled_mistakes(q, k, v, offset, tile_q, tile_k), hint,
           atol=1e-5, rtol=1e-4)
    check_matches(what, got, expected.float(), atol=1e-5, rtol=1e-4, dim=2, dim_name="query",
                  hint=hint)


def check_tile_memory(
    what: str, fn: Callable, *, T: int = 1024, tile: int = 64, hint: str = ""
) -> int:
    """Run ``fn`` (the learner's tiled attention) on one sequence of T positions, one key/value
    head shared by two query heads, and count the bytes it holds at once (``PeakBytes``): at most
    a quarter of one (B, Hq, T, T) score matrix, or the verdict says it forms the matrix. Returns
    the peak."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, T, 16, generator=gen)
    k, v = torch.randn(1, 1, T, 16, generator=gen), torch.randn(1, 1, T, 16, generator=gen)
    with PeakBytes() as tracker:
        _run(what, fn, q, k, v, 0, tile, tile, hint=hint)
    scores = q.shape[0] * q.shape[1] * T * T * q.element_size()
    if tracker.peak > scores / 4:
        raise _verdict(
            what,
            f"your attention held {tracker.peak:,} bytes at once over T = {T:,} positions; one "
            f"T × T score matrix is {scores:,}: it forms the matrix (or a large part of it), "
            "which tiles never need",
            hint,
            "the whole T × S score matrix formed",
        )
    return tracker.peak


# --- exercise 3: split-K decode ------------------------------------------------------------


def split_mistakes(q, k, v, splits: int) -> dict[str, torch.Tensor]:
    """One query q (B, H, 1, D) over k, v (B, H, S, D) cut into ``splits`` chunks (chunk i: keys
    i * S // splits .. (i + 1) * S // splits - 1), the chunks' outputs merged wrongly."""
    outs, lses = decode_partials(q.double(), k.double(), v.double(), splits=splits)
    S = k.shape[2]
    sizes = torch.tensor([(i + 1) * S // splits - i * S // splits for i in range(splits)])
    share = (sizes.double() / S).view(-1, *[1] * (outs.ndim - 1))
    return {
        "the partial outputs averaged (each chunk weighted 1 / splits, whatever its share of the "
        "softmax's mass)": outs.mean(0),
        "the partial outputs weighted by their chunk's length (S_i / S) instead of its mass": (
            share * outs).sum(0),
        "the partial outputs added up, unweighted": outs.sum(0),
        "the partial outputs weighted by exp(lse_i), not divided by the total exp(lse)": (
            torch.exp(lses)[..., None] * outs).sum(0),
        "the partial outputs weighted by softmax over the chunks' maxima instead of their lse": (
            _max_weights(q, k, splits)[..., None] * outs).sum(0),
    }


def _max_weights(q, k, splits: int) -> torch.Tensor:
    """(splits, B, H, 1): a softmax over each chunk's largest scaled score (a slip)."""
    s = (q.double() @ k.double().transpose(-2, -1)) * q.shape[-1] ** -0.5  # (B, H, 1, S)
    S = k.shape[2]
    maxima = torch.stack([s[..., i * S // splits:(i + 1) * S // splits].amax(-1)
                          for i in range(splits)])
    return maxima.softmax(0)


def check_split(what: str, fn: Callable, q, k, v, splits: int, hint: str = "") -> None:
    """``fn(q, k, v, splits)`` equals attention of the one query over every key, or the verdict
    names the slip of the merge."""
    expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    got = _run(what, fn, q.clone(), k.clone(), v.clone(), splits, hint=hint)
    check_shape(what, got, tuple(q.shape), hint)
    _named(what, got, expected, split_mistakes(q, k, v, splits), hint, atol=1e-5, rtol=1e-4)
    check_matches(what, got, expected.float(), atol=1e-5, rtol=1e-4, dim=1, dim_name="head",
                  hint=hint)
