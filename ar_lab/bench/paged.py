"""Chapter 08's paged KV memory: slots reserved for the longest request against blocks taken as
requests grow.

A mixed workload (``paged_workload``: short documentation prompts, answers of 4 to ``--longest`` new
tokens, most short) served on the course model four ways, in turns
(``ar_lab.perf.paged_memory.compare_kv``): with ``--max-batch`` slots, contiguous and paged (same
schedule: the time difference is the paged cache's bookkeeping and its gather), and in a fixed KV
budget of ``--budget-slots`` contiguous slots, contiguous and paged (how many requests run at once).
Every run gives the same tokens (asserted). Beside it, the arithmetic at scale: Llama-3-8B in bf16
on an 80 GB GPU (``scale_up``).
"""

from __future__ import annotations

import argparse

from ar_lab.base.args import positive_int
from ar_lab.base.timing import machine
from ar_lab.bench.common import course_model_or_random, torch_threads
from ar_lab.bench.table import format_table


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=32, help="requests in the workload (default 32)")
    p.add_argument(
        "--longest", type=int, default=256, help="most new tokens a request asks for (default 256)"
    )
    p.add_argument("--max-batch", type=int, default=8, help="rows decoded together (default 8)")
    p.add_argument("--block-size", type=int, default=16, help="positions per block (default 16)")
    p.add_argument(
        "--budget-slots",
        type=int,
        default=2,
        help="the fixed KV budget, in contiguous slots (default 2)",
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="interleaved repeats; the fastest run of each counts"
    )
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")


def paged_benchmark(
    model,
    *,
    requests: int = 32,
    longest: int = 256,
    max_batch: int = 8,
    block_size: int = 16,
    budget_slots: int = 2,
    repeats: int = 3,
) -> dict:
    """The measurements (returns data, prints nothing); see the module's docstring."""
    from ar_lab.perf.paged_memory import compare_kv, paged_workload, scale_up

    for name, value in (("requests", requests), ("longest", longest), ("repeats", repeats)):
        positive_int(name, value)
    res = compare_kv(
        model,
        paged_workload(requests, longest=longest),
        max_batch=max_batch,
        block_size=block_size,
        budget_slots=budget_slots,
        repeats=repeats,
    )
    res.pop("report")
    s = scale_up()
    res["scale_up"] = {
        "model": s.model,
        "gpu": s.gpu,
        "memory_bytes": s.memory,
        "weight_bytes": s.weights,
        "kv_budget_bytes": s.kv_budget,
        "bytes_per_position": s.bytes_per_position,
        "max_len": s.max_len,
        "block_size": s.block_size,
        "requests": len(s.lengths),
        "mean_length": sum(s.lengths) / len(s.lengths),
        "contiguous_fit": s.contiguous_fit,
        "paged_fit": s.paged_fit,
        "gain": s.gain,
        "contiguous_waste_share": s.contiguous.waste_share,
        "paged_waste_share": s.paged.waste_share,
    }
    res.update(benchmark="paged", repeats=repeats, machine=machine(model.device))
    return res


def format_paged_results(res: dict) -> str:
    runs = res["runs"]
    rows = [
        [
            name,
            f"{r['mean_reserved']:.0f}",
            f"{r['mean_used']:.0f}",
            f"{r['mean_rows']:.2f}",
            r["most_rows"],
            r["decode_steps"],
            f"{r['ms_per_step']:.2f}",
            f"{r['tokens_per_s']:.0f}",
        ]
        for name, r in runs.items()
    ]
    c, p, s = res["contiguous_footprint"], res["paged_footprint"], res["scale_up"]
    return "\n".join(
        [
            f"{res['requests']} requests (longest {res['longest']} positions), {res['max_batch']}"
            f" rows, blocks of {res['block_size']}; fixed budget {res['budget_positions']} "
            f"positions ({res['budget_slots']} slots); every run gave the contiguous cache's "
            "tokens",
            format_table(
                [
                    "KV cache",
                    "reserved (positions, mean)",
                    "used",
                    "rows/step",
                    "most rows",
                    "steps",
                    "ms/step",
                    "tokens/s",
                ],
                rows,
            ),
            f"all requests at once: contiguous reserves {c['reserved']} positions for {c['used']}"
            f" used ({1 - c['used'] / c['reserved']:.0%} waste), paged {p['reserved']} ("
            f"{1 - p['used'] / p['reserved']:.0%})",
            "paged / contiguous with the same slots: "
            f"{res['paged_vs_contiguous_tokens_per_s']:.2f}x tokens/s, "
            f"{res['paged_vs_contiguous_step']:.2f}x the time per decode step (the paged cache's "
            "bookkeeping and gather)",
            f"{s['model']} bf16 on {s['gpu']} ({s['memory_bytes'] / 1e9:.0f} GB, "
            f"{s['kv_budget_bytes'] / 1e9:.1f} GB for KV): {s['contiguous_fit']} requests at "
            f"once with {s['max_len']}-position slots ({s['contiguous_waste_share']:.0%} waste), "
            f"{s['paged_fit']} with blocks of {s['block_size']} ({s['paged_waste_share']:.1%} "
            f"waste): {s['gain']:.1f}x",
        ]
    )


def run(args: argparse.Namespace) -> dict:
    with torch_threads(args.threads):
        model, source = course_model_or_random()
        res = paged_benchmark(
            model,
            requests=args.requests,
            longest=args.longest,
            max_batch=args.max_batch,
            block_size=args.block_size,
            budget_slots=args.budget_slots,
            repeats=args.repeats,
        )
    res["model"] = source
    print(format_paged_results(res))
    return res
