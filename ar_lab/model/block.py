"""The transformer block, written once: ``GPT.forward`` and the lean engine both run ``block``.

A block is pre-norm attention then a pre-norm MLP, each added to the residual stream:

    x = x + proj(attention(rope(q), rope(k), v))   with q, k, v = qkv(norm1(x))
    x = x + mlp_proj(act(fc(norm2(x))))

What varies between GPT-2 and a Llama-shaped model is configuration (``GPTConfig``): the norm
(LayerNorm or RMSNorm), whether queries and keys are rotated (RoPE), the activation (GELU, or
SwiGLU on a fused gate|up product), the number of KV heads and the span a query sees. What varies
between the module path (training, any batch) and the lean path (one sequence, decode speed) is
only *how the weights are held*: ``BlockWeights`` is six callables, ``nn.Module`` layers for
``GPT.forward``, or the engine's pre-extracted weights (matrix-vector products for one row, packed
copies for a few, a ``QuantizedLinear``'s kernel). The arithmetic below is the same for both, and
attention itself is the KV store's (``ar_lab.model.attention``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from ar_lab.base.errors import ContextFull
from ar_lab.model.attention import FULL, Pos, Span, Store
from ar_lab.model.config import GPTConfig

Layer = Callable[[torch.Tensor], torch.Tensor]


class BlockWeights(NamedTuple):
    """One block's layers as callables on (..., features) activations."""

    norm1: Layer
    qkv: Layer  # (..., C) -> (..., (H + 2 H_kv) D): queries, keys, values
    proj: Layer  # (..., C) -> (..., C)
    norm2: Layer
    fc: Layer  # (..., C) -> (..., hidden), or (..., 2 hidden) as gate | up for SwiGLU
    mlp_proj: Layer  # (..., hidden) -> (..., C)


class Rope:
    """Rotary position embeddings: the pair (x_i, x_{i + D/2}) of a query or key at position p is
    rotated by the angle p * theta^(-2i/D). Rotating both before their dot product makes it depend
    on their positions' difference only; keys are stored rotated, at the position they were written
    at.

    The tables (positions x D/2, float32) are computed once for the context window; ``on`` moves
    them."""

    def __init__(self, head_dim: int, theta: float, max_len: int) -> None:
        inv_freq = 1.0 / (
            theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        )
        angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)  # (T_max, D/2)
        self.cos, self.sin = angles.cos(), angles.sin()
        self.half = head_dim // 2

    def on(self, device: torch.device) -> Rope:
        """The tables on ``device`` (moved once, kept in float32 whatever the model is cast to)."""
        if self.cos.device != device:
            self.cos, self.sin = self.cos.to(device), self.sin.to(device)
        return self

    def __call__(self, x: torch.Tensor, pos: Pos) -> torch.Tensor:
        """x (B, heads, T, D) at ``pos`` (an int: pos .. pos + T - 1; or (B, T)), rotated."""
        T = x.shape[2]
        if self.cos.device != x.device:
            self.on(x.device)
        if isinstance(pos, int):
            if pos + T > len(self.cos):  # a slice past the table would be silently short
                raise ContextFull(
                    f"positions up to {pos + T - 1} are past this RoPE table's {len(self.cos)}: "
                    "build it with a larger max_len",
                    arg="pos",
                )
            cos, sin = self.cos[pos : pos + T], self.sin[pos : pos + T]  # (T, D/2)
        else:
            cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # (B, 1, T, D/2)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        x1, x2 = x[..., : self.half], x[..., self.half :]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class BlockSpec(NamedTuple):
    """What a block needs of the configuration (computed once per model)."""

    n_head: int
    n_kv: int
    head_dim: int
    gated: bool  # SwiGLU
    span: Span
    rope: Rope | None
    split: tuple[int, int, int]  # q, k, v head counts: how the fused projection's heads divide
    n_qkv: int  # their sum, H + 2 H_kv

    @classmethod
    def from_config(cls, cfg: GPTConfig) -> BlockSpec:
        rope = (
            Rope(cfg.head_dim, cfg.rope_theta, cfg.block_size) if cfg.positions == "rope" else None
        )
        span = FULL if cfg.window is None else Span(cfg.window, cfg.sinks)
        split = (cfg.n_head, cfg.kv_heads, cfg.kv_heads)
        return cls(
            cfg.n_head, cfg.kv_heads, cfg.head_dim, cfg.mlp == "swiglu", span, rope, split,
            sum(split),
        )


def attend(
    h: torch.Tensor, w: BlockWeights, spec: BlockSpec, store: Store, layer: int, pos: Pos,
    mask: torch.Tensor | None = None, dropout: float = 0.0,
) -> torch.Tensor:
    """The attention half of a block on normed activations h (B, T, C), or (C,) for one token of one
    sequence: its output, of h's shape, before the residual.

    The new keys and values go to ``store`` at ``pos``; the store's attention reads what it
    holds."""
    *rows, _ = h.shape  # (B, T); none for the lean step's one vector (one token of one sequence)
    B, T = rows or (1, 1)
    # Heads side by side -> heads as a dimension: (B, T, (H + 2 H_kv) D) -> (B, H + 2 H_kv, T, D);
    # q, k, v are consecutive head ranges (one view and one transpose: rearrange's parsing would
    # cost a decode step time); the same calls for one position as for many (chapter 04 counts).
    qkv = w.qkv(h).view(B, T, spec.n_qkv, spec.head_dim).transpose(1, 2)
    q, k, v = qkv.split_with_sizes(spec.split, 1)  # (B, H, T, D), (B, H_kv, T, D), (B, H_kv, T, D)
    if spec.rope is not None:
        q, k = spec.rope(q, pos), spec.rope(k, pos)
    store.write(layer, k, v, pos)
    y = store.attend(layer, q, pos, spec.span, mask, dropout=dropout)  # (B, H, T, D)
    return w.proj(y.transpose(1, 2).reshape(h.shape))  # heads back side by side


def mlp(h: torch.Tensor, fc: Layer, proj: Layer, gated: bool) -> torch.Tensor:
    """The MLP half of a block on normed activations h (..., C): GELU (GPT-2's tanh form) or
    SwiGLU."""
    u = fc(h)
    if gated:
        gate, up = u.chunk(2, dim=-1)
        u = torch._C._nn.silu(gate).mul_(up)  # (the kernel without F.silu's wrapper)
    elif torch.is_grad_enabled():  # (GELU's backward reads its input)
        u = torch._C._nn.gelu(u, approximate="tanh")
    else:  # inference: in place, in fc's fresh output
        u = torch._C._nn.gelu_(u, approximate="tanh")
    return proj(u)


def residual(x: torch.Tensor, norm1: Layer, attention: Layer, norm2: Layer, feed_forward: Layer,
             drop: Callable | None = None, *, fresh: bool = False) -> torch.Tensor:
    """The pre-norm residual structure of every block: x + attention(norm1(x)), then +
    feed_forward(norm2(x)); ``drop``: residual dropout while training (None: none). ``fresh``: the
    two branches return tensors of their own (the lean engine's products), so the sums are made in
    them, without allocating another."""
    a = attention(norm1(x))
    x = a.add_(x) if fresh else x + (a if drop is None else drop(a))
    m = feed_forward(norm2(x))
    return m.add_(x) if fresh else x + (m if drop is None else drop(m))


def block(
    x: torch.Tensor, w: BlockWeights, spec: BlockSpec, store: Store, layer: int, pos: Pos,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One transformer block on the residual stream x (B, T, C) at positions ``pos``, from its
    weights (what the lean engine runs, whose products return tensors of their own; ``GPT``'s
    ``Block`` module runs ``residual`` over its own submodules)."""
    return residual(
        x, w.norm1, lambda h: attend(h, w, spec, store, layer, pos, mask), w.norm2,
        lambda h: mlp(h, w.fc, w.mlp_proj, spec.gated), fresh=True,
    )
