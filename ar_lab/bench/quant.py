"""Chapter 09's benchmark: fp32 vs bf16 vs int8 vs int4 weights in batch-1 cached decode.

For two models, the course model and a random-init one large enough that its weights stream
from main memory (``ar_lab.perf.measure.CONFIGS``, ``--config``), each weight format decodes the
same prompt; repeats are interleaved (every format once per repeat, the order rotating) and
each format's speedup over fp32 is the median of its per-repeat ratios. Beside it, the
roofline's memory-bound prediction (``ar_lab.perf.roofline.predicted_speedup``: the bytes a step
moves, fp32 over the format) and measured / predicted. For the course model, the quality
columns (``ar_lab.perf.quality``). First, the kernels alone: one matrix times one vector, on
matrices that fit in a cache, then streaming several times the largest cache from main memory.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from ar_lab.base.args import positive_int
from ar_lab.base.errors import BadValue
from ar_lab.base.timing import interleaved, median
from ar_lab.bench.common import course_model_or_random, torch_threads
from ar_lab.bench.table import format_table
from ar_lab.model.evaluation import protocol_for

FORMATS = ("fp32", "bf16", "int8", "int4")
QUICK = {"tokens": 6, "repeats": 1, "quality_tokens": 6, "bpb_windows": 1}  # bits/byte on the protocol's first window


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=64, help="new tokens per generation (default 64)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved repeats; medians are reported (default 5)")
    p.add_argument(
        "--config",
        default="small",
        help="the large random-init model, from ar_lab.perf.measure.CONFIGS: small (~100 M parameters, default), "
        "cpu (~300 M), or none to skip it",
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own count)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test, not a measurement")


def _kernel_calls(w: torch.Tensor, x: torch.Tensor) -> dict[str, tuple[Callable[[], torch.Tensor], torch.Tensor]]:
    """name -> (one matrix-vector product of ``w`` and ``x``, the matrix it stands for)."""
    from ar_lab.engine.quant import QuantizedLinear, quantize_int4, quantize_int8

    int8, int4 = QuantizedLinear(quantize_int8(w)), QuantizedLinear(quantize_int4(w, 32))
    wb, zero, q8 = (
        w.bfloat16(),
        torch.zeros(w.shape[0], dtype=torch.bfloat16),
        quantize_int8(w),
    )  # q8: float32 scales, what the kernel's float32 path takes
    return {
        "fp32 addmv": (lambda: torch.mv(w, x), w),
        "bf16 mv": (lambda: torch.mv(wb, x.bfloat16()), wb.float()),
        "bf16 addmv": (lambda: torch.addmv(zero, wb, x.bfloat16()), wb.float()),  # see quant.bf16_addmv
        "int8 kernel": (lambda: int8.matmul(x[None])[0], int8.quantized().dequantize()),
        "int8 kernel, fp32 input": (
            lambda: torch.ops.aten._weight_int8pack_mm(x[None], q8.q, q8.scale)[0],
            q8.dequantize(),
        ),
        "int8 dequantize + mv": (lambda: torch.mv(q8.q.float() * q8.scale[:, None], x), q8.dequantize()),
        "int4 kernel": (lambda: int4.matmul(x[None])[0], int4.quantized().dequantize()),
    }


def _protocol(model, quality: dict):
    """The course's evaluation protocol at the model's context (quick runs: its first windows only)."""
    protocol = protocol_for(model.config.block_size)
    return protocol if quality["bpb_windows"] is None else protocol.first(quality["bpb_windows"])


def kernel_timings(shapes=((1024, 256), (4096, 1024)), repeats: int = 30) -> list[dict]:
    """One (out, in) matrix times one vector, per shape: microseconds per call (median of interleaved
    calls), speed relative to float32 ``mv``, and the largest error relative to the product with the
    matrix the call stands for (its dequantized weights)."""
    rows = []
    for n_out, n_in in shapes:
        torch.manual_seed(0)
        w, x = torch.randn(n_out, n_in), torch.randn(n_in)
        calls = _kernel_calls(w, x)
        with torch.inference_mode():
            times = interleaved({name: fn for name, (fn, _) in calls.items()}, repeats, clock=time.perf_counter)
            for name, (fn, matrix) in calls.items():
                want = matrix @ x
                err = float((fn().float() - want).abs().max() / want.abs().max())
                us = 1e6 * median(times[name])
                rows.append({"shape": [n_out, n_in], "call": name, "us": us, "rel_error": err})
        base = rows[-len(calls)]["us"]  # fp32 addmv, the first call
        for r in rows[-len(calls) :]:
            r["x_fp32"] = base / r["us"]
    return rows


# CPU flags (as Linux names them) of instructions that multiply bfloat16 pairs and add into float32:
# x86 AVX512-BF16 (vdpbf16ps), x86 AMX-BF16 (tile products), Arm's BF16 extension (bfdot).
BF16_DOT_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def bf16_dot_instructions(cpuinfo: str | None = None) -> list[str] | None:
    """Which of ``BF16_DOT_FLAGS`` this CPU lists (``/proc/cpuinfo``, or the text given), or None where
    the flags cannot be read. Without any, a bfloat16 product widens every value to float32 (a 16-bit
    shift) before a float32 multiply-add: the arithmetic of fp32 plus a conversion per weight."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return None
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86, Arm
            flags.update(value.split())
    return [f for f in BF16_DOT_FLAGS if f in flags] if flags else None


def kernels_from_memory(nbytes: int, *, repeats: int = 5, n_in: int = 4096, group_size: int = 32) -> list[dict]:
    """The four decode kernels, each streaming the same ``nbytes`` (make it several times the largest
    cache, so that every call reads main memory): per call, microseconds (median of interleaved calls),
    weights and bytes read, GB/s, and per byte and per weight against fp32's ``mv``.

    The bytes are one buffer read as each format: fp32 rows, bf16 rows, int8 rows (plus a bfloat16 scale
    per row), and int4 in the CPU kernel's packed layout followed by its bfloat16 scales and zeros (one
    pair per ``group_size`` weights), so no format's copy is held beside another's. Every byte lies in
    [0x30, 0x3F]: read as fp32 or bf16 it is a normal number (no subnormals, which some CPUs compute
    slowly), as int8 a small positive one. Values do not change these kernels' speed; only the bytes do.
    """
    from ar_lab.engine.quant import INT4_GROUP_SIZES

    positive_int("repeats", repeats)
    positive_int("n_in", n_in, 2 * group_size)
    if group_size not in INT4_GROUP_SIZES or n_in % group_size:
        raise BadValue(
            f"group_size must be one of {INT4_GROUP_SIZES} and divide n_in={n_in}, got {group_size}", arg="group_size"
        )
    rows = positive_int("nbytes", nbytes, 64 * 4 * n_in) // (64 * 4 * n_in) * 64  # fp32 rows, a multiple of 64
    size = rows * 4 * n_in
    g = torch.Generator().manual_seed(0)
    block = torch.randint(0x30, 0x40, (4 * n_in,), dtype=torch.uint8, generator=g)
    buf = block.repeat(rows)  # (size,) bytes
    int4_rows = size // (n_in // 2 + 4 * n_in // group_size) // 64 * 64  # packed weights + scales fit in size
    packed = buf[: int4_rows * n_in // 2].view(int4_rows, n_in // 2)  # two 4-bit weights per byte
    zs = buf[packed.numel() : packed.numel() + 4 * int4_rows * n_in // group_size]
    scales_and_zeros = zs.view(torch.bfloat16).view(n_in // group_size, int4_rows, 2)
    int8_scales = torch.full((4 * rows,), 0.01, dtype=torch.bfloat16)
    x = torch.randn(n_in, generator=g)
    xb = x.bfloat16()
    w32, w16, w8 = (buf.view(dtype).view(-1, n_in) for dtype in (torch.float32, torch.bfloat16, torch.int8))
    aten = torch.ops.aten
    calls = {  # name -> (the call, weights it multiplies, bytes it reads)
        "fp32 mv": (lambda: torch.mv(w32, x), w32.numel(), size),
        "bf16 mv": (lambda: torch.mv(w16, xb), w16.numel(), size),
        "int8 kernel": (lambda: aten._weight_int8pack_mm(xb[None], w8, int8_scales), w8.numel(), size + 8 * rows),
        "int4 kernel": (
            lambda: aten._weight_int4pack_mm_for_cpu(xb[None], packed, group_size, scales_and_zeros),
            2 * packed.numel(),
            packed.numel() + zs.numel(),
        ),
    }
    with torch.inference_mode():
        times = interleaved({k: fn for k, (fn, _, _) in calls.items()}, repeats, warmup=1, clock=time.perf_counter)
    out = []
    for name, (_, weights, nread) in calls.items():
        seconds = median(times[name])
        out.append(
            {
                "call": name,
                "us": 1e6 * seconds,
                "weights": weights,
                "bytes": nread,
                "bytes_per_weight": nread / weights,
                "gb_per_s": nread / seconds / 1e9,
            }
        )
    fp32 = out[0]
    for r in out:
        r["per_byte_vs_fp32"] = r["gb_per_s"] / fp32["gb_per_s"]
        r["byte_ratio"] = fp32["bytes_per_weight"] / r["bytes_per_weight"]  # fewer bytes per weight than fp32
        r["per_weight_vs_fp32"] = r["byte_ratio"] * r["per_byte_vs_fp32"]  # = (weights/s) / fp32's
    return out


def streamed_bytes(cache: int | None = None, *, times: int = 3, most: int = 2**30) -> int:
    """Bytes for ``kernels_from_memory``: ``times`` the largest CPU cache (``ar_lab.perf.peaks.cache_bytes``;
    32 MiB where the machine does not say), at most ``most``."""
    from ar_lab.perf.peaks import cache_bytes

    cache = cache_bytes() if cache is None else cache
    return min(times * (cache or 32 * 2**20), most)


def decode_times(models: dict, prompt: str, tokens: int, repeats: int, say=None) -> dict[str, list[float]]:
    """Per model, per repeat: seconds of the ``tokens - 1`` decode steps (prefill excluded) of ``tokens``
    new tokens; every model once per repeat, the order rotating, after one warm-up run each."""
    from ar_lab.engine.generate import generate

    say = say or (lambda _m: None)
    for m in models.values():
        generate(m, prompt, 4, eos_id=None)  # warm-up
    seconds: dict[str, list[float]] = {k: [] for k in models}
    names = list(models)
    for r in range(repeats):
        say(f"repeat {r + 1}/{repeats}")
        for name in names[r % len(names) :] + names[: r % len(names)]:
            out = generate(models[name], prompt, tokens, eos_id=None)
            seconds[name].append(sum(out.stats.decode_times))
    return seconds


def measure_model(model, label: str, *, tokens: int, repeats: int, prompt: str, quality: dict | None, say) -> dict:
    """Every format of ``model`` decoded side by side: tokens/s, bytes/token, measured and predicted speedups."""
    from ar_lab.engine.quant import quantize_model
    from ar_lab.perf.quality import bits_per_byte, greedy_agreement, self_draft_acceptance
    from ar_lab.perf.roofline import bytes_per_token, predicted_speedup

    say(f"{label}: quantizing")
    models = {w: quantize_model(model, weights=w) for w in FORMATS}
    seconds = decode_times(models, prompt, tokens, repeats, lambda m: say(f"{label}: {m}"))
    context = len(prompt.encode()) + tokens // 2  # the mean position of a decode step
    rows = {}
    for w, m in models.items():
        per_repeat = [a / b for a, b in zip(seconds["fp32"], seconds[w], strict=True)]
        predicted = predicted_speedup(models["fp32"], m, context=context)
        rows[w] = {
            "tokens_per_s": (tokens - 1) / median(seconds[w]),
            "bytes_per_token": bytes_per_token(m),
            "speedup": median(per_repeat),
            "predicted_speedup": predicted,
            "measured_vs_predicted": median(per_repeat) / predicted,
            "seconds": seconds[w],
        }
        if quality is not None:
            say(f"{label}: quality of {w}")
            agree = greedy_agreement(models["fp32"], m, n_tokens=quality["quality_tokens"])
            accept = self_draft_acceptance(models["fp32"], m, n_tokens=quality["quality_tokens"])
            rows[w].update(
                bits_per_byte=bits_per_byte(m, _protocol(m, quality)),
                greedy_top1=agree.top1,
                first_divergence=agree.first_divergence,
                acceptance_greedy=accept.greedy,
                acceptance_t1=accept.sampled_exact,
            )
    cfg = model.config
    return {
        "label": label,
        "parameters": model.num_parameters(),
        "config": cfg.to_dict(),
        "context": context,
        "rows": rows,
    }


def kv_cache_figures(model, *, tokens: int, repeats: int, prompt: str, quality_tokens: int, say) -> dict:
    """A float32 KV cache against an ``Int8KVCache`` on ``model``: bytes of real caches at the full
    context (and the formulas'), decode tokens/s side by side (interleaved), greedy agreement."""
    from ar_lab.engine.generate import generate
    from ar_lab.engine.kv_quant import Int8KVCache, int8_kv_cache_bytes
    from ar_lab.model.cache import KVCache, kv_cache_bytes
    from ar_lab.perf.quality import kv_cache_agreement

    cfg = model.config
    sizes = (cfg.n_layer, cfg.kv_heads, cfg.head_dim, cfg.block_size)
    kinds = {"fp32": KVCache, "int8": Int8KVCache}
    out = {
        "context": cfg.block_size,
        "nbytes": {k: kind.for_model(model).nbytes for k, kind in kinds.items()},
        "formula_bytes": {"fp32": kv_cache_bytes(*sizes), "int8": int8_kv_cache_bytes(*sizes)},
    }
    max_len = len(prompt.encode()) + tokens - 1
    seconds: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(repeats + 1):  # the first round warms up
        say(f"KV cache: repeat {r}/{repeats}")
        for k in list(kinds)[:: 1 if r % 2 else -1]:
            run = generate(model, prompt, tokens, eos_id=None, cache=kinds[k].for_model(model, max_len=max_len))
            if r:
                seconds[k].append(sum(run.stats.decode_times))
    out["tokens_per_s"] = {k: (tokens - 1) / median(v) for k, v in seconds.items()}
    agreement = kv_cache_agreement(model, n_tokens=quality_tokens)
    out["greedy_top1"], out["first_divergence"] = agreement.top1, agreement.first_divergence
    return out


def quant_benchmark(
    course=None,
    large=None,
    *,
    tokens: int = 64,
    repeats: int = 5,
    prompt: str = "Python ",
    quick: bool = False,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """The measurements (returns data, prints nothing): kernels, then each model's formats side by side."""
    positive_int("tokens", tokens, 2)
    positive_int("repeats", repeats)
    say = progress or (lambda _m: None)
    source = "given"
    if course is None:
        course, source = course_model_or_random()
    quality = dict(QUICK) if quick else {"quality_tokens": 32, "bpb_windows": None}
    say("kernels")
    shapes = ((64, 64),) if quick else ((1024, 256), (4096, 1024))
    result = {"benchmark": "quant", "tokens": tokens, "repeats": repeats, "threads": torch.get_num_threads()}
    # what the quality columns were measured on (bits/byte: the evaluation protocol, by name)
    result["quality"] = {**quality, "bpb_protocol": _protocol(course, quality).name}
    result["kernels"] = kernel_timings(shapes, repeats=3 if quick else 30)
    say("kernels streaming from main memory")
    result["kernels_from_memory"] = kernels_from_memory(2**20 if quick else streamed_bytes(), repeats=2 if quick else 5)
    result["models"] = [
        measure_model(
            course, f"course model ({source})", tokens=tokens, repeats=repeats, prompt=prompt, quality=quality, say=say
        )
    ]
    result["kv_cache"] = kv_cache_figures(
        course, tokens=tokens, repeats=repeats, prompt=prompt, quality_tokens=quality["quality_tokens"], say=say
    )
    if large is not None:
        result["models"].append(
            measure_model(
                large, "random-init large model", tokens=tokens, repeats=repeats, prompt=prompt, quality=None, say=say
            )
        )
    return result


def format_quant_results(res: dict) -> str:
    """The printed report: the kernel table, then one table per model."""
    lines = [
        f"quant: batch-1 greedy decode, {res['tokens']} new tokens, {res['repeats']} interleaved repeats, "
        f"{res['threads']} thread{'s' if res['threads'] != 1 else ''}",
        "",
        "kernels: one (out, in) matrix x one vector",
    ]
    krows = [
        [f"{k['shape'][0]}x{k['shape'][1]}", k["call"], f"{k['us']:.0f}", f"{k['x_fp32']:.2f}", f"{k['rel_error']:.1e}"]
        for k in res["kernels"]
    ]
    lines += [format_table(["matrix", "call", "us/call", "x fp32 speed", "max rel. error"], krows), ""]
    streamed = res.get("kernels_from_memory")  # absent from results stored before it was measured
    if streamed:
        mib = streamed[0]["bytes"] / 2**20
        lines.append(f"kernels streaming {mib:.0f} MiB from main memory (one matrix x one vector)")
        srows = [
            [
                k["call"],
                f"{k['us'] / 1e3:.1f}",
                f"{k['bytes_per_weight']:.3f}",
                f"{k['gb_per_s']:.1f}",
                f"{k['per_byte_vs_fp32']:.2f}",
                f"{k['per_weight_vs_fp32']:.2f}",
            ]
            for k in streamed
        ]
        headers = ["call", "ms/call", "bytes/weight", "GB/s", "per byte x fp32", "per weight x fp32"]
        lines += [format_table(headers, srows), ""]
    for model in res["models"]:
        lines.append(f"{model['label']}: {model['parameters'] / 1e6:.1f} M parameters, mean context {model['context']}")
        headers = ["weights", "tokens/s", "MB/token", "speedup", "predicted", "measured/predicted"]
        quality = "bits_per_byte" in model["rows"]["fp32"]
        if quality:
            headers += ["bits/byte", "top-1 agree", "1st diverge", "accept greedy", "accept T=1"]
        rows = []
        for w, r in model["rows"].items():
            row = [
                w,
                f"{r['tokens_per_s']:.1f}",
                f"{r['bytes_per_token'] / 1e6:.2f}",
                f"{r['speedup']:.2f}x",
                f"{r['predicted_speedup']:.2f}x",
                f"{r['measured_vs_predicted']:.2f}",
            ]
            if quality:
                row += [
                    f"{r['bits_per_byte']:.4f}",
                    f"{r['greedy_top1']:.3f}",
                    f"{r['first_divergence']:.1f}",
                    f"{r['acceptance_greedy']:.3f}",
                    f"{r['acceptance_t1']:.3f}",
                ]
            rows.append(row)
        lines += [format_table(headers, rows), ""]
    kv = res["kv_cache"]
    nb, tps = kv["nbytes"], kv["tokens_per_s"]
    lines += [
        f"KV cache of the course model at its full context ({kv['context']} positions): "
        f"fp32 {nb['fp32'] / 2**20:.2f} MiB, int8 {nb['int8'] / 2**20:.2f} MiB ({nb['int8'] / nb['fp32']:.0%}, "
        f"formula {kv['formula_bytes']['int8']:,} B); "
        f"decode {tps['fp32']:.0f} vs {tps['int8']:.0f} tokens/s; int8 vs fp32 cache: top-1 agreement "
        f"{kv['greedy_top1']:.3f}, first divergence after {kv['first_divergence']:.1f} tokens",
        "",
    ]
    lines.append(
        "speedup: fp32's decode time over the format's, median of per-repeat ratios; predicted: the "
        "roofline's bytes ratio (weights + KV cache + activations per step). A shared machine is noisy."
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    """The command: options checked first, then the measurements, then the report."""
    from ar_lab.model.gpt import GPTConfig
    from ar_lab.perf.measure import CONFIGS, build_model

    positive_int("tokens", args.tokens, 2)
    positive_int("repeats", args.repeats)
    if args.config != "none" and args.config not in CONFIGS:
        raise BadValue(f"--config must be one of {sorted(CONFIGS)} or none, got {args.config!r}", arg="config")
    threads = torch.get_num_threads() if args.threads is None else args.threads
    tokens, repeats = (QUICK["tokens"], QUICK["repeats"]) if args.quick else (args.tokens, args.repeats)
    with torch_threads(threads):
        large = None
        if args.config != "none":
            cfg = GPTConfig(block_size=128, n_layer=2, n_head=2, n_embd=64) if args.quick else CONFIGS[args.config]
            large = build_model(cfg, "cpu", torch.float32)
        res = quant_benchmark(
            None,
            large,
            tokens=tokens,
            repeats=repeats,
            quick=args.quick,
            progress=lambda m: print("  " + m, flush=True),
        )
    print()
    print(format_quant_results(res))
    return res
