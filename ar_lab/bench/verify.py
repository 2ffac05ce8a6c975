"""Chapter 07's curve on other hardware: one pass over k new positions, in decode steps of the same
model.

Speculative decoding's theory counts the target's verifying pass (k = γ + 1 positions after a cached
context) as one decode step: true while the pass is memory-bound, when reading the weights costs
more than the arithmetic on them. Chapter 07 measures the curve on the learner's CPU with the course
model; this benchmark measures it where a notebook cannot, on a GPU: a random-init model whose
weights stream from memory (``measure.CONFIGS``; the "gpu" one, 6.5 B parameters in bf16, on CUDA),
every pass replayed as a CUDA graph, and the course checkpoint, both timed in turns over k
(``measure.prepare_forward``).
"""

from __future__ import annotations

import argparse

from ar_lab.base.args import positive_int
from ar_lab.base.errors import BadValue
from ar_lab.base.timing import interleaved, machine, median
from ar_lab.bench.common import checked_device
from ar_lab.bench.table import format_table

DEFAULT_KS = (1, 2, 3, 5, 9, 17, 33)


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument(
        "--config",
        choices=["small", "cpu", "gpu"],
        default=None,
        help="random-init model from ar_lab.perf.measure.CONFIGS (default: gpu on CUDA, cpu on a "
        "CPU)",
    )
    p.add_argument(
        "--ks",
        type=int,
        nargs="+",
        default=list(DEFAULT_KS),
        help="new positions per pass (1 first)",
    )
    p.add_argument(
        "--past", type=int, default=64, help="cached positions before the pass (default 64)"
    )
    p.add_argument(
        "--rounds", type=int, default=20, help="interleaved rounds; the median counts (default 20)"
    )
    p.add_argument("--quick", action="store_true", help="a tiny model and two sizes: a smoke test")


def verify_curve(model, ks, past: int, rounds: int, *, cuda_graph: bool) -> dict:
    """Median seconds of a pass over each k of ``ks`` after ``past`` cached positions, timed in
    turns, with the time, FLOPs and bytes of each pass relative to k = 1 (one decode step)."""
    from ar_lab.model.inference import inference
    from ar_lab.perf.measure import prepare_forward

    ks = [positive_int("ks", k) for k in ks]  # the one rule for counts: bools and 0 refused
    if not ks or ks[0] != 1:
        raise BadValue(
            f"ks must start with 1 (one decode step, what the others are divided by), got {ks!r}",
            arg="ks",
        )
    positive_int("past", past)
    positive_int("rounds", rounds)
    with inference(model):
        passes = {
            k: prepare_forward(model, k, past, 1, phase="verify", cuda_graph=cuda_graph) for k in ks
        }
        times = interleaved(
            {k: p[0] for k, p in passes.items()}, rounds, warmup=2, device=model.device
        )
    seconds = {k: median(times[k]) for k in ks}
    one = passes[1][1]
    return {
        "parameters": model.num_parameters(),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "mode": passes[1][2],
        "rows": {
            k: {
                "seconds": seconds[k],
                "time": seconds[k] / seconds[1],
                "flops": c.flops / one.flops,
                "bytes": c.bytes / one.bytes,
            }
            for k, (_fn, c, _mode, _note) in passes.items()
        },
    }


def run(args: argparse.Namespace) -> dict:
    import torch

    from ar_lab.model.gpt import GPTConfig
    from ar_lab.model.train import load_pretrained
    from ar_lab.perf.measure import CONFIGS, build_model

    device = checked_device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    if args.quick:
        cfg, ks, past = GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=64), [1, 2], 16
    else:
        cfg, ks, past = CONFIGS[args.config or ("gpu" if cuda else "cpu")], list(args.ks), args.past
    models = {"random init": lambda: build_model(cfg, device),
              "course checkpoint": lambda: load_pretrained("course", device)}
    result = {"device": device.type, "past": past, "models": {}, "machine": machine(device)}
    # one model at a time: the first is freed before the next is made
    for name, built in models.items():
        model = built()
        print(f"  {name}: {model.num_parameters() / 1e6:,.1f} M parameters", flush=True)
        result["models"][name] = verify_curve(model, ks, past, args.rounds, cuda_graph=cuda)
    print()
    print(format_verify_results(result))
    return result


def format_verify_results(result: dict) -> str:
    rows = []
    for name, m in result["models"].items():
        for k, r in m["rows"].items():
            rows.append(
                [
                    name,
                    f"{m['parameters'] / 1e6:,.1f} M",
                    m["dtype"],
                    m["mode"],
                    k,
                    f"{r['seconds'] * 1e3:.3f}",
                    f"{r['time']:.2f}",
                    f"{r['flops']:.1f}",
                    f"{r['bytes']:.3f}",
                ]
            )
    headers = [
        "model",
        "parameters",
        "dtype",
        "mode",
        "k",
        "ms",
        "time / step",
        "FLOPs / step",
        "bytes / step",
    ]
    return (
        f"a pass over k new positions after {result['past']} cached ones, against one decode "
        "step (k = 1)\n"
    ) + format_table(headers, rows)
