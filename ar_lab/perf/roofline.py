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

This module is the analytic side, pencil-and-paper arithmetic from a ``GPTConfig``:
``forward_cost`` (and its two phases, ``prefill_cost`` and ``decode_cost``) counts
the FLOPs and bytes of a pass; ``ridge_point`` and ``attainable_flops`` draw the
roofline; the ``approx_*`` functions are the seed arithmetic from a parameter count
alone. Measuring the roofs and the passes on this machine is ``ar_lab.perf.measure``;
drawing them is ``ar_lab.course.plots.plot_roofline``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass

from ar_lab.base.args import finite_number, positive_int
from ar_lab.model.cache import kv_cache_bytes
from ar_lab.model.gpt import GPT, GPTConfig


def _check_cfg(cfg) -> None:
    if not isinstance(cfg, GPTConfig):
        raise TypeError(f"cfg must be a GPTConfig (e.g. GPTConfig(n_layer=4)), got {cfg!r}")


def parameter_count(cfg: GPTConfig) -> int:
    """Parameters of ``GPT(cfg)`` (the tied embedding / output matrix counted once)."""
    _check_cfg(cfg)
    d, L = cfg.n_embd, cfg.n_layer
    qkv = (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim
    per_layer = (d * qkv + qkv) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d) + 2 * (2 * d)  # + 2 LayerNorms
    return cfg.vocab_size * d + cfg.block_size * d + L * per_layer + 2 * d  # + final LayerNorm


def matmul_parameters(cfg: GPTConfig) -> int:
    """Weights that multiply every token's activations: the four projections per layer and the output head.

    Each such weight costs one multiply and one add per token: 2 FLOPs. Biases,
    LayerNorms and the embedding lookups are left out (a few FLOPs per value, not per
    weight), as are the position embeddings, which are read but not multiplied.
    """
    d = cfg.n_embd
    qkv = (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim
    return cfg.n_layer * (d * qkv + d * d + 2 * (d * 4 * d)) + cfg.vocab_size * d


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

    def time_at(self, peak_flops: float, bandwidth: float) -> float:
        """Roofline time estimate: the slower of doing the FLOPs and moving the bytes."""
        ridge_point(peak_flops, bandwidth)  # checks both
        return max(self.flops / peak_flops, self.bytes / bandwidth)

    def bound(self, peak_flops: float, bandwidth: float) -> str:
        """``"compute"`` or ``"memory"``: which roof limits this pass on that machine."""
        return "compute" if self.intensity >= ridge_point(peak_flops, bandwidth) else "memory"

    def to_dict(self) -> dict:
        return {**asdict(self), "flops": self.flops, "bytes": self.bytes, "intensity": self.intensity}


def forward_cost(
    cfg: GPTConfig, batch: int, tokens: int, past: int, bytes_per_value: int = 4, phase: str = ""
) -> PhaseCost:
    """The cost of feeding ``tokens`` new tokens per sequence after ``past`` cached ones.

    FLOPs: 2 per matmul weight per token, plus attention: each new token at absolute
    position p compares its query with p + 1 keys (2 x head_dim FLOPs per key per
    head) and mixes as many values (the same again): 4 x n_embd x (p + 1) per layer.
    Only the causal (unmasked) part is counted; kernels that do not skip masked blocks
    do up to twice the attention work in prefill.

    Bytes: every weight once per forward pass (the position table only for the rows
    used; the token table is read whole by the tied output head), the new keys/values
    written and the whole cache (past + new) read once per sequence, and activations:
    each matmul reads its input and writes its output once per token (norms, GELU and
    residual adds that a fused kernel would keep in registers are not counted).
    """
    _check_cfg(cfg)
    positive_int("batch", batch)
    positive_int("tokens", tokens)
    if not isinstance(past, int) or isinstance(past, bool) or past < 0:
        raise ValueError(f"past must be an int >= 0, got {past!r}")
    positive_int("bytes_per_value", bytes_per_value)
    if past + tokens > cfg.block_size:
        raise ValueError(f"{past + tokens} positions exceed the context window of {cfg.block_size} (block_size)")
    d, L, V = cfg.n_embd, cfg.n_layer, cfg.vocab_size
    qkv = (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim
    n = batch * tokens  # tokens through the model
    keys = tokens * past + tokens * (tokens + 1) // 2  # sum over new tokens of the positions each attends to
    matmul_flops = 2 * matmul_parameters(cfg) * n
    attention_flops = 4 * d * L * batch * keys
    weights = parameter_count(cfg) - cfg.block_size * d + tokens * d
    kv = batch * (past + 2 * tokens) * kv_bytes_per_token(cfg, 1)
    per_layer_values = (d + qkv) + (d + d) + (d + 4 * d) + (4 * d + d)  # in + out of the four matmuls
    activations = n * (L * per_layer_values + d + (d + V))  # + embedding out, head in + logits out
    return PhaseCost(
        phase=phase or ("decode" if tokens == 1 and past > 0 else "prefill"),
        batch=batch,
        tokens=tokens,
        context=past + tokens,
        matmul_flops=float(matmul_flops),
        attention_flops=float(attention_flops),
        weight_bytes=float(weights * bytes_per_value),
        kv_bytes=float(kv * bytes_per_value),
        activation_bytes=float(activations * bytes_per_value),
    )


def prefill_cost(cfg: GPTConfig, prompt_len: int, batch: int = 1, bytes_per_value: int = 4) -> PhaseCost:
    """One forward pass over a ``prompt_len``-token prompt (per sequence), cache empty before."""
    positive_int("prompt_len", prompt_len)
    return forward_cost(cfg, batch, prompt_len, 0, bytes_per_value, phase="prefill")


def decode_cost(cfg: GPTConfig, context: int, batch: int = 1, bytes_per_value: int = 4) -> PhaseCost:
    """One decode step: one new token per sequence, which attends to ``context`` positions (itself included)."""
    positive_int("context", context)
    return forward_cost(cfg, batch, 1, context - 1, bytes_per_value, phase="decode")


def ridge_point(peak_flops: float, bandwidth: float) -> float:
    """The arithmetic intensity (FLOP/byte) where the bandwidth slope meets the compute roof."""
    return finite_number("peak_flops", peak_flops, above=True) / finite_number("bandwidth", bandwidth, above=True)


def attainable_flops(intensity, peak_flops: float, bandwidth: float):
    """The roofline: min(peak, intensity x bandwidth); works on floats and tensors/arrays."""
    ridge_point(peak_flops, bandwidth)
    if isinstance(intensity, numbers.Real):
        return min(peak_flops, finite_number("intensity (FLOP/byte)", intensity) * bandwidth)
    if not hasattr(intensity, "clip"):
        raise TypeError(f"intensity must be a number, a tensor or an array of FLOP/byte, got {intensity!r}")
    return (intensity * bandwidth).clip(max=peak_flops)


# The seed arithmetic with nothing but a parameter count: 2 FLOPs per parameter per
# token, and every parameter read once per decode step.


def approx_prefill_flops(n_params: float, prompt_len: int) -> float:
    """2 x parameters x prompt tokens (attention and the rest left out)."""
    return 2.0 * finite_number("n_params", n_params, above=True) * positive_int("prompt_len", prompt_len)


def approx_decode_bytes(n_params: float, bytes_per_param: float = 2.0) -> float:
    """Bytes one decode step reads: all the weights (fp16/bf16: 2 bytes each; KV cache left out)."""
    n = finite_number("n_params", n_params, above=True)
    return n * finite_number("bytes_per_param", bytes_per_param, above=True)


def approx_ttft(n_params: float, prompt_len: int, peak_flops: float) -> float:
    """Time to first token if prefill ran at ``peak_flops``."""
    return approx_prefill_flops(n_params, prompt_len) / finite_number("peak_flops", peak_flops, above=True)


def approx_tpot(n_params: float, bandwidth: float, bytes_per_param: float = 2.0) -> float:
    """Time per output token if a decode step streamed the weights at ``bandwidth``."""
    return approx_decode_bytes(n_params, bytes_per_param) / finite_number("bandwidth", bandwidth, above=True)


def format_si(value: float, unit: str) -> str:
    """1.3e11, "FLOP/s" -> "130 GFLOP/s"."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"format_si formats a number, got {value!r}")
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
        raise TypeError(f"bytes_per_token takes a GPT, got {type(model).__name__}")
    total = sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers())
    wpe = model.wpe.weight
    return total - wpe.nbytes + wpe[0].nbytes


def decode_step_bytes(model: GPT, context: int = 1) -> float:
    """Bytes one batch-1 decode step at ``context`` positions moves: ``bytes_per_token(model)`` plus
    the KV cache and activations as ``ar_lab.perf.roofline.decode_cost`` counts them (at the model's
    activation dtype: that of its token embedding)."""
    cost = decode_cost(model.config, context, bytes_per_value=model.wte.weight.element_size())
    return bytes_per_token(model) + cost.kv_bytes + cost.activation_bytes


def predicted_speedup(reference: GPT, other: GPT, *, context: int = 1) -> float:
    """The roofline's memory-bound prediction of ``other``'s decode speed over ``reference``'s: the ratio
    of the bytes a step moves (``decode_step_bytes``), the same bandwidth assumed for both."""
    return decode_step_bytes(reference, context) / decode_step_bytes(other, context)
