"""A preallocated key/value cache.

During decoding the keys and values of past tokens never change, so each layer keeps
them instead of recomputing them every step. The buffers are allocated once at full
size, per layer (B, H_kv, T_max, D); a step writes its new positions in place and
attention reads the filled prefix. Nothing is re-allocated or concatenated per step.

``truncate(n)`` rolls the cache back to its first n positions (speculative decoding
uses it to discard rejected draft tokens): the stale entries beyond n are simply
overwritten by the next write.
"""

from __future__ import annotations

import torch


class KVCache:
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
        for name, value in [
            ("n_layer", n_layer),
            ("batch_size", batch_size),
            ("n_kv_heads", n_kv_heads),
            ("max_len", max_len),
            ("head_dim", head_dim),
        ]:
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        shape = (batch_size, n_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.max_len = max_len
        self.batch_size = batch_size
        self.length = 0  # positions filled so far

    @classmethod
    def for_model(cls, model, batch_size: int = 1, max_len: int | None = None, dtype=None) -> KVCache:
        """A cache shaped for ``model`` (max_len defaults to its context window)."""
        cfg = model.config
        max_len = cfg.block_size if max_len is None else max_len
        if max_len > cfg.block_size:
            raise ValueError(f"max_len={max_len} exceeds the model's context window ({cfg.block_size})")
        p = next(model.parameters())
        return cls(cfg.n_layer, batch_size, cfg.kv_heads, max_len, cfg.head_dim, dtype or p.dtype, p.device)

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        """Write k, v (B, H_kv, T, D) at positions start..start+T; return all keys/values so far."""
        end = start + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache full: positions up to {end} requested, capacity is {self.max_len}")
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def truncate(self, n: int) -> None:
        """Keep only the first ``n`` positions (roll back)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"can truncate to 0..{self.length} positions, got {n}")
        self.length = n

    def reset(self) -> None:
        self.length = 0

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


def kv_cache_bytes(
    n_layer: int, n_kv_heads: int, head_dim: int, seq_len: int, batch_size: int = 1, bytes_per_value: int = 4
) -> int:
    """layers x KV heads x head dim x sequence x batch x 2 (K and V) x bytes per value."""
    return n_layer * n_kv_heads * head_dim * seq_len * batch_size * 2 * bytes_per_value
