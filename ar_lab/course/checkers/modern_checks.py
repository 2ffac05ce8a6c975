"""Chapter 11's checkers for the modern block: a learner's RMSNorm, SwiGLU, rotary embedding, block
and rolling cache, against the package's arithmetic, with the classic slips named.

Each checker runs the learner's code on small cases (``run_answer``: their exception becomes a short
verdict), checks shapes and types first, then compares with the package; on a mismatch it computes
what each named slip gives on the same input and names the one the answer equals. The block is
checked on a random two-layer Llama-shaped model (grouped heads, G = 2) through the chapter's cache
interface (``write(layer, k, v, pos)``, ``read(layer, q_pos) -> (k, v, seen)``): what it caches
(rotated keys, at their own positions), then its output. The rolling cache is driven directly:
random keys written in chunks, and after each write every query's visible positions are read back
from what ``read`` returns and compared with the window-and-sinks rule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F

from ar_lab.course.checkers.checks import run_answer, verdict
from ar_lab.model.attention import Keys, Span, Store, attention, visible
from ar_lab.model.block import BlockSpec, BlockWeights, Rope, block
from ar_lab.model.cache import KVCache
from ar_lab.model.config import GPTConfig
from ar_lab.model.gpt import GPT


def _tensor(what: str, got, shape: tuple[int, ...], hint: str) -> torch.Tensor:
    if not isinstance(got, torch.Tensor):
        raise verdict(what, f"expected a tensor, got {type(got).__name__}", hint)
    if tuple(got.shape) != shape:
        raise verdict(what, f"expected shape {shape}, got {tuple(got.shape)}", hint)
    if not got.dtype.is_floating_point:
        raise verdict(what, f"expected floating-point values, got {got.dtype}", hint)
    return got.float()


def _judge(what: str, got: torch.Tensor, want: torch.Tensor, slips: dict, hint: str,
           atol: float = 1e-4) -> None:
    """Pass if got equals want; else name the slip got equals, or say how far it is."""
    if torch.allclose(got, want, atol=atol, rtol=1e-4):
        return
    for mistake, value in slips.items():
        if value.shape == got.shape and torch.allclose(got, value, atol=atol, rtol=1e-4):
            raise verdict(what, f"your output is what {mistake} gives", hint, mistake)
    err = float((got - want).abs().max())
    raise verdict(what, f"largest difference from the expected output: {err:.3g}", hint)


def rms_norm_mistakes(x, weight, eps) -> dict[str, torch.Tensor]:
    ms = x.pow(2).mean(-1, keepdim=True)
    centred = x - x.mean(-1, keepdim=True)
    return {
        "LayerNorm's centring (the mean subtracted first)":
            centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps) * weight,
        "eps added outside the square root": x / (ms.sqrt() + eps) * weight,
        "the weight left out": x * torch.rsqrt(ms + eps),
        "one RMS over the whole tensor instead of one per row":
            x * torch.rsqrt(x.pow(2).mean() + eps) * weight,
    }


def check_rms_norm(fn: Callable, eps: float = 1e-5, seed: int = 0, hint: str = "") -> None:
    """``fn(x, weight, eps) -> x / sqrt(mean(x**2) + eps) * weight`` over the last dimension."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 5, 16, generator=g) + 0.5
    x[1] *= 1e-3  # rows whose mean square is below eps: where eps's place shows
    weight = torch.rand(16, generator=g) + 0.5
    what = f"my_rms_norm(<{tuple(x.shape)}>, weight, eps={eps})"
    got = _tensor(what, run_answer(what, fn, x.clone(), weight.clone(), eps, hint=hint),
                  tuple(x.shape), hint)
    want = F.rms_norm(x, (16,), weight, eps)
    _judge(what, got, want, rms_norm_mistakes(x, weight, eps), hint, atol=1e-5)


def swiglu_mistakes(x, fc, proj) -> dict[str, torch.Tensor]:
    gate, up = (x @ fc.T).chunk(2, dim=-1)
    return {
        "SiLU on the up half (the halves swapped)": (F.silu(up) * gate) @ proj.T,
        "GELU instead of SiLU": (F.gelu(gate) * up) @ proj.T,
        "no gating (SiLU of the gate half, the up half unused)": F.silu(gate) @ proj.T,
        "a sigmoid instead of SiLU (x * sigmoid(x))": (torch.sigmoid(gate) * up) @ proj.T,
    }


def check_swiglu(fn: Callable, seed: int = 0, hint: str = "") -> None:
    """``fn(x, fc_weight, proj_weight) -> (silu(gate) * up) @ proj_weight.T`` where gate | up =
    x @ fc_weight.T (the gate first)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 4, 16, generator=g)
    fc, proj = torch.randn(48, 16, generator=g) / 4, torch.randn(16, 24, generator=g) / 5
    what = "my_swiglu(<(2, 4, 16)>, fc_weight <(48, 16)>, proj_weight <(16, 24)>)"
    got = _tensor(what, run_answer(what, fn, x.clone(), fc.clone(), proj.clone(), hint=hint),
                  tuple(x.shape), hint)
    gate, up = (x @ fc.T).chunk(2, dim=-1)
    _judge(what, got, (F.silu(gate) * up) @ proj.T, swiglu_mistakes(x, fc, proj), hint)


def rope_mistakes(x, pos: int, theta: float) -> dict[str, torch.Tensor]:
    B, H, T, D = x.shape
    rope = Rope(D, theta, pos + T)
    interleaved = x.reshape(B, H, T, D // 2, 2).transpose(-1, -2).reshape(B, H, T, D)
    pairs_back = rope(interleaved, pos).reshape(B, H, T, 2, D // 2).transpose(-1, -2)
    slips = {
        "rotating adjacent pairs (x0, x1), (x2, x3), ... (the interleaved convention; these "
        "weights pair x_i with x_(i + D/2))": pairs_back.reshape(B, H, T, D),
        "frequencies theta^(-i/D) instead of theta^(-2i/D)": Rope(D, theta**0.5, pos + T)(x, pos),
        "the rotation the other way (sin's sign flipped)": _rotated_back(x, rope, pos),
    }
    if pos:
        slips["positions counted from 0 instead of pos"] = rope(x, 0)
    return slips


def _rotated_back(x, rope: Rope, pos: int) -> torch.Tensor:
    """x rotated by minus the angles of its positions."""
    T = x.shape[2]
    cos, sin = rope.cos[pos : pos + T], rope.sin[pos : pos + T]
    x1, x2 = x[..., : rope.half], x[..., rope.half :]
    return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)


def check_rope(fn: Callable, pos: int, theta: float = 10000.0, seed: int = 0,
               hint: str = "") -> None:
    """``fn(x, pos, theta)`` rotates x (B, H, T, D) at positions pos .. pos + T - 1 as ``Rope``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 5, 16, generator=g)
    what = f"my_rope(<(2, 3, 5, 16)>, pos={pos}, theta={theta:g})"
    got = _tensor(what, run_answer(what, fn, x.clone(), pos, theta, hint=hint), tuple(x.shape),
                  hint)
    want = Rope(16, theta, pos + 5)(x, pos)
    _judge(what, got, want, rope_mistakes(x, pos, theta), hint)


def tiny_modern(seed: int = 0) -> GPT:
    """A random two-layer Llama-shaped model (4 query heads, 2 KV heads, width 32) with weights of
    unit scale, so that every slip moves the output well above rounding."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        cfg = GPTConfig.modern(n_layer=2, n_embd=32, vocab_size=16, block_size=64)
        model = GPT(cfg).eval()
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim == 2:
                    p.normal_(0.0, p.shape[1] ** -0.5)
                else:
                    p.uniform_(0.5, 1.5)  # the norms' weights
    return model


def layer_tensors(model: GPT) -> list[dict[str, torch.Tensor]]:
    """Each block's weights by name: norm1, qkv (the fused projection: queries, then keys, then
    values), proj, norm2, fc (gate | up for SwiGLU), mlp_proj."""
    return [
        {"norm1": b.ln1.weight, "qkv": b.attn.qkv.weight, "proj": b.attn.proj.weight,
         "norm2": b.ln2.weight, "fc": b.mlp.fc.weight, "mlp_proj": b.mlp.proj.weight}
        for b in model.blocks
    ]


def _block_slip(x, w, cfg, K, V, pos: int, slip: str) -> torch.Tensor:
    """The block's output with one slip, over the right cached keys K, V (B, H_kv, pos + T, D)."""
    B, T, C = x.shape
    H, D, G = cfg.n_head, cfg.head_dim, cfg.n_head // cfg.kv_heads
    h = F.rms_norm(x, (C,), w["norm1"], cfg.norm_eps)
    q = Rope(D, cfg.rope_theta, pos + T)((h @ w["qkv"].T).view(B, T, -1, D).transpose(1, 2)[:, :H],
                                          pos)
    if slip == "repeat":
        K, V = K.repeat(1, G, 1, 1), V.repeat(1, G, 1, 1)
    else:
        K, V = K.repeat_interleave(G, 1), V.repeat_interleave(G, 1)
    seen = torch.arange(pos + T) <= torch.arange(pos, pos + T)[:, None]
    seen = None if slip == "no mask" else seen
    y = F.scaled_dot_product_attention(q, K, V, attn_mask=seen)
    a = x + y.transpose(1, 2).reshape(B, T, C) @ w["proj"].T
    gate, up = (F.rms_norm(x if slip == "parallel" else a, (C,), w["norm2"], cfg.norm_eps)
                @ w["fc"].T).chunk(2, dim=-1)
    return a + (F.silu(gate) * up) @ w["mlp_proj"].T


BLOCK_SLIPS = {
    "repeat": "query head h given KV head h % H_kv (k.repeat) instead of h // G "
              "(k.repeat_interleave)",
    "no mask": "no causal mask: the prompt's queries see later keys (use read's `seen`)",
    "parallel": "the MLP reading the block's input instead of the input plus attention",
}


def _check_cached(what, cache, layer, x, w, cfg, pos, hint) -> None:
    """The cache holds the new tokens' keys rotated at their own positions, and their values."""
    B, T, C = x.shape
    H, Hk, D = cfg.n_head, cfg.kv_heads, cfg.head_dim
    h = F.rms_norm(x, (C,), w["norm1"], cfg.norm_eps)
    _, k, v = (h @ w["qkv"].T).view(B, T, -1, D).transpose(1, 2).split([H, Hk, Hk], dim=1)
    rope = Rope(D, cfg.rope_theta, pos + T)
    got = run_answer(what, cache.read, layer, torch.arange(pos, pos + T), hint=hint)
    held_k, held_v = got[0][:, :, pos : pos + T].float(), got[1][:, :, pos : pos + T].float()
    if held_k.shape != k.shape or not torch.allclose(held_v, v, atol=1e-4):
        raise verdict(what, f"the cache does not hold layer {layer}'s new values at positions "
                            f"{pos} to {pos + T - 1}: write k and v with cache.write(layer, k, v, "
                            "pos)",
                      hint, "the new keys and values not written to the cache")
    if torch.allclose(held_k, rope(k, pos), atol=1e-4):
        return
    named = {}
    if pos:  # (first: a decode step's one key rotated as position 0 is not rotated at all)
        named["the new keys rotated as positions from 0 instead of pos"] = rope(k, 0)
    named["keys cached before they are rotated (rotated after caching)"] = k
    for mistake, value in named.items():
        if torch.allclose(held_k, value, atol=1e-4):
            raise verdict(what, f"the cached keys are {mistake}", hint, mistake)
    raise verdict(what, "the cached keys are not the new keys rotated at their positions", hint)


def check_block(fn: Callable, cache_cls: type, seed: int = 0, hint: str = "") -> None:
    """``fn(x, w, cache, layer, pos, cfg)``: the modern block on x (B, T, C) at positions pos ..,
    through a ``cache_cls(cfg, max_len)`` cache: a prompt of 5 positions, then two decode steps."""
    model = tiny_modern(seed)
    cfg, layer = model.config, 1
    w = layer_tensors(model)[layer]
    b = model.blocks[layer]
    weights = BlockWeights(b.ln1, b.attn.qkv, b.attn.proj, b.ln2, b.mlp.fc, b.mlp.proj)
    store, cache = KVCache.for_model(model, max_len=16), cache_cls(cfg, 16)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pos, T in ((0, 5), (5, 1), (6, 1)):
            x = torch.randn(1, T, cfg.n_embd, generator=g)
            what = f"my_block(<x of {T} positions>, w, cache, layer={layer}, pos={pos}, cfg)"
            got = run_answer(what, fn, x.clone(), w, cache, layer, pos, cfg, hint=hint)
            got = _tensor(what, got, tuple(x.shape), hint)
            store.length = pos
            want = block(x, weights, model.spec, store, layer, pos)
            _check_cached(what, cache, layer, x, w, cfg, pos, hint)
            K, V = store.k[layer][:, :, : pos + T], store.v[layer][:, :, : pos + T]
            slips = {text: _block_slip(x, w, cfg, K, V, pos, key)
                     for key, text in BLOCK_SLIPS.items() if key != "no mask" or T > 1}
            _judge(what, got, want, slips, hint)


def _visible(p: int, written: int, window: int, sinks: int) -> set[int]:
    return {j for j in range(min(p + 1, written)) if p - j < window or j < sinks}


def check_rolling(cls: type, window: int = 6, sinks: int = 2, spare: int = 3, seed: int = 0,
                  hint: str = "") -> None:
    """``cls(cfg, window, sinks, spare)``: after every write of a chunk of at most spare + 1
    positions, ``read(layer, q_pos)`` lets each query see exactly the positions the window and
    sinks rule allows, with their keys and values, in memory that does not grow."""
    cfg = GPTConfig.modern(n_layer=2, n_head=4, n_kv_heads=2, n_embd=16)
    name = getattr(cls, "__name__", "your cache")
    what = f"{name}(cfg, window={window}, sinks={sinks}, spare={spare})"
    cache = run_answer(what, cls, cfg, window, sinks, spare, hint=hint)
    g = torch.Generator().manual_seed(seed)
    chunks = [min(t, spare + 1) for t in (3, 1, 4, 1, 1, 2, 4, 4, 1, 3, 4, 2, 1, 4, 4, 1, 4)]
    n = sum(chunks)
    ks, vs = (torch.randn(cfg.n_layer, 1, cfg.kv_heads, n, cfg.head_dim, generator=g) for _ in "kv")
    places = None
    pos = 0
    for T in chunks:
        for layer in range(cfg.n_layer):
            k, v = ks[layer, :, :, pos : pos + T], vs[layer, :, :, pos : pos + T]
            run_answer(f"{what}.write(layer={layer}, <{T} keys>, pos={pos})", cache.write, layer,
                       k.clone(), v.clone(), pos, hint=hint)
        q_pos = torch.arange(pos, pos + T)
        for layer in range(cfg.n_layer):
            call = f"{what}.read(layer={layer}, q_pos={q_pos.tolist()})"
            got = run_answer(call, cache.read, layer, q_pos, hint=hint)
            if not isinstance(got, tuple | list) or len(got) != 3:
                raise verdict(call, "expected a triple (k, v, seen)", hint)
            k, v, seen = got
            if not all(isinstance(t, torch.Tensor) for t in got) or seen.dtype != torch.bool or \
                    seen.ndim != 2 or seen.shape[0] != T or k.shape[:2] != (1, cfg.kv_heads) or \
                    k.shape != v.shape or k.shape[2] != seen.shape[1]:
                raise verdict(call, "expected k, v (1, n_kv_heads, places, head_dim) and seen, "
                                    "bool (queries, places)", hint)
            if places is None:
                places = k.shape[2]
            if k.shape[2] != places or places > sinks + window + spare:
                raise verdict(call, f"the cache holds {k.shape[2]} places; it must keep the same "
                                    f"{sinks} + {window} + {spare} (sinks + window + spare) for "
                                    "every length", hint, "a cache whose memory grows")
            _check_seen(call, k, v, seen, q_pos, ks[layer], vs[layer], pos + T, window, sinks, hint)
        pos += T


def _check_seen(call, k, v, seen, q_pos, ks, vs, written, window, sinks, hint) -> None:
    """Each query's seen places hold exactly the positions it sees, with their keys and values."""
    # which position's key each place holds (-1: none of the written ones)
    match = (k[0, :, :, None, :] - ks[0, :, None, :written, :]).abs().amax(dim=(0, -1)) < 1e-6
    vmatch = (v[0, :, :, None, :] - vs[0, :, None, :written, :]).abs().amax(dim=(0, -1)) < 1e-6
    held = torch.where(match.any(-1), match.float().argmax(-1), -1)
    for t, p in enumerate(q_pos.tolist()):
        want = _visible(p, written, window, sinks)
        places = seen[t].nonzero().flatten().tolist()
        if any(int(held[s]) < 0 for s in places):
            raise verdict(call, f"the query at position {p} sees a place that holds none of the "
                                "keys written (an empty place, or one overwritten): mask places by "
                                "the position they hold, -1 for none", hint, "an empty place seen")
        got = {int(held[s]) for s in places}
        if any(not vmatch[s, int(held[s])] for s in places):
            raise verdict(call, "a place holds one position's key and another's value", hint)
        if got == want:
            continue
        extra, missing = sorted(got - want), sorted(want - got)
        mistake = None
        if any(j > p for j in extra):
            mistake = "a key after the query seen (the causal rule left out)"
        elif extra and all(j == p - window for j in extra):
            mistake = "a window one position too wide (p - j <= window)"
        elif missing and all(j < sinks for j in missing):
            mistake = "the sinks not kept: the first positions roll out of the ring"
        elif missing and any(p - j == window - 1 for j in missing) and not extra:
            mistake = "a window one position too narrow, or a write that overwrote keys still seen"
        detail = (f"the query at position {p} sees positions {sorted(got)}; it should see "
                  f"{sorted(want)}")
        if missing and not mistake:
            detail += f" (missing {missing}: overwritten, or not masked in)"
        raise verdict(call, detail + (f": {mistake}" if mistake else ""), hint, mistake)


# The package's pieces with the chapter's interfaces: what its experiments run until the learner's
# pass their tests.


class ChapterStore(Store):
    """The chapter's cache interface (``write(layer, k, v, pos)``, ``read(layer, q_pos) -> (k, v,
    seen)``) as a KV store, so that the package's block runs through a learner's cache: the cache
    decides what each query sees."""

    def __init__(self, cache) -> None:
        self.cache = cache

    def write(self, layer: int, k, v, pos: int) -> None:
        self.cache.write(layer, k, v, pos)

    def attend(self, layer, q, pos, span=None, mask=None, *, dropout=0.0):
        k, v, seen = self.cache.read(layer, torch.arange(pos, pos + q.shape[2]))
        return attention(q, Keys(k, v), seen)


_SPECS: dict[tuple[str, int], BlockSpec] = {}


def reference_block(x, w, cache, layer: int, pos: int, cfg) -> torch.Tensor:
    """The package's block (``ar_lab.model.block.block``) with ``my_block``'s signature: the weights
    by name, the chapter's cache, and rotary tables long enough for positions past the context
    window."""
    n = 1 << max(cfg.block_size, pos + x.shape[1] - 1).bit_length()  # a table per power of two
    spec = _SPECS.get((repr(cfg), n))
    if spec is None:
        spec = _SPECS[(repr(cfg), n)] = BlockSpec.from_config(replace(cfg, block_size=n))
    C = cfg.n_embd
    weights = BlockWeights(
        lambda t: F.rms_norm(t, (C,), w["norm1"], cfg.norm_eps), lambda t: t @ w["qkv"].T,
        lambda t: t @ w["proj"].T, lambda t: F.rms_norm(t, (C,), w["norm2"], cfg.norm_eps),
        lambda t: t @ w["fc"].T, lambda t: t @ w["mlp_proj"].T,
    )
    return block(x, weights, spec, ChapterStore(cache), layer, pos)


class RingCache:
    """A rolling cache with ``MyRollingCache``'s interface: the sinks in places of their own, the
    latest ``window + spare`` positions in a ring, ``visible``'s rule for what a query sees."""

    def __init__(self, cfg, window: int, sinks: int = 0, spare: int = 0) -> None:
        self.span, self.ring = Span(window, sinks), window + spare
        shape = (1, cfg.kv_heads, sinks + self.ring, cfg.head_dim)
        self.k = [torch.zeros(shape) for _ in range(cfg.n_layer)]
        self.v = [torch.zeros(shape) for _ in range(cfg.n_layer)]
        self.held = [torch.full((shape[2],), -1) for _ in range(cfg.n_layer)]

    def write(self, layer: int, k, v, pos: int) -> None:
        p, S = torch.arange(pos, pos + k.shape[2]), self.span.sinks
        place = torch.where(p < S, p, S + (p - S) % self.ring)
        self.k[layer][:, :, place], self.v[layer][:, :, place] = k, v
        self.held[layer][place] = p

    def read(self, layer: int, q_pos):
        seen = visible(q_pos[None], self.held[layer], self.span)[0, 0]  # (T, places)
        return self.k[layer], self.v[layer], seen

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)
