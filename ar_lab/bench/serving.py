"""Chapter 08's benchmark: static vs continuous batching, tokens/s vs batch size, prefix-cache TTFT,
chunked prefill's inter-token gaps.

Real runs of the model, each comparison side by side in one process.
"""

from __future__ import annotations

import argparse

from ar_lab.base.args import positive_int
from ar_lab.base.errors import BadValue, ContextFull
from ar_lab.base.timing import machine, machine_line, median
from ar_lab.bench.common import course_model_or_random, torch_threads
from ar_lab.bench.table import format_table

# Questions after the shared prefix in the TTFT test.
SUFFIXES = ["\nQ: What does the for statement do?\nA:", "\nQ: How are exceptions raised?\nA:"]
PREFIX_ROOM = 64  # positions after the shared prefix: a question (SUFFIXES) and 8 answer tokens

# policy summary key -> row label of the printed table
POLICY_ROWS = [
    ("tokens_per_s", "tokens/s"),
    ("mean_latency_s", "mean latency s"),
    ("p90_latency_s", "p90 latency s"),
    ("mean_ttft_s", "mean TTFT s (queue incl.)"),
    ("decode_steps", "decode steps"),
    ("mean_rows", "mean rows per step"),
    ("seconds", "total s"),
]


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--requests", type=int, default=32, help="requests in the mixed workload (default 32)"
    )
    p.add_argument(
        "--max-batch", type=int, default=8, help="slots (rows decoded together), default 8"
    )
    p.add_argument(
        "--short", type=int, default=16, help="new tokens of a short request (default 16)"
    )
    p.add_argument(
        "--long", type=int, default=256, help="new tokens of a long request (default 256)"
    )
    p.add_argument(
        "--long-every", type=int, default=4, help="every n-th request is long (default 4)"
    )
    p.add_argument(
        "--repeats", type=int, default=2, help="alternating runs of each policy; medians reported"
    )
    p.add_argument(
        "--batch-sizes",
        default="1,2,4,8,16,32",
        help="batch sizes for the tokens/s sweep (default 1,2,4,8,16,32)",
    )
    p.add_argument(
        "--context",
        type=int,
        default=128,
        help="positions in every row during the sweep (default 128)",
    )
    p.add_argument(
        "--prefix-tokens",
        type=int,
        default=800,
        help="shared static prefix for the TTFT test (800)",
    )
    p.add_argument(
        "--chunks",
        default="64,256",
        help="chunk sizes of chunked prefill, beside whole prompts (default 64,256)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")


def _policies(model, work, max_batch: int, repeats: int) -> tuple[dict, int]:
    """Median summary of each policy, and how many requests got identical outputs under both."""
    from ar_lab.perf.serving_measure import compare_policies

    reports = compare_policies(model, work, max_batch, repeats=repeats)
    policies = {}
    for policy, runs in reports.items():
        keys = runs[0].summary().keys()
        policies[policy] = {
            k: median([r.summary()[k] for r in runs]) if k != "policy" else policy for k in keys
        }
    same = sum(
        a.tokens == b.tokens
        for a, b in zip(reports["static"][0].results, reports["continuous"][0].results, strict=True)
    )
    return policies, same


def _batch_sweep(model, batch_sizes, context: int, repeats: int) -> list[dict]:
    """Tokens/s of decode steps at each batch size, against batch 1 and with the weight bytes per
    token."""
    from ar_lab.perf.roofline import decode_cost
    from ar_lab.perf.serving_measure import decode_throughput

    sweep = decode_throughput(
        model, list(batch_sizes), context=context, steps=16, repeats=max(3, repeats)
    )
    base = sweep[0]["tokens_per_s"]
    for row in sweep:
        row["x_batch_1"] = row["tokens_per_s"] / base
        cost = decode_cost(model.config, context + 1, row["batch"])
        row["weight_bytes_per_token"] = cost.weight_bytes / row["batch"]
    return sweep


def _chunked(model, max_batch: int, chunks, repeats: int) -> dict:
    """Inter-token gaps, TTFT and tokens/s of whole-prompt prefill and of each chunk size, on long
    documents arriving among chats, side by side; how many requests got the unchunked tokens."""
    from ar_lab.perf.serving_measure import compare_chunks, long_prompt_workload

    window = model.config.block_size  # (the course model's: 1,024)
    work = long_prompt_workload(prompt=min(768, window * 3 // 4), new=min(48, window // 8))
    reports = compare_chunks(model, work, max_batch, [None, *chunks], repeats=repeats)
    keys = ("p99_gap_s", "max_gap_s", "mean_ttft_s", "tokens_per_s", "seconds")
    rows = [{"chunk": c, **{k: median([r.summary()[k] for r in runs]) for k in keys}}
            for c, runs in reports.items()]
    whole = reports[None][0].results
    same = min(sum(a.tokens == b.tokens for a, b in zip(whole, runs[0].results, strict=True))
               for runs in reports.values())
    return {"requests": len(work), "document": len(work[-1].prompt), "rows": rows,
            "identical_outputs": same}


def serving_benchmark(
    model=None,
    *,
    requests: int = 32,
    max_batch: int = 8,
    short: int = 16,
    long: int = 256,
    long_every: int = 4,
    repeats: int = 2,
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
    context: int = 128,
    prefix_tokens: int = 800,
    chunks: tuple[int, ...] = (64, 256),
) -> dict:
    """Static vs continuous batching on a mixed workload, tokens/s against batch size, and TTFT
    with and without a prefix cache; real runs of the model, each comparison side by side.
    ``prefix_tokens`` is at most the context window less ``PREFIX_ROOM`` (refused, never cut short).
    Print the result with ``format_serving_results``."""
    from ar_lab.model.data import builtin_corpus
    from ar_lab.perf.serving_measure import mixed_workload, prefix_ttft

    source = "the model passed in"
    if model is None:
        model, source = course_model_or_random()
    work = mixed_workload(requests, short, long, long_every)
    # Every size is checked before the first run (the sweep and the TTFT test come minutes later).
    sizes = [
        ("max_batch", max_batch),
        ("repeats", repeats),
        ("context", context),
        ("prefix_tokens", prefix_tokens),
    ]
    for name, value in (sizes + [("batch_sizes", b) for b in batch_sizes or [0]]
                        + [("chunks", c) for c in chunks or [0]]):
        positive_int(name, value)
    window = model.config.block_size
    if context + 16 > window:  # the sweep decodes 16 steps after `context` positions
        raise ContextFull(
            f"context {context} + 16 decode steps must fit in the context window ({window})",
            arg="context",
        )
    # refused, not cut short: the report would show another size
    if prefix_tokens > window - PREFIX_ROOM:
        raise ContextFull(
            f"prefix_tokens must be at most {window - PREFIX_ROOM} (the context window of "
            f"{window} less {PREFIX_ROOM} positions for each question and its answer), got "
            f"{prefix_tokens}",
            arg="prefix_tokens",
        )
    policies, same = _policies(model, work, max_batch, repeats)
    sweep = _batch_sweep(model, batch_sizes, context, repeats)
    prefix = builtin_corpus()[:prefix_tokens]
    prefix_res = prefix_ttft(model, prefix, SUFFIXES, max_new_tokens=8, repeats=max(3, repeats))
    chunked = _chunked(model, max_batch, chunks, max(3, repeats))
    return {
        "benchmark": "serving",
        "model": source,
        "parameters": model.num_parameters(),
        "workload": {"requests": requests, "short": short, "long": long, "long_every": long_every},
        "max_batch": max_batch,
        "policies": policies,
        "identical_outputs": same,
        "context": context,
        "batch_sweep": sweep,
        "prefix": prefix_res,
        "chunked": chunked,
        "machine": machine(model.device),
    }


def format_serving_results(res: dict) -> str:
    """The printed report: both policies side by side, the batch sweep, the prefix cache, the key
    figures."""
    w, s, c = res["workload"], res["policies"]["static"], res["policies"]["continuous"]
    sweep, p = res["batch_sweep"], res["prefix"]
    rows = [
        [label, float(s[key]), float(c[key]), f"{c[key] / s[key]:.2f}"]
        for key, label in POLICY_ROWS
    ]
    sweep_rows = [
        [
            r["batch"],
            r["step_s"] * 1e3,
            r["tokens_per_s"],
            f"{r['x_batch_1']:.2f}",
            r["weight_bytes_per_token"],
        ]
        for r in sweep
    ]
    k = res["chunked"]
    chunk_rows = [[r["chunk"] or "whole prompts", r["p99_gap_s"] * 1e3, r["max_gap_s"] * 1e3,
                   r["mean_ttft_s"] * 1e3, r["tokens_per_s"]] for r in k["rows"]]
    return "\n".join(
        [
            f"serving: model {res['model']} ({res['parameters'] / 1e6:.2f} M parameters); "
            f"{machine_line(res['machine'])}",
            f"workload: {w['requests']} requests, every {w['long_every']}th wants {w['long']} "
            f"new tokens, the rest {w['short']}; {res['max_batch']} slots; greedy, no EOS",
            "",
            format_table(["", "static", "continuous", "continuous / static"], rows),
            f"identical outputs under both policies: {res['identical_outputs']}/{w['requests']} "
            "requests",
            "",
            f"decode steps with every row at {res['context']} positions (weights read once per "
            "step, chapter 05):",
            format_table(
                ["batch", "ms/step", "tokens/s", "x batch 1", "weight bytes / token"], sweep_rows
            ),
            "",
            f"prefix cache: {p['prefix_tokens']}-token static prefix + {p['suffix_tokens']} "
            f"question tokens: TTFT {p['ttft_plain_s'] * 1e3:.1f} ms prefilled whole vs "
            f"{p['ttft_reused_s'] * 1e3:.1f} ms reused ({p['speedup']:.1f}x); identical outputs "
            f"{p['identical_outputs']}/{p['runs']}; building the prefix cache once: "
            f"{p['build_s'] * 1e3:.1f} ms",
            "",
            f"chunked prefill: {k['requests']} requests, every 4th a {k['document']}-position "
            f"document among chats; identical outputs {k['identical_outputs']}/{k['requests']}",
            format_table(["chunk", "p99 gap ms", "max gap ms", "mean TTFT ms", "tokens/s"],
                         chunk_rows),
            "",
            "key figures: continuous / static batching: "
            f"{c['tokens_per_s'] / s['tokens_per_s']:.2f}x tokens/s, "
            f"{s['mean_latency_s'] / c['mean_latency_s']:.2f}x lower mean latency; batch "
            f"{sweep[-1]['batch']} decodes {sweep[-1]['x_batch_1']:.1f}x the tokens/s of batch "
            f"1; prefix cache {p['speedup']:.1f}x faster TTFT",
        ]
    )


def serving_summary(res: dict) -> str:
    """The README's sentence for this benchmark (``python -m ar_lab.bench.readme``)."""
    s, c = res["policies"]["static"], res["policies"]["continuous"]
    last, p = res["batch_sweep"][-1], res["prefix"]
    return (
        f"continuous {c['tokens_per_s'] / s['tokens_per_s']:.2f}× the tokens/s of static and "
        f"{s['mean_latency_s'] / c['mean_latency_s']:.1f}× lower mean latency; batch "
        f"{last['batch']} gives {last['x_batch_1']:.1f}× the tokens/s of batch 1; a reused "
        f"{p['prefix_tokens']}-token prefix cuts time to first token {p['speedup']:.1f}×"
        + _chunked_summary(res.get("chunked"))
    )


def _chunked_summary(k: dict | None) -> str:
    if k is None:  # (a run from before chunked prefill)
        return ""
    whole, rows = k["rows"][0], k["rows"][1:]
    return f"; chunked prefill by {rows[0]['chunk']} positions: p99 inter-token gap " + (
        f"{rows[0]['p99_gap_s'] * 1e3:.0f} ms against {whole['p99_gap_s'] * 1e3:.0f} ms for "
        f"whole prompts, at {rows[0]['tokens_per_s'] / whole['tokens_per_s']:.2f}× the tokens/s")


def _ints(text: str, name: str) -> tuple[int, ...]:
    try:
        return tuple(int(b) for b in text.split(","))
    except ValueError:
        raise BadValue(
            f"--{name.replace('_', '-')} must be ints separated by commas, e.g. 1,2,4, got "
            f"{text!r} ({name})",
            arg=name,
        ) from None


def run(args: argparse.Namespace) -> dict:
    sizes, chunks = _ints(args.batch_sizes, "batch_sizes"), _ints(args.chunks, "chunks")
    with torch_threads(args.threads):
        res = serving_benchmark(
            requests=args.requests,
            max_batch=args.max_batch,
            short=args.short,
            long=args.long,
            long_every=args.long_every,
            repeats=args.repeats,
            batch_sizes=sizes,
            context=args.context,
            prefix_tokens=args.prefix_tokens,
            chunks=chunks,
        )
    print(format_serving_results(res))
    return res
