"""Chapter 05's batching on a CPU: one decode step for B rows against one for a single sequence.

B rows can share one read of the weights. Whether a step does depends on its kernel: through
``GPT.forward`` a few rows are multiplied in ``nn.Linear``'s (out, in) layout, which a CPU's fp32
product of a few rows reads slowly; ar_lab's decoder (``LeanDecoder.step`` on a ``BatchKVCache``)
multiplies them by the copies chapter 07's verify pass uses (``ar_lab.engine.packed``). Measured
on chapter 05's 100 M-parameter model (``measure.CONFIGS["small"]``, weights streamed from main
memory), every row at the same context, all steps in turns; the two batched paths' logits are
checked equal first.
"""

from __future__ import annotations

import argparse

import torch

from ar_lab.base.args import positive_int
from ar_lab.base.errors import BadValue
from ar_lab.base.timing import interleaved, machine, machine_line, median
from ar_lab.bench.common import torch_threads
from ar_lab.bench.table import format_table

GOAL_BATCH, GOAL_RATIO = 4, 1.3  # issue 62: a batch-4 step within 1.3x a batch-1 step


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", choices=["small", "cpu"], default="small",
        help="random-init model from ar_lab.perf.measure.CONFIGS (default small: chapter 05's)",
    )
    p.add_argument("--batches", type=int, nargs="+", default=[2, 4, 8, 16], help="rows per step")
    p.add_argument("--context", type=int, default=64, help="positions each row holds (default 64)")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds; medians reported")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")


def _stepper(decoder, model, batch: int, context: int):
    """A function that runs one decode step for ``batch`` rows at position ``context`` (again at
    every call: the rows are rewound after it), and its first logits."""
    from ar_lab.model.cache import BatchKVCache

    cache = BatchKVCache.for_model(model, max_batch=batch, max_len=context + 1)
    ids = torch.randint(0, model.config.vocab_size, (1, context),
                        generator=torch.Generator().manual_seed(0)).to(model.device)
    for _ in range(batch):
        model(ids, cache.slot(cache.rows))  # the same prompt in every slot
        cache.add(context)
    tokens = torch.arange(batch, device=model.device) % model.config.vocab_size

    def step() -> torch.Tensor:
        logits = decoder.step(tokens, cache, None)
        cache.lengths[:batch] = [context] * batch  # position `context` again next time
        return logits

    return step, step()


def batched_benchmark(config: str = "small", batches=(2, 4, 8, 16), context: int = 64, *,
                      rounds: int = 7) -> dict:
    """Seconds of one decode step at batch 1 (ar_lab's lean step) and at each of ``batches``
    through ar_lab's decoder and through ``GPT.forward``, in turns; each as a multiple of the
    batch-1 step."""
    from ar_lab.engine.decoder import ForwardDecoder, LeanDecoder
    from ar_lab.model.cache import KVCache
    from ar_lab.perf.measure import CONFIGS, build_model

    if config not in CONFIGS:
        raise BadValue(f"config must be one of {sorted(CONFIGS)}, got {config!r}", arg="config")
    batches = [positive_int("batches", b, 2) for b in batches]
    positive_int("rounds", rounds)
    window = CONFIGS[config].block_size
    if positive_int("context", context) >= window:
        raise BadValue(
            f"context must be below the context window of {window}, got {context}", arg="context"
        )
    model = build_model(CONFIGS[config], "cpu", torch.float32)
    lean, forward = LeanDecoder(model), ForwardDecoder(model)
    runs = {}
    with torch.inference_mode():
        one = KVCache.for_model(model, max_len=context + 1)
        lean.prefill(torch.zeros(1, context, dtype=torch.long), one)
        runs[1] = lambda: lean.step(0, one, context)
        for b in batches:
            runs[("ar_lab", b)], ours = _stepper(lean, model, b, context)
            runs[("forward", b)], theirs = _stepper(forward, model, b, context)
            torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)  # the same step
        times = {k: median(v) for k, v in interleaved(runs, rounds, warmup=1).items()}
    base = times[1]
    rows = {
        str(b): {path: {"seconds": times[(path, b)], "x_batch_1": times[(path, b)] / base}
                 for path in ("ar_lab", "forward")}
        for b in batches
    }
    goal = rows.get(str(GOAL_BATCH), {}).get("ar_lab", {}).get("x_batch_1")
    return {
        "benchmark": "batched",
        "config": config,
        "parameters": model.num_parameters(),
        "context": context,
        "rounds": rounds,
        "threads": torch.get_num_threads(),
        "batch_1_seconds": base,
        "batches": rows,
        "goal": {"batch": GOAL_BATCH, "at_most_x_batch_1": GOAL_RATIO,
                 "met": None if goal is None else goal <= GOAL_RATIO},
        "machine": machine(model.device),
    }


def format_batched_results(res: dict) -> str:
    rows = [["1 (lean step)", f"{res['batch_1_seconds'] * 1e3:.1f}", "1.00", "-", "-"]]
    for b, r in res["batches"].items():
        ours, theirs = r["ar_lab"], r["forward"]
        rows.append([b, f"{ours['seconds'] * 1e3:.1f}", f"{ours['x_batch_1']:.2f}",
                     f"{theirs['seconds'] * 1e3:.1f}", f"{theirs['x_batch_1']:.2f}"])
    goal = res["goal"]
    verdict = {True: "met", False: "NOT met", None: "not measured"}[goal["met"]]
    return "\n".join([
        f"batched decode: {res['parameters'] / 1e6:.0f} M parameters, context {res['context']}, "
        f"{res['threads']} thread(s); {machine_line(res['machine'])}",
        format_table(["batch", "ar_lab ms", "x batch 1", "GPT.forward ms", "x batch 1"], rows),
        f"goal: batch {goal['batch']} within {goal['at_most_x_batch_1']}x a batch-1 step "
        f"through ar_lab's decoder: {verdict}",
    ])


def run(args: argparse.Namespace) -> dict:
    with torch_threads(args.threads):
        res = batched_benchmark(args.config, args.batches, args.context, rounds=args.rounds)
    print(format_batched_results(res))
    return res
