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


def weights_only_pass(model, steps: int) -> None:
    """Apply every weight matrix of ``model`` to one vector, ``steps`` times, and nothing else.

    The floor under any batch-1 decoder of the model (no attention, no LayerNorm, no sampling,
    no Python around it): time it to see what a decode step adds on top. Matrix-vector
    products, the fastest kernel for one vector (the one ``ar_lab.lean`` uses).
    """
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    vectors = [torch.randn(m.in_features, device=m.weight.device, dtype=m.weight.dtype) for m in linears]
    with torch.inference_mode():
        for _ in range(steps):
            for m, x in zip(linears, vectors, strict=True):
                torch.mv(m.weight, x)
    synchronize(vectors[0].device)


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
    try:
        results = fn(args)
    except (ValueError, FileNotFoundError) as e:  # bad options or a missing checkpoint: say so, no traceback
        parser.error(f"{args.name}: {e}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
        print(f"results written to {args.json}")
    return 0


# --- benchmarks (each section owned by its chapter) ------------------------------

# --- chapter 04: decode (KV cache vs recomputation; ar_lab vs transformers) ---------


def _decode_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=1000, help="new tokens per generation (default 1000)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats of each run; medians are reported")
    p.add_argument(
        "--uncached-repeats", type=int, default=None, help="repeats of the slow uncached run (default: --repeats)"
    )
    p.add_argument("--prompt", default="Python ", help="prompt text (default 'Python ')")
    p.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=None,
        help="torch CPU thread counts, each measured in turn (default: 1, then torch's default, all cores). "
        "Batch-1 decode of a 3.5 M-parameter model is a chain of small kernels: one thread is the steady "
        "figure on a shared machine; more threads split each weight read across cores",
    )
    p.add_argument("--no-peer", action="store_true", help="skip the transformers reference peer")


def _course_model_or_random():
    """The course checkpoint on CPU, or GPTConfig() with seeded random weights while it is missing.

    Decode timing depends on the shapes, not on what the weights learned.
    """
    from ar_lab.model import GPT, GPTConfig
    from ar_lab.train import checkpoint_path, load_checkpoint

    path = checkpoint_path("course")
    if path.exists():
        return load_checkpoint(path, "cpu"), str(path.name)
    torch.manual_seed(0)
    return GPT(GPTConfig()).eval(), "random init (data/course.safetensors not found)"


def decode_benchmark(
    model=None,
    tokens: int = 1000,
    repeats: int = 3,
    uncached_repeats: int | None = None,
    prompt: str = "Python ",
    threads: int | None = 1,
    peer: bool = True,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Batch-1 greedy decode of ``tokens`` new tokens: ar_lab cached, ar_lab uncached and
    transformers' ``generate`` (same weights, its own KV cache), measured side by side.

    Runs are interleaved within each repeat so a load change on the machine hits all of
    them alike; wall-clock and process CPU seconds are both kept. The transformers run
    must produce exactly ar_lab's tokens (``AssertionError`` otherwise).
    """
    from ar_lab.generate import generate
    from ar_lab.tokenizer import EOS_ID, encode

    if not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens must be an int >= 1, got {tokens!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    uncached_repeats = repeats if uncached_repeats is None else uncached_repeats
    if not isinstance(uncached_repeats, int) or uncached_repeats < 0:
        raise ValueError(f"uncached_repeats must be an int >= 0, got {uncached_repeats!r}")
    say = progress or (lambda _m: None)
    source = "given"
    if model is None:
        model, source = _course_model_or_random()
    model = model.eval()
    prompt_ids = encode(prompt)
    P, N = len(prompt_ids), tokens
    if P + N - 1 > model.config.block_size:
        raise ValueError(
            f"a {P}-token prompt plus {N} new tokens needs {P + N - 1} positions, more than the context "
            f"window of {model.config.block_size}; ask for at most {model.config.block_size - P + 1} tokens"
        )
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)

    def ours(use_cache: bool, n: int = N, lean: bool = True):
        return generate(model, prompt_ids, n, use_cache=use_cache, eos_id=None, lean=lean)

    hf, ids = None, torch.tensor([prompt_ids])
    if peer:
        from ar_lab.reference import to_hf_gpt2

        hf = to_hf_gpt2(model)
        try:
            from transformers.utils import logging as hf_logging

            hf_logging.set_verbosity_error()
        except ImportError:  # pragma: no cover - logging moved
            pass

    def theirs(n: int = N) -> list[int]:
        with torch.inference_mode():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                do_sample=False,
                eos_token_id=None,  # never stop early: exactly n tokens, like eos_id=None for ours
                pad_token_id=EOS_ID,
            )
        return out[0, P:].tolist()

    # The floor under any batch-1 decoder of this model; both peers pay it, what they add on top
    # is their own overhead.
    def weights_only() -> None:
        weights_only_pass(model, N)

    def timed(fn):
        w0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        return out, time.perf_counter() - w0, time.process_time() - c0

    runs = {"ar_lab cached": {}, "ar_lab cached, forward()": {}, "ar_lab uncached": {}}
    if peer:
        runs["transformers generate"] = {}
    runs["weights only (floor)"] = {}
    for run in runs.values():
        run.update(seconds=[], cpu_seconds=[])
    try:
        say("warm-up")
        ours(True, min(N, 16)), ours(True, min(N, 16), lean=False), ours(False, min(N, 16))
        if peer:
            theirs(min(N, 16))
        reference = None
        for r in range(max(repeats, uncached_repeats)):
            plan = [("ar_lab cached", lambda: ours(True))] if r < repeats else []
            if r < repeats:
                plan.append(("ar_lab cached, forward()", lambda: ours(True, lean=False)))
            if peer and r < repeats:
                plan.append(("transformers generate", theirs))
            if r < repeats:
                plan.append(("weights only (floor)", weights_only))
            if r < uncached_repeats:
                plan.append(("ar_lab uncached", lambda: ours(False)))
            for name, fn in plan:
                say(f"repeat {r + 1}: {name}")
                out, wall, cpu = timed(fn)
                if out is None:  # the floor produces no tokens
                    runs[name]["seconds"].append(wall)
                    runs[name]["cpu_seconds"].append(cpu)
                    continue
                got = out if isinstance(out, list) else out.tokens
                if not isinstance(out, list):
                    runs[name]["positions"] = out.stats.positions_processed
                    runs[name]["forward_calls"] = out.stats.forward_calls
                if reference is None:
                    reference = got
                elif got != reference:
                    first = next(i for i, (a, b) in enumerate(zip(got, reference, strict=False)) if a != b)
                    raise AssertionError(f"{name} produced different tokens (first difference at new token {first})")
                runs[name]["seconds"].append(wall)
                runs[name]["cpu_seconds"].append(cpu)
    finally:
        torch.set_num_threads(old_threads)
    if peer:  # transformers' cache also feeds the prompt once, then one token per step
        runs["transformers generate"]["positions"] = P + N - 1
    for run in runs.values():
        if run["seconds"]:
            run["median_s"] = median(run["seconds"])
            run["median_cpu_s"] = median(run["cpu_seconds"])
            run["tokens_per_s"] = N / run["median_s"]
    runs = {k: v for k, v in runs.items() if v["seconds"]}

    def speedup(a: str, b: str, key: str = "median_s") -> float | None:
        return runs[b][key] / runs[a][key] if a in runs and b in runs else None

    ratios = {
        "cached_vs_uncached": speedup("ar_lab cached", "ar_lab uncached"),
        "cached_vs_uncached_cpu": speedup("ar_lab cached", "ar_lab uncached", "median_cpu_s"),
        "ar_lab_vs_transformers": speedup("ar_lab cached", "transformers generate"),
        "ar_lab_vs_transformers_cpu": speedup("ar_lab cached", "transformers generate", "median_cpu_s"),
        "lean_vs_forward": speedup("ar_lab cached", "ar_lab cached, forward()"),
    }
    if "ar_lab uncached" in runs:
        positions = runs["ar_lab uncached"]["positions"] / runs["ar_lab cached"]["positions"]
        ratios["positions_uncached_vs_cached"] = positions
    # Time per token above the floor: what each implementation adds to the unavoidable weight reads.
    floor = runs.get("weights only (floor)")
    if floor is not None:
        ratios["floor_ms_per_token"] = 1000 * floor["median_s"] / N
        over = {k: 1000 * (runs[k]["median_s"] - floor["median_s"]) / N for k in runs if k != "weights only (floor)"}
        ratios["overhead_ms_per_token"] = over
        if "transformers generate" in over and over["ar_lab cached"] > 0:
            ratios["overhead_transformers_vs_ar_lab"] = over["transformers generate"] / over["ar_lab cached"]
    return {
        "benchmark": "decode",
        "model": {"source": source, "parameters": model.num_parameters(), **model.config.to_dict()},
        "prompt_tokens": P,
        "new_tokens": N,
        "repeats": repeats,
        "uncached_repeats": uncached_repeats,
        "threads": threads if threads is not None else old_threads,
        "machine": machine_info(),
        "runs": runs,
        "ratios": ratios,
        "tokens_identical": True,  # asserted above for every run
        "target_ar_lab_vs_transformers": 3.0,
    }


def format_decode_results(res: dict) -> str:
    """The printed table: medians per run, then the key ratios."""
    N = res["new_tokens"]
    rows = []
    for name, run in res["runs"].items():
        rows.append(
            [
                name,
                f"{run['positions']:,}" if "positions" in run else "-",
                f"{run['median_s']:.3f}",
                f"{run['median_cpu_s']:.3f}",
                f"{run['tokens_per_s']:,.0f}",
                f"{1000 * run['median_s'] / N:.2f}",
                f"{len(run['seconds'])}",
            ]
        )
    headers = ["run", "positions", "median s", "median CPU s", "tokens/s", "ms/token", "repeats"]
    r = res["ratios"]
    lines = [
        f"decode: batch 1, greedy, {res['prompt_tokens']}-token prompt + {N:,} new tokens; "
        f"model {res['model']['source']} ({res['model']['parameters'] / 1e6:.2f} M parameters); "
        f"{res['threads']} thread(s); torch {res['machine']['torch']} on {res['machine']['device']}",
        "",
        format_table(headers, rows),
        "",
    ]
    if r["cached_vs_uncached"] is not None:
        lines.append(
            f"KV cache: {r['cached_vs_uncached']:.1f}x faster than recomputing "
            f"(CPU time {r['cached_vs_uncached_cpu']:.1f}x) "
            f"while processing {r['positions_uncached_vs_cached']:.0f}x fewer positions"
        )
    if r["ar_lab_vs_transformers"] is not None:
        target = res["target_ar_lab_vs_transformers"]
        verdict = "met" if r["ar_lab_vs_transformers"] >= target else "NOT met"
        lines.append(
            f"ar_lab vs transformers generate: {r['ar_lab_vs_transformers']:.2f}x the tokens/s "
            f"(CPU time {r['ar_lab_vs_transformers_cpu']:.2f}x); identical tokens; target {target:.0f}x {verdict}"
        )
    if r.get("lean_vs_forward") is not None:
        lines.append(
            f"lean decode step (ar_lab.lean) vs the same steps through GPT.forward(): "
            f"{r['lean_vs_forward']:.2f}x the tokens/s"
        )
    if "overhead_transformers_vs_ar_lab" in r:
        over = r["overhead_ms_per_token"]
        lines.append(
            f"above the weights-only floor ({r['floor_ms_per_token']:.2f} ms/token, paid by both): ar_lab adds "
            f"{over['ar_lab cached']:.2f} ms/token, transformers {over['transformers generate']:.2f} "
            f"({r['overhead_transformers_vs_ar_lab']:.1f}x)"
        )
    return "\n".join(lines)


def decode_bench(args: argparse.Namespace) -> dict:
    from ar_lab.reference import have_transformers

    peer = not args.no_peer
    if peer and not have_transformers():
        print("transformers is not installed: skipping the reference peer (pip install transformers)")
        peer = False
    threads = args.threads or list(dict.fromkeys([1, torch.get_num_threads()]))
    if any(t < 1 for t in threads):
        raise SystemExit(f"--threads must be positive, got {threads}")
    results = []
    for i, t in enumerate(threads):
        print(f"{t} thread(s):")
        res = decode_benchmark(
            tokens=args.tokens,
            repeats=args.repeats,
            uncached_repeats=args.uncached_repeats if i == 0 else 0,  # the slow run once is enough
            prompt=args.prompt,
            threads=t,
            peer=peer,
            progress=lambda m: print("  " + m, flush=True),
        )
        results.append(res)
    for res in results:
        print()
        print(format_decode_results(res))
    if len(results) == 1:
        return results[0]
    return {"benchmark": "decode", "settings": results}


BENCHMARKS["decode"] = (
    decode_bench,
    "KV cache vs recomputation, and ar_lab vs transformers generate (chapter 04)",
    _decode_options,
)

# --- chapter 05: roofline ------------------------------------------------------------

# Sweeps per device type: prompt lengths (prefill), batch sizes (decode at one
# context) and contexts (decode at batch 1). "quick" is a smoke test.
_ROOFLINE_SWEEPS = {
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
    "quick": {"config": None, "prompt_lens": [8, 32], "batches": [1, 4], "context": 32, "contexts": [16]},
}


def _roofline_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument(
        "--config",
        choices=["small", "cpu", "gpu"],
        default=None,
        help="random-init model from ar_lab.roofline.CONFIGS (default: cpu on a CPU, gpu on CUDA)",
    )
    p.add_argument("--prompt-lens", type=int, nargs="+", default=None, help="prefill prompt lengths")
    p.add_argument("--batches", type=int, nargs="+", default=None, help="decode batch sizes (at --context)")
    p.add_argument("--context", type=int, default=None, help="context of the decode batch sweep")
    p.add_argument("--contexts", type=int, nargs="+", default=None, help="decode contexts at batch 1")
    p.add_argument(
        "--pairs", type=int, default=25, help="side-by-side (bandwidth kernel, decode step) pairs for the key figure"
    )
    p.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=None,
        help="CPU thread counts compared for the key figure (default: 1 and all); CUDA compares eager and graph",
    )
    p.add_argument("--buffer-mb", type=int, default=None, help="streaming buffer (default: max(1 GiB, 4 x L3))")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per point (median kept)")
    p.add_argument("--quick", action="store_true", help="tiny model and sizes: a smoke test, not a measurement")


def roofline_bench(args: argparse.Namespace) -> dict:
    """Peaks, prefill/decode points and the decode-bandwidth key figure; see ar_lab.roofline."""
    from ar_lab import roofline as rl
    from ar_lab.model import GPTConfig

    device = torch.device(args.device) if args.device else rl.default_device()
    sweep = dict(_ROOFLINE_SWEEPS["quick" if args.quick else device.type])
    for key, value in [
        ("prompt_lens", args.prompt_lens),
        ("batches", args.batches),
        ("context", args.context),
        ("contexts", args.contexts),
        ("config", args.config),
    ]:
        if value is not None:
            sweep[key] = value
    if args.quick and args.config is None:
        cfg = GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=64)
    else:
        cfg = rl.CONFIGS[sweep["config"]]
    buffer = args.buffer_mb * 2**20 if args.buffer_mb else (2**24 if args.quick else None)
    dtype = rl.default_dtype(device)
    print(f"roofline on {rl.device_name(device)}, {str(dtype).removeprefix('torch.')}, torch {torch.__version__}")
    model = rl.build_model(cfg, device, dtype)
    wbytes = sum(p.nbytes for p in model.parameters())
    print(
        f"model: {model.num_parameters() / 1e6:.1f} M parameters, {wbytes / 2**20:,.0f} MiB of weights "
        f"(largest CPU cache: {(rl.cache_bytes() or 0) / 2**20:,.0f} MiB)"
    )
    cores = torch.get_num_threads()
    key = rl.decode_bandwidth_fraction(
        model,
        min(64, sweep["context"]),
        2 if args.quick else args.pairs,
        args.threads,
        buffer,
        progress=lambda m: print("  " + m, flush=True),
    )
    # The sweep runs the way the key figure ran best (thread count; CUDA graph or eager).
    torch.set_num_threads(key["best_threads"])
    try:
        result = rl.run_roofline(
            model,
            sweep["prompt_lens"],
            sweep["batches"],
            sweep["context"],
            sweep["contexts"],
            buffer_bytes=buffer,
            repeats=args.repeats,
            matmul_size=256 if args.quick else None,
            progress=lambda m: print("  " + m, flush=True),
            cuda_graph=key["cuda_graph"],
        )
    finally:
        torch.set_num_threads(cores)
    result["command"] = "python -m ar_lab.bench roofline " + " ".join(sys.argv[2:] if len(sys.argv) > 2 else [])
    result["bandwidth_fraction"] = key
    k = result["key_figures"]
    k["decode_bandwidth_fraction_sweep"] = k.pop("decode_bandwidth_fraction", None)
    best = key["by_variant"][key["best"]]
    k.update(
        decode_bandwidth_fraction=key["fraction"],
        decode_bandwidth_fraction_pair_quartiles=[best["pair_quartiles"][0], best["pair_quartiles"][2]],
        decode_bandwidth_fraction_of_roof=key["fraction_of_roof"],
        decode_variant=key["best"],
    )

    from ar_lab.roofline import SUMMARY_HEADERS, format_si, summary_rows

    peaks = result["peaks"]
    print()
    print(format_table(SUMMARY_HEADERS, summary_rows(result)))
    print()
    print(f"matmul peak      {format_si(peaks['matmul_flops_per_s'], 'FLOP/s')} ({peaks['matmul_size']}^2 matmul)")
    print(
        f"bandwidth        {format_si(peaks['bandwidth_bytes_per_s'], 'B/s')} (best of "
        + ", ".join(f"{n} {format_si(v, 'B/s')}" for n, v in peaks["bandwidth_by_kernel"].items())
        + f"; {peaks['bandwidth_buffer_bytes'] / 2**20:,.0f} MiB buffer)"
    )
    print(f"ridge point      {result['ridge_point']:.1f} FLOP/byte")
    print()
    print(
        f"key figure: batch-1 decode at context {key['context']} ({key['decode_bytes'] / 2**20:,.0f} MiB per step), "
        f"each step timed right after one call of the fastest streaming kernel ({key['kernel']}), "
        f"{len(next(iter(key['by_variant'].values()))['pairs'])} pairs"
    )
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
    print(format_table(["", "fraction", "pairs: middle half", "pairs: all", "vs the kernel's best call"], rows))
    if "prefill_compute_fraction" in k:
        print(f"largest prefill ({k['prefill_tokens']} tokens): {k['prefill_compute_fraction']:.0%} of the matmul peak")
    return result


BENCHMARKS["roofline"] = (roofline_bench, "prefill vs decode on a measured roofline (chapter 05)", _roofline_options)

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
    from ar_lab.lean import engine_for
    from ar_lab.model import GPT
    from ar_lab.sampling import GREEDY, SamplingParams, sample

    source = "the model passed in"
    if model is None:
        from ar_lab.model import GPTConfig
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

        # The decode step ar_lab.generate runs: the lean one for a GPT (ar_lab.lean), else forward().
        engine = engine_for(model)
        token = int(step_in)

        def decode_step():
            cache.truncate(context)  # every timed step decodes position `context` again
            return engine.step(token, cache) if engine is not None else model(step_in, cache)[0, -1]

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

# --- chapter 07: speculative decoding ------------------------------------------------


def _speculative_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=200, help="new tokens per prompt (default 200)")
    p.add_argument("--prompts", type=int, default=3, help="prompts from the validation text (default 3)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="tokens per prompt (default 32)")
    p.add_argument("--gammas", type=int, nargs="+", default=list(range(1, 9)), help="gamma values (default 1..8)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved timing repeats; the fastest run of each counts")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1, as batch-1 decode)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled runs (default 0)")
    p.add_argument(
        "--device",
        default="cpu",
        help="device for both checkpoints (default cpu; cuda where a GPU is present: there a verify pass "
        "of a few positions costs about one decode step, the regime the theory assumes)",
    )


def _bench_device(device) -> torch.device:
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be like 'cpu' or 'cuda', got {device!r} ({e})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but torch sees no CUDA GPU here: use --device cpu")
    return device


def speculative_benchmark(
    target=None,
    draft=None,
    tokens: int = 200,
    prompts: int = 3,
    prompt_tokens: int = 32,
    gammas: list[int] | None = None,
    repeats: int = 3,
    seed: int = 0,
    modes: dict | None = None,
    progress: Callable[[str], None] | None = None,
    device: str | torch.device = "cpu",
) -> dict:
    """Plain cached decoding of the target against speculative decoding with the draft, side by side.

    For each sampler mode (greedy and T = 1 by default), each repeat, prompt and gamma,
    the prompt is decoded plainly (``ar_lab.generate``) and at once speculatively, both
    with ``tokens`` new tokens (no EOS stop, so the work compares). The key figure per gamma
    is the wall-clock speedup (plain time / speculative time, each the fastest of its
    ``repeats`` runs, summed over the prompts), next to
    the theory's prediction (Leviathan et al., 2023) from the measured acceptance rate alpha
    and the measured cost ratio c = one draft step / one target step, both measured in the
    same runs: the draft's mean time per forward pass (its sampling included) inside the
    speculative runs, over the plain run's time per token. Greedy runs must reproduce the
    plain tokens exactly.
    """
    from ar_lab.generate import generate
    from ar_lab.sampling import GREEDY, SamplingParams
    from ar_lab.speculative import (
        alpha_for_speedup,
        benchmark_prompts,
        best_gamma,
        expected_speedup,
        expected_tokens_per_iteration,
        speculative_generate,
        steady_clock,
    )
    from ar_lab.train import checkpoint_path, load_checkpoint

    say = progress or (lambda _m: None)
    gammas = list(range(1, 9)) if gammas is None else list(gammas)
    if not gammas or any(not isinstance(g, int) or g < 1 for g in gammas):
        raise ValueError(f"gammas must be ints >= 1, got {gammas!r}")
    sizes = {"tokens": tokens, "prompts": prompts, "prompt_tokens": prompt_tokens, "repeats": repeats}
    for name, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    device = _bench_device(device)  # for the checkpoints; models passed in stay where they are
    sources = {}
    for role, model in [("target", target), ("draft", draft)]:
        sources[role] = "given"
        if model is None:
            name = "course" if role == "target" else "draft"
            path = checkpoint_path(name)
            if not path.exists():
                raise FileNotFoundError(f"{path} is missing; run `make checkpoints` (or pass the models)")
            model, sources[role] = load_checkpoint(path, device), f"data/{path.name}"
        if role == "target":
            target = model.eval()
        else:
            draft = model.eval()
    modes = {"greedy": GREEDY, "T=1": SamplingParams(temperature=1.0)} if modes is None else modes

    prompt_ids = benchmark_prompts(prompts, prompt_tokens)

    def gen(s):
        return torch.Generator(target.device).manual_seed(s)

    # CPU time of this process on a one-thread CPU run (other processes on a shared machine
    # cannot inflate it), else the wall clock; both runs of a pair are timed the same way.
    clock = steady_clock(target.device)

    def timed(fn, *args, **kwargs):
        t0 = clock()
        out = fn(*args, **kwargs)
        synchronize(target.device)
        return clock() - t0, out

    # For reference: one plain decode step of the draft / one of the target, side by side.
    say("plain decoding of each model")
    step_times = {"target": [], "draft": []}
    for r in range(repeats + 1):
        for role, model in [("target", target), ("draft", draft)]:
            seconds, _ = timed(generate, model, prompt_ids[0], tokens, eos_id=None)
            if r:  # the first round warms up
                step_times[role].append(seconds / tokens)
    target_step, draft_step = min(step_times["target"]), min(step_times["draft"])
    c = draft_step / target_step

    results = {}
    for mode, params in modes.items():
        say(f"{mode}: warm-up")
        generate(target, prompt_ids[0], 8, sampling=params, generator=gen(seed), eos_id=None)
        speculative_generate(target, draft, prompt_ids[0], 8, max(gammas), params, gen(seed), eos_id=None)
        # Every speculative run is paired with a plain run just before it, and each keeps its
        # fastest repeat: load from other processes only ever adds time, so the minimum is the
        # cleanest estimate of the work itself. Runs with the same seed repeat the same tokens.
        plain_best = [float("inf")] * len(prompt_ids)
        fastest: dict[tuple[int, int], tuple[float, object]] = {}
        for r in range(repeats):
            say(f"{mode}: repeat {r + 1}/{repeats}")
            for k, prompt in enumerate(prompt_ids):
                for g in gammas:
                    t_plain, plain = timed(
                        generate, target, prompt, tokens, sampling=params, generator=gen(seed + k), eos_id=None
                    )
                    t_spec, out = timed(
                        speculative_generate, target, draft, prompt, tokens, g, params, gen(seed + k), None, clock
                    )
                    if params.greedy and out.tokens != plain.tokens:
                        raise AssertionError(f"greedy speculative decoding (gamma {g}) differs from plain decoding")
                    plain_best[k] = min(plain_best[k], t_plain)
                    if (k, g) not in fastest or t_spec < fastest[k, g][0]:
                        fastest[k, g] = (t_spec, out.stats)
        plain_s = sum(plain_best)
        # One target step: plain decoding's time per token. One draft step: the draft's mean
        # forward pass (with its pick) inside the speculative runs. c is their ratio.
        plain_step = plain_s / (tokens * len(prompt_ids))
        all_runs = [s for _, s in fastest.values()]
        draft_in_runs = sum(s.draft_time for s in all_runs) / sum(s.draft_calls for s in all_runs)
        c_mode = draft_in_runs / plain_step
        rows = {}
        for g in gammas:
            runs = [fastest[k, g][1] for k in range(len(prompt_ids))]
            tested = sum(s.tested for s in runs)
            alpha = sum(s.acceptances for s in runs) / tested if tested else 0.0
            calls = sum(s.target_calls for s in runs)
            spec_s = sum(fastest[k, g][0] for k in range(len(prompt_ids)))
            measured = plain_s / spec_s
            predicted = expected_speedup(alpha, g, c_mode)
            # the target's side of an iteration (verify pass + picks) / one plain decode step
            verify = sum(s.target_time for s in runs) / calls / plain_step
            rows[g] = {
                "alpha": alpha,
                "tokens_per_target_call": sum(s.produced for s in runs) / calls,
                "expected_tokens_per_iteration": expected_tokens_per_iteration(alpha, g),
                "verify_cost": verify,
                "speedup": measured,
                "predicted_speedup": predicted,
                "measured_over_predicted": measured / predicted,
                # the same formula with the measured verify cost in place of one target step
                "predicted_verify_measured": expected_tokens_per_iteration(alpha, g) / (g * c_mode + verify),
                "spec_s": spec_s,
            }
        best = max(gammas, key=lambda g: rows[g]["speedup"])
        # The acceptance rate a draft of this cost would need for 1.5x, with the verify costs measured here.
        needs = {g: alpha_for_speedup(1.5, g, c_mode, rows[g]["verify_cost"]) for g in gammas}
        needs = {g: a for g, a in needs.items() if a is not None}
        need_g = min(needs, key=needs.get) if needs else None
        results[mode] = {
            "plain_s": plain_s,
            "plain_step_s": plain_step,
            "draft_step_s": draft_in_runs,
            "cost_ratio_c": c_mode,
            "gammas": rows,
            "best_gamma_measured": best,
            "best_gamma_theory": best_gamma(rows[best]["alpha"], c_mode, max(gammas)),
            "alpha_needed_for_1.5x": None if need_g is None else {"alpha": needs[need_g], "gamma": need_g},
        }
    greedy_best = results.get("greedy", {}).get("best_gamma_measured")
    out = {
        "benchmark": "speculative",
        "target": {"source": sources["target"], "parameters": target.num_parameters()},
        "draft": {"source": sources["draft"], "parameters": draft.num_parameters()},
        "prompts": len(prompt_ids),
        "prompt_tokens": [len(p) for p in prompt_ids],
        "new_tokens": tokens,
        "repeats": repeats,
        "machine": machine_info(),
        "clock": "process CPU time" if clock is not time.perf_counter else "wall clock",
        "target_step_s": target_step,
        "draft_step_s": draft_step,
        "plain_step_ratio": c,
        "modes": results,
        "targets": {"greedy_speedup_at_best_gamma": 1.5, "within_of_prediction": 0.15},
    }
    if greedy_best is not None:
        row = results["greedy"]["gammas"][greedy_best]
        out["greedy_best"] = {
            "gamma": greedy_best,
            "speedup": row["speedup"],
            "predicted": row["predicted_speedup"],
            "predicted_verify_measured": row["predicted_verify_measured"],
            "speedup_target_met": row["speedup"] >= 1.5,
            "prediction_target_met": abs(row["measured_over_predicted"] - 1) <= 0.15,
            "prediction_verify_measured_met": abs(row["speedup"] / row["predicted_verify_measured"] - 1) <= 0.15,
        }
    return out


def format_speculative_results(res: dict) -> str:
    lines = [
        f"speculative decoding: target {res['target']['source']} ({res['target']['parameters'] / 1e6:.2f} M), "
        f"draft {res['draft']['source']} ({res['draft']['parameters'] / 1e6:.2f} M); "
        f"{res['prompts']} prompts x {res['new_tokens']} new tokens, {res['repeats']} repeats; "
        f"{res['machine']['threads']} thread(s), torch {res['machine']['torch']} on {res['machine']['device']}; "
        f"timed in {res['clock']}, fastest of the repeats",
        f"plain greedy decode step: target {1e3 * res['target_step_s']:.2f} ms, "
        f"draft {1e3 * res['draft_step_s']:.2f} ms "
        f"(ratio {res['plain_step_ratio']:.3f})",
    ]
    for mode, r in res["modes"].items():
        lines.append(
            f"{mode}: plain {1e3 * r['plain_step_s']:.2f} ms/token; draft step in the speculative runs "
            f"{1e3 * r['draft_step_s']:.3f} ms -> c = {r['cost_ratio_c']:.3f}"
        )
    headers = ["mode", "γ", "α", "tokens/call", "theory", "verify", "speedup", "predicted", "meas/pred", "pred (v)"]
    rows = []
    for mode, r in res["modes"].items():
        for g, row in r["gammas"].items():
            rows.append(
                [
                    mode,
                    g,
                    f"{row['alpha']:.3f}",
                    f"{row['tokens_per_target_call']:.2f}",
                    f"{row['expected_tokens_per_iteration']:.2f}",
                    f"{row['verify_cost']:.2f}",
                    f"{row['speedup']:.2f}x",
                    f"{row['predicted_speedup']:.2f}x",
                    f"{row['measured_over_predicted']:.2f}",
                    f"{row['predicted_verify_measured']:.2f}x",
                ]
            )
    lines += ["", format_table(headers, rows), ""]
    lines.append(
        "tokens/call: measured tokens per target forward pass; theory: (1 - α^(γ+1)) / (1 - α); verify: the "
        "target's side of an iteration / one plain step (the theory assumes 1); predicted: "
        "(1 - α^(γ+1)) / ((1 - α)(γc + 1)); pred (v): the same with the measured verify cost v in place of 1"
    )
    for mode, r in res["modes"].items():
        g = r["best_gamma_measured"]
        row = r["gammas"][g]
        lines.append(
            f"{mode}: best measured γ = {g} ({row['speedup']:.2f}x, predicted {row['predicted_speedup']:.2f}x); "
            f"theory's best γ for its α and c: {r['best_gamma_theory']}"
        )
        need = r["alpha_needed_for_1.5x"]
        if need is not None:
            lines.append(
                f"{mode}: 1.5x at this c and these verify costs needs α >= {need['alpha']:.2f} "
                f"(at γ = {need['gamma']}); measured α there: {r['gammas'][need['gamma']]['alpha']:.2f}"
            )
    if "greedy_best" in res:
        b = res["greedy_best"]
        ok = {True: "met", False: "NOT met"}
        lines.append(
            f"targets (greedy, best γ = {b['gamma']}): speedup >= 1.5x {ok[b['speedup_target_met']]} "
            f"({b['speedup']:.2f}x); within 15% of the prediction {ok[b['prediction_target_met']]} "
            f"({b['speedup'] / b['predicted']:.2f} of {b['predicted']:.2f}x); of the prediction with the measured "
            f"verify cost {ok[b['prediction_verify_measured_met']]} "
            f"({b['speedup'] / b['predicted_verify_measured']:.2f} of {b['predicted_verify_measured']:.2f}x)"
        )
    return "\n".join(lines)


def speculative_bench(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    res = speculative_benchmark(
        tokens=args.tokens,
        prompts=args.prompts,
        prompt_tokens=args.prompt_tokens,
        gammas=args.gammas,
        repeats=args.repeats,
        seed=args.seed,
        progress=lambda m: print("  " + m, flush=True),
        device=args.device,
    )
    print()
    print(format_speculative_results(res))
    return res


BENCHMARKS["speculative"] = (
    speculative_bench,
    "speculative vs plain decoding, measured against the theory (chapter 07)",
    _speculative_options,
)

# --- chapter 08: serving (batching, continuous batching, prefix cache) -----------------


def _serving_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=32, help="requests in the mixed workload (default 32)")
    p.add_argument("--max-batch", type=int, default=8, help="slots (rows decoded together), default 8")
    p.add_argument("--short", type=int, default=16, help="new tokens of a short request (default 16)")
    p.add_argument("--long", type=int, default=256, help="new tokens of a long request (default 256)")
    p.add_argument("--long-every", type=int, default=4, help="every n-th request is long (default 4)")
    p.add_argument("--repeats", type=int, default=2, help="alternating runs of each policy; medians reported")
    p.add_argument(
        "--batch-sizes", default="1,2,4,8,16,32", help="batch sizes for the tokens/s sweep (default 1,2,4,8,16,32)"
    )
    p.add_argument("--context", type=int, default=128, help="positions in every row during the sweep (default 128)")
    p.add_argument("--prefix-tokens", type=int, default=800, help="shared static prefix for the TTFT test (800)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")


def serving_benchmark(
    model=None,
    requests: int = 32,
    max_batch: int = 8,
    short: int = 16,
    long: int = 256,
    long_every: int = 4,
    repeats: int = 2,
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
    context: int = 128,
    prefix_tokens: int = 800,
) -> dict:
    """Static vs continuous batching on a mixed workload, tokens/s against batch size, and TTFT
    with and without a prefix cache; real runs of the model, each comparison side by side."""
    from ar_lab.data import builtin_corpus
    from ar_lab.roofline import decode_cost
    from ar_lab.serving import compare_policies, decode_throughput, mixed_workload, prefix_ttft

    source = "the model passed in"
    if model is None:
        model, source = _course_model_or_random()
    work = mixed_workload(requests, short, long, long_every)
    reports = compare_policies(model, work, max_batch, repeats=repeats)
    policies = {}
    for policy, runs in reports.items():
        keys = runs[0].summary().keys()
        policies[policy] = {k: median([r.summary()[k] for r in runs]) if k != "policy" else policy for k in keys}
    same = sum(
        a.tokens == b.tokens
        for a, b in zip(reports["static"][0].results, reports["continuous"][0].results, strict=True)
    )
    s, c = policies["static"], policies["continuous"]
    sweep = decode_throughput(model, list(batch_sizes), context=context, steps=16, repeats=max(3, repeats))
    base = sweep[0]["tokens_per_s"]
    for row in sweep:
        row["x_batch_1"] = row["tokens_per_s"] / base
        cost = decode_cost(model.config, context + 1, row["batch"])
        row["weight_bytes_per_token"] = cost.weight_bytes / row["batch"]
    text = builtin_corpus()
    prefix = text[: min(prefix_tokens, model.config.block_size - 64)]
    suffixes = ["\nQ: What does the for statement do?\nA:", "\nQ: How are exceptions raised?\nA:"]
    prefix_res = prefix_ttft(model, prefix, suffixes, max_new_tokens=8, repeats=max(3, repeats))

    print(
        f"serving: model {source} ({model.num_parameters() / 1e6:.2f} M parameters); {machine_info()}\n"
        f"workload: {requests} requests, every {long_every}th wants {long} new tokens, the rest {short}; "
        f"{max_batch} slots; greedy, no EOS\n"
    )
    rows = []
    for name, label in [
        ("tokens_per_s", "tokens/s"),
        ("mean_latency_s", "mean latency s"),
        ("p90_latency_s", "p90 latency s"),
        ("mean_ttft_s", "mean TTFT s (queue incl.)"),
        ("decode_steps", "decode steps"),
        ("mean_rows", "mean rows per step"),
        ("seconds", "total s"),
    ]:
        rows.append([label, float(s[name]), float(c[name]), f"{c[name] / s[name]:.2f}"])
    print(format_table(["", "static", "continuous", "continuous / static"], rows))
    print(f"identical outputs under both policies: {same}/{requests} requests\n")
    print(f"decode steps with every row at {context} positions (weights read once per step, chapter 05):")
    print(
        format_table(
            ["batch", "ms/step", "tokens/s", "x batch 1", "weight bytes / token"],
            [
                [r["batch"], r["step_s"] * 1e3, r["tokens_per_s"], f"{r['x_batch_1']:.2f}", r["weight_bytes_per_token"]]
                for r in sweep
            ],
        )
    )
    p = prefix_res
    print(
        f"\nprefix cache: {p['prefix_tokens']}-token static prefix + {p['suffix_tokens']} question tokens: "
        f"TTFT {p['ttft_plain_s'] * 1e3:.1f} ms prefilled whole vs {p['ttft_reused_s'] * 1e3:.1f} ms reused "
        f"({p['speedup']:.1f}x); identical outputs {p['identical_outputs']}/{p['runs']}; "
        f"building the prefix cache once: {p['build_s'] * 1e3:.1f} ms"
    )
    print(
        f"\nkey figures: continuous / static batching: {c['tokens_per_s'] / s['tokens_per_s']:.2f}x tokens/s, "
        f"{s['mean_latency_s'] / c['mean_latency_s']:.2f}x lower mean latency; batch {sweep[-1]['batch']} decodes "
        f"{sweep[-1]['x_batch_1']:.1f}x the tokens/s of batch 1; prefix cache {p['speedup']:.1f}x faster TTFT"
    )
    return {
        "model": source,
        "workload": {"requests": requests, "short": short, "long": long, "long_every": long_every},
        "max_batch": max_batch,
        "policies": policies,
        "identical_outputs": same,
        "batch_sweep": sweep,
        "prefix": prefix_res,
        **machine_info(),
    }


def serving_bench(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    sizes = tuple(int(b) for b in args.batch_sizes.split(","))
    return serving_benchmark(
        requests=args.requests,
        max_batch=args.max_batch,
        short=args.short,
        long=args.long,
        long_every=args.long_every,
        repeats=args.repeats,
        batch_sizes=sizes,
        context=args.context,
        prefix_tokens=args.prefix_tokens,
    )


BENCHMARKS["serving"] = (
    serving_bench,
    "static vs continuous batching, tokens/s vs batch size, prefix-cache TTFT (chapter 08)",
    _serving_options,
)

if __name__ == "__main__":
    sys.exit(main())
