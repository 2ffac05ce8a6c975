"""A batch-1 decode step timed side by side with another call, in interleaved pairs (chapter 05).

On a shared machine the load changes from one second to the next, so two figures
measured one after the other can differ by more than the effect they are meant to show.
Here each timed decode step follows one timed call of something else, ``pairs`` times, and
the figures are ratios of the two sides' medians: drift hits both sides alike.
``decode_bandwidth_fraction`` puts the step beside the fastest streaming kernel (how
close decode comes to the bandwidth); ``decode_step_growth`` puts a step at a long
context beside one at a short context (what a longer KV cache costs). The passes come
from ``ar_lab.perf.measure.prepare_forward``, timed by ``ar_lab.base.timing``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch

from ar_lab.base.args import positive_int
from ar_lab.base.errors import BadValue
from ar_lab.base.timing import interleaved, time_call
from ar_lab.model.inference import inference
from ar_lab.perf.measure import prepare_forward
from ar_lab.perf.peaks import streaming_kernels
from ar_lab.perf.roofline import decode_cost


def decode_bandwidth_fraction(
    model,
    context: int = 64,
    *,
    pairs: int = 25,
    threads: Sequence[int] | None = None,
    buffer_bytes: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """How close a batch-1 decode step comes to the streaming bandwidth, measured side by side.

    First every streaming kernel is measured once and the fastest is kept. Then, for
    each way of running the step (on a CPU: each thread count in ``threads``, default 1
    and all; on CUDA: eager and as a CUDA graph), ``pairs`` times: one call of that
    kernel is timed and immediately after it one decode step at ``context``, so a shared
    machine's changing load hits both sides alike. The figure is the step's
    bytes/s at its median time over the kernel's bytes/s at its median time; the
    quartiles and range of the per-pair ratios show the noise. ``of_roof`` divides by
    the kernel's *fastest* call instead (the roof drawn on the plot: a conservative
    ratio). ``best`` names the variant with the highest figure (``best_threads`` /
    ``cuda_graph`` say how to run it). The thread count and the model's mode are restored.
    """
    # checks the context against the window before anything is timed
    decode_cost(model.config, context)
    positive_int("pairs", pairs)
    device, dtype = model.device, next(model.parameters()).dtype
    say = progress or (lambda _msg: None)
    original = torch.get_num_threads()
    variants = _step_variants(device, threads, original)
    kernels, _ = streaming_kernels(device, dtype, nbytes=buffer_bytes)
    rates = {
        n: moved / min(time_call(fn, repeats=5, warmup=1, device=device))
        for n, (fn, moved) in kernels.items()
    }
    kernel = max(rates, key=rates.get)  # each kernel at its best call, as for the roof
    probe, probe_bytes = kernels[kernel]
    # variant -> [(probe seconds, step seconds)]; variant -> (function, mode, note)
    samples, steps = {}, {}
    with inference(model):
        try:
            for name, (t, graph) in variants.items():
                torch.set_num_threads(t)
                fn, cost, mode, note = prepare_forward(
                    model, 1, context - 1, 1, phase="decode", cuda_graph=graph
                )
                steps[name] = (fn, mode, note)
            # One variant after the other (switching thread counts between pairs would time
            # one variant's kernel against the other's still-spinning worker threads).
            for name, (t, _graph) in variants.items():
                torch.set_num_threads(t)
                samples[name] = _paired_times(probe, steps[name][0], pairs, device)
                say(
                    f"{name}: {_fraction(samples[name], cost.bytes, probe_bytes):.0%} of the "
                    "streaming bandwidth"
                )
        finally:
            torch.set_num_threads(original)
    by_variant = {}
    for name, (t, graph) in variants.items():
        _fn, mode, note = steps[name]
        by_variant[name] = {
            **_pair_figures(samples[name], cost.bytes, probe_bytes),
            "threads": t,
            "cuda_graph": graph,
            "mode": mode,
            **({"note": note} if note else {}),
            "pairs": [{"probe_seconds": a, "decode_seconds": b} for a, b in samples[name]],
        }
    best = max(by_variant, key=lambda n: by_variant[n]["fraction"])
    return {
        "context": context,
        "decode_bytes": cost.bytes,
        "kernel": kernel,
        "kernel_bytes": probe_bytes,
        "kernel_rates": rates,
        "by_variant": by_variant,
        "best": best,
        "best_threads": by_variant[best]["threads"],
        "cuda_graph": by_variant[best]["cuda_graph"],
        "fraction": by_variant[best]["fraction"],
        "fraction_of_roof": by_variant[best]["of_roof"],
    }


def decode_step_growth(model, short: int, long: int, *, pairs: int = 60) -> dict:
    """How much longer a batch-1 decode step takes at context ``long`` than at ``short``.

    A step at a longer context reads a longer KV cache, but on a small model that extra
    read can be a fifth of the step or less: smaller than the drift of a shared machine
    between two separate runs. So the two steps are timed in ``pairs`` interleaved pairs
    (one short step, then one long step), and the figure is the ratio of their median
    times. Returns ``{"short", "long", "short_seconds", "long_seconds", "ratio"}``.
    """
    positive_int("short", short)
    positive_int("pairs", pairs)
    if long <= short:
        raise BadValue(
            f"long must be a longer context than short, got short={short}, long={long}", arg="long"
        )
    try:
        # checks the context against the window before anything is timed
        decode_cost(model.config, long)
    except BadValue as error:
        raise type(error)(f"long: {error}", arg="long") from None
    with inference(model):
        step_short = prepare_forward(model, 1, short - 1, phase="decode")[0]
        step_long = prepare_forward(model, 1, long - 1, phase="decode")[0]
        samples = _paired_times(step_short, step_long, pairs, model.device)
    a = statistics.median(t for t, _ in samples)
    b = statistics.median(t for _, t in samples)
    return {"short": short, "long": long, "short_seconds": a, "long_seconds": b, "ratio": b / a}


def _step_variants(
    device: torch.device, threads: Sequence[int] | None, original: int
) -> dict[str, tuple[int, bool]]:
    """{name: (thread count, CUDA graph)}: on CUDA eager and graph; on a CPU each thread count."""
    if device.type == "cuda":
        return {"eager": (original, False), "cuda graph": (original, True)}
    ts = sorted({positive_int("threads", t) for t in threads}) if threads else sorted({1, original})
    return {f"{t} thread{'s' if t > 1 else ''}": (t, False) for t in ts}


def _paired_times(probe: Callable, step: Callable, pairs: int, device) -> list[tuple[float, float]]:
    """``pairs`` times: one probe call timed, then one step timed right after it."""
    step()  # the first calls after a switch are slower: one more warm-up call for the step
    t = interleaved({"probe": probe, "step": step}, pairs, warmup=2, rotate=False, device=device)
    return list(zip(t["probe"], t["step"], strict=True))


def _fraction(samples: list[tuple[float, float]], step_bytes: float, probe_bytes: float) -> float:
    """(step bytes / median step seconds) / (probe bytes / median probe seconds)."""
    step = statistics.median(b for _, b in samples)
    probe = statistics.median(a for a, _ in samples)
    return (step_bytes / step) / (probe_bytes / probe)


def _pair_figures(
    samples: list[tuple[float, float]], step_bytes: float, probe_bytes: float
) -> dict:
    """One variant's figure, the spread of its per-pair ratios, and both rates at the median
    times."""
    fr = sorted(step_bytes / b / (probe_bytes / a) for a, b in samples)
    step_rate = step_bytes / statistics.median(b for _, b in samples)
    return {
        "fraction": _fraction(samples, step_bytes, probe_bytes),
        "pair_quartiles": statistics.quantiles(fr, n=4, method="inclusive")
        if len(fr) > 1
        else fr * 3,
        "pair_range": [fr[0], fr[-1]],
        "of_roof": step_rate / (probe_bytes / min(a for a, _ in samples)),
        "decode_bytes_per_s": step_rate,
        "bandwidth_bytes_per_s": probe_bytes / statistics.median(a for a, _ in samples),
    }
