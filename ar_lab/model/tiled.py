"""Attention as engines compute it: online softmax, tiles without the T x S matrix, split-K decode.

``model/attention.py`` calls ``scaled_dot_product_attention``; this module writes out, in plain
torch, the scheme its fused kernels (and every serving engine's) follow, so that a chapter can
measure it.

**Online softmax** (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022, Algorithm 1). A row
x seen in chunks keeps a running maximum m and a running sum l = sum_j exp(x_j - m). A new chunk c
gives m' = max(m, max c) and l' = l * exp(m - m') + sum_j exp(c_j - m'): the old sum was taken
against the old maximum, so it is rescaled by exp(m - m') <= 1 when the maximum grows. At the end
softmax(x) = exp(x - m) / l and logsumexp(x) = m + log l. No exp ever overflows, and the row is
never needed whole.

**Tiled attention** (FlashAttention-2, Dao 2023). Queries in tiles of ``tile_q`` rows (the outer
loop, in parallel on a GPU), keys in tiles of ``tile_k`` (the inner loop): per query tile the
running m, l and an *unnormalised* output acc = sum_j exp(s_j - m) v_j, rescaled by exp(m - m') like
l. The division by l happens once, at the end. Only a tile_q x tile_k block of scores exists per
head at a time. Causal with a KV cache: query i sits at absolute position offset + i and sees keys 0
.. offset + i; a key tile whose first key is later than the tile's last query is wholly above the
diagonal and never visited; only tiles that cross the diagonal are masked. Grouped-query heads:
query head h reads key/value head h // G (G = H_q / H_kv), as
``scaled_dot_product_attention(enable_gqa=True)`` does.

**Split-K decode** (Flash-Decoding, Dao et al. 2023). One query over a long cache leaves a GPU idle
if one worker walks all S keys, so the cache is split into chunks done side by side. Each chunk i
returns its own normalised output o_i and its log-sum-exp lse_i; the exact merge weighs each by its
share of the total mass: lse = logsumexp_i(lse_i), o = sum_i exp(lse_i - lse) o_i.

``materialised_attention`` is the plain way, the baseline these are measured against
(``bench/attention``): the whole (B, H, T, S) score matrix, masked, softmaxed, times V.
"""

from __future__ import annotations

import torch
from einops import rearrange

from ar_lab.base.args import finite_number, positive_int
from ar_lab.base.errors import BadType, BadValue

DEFAULT_TILE = 64  # a tile's rows and columns when not given (capped at the length it tiles)


# -------------------------------------------------------------------------------- checks


def _check_float(name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise BadType(f"{name} must be a torch.Tensor, got {type(x).__name__}", arg=name)
    if not x.is_floating_point():
        raise BadType(
            f"{name} must hold floating-point values (e.g. torch.float32), got {x.dtype}", arg=name
        )
    return x


def _check_qkv(q, k, v, offset) -> int:
    """Check q (B, Hq, T, D) against k, v (B, Hkv, S, D) and the causal offset; return offset."""
    for name, x in [("q", q), ("k", k), ("v", v)]:
        _check_float(name, x)
        if x.ndim != 4 or x.shape[2] == 0:
            raise BadValue(
                f"{name} must be (B, heads, positions >= 1, D), got shape {tuple(x.shape)}",
                arg=name,
            )
    B, Hq, T, D = q.shape
    for name, x in [("k", k), ("v", v)]:
        if x.dtype != q.dtype or x.device != q.device:
            raise BadType(
                f"{name} must be {q.dtype} on {q.device} like q, got {x.dtype} on {x.device}",
                arg=name,
            )
    if k.shape[0] != B or k.shape[3] != D:
        raise BadValue(
            f"k must be (B={B}, Hkv, S, D={D}) to match q {tuple(q.shape)}, got {tuple(k.shape)}",
            arg="k",
        )
    if Hq % k.shape[1]:
        raise BadValue(
            f"k's {k.shape[1]} heads must divide q's {Hq} (a group of query heads shares one)",
            arg="k",
        )
    if v.shape != k.shape:
        raise BadValue(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}", arg="v")
    offset = positive_int("offset", offset, minimum=0)
    if k.shape[2] != offset + T:
        hint = f" (pass offset={k.shape[2] - T})" if k.shape[2] >= T else ""
        raise BadValue(
            f"offset: queries at positions offset .. offset + T - 1 see keys 0 .. offset + T - 1, "
            f"so k needs offset + T = {offset + T} positions; got {k.shape[2]}{hint}",
            arg="offset",
        )
    return offset


def _tile(name: str, value, length: int, what: str) -> int:
    """A tile size in 1 .. length (None: DEFAULT_TILE, capped at length). A tile longer than what it
    tiles would be one tile holding all of it: the untiled computation under another name, so it is
    refused."""
    if value is None:
        return min(DEFAULT_TILE, length)
    value = positive_int(name, value)
    if value > length:
        raise BadValue(f"{name} must be at most {what} ({length}), got {value}", arg=name)
    return value


def _scale(scale, D: int) -> float:
    return D**-0.5 if scale is None else finite_number("scale", scale, above=True)


# -------------------------------------------------------------------------------- softmax


def softmax_stats(x: torch.Tensor, *, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The running maximum m and sum l = sum exp(x - m) over the last dim of ``x``, seen ``chunk``
    at a time: (m, l), each of x's shape without its last dim. -inf entries count for nothing; an
    all -inf row gives m = -inf, l = 0."""
    _check_float("x", x)
    if x.ndim == 0 or x.shape[-1] == 0:
        raise BadValue(
            f"x must have at least one value in its last dim, got shape {tuple(x.shape)}", arg="x"
        )
    chunk = _tile("chunk", chunk, x.shape[-1], "the row's length")
    m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype, device=x.device)  # (...,)
    ell = torch.zeros_like(m)  # the papers' l (ℓ): the running sum
    for c in x.split(chunk, dim=-1):  # (..., chunk)
        m_new = torch.maximum(m, c.amax(-1))
        # where nothing finite was seen yet, subtract 0 instead: exp(-inf - 0) = 0, never -inf + inf
        base = torch.where(m_new == float("-inf"), 0.0, m_new)
        ell = ell * torch.exp(m - base) + torch.exp(c - base[..., None]).sum(-1)  # old sum, new max
        m = m_new
    return m, ell


def online_softmax(x: torch.Tensor, *, chunk: int) -> torch.Tensor:
    """softmax over the last dim of ``x``, its normaliser found ``chunk`` values at a time
    (``softmax_stats``): exp(x - m) / l. Equals ``torch.softmax(x, -1)``."""
    m, ell = softmax_stats(x, chunk=chunk)
    return torch.exp(x - m[..., None]) / ell[..., None]


# -------------------------------------------------------------------------------- attention


def materialised_attention(q, k, v, *, offset: int = 0, scale: float | None = None) -> torch.Tensor:
    """Causal attention the plain way: the whole (B, Hq, T, S) score matrix, masked, softmaxed,
    times V.

    q (B, Hq, T, D) at positions offset .. offset + T - 1; k, v (B, Hkv, S = offset + T, D). Returns
    (B, Hq, T, D). Two T x S matrices are alive at once (the scores, then their softmax)."""
    offset = _check_qkv(q, k, v, offset)
    scale = _scale(scale, q.shape[-1])
    G = q.shape[1] // k.shape[1]
    T, S = q.shape[2], k.shape[2]
    # (B, Hq, S, D): query head h reads key/value head h // G
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    positions = torch.arange(offset, offset + T, device=q.device)[:, None]  # (T, 1)
    seen = torch.arange(S, device=q.device) <= positions  # (T, S): key j seen by the query at p
    att = (q @ k.transpose(-2, -1)) * scale  # (B, Hq, T, S)
    att = att.masked_fill(~seen, float("-inf"))
    att = torch.softmax(att, dim=-1)
    return att @ v  # (B, Hq, T, D)


def tile_plan(T: int, *, offset: int = 0, tile_q: int, tile_k: int) -> list[tuple[int, int, list]]:
    """The tiles tiled attention visits: [(i0, i1, [(j0, j1, masked), ...]), ...] for query rows i0
    .. i1 - 1 and key columns j0 .. j1 - 1. Key tiles wholly above the diagonal (j0 > offset + i1 -
    1) are absent; ``masked`` is True for a tile crossing it (a key later than the tile's first
    query).
    """
    T, tile_q, tile_k = (
        positive_int(n, x) for n, x in [("T", T), ("tile_q", tile_q), ("tile_k", tile_k)]
    )
    offset = positive_int("offset", offset, minimum=0)
    plan = []
    for i0 in range(0, T, tile_q):
        i1 = min(i0 + tile_q, T)
        last = offset + i1 - 1  # the tile's last query's position: no key after it is seen
        keys = [
            (j0, min(j0 + tile_k, last + 1), min(j0 + tile_k, last + 1) - 1 > offset + i0)
            for j0 in range(0, last + 1, tile_k)
        ]
        plan.append((i0, i1, keys))
    return plan


def tiled_attention(
    q,
    k,
    v,
    *,
    offset: int = 0,
    tile_q: int | None = None,
    tile_k: int | None = None,
    scale: float | None = None,
    return_lse: bool = False,
):
    """Causal attention in tiles, FlashAttention-2's way: equal to ``scaled_dot_product_attention``.

    q (B, Hq, T, D) at positions offset .. offset + T - 1 (offset > 0: a block of queries after a KV
    cache); k, v (B, Hkv, S = offset + T, D), Hq a multiple of Hkv. ``tile_q`` in 1 .. T and
    ``tile_k`` in 1 .. S (default: 64, or the whole length if shorter). Returns o (B, Hq, T, D), and
    with ``return_lse`` also the log-sum-exp (B, Hq, T) of each row's scaled scores. At most one
    (tile_q, tile_k) block of scores per head exists at a time; the output is accumulated
    unnormalised and divided by l once per query tile."""
    offset = _check_qkv(q, k, v, offset)
    B, Hq, T, D = q.shape
    tile_q = _tile("tile_q", tile_q, T, "T, the number of queries")
    tile_k = _tile("tile_k", tile_k, k.shape[2], "S, the number of keys")
    scale = _scale(scale, D)
    acc_dtype = torch.promote_types(q.dtype, torch.float32)  # bf16/fp16 inputs accumulate in fp32
    # (B, Hkv, G, T, D): the G query heads that share each key/value head, side by side
    qg = rearrange(q, "b (h g) t d -> b h g t d", h=k.shape[1])
    out = torch.empty(qg.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(qg.shape[:-1], dtype=acc_dtype, device=q.device)  # (B, Hkv, G, T)
    for i0, i1, keys in tile_plan(T, offset=offset, tile_q=tile_q, tile_k=tile_k):
        acc, m, ell = _query_tile(qg[..., i0:i1, :] * scale, k, v, offset + i0, keys, acc_dtype)
        out[..., i0:i1, :] = acc / ell[..., None]  # FA-2: the one division, after the last key tile
        lse[..., i0:i1] = m + torch.log(ell)
    out = rearrange(out, "b h g t d -> b (h g) t d")
    return (out, rearrange(lse, "b h g t -> b (h g) t")) if return_lse else out


def _query_tile(qt, k, v, first: int, keys, acc_dtype):
    """One query tile qt (B, Hkv, G, tq, D), already scaled, at positions first .. first + tq - 1,
    over the key tiles ``keys``: (acc (B, Hkv, G, tq, D) unnormalised, m, l (B, Hkv, G, tq)), all in
    ``acc_dtype``."""
    m = torch.full(qt.shape[:-1], float("-inf"), dtype=acc_dtype, device=qt.device)
    ell = torch.zeros(qt.shape[:-1], dtype=acc_dtype, device=qt.device)  # the running sum
    acc = torch.zeros(qt.shape, dtype=acc_dtype, device=qt.device)
    q_pos = torch.arange(first, first + qt.shape[-2], device=qt.device)[:, None]  # (tq, 1)
    # the first key tile holds key 0, which every query sees: m is finite from then on
    for j0, j1, masked in keys:
        s = (qt @ k[:, :, None, j0:j1].transpose(-2, -1)).to(acc_dtype)  # (B, Hkv, G, tq, tk)
        if masked:  # a tile on the diagonal: hide the keys later than each query
            s.masked_fill_(torch.arange(j0, j1, device=qt.device) > q_pos, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        alpha = torch.exp(m - m_new)  # rescales what was summed against the old max (0 at first)
        p = torch.exp(s - m_new[..., None])  # (B, Hkv, G, tq, tk)
        ell = ell * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + (p.to(v.dtype) @ v[:, :, None, j0:j1]).to(acc_dtype)
        m = m_new
    return acc, m, ell


# -------------------------------------------------------------------------------- split-K decode


def _check_decode(q, k, v, splits: int) -> int:
    if isinstance(q, torch.Tensor) and q.ndim == 4 and q.shape[2] != 1:
        raise BadValue(
            f"q must be one query position (B, Hq, 1, D) for split decode, got {tuple(q.shape)}; "
            "for several use tiled_attention",
            arg="q",
        )
    S = k.shape[2] if isinstance(k, torch.Tensor) and k.ndim == 4 else 1
    _check_qkv(q, k, v, S - 1)  # the query sits after every cached key: it sees them all
    return _tile("splits", splits, k.shape[2], "S, the number of cached keys")


def decode_partials(q, k, v, *, splits: int, scale: float | None = None):
    """Flash-Decoding's first phase: one query q (B, Hq, 1, D) over k, v (B, Hkv, S, D) cut into
    ``splits`` chunks of near-equal length (1 .. S of them). Returns (outputs (splits, B, Hq, 1, D),
    each normalised within its chunk, lses (splits, B, Hq, 1), each chunk's log-sum-exp);
    ``merge_partials`` combines them."""
    splits = _check_decode(q, k, v, splits)
    scale = _scale(scale, q.shape[-1])
    qg = rearrange(q, "b (h g) t d -> b h g t d", h=k.shape[1]) * scale  # (B, Hkv, G, 1, D)
    S = k.shape[2]
    bounds = [i * S // splits for i in range(splits + 1)]
    outputs, lses = [], []
    for a, b in zip(bounds, bounds[1:], strict=False):  # each chunk: a softmax over its own keys
        s = qg @ k[:, :, None, a:b].transpose(-2, -1)  # (B, Hkv, G, 1, b - a)
        lse = torch.logsumexp(s, dim=-1)  # (B, Hkv, G, 1)
        o = torch.exp(s - lse[..., None]) @ v[:, :, None, a:b]  # (B, Hkv, G, 1, D)
        outputs.append(rearrange(o, "b h g t d -> b (h g) t d"))
        lses.append(rearrange(lse, "b h g t -> b (h g) t"))
    return torch.stack(outputs), torch.stack(lses)


def merge_partials(outputs, lses) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash-Decoding's second phase, exact: outputs (n, ..., D) normalised each over its own keys,
    lses (n, ...) their log-sum-exps (lists of tensors are stacked). Returns (o (..., D), lse (...))
    with lse = logsumexp_i lse_i and o = sum_i exp(lse_i - lse) o_i: each part weighted by its share
    of the softmax's mass. A part with lse = -inf (it saw no key) weighs nothing. The order of the
    parts does not matter (up to rounding)."""
    outputs = torch.stack(list(outputs)) if isinstance(outputs, (list, tuple)) else outputs
    lses = torch.stack(list(lses)) if isinstance(lses, (list, tuple)) else lses
    _check_float("outputs", outputs)
    _check_float("lses", lses)
    if outputs.ndim < 2 or outputs.shape[0] == 0 or lses.shape != outputs.shape[:-1]:
        raise BadValue(
            f"lses must be outputs' shape without its last dim, with at least one part: outputs "
            f"{tuple(outputs.shape)}, lses {tuple(lses.shape)}",
            arg="lses",
        )
    lse = torch.logsumexp(lses, dim=0)  # (...)
    w = torch.exp(lses - lse)[..., None]  # (n, ..., 1): the parts' shares, summing to 1
    return torch.where(w > 0, w * outputs, 0.0).sum(0), lse


def split_decode(q, k, v, *, splits: int, scale: float | None = None) -> torch.Tensor:
    """One decode step's attention, Flash-Decoding's way: ``decode_partials`` over ``splits``
    chunks, then ``merge_partials``. q (B, Hq, 1, D), k, v (B, Hkv, S, D): (B, Hq, 1, D), equal to
    attention over all S."""
    return merge_partials(*decode_partials(q, k, v, splits=splits, scale=scale))[0]


def attention_bytes(
    B: int,
    Hq: int,
    Hkv: int,
    T: int,
    S: int,
    D: int,
    *,
    tile_q: int,
    tile_k: int,
    itemsize: int = 4,
) -> dict[str, int]:
    """What each way holds beyond its inputs, by arithmetic: the model ``bench/attention`` prints
    beside its measurement. ``scores``: one (B, Hq, T, S) matrix. ``materialised``: two of them (the
    scores and the scaled scores, then the scaled scores and their softmax, are alive together), the
    causal mask and its negation (T x S bools), and k, v repeated to Hq heads when Hkv < Hq.
    ``tiled``: O, the lse, and a working set that does not grow with T, counted as if all were alive
    at once (an upper bound: which step of a tile holds most depends on the tile sizes): per head
    four (tile_q, tile_k) blocks, three (tile_q, D) arrays (the scaled queries, the old and new
    unnormalised output), the key and value tiles broadcast to every query head of the group, two
    rows of tile_q (the new maximum, the rescaling), and the diagonal's mask with its positions.
    """
    for name, value in [("B", B), ("Hq", Hq), ("Hkv", Hkv), ("T", T), ("S", S), ("D", D)]:
        positive_int(name, value)
    o = B * Hq * T * D * itemsize
    scores = B * Hq * T * S * itemsize
    repeated = 2 * B * Hq * S * D * itemsize if Hkv < Hq else 0
    tq, tk = min(tile_q, T), min(tile_k, S)
    working = B * Hq * (4 * tq * tk + 3 * tq * D + 2 * tk * D + 2 * tq) * itemsize
    working += tq * tk + 8 * (tq + tk)  # the mask (bools) and the positions (int64) it compares
    return {
        "scores": scores,
        "materialised": 2 * scores + 2 * T * S + repeated,
        "tiled": o + B * Hq * T * max(itemsize, 4) + working,
    }


__all__ = [
    "DEFAULT_TILE",
    "attention_bytes",
    "decode_partials",
    "materialised_attention",
    "merge_partials",
    "online_softmax",
    "softmax_stats",
    "split_decode",
    "tile_plan",
    "tiled_attention",
]
