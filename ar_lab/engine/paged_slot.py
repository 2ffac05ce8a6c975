"""One request of a ``PagedKVCache`` (``ar_lab.engine.paged``) as a batch-1 KV store: what its
prefill writes."""

from __future__ import annotations

from collections.abc import Hashable

import torch

from ar_lab.model.attention import Keys
from ar_lab.model.cache import KVCache


class PagedSlot(KVCache):
    """One request of a ``PagedKVCache`` as a batch-1 ``KVCache``: what a request's prefill writes
    through (``update`` grows the request and scatters into its blocks; attention reads a
    gather)."""

    def __init__(self, paged, request: Hashable, length: int) -> None:
        self.paged, self.request = paged, request
        # (n_layer, blocks, H_kv, block_size, D): k[layer] per layer
        self.k, self.v = paged.k, paged.v
        self.batch_size, self.max_len, self.length = 1, paged.max_len, length
        self._ids: list[int] = []
        self._held = length  # positions the allocator holds for the request

    def _store(self, layer: int, start: int, end: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v (1, H_kv, T, D) at positions start..end of the request, growing its blocks
        first."""
        paged = self.paged
        if end > self._held:
            paged.allocator.grow(self.request, end)
            self._held = end
        owned = paged.allocator.table(self.request)
        if layer == 0:  # once per write: the blocks it fills are the request's own
            paged.check_owned(
                self.request, owned[start // paged.block_size : -(-end // paged.block_size)]
            )
        pos = torch.arange(start, end, device=paged.device)
        table = torch.tensor(owned, device=paged.device)
        block, offset = table[pos // paged.block_size], pos % paged.block_size  # (T,) each
        paged.k[layer][block, :, offset] = k[0].transpose(0, 1)  # (T, H_kv, D) into the blocks
        paged.v[layer][block, :, offset] = v[0].transpose(0, 1)

    def keys(self, layer: int, pos: int, T: int) -> Keys:
        """The request's positions 0 .. pos + T - 1, gathered from its blocks."""
        end, paged = pos + T, self.paged
        table = torch.tensor(paged.allocator.table(self.request), device=paged.device)
        used = table[: -(-end // paged.block_size)][None]  # (1, blocks): ceil(end / block_size)
        return Keys(
            paged.gather(paged.k[layer], used, end), paged.gather(paged.v[layer], used, end)
        )

    @property
    def nbytes(self) -> int:
        return self.paged.nbytes

    @property
    def used_bytes(self) -> int:
        return self.paged.bytes_per_position * self.length
