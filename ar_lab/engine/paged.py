"""Paged KV memory: keys and values in fixed-size blocks of one pool, found through block tables
(chapter 08).

A contiguous cache (``BatchKVCache``) gives every slot room for the longest request the server may
see, whether it uses it or not. vLLM's PagedAttention (Kwon et al., SOSP 2023, "Efficient Memory
Management for Large Language Model Serving with PagedAttention", section 4) borrows the operating
system's answer to the same waste: memory in pages. Here:

- ``BlockAllocator`` owns ``num_blocks`` physical blocks of ``block_size`` positions each: a free
  list, and a *block table* per request (its logical block j lives in physical block
  ``table[j]``). A request gets blocks as it grows (``allocate``, ``grow``: ceil(n / block_size) for
  n tokens) and gives them back when it finishes (``free``). ``fork`` lets a new request share the
  blocks that a parent's first n tokens fill completely (reference counts; a block returns to the
  free list when its last user frees it); a partly filled last block is not shared but copied
  into a fresh block at once (vLLM shares it and copies it on the first write: copy-on-write).
  Only the last block of a request is ever partly filled, so the waste is under one block per
  request (internal fragmentation), and any free block serves any request (no external
  fragmentation).
- ``PagedKVCache`` is a ``BatchKVCache`` whose slots live in those blocks: the key and value pools
  are (n_layer, num_blocks, H_kv, block_size, D); a forward step's writes scatter into the blocks
  through each row's table, and attention *gathers* the rows' blocks back into the (rows, H_kv,
  keys, D) layout ``GPT.forward`` reads. That gather is a copy per layer and step, honest on a
  CPU; GPU kernels (vLLM's paged attention, FlashInfer) read the blocks in place instead.
  ``serve(..., kv="paged")`` runs on it; the model's forward does not change.

Any object with ``BlockAllocator``'s methods can run it (``check_allocator`` says which are
missing): chapter 08's learner serves the course model on their own allocator.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable

import torch

from ar_lab.base.args import positive_int
from ar_lab.base.errors import ArLabError, BadType, BadValue
from ar_lab.engine.paged_slot import PagedSlot
from ar_lab.model.attention import Keys
from ar_lab.model.cache import BatchKVCache, check_dtype

# what PagedKVCache calls (results: table's only)
ALLOCATOR_METHODS = ("allocate", "grow", "fork", "free", "table")
ALLOCATOR_FIELDS = ("block_size", "num_blocks", "num_free")  # what it reads


class OutOfBlocks(ArLabError, RuntimeError):
    """The pool has fewer free blocks than a request asked for; nothing was changed. A server
    catches it and lets the request wait until another one finishes."""

    def __init__(self, asked: int, free: int, request: Hashable) -> None:
        self.asked, self.free, self.request = asked, free, request
        super().__init__(
            f"out of KV blocks: request {request!r} needs {asked} more block(s), {free}"
            " are free in the allocator; "
            # the pool is full
            "wait for a request to finish (or give the pool more blocks)",
            arg="allocator",
        )


def blocks_for(n_tokens: int, block_size: int) -> int:
    """Blocks that hold ``n_tokens`` positions: ceil(n / block_size) (0 tokens: no block)."""
    return -(-n_tokens // block_size)


class BlockAllocator:
    """A free list of physical block ids, a block table per request, reference counts for sharing.

    Request ids are any hashable names. The lowest free block is handed out first (any order
    would do; a fixed one makes tables reproducible). Every method checks its arguments and
    changes nothing when it raises.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = positive_int("num_blocks", num_blocks)
        self.block_size = positive_int("block_size", block_size)
        self._free = list(range(num_blocks))  # a heap: the lowest id first
        self._refs = [0] * num_blocks  # how many block tables hold each block
        self._tables: dict[Hashable, list[int]] = {}
        self._lengths: dict[Hashable, int] = {}
        self._freed: set[Hashable] = set()  # finished requests (to name a second free)

    # --- what a request holds -------------------------------------------------------------

    def table(self, request: Hashable) -> list[int]:
        """The physical blocks of ``request``'s logical blocks 0, 1, ... (a copy)."""
        return list(self._tables[self._known(request)])

    def length(self, request: Hashable) -> int:
        """Positions ``request`` holds."""
        return self._lengths[self._known(request)]

    def refcount(self, block: int) -> int:
        """How many requests' tables hold physical ``block`` (0: it is free)."""
        if (
            not isinstance(block, int)
            or isinstance(block, bool)
            or not 0 <= block < self.num_blocks
        ):
            raise BadValue(
                f"block must be an int in 0..{self.num_blocks - 1}, got {block!r}", arg="block"
            )
        return self._refs[block]

    @property
    def requests(self) -> list[Hashable]:
        return list(self._tables)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def tokens(self) -> int:
        """Positions held by all requests (a shared block counts once per request that reads it)."""
        return sum(self._lengths.values())

    # --- changes --------------------------------------------------------------------------

    def allocate(self, request: Hashable, n_tokens: int = 0) -> list[int]:
        """Start ``request`` with blocks for ``n_tokens`` positions; its table."""
        self._new(request)
        n_tokens = positive_int("n_tokens", n_tokens, 0)
        self._take(request, blocks_for(n_tokens, self.block_size))
        self._tables[request] = []
        self._freed.discard(request)
        return self._extend(request, n_tokens)

    def grow(self, request: Hashable, n_tokens: int) -> list[int]:
        """Let ``request`` hold ``n_tokens`` positions (no fewer than now): new blocks only when the
        last one is full. Its table."""
        have = self._lengths[self._known(request)]
        n_tokens = positive_int("n_tokens", n_tokens, have)
        self._take(request, blocks_for(n_tokens, self.block_size) - len(self._tables[request]))
        return self._extend(request, n_tokens)

    def fork(self, parent: Hashable, child: Hashable, n_tokens: int | None = None) -> list[int]:
        """Start ``child`` holding ``parent``'s first ``n_tokens`` positions (all of them by
        default).

        The blocks those positions fill completely are shared (their reference counts go up); a
        partly filled last block gets a fresh block of the child's own, into which the caller copies
        the filled positions. The child's table."""
        have = self._lengths[self._known(parent)]
        self._new(child, "child")
        n_tokens = have if n_tokens is None else n_tokens
        if not isinstance(n_tokens, int) or isinstance(n_tokens, bool) or not 0 <= n_tokens <= have:
            raise BadValue(
                f"n_tokens must be an int in 0..{have} (the parent's length), got {n_tokens!r}",
                arg="n_tokens",
            )
        full = n_tokens // self.block_size
        self._take(child, blocks_for(n_tokens, self.block_size) - full)
        shared = self._tables[parent][:full]
        for b in shared:
            self._refs[b] += 1
        self._tables[child] = shared
        self._freed.discard(child)
        return self._extend(child, n_tokens)

    def free(self, request: Hashable) -> None:
        """``request`` has finished: each of its blocks that no other request holds returns to the
        free list."""
        for b in self._tables.pop(self._known(request)):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                heapq.heappush(self._free, b)
        del self._lengths[request]
        self._freed.add(request)

    # --- inside ---------------------------------------------------------------------------

    def _known(self, request: Hashable) -> Hashable:
        if request in self._tables:
            return request
        if request in self._freed:
            raise KeyError(
                f"request {request!r} was already freed (a second free, or a use after free)"
            )
        raise KeyError(
            f"unknown request {request!r}: allocate it first (requests now: {list(self._tables)})"
        )

    def _new(self, request: Hashable, name: str = "request") -> None:
        if not isinstance(request, Hashable):
            raise BadType(
                f"a {name} id must be hashable (an int or a str), got {type(request).__name__}",
                arg=name,
            )
        if request in self._tables:
            raise BadValue(
                f"{name} {request!r} already holds blocks: free it first or pick another id",
                arg=name,
            )

    def _take(self, request: Hashable, n_blocks: int) -> None:
        """Check that ``n_blocks`` are free (the caller then takes them in ``_extend``)."""
        if n_blocks > len(self._free):
            raise OutOfBlocks(n_blocks, len(self._free), request)

    def _extend(self, request: Hashable, n_tokens: int) -> list[int]:
        table = self._tables[request]
        while len(table) < blocks_for(n_tokens, self.block_size):
            b = heapq.heappop(self._free)
            self._refs[b] = 1
            table.append(b)
        self._lengths[request] = n_tokens
        return list(table)

    def __repr__(self) -> str:
        return (
            f"BlockAllocator(blocks={self.num_blocks}, block_size={self.block_size}, free="
            f"{self.num_free}, requests={len(self._tables)}, tokens={self.tokens})"
        )


def check_allocator(allocator) -> None:
    """Raise unless ``allocator`` has what ``PagedKVCache`` uses (``BlockAllocator``'s interface)
    and is empty: a TypeError naming the first missing method or attribute."""
    missing = [m for m in ALLOCATOR_METHODS if not callable(getattr(allocator, m, None))]
    missing += [f for f in ALLOCATOR_FIELDS if not hasattr(allocator, f)]
    if missing:
        raise BadType(
            f"allocator must have BlockAllocator's interface; {type(allocator).__name__} lacks "
            f"{missing[0]!r} (it needs the methods {', '.join(ALLOCATOR_METHODS)} and the "
            f"attributes {', '.join(ALLOCATOR_FIELDS)})",
            arg="allocator",
        )
    for f in ("block_size", "num_blocks"):
        positive_int(f"allocator.{f}", getattr(allocator, f))
    if allocator.num_free != allocator.num_blocks:
        raise BadValue(
            f"allocator must be empty (a fresh one): {allocator.num_free} of its "
            f"{allocator.num_blocks} blocks are free",
            arg="allocator",
        )


class PagedKVCache(BatchKVCache):
    """``BatchKVCache``'s interface (``slot``, ``add``, ``remove``, ``begin``, ``update``,
    ``advance``) over a pool of blocks: the memory a row holds grows with it, one block at a time.

    ``slot(rows)`` starts a new request (no blocks yet: its prefill allocates them as it writes);
    ``add`` makes it a row; ``remove`` frees its blocks and moves the last row's *table* into the
    freed row (no keys or values move). ``hold_prefix`` writes a shared prefix into blocks of its
    own once, and ``slot(rows, shared=n)`` starts a request that shares them
    (``BlockAllocator.fork``).
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
        *,
        block_size: int | None = None,
        num_blocks: int | None = None,
        allocator=None,
    ) -> None:
        for name, value in [
            ("n_layer", n_layer),
            ("max_batch", max_batch),
            ("n_kv_heads", n_kv_heads),
            ("max_len", max_len),
            ("head_dim", head_dim),
        ]:
            positive_int(name, value)
        dtype = check_dtype(dtype)
        if allocator is None:
            block_size = positive_int("block_size", 16 if block_size is None else block_size)
            per_row = blocks_for(max_len, block_size)
            num_blocks = (
                max_batch * per_row
                if num_blocks is None
                else positive_int("num_blocks", num_blocks)
            )
            allocator = BlockAllocator(num_blocks, block_size)
        else:
            check_allocator(allocator)
            for name, value in [("block_size", block_size), ("num_blocks", num_blocks)]:
                if value is not None and value != getattr(allocator, name):
                    raise BadValue(
                        f"{name}={value} but the allocator has {getattr(allocator, name)}: leave "
                        f"{name} out when you pass an allocator",
                        arg=name,
                    )
        self.allocator, self.block_size, self.num_blocks = (
            allocator,
            allocator.block_size,
            allocator.num_blocks,
        )
        device = torch.device(device)
        shape = (n_layer, self.num_blocks, n_kv_heads, self.block_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_batch, self.max_len, self.device = max_batch, max_len, device
        self.lengths = [0] * max_batch  # positions filled in each row
        self.ids: list[Hashable | None] = [None] * max_batch  # the request decoding in each row
        self.rows, self._end, self._next = 0, 0, 0
        self._pending: Hashable | None = None  # started by slot(rows), not yet a row
        self._prefix: Hashable | None = None
        self._steps = torch.arange(max_len + self.block_size, device=device)
        # (block, offset) of this step's positions
        self._where: tuple[torch.Tensor, torch.Tensor] | None = None
        self._table: torch.Tensor | None = None  # (rows, blocks) of this step

    @classmethod
    def for_model(
        cls,
        model,
        max_batch: int,
        max_len: int | None = None,
        dtype=None,
        *,
        block_size: int | None = None,
        num_blocks: int | None = None,
        allocator=None,
    ) -> PagedKVCache:
        """A paged cache shaped for ``model``; ``num_blocks`` defaults to the contiguous cache's
        memory (``max_batch`` rows of ``max_len``, rounded up to whole blocks)."""
        # checks the model, max_len and dtype
        plain = BatchKVCache.for_model(model, 1, max_len, dtype)
        _, h, t, d = plain.k[0].shape
        return cls(len(plain.k), max_batch, h, t, d, plain.dtype, plain.k[0].device,
                   block_size=block_size, num_blocks=num_blocks, allocator=allocator)

    @property
    def bytes_per_position(self) -> int:
        """Bytes of one position's keys and values over all layers."""
        return 2 * self.k[:, 0, :, 0].nbytes

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    # --- requests in and out ----------------------------------------------------------------

    def slot(self, i: int, shared: int = 0) -> PagedSlot:
        """Row ``i`` as a batch-1 cache; ``i == rows`` starts a new request, sharing the first
        ``shared`` positions of the prefix held by ``hold_prefix``. A started request that never
        became a row (``add``) is freed by the next ``slot(rows)`` or by ``drop_pending``."""
        positive_int("slot", i, 0)
        if i < self.rows:
            return PagedSlot(self, self.ids[i], self.lengths[i])
        if i != self.rows or i >= self.max_batch:
            raise BadValue(
                f"slot must be a row in use (0..{self.rows - 1}) or the next free one ("
                f"{self.rows}), "
                # (as positive_int names i)
                f"and there are {self.max_batch} rows; got {i}",
                arg="slot",
            )
        self.drop_pending()
        rid, self._next = self._next, self._next + 1
        if shared:
            self._share(rid, shared)
        else:
            self.allocator.allocate(rid, 0)
        self._pending = rid
        return PagedSlot(self, rid, shared)

    def drop_pending(self) -> None:
        """Free the request ``slot`` started if it never became a row (its prefill finished it)."""
        if self._pending is not None:
            self.allocator.free(self._pending)
            self._pending = None

    def hold_prefix(self, k: list[torch.Tensor], v: list[torch.Tensor]) -> int:
        """Write a shared prefix's keys/values (per layer (1, H_kv, n, D), e.g. a ``PrefixCache``'s)
        into blocks of its own, held until ``close``; requests then share them (``slot(rows,
        shared=...)``)."""
        if self._prefix is not None:
            raise BadValue("this cache already holds a prefix", arg="cache")
        if k[0].dtype != self.k.dtype or k[0].device != self.k.device:
            raise BadValue(
                f"the prefix (k, v) holds {k[0].dtype} on {k[0].device}, the cache {self.k.dtype}"
                f" on {self.k.device}: build the prefix from the model that uses the cache",
                arg="k",
            )
        rid, self._next = self._next, self._next + 1
        self.allocator.allocate(rid, 0)
        self._prefix, holder = rid, PagedSlot(self, rid, 0)
        for layer, (kl, vl) in enumerate(zip(k, v, strict=True)):
            holder.write(layer, kl, vl, 0)
        return kl.shape[2]

    def _share(self, rid: Hashable, n: int) -> None:
        if self._prefix is None:
            raise BadValue(
                "no prefix is held: call hold_prefix first, or pass shared=0", arg="shared"
            )
        self.allocator.fork(self._prefix, rid, n)
        table = self.allocator.table(rid)
        j = n // self.block_size
        # the partly filled block is the child's own: copy the prefix's positions in
        if n % self.block_size:
            src = self.allocator.table(self._prefix)[j]
            self.k[:, table[j]], self.v[:, table[j]] = self.k[:, src], self.v[:, src]

    def close(self) -> None:
        """Free every request and the prefix: the pool is empty again."""
        self.drop_pending()
        for i in range(self.rows):
            self.allocator.free(self.ids[i])
        self.rows = 0
        if self._prefix is not None:
            self.allocator.free(self._prefix)
            self._prefix = None

    def add(self, length: int) -> int:
        """Make the request started by ``slot(rows)`` (prefilled with ``length`` positions) a row;
        its index."""
        if self._pending is None:
            raise BadValue(
                "no request was started in this cache: call slot(rows) and prefill it first",
                arg="cache",
            )
        if self.rows == self.max_batch:
            raise BadValue(
                f"all {self.max_batch} rows are in use: remove a finished row from the cache first",
                arg="cache",
            )
        positive_int("length", length, 0)
        i, self.rows = self.rows, self.rows + 1
        self.lengths[i], self.ids[i], self._pending = length, self._pending, None
        return i

    def remove(self, i: int) -> int | None:
        """Free row ``i``'s blocks; the last row's table moves into it. Returns the index that moved
        (or None)."""
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.rows:
            raise BadValue(
                f"row i must be in use: an int in 0..{self.rows - 1}, got {i!r}", arg="i"
            )
        self.allocator.free(self.ids[i])
        last = self.rows = self.rows - 1
        self.lengths[i], self.ids[i] = self.lengths[last], self.ids[last]
        self.lengths[last], self.ids[last] = 0, None
        return last if i != last else None

    # --- a forward step -------------------------------------------------------------------

    def begin(self, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``BatchKVCache.begin``, after growing every row by ``T`` positions (new blocks where its
        last is full)."""
        positions, mask = super().begin(T)
        bs, tables = self.block_size, []
        for i in range(self.rows):
            self.allocator.grow(self.ids[i], self.lengths[i] + T)
            tables.append(self.allocator.table(self.ids[i]))
        for i, t in enumerate(tables):  # the blocks this step writes are each row's own
            self.check_owned(
                self.ids[i], t[self.lengths[i] // bs : blocks_for(self.lengths[i] + T, bs)]
            )
        width = blocks_for(self._end, bs)
        padded = [t + [0] * (width - len(t)) for t in tables]  # (masked beyond each row's length)
        self._table = torch.tensor(padded, device=self.device)  # (rows, blocks)
        block = torch.gather(self._table, 1, positions // bs)  # (rows, T)
        self._where = (block, positions % bs)
        return positions, mask

    def check_owned(self, request: Hashable, blocks: list[int]) -> None:
        """Raise unless ``blocks``, which ``request`` is about to write, are in no other live
        request's table (a running row, the request being prefilled, the held prefix). Blocks shared
        by ``fork`` are full ones of the prefix, which nobody writes; a block two requests write
        would mix their keys and values silently."""
        mine = set(blocks)
        live = [*self.ids[: self.rows], self._pending, self._prefix]
        for other in live:
            if other is None or other == request:
                continue
            both = mine.intersection(self.allocator.table(other))
            if both:
                raise BadValue(
                    f"the allocator gave block {min(both)} to request {request!r}, which writes "
                    f"it, while request {other!r} holds it too: a block a request writes must be "
                    "its own (fork shares only full prefix blocks, never written again)",
                    arg="allocator",
                )

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos) -> None:
        """Scatter k, v (rows, H_kv, T, D) into each row's blocks, at the positions ``begin``
        gave."""
        block, offset = self._where
        # (rows, T, H_kv, D): advanced indices first
        self.k[layer][block, :, offset] = k.transpose(1, 2)
        self.v[layer][block, :, offset] = v.transpose(1, 2)

    def keys(self, layer: int, pos, T: int) -> Keys:
        """Every row's blocks gathered into (rows, H_kv, keys, D) for attention."""
        table, end = self._table, self._end
        return Keys(self.gather(self.k[layer], table, end), self.gather(self.v[layer], table, end))

    @staticmethod
    def gather(pool: torch.Tensor, table: torch.Tensor, end: int) -> torch.Tensor:
        """The first ``end`` positions of each table's blocks, (rows, H_kv, end, D), from ``pool``
        (blocks, H_kv, block_size, D): the copy a CPU makes where a GPU kernel reads the blocks in
        place."""
        rows, n = table.shape
        _, h, bs, d = pool.shape
        blocks = pool[table]  # (rows, n, H_kv, bs, D)
        return blocks.transpose(1, 2).reshape(rows, h, n * bs, d)[:, :, :end]

    def __repr__(self) -> str:
        _, nb, h, bs, d = self.k.shape
        return (
            f"PagedKVCache(layers={len(self.k)}, blocks={nb}x{bs}, free={self.allocator.num_free}"
            f", rows={self.rows}, kv_heads={h}, head_dim={d}, lengths={self.lengths[: self.rows]}"
            f", nbytes={self.nbytes:,})"
        )
