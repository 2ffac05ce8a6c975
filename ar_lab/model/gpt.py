"""A GPT in the GPT-2 mould, small enough to train on a laptop CPU.

Token + learned position embeddings, a stack of pre-norm blocks (LayerNorm ->
causal self-attention -> residual, LayerNorm -> MLP -> residual), a final LayerNorm
and an output projection tied to the token embedding. With ``n_kv_heads == n_head``
it is exactly GPT-2's architecture (tests check it against Hugging Face's
``GPT2LMHeadModel``); fewer KV heads give grouped-query (GQA) or multi-query (MQA)
attention, where groups of query heads share one key/value head.

``forward(idx, cache)`` processes only the new tokens when a ``KVCache`` is given:
their keys/values are appended to the cache and attention reads all of it. The model computes
and nothing else: the decode loops' bookkeeping (which tokens a cache holds, rolling it back,
rows of different lengths) lives in ``ar_lab.engine``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ar_lab.base.errors import BadType, BadValue, ContextFull
from ar_lab.model.cache import KVCache
from ar_lab.model.tokenizer import VOCAB_SIZE


@dataclass
class GPTConfig:
    vocab_size: int = VOCAB_SIZE
    block_size: int = 1024  # context window: the most positions one sequence can hold
    n_layer: int = 4
    n_head: int = 4
    n_kv_heads: int | None = None  # None: same as n_head (MHA); 1: MQA; in between: GQA
    n_embd: int = 256
    dropout: float = 0.0

    def __post_init__(self) -> None:
        # bool is an int to Python, but GPTConfig(n_kv_heads=True) is a mistake, not one KV head.
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise BadValue(f"GPTConfig.{name} must be a positive int, got {value!r}", arg=name)
        if self.n_embd % self.n_head:
            raise BadValue(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})", arg="n_head")
        if self.n_kv_heads is not None:
            kv = self.n_kv_heads
            if not isinstance(kv, int) or isinstance(kv, bool) or kv < 1:
                raise BadValue(
                    f"GPTConfig.n_kv_heads must be a positive int or None (= n_head), got {kv!r}", arg="n_kv_heads"
                )
            if self.n_head % kv:
                raise BadValue(
                    f"n_head ({self.n_head}) must be a multiple of n_kv_heads ({kv}): "
                    "each KV head serves an equal group of query heads",
                    arg="n_kv_heads",
                )
        d = self.dropout
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0.0 <= d < 1.0:
            raise BadValue(f"GPTConfig.dropout must be a number in [0, 1), got {d!r}", arg="dropout")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_head if self.n_kv_heads is None else self.n_kv_heads

    def to_dict(self) -> dict:
        return asdict(self)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv, self.d = cfg.n_head, cfg.kv_heads, cfg.head_dim
        # One fused projection for queries (n_head heads) and keys/values (n_kv heads each).
        self.qkv = nn.Linear(cfg.n_embd, (self.n_head + 2 * self.n_kv) * self.d)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout
        self.split_sizes = [self.n_head, self.n_kv, self.n_kv]  # heads of q, k, v
        self.gqa = self.n_kv != self.n_head

    def forward(
        self, x: torch.Tensor, cache: KVCache | None, layer: int, start: int, row_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        B, T, C = x.shape
        # Heads side by side -> heads as a dimension: (B, T, (H + 2 H_kv) * D) -> (B, H + 2 H_kv, T, D),
        # then q, k, v are consecutive head ranges. One view and one transpose (what einops'
        # rearrange "b t (h d) -> b h t d" does, without its per-call parsing: a one-token decode
        # step is short enough for that to show in tokens/s).
        qkv = self.qkv(x).view(B, T, self.n_head + 2 * self.n_kv, self.d).transpose(1, 2)
        q, k, v = qkv.split(self.split_sizes, dim=1)  # (B, H, T, D), (B, H_kv, T, D), (B, H_kv, T, D)
        if cache is not None:
            k, v = cache.update(layer, start, k, v)  # (B, H_kv, start + T, D)
        # Causal mask: query i (absolute position start + i) sees keys 0..start + i.
        # One new token sees everything cached: no mask needed. A fresh sequence: the
        # standard lower-triangular mask. New tokens after a cached prefix: explicit mask.
        # Rows of different lengths (a BatchKVCache): the per-row mask built once per step.
        mask, causal = row_mask, False
        if T > 1 and mask is None:
            if start == 0:
                causal = True
            else:
                mask = torch.ones(T, start + T, dtype=torch.bool, device=x.device).tril(diagonal=start)
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=causal,
            dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=self.gqa,
        )  # (B, H, T, D)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))  # heads back side by side: (B, T, H * D)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # GPT-2 uses the tanh approximation of GELU.
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(
        self, x: torch.Tensor, cache: KVCache | None, layer: int, start: int, row_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        a = self.attn(self.ln1(x), cache, layer, start, row_mask)
        x = x + (self.drop(a) if self.training else a)  # dropout is the identity in eval: skip the call
        m = self.mlp(self.ln2(x))
        return x + (self.drop(m) if self.training else m)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise BadType(f"GPT(config) needs a GPTConfig, got {type(config).__name__}", arg="config")
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as in GPT-2
        self.apply(self._init_weights)
        # GPT-2's scaled init of the projections that write into the residual stream.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self, exclude_positions: bool = False) -> int:
        """Parameters, counting the tied embedding/output matrix once."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if exclude_positions else n

    @property
    def device(self) -> torch.device:
        return self.wte.weight.device

    def forward(
        self,
        idx: torch.Tensor,
        cache: KVCache | None = None,
        *,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (B, T, vocab) for token ids idx (B, T).

        Without a cache, idx is the whole sequence from position 0. With a cache, idx holds only
        the new tokens, at positions cache.length .. + T: ``cache.update`` stores their keys and
        values, attention reads all of them, and cache.length moves on by T. ``positions`` (B, T)
        and ``mask`` (B, 1, T, keys) place each row at positions of its own (a ``BatchKVCache``
        of rows at different lengths, chapter 08): the caller then moves the cache on.
        """
        if idx.ndim != 2:
            raise BadValue(f"idx must have shape (batch, time), got {tuple(idx.shape)}", arg="idx")
        if idx.dtype not in (torch.long, torch.int, torch.int32):
            raise BadType(f"idx must hold integer token ids, got dtype {idx.dtype}", arg="idx")
        B, T = idx.shape
        if T == 0:
            raise BadValue("idx is empty: give at least one token", arg="idx")
        if positions is None:
            start = 0 if cache is None else cache.length
            end = start + T
            if end > self.config.block_size:
                raise ContextFull(
                    f"{end} positions exceed the context window of {self.config.block_size} tokens "
                    f"(config.block_size); shorten the prompt (idx) or generate fewer tokens",
                    arg="idx",
                )
            if cache is not None and cache.batch_size != B:
                raise BadValue(f"cache was built for batch size {cache.batch_size}, got a batch of {B}", arg="cache")
            where, pos_emb = start, self.wpe.weight[start:end]  # positions are a slice of wpe
        else:
            where, pos_emb = positions, self.wpe(positions)  # (B, T, C): each row at its own positions
        try:
            x = self.wte(idx) + pos_emb  # (B, T, C)
        except IndexError:  # the embedding checks the ids as it gathers: nothing to pay when they are fine
            raise BadValue(
                f"idx holds token ids outside the vocabulary [0, {self.config.vocab_size - 1}]", arg="idx"
            ) from None
        except RuntimeError:  # ids on another device than the model: said here, not by torch's index_select
            if idx.device == self.wte.weight.device:
                raise
            raise BadValue(f"idx is on {idx.device}, the model on {self.wte.weight.device}: pass idx.to(model.device)",
                           arg="idx") from None
        if cache is not None and getattr(cache, "dtype", x.dtype) != x.dtype:  # a cache of one's own may have none
            raise BadType(
                f"the cache holds {cache.dtype} keys and values but the model computes in {x.dtype}: "
                f"build the cache with dtype={x.dtype} (or convert the model)",
                arg="cache",
            )
        if self.training:
            x = self.drop(x)  # (dropout is the identity in eval: skip the call)
        for layer, block in enumerate(self.blocks):
            x = block(x, cache, layer, where, mask)
        if cache is not None and positions is None:
            cache.length = end
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)


def checked_model(model, name: str = "model"):
    """``model`` if it is an ar_lab model (a ``torch.nn.Module`` with a ``GPTConfig`` as ``.config``: a GPT,
    a quantized copy of one, a ``BigramModel``); else a BadType (a TypeError) naming ``name``, saying what to pass."""
    if not isinstance(model, torch.nn.Module) or not isinstance(getattr(model, "config", None), GPTConfig):
        raise BadType(
            f"{name} must be an ar_lab model (a GPT, e.g. load_pretrained('course')), got {type(model).__name__}",
            arg=name,
        )
    return model
