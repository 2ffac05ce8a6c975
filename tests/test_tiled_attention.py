"""Attention as engines compute it (chapter 10): online softmax, tiled causal attention with a
KV-cache offset and grouped heads, split-K decode, each pinned to torch's reference; the bad inputs;
and the peak-bytes count that shows the T x S matrix reach memory one way and not the other."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ar_lab.base.errors import BadType, BadValue
from ar_lab.model.tiled import (
    attention_bytes,
    decode_partials,
    materialised_attention,
    merge_partials,
    online_softmax,
    softmax_stats,
    split_decode,
    tile_plan,
    tiled_attention,
)
from ar_lab.perf.peak_bytes import PeakBytes, peak_bytes
from tests.raising import raises

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float64: dict(atol=1e-11, rtol=1e-11)}


def qkv(B, Hq, Hkv, T, S, D, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, T, D, generator=gen, dtype=dtype)
    k = torch.randn(B, Hkv, S, D, generator=gen, dtype=dtype)
    v = torch.randn(B, Hkv, S, D, generator=gen, dtype=dtype)
    return q, k, v


def sdpa(q, k, v, offset):
    """torch's reference, with the causal mask of a query block at offset .. offset + T - 1."""
    T, S = q.shape[2], k.shape[2]
    seen = torch.arange(S) <= torch.arange(offset, offset + T)[:, None]  # (T, S)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=seen, enable_gqa=k.shape[1] != q.shape[1]
    )


@st.composite
def cases(draw):
    """Shapes, a causal offset, a GQA ratio, tile sizes (non-dividing ones included), a dtype."""
    B, Hkv, G = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    T, offset, D = draw(st.integers(1, 24)), draw(st.integers(0, 24)), draw(st.integers(1, 12))
    S = offset + T
    # at most ~7 x 7 tiles (fast), tile sizes that divide T and S and ones that do not
    tile_q = draw(st.integers(max(1, T // 6), T))
    tile_k = draw(st.integers(max(1, S // 6), S))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    return dict(
        B=B,
        Hq=Hkv * G,
        Hkv=Hkv,
        T=T,
        S=S,
        D=D,
        offset=offset,
        tile_q=tile_q,
        tile_k=tile_k,
        dtype=dtype,
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=220)
@given(cases())
def test_tiled_attention_equals_sdpa(c):
    q, k, v = qkv(c["B"], c["Hq"], c["Hkv"], c["T"], c["S"], c["D"], c["dtype"], c["seed"])
    out, lse = tiled_attention(
        q, k, v, offset=c["offset"], tile_q=c["tile_q"], tile_k=c["tile_k"], return_lse=True
    )
    torch.testing.assert_close(out, sdpa(q, k, v, c["offset"]), **TOL[c["dtype"]])
    scores = q @ k.repeat_interleave(c["Hq"] // c["Hkv"], 1).transpose(-2, -1) / math.sqrt(c["D"])
    seen = torch.arange(c["S"]) <= torch.arange(c["offset"], c["S"])[:, None]
    torch.testing.assert_close(
        lse, torch.logsumexp(scores.masked_fill(~seen, -math.inf), -1), **TOL[c["dtype"]]
    )


@settings(max_examples=40)
@given(cases())
def test_materialised_attention_equals_sdpa(c):
    q, k, v = qkv(c["B"], c["Hq"], c["Hkv"], c["T"], c["S"], c["D"], c["dtype"], c["seed"])
    torch.testing.assert_close(
        materialised_attention(q, k, v, offset=c["offset"]),
        sdpa(q, k, v, c["offset"]),
        **TOL[c["dtype"]],
    )


def test_tiles_of_one_and_a_scale_of_ones_own():
    q, k, v = qkv(1, 4, 2, 7, 10, 5)
    ref = sdpa(q, k, v, 3)
    torch.testing.assert_close(
        tiled_attention(q, k, v, offset=3, tile_q=1, tile_k=1), ref, **TOL[q.dtype]
    )
    seen = torch.arange(10) <= torch.arange(3, 10)[:, None]
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=seen, enable_gqa=True, scale=0.3)
    torch.testing.assert_close(tiled_attention(q, k, v, offset=3, scale=0.3), ref, **TOL[q.dtype])
    assert tiled_attention(q, k, v, offset=3).shape == (1, 4, 7, 5)  # default tiles: capped at T, S


def test_bfloat16_accumulates_in_float32():
    q, k, v = qkv(1, 2, 1, 40, 40, 16)
    out = tiled_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), tile_q=8, tile_k=8)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), sdpa(q, k, v, 0), atol=3e-2, rtol=3e-2)


@settings(max_examples=60)
@given(st.integers(1, 30), st.integers(0, 40), st.data())
def test_tile_plan_visits_each_seen_key_once_and_skips_tiles_above_the_diagonal(T, offset, data):
    tile_q, tile_k = data.draw(st.integers(1, T)), data.draw(st.integers(1, offset + T))
    plan = tile_plan(T, offset=offset, tile_q=tile_q, tile_k=tile_k)
    assert [i0 for i0, _, _ in plan] == list(range(0, T, tile_q)) and plan[-1][1] == T
    for i0, i1, keys in plan:
        covered = [j for j0, j1, _ in keys for j in range(j0, j1)]
        assert covered == list(range(offset + i1))  # keys 0 .. the tile's last query, once each
        for j0, j1, masked in keys:
            assert j0 <= offset + i1 - 1  # never a tile wholly above the diagonal
            assert masked == (
                j1 - 1 > offset + i0
            )  # masked exactly where a key is later than a query


def test_tile_plan_counts_a_triangle():
    n = 8  # T = S = 8 tiles of 16: n (n + 1) / 2 tiles on or below the diagonal, n of them masked
    plan = tile_plan(128, tile_q=16, tile_k=16)
    visited = [m for _, _, keys in plan for _, _, m in keys]
    assert len(visited) == n * (n + 1) // 2 and sum(visited) == n


# -------------------------------------------------------------------------------- online softmax


rows = st.tuples(st.integers(1, 3), st.integers(1, 30), st.integers(0, 2**16), st.data())


@given(rows)
def test_online_softmax_equals_softmax(args):
    R, N, seed, data = args
    chunk = data.draw(st.integers(1, N))
    x = torch.randn(R, N, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 30
    hide = data.draw(st.lists(st.integers(0, N - 1), max_size=N - 1, unique=True))
    x[:, hide] = -math.inf  # masked entries count for nothing; every row keeps one finite value
    torch.testing.assert_close(online_softmax(x, chunk=chunk), torch.softmax(x, -1))
    m, ell = softmax_stats(x, chunk=chunk)
    torch.testing.assert_close(m, x.amax(-1))
    torch.testing.assert_close(m + ell.log(), torch.logsumexp(x, -1))


def test_running_sum_is_rescaled_when_the_maximum_grows():
    x = torch.tensor([0.0, 10.0, 20.0], dtype=torch.float64)  # a new maximum in every chunk
    m, ell = softmax_stats(x, chunk=1)
    assert m == 20 and ell == pytest.approx(math.exp(-20) + math.exp(-10) + 1, rel=1e-15)
    big = torch.tensor([1000.0, 1001.0])  # exp(1000) overflows float32; the running max never does
    torch.testing.assert_close(online_softmax(big, chunk=1), torch.softmax(big, -1))


def test_a_row_of_minus_infinity_gives_what_torch_gives():
    x = torch.tensor([[-math.inf] * 4, [-math.inf, -math.inf, 1.0, 2.0]])
    m, ell = softmax_stats(x, chunk=2)
    assert m[0] == -math.inf and ell[0] == 0 and torch.isfinite(ell[1])
    torch.testing.assert_close(online_softmax(x, chunk=2), torch.softmax(x, -1), equal_nan=True)


# -------------------------------------------------------------------------------- split-K decode


@settings(max_examples=60)
@given(st.integers(1, 2), st.integers(1, 3), st.integers(1, 3), st.integers(1, 60), st.data())
def test_split_decode_equals_sdpa(B, Hkv, G, S, data):
    splits = data.draw(st.integers(1, S))
    q, k, v = qkv(B, Hkv * G, Hkv, 1, S, 8, torch.float64, seed=S)
    torch.testing.assert_close(split_decode(q, k, v, splits=splits), sdpa(q, k, v, S - 1))


@given(st.integers(2, 8), st.randoms(use_true_random=False))
def test_merge_is_exact_and_order_independent(splits, rnd):
    q, k, v = qkv(1, 4, 2, 1, 50, 8, torch.float64)
    outputs, lses = decode_partials(q, k, v, splits=splits)
    order = list(range(splits))
    rnd.shuffle(order)
    o1, lse1 = merge_partials(outputs, lses)
    o2, lse2 = merge_partials([outputs[i] for i in order], [lses[i] for i in order])
    torch.testing.assert_close(o1, o2)
    torch.testing.assert_close(lse1, lse2)
    _, lse = tiled_attention(q, k, v, offset=49, return_lse=True)
    torch.testing.assert_close(lse1, lse)  # the merged lse is the whole row's


def test_each_partial_is_attention_over_its_own_chunk():
    q, k, v = qkv(1, 2, 2, 1, 10, 4, torch.float64)
    outputs, lses = decode_partials(q, k, v, splits=3)  # chunks 0..2, 3..5, 6..9
    assert outputs.shape == (3, 1, 2, 1, 4) and lses.shape == (3, 1, 2, 1)
    torch.testing.assert_close(
        outputs[2], F.scaled_dot_product_attention(q, k[:, :, 6:], v[:, :, 6:])
    )


def test_a_part_that_saw_nothing_weighs_nothing():
    outputs = torch.tensor(
        [[1.0, 2.0], [float("nan"), float("nan")]]
    )  # (n=2, D=2), part 1 empty (0/0)
    lses = torch.tensor([0.5, -math.inf])
    o, lse = merge_partials(outputs, lses)
    torch.testing.assert_close(o, torch.tensor([1.0, 2.0]))
    assert lse == 0.5


# -------------------------------------------------------------------------------- bad input


def bad_calls():
    q, k, v = qkv(1, 4, 2, 6, 6, 8)
    empty = torch.zeros(1, 4, 0, 8)
    return [
        (BadValue, "q", lambda: tiled_attention(empty, k[:, :, :0], v[:, :, :0])),  # T = 0
        (BadValue, "tile_q", lambda: tiled_attention(q, k, v, tile_q=0)),
        (BadValue, "tile_q", lambda: tiled_attention(q, k, v, tile_q=7)),  # larger than T
        (BadValue, "tile_k", lambda: tiled_attention(q, k, v, tile_k=0)),
        (BadValue, "tile_k", lambda: tiled_attention(q, k, v, tile_k=7)),  # larger than S
        (BadValue, "k", lambda: tiled_attention(q, *qkv(1, 3, 3, 6, 6, 8)[1:])),  # 4 % 3 heads
        (BadValue, "k", lambda: tiled_attention(q, *qkv(2, 4, 2, 6, 6, 8)[1:])),  # batch
        (BadValue, "k", lambda: tiled_attention(q, *qkv(1, 4, 2, 6, 6, 4)[1:])),  # head dim
        (BadValue, "v", lambda: tiled_attention(q, k, v[:, :1])),
        (BadType, "q", lambda: tiled_attention(q.long(), k, v)),
        (BadType, "k", lambda: tiled_attention(q, k.int(), v)),
        (BadType, "v", lambda: tiled_attention(q, k, v.double())),
        (BadType, "q", lambda: tiled_attention(q.tolist(), k, v)),
        (BadValue, "q", lambda: tiled_attention(q[0], k, v)),
        (BadValue, "offset", lambda: tiled_attention(q, k, v, offset=-1)),
        (BadValue, "offset", lambda: tiled_attention(q, k, v, offset=2)),  # S != offset + T
        (BadValue, "scale", lambda: tiled_attention(q, k, v, scale=0.0)),
        (BadValue, "offset", lambda: materialised_attention(q, k, v, offset=1)),
        (BadType, "q", lambda: materialised_attention(q.bool(), k, v)),
        (BadValue, "chunk", lambda: online_softmax(q, chunk=0)),
        (BadValue, "chunk", lambda: online_softmax(q, chunk=9)),
        (BadType, "x", lambda: online_softmax(torch.arange(4), chunk=2)),
        (BadValue, "x", lambda: softmax_stats(torch.zeros(3, 0), chunk=1)),
        (BadValue, "q", lambda: split_decode(q, k, v, splits=2)),  # six queries: not one
        (BadValue, "splits", lambda: split_decode(q[:, :, :1], k, v, splits=0)),
        (BadValue, "splits", lambda: split_decode(q[:, :, :1], k, v, splits=7)),
        (BadType, "q", lambda: split_decode(q[:, :, :1].half().int(), k, v, splits=2)),
        (BadValue, "lses", lambda: merge_partials(torch.zeros(2, 3, 4), torch.zeros(3, 3))),
        (BadType, "lses", lambda: merge_partials(torch.zeros(2, 3, 4), torch.zeros(2, 3).long())),
        (BadValue, "T", lambda: tile_plan(0, tile_q=1, tile_k=1)),
        (BadType, "fn", lambda: peak_bytes(q)),
    ]


@pytest.mark.parametrize("i", range(len(bad_calls())))
def test_bad_input_is_refused_naming_the_argument(i):
    kind, arg, call = bad_calls()[i]
    with raises(kind, arg):
        call()


# -------------------------------------------------------------------------------- peak bytes


def test_peak_bytes_counts_a_known_pattern():
    with PeakBytes() as tracker:
        a = torch.empty(1000)  # 4000 bytes
        b = torch.empty(500)  # 2000: 6000 alive
        a.view(10, 100).add_(1)  # a view and an in-place op: no new storage
        torch.add(b, 1, out=b)  # out=: no new storage
        del a  # 2000 alive
        c = torch.empty(250)  # 3000 alive
    assert (tracker.peak, tracker.live) == (6000, 3000)
    del b, c
    assert tracker.live == 0
    x = torch.ones(100)  # made before: not counted; its product is
    assert peak_bytes(lambda: x * 2) == 400
    assert peak_bytes(lambda: (x * 2).sum()) == 404  # the product and then the sum held together


def peaks(q, k, v, tile):
    """Peak bytes of the tiled way and of the materialised way on these inputs."""
    tiled = peak_bytes(lambda: tiled_attention(q, k, v, tile_q=tile, tile_k=tile))
    return tiled, peak_bytes(lambda: materialised_attention(q, k, v))


def test_the_meta_device_counts_what_the_cpu_allocates():
    q, k, v = qkv(1, 4, 2, 96, 96, 16)
    assert peaks(q, k, v, 32) == peaks(*(x.to("meta") for x in (q, k, v)), 32)


def test_tiled_peak_grows_linearly_and_materialised_quadratically():
    """The T x S matrix reaches memory one way only: at 2T the materialised peak is ~4x, the tiled
    ~2x; the tiled peak is exactly affine in T (its tiles' working set does not grow), matching the
    model."""
    B, Hq, Hkv, D, tile = 1, 2, 1, 64, 32
    lengths = [512, 1024, 2048]
    with torch.inference_mode():
        t, m = zip(*(peaks(*qkv(B, Hq, Hkv, T, T, D), tile) for T in lengths), strict=True)
    assert 1.8 < t[2] / t[1] < 2.0 and 3.8 < m[2] / m[1] < 4.0, (t, m)
    assert (
        t[2] - t[1] == 2 * (t[1] - t[0]) == B * Hq * 1024 * (D + 1) * 4
    )  # the O and lse of 1024 more
    model = [attention_bytes(B, Hq, Hkv, T, T, D, tile_q=tile, tile_k=tile) for T in lengths]
    assert all(0.85 < p / mb["tiled"] <= 1 for p, mb in zip(t, model, strict=True)), (t, model)
    assert all(abs(p / mb["materialised"] - 1) < 0.05 for p, mb in zip(m, model, strict=True))
    assert all(p > mb["scores"] for p, mb in zip(m, model, strict=True))  # the T x S matrix is held
    assert all(p < mb["scores"] / 5 for p, mb in zip(t, model, strict=True))  # and never here
    assert t[-1] < model[-1]["scores"] / 25
