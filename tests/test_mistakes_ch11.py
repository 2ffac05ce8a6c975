"""Chapter 11's named mistakes: RMSNorm, SwiGLU, RoPE, the modern block and the rolling cache. Each
classic slip, written out by hand, fails its check naming it; the right answer passes; bad output
(a wrong shape, an exception) gets a short verdict."""

import pytest
import torch
import torch.nn.functional as F

from ar_lab.course.checkers.checks import CheckFailed
from ar_lab.course.checkers.modern_checks import (
    check_block,
    check_rms_norm,
    check_rolling,
    check_rope,
    check_swiglu,
)
from tests.raising import fails_naming


def rms_norm(x, weight, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def swiglu(x, fc, proj, act=F.silu, swap=False):
    gate, up = (x @ fc.T).chunk(2, dim=-1)
    if swap:
        gate, up = up, gate
    return (act(gate) * up) @ proj.T


def rope(x, pos, theta=10000.0, *, interleaved=False, exponent=2, sign=1.0):
    D = x.shape[-1]
    inv = theta ** (-exponent * torch.arange(D // 2).float() / D)
    ang = torch.arange(pos, pos + x.shape[2]).float()[:, None] * inv
    cos, sin = ang.cos(), sign * ang.sin()
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).flatten(-2)
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def test_norm_and_mlp_pass_and_their_slips_are_named():
    check_rms_norm(rms_norm)
    check_swiglu(swiglu)
    for slip, named in [
        (lambda x, w, eps: (x - x.mean(-1, keepdim=True))
         * torch.rsqrt(x.var(-1, keepdim=True, unbiased=False) + eps) * w, "LayerNorm's centring"),
        (lambda x, w, eps: x / (x.pow(2).mean(-1, keepdim=True).sqrt() + eps) * w,
         "eps added outside the square root"),
        (lambda x, w, eps: rms_norm(x, 1.0, eps), "the weight left out"),
        (lambda x, w, eps: x * torch.rsqrt(x.pow(2).mean() + eps) * w, "one RMS over the whole"),
    ]:
        fails_naming(named, check_rms_norm, slip)
    for slip, named in [
        (lambda x, fc, p: swiglu(x, fc, p, swap=True), "SiLU on the up half"),
        (lambda x, fc, p: swiglu(x, fc, p, act=F.gelu), "GELU instead of SiLU"),
        (lambda x, fc, p: swiglu(x, fc, p, act=torch.sigmoid), "a sigmoid instead of SiLU"),
    ]:
        fails_naming(named, check_swiglu, slip)


def test_rope_passes_at_every_offset_and_its_slips_are_named():
    for pos in (0, 7, 1000):
        check_rope(rope, pos)
    check_rope(rope, 3, theta=500000.0)
    for slip, named in [
        (lambda x, pos, theta: rope(x, pos, theta, interleaved=True), "rotating adjacent pairs"),
        (lambda x, pos, theta: rope(x, 0, theta), "positions counted from 0"),
        (lambda x, pos, theta: rope(x, pos, theta, exponent=1), "theta^(-i/D)"),
        (lambda x, pos, theta: rope(x, pos, theta, sign=-1.0), "the rotation the other way"),
    ]:
        fails_naming(named, check_rope, slip, 7)


class FullCache:  # the chapter's contiguous cache
    def __init__(self, cfg, max_len):
        shape = (1, cfg.kv_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape) for _ in range(cfg.n_layer)]
        self.v = [torch.zeros(shape) for _ in range(cfg.n_layer)]

    def write(self, layer, k, v, pos):
        self.k[layer][:, :, pos : pos + k.shape[2]] = k
        self.v[layer][:, :, pos : pos + k.shape[2]] = v

    def read(self, layer, q_pos):
        S = int(q_pos[-1]) + 1
        return self.k[layer][:, :, :S], self.v[layer][:, :, :S], torch.arange(S) <= q_pos[:, None]


def make_block(slip=None):
    def my_block(x, w, cache, layer, pos, cfg):
        B, T, C = x.shape
        H, Hkv, D = cfg.n_head, cfg.kv_heads, cfg.head_dim
        h = rms_norm(x, w["norm1"], cfg.norm_eps)
        q, k, v = (h @ w["qkv"].T).view(B, T, -1, D).transpose(1, 2).split([H, Hkv, Hkv], dim=1)
        at = 0 if slip == "from 0" else pos
        if slip == "after caching":
            cache.write(layer, k, v, pos)
        q, k = rope(q, at, cfg.rope_theta), rope(k, at, cfg.rope_theta)
        if slip != "after caching":
            cache.write(layer, k, v, pos)
        k, v, seen = cache.read(layer, torch.arange(pos, pos + T))
        G = H // Hkv
        if slip == "repeat":
            k, v = k.repeat(1, G, 1, 1), v.repeat(1, G, 1, 1)
        else:
            k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None if slip == "no mask" else seen)
        a = x + y.transpose(1, 2).reshape(B, T, C) @ w["proj"].T
        return a + swiglu(rms_norm(x if slip == "parallel" else a, w["norm2"], cfg.norm_eps),
                          w["fc"], w["mlp_proj"])
    return my_block


def test_the_block_passes_and_its_slips_are_named():
    check_block(make_block(), FullCache)
    check_block(make_block(), FullCache, seed=3)
    for slip, named in [
        ("after caching", "rotated after caching"),
        ("from 0", "rotated as positions from 0"),
        ("repeat", "KV head h % H_kv"),
        ("no mask", "no causal mask"),
        ("parallel", "the MLP reading the block's input"),
    ]:
        fails_naming(named, check_block, make_block(slip), FullCache)
    with pytest.raises(CheckFailed) as info:  # a short verdict, not a traceback
        check_block(lambda x, w, cache, layer, pos, cfg: x[0], FullCache)
    assert info.value.mistake is None and info.value.__cause__ is None


def make_rolling(slip=None):
    class Rolling:
        def __init__(self, cfg, window, sinks=0, spare=0):
            self.window, self.sinks = window, sinks
            self.ring = window + (0 if slip == "no spare" else spare)
            keep = 0 if slip == "no sinks" else sinks
            self.offset = keep
            places = keep + self.ring + (sinks - keep)
            shape = (1, cfg.kv_heads, places, cfg.head_dim)
            self.k = [torch.zeros(shape) for _ in range(cfg.n_layer)]
            self.v = [torch.zeros(shape) for _ in range(cfg.n_layer)]
            self.held = [torch.full((places,), -1) for _ in range(cfg.n_layer)]

        def write(self, layer, k, v, pos):
            p = torch.arange(pos, pos + k.shape[2])
            S = self.offset
            place = torch.where(p < S, p, S + (p - S) % self.ring)
            self.k[layer][:, :, place], self.v[layer][:, :, place] = k, v
            self.held[layer][place] = p

        def read(self, layer, q_pos):
            j, q = self.held[layer], q_pos[:, None]
            near = (q - j <= self.window) if slip == "wide" else (q - j < self.window)
            seen = (j <= q) if slip != "future" else torch.ones_like(j <= q)
            if slip != "empty":
                seen = seen & (j >= 0)
            return self.k[layer], self.v[layer], seen & (near | (j < self.sinks))
    return Rolling


def test_the_rolling_cache_passes_and_its_slips_are_named():
    check_rolling(make_rolling())
    check_rolling(make_rolling(), window=5, sinks=0, spare=3, seed=1)
    for slip, named in [
        ("no sinks", "the sinks not kept"),
        ("wide", "one position too wide"),
        ("empty", "an empty place seen"),
        ("future", "the causal rule left out"),
    ]:
        fails_naming(named, check_rolling, make_rolling(slip))
    # a ring with no spare places: a chunk's write overwrites keys its first queries still see
    fails_naming("a write that overwrote keys still seen", check_rolling, make_rolling("no spare"))


@pytest.mark.parametrize("bad", [None, "text", torch.zeros(2, 3, dtype=torch.long)])
def test_a_malformed_answer_gets_a_verdict_not_a_traceback(bad):
    for check, answer in [
        (check_rms_norm, lambda x, w, eps: bad),
        (check_swiglu, lambda x, fc, p: bad),
        (lambda fn: check_rope(fn, 3), lambda x, pos, theta: bad),
        (lambda fn: check_block(fn, FullCache), lambda x, w, cache, layer, pos, cfg: bad),
    ]:
        with pytest.raises(CheckFailed):
            check(answer)
    # a cache whose read returns the wrong things, or whose constructor fails
    rolling = make_rolling()
    rolling.read = lambda self, layer, q_pos: bad
    with pytest.raises(CheckFailed):
        check_rolling(rolling)
    with pytest.raises(CheckFailed):
        check_rolling(lambda cfg, window, sinks, spare: 1 / 0)
