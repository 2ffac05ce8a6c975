"""A GPT in the GPT-2 mould, small enough to train on a laptop CPU, or a Llama-shaped one by
configuration.

Token embeddings (+ learned position embeddings, GPT-2; or rotary positions inside attention), a
stack of pre-norm blocks (norm -> causal self-attention -> residual, norm -> MLP -> residual), a
final norm and an output projection tied to the token embedding. With the default ``GPTConfig`` it
is exactly GPT-2's architecture (tests check it against Hugging Face's ``GPT2LMHeadModel``);
``GPTConfig.modern()`` is Llama's (RMSNorm, RoPE, SwiGLU, grouped-query attention; tests check it
against ``LlamaForCausalLM``).

The block's arithmetic is ``ar_lab.model.block.block``, which the lean engine runs too.
``forward(idx, cache)`` processes only the new tokens when a cache (a KV store,
``ar_lab.model.attention``) is given: their keys/values are written to it at their positions and
attention reads what it holds. The model computes and nothing else: the decode loops' bookkeeping
(which tokens a cache holds, rolling it back, rows of different lengths) lives in ``ar_lab.engine``.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from ar_lab.base.errors import BadType, BadValue, ContextFull
from ar_lab.model.attention import Pos, Store, Uncached, Updating
from ar_lab.model.block import BlockSpec, BlockWeights, attend, mlp, residual
from ar_lab.model.cache import KVCache
from ar_lab.model.config import GPTConfig
from ar_lab.model.moe import MoE

__all__ = ["GPT", "GPTConfig", "Block", "CausalSelfAttention", "MLP", "checked_model"]


def norm(cfg: GPTConfig) -> nn.Module:
    """The block's and the final norm: LayerNorm (GPT-2) or RMSNorm (Llama)."""
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps, bias=cfg.bias)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv, self.d = cfg.n_head, cfg.kv_heads, cfg.head_dim
        # One fused projection for queries (n_head heads) and keys/values (n_kv heads each).
        self.qkv = nn.Linear(cfg.n_embd, (self.n_head + 2 * self.n_kv) * self.d, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.spec = BlockSpec.from_config(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cache: Store | None,
        layer: int,
        start: Pos,
        row_mask: torch.Tensor | None = None,
        spec: BlockSpec | None = None,
    ) -> torch.Tensor:
        """Attention of normed activations x (B, T, C) at positions ``start`` (an int or (B, T)),
        through ``cache`` (None: x is a whole sequence); the output before the residual."""
        store = Uncached(layer + 1) if cache is None else cache
        w = BlockWeights(None, self.qkv, self.proj, None, None, None)
        spec = self.spec if spec is None else spec
        return attend(
            x, w, spec, store, layer, start, row_mask, self.dropout if self.training else 0.0
        )


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        # SwiGLU: gate | up in one product
        width = 2 * cfg.hidden if cfg.mlp == "swiglu" else cfg.hidden
        self.fc = nn.Linear(cfg.n_embd, width, bias=cfg.bias)
        self.proj = nn.Linear(cfg.hidden, cfg.n_embd, bias=cfg.bias)
        self.gated = cfg.mlp == "swiglu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mlp(x, self.fc, self.proj, self.gated)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = norm(cfg)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = norm(cfg)
        self.mlp = MoE(cfg, MLP) if cfg.n_experts else MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(
        self,
        x: torch.Tensor,
        cache: Store | None,
        layer: int,
        start: Pos,
        row_mask: torch.Tensor | None = None,
        spec: BlockSpec | None = None,
    ) -> torch.Tensor:
        store = Uncached(layer + 1) if cache is None else cache
        # dropout is the identity in eval
        drop = self.drop if self.training and self.drop.p > 0 else None
        return residual(
            x,
            self.ln1,
            lambda h: self.attn(h, store, layer, start, row_mask, spec),
            self.ln2,
            self.mlp,
            drop,
        )


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise BadType(
                f"GPT(config) needs a GPTConfig, got {type(config).__name__}", arg="config"
            )
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        # Learned positions (GPT-2): a table; rotary positions (Llama): none, queries and keys are
        # rotated instead.
        self.wpe = (
            nn.Embedding(config.block_size, config.n_embd) if config.learned_positions else None
        )
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = norm(config)
        # what every block needs of the config (one RoPE table)
        self.spec = BlockSpec.from_config(config)
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
        return n - self.wpe.weight.numel() if exclude_positions and self.wpe is not None else n

    @property
    def device(self) -> torch.device:
        return self.wte.weight.device

    def _embed(self, idx: torch.Tensor) -> torch.Tensor:
        """The token embeddings of idx (B, T) -> (B, T, C); ids outside the vocabulary or on another
        device than the model are refused with what to do."""
        try:
            return self.wte(idx)
        # the embedding checks the ids as it gathers: nothing to pay when they are fine
        except IndexError:
            raise BadValue(
                f"idx holds token ids outside the vocabulary [0, {self.config.vocab_size - 1}]",
                arg="idx",
            ) from None
        # ids on another device than the model: said here, not by torch's index_select
        except RuntimeError:
            if idx.device == self.wte.weight.device:
                raise
            raise BadValue(
                f"idx is on {idx.device}, the model on {self.wte.weight.device}: pass "
                "idx.to(model.device)",
                arg="idx",
            ) from None

    def forward(
        self,
        idx: torch.Tensor,
        cache: KVCache | None = None,
        *,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (B, T, vocab) for token ids idx (B, T).

        Without a cache, idx is the whole sequence from position 0. With a cache (a KV store), idx
        holds only the new tokens, at positions cache.length .. + T: the store keeps their keys and
        values, attention reads what it holds, and cache.length moves on by T. ``positions`` (B, T)
        places each row at positions of its own (a ``BatchKVCache`` of rows at different lengths,
        chapter 08; the caller then moves the cache on); ``mask`` (B, 1, T, keys), if given,
        replaces the mask the store derives from the positions (chapter 08's learner passes their
        own).
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
                raise BadValue(
                    f"cache was built for batch size {cache.batch_size}, got a batch of {B}",
                    arg="cache",
                )
            where = start
        else:
            where = positions
        x = self._embed(idx)  # (B, T, C)
        if self.wpe is not None:  # learned positions: a slice of the table, or each row's own
            x = x + (self.wpe.weight[start:end] if positions is None else self.wpe(positions))
        if cache is not None:
            if getattr(cache, "dtype", x.dtype) != x.dtype:  # a cache of one's own may have none
                raise BadType(
                    f"the cache holds {cache.dtype} keys and values but the model computes in "
                    f"{x.dtype}: build the cache with dtype={x.dtype} (or convert the model)",
                    arg="cache",
                )
            fits = getattr(cache, "fits_config", None)
            if fits is not None:
                fits(self.config)
        if self.training:
            x = self.drop(x)  # (dropout is the identity in eval: skip the call)
        store = (
            Uncached(len(self.blocks))
            if cache is None
            else cache
            if isinstance(cache, Store)
            else Updating(cache)
        )
        for layer, b in enumerate(self.blocks):
            x = b(x, store, layer, where, mask, self.spec)
        if cache is not None and positions is None:
            cache.length = end
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)


def checked_model(model, name: str = "model"):
    """``model`` if it is an ar_lab model (a ``torch.nn.Module`` with a ``GPTConfig`` as
    ``.config``: a GPT, a quantized copy of one, a ``BigramModel``); else a BadType (a TypeError)
    naming ``name``, saying what to pass."""
    if not isinstance(model, torch.nn.Module) or not isinstance(
        getattr(model, "config", None), GPTConfig
    ):
        raise BadType(
            f"{name} must be an ar_lab model (a GPT, e.g. load_pretrained('course')), got "
            f"{type(model).__name__}",
            arg=name,
        )
    return model
