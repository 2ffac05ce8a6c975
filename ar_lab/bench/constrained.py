"""Chapter 06's constrained-decoding benchmark: JSON records from the course model, free and under a
grammar.

The prompt is three lines of JSON records (``RECORDS_PROMPT``); the grammar (``record_grammar``) is
the next record: ``{"name": <string>, "size": <integer>}``. ``--samples`` texts are drawn each way
at T = 1 with the same seeds, and three figures come out of one run:

- the share of valid texts: free texts are judged generously (a valid record at the start, whatever
  follows it, by ``json``), constrained ones strictly (the whole text): 100 % by construction,
  checked here anyway;
- the mask's cost: each constrained sample and a free sample of the *same number of steps* (same
  seed, no EOS) are generated in turns (``interleaved``), so the ratio of their times is the cost of
  the mask and the state machine per step, on equal work;
- what the mask does to the distribution: the mean log-probability per token, under the model's own
  (unmasked) distribution, of the constrained texts against the free ones (the text's bytes, not the
  EOS that ends a constrained one), and the share of those steps where the model's most likely token
  was refused (the mask overrode it).
"""

from __future__ import annotations

import argparse

import torch

from ar_lab.base.args import positive_int
from ar_lab.base.errors import ContextFull
from ar_lab.base.timing import interleaved, machine, median, steady_clock
from ar_lab.bench.common import course_model_or_random, torch_threads
from ar_lab.bench.table import format_table

RECORDS_PROMPT = (
    '{"name": "spam", "size": 3}\n{"name": "eggs", "size": 12}\n{"name": "ham", "size": 7}\n'
)


def record_grammar():
    """The next record of ``RECORDS_PROMPT``: ``{"name": <≤ 24 printable characters>, "size": <≤ 6
    digits>}``."""
    from ar_lab.engine.constrained import JsonObject

    return JsonObject({"name": str, "size": int}, max_string=24, max_digits=6)


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--samples", type=int, default=32, help="texts drawn each way (default 32)")
    p.add_argument(
        "--tokens", type=int, default=96, help="new tokens at most per text (default 96)"
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="interleaved timing rounds; medians are reported"
    )
    p.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (default 1, as batch-1 decode)"
    )


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _seconds_per_step(model, prompt, tokens, params, grammar, steps, repeats) -> dict:
    """Seconds per decode step, constrained and free, timed interleaved on equal work: each free
    sample runs as many steps as its constrained twin (``steps``, no EOS stop)."""
    from ar_lab.engine.generate import generate

    runs = {
        "constrained": lambda: [
            generate(
                model, prompt, tokens, sampling=params, generator=_seeded(i), constraint=grammar
            )
            for i in range(len(steps))
        ],
        "free": lambda: [
            generate(model, prompt, n, sampling=params, generator=_seeded(i), eos_id=None)
            for i, n in enumerate(steps)
        ],
    }
    times = interleaved(
        runs, repeats, warmup=1, clock=steady_clock(model.device), device=model.device
    )
    return {name: median(t) / sum(steps) for name, t in times.items()}


def constrained_benchmark(
    model=None, *, samples: int = 32, tokens: int = 96, repeats: int = 3
) -> dict:
    """The measurements (returns data, prints nothing); see the module's docstring."""
    from ar_lab.engine.generate import generate
    from ar_lab.engine.sampling import SamplingParams
    from ar_lab.model.tokenizer import encode
    from ar_lab.perf.quality import path_logprobs, path_summary

    for name, value in (("samples", samples), ("tokens", tokens), ("repeats", repeats)):
        positive_int(name, value)
    source = "the model passed in"
    if model is None:
        model, source = course_model_or_random()
    grammar, prompt, params = record_grammar(), encode(RECORDS_PROMPT), SamplingParams()
    if len(prompt) + tokens > model.config.block_size:
        most = model.config.block_size - len(prompt)
        raise ContextFull(
            f"tokens must be at most {most} for this prompt and model, got {tokens}", arg="tokens"
        )
    free = [
        generate(model, prompt, tokens, sampling=params, generator=_seeded(i))
        for i in range(samples)
    ]
    bound = [
        generate(model, prompt, tokens, sampling=params, generator=_seeded(i), constraint=grammar)
        for i in range(samples)
    ]
    bound_ok = [grammar.valid(r.text) for r in bound]
    if not all(ok for ok, r in zip(bound_ok, bound, strict=True) if r.stats.stop_reason == "eos"):
        raise AssertionError("a constrained text that ended at EOS is not a valid record")
    steps = [r.stats.forward_calls for r in bound]
    per_step = _seconds_per_step(model, prompt, tokens, params, grammar, steps, repeats)
    # the text, not its final EOS
    bound_lp = [path_logprobs(model, prompt, r.tokens, grammar) for r in bound]
    free_lp = [path_logprobs(model, prompt, r.tokens) for r in free]
    (free_mean, _), (bound_mean, refused) = path_summary(free_lp), path_summary(bound_lp)
    return {
        "benchmark": "constrained",
        "model": source,
        "prompt": RECORDS_PROMPT,
        "grammar": repr(grammar),
        "samples": samples,
        "tokens": tokens,
        "repeats": repeats,
        "valid_share": {
            "free": sum(grammar.valid(r.text, trailing=True) for r in free) / samples,
            "constrained": sum(bound_ok) / samples,
        },
        "complete_share": sum(r.stats.stop_reason == "eos" for r in bound) / samples,
        "steps": sum(steps),
        "ms_per_step": {name: 1e3 * t for name, t in per_step.items()},
        "mask_cost_ratio": per_step["constrained"] / per_step["free"],
        "mean_logprob": {"free": free_mean, "constrained": bound_mean},
        "top_refused_share": refused,
        "examples": {
            "free": [r.text for r in free[:3]],
            "constrained": [r.text for r in bound[:3]],
        },
        "machine": machine(model.device),
    }


def format_constrained_results(res: dict) -> str:
    v, ms, lp = res["valid_share"], res["ms_per_step"], res["mean_logprob"]
    rows = [
        [name, f"{v[name]:.0%}", f"{ms[name]:.3f}", f"{lp[name]:.2f}"]
        for name in ("free", "constrained")
    ]
    return "\n".join(
        [
            f"model: {res['model']}; {res['samples']} samples at T = 1 of the next record after "
            f"three JSON records; grammar {res['grammar']}",
            format_table(
                ["decoding", "valid records", "ms / step", "mean log-prob / token (nats)"], rows
            ),
            f"a constrained step takes {res['mask_cost_ratio']:.2f}x the time of a free one "
            "(equal steps, in turns); the model's most likely token was refused at "
            f"{res['top_refused_share']:.0%} of the constrained steps; "
            f"{res['complete_share']:.0%} of constrained texts closed before the cap",
            "free texts are judged by their start (text after a valid record is ignored); "
            "constrained ones whole",
        ]
    )


def run(args: argparse.Namespace) -> dict:
    with torch_threads(args.threads):
        res = constrained_benchmark(samples=args.samples, tokens=args.tokens, repeats=args.repeats)
    print(format_constrained_results(res))
    return res
