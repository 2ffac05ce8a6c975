"""An int8 KV cache: keys and values in one byte each, a float32 scale per head and position.

The KV cache grows with the context (chapter 04): at long contexts or large batches it, not
the weights, is what a decode step reads most. ``Int8KVCache`` stores each key and value
vector (head_dim values of one head at one position) as int8 with its own absmax scale,
scale = max|vector| / 127 (``ar_lab.engine.quant.absmax_quantize``). One scale per head and position
is the robust choice: a position whose keys are unusually large (an attention sink, an outlier
token) does not coarsen every other position's levels, as a single per-head scale would, and
the scale is written once, with its vector, so nothing is ever re-quantized. It costs 4 bytes
per head_dim bytes: (D + 4) / 4D of a float32 cache (about 27% at D = 64).

It is a ``KVCache`` (same constructor and ``for_model``, ``truncate``, recorded token ids), so
``ar_lab.generate(model, prompt, n, cache=Int8KVCache.for_model(model, max_len=...))`` uses it:
every pass writes through the KV-store protocol (``write`` quantizes the new keys and values)
and attention (``ar_lab.model.attention``) reads the int8 keys and values with their scales: for
one query (a decode step) the scales fold into the attention scores and weights, so no
dequantized copy of the cache is made; several queries (a prompt) read a dequantized copy. A cache
is chosen by passing it: nothing changes for a caller that does not.
"""

from __future__ import annotations

import torch

from ar_lab.base.errors import BadType
from ar_lab.engine.quant import absmax_quantize
from ar_lab.model.attention import Keys
from ar_lab.model.cache import KVCache, kv_cache_bytes


def int8_kv_cache_bytes(
    n_layer: int,
    n_kv_heads: int,
    head_dim: int,
    seq_len: int,
    batch_size: int = 1,
    scale_bytes: int = 4,
) -> int:
    """Bytes of an ``Int8KVCache``: the int8 keys and values (``kv_cache_bytes`` at one byte per
    value) plus one scale per key and value vector (the same formula with one value of
    ``scale_bytes`` per head)."""
    values = kv_cache_bytes(n_layer, n_kv_heads, head_dim, seq_len, batch_size, bytes_per_value=1)
    return values + kv_cache_bytes(
        n_layer, n_kv_heads, 1, seq_len, batch_size, bytes_per_value=scale_bytes
    )


class Int8KVCache(KVCache):
    """A ``KVCache`` whose keys and values are int8, with a float32 scale per (row, head, position).

    ``k``/``v``: per layer (B, H_kv, T_max, D) int8; ``k_scale``/``v_scale``: per layer (B, H_kv,
    T_max) float32. ``dtype``: what the model computes in (attention receives dequantized values of
    it).

    A key or value vector holding NaN or inf gets a NaN or inf scale, so it dequantizes to
    non-finite values, as a float cache would hold them: never to a finite vector that hides the
    fault.
    """

    storage_dtype = torch.int8  # the buffers; ``dtype`` is what attention reads

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
        # checks dtype
        super().__init__(n_layer, batch_size, n_kv_heads, max_len, head_dim, dtype, device)
        self._dtype = dtype
        shape = (batch_size, n_kv_heads, max_len)
        self.k_scale = [torch.ones(shape, device=device) for _ in range(n_layer)]
        self.v_scale = [torch.ones(shape, device=device) for _ in range(n_layer)]

    @property
    def dtype(self) -> torch.dtype:
        """The model's compute dtype: what the int8 keys and values are dequantized to."""
        return self._dtype

    @classmethod
    def from_buffers(cls, k, v, length: int = 0):
        # arg=None: no argument of this call is at fault; this constructor is not one Int8KVCache
        # offers.
        raise BadType(
            "Int8KVCache owns its buffers and scales: build it with Int8KVCache.for_model(model)",
            arg=None,
        )

    def _store(self, layer: int, start: int, end: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize k, v (B, H_kv, T, D) into positions start..end: int8 values, one scale per (row,
        head, position)."""
        for values, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            q, s = absmax_quantize(x.float(), 127)
            values[layer][:, :, start:end] = q
            scales[layer][:, :, start:end] = s

    def keys(self, layer: int, pos: int, T: int) -> Keys:
        """The int8 keys and values of positions 0 .. pos + T - 1 with their scales: attention folds
        the scales into the scores and the weights (one query) or dequantizes (several)."""
        end = pos + T
        return Keys(self.k[layer][:, :, :end], self.v[layer][:, :, :end], None,
                    self.k_scale[layer][:, :, :end], self.v_scale[layer][:, :, :end])

    @property
    def nbytes(self) -> int:
        """Bytes held: the int8 keys and values and their float32 scales (all layers)."""
        return (
            super().nbytes
            + sum(t.nbytes for t in self.k_scale)
            + sum(t.nbytes for t in self.v_scale)
        )

    def __repr__(self) -> str:
        return "Int8" + super().__repr__()
