"""The benchmark itself: each weight format decoding the course model and a random-init model that
streams from main memory, against the roofline's bytes ratio; quality; the int8 KV cache; the
table (``format_quant_results``) and ``run``."""
from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import torch

from ar_lab.base.args import positive_int
from ar_lab.base.errors import BadValue
from ar_lab.base.timing import median
from ar_lab.bench.common import course_model_or_random, torch_threads
from ar_lab.bench.quant.kernels import kernel_timings, kernels_from_memory, streamed_bytes
from ar_lab.bench.table import format_table
from ar_lab.model.evaluation import protocol_for

FORMATS = ("fp32", "bf16", "int8", "int4")
# int4 by the calibrated methods (ar_lab.engine.calibrated), the course model only: the same
# format and kernels as round-to-nearest int4, other integers
CALIBRATED = ("int4 awq", "int4 gptq")


# bits/byte on the protocol's first window
# the whole protocol; calibration_stats' default 32,768 tokens
FULL = {"quality_tokens": 32, "bpb_windows": None, "calibration": {"windows": 64, "length": 512}}
QUICK = {
    "tokens": 6,
    "repeats": 1,
    "quality_tokens": 6,
    "bpb_windows": 1,
    "calibration": {"windows": 2, "length": 64},
}


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=64, help="new tokens per generation (default 64)")
    p.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="interleaved repeats; medians are reported (default 5)",
    )
    p.add_argument(
        "--config",
        default="small",
        help="the large random-init model, from ar_lab.perf.measure.CONFIGS: small (~100 M "
        "parameters, default), cpu (~300 M), or none to skip it",
    )
    p.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's own count)"
    )
    p.add_argument(
        "--quick", action="store_true", help="tiny sizes: a smoke test, not a measurement"
    )


def _protocol(model, quality: dict):
    """The course's evaluation protocol at the model's context (quick runs: its first windows
    only)."""
    protocol = protocol_for(model.config.block_size)
    return protocol if quality["bpb_windows"] is None else protocol.first(quality["bpb_windows"])


def decode_times(
    models: dict, prompt: str, tokens: int, repeats: int, say=None
) -> dict[str, list[float]]:
    """Per model, per repeat: seconds of the ``tokens - 1`` decode steps (prefill excluded) of
    ``tokens`` new tokens; every model once per repeat, the order rotating, after one warm-up run
    each."""
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


def measure_model(
    model, label: str, *, tokens: int, repeats: int, prompt: str, quality: dict | None, say
) -> dict:
    """Every format of ``model`` decoded side by side: tokens/s, bytes/token, measured and predicted
    speedups."""
    from ar_lab.engine.quant import quantize_model
    from ar_lab.perf.quality import bits_per_byte, greedy_agreement, self_draft_acceptance
    from ar_lab.perf.roofline import bytes_per_token, predicted_speedup

    say(f"{label}: quantizing")
    models = {w: quantize_model(model, weights=w) for w in FORMATS}
    if quality is not None:
        from ar_lab.engine.calibrated import calibrated_model

        for w in CALIBRATED:
            say(f"{label}: calibrating {w}")
            models[w] = calibrated_model(model, w.split()[1], **quality["calibration"])
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
    if quality is not None:
        from ar_lab.engine.calibrated import recovered

        full, rtn = rows["fp32"]["bits_per_byte"], rows["int4"]["bits_per_byte"]
        for w in CALIBRATED:
            share = recovered(rtn, rows[w]["bits_per_byte"], full)
            rows[w]["recovered_of_int4_loss"] = None if math.isnan(share) else share  # JSON
    cfg = model.config
    return {
        "label": label,
        "parameters": model.num_parameters(),
        "config": cfg.to_dict(),
        "context": context,
        "rows": rows,
    }


def kv_cache_figures(
    model, *, tokens: int, repeats: int, prompt: str, quality_tokens: int, say
) -> dict:
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
            run = generate(
                model, prompt, tokens, eos_id=None, cache=kinds[k].for_model(model, max_len=max_len)
            )
            if r:
                seconds[k].append(sum(run.stats.decode_times))
    out["tokens_per_s"] = {k: (tokens - 1) / median(v) for k, v in seconds.items()}
    agreement = kv_cache_agreement(model, n_tokens=quality_tokens)
    out["greedy_top1"], out["first_divergence"] = agreement.top1, agreement.first_divergence
    return out


def format_figures(model, quality: dict, say) -> dict:
    """Weights rounded to each format of ``ar_lab.engine.float_formats`` (FP8, NVFP4, MXFP4 beside
    int8 and int4): bits per weight, relative RMS error, bits per byte of the course model."""
    from ar_lab.engine.float_formats import formats_compared, rounded_model
    from ar_lab.perf.quality import bits_per_byte

    found = formats_compared(model)
    for fmt, row in found.items():
        say(f"formats: {fmt}")
        row["bits_per_byte"] = bits_per_byte(rounded_model(model, fmt), _protocol(model, quality))
    return found


def quant_benchmark(
    course=None,
    large=None,
    *,
    tokens: int = 64,
    repeats: int = 5,
    prompt: str = "Python ",
    quick: bool = False,
    progress: Callable[[str], None] | None = None,
    extra: tuple = (),
) -> dict:
    """The measurements (returns data, prints nothing): kernels, then each model's formats side by
    side. ``extra``: (model, label) pairs of further trained models, measured as the course model is
    (quality and calibrated int4 included), after it."""
    positive_int("tokens", tokens, 2)
    positive_int("repeats", repeats)
    say = progress or (lambda _m: None)
    source = "given"
    if course is None:
        course, source = course_model_or_random()
    quality = dict(QUICK if quick else FULL)
    say("kernels")
    shapes = ((64, 64),) if quick else ((1024, 256), (4096, 1024))
    result = {
        "benchmark": "quant",
        "tokens": tokens,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
    }
    # what the quality columns were measured on (bits/byte: the evaluation protocol, by name)
    result["quality"] = {**quality, "bpb_protocol": _protocol(course, quality).name}
    result["kernels"] = kernel_timings(shapes, repeats=3 if quick else 30)
    say("kernels streaming from main memory")
    result["kernels_from_memory"] = kernels_from_memory(
        2**20 if quick else streamed_bytes(), repeats=2 if quick else 5
    )
    result["models"] = [
        measure_model(
            course,
            f"course model ({source})",
            tokens=tokens,
            repeats=repeats,
            prompt=prompt,
            quality=quality,
            say=say,
        )
    ]
    result["kv_cache"] = kv_cache_figures(
        course,
        tokens=tokens,
        repeats=repeats,
        prompt=prompt,
        quality_tokens=quality["quality_tokens"],
        say=say,
    )
    result["formats"] = format_figures(course, quality, say)
    for model, label in extra:
        result["models"].append(measure_model(model, label, tokens=tokens, repeats=repeats,
                                              prompt=prompt, quality=quality, say=say))
    if large is not None:
        result["models"].append(
            measure_model(
                large,
                "random-init large model",
                tokens=tokens,
                repeats=repeats,
                prompt=prompt,
                quality=None,
                say=say,
            )
        )
    return result


def _streamed_kernel_lines(streamed: list[dict]) -> list[str]:
    """The report's table of the kernels streaming their matrix from main memory."""
    mib = streamed[0]["bytes"] / 2**20
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
    headers = [
        "call",
        "ms/call",
        "bytes/weight",
        "GB/s",
        "per byte x fp32",
        "per weight x fp32",
    ]
    return [
        f"kernels streaming {mib:.0f} MiB from main memory (one matrix x one vector)",
        format_table(headers, srows),
        "",
    ]


def _model_lines(model: dict) -> list[str]:
    """The report's table of one model: each weight format's speed, and its quality if measured."""
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
    lines = [
        f"{model['label']}: {model['parameters'] / 1e6:.1f} M parameters, mean context "
        f"{model['context']}",
        format_table(headers, rows),
    ]
    shares = {w: model["rows"].get(w, {}).get("recovered_of_int4_loss") for w in CALIBRATED}
    if any(v is not None for v in shares.values()):
        lines.append(
            "int4's bits/byte lost to fp32, recovered by calibration (same format and kernels): "
            + ", ".join(f"{w} {v:.0%}" for w, v in shares.items() if v is not None)
        )
    return [*lines, ""]


def format_quant_results(res: dict) -> str:
    """The printed report: the kernel table, then one table per model."""
    lines = [
        f"quant: batch-1 greedy decode, {res['tokens']} new tokens, {res['repeats']} interleaved "
        f"repeats, {res['threads']} thread{'s' if res['threads'] != 1 else ''}",
        "",
        "kernels: one (out, in) matrix x one vector",
    ]
    krows = [
        [
            f"{k['shape'][0]}x{k['shape'][1]}",
            k["call"],
            f"{k['us']:.0f}",
            f"{k['x_fp32']:.2f}",
            f"{k['rel_error']:.1e}",
        ]
        for k in res["kernels"]
    ]
    lines += [
        format_table(["matrix", "call", "us/call", "x fp32 speed", "max rel. error"], krows),
        "",
    ]
    streamed = res.get("kernels_from_memory")  # absent from results stored before it was measured
    if streamed:
        lines += _streamed_kernel_lines(streamed)
    for model in res["models"]:
        lines += _model_lines(model)
    formats = res.get("formats")  # measured since 2026-12-07
    if formats:
        rows = [
            [f, *(f"{r[k]:.{d}f}" for k, d in (("bits_per_weight", 2), ("relative_rms", 4),
                                              ("bits_per_byte", 4)))]
            for f, r in formats.items()
        ]
        lines += [
            "the course model's block weights rounded to each format (fake quantization, fp32 "
            "arithmetic: quality only)",
            format_table(["format", "bits/weight", "relative RMS error", "bits/byte"], rows),
            "",
        ]
    kv = res["kv_cache"]
    nb, tps = kv["nbytes"], kv["tokens_per_s"]
    lines += [
        f"KV cache of the course model at its full context ({kv['context']} positions): fp32 "
        f"{nb['fp32'] / 2**20:.2f} MiB, int8 {nb['int8'] / 2**20:.2f} MiB ("
        f"{nb['int8'] / nb['fp32']:.0%}, formula {kv['formula_bytes']['int8']:,} B); decode "
        f"{tps['fp32']:.0f} vs {tps['int8']:.0f} tokens/s; int8 vs fp32 cache: top-1 agreement "
        f"{kv['greedy_top1']:.3f}, first divergence after {kv['first_divergence']:.1f} tokens",
        "",
    ]
    lines.append(
        "speedup: fp32's decode time over the format's, median of per-repeat ratios; predicted: "
        "the roofline's bytes ratio (weights + KV cache + activations per step). A shared "
        "machine is noisy."
    )
    return "\n".join(lines)


def _modern(quick: bool) -> tuple:
    """The modern checkpoint, measured beside the course model when it is there (not with
    --quick)."""
    from ar_lab.model.train.presets import checkpoint_path, load_pretrained

    if quick or not checkpoint_path("modern").exists():
        return ()
    return ((load_pretrained("modern", "cpu"), "modern model (data/modern.safetensors)"),)


def run(args: argparse.Namespace) -> dict:
    """The command: options checked first, then the measurements, then the report."""
    from ar_lab.model.gpt import GPTConfig
    from ar_lab.perf.measure import CONFIGS, build_model

    positive_int("tokens", args.tokens, 2)
    positive_int("repeats", args.repeats)
    if args.config != "none" and args.config not in CONFIGS:
        raise BadValue(
            f"--config must be one of {sorted(CONFIGS)} or none, got {args.config!r}", arg="config"
        )
    threads = torch.get_num_threads() if args.threads is None else args.threads
    tokens, repeats = (
        (QUICK["tokens"], QUICK["repeats"]) if args.quick else (args.tokens, args.repeats)
    )
    with torch_threads(threads):
        large = None
        if args.config != "none":
            cfg = (
                GPTConfig(block_size=128, n_layer=2, n_head=2, n_embd=64)
                if args.quick
                else CONFIGS[args.config]
            )
            large = build_model(cfg, "cpu", torch.float32)
        res = quant_benchmark(
            None,
            large,
            tokens=tokens,
            repeats=repeats,
            quick=args.quick,
            progress=lambda m: print("  " + m, flush=True),
            extra=_modern(args.quick),
        )
    print()
    print(format_quant_results(res))
    return res
