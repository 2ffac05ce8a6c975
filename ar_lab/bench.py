"""Benchmarks: ``python -m ar_lab.bench NAME``.

Each benchmark measures the things it compares side by side in one process, repeats
them, and prints medians with the *ratios* as the key figures: this machine (and a
learner's laptop) is shared and noisy, and a ratio measured in one run survives
that far better than an absolute time.

Benchmarks register themselves in ``BENCHMARKS`` (name -> (function, help)); each
function takes the parsed arguments and returns a dict of results (also written as
JSON with ``--json PATH``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch


def synchronize(device: torch.device | str | None = None) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_call(fn: Callable[[], object], repeats: int = 5, warmup: int = 1, device=None) -> list[float]:
    """Wall-clock seconds of ``fn()`` for each of ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def median(values: list[float]) -> float:
    return statistics.median(values)


def format_table(headers: list[str], rows: list[list[object]]) -> str:
    """A plain-text table with right-aligned columns."""
    cells = [[str(h) for h in headers]] + [[f"{v:,.3g}" if isinstance(v, float) else str(v) for v in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def machine_info() -> dict:
    import platform

    info = {"torch": torch.__version__, "threads": torch.get_num_threads(), "python": platform.python_version()}
    info["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return info


# name -> (function(args) -> dict, one-line help, function(parser) adding options)
BENCHMARKS: dict[str, tuple[Callable, str, Callable[[argparse.ArgumentParser], None]]] = {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ar_lab.bench", description="Side-by-side benchmarks.")
    sub = parser.add_subparsers(dest="name", required=True)
    for name, (_, help_text, add_options) in BENCHMARKS.items():
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
        add_options(p)
    args = parser.parse_args(argv)
    fn = BENCHMARKS[args.name][0]
    results = fn(args)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
        print(f"results written to {args.json}")
    return 0


# --- benchmarks (each section owned by its chapter) ------------------------------

# --- chapter 06: sampler step vs decode step -----------------------------------------


def _sampler_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--context", type=int, default=128, help="tokens already in the KV cache (default 128)")
    p.add_argument("--rounds", type=int, default=30, help="interleaved timing rounds; medians are reported")
    p.add_argument("--calls", type=int, default=20, help="calls per round, averaged (default 20)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1, as batch-1 decode)")


def sampler_benchmark(model=None, context: int = 128, rounds: int = 30, calls: int = 20) -> dict:
    """Batch-1: one cached decode step against one sampler step on its logits, interleaved.

    The key figure is sampler time / decode time: a sampler must not show in decode time.
    """
    from ar_lab.cache import KVCache
    from ar_lab.sampling import GREEDY, SamplingParams, sample

    source = "given"
    if model is None:
        from ar_lab.model import GPT, GPTConfig
        from ar_lab.train import checkpoint_path, load_checkpoint

        if checkpoint_path("course").exists():
            model, source = load_checkpoint(checkpoint_path("course"), "cpu"), "data/course.safetensors"
        else:
            torch.manual_seed(0)
            model, source = GPT(GPTConfig()).eval(), "random init (course checkpoint missing)"
    device = model.device
    gen = torch.Generator(device=device).manual_seed(0)
    history = torch.randint(0, model.config.vocab_size, (context,), generator=gen, device=device)
    cache = KVCache.for_model(model, max_len=context + 1)
    step_in = history[-1:].view(1, 1)
    with torch.inference_mode():
        model(history[None, :context], cache)  # prefill: the cache now holds `context` positions

        def decode_step():
            cache.truncate(context)  # every timed step decodes position `context` again
            return model(step_in, cache)[0, -1]

        logits = decode_step()
    hist = history.tolist()
    samplers = {
        "greedy": (GREEDY, ()),
        "T=1 (pure sampling)": (SamplingParams(), ()),
        "T=0.8, top-k 40": (SamplingParams(temperature=0.8, top_k=40), ()),
        "T=0.8, top-p 0.9": (SamplingParams(temperature=0.8, top_p=0.9), ()),
        "T=0.8, min-p 0.05": (SamplingParams(temperature=0.8, min_p=0.05), ()),
        "all + repetition penalty 1.2": (
            SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.2),
            hist,
        ),
    }
    times: dict[str, list[float]] = {"decode step": [], **{k: [] for k in samplers}}
    with torch.inference_mode():
        for _ in range(rounds):  # interleaved, so load changes hit every column alike
            times["decode step"].append(median(time_call(decode_step, repeats=calls, warmup=1, device=device)))
            for name, (params, h) in samplers.items():
                fn = lambda params=params, h=h: int(sample(logits, params, gen, h))  # int(): waits for the device
                times[name].append(median(time_call(fn, repeats=calls, warmup=1)))
    decode = median(times["decode step"])
    rows, out = [["decode step (cached, batch 1)", f"{decode * 1e6:,.1f}", "1"]], {}
    for name in samplers:
        t = median(times[name])
        rows.append([f"sampler: {name}", f"{t * 1e6:,.1f}", f"{t / decode:.3f}"])
        out[name] = {"seconds": t, "ratio_to_decode_step": t / decode}
    print(f"model: {source}; {model.num_parameters():,} parameters; context {context}; {machine_info()}")
    print(format_table(["step", "median µs", "x decode step"], rows))
    return {"model": source, "context": context, "decode_step_seconds": decode, "samplers": out, **machine_info()}


def sampler_bench(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    return sampler_benchmark(context=args.context, rounds=args.rounds, calls=args.calls)


BENCHMARKS["sampler"] = (sampler_bench, "batch-1 sampler step vs cached decode step (chapter 06)", _sampler_options)


if __name__ == "__main__":
    sys.exit(main())
