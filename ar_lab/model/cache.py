"""A preallocated key/value cache.

During decoding the keys and values of past tokens never change, so each layer keeps
them instead of recomputing them every step. The buffers are allocated once at full
size, per layer (B, H_kv, T_max, D); a step writes its new positions in place and
attention reads the filled prefix. Nothing is re-allocated or concatenated per step.

``truncate(n)`` rolls the cache back to its first n positions (speculative decoding
uses it to discard rejected draft tokens): the stale entries beyond n are simply
overwritten by the next write.

A batch-1 cache also records which token id it holds at each position (``record``, called by the
decode loops' decoders, ``ar_lab.engine.decoder``; ``token_ids`` reads them): keys and values are
only valid for the tokens they were computed from, so ``generate(..., cache=c)`` reuses exactly the
positions where the cached ids and the new prompt agree, and recomputes the rest.

``BatchKVCache`` holds several sequences of different lengths in slots, for batched
serving (chapter 08): each row has its own length, positions and attention mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ar_lab.base.args import positive_int
from ar_lab.base.errors import BadType, BadValue, ContextFull
from ar_lab.base.timing import checked_device
from ar_lab.model.attention import Keys, Pos, Store, dense, visible
from ar_lab.model.store_checks import check_dtype, check_fits, check_shape, checked_index, config_of


def _buffers(n_layer, batch, n_kv_heads, max_len, head_dim, dtype, device, batch_name="batch_size"):
    """Per-layer key and value buffers (batch, H_kv, max_len, D), after checking every size and the
    device."""
    sizes = [
        ("n_layer", n_layer),
        (batch_name, batch),
        ("n_kv_heads", n_kv_heads),
        ("max_len", max_len),
    ]
    for name, value in [*sizes, ("head_dim", head_dim)]:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise BadValue(f"{name} must be a positive int, got {value!r}", arg=name)
    device = checked_device(device)
    shape = (batch, n_kv_heads, max_len, head_dim)
    k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
    v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
    return k, v


class Buffers(Store):
    """Per-layer key and value buffers (B, H_kv, T_max, D) written and read at explicit positions,
    with no bookkeeping: what a compiled decode step traces (``ar_lab.engine.compiled``: nothing in
    it depends on a position's value, so one graph serves every length). ``KVCache`` adds the
    checks, the filled length and the token ids."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        self.k, self.v = k, v

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: Pos) -> None:
        self._store(layer, pos, pos + k.shape[2], k, v)

    def _store(self, layer: int, start: int, end: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].narrow(2, start, end - start).copy_(k)
        self.v[layer].narrow(2, start, end - start).copy_(v)

    def keys(self, layer: int, pos: Pos, T: int) -> Keys:
        """Positions 0 .. pos + T - 1 (what a query written at pos .. pos + T - 1 may see), in
        order."""
        end = pos + T
        return Keys(self.k[layer].narrow(2, 0, end), self.v[layer].narrow(2, 0, end))


class KVCache(Buffers):
    # what the buffers hold; None: the compute dtype (Int8KVCache: int8)
    storage_dtype: torch.dtype | None = None

    def __init__(
        self,
        n_layer: int,
        batch_size: int,
        n_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        dtype = check_dtype(dtype)
        super().__init__(*_buffers(
            n_layer, batch_size, n_kv_heads, max_len, head_dim, self.storage_dtype or dtype, device
        ))
        self.max_len = max_len
        self.batch_size = batch_size
        self.length = 0  # positions filled so far
        # token ids recorded at positions 0, 1, ... (batch 1); see token_ids
        self._ids: list[int] = []

    @classmethod
    def for_model(
        cls, model, batch_size: int = 1, max_len: int | None = None, dtype=None
    ) -> KVCache:
        """A cache shaped for ``model`` (max_len defaults to its context window)."""
        cfg = config_of(model)
        max_len = cfg.block_size if max_len is None else max_len
        if isinstance(max_len, int) and not isinstance(max_len, bool) and max_len > cfg.block_size:
            raise ContextFull(
                f"max_len={max_len} exceeds the model's context window ({cfg.block_size})",
                arg="max_len",
            )
        checked_index("max_len", max_len, 1, cfg.block_size)
        p = next(model.parameters())
        dtype = p.dtype if dtype is None else check_dtype(dtype)
        return cls(cfg.n_layer, batch_size, cfg.kv_heads, max_len, cfg.head_dim, dtype, p.device)

    @classmethod
    def from_buffers(cls, k: list[torch.Tensor], v: list[torch.Tensor], length: int = 0) -> KVCache:
        """A cache over existing per-layer buffers (B, H_kv, T_max, D), e.g. views of one slot of a
        ``BatchKVCache``: writes go straight into them, nothing is copied. The token ids of its
        first ``length`` positions are unknown (``token_ids`` is None) until ``record`` names
        them."""
        if not isinstance(k, (list, tuple)) or not isinstance(v, (list, tuple)):
            raise BadType(
                f"k and v must be lists of per-layer tensors, got {type(k).__name__}, "
                f"{type(v).__name__}",
                arg="k" if not isinstance(k, (list, tuple)) else "v",
            )
        if not all(isinstance(a, torch.Tensor) for a in [*k, *v]):
            raise BadType(
                "k and v must hold torch.Tensors (one per layer)",
                arg="k" if not all(isinstance(a, torch.Tensor) for a in k) else "v",
            )
        if (
            not k
            or len(k) != len(v)
            or any(a.ndim != 4 or a.shape != b.shape for a, b in zip(k, v, strict=True))
        ):
            raise BadValue(
                "k and v must be equal-length lists of (B, H_kv, T_max, D) buffers of the same "
                "shape",
                arg="k" if not k or any(a.ndim != 4 for a in k) else "v",
            )
        if not k[0].is_floating_point():
            raise BadValue(f"k and v must be floating-point buffers, got {k[0].dtype}", arg="k")
        self = cls.__new__(cls)
        self.k, self.v = list(k), list(v)
        self.batch_size, _, self.max_len, _ = k[0].shape
        self.length = checked_index("length", length, 0, self.max_len)
        self._ids = []
        return self

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: Pos) -> None:
        """Write k, v (B, H_kv, T, D) at positions pos .. pos + T - 1 of every row (the KV-store
        protocol, ``ar_lab.model.attention``). Token ids recorded from ``pos`` on are dropped: the
        caller records the new ones."""
        if not isinstance(pos, int):
            raise BadType(
                "a KVCache's rows share their positions: pass pos as an int (a BatchKVCache "
                "takes a tensor of each row's positions)",
                arg="pos",
            )
        end = pos + k.shape[2]
        if end > self.max_len:
            raise ContextFull(
                f"KV cache full: positions up to {end} requested, capacity is {self.max_len}",
                arg="cache",
            )
        del self._ids[pos:]
        self._store(layer, pos, end, k, v)

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        """``write`` at ``start``, then every key and value so far, (B, H_kv, start + T, D) each, in
        the model's dtype (an int8 store's dequantized)."""
        self.write(layer, k, v, start)
        return dense(self.keys(layer, start, k.shape[2]), self.dtype)

    @property
    def length(self) -> int:
        """Positions filled so far: written only by this setter, from the pass that wrote them
        (GPT.forward, LeanGPT) or from ``truncate``; token ids recorded past it are dropped, so none
        outlive their keys and values."""
        return self._length

    @length.setter
    def length(self, n: int) -> None:
        self._length = checked_index("length", n, 0, self.max_len)
        if len(self.__dict__.get("_ids", ())) > n:
            del self._ids[n:]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype attention reads the keys and values in (the model's): here the buffers' own."""
        return self.k[0].dtype

    def check_fits(self, model) -> None:
        """Raise unless this cache fits ``model`` (layers, KV heads, head size, dtype, device):
        ``check_fits``."""
        check_fits(self, model)

    def fits_config(self, cfg) -> None:
        """Raise unless this cache's layers, KV heads and head size are ``cfg``'s (``GPT.forward``
        asks)."""
        check_shape(self, cfg)

    def record(self, start: int, ids: list[int]) -> None:
        """Note that positions ``start ..`` now hold the keys/values of token ``ids`` (a batch-1
        cache).

        If an id before ``start`` is unknown, so stay these (``token_ids`` is None)."""
        if len(self._ids) >= start:
            self._ids[start:] = ids

    @property
    def token_ids(self) -> list[int] | None:
        """The token ids at positions 0 .. length - 1, or None if some were written without
        ``record`` (the decoders of ``ar_lab.engine`` and ``PrefixCache`` record; ``GPT.forward``
        and ``update`` do not)."""
        ids, n = self._ids, self.length
        return ids[:n] if len(ids) >= n else None

    def reusable(self, prompt: list[int]) -> int:
        """``reusable_length`` of the recorded ids and ``prompt``; raises if some position's id is
        unknown."""
        if isinstance(prompt, str) or not all(isinstance(t, int) for t in prompt):
            raise BadType(
                f"prompt must be a list of token ids (ints), got {type(prompt).__name__}",
                arg="prompt",
            )
        cached = self.token_ids
        if cached is None:
            raise BadValue(
                f"the cache holds {self.length} positions but knows the token ids of only "
                f"{len(self._ids)} of them (filled by model(idx, cache), KVCache.update or by "
                "setting cache.length, which do not record ids), so it cannot tell which "
                "positions belong to this prompt: fill it through ar_lab.generate or a "
                "PrefixCache, or call cache.truncate(0) to reuse only its memory",
                arg="cache",
            )
        return reusable_length(cached, prompt)

    def truncate(self, n: int) -> None:
        """Keep only the first ``n`` positions (roll back). ``n`` is checked before anything
        changes."""
        self.length = checked_index("n", n, 0, self.length)  # (drops the token ids past n)

    @property
    def nbytes(self) -> int:
        """Bytes held by the preallocated buffers (keys and values, all layers)."""
        return sum(t.nbytes for t in self.k) + sum(t.nbytes for t in self.v)

    @property
    def used_bytes(self) -> int:
        """Bytes of the positions filled so far."""
        return self.nbytes * self.length // self.max_len

    def __repr__(self) -> str:
        b, h, t, d = self.k[0].shape
        return (
            f"KVCache(layers={len(self.k)}, batch={b}, kv_heads={h}, max_len={t}, head_dim={d}, "
            f"length={self.length}, nbytes={self.nbytes:,})"
        )


class BatchKVCache(Store):
    """Slots for sequences of *different* lengths that are decoded together (serving, chapter 08).

    The buffers are KVCache's, per layer (B_max, H_kv, T_max, D), but every slot (row) has its
    own length: slot i holds ``lengths[i]`` positions. The slots in use are always the first
    ``rows``; a forward pass works on exactly those (a view, no gather), and ``remove`` keeps
    them packed by moving the last used slot into the freed one.

    A forward step through the model (``GPT.forward(idx, cache)`` with idx (rows, T)) puts row
    i's new tokens at positions ``lengths[i] ..``: ``begin(T)`` gives those positions (for the
    position embeddings) and the attention mask (row i's query at position p sees keys 0..p,
    never another row's stale or unused entries); ``update`` writes the new keys/values at them;
    ``advance(T)`` moves the lengths on.

    A new request is prefilled alone into ``slot(rows)`` (a batch-1 ``KVCache`` over the slot's
    buffers, so the prompt's keys/values land in place) and then joins with ``add``.
    """

    def __init__(
        self,
        n_layer: int,
        max_batch: int,
        n_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        dtype = check_dtype(dtype)
        self.k, self.v = _buffers(
            n_layer, max_batch, n_kv_heads, max_len, head_dim, dtype, device, "max_batch"
        )
        self.max_batch, self.max_len = max_batch, max_len
        self.lengths = [0] * max_batch  # positions filled in each slot
        self.rows = 0  # slots 0..rows-1 are in use
        self.device = torch.device(device)
        # 0..T_max-1, sliced for positions and masks
        self._steps = torch.arange(max_len, device=device)
        self._slots = torch.arange(max_batch, device=device)[:, None]  # (B_max, 1) row indices
        self._end = 0  # keys the current forward step attends over (set by begin)

    @classmethod
    def for_model(
        cls, model, max_batch: int, max_len: int | None = None, dtype=None
    ) -> BatchKVCache:
        """Slots shaped for ``model`` (max_len defaults to its context window)."""
        cfg = config_of(model)
        max_len = cfg.block_size if max_len is None else max_len
        if (
            not isinstance(max_len, int)
            or isinstance(max_len, bool)
            or not 1 <= max_len <= cfg.block_size
        ):
            kind = (
                ContextFull if isinstance(max_len, int) and max_len > cfg.block_size else BadValue
            )
            raise kind(
                f"max_len must be an int in 1..{cfg.block_size} (the context window), got "
                f"{max_len!r}",
                arg="max_len",
            )
        p = next(model.parameters())
        dtype = p.dtype if dtype is None else check_dtype(dtype)
        return cls(cfg.n_layer, max_batch, cfg.kv_heads, max_len, cfg.head_dim, dtype, p.device)

    @property
    def batch_size(self) -> int:
        """Rows a forward step must feed: the slots in use."""
        return self.rows

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the keys and values (the model's)."""
        return self.k[0].dtype

    def check_fits(self, model) -> None:
        """Raise unless these slots fit ``model`` (layers, KV heads, head size, dtype, device):
        ``check_fits``."""
        check_fits(self, model)

    def fits_config(self, cfg) -> None:
        """Raise unless these slots' layers, KV heads and head size are ``cfg``'s (``GPT.forward``
        asks)."""
        check_shape(self, cfg)

    @property
    def length(self) -> int:
        """Not one number: each row has its own (``lengths``). Here so that ``model(idx, cache)``
        explains."""
        raise BadValue(
            "a BatchKVCache's rows sit at lengths of their own: feed it with "
            "ar_lab.engine.decoder.ForwardDecoder(model).prefill(idx, cache, None) or "
            ".step(tokens, cache, None), or call model(idx, cache, positions=..., mask=...) with "
            "cache.begin(T), then cache.advance(T)",
            arg="cache",
        )

    def slot(self, i: int) -> KVCache:
        """Slot ``i`` as a batch-1 ``KVCache`` (views of the buffers, its current length)."""
        checked_index("slot", i, 0, self.max_batch - 1)
        return KVCache.from_buffers(
            [k[i : i + 1] for k in self.k], [v[i : i + 1] for v in self.v], length=self.lengths[i]
        )

    def add(self, length: int) -> int:
        """Put slot ``rows`` (prefilled with ``length`` positions, e.g. through ``slot``) in use;
        its index."""
        if self.rows == self.max_batch:
            raise BadValue(
                f"all {self.max_batch} slots are in use (the cache is full): remove a finished "
                "row first",
                arg="cache",
            )
        if (
            not isinstance(length, int)
            or isinstance(length, bool)
            or not 0 <= length <= self.max_len
        ):
            raise BadValue(
                f"length must be an int in 0..{self.max_len}, got {length!r}", arg="length"
            )
        i = self.rows
        self.lengths[i] = length
        self.rows += 1
        return i

    def remove(self, i: int) -> int | None:
        """Free row ``i``; the last row in use moves into it. Returns the index that moved (or
        None)."""
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.rows:
            raise BadValue(
                f"row i must be in use: an int in 0..{self.rows - 1}, got {i!r}", arg="i"
            )
        last = self.rows - 1
        self.rows = last
        self.lengths[i], moved = self.lengths[last], None
        if i != last:
            n = self.lengths[last]  # only the filled positions need to move
            for buf in self.k + self.v:
                buf[i, :, :n] = buf[last, :, :n]
            moved = last
        self.lengths[last] = 0
        return moved

    def begin(self, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions (rows, T) of the next T tokens of each row, and the attention mask (rows, 1, T,
        keys) that ``attend`` applies (``visible``: row i's new token at position p sees its keys 0
        .. p, nothing else)."""
        if self.rows == 0:
            raise BadValue(
                "no row is in use (the cache is empty): add a prefilled slot first", arg="cache"
            )
        checked_index("T", T, 1, self.max_len)
        lengths = self.lengths[: self.rows]
        self._end = max(lengths) + T
        if self._end > self.max_len:
            raise ContextFull(
                f"KV cache full: positions up to {self._end} requested, capacity is {self.max_len}",
                arg="cache",
            )
        # (rows, T)
        positions = torch.tensor(lengths, device=self.device)[:, None] + self._steps[:T]
        return positions, visible(positions, self._steps[: self._end])

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: Pos) -> None:
        """Write k, v (rows, H_kv, T, D) at each row's positions ``pos`` (rows, T), from
        ``begin``."""
        rows = self._slots[: self.rows]  # (rows, 1): broadcasts against positions (rows, T)
        # buf[rows, :, positions] selects (rows, T, H_kv, D): the advanced indices come first.
        self.k[layer][rows, :, pos] = k.transpose(1, 2)
        self.v[layer][rows, :, pos] = v.transpose(1, 2)

    def keys(self, layer: int, pos: Pos, T: int) -> Keys:
        """The rows' keys up to the longest row's new end (``begin``): each row's own beyond its
        length are hidden by ``visible``, since they sit after its queries."""
        return Keys(
            self.k[layer][: self.rows, :, : self._end], self.v[layer][: self.rows, :, : self._end]
        )

    def advance(self, T: int) -> None:
        """Move every row in use on by ``T`` positions (after a forward step wrote them)."""
        checked_index("T", T, 0, self.max_len)
        for i in range(self.rows):
            self.lengths[i] += T

    @property
    def nbytes(self) -> int:
        """Bytes held by the preallocated buffers (keys and values, all layers, all slots)."""
        return sum(t.nbytes for t in self.k) + sum(t.nbytes for t in self.v)

    def __repr__(self) -> str:
        b, h, t, d = self.k[0].shape
        return (
            f"BatchKVCache(layers={len(self.k)}, slots={b}, rows={self.rows}, kv_heads={h}, "
            f"max_len={t}, head_dim={d}, lengths={self.lengths[: self.rows]}, nbytes="
            f"{self.nbytes:,})"
        )


def row_mask(lengths: Sequence[int], T: int, keys: torch.Tensor | None = None) -> torch.Tensor:
    """The attention mask of one batched step: bool (rows, 1, T, max(lengths) + T), one mask for all
    heads.

    Row i holds ``lengths[i]`` positions and gets T new tokens; its new token t sits at position
    ``lengths[i] + t`` and sees keys 0 .. lengths[i] + t: its own past and itself, nothing later,
    and none of the padding beyond its own length. ``keys``: ``torch.arange(max(lengths) + T)`` on
    the device wanted (``BatchKVCache.begin`` passes its own)."""
    keys = torch.arange(max(lengths) + T) if keys is None else keys  # (keys,)
    positions = torch.tensor(list(lengths), device=keys.device)[:, None] + keys[:T]  # (rows, T)
    return visible(positions, keys)  # (rows, 1, T, keys)


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many items ``a`` and ``b`` share from the start."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def reusable_length(cached: Sequence[int], prompt: Sequence[int]) -> int:
    """Prompt positions whose keys/values a cache of ``cached`` tokens can serve: those the two
    share from the start, never the prompt's last token (its logits give the first new token)."""
    if len(prompt) == 0:
        raise BadValue("the prompt is empty", arg="prompt")
    return min(common_prefix_length(cached, prompt), len(prompt) - 1)


def check_sizes(**sizes) -> None:
    for name, value in sizes.items():
        positive_int(name, value, 0 if name == "seq_len" else 1)  # (numpy integers are counts too)


def kv_cache_bytes(
    n_layer: int,
    n_kv_heads: int,
    head_dim: int,
    seq_len: int,
    batch_size: int = 1,
    bytes_per_value: int = 4,
) -> int:
    """layers x KV heads x head dim x sequence x batch x 2 (K and V) x bytes per value.

    One formula for MHA (KV heads = query heads), GQA (fewer) and MQA (one).
    """
    check_sizes(
        n_layer=n_layer,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        seq_len=seq_len,
        batch_size=batch_size,
        bytes_per_value=bytes_per_value,
    )
    return n_layer * n_kv_heads * head_dim * seq_len * batch_size * 2 * bytes_per_value
