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
the prefill goes through ``GPT.forward`` (``update`` quantizes the new keys and values and
returns the dequantized prefix to attention), and the decode steps through the lean step,
which calls ``attend``: the int8 keys and values are read as they are and their scales folded
into the attention scores and weights, so no dequantized copy of the cache is kept. A cache
is chosen by passing it: nothing changes for a caller that does not.
"""

from __future__ import annotations

import torch

from ar_lab.base.errors import BadType, ContextFull
from ar_lab.engine.quant import absmax_quantize
from ar_lab.model.cache import KVCache, kv_cache_bytes


def int8_kv_cache_bytes(
    n_layer: int, n_kv_heads: int, head_dim: int, seq_len: int, batch_size: int = 1, scale_bytes: int = 4
) -> int:
    """Bytes of an ``Int8KVCache``: the int8 keys and values (``kv_cache_bytes`` at one byte per value)
    plus one scale per key and value vector (the same formula with one value of ``scale_bytes`` per head)."""
    values = kv_cache_bytes(n_layer, n_kv_heads, head_dim, seq_len, batch_size, bytes_per_value=1)
    return values + kv_cache_bytes(n_layer, n_kv_heads, 1, seq_len, batch_size, bytes_per_value=scale_bytes)


class Int8KVCache(KVCache):
    """A ``KVCache`` whose keys and values are int8, with a float32 scale per (row, head, position).

    ``k``/``v``: per layer (B, H_kv, T_max, D) int8; ``k_scale``/``v_scale``: per layer (B, H_kv, T_max)
    float32. ``dtype``: what the model computes in (attention receives dequantized values of it).

    A key or value vector holding NaN or inf gets a NaN or inf scale, so it dequantizes to
    non-finite values, as a float cache would hold them: never to a finite vector that hides the fault.
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
        super().__init__(n_layer, batch_size, n_kv_heads, max_len, head_dim, dtype, device)  # checks dtype
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
        # arg=None: no argument of this call is at fault; this constructor is not one Int8KVCache offers.
        raise BadType("Int8KVCache owns its buffers and scales: build it with Int8KVCache.for_model(model)", arg=None)

    def _dequantized(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.k[layer][:, :, :end].to(self.dtype) * self.k_scale[layer][:, :, :end, None].to(self.dtype)
        v = self.v[layer][:, :, :end].to(self.dtype) * self.v_scale[layer][:, :, :end, None].to(self.dtype)
        return k, v  # (B, H_kv, end, D)

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        """Quantize and write k, v (B, H_kv, T, D) at positions start..start+T; return the dequantized
        keys/values so far (B, H_kv, start + T, D), in ``dtype`` (what ``GPT.forward``'s attention reads)."""
        end = start + k.shape[2]
        if end > self.max_len:
            raise ContextFull(f"KV cache full: positions up to {end} requested, capacity is {self.max_len}",
                              arg="cache")
        del self._ids[start:]
        for values, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            q, s = absmax_quantize(x.float(), 127)  # one scale per (row, head, position)
            values[layer][:, :, start:end] = q
            scales[layer][:, :, start:end] = s
        return self._dequantized(layer, end)

    def attend(
        self, layer: int, pos: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor
    ) -> torch.Tensor:
        """One layer of the lean decode step (batch row 0): write the new key and value k, v (H_kv, D) at
        ``pos``, then attention of the queries q (H_kv, G, D) over positions 0..pos into ``out`` (H_kv, G, D).

        scores = (q . k_int8) x k_scale x scale and out = (softmax x v_scale) . v_int8: the scales of
        each position fold into the scores and the attention weights.
        """
        L = pos + 1
        K, V, ks, vs = self.k[layer][0], self.v[layer][0], self.k_scale[layer][0], self.v_scale[layer][0]
        K[:, pos], ks[:, pos] = absmax_quantize(k.float(), 127)  # (H_kv, D) int8, (H_kv,)
        V[:, pos], vs[:, pos] = absmax_quantize(v.float(), 127)
        dtype = q.dtype
        scores = torch.bmm(q, K[:, :L].to(dtype).transpose(1, 2))  # (H_kv, G, L)
        scores.mul_(ks[:, None, :L].to(dtype)).mul_(scale)
        weights = torch.softmax(scores, -1).mul_(vs[:, None, :L].to(dtype))
        return torch.bmm(weights, V[:, :L].to(dtype), out=out)

    @property
    def nbytes(self) -> int:
        """Bytes held: the int8 keys and values and their float32 scales (all layers)."""
        return super().nbytes + sum(t.nbytes for t in self.k_scale) + sum(t.nbytes for t in self.v_scale)

    def __repr__(self) -> str:
        return "Int8" + super().__repr__()
