"""Chapter 05's exercise checkers: the learner's two roofline probes, a TPOT predicted from
bandwidth, and a decode plan on a GPU.

Each ``*_mistakes`` function computes, with the exercise's own inputs, what a classic slip gives
(one array's bytes for a stream that reads two and writes one, a multiply-add counted as one FLOP,
the KV cache left out, the ratio upside down, milliseconds for seconds, the weights not subtracted
from the memory, ...), keeping only the slips the exercise's test would not pass anyway;
``ar_lab.course.checkers.mistakes.name_mistake`` names the one a learner's answer equals. A probe's
*time* is noisy, so ``check_probe_rates`` judges it against ar_lab's probes called in turns with it,
within a wide factor, and names the slips that land far outside it (milliseconds for seconds, the
total of the repeats, a GPU not waited for).
"""

from __future__ import annotations

import math
import numbers

import torch

from ar_lab.course.checkers.answers import (
    is_real,
    is_whole,
    real_number,
    require_answer,
    whole_number,
)
from ar_lab.course.checkers.checks import CheckFailed
from ar_lab.perf import peaks

RATE_FACTOR = 3.0  # a probe's rate must be within this factor of ar_lab's, timed in turns with it
# ...and a bandwidth no more than this far above ar_lab's on a CPU: the same arrays, timed in turns,
# read no faster; a rate well above is a buffer the caches hold (a roof that is not memory's)
FAST_FACTOR = 1.5
RATE_ROUNDS = 3  # rounds of (yours, ar_lab's), timed in turns
RATE_REPEATS = 10  # timed calls per probe call in the rate check (the total of 10 calls is 10x off)
# (values per array, matmul side) the rate check times, by device type: about 10 ms a call on a CPU
RATE_SIZES = {"cpu": (2**23, 768), "cuda": (2**27, 4096)}


def _apart(wrong: dict[str, float], right: float, rtol: float) -> dict[str, float]:
    """The mistakes of ``wrong`` whose value a test with relative tolerance ``rtol`` would not
    pass."""
    return {k: v for k, v in wrong.items() if not math.isclose(v, right, rel_tol=rtol)}


def predict_tpot_mistakes(
    n_params: float, bytes_per_param: float, bandwidth: float, kv_cache_bytes: float = 0.0
):
    """Seconds of a memory-bound decode step, (weights + KV cache) / bandwidth, computed wrongly."""
    right = (n_params * bytes_per_param + kv_cache_bytes) / bandwidth
    return _apart(
        {
            "leaving the KV cache out": n_params * bytes_per_param / bandwidth,
            "one byte per parameter (bytes_per_param left out)": (n_params + kv_cache_bytes)
            / bandwidth,
            "bandwidth over bytes (the ratio upside down)": 1 / right,
            "milliseconds instead of seconds": 1e3 * right,
            "bits instead of bytes (8 bits a byte)": 8 * right,
        },
        right,
        1e-6,
    )


def decode_plan_mistakes(shape, gpu, context: int) -> dict[str, dict[str, float]]:
    """Chapter 05's decode plan of a Llama-style model (bf16, untied embeddings) on ``gpu``, key by
    key, computed wrongly; each key keeps the slips its test would not pass."""
    cache = context * shape.kv_values_per_token * 2  # bytes of one sequence's cache
    # one embedding row of the table is read
    read = (shape.parameters - (shape.vocab - 1) * shape.d_model) * 2
    room = gpu.memory - shape.parameters * 2
    wrong = {
        "tpot": {
            "reading the whole embedding table every step": (shape.parameters * 2 + cache)
            / gpu.bandwidth,
            "leaving the KV cache out": read / gpu.bandwidth,
        },
        "max_batch": {
            "not subtracting the weights from the memory": math.floor(gpu.memory / cache),
            "rounding up (the last sequence's cache does not fit)": math.ceil(room / cache),
        },
        "matmul_batch": {
            "half the intensity (a multiply-add as 1 FLOP, or 4 bytes per weight)": math.ceil(
                2 * gpu.ridge
            )
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


PLAN_KEYS = {
    "tpot": "seconds",
    "max_batch": "batch",
    "matmul_batch": "batch",
    "attention_intensity": "ratio",
}


def read_plan(what: str, plan) -> dict:
    """``plan`` (exercise 3's ``decode_plan`` result) if it is a dict of the four ``PLAN_KEYS``,
    each of its kind: the two batches ints (a batch is whole: a float or a str of one is not read as
    one), the seconds and the FLOPs per byte finite floats; else fail saying which key holds
    what."""
    if not isinstance(plan, dict) or sorted(plan) != sorted(PLAN_KEYS):
        shown = sorted(plan) if isinstance(plan, dict) else type(plan).__name__
        raise CheckFailed(f"{what}: expected a dict with the keys {sorted(PLAN_KEYS)}, got {shown}"
                          "\nHint: return a dict with these four keys")
    return {
        key: whole_number(
            f"{what}['{key}']", plan[key], "a batch is a whole number of sequences: an int"
        )
        if kind == "batch"
        else real_number(f"{what}['{key}']", plan[key])
        for key, kind in PLAN_KEYS.items()
    }


def stream_probe_mistakes(n: int, item: int) -> dict[str, int]:
    """Bytes one call of ``c = a + b`` over three arrays of ``n`` values of ``item`` bytes moves,
    counted wrongly."""
    right = 3 * n * item
    wrong = {
        "counting one array's bytes, not every array read or written": n * item,
        "counting the bytes read (a and b) but not those written (c)": 2 * n * item,
        "counting values instead of bytes": 3 * n,
        "counting bits instead of bytes": 8 * right,
        "4 bytes per value whatever the dtype (arrays not made in `dtype`)": 3 * n * 4,
    }
    return {k: v for k, v in wrong.items() if v != right}


def matmul_probe_mistakes(m: int, k: int, n: int) -> dict[str, int]:
    """FLOPs of one (m, k) by (k, n) product, 2 m k n, counted wrongly."""
    right = 2 * m * k * n
    wrong = {
        "m x k x n: a multiply-add counted as one FLOP, not two": m * k * n,
        "2 n^3: a square product's count, whatever m and k": 2 * n**3,
        "2 m n: one FLOP pair per output value, not per term of its sum": 2 * m * n,
    }
    return {key: v for key, v in wrong.items() if v != right}


def probe_result(what: str, got) -> tuple[int, float]:
    """``got`` as (count, seconds) if it is a pair of a positive int (bytes and FLOPs are whole) and
    a positive finite float; else fail saying what came (a str or a float that reads as the number
    is not one: ``answers``)."""
    pair = isinstance(got, (tuple, list)) and len(got) == 2
    count, seconds = got if pair else (None, None)
    if not (pair and is_whole(count) and is_real(seconds) and count > 0 and seconds > 0):
        one = isinstance(got, numbers.Real) and not isinstance(got, bool)
        kinds = f" ({type(count).__name__}, {type(seconds).__name__})" if pair else ""
        raise CheckFailed(
            f"{what}: expected a pair (count, seconds) of a positive int and a positive finite "
            f"float, got {got!r}{kinds}\nHint: return the bytes (or FLOPs) of one call, an int, "
            "and the seconds of the fastest call, a float",
            "one number (a rate?) instead of the pair (count, seconds)" if one else None,
        )
    return int(count), float(seconds)


def rate_mistakes(
    device: torch.device, kind: str = "bandwidth"
) -> dict[str, tuple[float, float]]:
    """What a probe's rate over ar_lab's rate is, roughly, with a slip of the timing: {slip: (low,
    high)}. ``kind``: "bandwidth" or "FLOP/s" (only a stream probe reads a buffer the caches
    hold)."""
    out = {
        "seconds read as milliseconds (the time x 1,000)": (1e-3 / 2.5, 1e-3 * 2.5),
        # a busy moment adds to a total, never to the fastest call: the total lands at or below 1 /
        # RATE_REPEATS
        f"the total of all {RATE_REPEATS} calls, not the fastest one": (
            1 / RATE_REPEATS / 10,
            1 / RATE_REPEATS * 2.5,
        ),
    }
    if device.type == "cuda":
        out[
            "the clock read before the GPU finished (call synchronize(device) before reading it)"
        ] = (RATE_FACTOR, math.inf)
    elif kind == "bandwidth":
        out[
            "a buffer the CPU's caches hold (fewer values than the n counted, or a slice of "
            "them): a roof read from cache, not memory; time all three arrays of n values"
        ] = (FAST_FACTOR, math.inf)
    return out


def check_probe_rates(
    stream_probe, matmul_probe, device, dtype, *, hint: str = ""
) -> dict[str, float]:
    """The learner's probes beside ar_lab's (``ar_lab.perf.peaks``), called in turns for
    ``RATE_ROUNDS`` rounds on the same sizes; each side's fastest rate. Fails unless each ratio is
    within ``RATE_FACTOR`` (a CPU's bandwidth at most ``FAST_FACTOR`` above ar_lab's: the same
    arrays read no faster, a cache-resident buffer does), naming the slip a ratio outside points
    to. Returns {"bandwidth": ratio, "FLOP/s": ratio}.

    On a CPU both sides run on one thread, whatever the kernel chose (in the grading step the
    learner's probes run in their answer process, ar_lab's in the judge: each on one thread), and
    one thread cannot wait on a thread that lost its core. None, or ar_lab's own probes, are no
    answer yet (``answers.require_answer``)."""
    require_answer("stream_probe and matmul_probe", stream_probe, matmul_probe)
    device = torch.device(device)
    n, side = RATE_SIZES[device.type]
    calls = {
        "bandwidth": (
            f"stream_probe({n}, {RATE_REPEATS})",
            lambda: stream_probe(n, RATE_REPEATS),
            lambda: peaks.stream_probe(n, RATE_REPEATS, device=device, dtype=dtype),
        ),
        "FLOP/s": (
            f"matmul_probe({side}, {side}, {side}, {RATE_REPEATS})",
            lambda: matmul_probe(side, side, side, RATE_REPEATS),
            lambda: peaks.matmul_probe(side, side, side, RATE_REPEATS, device=device, dtype=dtype),
        ),
    }
    best = {(name, who): 0.0 for name in calls for who in ("yours", "ours")}
    threads = torch.get_num_threads()
    try:
        if device.type == "cpu":
            torch.set_num_threads(1)
        for _ in range(RATE_ROUNDS):
            for name, (what, yours, ours) in calls.items():
                count, seconds = probe_result(what, yours())
                best[name, "yours"] = max(best[name, "yours"], count / seconds)
                count, seconds = ours()
                best[name, "ours"] = max(best[name, "ours"], count / seconds)
    finally:
        torch.set_num_threads(threads)
    ratios = {name: best[name, "yours"] / best[name, "ours"] for name in calls}
    for name, ratio in ratios.items():
        # a CPU's bandwidth no faster than ar_lab's on the same arrays (a cache-resident buffer is)
        top = FAST_FACTOR if name == "bandwidth" and device.type == "cpu" else RATE_FACTOR
        if 1 / RATE_FACTOR <= ratio <= top:
            continue
        what = f"{calls[name][0]}: your {name} is {ratio:.3g}x ar_lab's, timed in turns with it"
        slips = rate_mistakes(device, name).items()
        slip = next((s for s, (lo, hi) in slips if lo <= ratio <= hi), None)
        detail = (
            f", which is what {slip} gives" if slip
            else f" (it should be within {1 / RATE_FACTOR:.2g}x to {top:g}x)"
        )
        raise CheckFailed(what + detail + (f"\nHint: {hint}" if hint else ""), slip)
    return ratios
