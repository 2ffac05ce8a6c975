"""Chapter 06's benchmark: one sampler step against one cached decode step, batch 1.

The key figure is sampler time / decode time: a sampler must not show in decode time.
"""

from __future__ import annotations

import argparse

import torch

from ar_lab.base.args import positive_int
from ar_lab.base.errors import ContextFull
from ar_lab.base.timing import machine, machine_line, median, time_call
from ar_lab.bench.common import course_model_or_random, torch_threads
from ar_lab.bench.table import format_table


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--context", type=int, default=128, help="tokens already in the KV cache (default 128)"
    )
    p.add_argument(
        "--rounds", type=int, default=30, help="interleaved timing rounds; medians are reported"
    )
    p.add_argument("--calls", type=int, default=20, help="calls per round, averaged (default 20)")
    p.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (default 1, as batch-1 decode)"
    )


def _samplers(history: list[int]) -> dict:
    """name -> (SamplingParams, history for the repetition penalty)."""
    from ar_lab.engine.sampling import GREEDY, SamplingParams

    return {
        "greedy": (GREEDY, ()),
        "T=1 (pure sampling)": (SamplingParams(), ()),
        "T=0.8, top-k 40": (SamplingParams(temperature=0.8, top_k=40), ()),
        "T=0.8, top-p 0.9": (SamplingParams(temperature=0.8, top_p=0.9), ()),
        "T=0.8, min-p 0.05": (SamplingParams(temperature=0.8, min_p=0.05), ()),
        "all + repetition penalty 1.2": (
            SamplingParams(
                temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.2
            ),
            history,
        ),
    }


def sampler_benchmark(model=None, context: int = 128, *, rounds: int = 30, calls: int = 20) -> dict:
    """Batch-1: one cached decode step against one sampler step on its logits, interleaved.

    Each of ``rounds`` rounds times ``calls`` calls of the decode step and of every sampler
    (median per round, so a load change on the machine hits every column alike); the
    medians over the rounds are reported, with each sampler's time as a fraction of the
    decode step's. Print the result with ``format_sampler_results``.
    """
    from ar_lab.engine.decoder import decoder_for
    from ar_lab.engine.sampling import sample
    from ar_lab.model.cache import KVCache
    from ar_lab.model.inference import inference

    for name, value in [("context", context), ("rounds", rounds), ("calls", calls)]:
        positive_int(name, value)
    source = "the model passed in"
    if model is None:
        model, source = course_model_or_random()
    if context >= model.config.block_size:
        raise ContextFull(
            f"context must be below the context window of {model.config.block_size}, got {context}",
            arg="context",
        )
    device = model.device
    gen = torch.Generator(device=device).manual_seed(0)
    history = torch.randint(0, model.config.vocab_size, (context,), generator=gen, device=device)
    cache = KVCache.for_model(model, max_len=context + 1)
    decoder = decoder_for(model)  # the decoder ar_lab.generate runs: the lean step for a GPT
    with inference(model):
        decoder.prefill(history[None, :context], cache)  # the cache now holds `context` positions
    token = int(history[-1])

    def decode_step():
        # every timed step decodes position `context` again
        return decoder.step(token, cache, context)

    samplers = _samplers(history.tolist())
    times: dict[str, list[float]] = {"decode step": [], **{k: [] for k in samplers}}
    with inference(model):
        logits = decode_step()
        for _ in range(rounds):  # interleaved, so load changes hit every column alike
            times["decode step"].append(
                median(time_call(decode_step, repeats=calls, warmup=1, device=device))
            )
            for name, (params, h) in samplers.items():
                # int(): waits for the device
                fn = lambda params=params, h=h: int(sample(logits, params, gen, h))
                times[name].append(median(time_call(fn, repeats=calls, warmup=1)))
    decode = median(times["decode step"])
    out = {}
    for name in samplers:
        t = median(times[name])
        out[name] = {"seconds": t, "ratio_to_decode_step": t / decode}
    return {
        "benchmark": "sampler",
        "model": source,
        "parameters": model.num_parameters(),
        "context": context,
        "decode_step_seconds": decode,
        "samplers": out,
        "machine": machine(device),
    }


def format_sampler_results(res: dict) -> str:
    """The printed table: the decode step, then each sampler, in µs and as a fraction of the
    step."""
    decode = res["decode_step_seconds"]
    rows = [["decode step (cached, batch 1)", f"{decode * 1e6:,.1f}", "1"]]
    for name, s in res["samplers"].items():
        rows.append(
            [f"sampler: {name}", f"{s['seconds'] * 1e6:,.1f}", f"{s['ratio_to_decode_step']:.3f}"]
        )
    header = (
        f"model: {res['model']}; {res['parameters']:,} parameters; context {res['context']}; "
        f"{machine_line(res['machine'])}"
    )
    return header + "\n" + format_table(["step", "median µs", "x decode step"], rows)


def run(args: argparse.Namespace) -> dict:
    with torch_threads(args.threads):
        res = sampler_benchmark(context=args.context, rounds=args.rounds, calls=args.calls)
    print(format_sampler_results(res))
    return res
