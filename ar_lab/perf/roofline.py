"""Prefill against decode: what one forward pass costs in FLOPs and in bytes, and the roofline.

Generation has two phases with opposite bottlenecks:

* **prefill** runs the whole prompt through the model in one parallel pass. Every
  weight that is read from memory is used for all T prompt tokens, so there are many
  FLOPs per byte moved: prefill is *compute-bound* and sets the time to first token
  (TTFT).
* **decode** produces one token per forward pass. Every weight (and the whole KV
  cache) is still read from memory, but used for one token's arithmetic (B tokens in
  a batch of B): decode is *memory-bound* and sets the time per output token (TPOT).

The roofline model (Williams, Waterman & Patterson, CACM 2009) makes this
quantitative: a kernel that does F FLOPs while moving Q bytes has arithmetic
intensity I = F / Q, and on a machine with peak compute P (FLOP/s) and memory
bandwidth W (bytes/s) it can reach at most min(P, I x W) FLOP/s. The *ridge point*
I = P / W separates the memory-bound side (left) from the compute-bound side.

This module is the analytic side, pencil-and-paper arithmetic from a ``GPTConfig``: ``forward_cost``
(and its two phases, ``prefill_cost`` and ``decode_cost``) counts the FLOPs and bytes of a pass;
``ridge_point`` and ``attainable_flops`` draw the roofline. The counting itself is ``shape_cost`` on
a ``ModelShape``, the sizes of any decoder-only transformer: ``from_gpt_config`` gives the course
model's, and ``ar_lab.perf.llm_costs`` uses the same count for production models (gated MLPs, untied
heads, 8- and 4-bit weights). The ``approx_*`` functions are the seed arithmetic from a parameter
count alone. Measuring the roofs and the passes on this machine is ``ar_lab.perf.measure``; drawing
them is ``ar_lab.course.views.plots.plot_roofline``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass

import torch

from ar_lab.base.args import finite_number, positive_int
from ar_lab.base.errors import BadType, BadValue, ContextFull
from ar_lab.engine.quant import WEIGHT_FORMATS, quantize_model
from ar_lab.model.cache import kv_cache_bytes
from ar_lab.model.gpt import GPT, GPTConfig
from ar_lab.model.moe import expected_experts


def _check_cfg(cfg) -> None:
    if not isinstance(cfg, GPTConfig):
        raise BadType(
            f"cfg must be a GPTConfig (e.g. GPTConfig(n_layer=4)), got {cfg!r}", arg="cfg"
        )


@dataclass(frozen=True)
class ModelShape:
    """The sizes that set a decoder-only transformer's FLOPs and bytes."""

    name: str
    n_layer: int
    d_model: int
    n_head: int
    n_kv_heads: int  # == n_head: MHA; 1: MQA; in between: GQA
    head_dim: int
    d_ff: int  # MLP hidden width
    vocab: int
    max_context: int
    # SwiGLU: gate and up (d -> d_ff each), down (d_ff -> d); else fc and proj (GELU)
    gated_mlp: bool = True
    tied_embeddings: bool = False  # the output head reuses the input embedding
    learned_positions: bool = False  # a position table (GPT-2); RoPE models have none
    layer_norm: bool = False  # LayerNorm (weight and bias); else RMSNorm (weight only)
    # "none", "qkv" (query/key/value projections only) or "all" (every linear but the head)
    biases: str = "none"
    source: str = ""
    # a mixture of experts in place of the MLP: n_experts MLPs of d_ff, experts_per_token per token
    # (0, 0: a dense MLP)
    n_experts: int = 0
    experts_per_token: int = 0

    def __post_init__(self) -> None:
        for f in (
            "n_layer",
            "d_model",
            "n_head",
            "n_kv_heads",
            "head_dim",
            "d_ff",
            "vocab",
            "max_context",
        ):
            positive_int(f"ModelShape.{f}", getattr(self, f), arg=f)
        if self.n_head % self.n_kv_heads:
            raise BadValue(
                f"n_head ({self.n_head}) must be a multiple of n_kv_heads ({self.n_kv_heads})",
                arg="n_kv_heads",
            )
        if (self.n_experts, self.experts_per_token) != (0, 0):
            positive_int("ModelShape.n_experts", self.n_experts, arg="n_experts")
            if not 1 <= positive_int("ModelShape.experts_per_token", self.experts_per_token,
                                     arg="experts_per_token") <= self.n_experts:
                raise BadValue(
                    f"experts_per_token ({self.experts_per_token}) must be at most n_experts "
                    f"({self.n_experts})", arg="experts_per_token")
            if self.biases == "all":
                raise BadValue("a mixture of experts is counted without MLP biases: biases "
                               "'none' or 'qkv'", arg="biases")
        if self.biases not in ("none", "qkv", "all"):
            raise BadValue(
                f"biases must be 'none', 'qkv' or 'all', got {self.biases!r}", arg="biases"
            )

    @property
    def q_width(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def mlp_out(self) -> int:
        """Width of the MLP's first matmul output: gate and up side by side, or the one fc."""
        return 2 * self.d_ff if self.gated_mlp else self.d_ff

    @property
    def expert_weights(self) -> int:
        """One MLP's matmul weights (one expert's, in a mixture)."""
        return self.d_model * self.mlp_out + self.d_ff * self.d_model

    def _layer_weights(self, mlps: int) -> int:
        d = self.d_model
        attention = d * (self.q_width + 2 * self.kv_width) + self.q_width * d
        return attention + d * self.n_experts + mlps * self.expert_weights  # (+ the router)

    @property
    def layer_matmul_weights(self) -> int:
        """A layer's matmul weights as stored: every expert of a mixture."""
        return self._layer_weights(self.n_experts or 1)

    @property
    def matmul_weights(self) -> int:
        """Weights that multiply every token: all layers' projections (of a mixture, the router's
        and the experts_per_token experts a token goes to) and the output head."""
        active = self._layer_weights(self.experts_per_token or 1)
        return self.n_layer * active + self.vocab * self.d_model

    def experts_read(self, tokens: int) -> float:
        """Experts of each layer ``tokens`` tokens go to, on average, if routing is uniform and
        independent (``ar_lab.model.moe.expected_experts``); 1 for a dense MLP."""
        if not self.n_experts:
            return 1.0
        return expected_experts(tokens, self.n_experts, self.experts_per_token)

    @property
    def parameters(self) -> int:
        """All parameters (a tied embedding counted once)."""
        d = self.d_model
        qkv = self.q_width + 2 * self.kv_width
        bias = {"none": 0, "qkv": qkv, "all": qkv + d + self.mlp_out + d}[self.biases]
        norm = 2 * d if self.layer_norm else d
        per_layer = self.layer_matmul_weights + bias + 2 * norm
        embeddings = (0 if self.tied_embeddings else self.vocab * d) + (
            self.max_context * d if self.learned_positions else 0
        )
        return self.n_layer * per_layer + self.vocab * d + embeddings + norm  # + the final norm

    @property
    def kv_values_per_token(self) -> int:
        """Values one position adds to the cache: a key and a value per KV head per layer."""
        return 2 * self.n_layer * self.kv_width


def from_gpt_config(cfg: GPTConfig, name: str = "GPT") -> ModelShape:
    """The course's ``GPTConfig`` as a ``ModelShape``: GPT-2's layout (a GELU MLP four times the
    width, a tied head, a learned position table, LayerNorms, biases on every linear)."""
    _check_cfg(cfg)
    if cfg.n_experts:
        raise BadValue("cfg: a mixture of experts is counted from a ModelShape with n_experts and "
                       "experts_per_token (llm_costs.MODELS['Mixtral-8x7B'] is one)", arg="cfg")
    return ModelShape(
        name,
        cfg.n_layer,
        cfg.n_embd,
        cfg.n_head,
        cfg.kv_heads,
        cfg.head_dim,
        4 * cfg.n_embd,
        cfg.vocab_size,
        cfg.block_size,
        gated_mlp=False,
        tied_embeddings=True,
        learned_positions=True,
        layer_norm=True,
        biases="all",
        source="ar_lab GPTConfig",
    )


def parameter_count(cfg: GPTConfig) -> int:
    """Parameters of ``GPT(cfg)`` (the tied embedding / output matrix counted once)."""
    return from_gpt_config(cfg).parameters


def matmul_parameters(cfg: GPTConfig) -> int:
    """Weights that multiply every token's activations: the four projections per layer and the
    output head.

    Each such weight costs one multiply and one add per token: 2 FLOPs. Biases,
    LayerNorms and the embedding lookups are left out (a few FLOPs per value, not per
    weight), as are the position embeddings, which are read but not multiplied.
    """
    return from_gpt_config(cfg).matmul_weights


def kv_bytes_per_token(cfg: GPTConfig, bytes_per_value: int = 4) -> int:
    """Bytes of keys and values one position adds to the cache (all layers)."""
    _check_cfg(cfg)
    return kv_cache_bytes(cfg.n_layer, cfg.kv_heads, cfg.head_dim, 1, 1, bytes_per_value)


@dataclass(frozen=True)
class PhaseCost:
    """FLOPs and bytes of one forward pass: ``batch`` sequences, ``tokens`` new tokens each.

    ``context`` is the number of positions the last new token attends to (the cache
    length after the pass).
    """

    phase: str  # "prefill" or "decode"
    batch: int
    tokens: int
    context: int
    matmul_flops: float
    attention_flops: float
    weight_bytes: float
    kv_bytes: float
    activation_bytes: float

    @property
    def flops(self) -> float:
        return self.matmul_flops + self.attention_flops

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes + self.activation_bytes

    @property
    def intensity(self) -> float:
        """Arithmetic intensity: FLOPs per byte moved to or from memory."""
        return self.flops / self.bytes

    @property
    def matmul_intensity(self) -> float:
        """The weight matrix products alone: their FLOPs per byte of the weights and activations
        they move."""
        return self.matmul_flops / (self.weight_bytes + self.activation_bytes)

    @property
    def attention_intensity(self) -> float:
        """Attention over the cache alone: its FLOPs per byte of keys and values read and
        written."""
        return self.attention_flops / self.kv_bytes

    def time_at(self, peak_flops: float, bandwidth: float) -> float:
        """Roofline time estimate: the slower of doing the FLOPs and moving the bytes."""
        ridge_point(peak_flops, bandwidth)  # checks both
        return max(self.flops / peak_flops, self.bytes / bandwidth)

    def bound(self, peak_flops: float, bandwidth: float) -> str:
        """``"compute"`` or ``"memory"``: which roof limits this pass on that machine."""
        return "compute" if self.intensity >= ridge_point(peak_flops, bandwidth) else "memory"

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "flops": self.flops,
            "bytes": self.bytes,
            "intensity": self.intensity,
        }


def shape_cost(
    shape: ModelShape,
    batch: int,
    tokens: int,
    past: int,
    weight_bytes: float,
    value_bytes: float,
    phase: str = "",
) -> PhaseCost:
    """The cost of feeding ``tokens`` new tokens to each of ``batch`` sequences after ``past``
    cached ones.

    ``weight_bytes`` is the size of one stored weight, ``value_bytes`` that of one KV-cache
    or activation value (they differ for weight-only int8 / int4). Both ``forward_cost``
    functions (here, from a ``GPTConfig``; ``ar_lab.perf.llm_costs``, from a named format)
    are this count.

    FLOPs: 2 per matmul weight per token, plus attention: each new token at absolute
    position p compares its query with p + 1 keys (2 x head_dim FLOPs per key per query
    head) and mixes as many values (the same again): 4 x q_width x (p + 1) per layer.
    Only the causal (unmasked) part is counted; kernels that do not skip masked blocks
    do up to twice the attention work in prefill.

    A mixture of experts: each token multiplies the router and its ``experts_per_token`` experts,
    and the pass reads the experts some token goes to, E (1 - (1 - k/E)^n) of each layer's E for n
    tokens if routing is uniform and independent (``ModelShape.experts_read``): about k at batch 1,
    all of them for a large batch or a prompt.

    Bytes: every weight once per forward pass, but of the position table only the rows
    of the new positions and of an untied input embedding only the rows of the tokens
    fed (a tied table is read whole by the output head); the new keys/values written and
    the whole cache (past + new) read once per sequence; and activations: each matmul
    reads its input and writes its output once per token (norms, activation functions
    and residual adds that a fused kernel keeps in registers are not counted, nor are
    attention scores).
    """
    if not isinstance(shape, ModelShape):
        raise BadType(f"shape must be a ModelShape, got {shape!r}", arg="shape")
    positive_int("batch", batch)
    positive_int("tokens", tokens)
    positive_int("past", past, minimum=0)
    finite_number("weight_bytes", weight_bytes, above=True)
    finite_number("value_bytes", value_bytes, above=True)
    if past + tokens > shape.max_context:
        raise ContextFull(
            f"{past + tokens:,} positions exceed {shape.name}'s context window of "
            f"{shape.max_context:,}; lower past or tokens",
            arg=_overflowing(tokens, shape.max_context),
        )
    d, L = shape.d_model, shape.n_layer
    n = batch * tokens  # tokens through the model
    # per sequence: positions each new token attends to, summed
    keys = tokens * past + tokens * (tokens + 1) // 2
    weights = shape.parameters
    if shape.n_experts:  # the experts no token goes to are not read
        unread = shape.n_experts - shape.experts_read(n)
        weights -= round(L * unread * shape.expert_weights)
    if shape.learned_positions:  # only the rows of the new positions are read
        weights += (tokens - shape.max_context) * d
    # the input table: only the rows of the tokens fed (the head reads its own)
    if not shape.tied_embeddings:
        weights += (min(n, shape.vocab) - shape.vocab) * d
    mlps = shape.experts_per_token or 1  # a token's input read, and an output written, by each
    per_layer = (
        (d + shape.q_width + 2 * shape.kv_width)
        + (shape.q_width + d)
        + mlps * ((d + shape.mlp_out) + (shape.d_ff + d))
        + (d + shape.n_experts if shape.n_experts else 0)  # the router
    )
    # matmul ins and outs; embedding out; head in and logits out
    per_token = L * per_layer + d + (d + shape.vocab)
    return PhaseCost(
        phase=phase or ("decode" if tokens == 1 and past > 0 else "prefill"),
        batch=batch,
        tokens=tokens,
        context=past + tokens,
        matmul_flops=float(2 * shape.matmul_weights * n),
        attention_flops=float(4 * shape.q_width * L * batch * keys),
        weight_bytes=float(weights * weight_bytes),
        kv_bytes=float(batch * (past + 2 * tokens) * shape.kv_values_per_token * value_bytes),
        activation_bytes=float(n * per_token * value_bytes),
    )


def forward_cost(
    cfg: GPTConfig, batch: int, tokens: int, past: int, bytes_per_value: int = 4, phase: str = ""
) -> PhaseCost:
    """The cost of feeding ``tokens`` new tokens per sequence after ``past`` cached ones, every
    weight and value stored in ``bytes_per_value`` bytes: ``shape_cost`` of
    ``from_gpt_config(cfg)``."""
    _check_cfg(cfg)
    positive_int("batch", batch)
    positive_int("tokens", tokens)
    positive_int("past", past, minimum=0)
    positive_int("bytes_per_value", bytes_per_value)
    _fit(cfg, past + tokens, "past or tokens", _overflowing(tokens, cfg.block_size))
    return shape_cost(
        from_gpt_config(cfg), batch, tokens, past, bytes_per_value, bytes_per_value, phase
    )


def prefill_cost(
    cfg: GPTConfig, prompt_len: int, batch: int = 1, bytes_per_value: int = 4
) -> PhaseCost:
    """One forward pass over a ``prompt_len``-token prompt (per sequence), cache empty before."""
    positive_int("prompt_len", prompt_len)
    _fit(cfg, prompt_len, "prompt_len")
    return forward_cost(cfg, batch, prompt_len, 0, bytes_per_value, phase="prefill")


def decode_cost(
    cfg: GPTConfig, context: int, batch: int = 1, bytes_per_value: int = 4
) -> PhaseCost:
    """One decode step: one new token per sequence, which attends to ``context`` positions (itself
    included)."""
    positive_int("context", context)
    _fit(cfg, context, "context")
    return forward_cost(cfg, batch, 1, context - 1, bytes_per_value, phase="decode")


def _overflowing(tokens: int, window: int) -> str:
    """The argument to lower when past + tokens overflow ``window``: tokens if they alone do, else
    past."""
    return "tokens" if tokens > window else "past"


def _fit(cfg: GPTConfig, positions: int, lower: str, arg: str | None = None) -> None:
    """A ContextFull for ``arg`` (default ``lower``) when ``positions`` exceed ``cfg``'s context
    window."""
    _check_cfg(cfg)
    if positions > cfg.block_size:
        raise ContextFull(
            f"{positions} positions exceed the context window of {cfg.block_size} (block_size); "
            f"lower {lower}",
            arg=arg or lower,
        )


def ridge_point(peak_flops: float, bandwidth: float) -> float:
    """The arithmetic intensity (FLOP/byte) where the bandwidth slope meets the compute roof."""
    return finite_number("peak_flops", peak_flops, above=True) / finite_number(
        "bandwidth", bandwidth, above=True
    )


def attainable_flops(intensity, peak_flops: float, bandwidth: float):
    """The roofline: min(peak, intensity x bandwidth); works on floats and tensors/arrays."""
    ridge_point(peak_flops, bandwidth)
    if isinstance(intensity, numbers.Real):
        return min(
            peak_flops,
            finite_number("intensity (FLOP/byte)", intensity, arg="intensity") * bandwidth,
        )
    if not hasattr(intensity, "clip"):
        raise BadType(
            f"intensity must be a number, a tensor or an array of FLOP/byte, got {intensity!r}",
            arg="intensity",
        )
    return (intensity * bandwidth).clip(max=peak_flops)


# The seed arithmetic with nothing but a parameter count: 2 FLOPs per parameter per
# token, and every parameter read once per decode step.


def approx_prefill_flops(n_params: float, prompt_len: int) -> float:
    """2 x parameters x prompt tokens (attention and the rest left out)."""
    return (
        2.0
        * finite_number("n_params", n_params, above=True)
        * positive_int("prompt_len", prompt_len)
    )


def approx_decode_bytes(n_params: float, bytes_per_param: float = 2.0) -> float:
    """Bytes one decode step reads: all the weights (fp16/bf16: 2 bytes each; KV cache left out)."""
    n = finite_number("n_params", n_params, above=True)
    return n * finite_number("bytes_per_param", bytes_per_param, above=True)


def approx_ttft(n_params: float, prompt_len: int, peak_flops: float) -> float:
    """Time to first token if prefill ran at ``peak_flops``."""
    return approx_prefill_flops(n_params, prompt_len) / finite_number(
        "peak_flops", peak_flops, above=True
    )


def approx_tpot(n_params: float, bandwidth: float, bytes_per_param: float = 2.0) -> float:
    """Time per output token if a decode step streamed the weights at ``bandwidth``."""
    return approx_decode_bytes(n_params, bytes_per_param) / finite_number(
        "bandwidth", bandwidth, above=True
    )


def format_si(value: float, unit: str) -> str:
    """1.3e11, "FLOP/s" -> "130 GFLOP/s"."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise BadType(f"format_si formats a number (value), got {value!r}", arg="value")
    if value == 0 or not math.isfinite(value):
        return f"{value} {unit}"
    prefixes = [(1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1, "")]
    for scale, p in prefixes:
        if abs(value) >= scale:
            return f"{value / scale:.3g} {p}{unit}"
    return f"{value:.3g} {unit}"


def bytes_per_token(model: GPT) -> int:
    """Bytes of weights one batch-1 decode step reads, as the model stores them.

    Every parameter and buffer once (the token embedding whole: the tied output head reads
    all of it), except the position table, of which one row. For a float32 or bfloat16 model
    this is ``ar_lab.perf.roofline.decode_cost(cfg, ...).weight_bytes``.
    """
    if not isinstance(model, GPT):
        raise BadType(
            f"bytes_per_token takes a GPT as model, got {type(model).__name__}", arg="model"
        )
    total = sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers())
    if model.wpe is None:  # rotary positions: no table to read a row of
        return total
    wpe = model.wpe.weight
    return total - wpe.nbytes + wpe[0].nbytes


def _check_gpt(model, name: str) -> GPT:
    if not isinstance(model, GPT):
        raise BadType(
            f"{name} must be a GPT (e.g. load_pretrained('course')), got {type(model).__name__}",
            arg=name,
        )
    return model


def model_or_format(reference: GPT, other, name: str = "other") -> GPT:
    """``other`` if it is a model; a weight format name (``"fp32"``, ``"bf16"``, ``"int8"``,
    ``"int4"``) stands for ``reference`` stored that way,
    ``ar_lab.engine.quant.quantize_model(reference, weights=other)`` (built here, on the CPU for
    int8/int4). Anything else: a TypeError naming ``name``."""
    if isinstance(other, str):
        if other not in WEIGHT_FORMATS:
            raise BadValue(
                f"{name} must be a model or a weight format, one of {WEIGHT_FORMATS}, got "
                f"{other!r}",
                arg=name,
            )
        return quantize_model(_check_gpt(reference, "reference"), weights=other)
    if not isinstance(other, torch.nn.Module) or not isinstance(
        getattr(other, "config", None), GPTConfig
    ):
        raise BadType(
            f"{name} must be a model (a GPT) or a weight format such as 'int8', got "
            f"{type(other).__name__}",
            arg=name,
        )
    return other


def decode_step_bytes(model: GPT, context: int = 1) -> float:
    """Bytes one batch-1 decode step at ``context`` positions moves: ``bytes_per_token(model)`` plus
    the KV cache and activations as ``ar_lab.perf.roofline.decode_cost`` counts them (at the model's
    activation dtype: that of its token embedding)."""
    _check_gpt(model, "model")
    cost = decode_cost(model.config, context, bytes_per_value=model.wte.weight.element_size())
    return bytes_per_token(model) + cost.kv_bytes + cost.activation_bytes


def predicted_speedup(reference: GPT, other: GPT | str, *, context: int = 1) -> float:
    """The roofline's memory-bound prediction of ``other``'s decode speed over ``reference``'s: the
    ratio of the bytes a step moves (``decode_step_bytes``), the same bandwidth assumed for both.
    ``other`` may be a weight format name: ``predicted_speedup(m, "int8")`` is the int8 copy of
    ``m`` (``model_or_format``)."""
    _check_gpt(reference, "reference")
    other = _check_gpt(model_or_format(reference, other), "other")
    return decode_step_bytes(reference, context) / decode_step_bytes(other, context)
