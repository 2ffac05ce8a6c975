"""Chapter 10's checkers: correct answers pass, each named slip is named, and a bad answer gets a
short verdict (ar_lab.course.checkers.attention_checks)."""

from __future__ import annotations

import math

import pytest
import torch

from ar_lab.course.checkers.attention_checks import (
    check_online_softmax,
    check_split,
    check_tile_memory,
    check_tiled,
    softmax_mistakes,
    split_mistakes,
    tiled_mistakes,
)
from ar_lab.course.checkers.checks import CheckFailed
from ar_lab.model.tiled import materialised_attention

# --- answers, right and with each slip, as a learner writes them ---------------------------


def softmax_answer(x, chunk, slip=None):
    m = torch.full(x.shape[:-1], float("-inf"))
    ell = torch.zeros(x.shape[:-1])
    for c in x.split(chunk, dim=-1):
        m_new = torch.maximum(m, c.amax(-1))
        if slip == "unshifted":
            ell = ell + torch.exp(c).sum(-1)
        elif slip == "no rescale":
            ell = ell + torch.exp(c - m_new[..., None]).sum(-1)
        else:
            ell = ell * torch.exp(m - m_new) + torch.exp(c - m_new[..., None]).sum(-1)
        m = m_new
    if slip == "unshifted":
        return torch.exp(x) / ell[..., None]
    if slip == "per chunk":
        return torch.cat([torch.exp(c - c.amax(-1, keepdim=True)) / torch.exp(
            c - c.amax(-1, keepdim=True)).sum(-1, keepdim=True) for c in x.split(chunk, -1)], -1)
    return torch.exp(x - m[..., None]) / ell[..., None]


def tiled_answer(q, k, v, offset, tile_q, tile_k, slip=None):
    B, Hq, T, D = q.shape
    G = Hq // k.shape[1]
    if slip == "cycle":
        k, v = k.repeat(1, G, 1, 1), v.repeat(1, G, 1, 1)
    else:
        k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    out = torch.empty_like(q)
    for i0 in range(0, T, tile_q):
        i1 = min(i0 + tile_q, T)
        qt = q[:, :, i0:i1] / (1.0 if slip == "no scale" else math.sqrt(D))
        first = i0 if slip == "mask offset" else offset + i0
        pos = torch.arange(first, first + i1 - i0)[:, None]
        m = torch.full((B, Hq, i1 - i0), float("-inf"))
        ell, acc = torch.zeros(B, Hq, i1 - i0), torch.zeros(B, Hq, i1 - i0, D)
        end = {"skip first": offset + i0 + 1, "skip offset": i1}.get(slip, offset + i1)
        for j0 in range(0, end, tile_k):
            j1 = min(j0 + tile_k, offset + i1)
            s = qt @ k[:, :, j0:j1].transpose(-2, -1)
            if j1 - 1 > offset + i0 and slip != "unmasked":
                hidden = {
                    "diagonal": torch.arange(j0, j1) >= pos,
                    "ahead": torch.arange(j0, j1) > pos + 1,
                    "local": torch.arange(j1 - j0) > torch.arange(i1 - i0)[:, None],
                }.get(slip, torch.arange(j0, j1) > pos)
                s = s.masked_fill(hidden, float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            alpha = torch.exp(m - m_new)
            p = torch.exp(s - m_new[..., None])
            ell = ell * alpha + p.sum(-1)
            acc = (acc if slip == "unrescaled" else acc * alpha[..., None]) + p @ v[:, :, j0:j1]
            m = m_new
        out[:, :, i0:i1] = acc / ell[..., None]
    return out


def split_answer(q, k, v, splits, slip=None):
    S = k.shape[2]
    outs, lses, sizes = [], [], []
    for i in range(splits):
        a, b = i * S // splits, (i + 1) * S // splits
        s = q @ k[:, :, a:b].transpose(-2, -1) / math.sqrt(q.shape[-1])
        lse = torch.logsumexp(s, -1)
        outs.append(torch.exp(s - lse[..., None]) @ v[:, :, a:b])
        lses.append(lse)
        sizes.append(b - a)
    outs, lses = torch.stack(outs), torch.stack(lses)
    if slip == "average":
        return outs.mean(0)
    if slip == "length":
        return sum(n / S * o for n, o in zip(sizes, outs, strict=True))
    w = torch.exp(lses - torch.logsumexp(lses, 0))
    return (w[..., None] * outs).sum(0)


def qkv(B, Hq, Hkv, T, S, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Hq, T, D, generator=g), torch.randn(B, Hkv, S, D, generator=g),
            torch.randn(B, Hkv, S, D, generator=g))


def rows():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 37, generator=g) * 3
    x[1] = torch.linspace(-5, 9, 37)  # the maximum grows chunk after chunk
    x[2] += 200  # exp overflows float32 unless shifted
    return x


# --- exercise 1 --------------------------------------------------------------------------


def test_a_right_online_softmax_passes():
    for chunk in (1, 5, 8, 37):
        check_online_softmax("softmax", softmax_answer, rows(), chunk)


@pytest.mark.parametrize("slip, named", [
    ("no rescale", "never rescaled"),
    ("per chunk", "each chunk on its own"),
    ("unshifted", "only at the end"),
])
def test_each_softmax_slip_is_named(slip, named):
    with pytest.raises(CheckFailed) as failed:
        check_online_softmax("softmax", lambda x, c: softmax_answer(x, c, slip), rows(), 8)
    assert named in (failed.value.mistake or ""), str(failed.value)


def test_the_softmax_mistakes_differ_from_the_answer():
    x = rows()[:2]
    for name, out in softmax_mistakes(x, 8).items():
        assert not torch.allclose(out, torch.softmax(x.double(), -1), atol=1e-4), name


# --- exercise 2 --------------------------------------------------------------------------

CASES = [  # B, Hq, Hkv, T, offset, D, tile_q, tile_k
    (2, 4, 2, 13, 5, 8, 4, 3),
    (1, 6, 3, 16, 0, 8, 5, 7),
    (1, 4, 1, 9, 20, 4, 3, 8),
]


@pytest.mark.parametrize("case", CASES)
def test_a_right_tiled_attention_passes(case):
    B, Hq, Hkv, T, offset, D, tq, tk = case
    q, k, v = qkv(B, Hq, Hkv, T, offset + T, D)
    check_tiled("tiled", tiled_answer, q, k, v, offset, tq, tk)


@pytest.mark.parametrize("slip, named", [
    ("diagonal", "hides the diagonal"),
    ("ahead", "next key"),
    ("local", "within the tile"),
    ("skip first", "tile's first query"),
    ("skip offset", "without the offset"),
    ("mask offset", "leaves out the offset"),
    ("unmasked", "diagonal tiles left unmasked"),
    ("unrescaled", "running output not rescaled"),
    ("cycle", "h % H_kv"),
    ("no scale", "not scaled"),
])
def test_each_tiled_slip_is_named(slip, named):
    q, k, v = qkv(2, 4, 2, 13, 18, 8)
    with pytest.raises(CheckFailed) as failed:
        check_tiled("tiled", lambda *a: tiled_answer(*a, slip=slip), q, k, v, 5, 4, 3)
    assert named in (failed.value.mistake or ""), str(failed.value)


def test_the_tiled_mistakes_differ_from_attention():
    q, k, v = qkv(1, 4, 2, 13, 18, 8)
    right = materialised_attention(q.double(), k.double(), v.double(), offset=5)
    for name, outs in tiled_mistakes(q, k, v, 5, 4, 3).items():
        for out in outs if isinstance(outs, tuple) else (outs,):
            assert not torch.allclose(out, right, atol=1e-4, equal_nan=True), name


def test_the_memory_check_passes_tiles_and_names_the_whole_matrix():
    peak = check_tile_memory("tiled", tiled_answer, T=512, tile=32)
    assert 0 < peak < 512 * 512 * 4 * 2 / 4
    def whole(q, k, v, offset, tq, tk):
        return materialised_attention(q, k, v, offset=offset)

    with pytest.raises(CheckFailed) as failed:
        check_tile_memory("tiled", whole, T=512, tile=32)
    assert "score matrix formed" in failed.value.mistake


# --- exercise 3 --------------------------------------------------------------------------


@pytest.mark.parametrize("splits", [1, 3, 7])
def test_a_right_split_decode_passes(splits):
    q, k, v = qkv(2, 3, 3, 1, 50, 8)
    check_split("split", split_answer, q, k, v, splits)


@pytest.mark.parametrize("slip, named", [("average", "averaged"), ("length", "chunk's length")])
def test_each_merge_slip_is_named(slip, named):
    q, k, v = qkv(2, 3, 3, 1, 50, 8)
    with pytest.raises(CheckFailed) as failed:
        check_split("split", lambda *a: split_answer(*a, slip=slip), q, k, v, 3)
    assert named in (failed.value.mistake or ""), str(failed.value)
    assert len(split_mistakes(q, k, v, 3)) >= 4


# --- bad answers: a short verdict, a stub's NotImplementedError kept -------------------------


@pytest.mark.parametrize("answer, cause", [
    (lambda *a: None, None),  # no tensor
    (lambda *a: torch.zeros(2), None),  # the wrong shape
    (lambda *a: 1 / 0, ZeroDivisionError),  # the learner's code raised
])
def test_a_bad_answer_gets_a_short_verdict(answer, cause):
    q, k, v = qkv(1, 2, 1, 5, 5, 4)
    for check in (lambda: check_tiled("t", answer, q, k, v, 0, 2, 2),
                  lambda: check_online_softmax("s", answer, rows(), 4),
                  lambda: check_split("d", answer, q[:, :, :1], k, v, 2)):
        with pytest.raises(CheckFailed) as failed:  # a verdict, not the checker's own error
            check()
        assert failed.value.mistake is None
        assert type(failed.value.__cause__) is cause if cause else failed.value.__cause__ is None


def test_a_stub_still_raises_not_implemented():
    def stub(*args):
        raise NotImplementedError()

    with pytest.raises(NotImplementedError):
        check_online_softmax("s", stub, rows(), 4)
