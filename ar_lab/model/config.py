"""``GPTConfig``: one model family, GPT-2 or a 2026-style (Llama-shaped) block by configuration.

The defaults are GPT-2's block: learned position embeddings, LayerNorm, a GELU MLP four times as
wide as the model, biases, full multi-head attention. Each mechanism a current model uses instead
is an option of the same config, as Llama, Qwen and Mistral are options of one family in
``transformers``:

- ``norm="rmsnorm"``: RMSNorm (Zhang & Sennrich 2019): x / sqrt(mean(x^2) + eps) * weight, no mean
  subtracted, no bias.
- ``positions="rope"``: rotary position embeddings (Su et al. 2021, "RoFormer") on queries and keys,
  with base ``rope_theta``; no learned position table. Dimensions are paired as (i, i + D/2), the
  "rotate half" layout of ``transformers``' Llama (Meta's original code pairs (2i, 2i + 1) and the
  conversion permutes the projection rows instead).
- ``mlp="swiglu"``: a gated MLP (Shazeer 2020, "GLU Variants Improve Transformer"):
  down(silu(gate(x)) * up(x)), ``mlp_hidden`` wide.
- ``n_kv_heads``: grouped-query attention (Ainslie et al. 2023): groups of query heads share a
  key/value head, and the KV cache holds ``n_kv_heads`` heads, not ``n_head``.
- ``window``: sliding-window attention (Mistral 7B): a query at position p sees keys p - window + 1
  .. p. ``sinks``: with a window, the first ``sinks`` positions stay visible to every query as well
  (StreamingLLM's attention sinks, Xiao et al. 2023), so a rolling cache keeps them.
- ``bias=False``: no biases in the linear layers (Llama's choice).
- ``n_experts``: a mixture of experts in place of the MLP (Shazeer et al. 2017; Mixtral, DeepSeek,
  Qwen3-MoE, gpt-oss): ``n_experts`` MLPs of ``mlp_hidden`` each, a router sending every token to
  ``experts_per_token`` of them (``ar_lab.model.moe``). 0: a dense MLP.

``GPTConfig.modern(...)`` gives the Llama-shaped combination the course ships as ``modern``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from ar_lab.base.errors import BadValue
from ar_lab.model.tokenizer import VOCAB_SIZE

NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rope")
MLPS = ("gelu", "swiglu")


def _positive(name: str, value) -> None:
    # bool is an int to Python, but GPTConfig(n_kv_heads=True) is a mistake, not one KV head.
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise BadValue(f"GPTConfig.{name} must be a positive int, got {value!r}", arg=name)


def _choice(name: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise BadValue(
            f"GPTConfig.{name} must be one of {', '.join(map(repr, choices))}, got {value!r}",
            arg=name,
        )


def _finite(
    name: str, value, low: float, high: float | None = None, *, open_low: bool = False
) -> None:
    real = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if (
        not real
        or value < low
        or (open_low and value == low)
        or (high is not None and value >= high)
    ):
        bound = f"{'>' if open_low else '>='} {low:g}" + (
            f" and < {high:g}" if high is not None else ""
        )
        raise BadValue(f"GPTConfig.{name} must be a finite number {bound}, got {value!r}", arg=name)


@dataclass
class GPTConfig:
    vocab_size: int = VOCAB_SIZE
    block_size: int = 1024  # context window: the most positions one sequence can hold
    n_layer: int = 4
    n_head: int = 4
    n_kv_heads: int | None = None  # None: same as n_head (MHA); 1: MQA; in between: GQA
    n_embd: int = 256
    dropout: float = 0.0
    norm: str = "layernorm"  # or "rmsnorm"
    positions: str = "learned"  # or "rope"
    rope_theta: float = 10000.0
    mlp: str = "gelu"  # or "swiglu"
    # None: 4 n_embd (gelu), 8/3 n_embd rounded up to a multiple of 32 (swiglu)
    mlp_hidden: int | None = None
    bias: bool = True
    # None: every earlier position is visible; else the last `window` positions
    window: int | None = None
    sinks: int = 0  # with a window: the first `sinks` positions stay visible too
    norm_eps: float = 1e-5
    n_experts: int = 0  # 0: a dense MLP; else a mixture of this many expert MLPs
    experts_per_token: int = 2  # with experts: how many the router picks for each token

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            _positive(name, getattr(self, name))
        if self.n_embd % self.n_head:
            raise BadValue(
                f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})", arg="n_head"
            )
        if self.n_kv_heads is not None:
            kv = self.n_kv_heads
            if not isinstance(kv, int) or isinstance(kv, bool) or kv < 1:
                raise BadValue(
                    f"GPTConfig.n_kv_heads must be a positive int or None (= n_head), got {kv!r}",
                    arg="n_kv_heads",
                )
            if self.n_head % kv:
                raise BadValue(
                    f"n_head ({self.n_head}) must be a multiple of n_kv_heads ({kv}): "
                    "each KV head serves an equal group of query heads",
                    arg="n_kv_heads",
                )
        _finite("dropout", self.dropout, 0.0, 1.0)
        _choice("norm", self.norm, NORMS)
        _choice("positions", self.positions, POSITIONS)
        _choice("mlp", self.mlp, MLPS)
        _finite("rope_theta", self.rope_theta, 0.0, open_low=True)
        _finite("norm_eps", self.norm_eps, 0.0, open_low=True)
        if self.positions == "rope" and self.head_dim % 2:
            raise BadValue(
                f"rotary positions pair a head's dimensions: head_dim ({self.head_dim}) must be "
                "even",
                arg="positions",
            )
        if self.mlp_hidden is not None:
            _positive("mlp_hidden", self.mlp_hidden)
        if not isinstance(self.bias, bool):
            raise BadValue(f"GPTConfig.bias must be True or False, got {self.bias!r}", arg="bias")
        if self.window is not None:
            _positive("window", self.window)
        if not isinstance(self.sinks, int) or isinstance(self.sinks, bool) or self.sinks < 0:
            raise BadValue(f"GPTConfig.sinks must be an int >= 0, got {self.sinks!r}", arg="sinks")
        for name in ("n_experts", "experts_per_token"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (name == "experts_per_token"):
                raise BadValue(f"GPTConfig.{name} must be an int >= {int(name != 'n_experts')}, "
                               f"got {v!r}", arg=name)
        if self.n_experts and self.experts_per_token > self.n_experts:
            raise BadValue(
                f"GPTConfig.experts_per_token ({self.experts_per_token}) must be at most n_experts "
                f"({self.n_experts}): the router picks that many distinct experts per token",
                arg="experts_per_token",
            )
        if self.sinks and self.window is None:
            raise BadValue(
                "GPTConfig.sinks keeps the first positions visible past a window: set window too",
                arg="sinks",
            )

    @classmethod
    def modern(cls, **overrides) -> GPTConfig:
        """The Llama-shaped block: RMSNorm, RoPE, SwiGLU, grouped-query attention (2 query heads per
        KV head), no biases. Any field can be overridden (``window=256, sinks=4``,
        ``n_layer=2``)."""
        base = dict(n_layer=4, n_head=4, n_kv_heads=2, n_embd=256, norm="rmsnorm", positions="rope",
                    mlp="swiglu", bias=False)
        return cls(**{**base, **overrides})

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_head if self.n_kv_heads is None else self.n_kv_heads

    @property
    def hidden(self) -> int:
        """The MLP's inner width."""
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        return 4 * self.n_embd if self.mlp == "gelu" else -(-8 * self.n_embd // 3 // 32) * 32

    @property
    def learned_positions(self) -> bool:
        return self.positions == "learned"

    @property
    def is_gpt2(self) -> bool:
        """Exactly GPT-2's block (what ``transformers``' GPT-2 reproduces)."""
        return (
            self.kv_heads == self.n_head
            and self.hidden == 4 * self.n_embd
            and self.norm == "layernorm"
            and self.learned_positions
            and self.mlp == "gelu"
            and self.bias
            and self.window is None
            and not self.n_experts
        )

    def to_dict(self) -> dict:
        return asdict(self)

    def __repr__(self) -> str:
        """GPT-2's fields always; the modern options only where they differ from GPT-2's block."""
        shown = [f.name for f in fields(self)[:7]]
        shown += [f.name for f in fields(self)[7:] if getattr(self, f.name) != f.default]
        return f"GPTConfig({', '.join(f'{name}={getattr(self, name)!r}' for name in shown)})"
