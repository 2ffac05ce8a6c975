"""The command line: ``python -m ar_lab.bench NAME [options] [--json PATH]``.

Each benchmark module gives ``add_options(parser)`` (its options) and ``run(args)`` (measure,
print the report, return the results); ``--json PATH`` also writes the results, with the
command that produced them. Bad options, a missing checkpoint or an unknown device end
with a one-line message and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from ar_lab.base.timing import machine
from ar_lab.bench import (
    against,
    attention,
    batched,
    constrained,
    decode,
    lookup,
    paged,
    quant,
    roofline,
    sampler,
    selfspec,
    serving,
    speculative,
    verify,
)
from ar_lab.model.data import check_writable

# name -> (module with add_options and run, one-line help)
BENCHMARKS = {
    "decode": (
        decode,
        "KV cache vs recomputation, and ar_lab vs transformers generate (chapter 04)",
    ),
    "roofline": (roofline, "prefill vs decode on a measured roofline (chapter 05)"),
    "batched": (
        batched,
        "one decode step for B rows vs one for a single sequence, through ar_lab's decoder "
        "(weights packed for a few rows) and through GPT.forward (chapter 05)",
    ),
    "sampler": (sampler, "batch-1 sampler step vs cached decode step (chapter 06)"),
    "constrained": (
        constrained,
        "JSON records free vs under a grammar: validity, mask cost, log-prob (chapter 06)",
    ),
    "speculative": (
        speculative,
        "speculative vs plain decoding, measured against the theory (chapter 07)",
    ),
    "selfspec": (
        selfspec,
        "speculative decoding on a memory-bound target: the widened course model drafted by its "
        "own int4 copy, and the verify pass in decode steps (chapter 07)",
    ),
    "verify": (
        verify,
        "one pass over k new positions in decode steps, on a memory-bound model and the course "
        "model: chapter 07's curve where a notebook cannot measure it (a GPU)",
    ),
    "lookup": (
        lookup,
        (
            "prompt lookup vs a draft model vs plain decoding, and vs transformers' lookup "
            "(chapter 07)"
        ),
    ),
    "serving": (
        serving,
        "static vs continuous batching, tokens/s vs batch size, prefix-cache TTFT (chapter 08)",
    ),
    "paged": (
        paged,
        (
            "KV memory in slots vs paged blocks: reserved vs used, requests in a fixed budget "
            "(chapter 08)"
        ),
    ),
    "quant": (
        quant,
        "fp32 vs bf16 vs int8 vs int4 weights in batch-1 decode, against the roofline (chapter 09)",
    ),
    "attention": (
        attention,
        "attention materialised vs in tiles (FlashAttention-2) vs SDPA: peak bytes and time "
        "against T (chapter 10)",
    ),
    "against": (
        against,
        "this tree's batch-1 decode against another checkout's, in alternating processes (a "
        "refactor of the engine measured before it lands)",
    ),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(
        prog="python -m ar_lab.bench", description="Side-by-side benchmarks."
    )
    sub = parser.add_subparsers(dest="name", required=True)
    for name, (module, help_text) in BENCHMARKS.items():
        p = sub.add_parser(name, help=help_text)
        p.add_argument(
            "--json", type=Path, default=None, help="also write the results to this JSON file"
        )
        module.add_options(p)
    args = parser.parse_args(argv)
    try:
        # a path that cannot be written: said before the run, not after it
        if args.json is not None:
            check_writable(args.json, "--json")
        results = BENCHMARKS[args.name][0].run(args)
    # bad options or a missing checkpoint: say so, no traceback
    except (ValueError, FileNotFoundError) as e:
        parser.error(f"{args.name}: {e}")
    results["command"] = shlex.join(["python", "-m", "ar_lab.bench", *argv])
    # what the README's table says it ran on, and when: the result's own device where it names one
    # (a GPU run)
    described = isinstance(results.get("device"), dict) and all(
        k in results for k in ("versions", "date")
    )
    results.setdefault(
        "machine",
        {k: results[k] for k in ("device", "versions", "date")} if described else machine(),
    )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
