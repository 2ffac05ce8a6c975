"""Chapter 04's benchmark: KV cache vs recomputation, and ar_lab vs transformers ``generate``.

Batch-1 greedy decode, every run of a repeat side by side: ar_lab cached (the lean step),
the lean step compiled (``torch.compile``, ``ar_lab.engine.compiled``), the same steps through
``GPT.forward()``, uncached, Hugging Face ``transformers`` ``generate`` on the same weights (its
own KV cache), and the weights-only floor every batch-1 decoder of the model pays. All runs must
produce exactly the same tokens.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from ar_lab.base.args import positive_int
from ar_lab.base.timing import machine, median
from ar_lab.bench.common import checked_threads, course_model_or_random
from ar_lab.bench.decode_report import (  # the runs' names, the goals and the printed report
    CACHED,
    COMPILED,
    FLOOR,
    FLOORS,
    FORWARD,
    PEER,
    READS,
    TARGET_OVER_FLOOR,
    TARGET_VS_TRANSFORMERS,
    UNCACHED,
    format_decode_results,
)


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tokens", type=int, default=1000, help="new tokens per generation (default 1000)"
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="timed repeats of each run; medians are reported"
    )
    p.add_argument(
        "--uncached-repeats",
        type=int,
        default=None,
        help="repeats of the slow uncached run (default: --repeats)",
    )
    p.add_argument("--prompt", default="Python ", help="prompt text (default 'Python ')")
    p.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=None,
        help="torch CPU thread counts, each measured in turn (default: 1, then torch's default, "
        "all cores). Batch-1 decode of a 3.5 M-parameter model is a chain of small kernels: one "
        "thread is the steady figure on a shared machine; more threads split each weight read "
        "across cores",
    )
    p.add_argument("--no-peer", action="store_true", help="skip the transformers reference peer")
    p.add_argument(
        "--no-compile", action="store_true", help="skip the compiled step (torch.compile)"
    )


def _transformers_peer(model, prompt_ids: list[int]) -> Callable[[int], list[int]]:
    """``theirs(n)``: n greedy tokens from transformers' ``generate`` on ``model``'s weights."""
    from ar_lab.model.inference import inference
    from ar_lab.model.reference import to_hf_gpt2
    from ar_lab.model.tokenizer import EOS_ID

    hf = to_hf_gpt2(model)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except ImportError:  # pragma: no cover - logging moved
        pass
    ids = torch.tensor([prompt_ids])

    def theirs(n: int) -> list[int]:
        with inference(hf):
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                do_sample=False,
                eos_token_id=None,  # never stop early: exactly n tokens, like eos_id=None for ours
                pad_token_id=EOS_ID,
            )
        return out[0, len(prompt_ids) :].tolist()

    return theirs


def _runners(
    model, prompt_ids: list[int], n: int, peer: bool, compiled: bool
) -> dict[str, Callable[[int], object]]:
    """name -> ``fn(n)``, in the order each repeat runs them (the uncached one last)."""
    from ar_lab.engine.generate import generate
    from ar_lab.engine.lean import weights_only_pass

    def ours(use_cache: bool, lean: bool = True, compile: bool = False) -> Callable[[int], object]:
        return lambda k: generate(
            model, prompt_ids, k, use_cache=use_cache, eos_id=None, lean=lean, compile=compile
        )

    runners = {CACHED: ours(True)}
    if compiled:  # compiled in the warm-up (seconds), once per model and process
        runners[COMPILED] = ours(True, compile=True)
    runners[FORWARD] = ours(True, lean=False)
    if peer:
        runners[PEER] = _transformers_peer(model, prompt_ids)
    # The floor under any batch-1 decoder of this model; both peers pay it, what they add on top
    # is their own overhead. It produces no tokens.
    runners[FLOOR] = lambda k: weights_only_pass(model, k)
    runners[READS] = reads_pass(model, len(prompt_ids), n)
    runners[UNCACHED] = ours(False)
    return runners


def reads_pass(model, prompt_len: int, n: int) -> Callable[[int], None]:
    """``fn(k)``: k steps of the reads a batch-1 decode step makes, and nothing else: every weight
    matrix applied to one vector (as ``weights_only_pass``) and, per layer, one query attended over
    a KV cache as long as the step's (the prompt's length plus one a step) by the step's own kernel
    (SDPA). The floor with the cache: what is left above it is the work between these kernels."""
    import torch.nn.functional as F

    from ar_lab.base.timing import synchronize
    from ar_lab.engine.lean import weight_products

    cfg, products = model.config, weight_products(model)
    device, dtype = model.wte.weight.device, model.wte.weight.dtype
    shape = (1, cfg.kv_heads, prompt_len + n, cfg.head_dim)
    # keys and values in buffers of their own, as a step reads them (one tensor for both would
    # read its bytes once and find them in the CPU's cache the second time)
    caches = [
        tuple(torch.randn(shape, device=device, dtype=dtype) for _ in range(2))
        for _ in range(cfg.n_layer)
    ]
    q = torch.randn(1, cfg.n_head, 1, cfg.head_dim, device=device, dtype=dtype)
    gqa = cfg.kv_heads != cfg.n_head

    def run(k: int) -> None:
        with torch.inference_mode():
            for i in range(k):
                for product, x in products:
                    product(x)
                L = prompt_len + 1 + i
                for keys, values in caches:
                    F.scaled_dot_product_attention(
                        q, keys[:, :, :L], values[:, :, :L], enable_gqa=gqa
                    )
        synchronize(device)

    return run


def kv_bytes_per_step(model, prompt_len: int, n: int) -> float:
    """The bytes of KV cache a decode step reads, on average over ``n`` steps after a prompt."""
    cfg = model.config
    per_position = 2 * cfg.n_layer * cfg.kv_heads * cfg.head_dim * model.wte.weight.element_size()
    return per_position * (prompt_len + (n + 1) / 2)


def _timed_repeats(
    runners: dict, n: int, repeats: int, uncached_repeats: int, say: Callable[[str], None]
) -> dict:
    """Wall-clock and CPU seconds of every run, interleaved within each repeat (a load change on
    the machine hits all of them alike); every run must produce the same tokens."""
    runs = {
        name: {"seconds": [], "cpu_seconds": []}
        for name in [CACHED, COMPILED, FORWARD, UNCACHED, PEER, *FLOORS]
    }
    say("warm-up")
    for name, fn in runners.items():
        if name not in FLOORS:
            fn(min(n, 16))
    reference = None
    for r in range(max(repeats, uncached_repeats)):
        for name, fn in runners.items():
            if r >= (uncached_repeats if name == UNCACHED else repeats):
                continue
            say(f"repeat {r + 1}: {name}")
            w0, c0 = time.perf_counter(), time.process_time()
            out = fn(n)
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            if out is not None:  # the floor produces no tokens
                got = out if isinstance(out, list) else out.tokens
                if not isinstance(out, list):
                    runs[name]["positions"] = out.stats.positions_processed
                    runs[name]["forward_calls"] = out.stats.forward_calls
                if reference is None:
                    reference = got
                elif got != reference:
                    first = next(
                        i for i, (a, b) in enumerate(zip(got, reference, strict=False)) if a != b
                    )
                    raise AssertionError(
                        f"{name} produced different tokens (first difference at new token {first})"
                    )
            runs[name]["seconds"].append(wall)
            runs[name]["cpu_seconds"].append(cpu)
    return runs


def _with_medians(runs: dict, n: int) -> dict:
    """The runs that ran, each with its median wall and CPU seconds and tokens/s."""
    out = {}
    for name, run in runs.items():
        if run["seconds"]:
            run["median_s"] = median(run["seconds"])
            run["median_cpu_s"] = median(run["cpu_seconds"])
            run["tokens_per_s"] = n / run["median_s"]
            out[name] = run
    return out


def _ratios(runs: dict, n: int) -> dict:
    """The key figures: speedups between runs, and each run's time per token above the floor."""

    def speedup(a: str, b: str, key: str = "median_s") -> float | None:
        return runs[b][key] / runs[a][key] if a in runs and b in runs else None

    ratios = {
        "cached_vs_uncached": speedup(CACHED, UNCACHED),
        "cached_vs_uncached_cpu": speedup(CACHED, UNCACHED, "median_cpu_s"),
        "ar_lab_vs_transformers": speedup(CACHED, PEER),
        "ar_lab_vs_transformers_cpu": speedup(CACHED, PEER, "median_cpu_s"),
        "lean_vs_forward": speedup(CACHED, FORWARD),
        "compiled_vs_lean": speedup(COMPILED, CACHED),
        "compiled_vs_transformers": speedup(COMPILED, PEER),
        "compiled_vs_transformers_cpu": speedup(COMPILED, PEER, "median_cpu_s"),
    }
    if UNCACHED in runs:
        ratios["positions_uncached_vs_cached"] = (
            runs[UNCACHED]["positions"] / runs[CACHED]["positions"]
        )
    # Time per token above the floor: what each implementation adds to the unavoidable weight reads.
    floor = runs.get(FLOOR)
    if floor is not None:
        ratios["floor_ms_per_token"] = 1000 * floor["median_s"] / n
        if COMPILED in runs:
            ratios["compiled_over_floor"] = runs[COMPILED]["median_s"] / floor["median_s"]
        over = {
            k: 1000 * (runs[k]["median_s"] - floor["median_s"]) / n for k in runs if k not in FLOORS
        }
        ratios["overhead_ms_per_token"] = over
        if PEER in over and over[CACHED] > 0:
            ratios["overhead_transformers_vs_ar_lab"] = over[PEER] / over[CACHED]
    reads = runs.get(READS)
    if reads is not None:
        ratios["reads_floor_ms_per_token"] = 1000 * reads["median_s"] / n
        if COMPILED in runs:
            ratios["compiled_over_reads_floor"] = runs[COMPILED]["median_s"] / reads["median_s"]
        ratios["goal_ms_per_token"] = _goal_times(runs, n)
    return ratios


def _goal_times(runs: dict, n: int) -> dict[str, float]:
    """The time per token each goal allows: ``transformers``' over the target speedup, and the
    weights-only floor's times the allowed ratio (the runs that ran)."""
    goals = {}
    if PEER in runs:
        goals["vs_transformers"] = 1000 * runs[PEER]["median_s"] / n / TARGET_VS_TRANSFORMERS
    if FLOOR in runs:
        goals["over_floor"] = 1000 * runs[FLOOR]["median_s"] / n * TARGET_OVER_FLOOR
    return goals


def decode_benchmark(
    model=None,
    tokens: int = 1000,
    repeats: int = 3,
    uncached_repeats: int | None = None,
    prompt: str = "Python ",
    *,
    threads: int | None = 1,
    peer: bool = True,
    compiled: bool = True,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Batch-1 greedy decode of ``tokens`` new tokens: ar_lab cached, ar_lab uncached and
    transformers' ``generate`` (same weights, its own KV cache), measured side by side.

    Runs are interleaved within each repeat so a load change on the machine hits all of
    them alike; wall-clock and process CPU seconds are both kept. The transformers run
    must produce exactly ar_lab's tokens (``AssertionError`` otherwise). ``threads``: torch
    CPU threads for the runs (None: leave as is); restored afterwards.
    """
    from ar_lab.engine.prompts import checked_prompt
    from ar_lab.model.inference import inference

    positive_int("tokens", tokens)
    positive_int("repeats", repeats)
    uncached_repeats = positive_int(
        "uncached_repeats", repeats if uncached_repeats is None else uncached_repeats, 0
    )
    if threads is not None:
        checked_threads(threads)
    say = progress or (lambda _m: None)
    source = "given"
    if model is None:
        model, source = course_model_or_random()
    prompt_ids = checked_prompt(model, prompt, tokens)
    runners = _runners(model, prompt_ids, tokens, peer, compiled)
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        with inference(model):
            runs = _timed_repeats(runners, tokens, repeats, uncached_repeats, say)
        ran_on = machine(model.device)
    finally:
        torch.set_num_threads(old_threads)
    P = len(prompt_ids)
    if peer:  # transformers' cache also feeds the prompt once, then one token per step
        runs[PEER]["positions"] = P + tokens - 1
    runs = _with_medians(runs, tokens)
    return {
        "benchmark": "decode",
        "model": {"source": source, "parameters": model.num_parameters(), **model.config.to_dict()},
        "prompt_tokens": P,
        "new_tokens": tokens,
        "repeats": repeats,
        "uncached_repeats": uncached_repeats,
        "threads": threads if threads is not None else old_threads,
        "machine": ran_on,
        "runs": runs,
        "ratios": _ratios(runs, tokens),
        # what a step reads: the matrices (the weights-only floor's bytes), and the KV cache
        "weight_bytes": sum(
            m.weight.nbytes for m in model.modules() if isinstance(m, torch.nn.Linear)
        ),
        "kv_bytes_per_step": kv_bytes_per_step(model, P, tokens),
        "target_ar_lab_vs_transformers": TARGET_VS_TRANSFORMERS,
        "target_compiled_over_floor": TARGET_OVER_FLOOR,
    }


def run(args: argparse.Namespace) -> dict:
    """The command: each thread count in turn (the slow uncached run only in the first), then the
    tables."""
    from ar_lab.engine.prompts import checked_prompt
    from ar_lab.model.reference import have_transformers

    # Every argument is checked (and the model loaded) before anything is printed or timed.
    positive_int("tokens", args.tokens)
    positive_int("repeats", args.repeats)
    if args.uncached_repeats is not None:
        positive_int("uncached_repeats", args.uncached_repeats, 0)
    threads = checked_threads(args.threads or list(dict.fromkeys([1, torch.get_num_threads()])))
    model, source = course_model_or_random()
    checked_prompt(model, args.prompt, args.tokens)
    peer = not args.no_peer
    if peer and not have_transformers():
        print(
            "transformers is not installed: skipping the reference peer (pip install transformers)"
        )
        peer = False
    results = []
    for i, t in enumerate(threads):
        print(f"{t} thread{'s' if t != 1 else ''}:")
        res = decode_benchmark(
            model,
            tokens=args.tokens,
            repeats=args.repeats,
            uncached_repeats=args.uncached_repeats if i == 0 else 0,  # the slow run once is enough
            prompt=args.prompt,
            threads=t,
            peer=peer,
            compiled=not args.no_compile,
            progress=lambda m: print("  " + m, flush=True),
        )
        res["model"]["source"] = source
        results.append(res)
    for res in results:
        print()
        print(format_decode_results(res))
    if len(results) == 1:
        return results[0]
    return {"benchmark": "decode", "settings": results}
