"""Chapter 09's benchmark: fp32 vs bf16 vs int8 vs int4 weights in batch-1 cached decode.

For two models, the course model and a random-init one large enough that its weights stream
from main memory (``ar_lab.perf.measure.CONFIGS``, ``--config``), each weight format decodes the
same prompt; repeats are interleaved (every format once per repeat, the order rotating) and
each format's speedup over fp32 is the median of its per-repeat ratios. Beside it, the
roofline's memory-bound prediction (``ar_lab.perf.roofline.predicted_speedup``: the bytes a step
moves, fp32 over the format) and measured / predicted. For the course model, the quality
columns (``ar_lab.perf.quality``). First, the kernels alone: one matrix times one vector, on
matrices that fit in a cache, then streaming several times the largest cache from main memory.

- ``ar_lab.bench.quant.kernels``: the kernels alone, from a cache and from main memory.
- ``ar_lab.bench.quant.benchmark``: the models decoding in each format, the table, ``run``.
"""

from ar_lab.bench.quant.benchmark import (
    FORMATS,
    QUICK,
    add_options,
    decode_times,
    format_quant_results,
    kv_cache_figures,
    measure_model,
    quant_benchmark,
    run,
)
from ar_lab.bench.quant.kernels import (
    BF16_DOT_FLAGS,
    bf16_dot_instructions,
    kernel_timings,
    kernels_from_memory,
    streamed_bytes,
)

__all__ = [
    "BF16_DOT_FLAGS",
    "FORMATS",
    "QUICK",
    "add_options",
    "bf16_dot_instructions",
    "decode_times",
    "format_quant_results",
    "kernel_timings",
    "kernels_from_memory",
    "kv_cache_figures",
    "measure_model",
    "quant_benchmark",
    "run",
    "streamed_bytes",
]
