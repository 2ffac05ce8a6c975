"""Chapter 05's benchmark: prefill vs decode on a measured roofline.

The machine's two roofs (``ar_lab.perf.peaks``), prefill and decode points of a random-init
model (``ar_lab.perf.measure``) placed under them by the analytic FLOP/byte model
(``ar_lab.perf.roofline``), and the key figure: how close batch-1 decode comes to the
streaming bandwidth, each decode step timed right after one call of the streaming kernel.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

import torch

from ar_lab.base.args import positive_int
from ar_lab.base.errors import BadValue, named
from ar_lab.bench.common import checked_device, checked_threads
from ar_lab.bench.table import format_table

# Sweeps per device type: prompt lengths (prefill), batch sizes (decode at one
# context) and contexts (decode at batch 1). "quick" is a smoke test.
SWEEPS = {
    "cpu": {
        "config": "cpu",
        "prompt_lens": [16, 64, 256],
        "batches": [1, 4, 16, 64],
        "context": 128,
        "contexts": [64, 512, 1024],
    },
    "cuda": {
        "config": "gpu",
        "prompt_lens": [128, 512, 2048, 4096],
        "batches": [1, 8, 32, 128],
        "context": 512,
        "contexts": [512, 2048, 4096],
    },
    "quick": {
        "config": None,
        "prompt_lens": [8, 32],
        "batches": [1, 4],
        "context": 32,
        "contexts": [16],
    },
}


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument(
        "--config",
        choices=["small", "cpu", "gpu"],
        default=None,
        help="random-init model from ar_lab.perf.measure.CONFIGS (default: cpu on a CPU, gpu on "
        "CUDA)",
    )
    p.add_argument(
        "--prompt-lens", type=int, nargs="+", default=None, help="prefill prompt lengths"
    )
    p.add_argument(
        "--batches", type=int, nargs="+", default=None, help="decode batch sizes (at --context)"
    )
    p.add_argument("--context", type=int, default=None, help="context of the decode batch sweep")
    p.add_argument(
        "--contexts", type=int, nargs="+", default=None, help="decode contexts at batch 1"
    )
    p.add_argument(
        "--pairs",
        type=int,
        default=25,
        help="side-by-side (bandwidth kernel, decode step) pairs for the key figure",
    )
    p.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=None,
        help="CPU thread counts compared for the key figure (default: 1 and all); CUDA compares "
        "eager and graph",
    )
    p.add_argument(
        "--buffer-mb", type=int, default=None, help="streaming buffer (default: max(1 GiB, 4 x L3))"
    )
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per point (median kept)")
    p.add_argument(
        "--quick", action="store_true", help="tiny model and sizes: a smoke test, not a measurement"
    )


def _config(config: str | None, quick: bool):
    """The config of the sweep's random-init model: ``config`` from ``measure.CONFIGS``, or a tiny
    one when quick."""
    from ar_lab.model.gpt import GPTConfig
    from ar_lab.perf.measure import CONFIGS

    if config is None and quick:
        return GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=64)
    if config in CONFIGS:
        return CONFIGS[config]
    raise BadValue(f"config must be one of {sorted(CONFIGS)}, got {config!r}", arg="config")


def _check_sweep(
    cfg, sweep: dict, pairs: int, threads, buffer_mb: int | None, repeats: int
) -> None:
    """Every size against the model's window, every count >= 1: all before anything is built or
    measured."""
    from ar_lab.perf.roofline import decode_cost, prefill_cost

    for t in sweep["prompt_lens"]:  # each error names roofline_benchmark's argument
        named("prompt_lens", lambda t=t: prefill_cost(cfg, t))
    for b in sweep["batches"]:
        named("context", lambda: decode_cost(cfg, sweep["context"]))
        named("batches", lambda b=b: decode_cost(cfg, sweep["context"], b))
    for c in sweep["contexts"]:
        named("contexts", lambda c=c: decode_cost(cfg, c))
    positive_int("pairs", pairs)
    positive_int("repeats", repeats)
    if buffer_mb is not None:
        positive_int("buffer_mb", buffer_mb)
    if threads is not None:
        checked_threads(threads)


def _model(device: torch.device, cfg, say: Callable[[str], None]):
    """The random-init model of the sweep on ``device``, described through ``say``."""
    from ar_lab.base.timing import device_name
    from ar_lab.perf.measure import build_model
    from ar_lab.perf.peaks import cache_bytes, default_dtype

    dtype = default_dtype(device)
    say(
        f"roofline on {device_name(device)}, {str(dtype).removeprefix('torch.')}, torch "
        f"{torch.__version__}"
    )
    model = build_model(cfg, device, dtype)
    wbytes = sum(p.nbytes for p in model.parameters())
    say(
        f"model: {model.num_parameters() / 1e6:.1f} M parameters, {wbytes / 2**20:,.0f} MiB of "
        f"weights (largest CPU cache: {(cache_bytes() or 0) / 2**20:,.0f} MiB)"
    )
    return model


def roofline_benchmark(
    device: str | torch.device | None = None,
    *,
    config: str | None = None,
    prompt_lens: Sequence[int] | None = None,
    batches: Sequence[int] | None = None,
    context: int | None = None,
    contexts: Sequence[int] | None = None,
    pairs: int = 25,
    threads: Sequence[int] | None = None,
    buffer_mb: int | None = None,
    repeats: int = 3,
    quick: bool = False,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Peaks, prefill/decode points and the decode-bandwidth key figure (``measure.run_roofline``'s
    result with ``bandwidth_fraction`` and the key figure added).

    Sizes not given come from ``SWEEPS`` for the device type (``quick``: a tiny model and
    sizes, a smoke test). The sweep runs the way the key figure ran best (thread count on
    a CPU; CUDA graph or eager on a GPU).
    """
    from ar_lab.base.timing import default_device
    from ar_lab.perf.measure import run_roofline
    from ar_lab.perf.side_by_side import decode_bandwidth_fraction

    say = progress or (lambda _m: None)
    device = default_device() if device is None else checked_device(device)
    sweep = dict(SWEEPS["quick" if quick else device.type])
    given = {
        "prompt_lens": prompt_lens,
        "batches": batches,
        "context": context,
        "contexts": contexts,
    }
    sweep.update({k: v for k, v in given.items() if v is not None})
    cfg = _config(config if config is not None else sweep["config"], quick)
    _check_sweep(cfg, sweep, pairs, threads, buffer_mb, repeats)
    buffer = buffer_mb * 2**20 if buffer_mb else (2**24 if quick else None)
    model = _model(device, cfg, say)
    cores = torch.get_num_threads()
    key = decode_bandwidth_fraction(
        model,
        min(64, sweep["context"]),
        pairs=min(2, pairs) if quick else pairs,
        threads=threads,
        buffer_bytes=buffer,
        progress=say,
    )
    torch.set_num_threads(key["best_threads"])
    try:
        result = run_roofline(
            model,
            sweep["prompt_lens"],
            sweep["batches"],
            sweep["context"],
            sweep["contexts"],
            buffer_bytes=buffer,
            repeats=repeats,
            matmul_size=256 if quick else None,
            progress=say,
            cuda_graph=key["cuda_graph"],
        )
    finally:
        torch.set_num_threads(cores)
    _add_key_figure(result, key)
    return result


def _add_key_figure(result: dict, key: dict) -> None:
    """Put the decode-bandwidth key figure (``decode_bandwidth_fraction``'s ``key``) into the
    roofline ``result``; the sweep's own figure stays, renamed ``..._sweep``."""
    result["bandwidth_fraction"] = key
    k = result["key_figures"]
    k["decode_bandwidth_fraction_sweep"] = k.pop("decode_bandwidth_fraction", None)
    best = key["by_variant"][key["best"]]
    k.update(
        decode_bandwidth_fraction=key["fraction"],
        decode_bandwidth_fraction_pair_quartiles=[
            best["pair_quartiles"][0],
            best["pair_quartiles"][2],
        ],
        decode_bandwidth_fraction_of_roof=key["fraction_of_roof"],
        decode_variant=key["best"],
    )


def format_roofline_results(result: dict) -> str:
    """The printed report: the points against the roof, the peaks, and the key figure per
    variant."""
    from ar_lab.perf.measure import SUMMARY_HEADERS, summary_rows
    from ar_lab.perf.roofline import format_si

    peaks, key, k = result["peaks"], result["bandwidth_fraction"], result["key_figures"]
    kernels = ", ".join(
        f"{n} {format_si(v, 'B/s')}" for n, v in peaks["bandwidth_by_kernel"].items()
    )
    lines = [
        format_table(SUMMARY_HEADERS, summary_rows(result)),
        "",
        f"matmul peak      {format_si(peaks['matmul_flops_per_s'], 'FLOP/s')} ("
        f"{peaks['matmul_size']}^2 matmul)",
        f"bandwidth        {format_si(peaks['bandwidth_bytes_per_s'], 'B/s')} (best of {kernels}; "
        f"{peaks['bandwidth_buffer_bytes'] / 2**20:,.0f} MiB buffer)",
        f"ridge point      {result['ridge_point']:.1f} FLOP/byte",
        "",
        f"key figure: batch-1 decode at context {key['context']} ("
        f"{key['decode_bytes'] / 2**20:,.0f} MiB per step), each step timed right after one call "
        f"of the fastest streaming kernel ({key['kernel']}), "
        f"{len(next(iter(key['by_variant'].values()))['pairs'])} pairs",
    ]
    rows = [
        [
            name,
            f"{v['fraction']:.0%}",
            f"{v['pair_quartiles'][0]:.0%} .. {v['pair_quartiles'][2]:.0%}",
            f"{v['pair_range'][0]:.0%} .. {v['pair_range'][1]:.0%}",
            f"{v['of_roof']:.0%}",
        ]
        for name, v in key["by_variant"].items()
    ]
    lines.append(
        format_table(
            ["", "fraction", "pairs: middle half", "pairs: all", "vs the kernel's best call"], rows
        )
    )
    if "prefill_compute_fraction" in k:
        lines.append(
            f"largest prefill ({k['prefill_tokens']} tokens): {k['prefill_compute_fraction']:.0%}"
            " of the matmul peak"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    result = roofline_benchmark(
        args.device,
        config=args.config,
        prompt_lens=args.prompt_lens,
        batches=args.batches,
        context=args.context,
        contexts=args.contexts,
        pairs=args.pairs,
        threads=args.threads,
        buffer_mb=args.buffer_mb,
        repeats=args.repeats,
        quick=args.quick,
        progress=lambda m: print("  " + m, flush=True),
    )
    print()
    print(format_roofline_results(result))
    return result
