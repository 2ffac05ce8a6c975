"""Chapter 10's benchmark: attention materialised, in tiles (FlashAttention-2's way) and by SDPA.

Memory: the peak bytes of the tensors each way creates (``ar_lab.perf.peak_bytes``), for T up to 8k
(16k with ``--memory-lengths``), counted on the meta device (the same operations on shapes only: the
count is exact, and a T x T matrix of 16k positions costs no memory to count), with the fitted
exponent of bytes against T (materialised about 2, tiled about 1; and of its growth, peak(2T) -
peak(T), which leaves out the tiles' fixed working set) and the arithmetic model
(``ar_lab.model.tiled.attention_bytes``) beside it. Time: the three on this machine's CPU for
shorter T, in interleaved turns, as ratios to SDPA measured in one run, with each side's peak bytes
measured on the CPU too (SDPA's fused kernel keeps its tiles in scratch of its own, which the count
does not see: its column is its output).
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from ar_lab.base.args import positive_int
from ar_lab.base.errors import BadValue
from ar_lab.base.timing import interleaved, machine, machine_line, median
from ar_lab.bench.common import torch_threads
from ar_lab.bench.table import format_table
from ar_lab.model.tiled import attention_bytes, materialised_attention, tiled_attention
from ar_lab.perf.peak_bytes import peak_bytes

MEMORY_LENGTHS = (512, 1024, 2048, 4096, 8192)
TIME_LENGTHS = (256, 512, 1024, 2048, 4096)
QUICK = {"memory_lengths": (128, 256, 512), "time_lengths": (64, 128), "rounds": 1, "tile": 32}


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--memory-lengths",
        type=int,
        nargs="+",
        default=list(MEMORY_LENGTHS),
        help="T for the peak-bytes sweep, counted on the meta device (default 512 .. 8192; "
        "16384 adds ~25 s)",
    )
    p.add_argument(
        "--time-lengths",
        type=int,
        nargs="+",
        default=list(TIME_LENGTHS),
        help="T for the timed sweep on the CPU (default 256 .. 4096)",
    )
    p.add_argument("--heads", type=int, default=4, help="query heads (default 4)")
    p.add_argument(
        "--kv-heads", type=int, default=2, help="key/value heads, dividing --heads (default 2)"
    )
    p.add_argument("--head-dim", type=int, default=64, help="D, the head size (default 64)")
    p.add_argument(
        "--tile", type=int, default=128, help="tile_q = tile_k of the tiled way (default 128)"
    )
    p.add_argument(
        "--rounds", type=int, default=5, help="interleaved timing rounds; medians (default 5)"
    )
    p.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (default 1: steadier when shared)"
    )
    p.add_argument(
        "--quick", action="store_true", help="tiny sizes: a smoke test, not a measurement"
    )


def _inputs(T: int, heads: int, kv_heads: int, D: int, device: str):
    """Seeded q (1, heads, T, D), k, v (1, kv_heads, T, D) on the CPU, or their shapes on the meta
    device."""
    gen = torch.Generator().manual_seed(T)
    make = (
        (lambda *shape: torch.empty(shape, device="meta"))
        if device == "meta"
        else (lambda *shape: torch.randn(shape, generator=gen))
    )
    return make(1, heads, T, D), make(1, kv_heads, T, D), make(1, kv_heads, T, D)


def _ways(q, k, v, tile: int, *, sdpa: bool = True) -> dict:
    """name -> a call of no arguments: the three ways of computing the same causal attention."""
    tile = min(tile, q.shape[2])
    ways = {
        "materialised": lambda: materialised_attention(q, k, v),
        "tiled": lambda: tiled_attention(q, k, v, tile_q=tile, tile_k=tile),
    }
    if sdpa:
        ways["sdpa"] = lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True
        )
    return ways


def exponent(lengths, values) -> float:
    """The least-squares slope of log(values) against log(lengths): b in values ~ a * T**b."""
    x, y = [math.log(t) for t in lengths], [math.log(b) for b in values]
    mx, my = sum(x) / len(x), sum(y) / len(y)
    return sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True)) / sum(
        (a - mx) ** 2 for a in x
    )


def growth_exponent(lengths, values) -> float | None:
    """b in values ~ c + a * T**b, from the increments between consecutive lengths (the constant c
    cancels): values[i + 1] - values[i] ~ a * (r**b - 1) * T_i**b when each length is r times the
    last. None unless the lengths grow by one constant ratio and the values increase."""
    ratios = [b / a for a, b in zip(lengths, lengths[1:], strict=False)]
    steps = [b - a for a, b in zip(values, values[1:], strict=False)]
    if len(steps) < 2 or max(ratios) - min(ratios) > 1e-9 * max(ratios) or min(steps) <= 0:
        return None
    return exponent(lengths[:-1], steps)


def _memory_sweep(lengths, heads: int, kv_heads: int, D: int, tile: int) -> list[dict]:
    rows = []
    for T in lengths:
        q, k, v = _inputs(T, heads, kv_heads, D, "meta")
        peaks = {name: peak_bytes(fn) for name, fn in _ways(q, k, v, tile, sdpa=False).items()}
        model = attention_bytes(1, heads, kv_heads, T, T, D, tile_q=tile, tile_k=tile)
        rows.append({"T": T, "peak_bytes": peaks, "model_bytes": model})
    return rows


def _time_sweep(lengths, heads: int, kv_heads: int, D: int, tile: int, rounds: int) -> list[dict]:
    rows = []
    for T in lengths:
        q, k, v = _inputs(T, heads, kv_heads, D, "cpu")
        ways = _ways(q, k, v, tile)
        ref = ways["sdpa"]()
        error = max(float((fn() - ref).abs().max()) for fn in ways.values())
        peaks = {name: peak_bytes(fn) for name, fn in ways.items()}
        times = {name: median(t) for name, t in interleaved(ways, rounds, warmup=1).items()}
        rows.append(
            {
                "T": T,
                "seconds": times,
                "ratio_to_sdpa": {n: t / times["sdpa"] for n, t in times.items()},
                "peak_bytes": peaks,
                "max_abs_difference": error,
            }
        )
    return rows


def attention_benchmark(
    *,
    memory_lengths=MEMORY_LENGTHS,
    time_lengths=TIME_LENGTHS,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    tile: int = 128,
    rounds: int = 5,
) -> dict:
    """Peak bytes against T (meta device) with fitted exponents, and time against T (CPU,
    interleaved) as ratios to SDPA. Returns JSON-ready data and prints nothing;
    ``format_attention_results`` prints it."""
    for name, values in [("memory_lengths", memory_lengths), ("time_lengths", time_lengths)]:
        if len(values) < 2 or len(set(values)) != len(values):
            raise BadValue(
                f"{name} needs at least two different lengths, got {list(values)}", arg=name
            )
        for t in values:
            positive_int(name, t)
    for name, value in [
        ("heads", heads),
        ("kv_heads", kv_heads),
        ("head_dim", head_dim),
        ("tile", tile),
        ("rounds", rounds),
    ]:
        positive_int(name, value)
    if heads % kv_heads:
        raise BadValue(f"kv_heads must divide heads ({heads}), got {kv_heads}", arg="kv_heads")
    with torch.inference_mode():
        memory = _memory_sweep(sorted(memory_lengths), heads, kv_heads, head_dim, tile)
        timed = _time_sweep(sorted(time_lengths), heads, kv_heads, head_dim, tile, rounds)
    Ts = [r["T"] for r in memory]
    peaks = {n: [r["peak_bytes"][n] for r in memory] for n in ("materialised", "tiled")}
    exponents = {n: exponent(Ts, p) for n, p in peaks.items()}
    growth = {n: growth_exponent(Ts, p) for n, p in peaks.items()}
    return {
        "benchmark": "attention",
        "shape": {"B": 1, "Hq": heads, "Hkv": kv_heads, "D": head_dim, "dtype": "float32"},
        "tile": tile,
        "rounds": rounds,
        "memory": memory,
        "exponents": exponents,
        "growth_exponents": growth,
        "time": timed,
        "machine": machine("cpu"),
    }


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f}"


def _memory_lines(res: dict) -> list[str]:
    """The report's peak-bytes table and the fitted growth exponents."""
    mem = [
        [
            r["T"],
            _mib(r["peak_bytes"]["materialised"]),
            _mib(r["model_bytes"]["materialised"]),
            _mib(r["peak_bytes"]["tiled"]),
            _mib(r["model_bytes"]["tiled"]),
            f"{r['peak_bytes']['materialised'] / r['peak_bytes']['tiled']:.1f}",
        ]
        for r in res["memory"]
    ]
    e = res["exponents"]
    mem_table = format_table(
        ["T", "materialised MiB", "model MiB", "tiled MiB", "model MiB", "materialised / tiled"],
        mem,
    )
    fit = (
        f"peak bytes ~ T^b fitted over T: materialised b = {e['materialised']:.2f}, "
        f"tiled b = {e['tiled']:.2f}"
    )
    g = res["growth_exponents"]
    # the tiles' fixed working set weighs at short T; growth leaves it out
    if None not in g.values():
        fit += (
            f"\npeak(rT) - peak(T) ~ T^b (the fixed part cancels): "
            f"materialised b = {g['materialised']:.2f}, tiled b = {g['tiled']:.2f}"
        )
    return [mem_table, fit]


def _time_table(res: dict) -> str:
    """The report's table of times, ratios to sdpa, peak bytes and the largest difference."""
    t_rows = [
        [
            r["T"],
            *(f"{r['seconds'][n] * 1e3:,.1f}" for n in ("materialised", "tiled", "sdpa")),
            f"{r['ratio_to_sdpa']['materialised']:.2f}",
            f"{r['ratio_to_sdpa']['tiled']:.2f}",
            _mib(r["peak_bytes"]["materialised"]),
            _mib(r["peak_bytes"]["tiled"]),
            _mib(r["peak_bytes"]["sdpa"]),
            f"{r['max_abs_difference']:.1e}",
        ]
        for r in res["time"]
    ]
    return format_table(
        [
            "T",
            "materialised ms",
            "tiled ms",
            "sdpa ms",
            "materialised/sdpa",
            "tiled/sdpa",
            "mat. MiB",
            "tiled MiB",
            "sdpa MiB",
            "max |diff|",
        ],
        t_rows,
    )


def format_attention_results(res: dict) -> str:
    s = res["shape"]
    head = (
        f"causal attention, B=1, Hq={s['Hq']}, Hkv={s['Hkv']}, D={s['D']}, float32; "
        f"tiles {res['tile']} x {res['tile']}; {machine_line(res['machine'])}"
    )
    return "\n".join(
        [
            head,
            "",
            "peak bytes of the tensors each way creates "
            "(counted on the meta device: shapes, no arithmetic)",
            *_memory_lines(res),
            "",
            f"time on this CPU, {res['rounds']} interleaved rounds (medians), "
            "ratios measured side by side",
            _time_table(res),
        ]
    )


def run(args: argparse.Namespace) -> dict:
    sizes = dict(
        memory_lengths=args.memory_lengths,
        time_lengths=args.time_lengths,
        rounds=args.rounds,
        tile=args.tile,
    )
    if args.quick:
        sizes = dict(QUICK)
    threads = torch.get_num_threads() if args.threads is None else args.threads
    with torch_threads(threads):
        res = attention_benchmark(
            heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, **sizes
        )
    print(format_attention_results(res))
    return res
