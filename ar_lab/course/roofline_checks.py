"""Chapter 05's exercise checkers: the named mistakes of a decode step's intensity, a TPOT predicted from
bandwidth, and a decode plan on a GPU.

Each function computes, with the exercise's own inputs, what a classic slip gives (the weights read
once per sequence, the KV cache left out, the ratio upside down, milliseconds for seconds, the weights
not subtracted from the memory, ...), keeping only the slips the exercise's test would not pass
anyway; ``ar_lab.course.mistakes.name_mistake`` names the one a learner's answer equals.
"""

from __future__ import annotations

import math

from ar_lab.perf import roofline as rl


def _apart(wrong: dict[str, float], right: float, rtol: float) -> dict[str, float]:
    """The mistakes of ``wrong`` whose value a test with relative tolerance ``rtol`` would not pass."""
    return {k: v for k, v in wrong.items() if not math.isclose(v, right, rel_tol=rtol)}


def decode_intensity_mistakes(cfg, context: int, batch: int, bytes_per_value: int) -> dict[str, float]:
    """FLOPs per byte of one decode step (weights + KV cache, activations left out), counted wrongly;
    only the slips that move the result past the test's 3 % tolerance."""
    flops = batch * (2 * rl.matmul_parameters(cfg) + 4 * cfg.n_embd * cfg.n_layer * context)
    weights = rl.parameter_count(cfg) - cfg.block_size * cfg.n_embd  # the position table is not read by a step
    kv = batch * context * rl.kv_bytes_per_token(cfg, bytes_per_value)
    bytes_moved = weights * bytes_per_value + kv
    return _apart(
        {
            "reading the weights once per sequence, not once per step": flops
            / (batch * weights * bytes_per_value + kv),
            "leaving the KV cache out of the bytes": flops / (weights * bytes_per_value),
            "4 bytes per value whatever bytes_per_value says": flops / (4 * weights + kv * 4 / bytes_per_value),
            "one sequence's FLOPs over the whole batch's bytes": flops / batch / bytes_moved,
            "bytes over FLOPs (the ratio upside down)": bytes_moved / flops,
        },
        flops / bytes_moved,
        0.03,
    )


def predict_tpot_mistakes(n_params: float, bytes_per_param: float, bandwidth: float, kv_cache_bytes: float = 0.0):
    """Seconds of a memory-bound decode step, (weights + KV cache) / bandwidth, computed wrongly."""
    right = (n_params * bytes_per_param + kv_cache_bytes) / bandwidth
    return _apart(
        {
            "leaving the KV cache out": n_params * bytes_per_param / bandwidth,
            "one byte per parameter (bytes_per_param left out)": (n_params + kv_cache_bytes) / bandwidth,
            "bandwidth over bytes (the ratio upside down)": 1 / right,
            "milliseconds instead of seconds": 1e3 * right,
            "bits instead of bytes (8 bits a byte)": 8 * right,
        },
        right,
        1e-6,
    )


def decode_plan_mistakes(shape, gpu, context: int) -> dict[str, dict[str, float]]:
    """Chapter 05's decode plan of a Llama-style model (bf16, untied embeddings) on ``gpu``, key by key,
    computed wrongly; each key keeps the slips its test would not pass."""
    cache = context * shape.kv_values_per_token * 2  # bytes of one sequence's cache
    read = (shape.parameters - (shape.vocab - 1) * shape.d_model) * 2  # one embedding row of the table is read
    room = gpu.memory - shape.parameters * 2
    wrong = {
        "tpot": {
            "reading the whole embedding table every step": (shape.parameters * 2 + cache) / gpu.bandwidth,
            "leaving the KV cache out": read / gpu.bandwidth,
        },
        "max_batch": {
            "not subtracting the weights from the memory": math.floor(gpu.memory / cache),
            "rounding up (the last sequence's cache does not fit)": math.ceil(room / cache),
        },
        "matmul_batch": {
            "half the intensity (a multiply-add as 1 FLOP, or 4 bytes per weight)": math.ceil(2 * gpu.ridge)
        },
        "attention_intensity": {
            "1 FLOP/byte whatever the KV heads (the group size left out)": 1.0,
            "kv_width / q_width (the ratio upside down)": shape.kv_width / shape.q_width,
        },
    }
    right = {
        "tpot": (read + cache) / gpu.bandwidth,
        "max_batch": math.floor(room / cache),
        "matmul_batch": math.ceil(gpu.ridge),
        "attention_intensity": shape.q_width / shape.kv_width,
    }
    tolerance = {"tpot": 0.01, "max_batch": 0.0, "matmul_batch": 0.15, "attention_intensity": 0.01}
    return {key: _apart(w, right[key], tolerance[key]) for key, w in wrong.items()}
