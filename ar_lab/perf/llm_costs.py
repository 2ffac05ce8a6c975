"""Prefill and decode of real model shapes, counted from first principles and placed on a GPU's
roofline.

``ar_lab.perf.roofline`` counts the course's own GPT (a ``GPTConfig``: GELU MLP four times
the width, tied embeddings, learned positions). Production models differ in ways that
move the numbers: a gated MLP (SwiGLU: three matrices of an arbitrary width), separate
input and output embeddings, grouped-query attention, weights stored in 8 or 4 bits.
A ``ModelShape`` (defined in ``ar_lab.perf.roofline``) describes such a model, ``MODELS``
holds some, and ``forward_cost`` counts one forward pass of one in a named weight format
with ``ar_lab.perf.roofline.shape_cost``, the count the course model's passes use too:

* FLOPs: 2 per matmul weight per token; attention 4 x (query heads x head_dim) per key
  per layer (query . key, then the weighted value);
* bytes: every weight once per pass (the input embedding only for the rows used), the KV
  cache of each sequence read once and the new positions written, and each matmul's input
  and output once per token (attention scores never reach memory: a fused kernel).

``place_decode`` answers the questions a decode batch raises on a given GPU (from
``ar_lab.perf.gpus``): at which batch the sequences' own KV reads outweigh the shared weight
read, whether batching ever reaches the ridge, and the largest batch whose KV cache fits.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from ar_lab.base.args import finite_number, positive_int
from ar_lab.base.errors import BadType, BadValue, ContextFull
from ar_lab.model.gpt import GPTConfig
from ar_lab.perf.gpus import GPUSpec, as_gpu, weight_format
from ar_lab.perf.roofline import ModelShape, PhaseCost, from_gpt_config, shape_cost

# Bytes per weight for each storage format. int8 / int4 are weight-only formats: the
# weights are read at that size and turned back into bf16 for the arithmetic, and the
# KV cache and activations stay 16-bit (the scales of grouped quantisation, ~1-3 % more
# bytes, are left out).
WEIGHT_BYTES = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5}


def value_bytes(weight_dtype: str) -> int:
    """Bytes per KV-cache and activation value: 4 with fp32 weights, 2 (bf16) with any other."""
    return 4 if check_dtype(weight_dtype) == "fp32" else 2


def check_dtype(weight_dtype) -> str:
    """The key of ``WEIGHT_BYTES`` for ``weight_dtype`` in any spelling
    ``ar_lab.perf.gpus.weight_format`` takes ("FP32", "bfloat16", torch.bfloat16 ...); a ValueError
    listing the formats otherwise."""
    return weight_format(weight_dtype)


def count(name: str, value, minimum: int = 1) -> int:
    """``value`` as an int if it is a whole number (numpy's too, not a bool) >= ``minimum``; else
    ``positive_int``'s ValueError naming ``name``."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = int(value)
    return positive_int(name, value, minimum)


def as_model(shape, name: str = "shape") -> ModelShape:
    """``shape`` if it is a ``ModelShape``, the preset it names if it is a key of ``MODELS``; else
    an error naming the argument and what to pass."""
    if isinstance(shape, ModelShape):
        return shape
    if isinstance(shape, str):
        return _preset(shape, name)
    raise BadType(
        f"{name} must be a ModelShape or a name from MODELS such as 'Llama-3-8B', got {shape!r}",
        arg=name,
    )


def check_positions(shape: ModelShape, context, name: str = "context") -> int:
    """``context`` if it is a whole number of positions from 1 to ``shape``'s window: the messages
    of ``decode_cost``, so that memory and cost refuse the same contexts. ``name``: the argument's
    name."""
    context = count(name, context)
    if context > shape.max_context:
        raise ContextFull(
            f"{context:,} positions exceed {shape.name}'s context window of {shape.max_context:,}"
            f"; lower {name}",
            arg=name,
        )
    return context


MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in [
        # The seed's 13 B example as a real model: hidden_size 5120, intermediate_size 13824,
        # 40 layers, 40 heads, 40 KV heads (MHA), vocabulary 32000, untied head, 4096 positions.
        ModelShape(
            "Llama-2-13B",
            40,
            5120,
            40,
            40,
            128,
            13824,
            32000,
            4096,
            source="meta-llama/Llama-2-13b-hf config.json",
        ),
        # GQA: 32 query heads share 8 KV heads; SwiGLU width 14336; vocabulary 128256; 8192
        # positions.
        ModelShape(
            "Llama-3-8B",
            32,
            4096,
            32,
            8,
            128,
            14336,
            128256,
            8192,
            source="meta-llama/Meta-Llama-3-8B config.json",
        ),
        # 28 layers, hidden 3584, 28 heads, 4 KV heads, intermediate 18944, vocabulary 152064,
        # biases on q/k/v, untied; 32,768 positions without rope scaling.
        ModelShape(
            "Qwen2.5-7B",
            28,
            3584,
            28,
            4,
            128,
            18944,
            152064,
            32768,
            biases="qkv",
            source="Qwen/Qwen2.5-7B config.json",
        ),
        # A mixture of experts: 8 SwiGLU experts of width 14336 per layer, 2 per token (a router
        # of 8 outputs); GQA 32 / 8; vocabulary 32000, untied; 32,768 positions. 46.7 B
        # parameters stored, 12.9 B multiply each token (Mistral AI's figures).
        ModelShape(
            "Mixtral-8x7B",
            32,
            4096,
            32,
            8,
            128,
            14336,
            32000,
            32768,
            n_experts=8,
            experts_per_token=2,
            source="mistralai/Mixtral-8x7B-v0.1 config.json",
        ),
        from_gpt_config(GPTConfig(), "ar_lab course model"),
    ]
}


def model(name: str) -> ModelShape:
    """The preset named ``name`` (a key of ``MODELS``), with a clear error for anything else."""
    return _preset(name, "name")


def _preset(name, arg: str) -> ModelShape:
    """The preset named ``name``; else a BadValue for the argument ``arg`` listing the names."""
    if not isinstance(name, str) or name not in MODELS:
        raise BadValue(
            f"unknown model {name!r}; choose one of {list(MODELS)} (argument {arg})", arg=arg
        )
    return MODELS[name]


def forward_cost(
    shape: ModelShape,
    batch: int,
    tokens: int,
    past: int,
    weight_dtype: str = "bf16",
    phase: str = "",
) -> PhaseCost:
    """FLOPs and bytes of feeding ``tokens`` new tokens to each of ``batch`` sequences after
    ``past`` cached ones, the weights stored as ``weight_dtype`` (a key of ``WEIGHT_BYTES``) and the
    cache and activations as ``value_bytes`` says: ``ar_lab.perf.roofline.shape_cost``."""
    shape, batch = as_model(shape), count("batch", batch)
    tokens, past = count("tokens", tokens), count("past", past, minimum=0)
    wb, vb = WEIGHT_BYTES[check_dtype(weight_dtype)], value_bytes(weight_dtype)
    return shape_cost(shape, batch, tokens, past, wb, vb, phase)


def prefill_cost(
    shape: ModelShape, prompt_len: int, batch: int = 1, weight_dtype: str = "bf16"
) -> PhaseCost:
    """One pass over ``batch`` prompts of ``prompt_len`` tokens, cache empty before."""
    prompt_len = count("prompt_len", prompt_len)
    check_positions(as_model(shape), prompt_len, "prompt_len")
    return forward_cost(shape, batch, prompt_len, 0, weight_dtype, phase="prefill")


def decode_cost(
    shape: ModelShape, context: int, batch: int = 1, weight_dtype: str = "bf16"
) -> PhaseCost:
    """One decode step: one new token per sequence, attending to ``context`` positions (itself
    included)."""
    context = count("context", context)
    check_positions(as_model(shape), context)
    return forward_cost(shape, batch, 1, context - 1, weight_dtype, phase="decode")


# --- memory -------------------------------------------------------------------------


def weight_memory(shape: ModelShape, weight_dtype: str = "bf16") -> float:
    """Bytes the weights occupy on the device."""
    return as_model(shape).parameters * WEIGHT_BYTES[check_dtype(weight_dtype)]


def kv_memory(shape: ModelShape, context: int, batch: int = 1, weight_dtype: str = "bf16") -> float:
    """Bytes of the KV cache holding ``context`` positions for each of ``batch`` sequences
    (``context`` within the model's window, as ``decode_cost`` takes it)."""
    shape = as_model(shape)
    context, batch = check_positions(shape, context), count("batch", batch)
    return batch * context * shape.kv_values_per_token * value_bytes(weight_dtype)


def memory_needed(
    shape: ModelShape, context: int, batch: int = 1, weight_dtype: str = "bf16"
) -> float:
    """Weights + KV cache (activations and the framework's workspace come on top)."""
    kv = kv_memory(shape, context, batch, weight_dtype)  # checks every argument
    return weight_memory(shape, weight_dtype) + kv


def max_batch(shape: ModelShape, memory: float, context: int, weight_dtype: str = "bf16") -> int:
    """The most sequences of ``context`` positions whose KV cache fits beside the weights (0: none)
    in ``memory`` bytes (a GPU's is ``spec.memory``)."""
    if isinstance(memory, (GPUSpec, str)):
        raise BadType(
            "memory must be a number of bytes (a GPU's: gpus.gpu('H100 SXM').memory), got "
            f"{memory!r}",
            arg="memory",
        )
    # checks shape, context and weight_dtype
    per_sequence = kv_memory(shape, context, 1, weight_dtype)
    free = finite_number("memory (bytes)", memory, above=True, arg="memory") - weight_memory(
        shape, weight_dtype
    )
    return max(0, math.floor(free / per_sequence))


# --- a decode batch on a GPU --------------------------------------------------------


@dataclass(frozen=True)
class DecodePlacement:
    """Where decode steps at one context land on a GPU's roofline as the batch grows.

    A step's bytes are ``shared_bytes`` (the weights, read once for the whole batch) plus
    ``bytes_per_sequence`` (each sequence's own KV cache and activations) times the batch;
    its FLOPs are ``flops_per_sequence`` times the batch. So the intensity rises with the
    batch toward ``intensity_limit`` = flops / bytes of one sequence alone, and never past it.
    """

    context: int
    weight_dtype: str
    ridge: float
    shared_bytes: float
    bytes_per_sequence: float
    flops_per_sequence: float
    # smallest batch whose own bytes reach the shared weight bytes
    weights_stop_dominating_batch: int
    # smallest batch at or past the ridge; None: never, at any batch
    compute_bound_batch: int | None
    max_batch: int  # the largest batch whose KV cache fits beside the weights
    # Per operator: the weight matrix products (shared weights, each sequence's activations) and
    # attention over the cache (each sequence's own keys and values): two points on the roofline,
    # not one.
    # smallest batch whose matmuls alone reach the ridge
    matmul_compute_bound_batch: int | None = None
    attention_intensity: float = 0.0  # attention's FLOP/byte: the same at every batch

    @property
    def intensity_limit(self) -> float:
        return self.flops_per_sequence / self.bytes_per_sequence

    def intensity(self, batch: int) -> float:
        return (
            batch * self.flops_per_sequence / (self.shared_bytes + batch * self.bytes_per_sequence)
        )

    @property
    def turns_compute_bound(self) -> bool:
        """True when some batch that fits in memory reaches the ridge."""
        return self.compute_bound_batch is not None and self.compute_bound_batch <= self.max_batch


def place_decode(
    shape: ModelShape, gpu, context: int, weight_dtype: str = "bf16"
) -> DecodePlacement:
    """Decode at ``context`` on ``gpu`` (an ``ar_lab.perf.gpus.GPUSpec`` or its name, e.g. "H100
    SXM"): the batches where the picture changes."""
    shape, gpu, weight_dtype = as_model(shape), as_gpu(gpu), check_dtype(weight_dtype)
    context = count("context", context)
    one, two = (
        decode_cost(shape, context, 1, weight_dtype),
        decode_cost(shape, context, 2, weight_dtype),
    )
    per_seq = two.bytes - one.bytes  # the step's bytes are linear in the batch
    shared, flops = one.bytes - per_seq, one.flops
    ridge = gpu.peak_flops(weight_dtype) / gpu.bandwidth
    compute = _first_batch_at(ridge, flops, shared, per_seq)
    matmul_bytes = [c.weight_bytes + c.activation_bytes for c in (one, two)]
    matmul_per_seq = matmul_bytes[1] - matmul_bytes[0]
    matmuls = _first_batch_at(
        ridge, one.matmul_flops, matmul_bytes[0] - matmul_per_seq, matmul_per_seq
    )
    return DecodePlacement(
        context=context,
        weight_dtype=weight_dtype,
        ridge=ridge,
        shared_bytes=shared,
        bytes_per_sequence=per_seq,
        flops_per_sequence=flops,
        weights_stop_dominating_batch=max(1, math.ceil(shared / per_seq)),
        compute_bound_batch=compute,
        max_batch=max_batch(shape, gpu.memory, context, weight_dtype),
        matmul_compute_bound_batch=matmuls,
        attention_intensity=one.attention_intensity,
    )


def _first_batch_at(ridge: float, flops: float, shared: float, per_seq: float) -> int | None:
    """The smallest batch B with B flops / (shared + B per_seq) >= ridge; None when no batch gets
    there."""
    # intensity(B) >= ridge  <=>  B (flops - ridge per_seq) >= ridge shared
    if flops <= ridge * per_seq:
        return None
    return max(1, math.ceil(ridge * shared / (flops - ridge * per_seq)))


def predicted_time(cost: PhaseCost, gpu, weight_dtype: str = "bf16") -> float:
    """The roofline's time for a pass on ``gpu``: the slower of its FLOPs at the compute roof and
    its bytes at the bandwidth (a floor: real kernels reach a fraction of both roofs). ``gpu``: a
    ``GPUSpec`` or its name."""
    if not isinstance(cost, PhaseCost):
        raise BadType(
            f"cost must be a PhaseCost (from prefill_cost or decode_cost), got {cost!r}", arg="cost"
        )
    gpu = as_gpu(gpu)
    return cost.time_at(gpu.peak_flops(weight_dtype), gpu.bandwidth)
