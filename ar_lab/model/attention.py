"""Attention over a KV store: the one definition every cache and every pass uses.

A transformer block hands its new keys and values to a *KV store* and asks it for attention, at
explicit positions (as gpt-fast's ``input_pos``): the same call serves a prompt, a decode step and
a verify pass. The protocol is two methods:

- ``write(layer, k, v, pos)``: store keys and values (B, H_kv, T, D) of the new tokens;
- ``attend(layer, q, pos, span, mask=None)``: attention (B, H, T, D) of the queries (B, H, T, D)
  over every key the store holds for them.

``pos`` is an ``int`` (every row's new tokens sit at pos .. pos + T - 1) or a long tensor (B, T) of
each row's own positions (rows of different lengths, chapter 08). ``span`` is the model's
``Span`` (its sliding window and attention sinks). A store says where its keys sit (``Keys``:
the tensors and their positions), and ``visible`` turns positions into the mask: a query at
position p sees a key at position j when j <= p, and, with a window W, when p - j < W or j is one
of the first ``sinks`` positions. That one rule is the causal mask of a prompt, the mask of a
decode step (none needed: everything cached is earlier), the mask of a verify pass after a cached
prefix, the per-row mask of batched serving, and the sliding window: it is written once, here.

``attention`` is the arithmetic, once: softmax(q k^T / sqrt(D) + mask) v, with groups of query heads
sharing a key/value head (GQA), through ``torch.nn.functional.scaled_dot_product_attention``, whose
fused kernels work in tiles without forming the T x T score matrix where they apply
(FlashAttention's scheme; PyTorch picks its plain path for some masks and shapes). An int8 store
passes the keys' and values' scales: for one query per row they fold into the scores and the weights
(two batched products, no dequantized copy of the cache); several queries read a dequantized copy.

The stores: ``Uncached`` (one pass over a whole sequence, no cache), ``KVCache`` and
``BatchKVCache`` (``model/cache.py``), ``RollingKVCache`` (here: constant memory for a windowed
model), ``Int8KVCache`` and ``PagedKVCache`` (``ar_lab.engine``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

Pos = int | torch.Tensor  # pos .. pos + T - 1 for every row, or (B, T) positions of each row's own


class Span(NamedTuple):
    """Which earlier keys a query sees besides the causal rule: the last ``window`` positions (None:
    all), plus the first ``sinks`` positions."""

    window: int | None = None
    sinks: int = 0


FULL = Span()


class Keys(NamedTuple):
    """What a store holds for one layer: k, v (B, H_kv, S, D), the positions of the S keys (None: 0
    .. S - 1 in order, the same in every row; else (S,) or (B, S), with -1 for an empty place), and
    for an int8 store the per-position scales (B, H_kv, S) of k and v."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


def query_positions(pos: Pos, T: int, device: torch.device) -> torch.Tensor:
    """The positions (1, T) or (B, T) of T new tokens at ``pos``."""
    if isinstance(pos, int):
        return torch.arange(pos, pos + T, device=device)[None]
    return pos


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, span: Span = FULL) -> torch.Tensor:
    """The attention mask, bool (B, 1, T, S): True where the query at position q_pos[b, t] sees the
    key at k_pos[(b,) s]. The rule: j <= p (causal; an empty place, -1 .. never, is hidden below),
    and with a window W, p - j < W or j < sinks."""
    q = q_pos[:, :, None]  # (B, T, 1)
    k = k_pos[:, None, :] if k_pos.ndim == 2 else k_pos[None, None, :]  # (B or 1, 1, S)
    seen = (k <= q) & (k >= 0)
    if span.window is not None:
        seen &= (q - k < span.window) | (k < span.sinks)
    return seen[:, None]  # (B, 1, T, S): one mask for every head


def mask_for(pos: Pos, T: int, keys: Keys, span: Span):
    """(mask, causal) for ``attention``: no mask where every key a store holds is visible (one query
    at the end of a contiguous store), ``causal`` for a fresh prompt, else ``visible``'s mask. A
    store whose keys are in order (``keys.positions`` None) at an int ``pos`` holds exactly
    positions 0 .. pos + T - 1."""
    if keys.positions is None and isinstance(pos, int) and span.window is None:
        if T == 1:
            return None, False
        if pos == 0:
            return None, True
    device = keys.k.device
    k_pos = (
        torch.arange(keys.k.shape[2], device=device) if keys.positions is None else keys.positions
    )
    return visible(query_positions(pos, T, device), k_pos, span), False


def attention(
    q: torch.Tensor,
    keys: Keys,
    mask: torch.Tensor | None = None,
    *,
    causal: bool = False,
    dropout: float = 0.0,
) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) + mask) v for queries q (B, H, T, D) over ``keys`` (B, H_kv, S, D):
    (B, H, T, D).

    H is a multiple of H_kv: query heads h*G .. h*G + G - 1 share key/value head h (G = H / H_kv).
    ``mask``: bool, broadcastable to (B, H, T, S), True where a key is seen. Every pass calls
    ``scaled_dot_product_attention`` (a pass calls the same operations for any number of positions),
    except one query per row over an int8 store: two batched products over the grouped heads with
    the scales folded in, so no dequantized copy of the cache is made."""
    B, H, T, D = q.shape
    k, v = keys.k, keys.v
    _, Hk, S, _ = k.shape
    if T == 1 and keys.k_scale is not None and not dropout:  # int8, one query per row: two products
        G = H // Hk
        # (B Hk, S, D): int8 values, exactly
        kk, vv = k.flatten(0, 1).to(q.dtype), v.flatten(0, 1).to(q.dtype)
        # (q . k_int8) x k_scale x 1/sqrt(D), then the softmax's weights x v_scale, then . v_int8
        scores = torch.baddbmm(
            _zero(q), q.reshape(B * Hk, G, D), kk.transpose(1, 2), beta=0, alpha=D**-0.5
        )
        scores.mul_(keys.k_scale.reshape(B * Hk, 1, S).to(q.dtype))
        if mask is not None:
            scores.view(B, Hk, G, S).masked_fill_(~mask, float("-inf"))
        # (B Hk, G, S)
        weights = torch.softmax(scores, -1).mul_(keys.v_scale.reshape(B * Hk, 1, S).to(q.dtype))
        return torch.bmm(weights, vv).view(B, H, 1, D)
    if keys.k_scale is not None:
        k, v = dense(keys, q.dtype)
    if Hk == H:  # (positional arguments: parsing four keywords cost about 0.5 us a call here)
        return F.scaled_dot_product_attention(q, k, v, mask, dropout, causal)
    return F.scaled_dot_product_attention(q, k, v, mask, dropout, causal, enable_gqa=True)


def dense(keys: Keys, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v as values of ``dtype`` (default: the scales' dtype for an int8 store, else as
    stored)."""
    if keys.k_scale is None:
        return keys.k, keys.v
    dtype = keys.k_scale.dtype if dtype is None else dtype
    k = keys.k.to(dtype) * keys.k_scale[..., None].to(dtype)
    return k, keys.v.to(dtype) * keys.v_scale[..., None].to(dtype)


_ZEROS: dict = {}


def _zero(q: torch.Tensor) -> torch.Tensor:
    """``baddbmm``'s ignored input (beta=0): one (1, 1, 1) zero per dtype and device, never
    written."""
    key = (q.dtype, q.device)
    z = _ZEROS.get(key)
    if z is None:
        z = _ZEROS[key] = torch.zeros(1, 1, 1, dtype=q.dtype, device=q.device)
    return z


class Store:
    """What every store shares: ``attend`` reads the store's ``Keys`` for the layer and runs
    ``attention`` with ``visible``'s mask. A store implements ``write`` and ``keys`` (and may refine
    ``attend``)."""

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: Pos) -> None:
        raise NotImplementedError

    def keys(self, layer: int, pos: Pos, T: int) -> Keys:
        raise NotImplementedError

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        pos: Pos,
        span: Span = FULL,
        mask: torch.Tensor | None = None,
        *,
        dropout: float = 0.0,
    ) -> torch.Tensor:
        T = q.shape[2]
        keys = self.keys(layer, pos, T)
        causal = False
        if mask is None:
            mask, causal = mask_for(pos, T, keys, span)
        # a mask of the caller's (chapter 08's row mask), within the window
        elif span.window is not None:
            mask = mask & mask_for(pos, T, keys, span)[0]
        return attention(q, keys, mask, causal=causal, dropout=dropout)


class Uncached(Store):
    """One pass over a whole sequence without a cache (training, ``use_cache=False``): each layer's
    keys and values live for the pass only."""

    def __init__(self, n_layer: int) -> None:
        self._kv: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * n_layer

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: Pos) -> None:
        self._kv[layer] = (k, v)

    def keys(self, layer: int, pos: Pos, T: int) -> Keys:
        k, v = self._kv[layer]
        self._kv[layer] = None
        if isinstance(pos, int) and pos == 0:
            return Keys(k, v)
        return Keys(k, v, query_positions(pos, T, k.device))


class Updating(Store):
    """A cache of one's own with chapter 04's contract, ``update(layer, start, k, v)`` -> every key
    and value so far (B, H_kv, start + T, D), as a store: ``GPT.forward`` takes one through this."""

    def __init__(self, cache) -> None:
        self.cache = cache
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: Pos) -> None:
        self._kv[layer] = self.cache.update(layer, pos, k, v)

    def keys(self, layer: int, pos: Pos, T: int) -> Keys:
        k, v = self._kv.pop(layer)
        return Keys(k, v)
