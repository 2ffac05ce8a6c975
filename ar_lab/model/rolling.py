"""A rolling KV cache: constant memory for a model that attends over a sliding window.

A model with ``GPTConfig(window=W, sinks=S)`` never lets a query at position p see a key older than
p - W + 1, except the first S positions (attention sinks). A contiguous cache would still keep every
position; ``RollingKVCache`` keeps only those that can still be seen: the S sinks in places of their
own, and the last W (+ ``spare``) positions in a ring, where position p lives at place
S + (p - S) mod ring. Its memory does not grow with the sequence (Mistral's rolling buffer cache;
StreamingLLM's sinks).

Each place remembers which position it holds (-1: none), and attention masks by those positions
with the same rule as every other store (``ar_lab.model.attention.visible``). A multi-token write
(a prompt longer than the ring) would overwrite keys that its own earlier queries still need, so
``write`` only holds the new keys and ``attend`` reads the ring *and* them, then rolls them in.

Rolling back (``truncate``, speculative decoding's rejected drafts) works while the ring still holds
every key the next query needs: ``spare`` extra places allow rolling back that many positions;
beyond that ``truncate`` raises rather than let a query silently miss keys.
"""

from __future__ import annotations

import torch

from ar_lab.base.errors import BadType, BadValue, ContextFull
from ar_lab.model.attention import Keys, Pos, Span, Store, Uncached
from ar_lab.model.store_checks import check_dtype, check_fits, check_shape, checked_index, config_of


class RollingKVCache(Store):
    """Keys and values of one sequence batch (B rows at the same positions) for a windowed model."""

    def __init__(
        self,
        n_layer: int,
        batch_size: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        window: int,
        sinks: int = 0,
        spare: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, value in [
            ("n_layer", n_layer),
            ("batch_size", batch_size),
            ("n_kv_heads", n_kv_heads),
            ("head_dim", head_dim),
            ("window", window),
        ]:
            checked_index(name, value, 1, 1 << 40)
        checked_index("sinks", sinks, 0, 1 << 40)
        checked_index("spare", spare, 0, 1 << 40)
        dtype = check_dtype(dtype)
        self.span = Span(window, sinks)
        self.ring = window + spare  # places for the latest positions
        self.places = sinks + self.ring
        shape = (batch_size, n_kv_heads, self.places, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        # the position at each place
        self.held = torch.full((self.places,), -1, dtype=torch.long, device=device)
        self.batch_size, self.max_len = batch_size, 1 << 62  # no capacity: old positions roll out
        self._length = 0
        self._pending: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * n_layer

    @classmethod
    def for_model(cls, model, batch_size: int = 1, *, spare: int = 0, dtype=None) -> RollingKVCache:
        """A rolling cache for a windowed ``model`` (``GPTConfig.window``), with its sinks."""
        cfg = config_of(model)
        if getattr(cfg, "window", None) is None:
            raise BadValue(
                "a rolling cache keeps a sliding window: the model has none (GPTConfig.window is "
                "None); use KVCache.for_model(model)",
                arg="model",
            )
        p = next(model.parameters())
        dtype = p.dtype if dtype is None else check_dtype(dtype)
        return cls(
            cfg.n_layer,
            batch_size,
            cfg.kv_heads,
            cfg.head_dim,
            window=cfg.window,
            sinks=cfg.sinks,
            spare=spare,
            dtype=dtype,
            device=p.device,
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    @property
    def length(self) -> int:
        """Positions written so far (the next token's position)."""
        return self._length

    @length.setter
    def length(self, n: int) -> None:
        self._length = checked_index("length", n, 0, self.max_len)

    def check_fits(self, model) -> None:
        check_fits(self, model)
        self.fits_config(model.config)

    def fits_config(self, cfg) -> None:
        """Raise unless the model attends over this cache's window and sinks, with its shapes."""
        check_shape(self, cfg)
        if (cfg.window, cfg.sinks) != tuple(self.span):
            raise BadValue(
                f"this rolling cache keeps window={self.span.window}, sinks={self.span.sinks}, "
                f"the model attends with window={cfg.window}, sinks={cfg.sinks}: build it with "
                "RollingKVCache.for_model(model)",
                arg="cache",
            )

    def _place(self, positions: torch.Tensor) -> torch.Tensor:
        S = self.span.sinks
        return torch.where(positions < S, positions, S + (positions - S) % self.ring)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: Pos) -> None:
        if not isinstance(pos, int):
            raise BadType(
                "a rolling cache's rows share their positions: pass pos as an int", arg="pos"
            )
        if pos != self._length:
            raise BadValue(
                f"a rolling cache is written in order: the next position is {self._length}, got "
                f"{pos} (truncate first to go back)",
                arg="pos",
            )
        self._pending[layer] = (k, v)

    def keys(self, layer: int, pos: Pos, T: int) -> Keys:
        """The ring (as it was before these T tokens) and the T new keys, with their positions."""
        k, v = self._pending[layer]
        new = torch.arange(pos, pos + T, device=self.held.device)
        K = torch.cat((self.k[layer], k), dim=2)
        V = torch.cat((self.v[layer], v), dim=2)
        return Keys(K, V, torch.cat((self.held, new)))

    def attend(self, layer, q, pos, span=None, mask=None, *, dropout=0.0):
        y = super().attend(layer, q, pos, self.span, mask, dropout=dropout)
        self._roll_in(layer, pos)
        return y

    def _roll_in(self, layer: int, pos: int) -> None:
        k, v = self._pending[layer]
        self._pending[layer] = None
        T = k.shape[2]
        # of a long write, only the latest positions outlive it (and the sinks)
        keep = min(T, self.ring)
        positions = torch.arange(pos, pos + T, device=self.held.device)
        chosen = (positions < self.span.sinks) | (positions >= pos + T - keep)
        places = self._place(positions[chosen])
        self.k[layer][:, :, places] = k[:, :, chosen]
        self.v[layer][:, :, places] = v[:, :, chosen]
        if layer == len(self.k) - 1:
            self.held[places] = positions[chosen]

    def truncate(self, n: int) -> None:
        """Forget positions n and later; raises if the ring no longer holds what position n's query
        needs."""
        checked_index("n", n, 0, self._length)
        oldest_needed = max(n - self.span.window + 1, self.span.sinks)
        ring_oldest = max(self._length - self.ring, self.span.sinks)
        if n < self._length and oldest_needed < ring_oldest:
            raise ContextFull(
                f"cannot roll a rolling cache back from {self._length} to {n} positions: "
                f"position {oldest_needed} has rolled out (the ring holds {self.ring}); build it "
                f"with spare >= {self._length - n}",
                arg="n",
            )
        self.held[self.held >= n] = -1
        self._length = n

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k) + sum(t.nbytes for t in self.v)

    def __repr__(self) -> str:
        b, h, p, d = self.k[0].shape
        return (
            f"RollingKVCache(layers={len(self.k)}, batch={b}, kv_heads={h}, places={p}, head_dim="
            f"{d}, window={self.span.window}, sinks={self.span.sinks}, length={self.length}, "
            f"nbytes={self.nbytes:,})"
        )


class _Weighing(Uncached):
    """A pass without a cache that also keeps, per layer, the attention each query gives to the
    first ``first`` positions (the softmax's weights summed over those keys)."""

    def __init__(self, n_layer: int, first: int) -> None:
        super().__init__(n_layer)
        self.first, self.length, self.batch_size = first, 0, 1
        self.share: list[torch.Tensor] = []

    def attend(self, layer, q, pos, span=None, mask=None, *, dropout=0.0):
        keys = self.keys(layer, pos, q.shape[2])
        G = q.shape[1] // keys.k.shape[1]
        k, v = keys.k.repeat_interleave(G, 1), keys.v.repeat_interleave(G, 1)
        T, S = q.shape[2], k.shape[2]
        scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5  # (B, H, T, S)
        future = torch.ones(T, S, dtype=torch.bool, device=q.device).triu(S - T + 1)
        weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        self.share.append(weights[..., : self.first].sum(-1))  # (B, H, T)
        return weights @ v


def sink_share(model, idx: torch.Tensor, first: int = 4) -> torch.Tensor:
    """How much attention the first ``first`` positions get: for a whole sequence idx (1, T), a
    tensor (n_layer, T) of each query's weight on keys 0 .. first - 1, averaged over the heads.

    StreamingLLM (Xiao et al., 2023) found large models give much of their attention to the first
    tokens whatever they are (attention sinks), so a window that evicts them breaks the model; this
    measures whether a model does."""
    checked_index("first", first, 1, 1 << 40)
    store = _Weighing(model.config.n_layer, first)
    with torch.inference_mode():
        model(idx, store)
    return torch.stack([s[0].mean(0) for s in store.share])
