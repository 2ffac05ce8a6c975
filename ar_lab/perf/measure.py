"""Chapter 05 measured: forward passes of a model timed on this machine, and the results on disk.

``ar_lab.perf.roofline`` predicts what a pass costs (FLOPs and bytes, from the config) and
``ar_lab.perf.peaks`` measures the machine's two roofs; this module times the passes themselves:
``measure_prefill``, ``measure_decode`` and the general ``measure_forward`` (time per pass ->
achieved FLOP/s and bytes/s, a ``Point``); ``ar_lab.perf.side_by_side`` times a decode step in
interleaved pairs against another call. ``run_roofline`` gathers peaks and points in the JSON-ready
dict that ``python -m ar_lab.bench roofline`` writes and chapter 05 plots
(``ar_lab.course.views.plots.plot_roofline``); reference runs made by the same command lie in the
data folder as ``roofline_<name>.json`` (``reference_files``, ``load_result``). On a CPU the passes
run in fp32, on CUDA in bf16, timed by ``ar_lab.base.timing``.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ar_lab.base.args import positive_int
from ar_lab.base.errors import BadType, BadValue, named
from ar_lab.base.timing import checked_device, default_device, interleaved, machine, time_call
from ar_lab.engine import graphed
from ar_lab.model import data
from ar_lab.model.cache import KVCache
from ar_lab.model.gpt import GPT, GPTConfig
from ar_lab.model.inference import inference
from ar_lab.perf.peaks import checked_peaks, default_dtype, measure_peaks
from ar_lab.perf.roofline import (
    PhaseCost,
    attainable_flops,
    decode_cost,
    forward_cost,
    prefill_cost,
    ridge_point,
)

# the JSON format of a result (unchanged since the first shipped references)
SCHEMA = "ar_lab.roofline/1"


# --- 1. passes of a model ----------------------------------------------------------


@dataclass
class Point:
    """One measured forward pass: its analytic cost and the measured seconds."""

    cost: PhaseCost
    times: list[float]
    mode: str = "eager"  # "eager", or "cuda graph" (the pass replayed as one captured CUDA graph)
    note: str = ""  # why a requested CUDA graph fell back to eager, if it did

    @property
    def seconds(self) -> float:
        return statistics.median(self.times)

    @property
    def flops_per_s(self) -> float:
        return self.cost.flops / self.seconds

    @property
    def bytes_per_s(self) -> float:
        return self.cost.bytes / self.seconds

    def to_dict(self) -> dict:
        return {
            **self.cost.to_dict(),
            "seconds": self.seconds,
            "times": self.times,
            "flops_per_s": self.flops_per_s,
            "bytes_per_s": self.bytes_per_s,
            "mode": self.mode,
            **({"note": self.note} if self.note else {}),
        }


def measure_forward(
    model,
    tokens: int,
    past: int = 0,
    batch: int = 1,
    *,
    repeats: int = 3,
    phase: str = "",
    cuda_graph: bool = False,
) -> Point:
    """Time one forward pass of ``tokens`` new tokens per sequence after ``past`` cached positions.

    The cache stands for ``past`` earlier positions: its buffers are filled with random
    keys and values rather than computed by a prefill (the time of a pass does not
    depend on the values, and a batch-64 prefill just to fill it would cost more than
    the measurement). Every timed pass rolls the cache back to ``past`` first, so every
    repeat is the same pass. ``tokens`` > 1 after a cached prefix is what a prompt-cache
    hit or the verification pass of speculative decoding runs.

    ``cuda_graph=True`` (CUDA only; ignored on a CPU) captures the pass once and times
    replays of the graph: the GPU then runs the same kernels without Python launching
    each of them, which is what a small-batch decode step on a fast GPU needs to be
    limited by memory rather than by launches. If capture fails, the pass is timed
    eagerly and ``Point.note`` says why. The model runs in eval mode; its own mode is
    restored afterwards.
    """
    with inference(model):
        fn, cost, mode, note = prepare_forward(
            model, tokens, past, batch, phase=phase, cuda_graph=cuda_graph
        )
        times = time_call(fn, repeats=repeats, warmup=1 if tokens > 1 else 2, device=model.device)
    return Point(cost, times, mode, note)


def prepare_forward(
    model, tokens: int, past: int = 0, batch: int = 1, *, phase: str = "", cuda_graph: bool = False
) -> tuple[Callable[[], None], PhaseCost, str, str]:
    """The pass ``measure_forward`` times, ready to call: (function, cost, mode, note).

    Each call of the function runs the model in eval mode and restores its mode.
    """
    positive_int("tokens", tokens)
    positive_int("batch", batch)
    bytes_per_value = next(model.parameters()).element_size()
    cost = forward_cost(model.config, batch, tokens, past, bytes_per_value, phase)
    with inference(model):
        cache = KVCache.for_model(model, batch_size=batch, max_len=past + tokens)
        g = torch.Generator(device=model.device).manual_seed(0)
        for buf in cache.k + cache.v:
            buf.normal_(generator=g)
        cache.length = past
        ids = torch.randint(
            0, model.config.vocab_size, (batch, tokens), generator=torch.Generator().manual_seed(1)
        )
        idx = ids.to(model.device)  # (B, T)

        def step():
            with inference(model):
                cache.truncate(past)
                model(idx, cache)

        fn, mode, note = step, "eager", ""
        if cuda_graph and model.device.type == "cuda":
            try:
                fn, mode = graphed.cuda_graph(step, model.device)[0], "cuda graph"
            except RuntimeError as e:  # capture is beta in PyTorch: fall back, and say so
                note = f"CUDA graph capture failed, timed eagerly: {e}"
    return fn, cost, mode, note


def measure_prefill(
    model, prompt_len: int, batch: int = 1, *, repeats: int = 3, cuda_graph: bool = False
) -> Point:
    """Time one prefill pass: ``batch`` prompts of ``prompt_len`` tokens into an empty KV cache."""
    positive_int("prompt_len", prompt_len)
    # a too-long prompt_len is named as such
    _fits(model, lambda cfg: prefill_cost(cfg, prompt_len))
    return measure_forward(
        model, prompt_len, 0, batch, repeats=repeats, phase="prefill", cuda_graph=cuda_graph
    )


def measure_decode(
    model, context: int, batch: int = 1, *, repeats: int = 5, cuda_graph: bool = False
) -> Point:
    """Time one decode step at ``context``: ``batch`` new tokens, each attending to ``context``
    positions."""
    positive_int("context", context)
    _fits(model, lambda cfg: decode_cost(cfg, context))  # a too-long context is named as such
    return measure_forward(
        model, 1, context - 1, batch, repeats=repeats, phase="decode", cuda_graph=cuda_graph
    )


def _fits(model, cost: Callable[[GPTConfig], PhaseCost]) -> None:
    """Run ``cost`` on the model's config, if it has one, for its errors (prepare_forward's own name
    past/tokens)."""
    if isinstance(getattr(model, "config", None), GPTConfig):
        cost(model.config)


def fastest_threads(
    model, context: int = 64, candidates: Sequence[int] | None = None, *, repeats: int = 3
) -> dict:
    """Time a batch-1 decode step with each CPU thread count in ``candidates`` (default: 1 and all).

    A decode step is a chain of small kernels, each split across the threads and
    joined again. On a quiet machine more threads pull more bandwidth; on a busy one a
    thread that has lost its core makes every join wait, and one thread can win by
    far. Returns {"seconds": {threads: median seconds}, "best": threads}; the thread
    count is restored (set it yourself with ``torch.set_num_threads``).
    """
    original = torch.get_num_threads()
    candidates = list(candidates) if candidates else sorted({1, original})
    seconds = {}
    try:
        for t in candidates:
            named("candidates", lambda t=t: positive_int("threads", t))
            torch.set_num_threads(int(t))
            seconds[t] = measure_decode(model, context, 1, repeats=repeats).seconds
    finally:
        torch.set_num_threads(original)
    return {"seconds": seconds, "best": min(seconds, key=seconds.get)}


# --- 2. the full run ---------------------------------------------------------------

# Random-init configs for the roofline (speed does not depend on training). "small":
# ~100 M parameters, the chapter-05 notebook's model; "cpu": ~300 M parameters (1.2 GB
# in fp32, several times the largest CPU cache); "gpu": ~6.5 B parameters (13 GB in
# bf16), big enough that a decode step is memory traffic, not kernel launches.
CONFIGS: dict[str, GPTConfig] = {
    "small": GPTConfig(block_size=512, n_layer=8, n_head=16, n_embd=1024),
    "cpu": GPTConfig(block_size=1024, n_layer=24, n_head=16, n_embd=1024),
    "gpu": GPTConfig(block_size=4096, n_layer=32, n_head=32, n_embd=4096),
}


def build_model(
    cfg: GPTConfig,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    *,
    seed: int = 0,
) -> GPT:
    """A randomly initialised ``GPT(cfg)`` in eval mode, created directly on ``device`` in
    ``dtype``.

    No full-precision or CPU copy is made first: a 6 B-parameter model in bf16 needs
    13 GB on the GPU, not 26 GB of fp32 on the way there.
    """
    if not isinstance(cfg, GPTConfig):
        raise BadType(
            f"cfg must be a GPTConfig (e.g. ar_lab.perf.measure.CONFIGS['small']), got {cfg!r}",
            arg="cfg",
        )
    device = default_device() if device is None else checked_device(device)
    dtype = default_dtype(device) if dtype is None else dtype
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = GPT(cfg)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def run_roofline(
    model,
    prompt_lens: Sequence[int] = (16, 64, 256),
    decode_batches: Sequence[int] = (1, 4, 16, 64),
    decode_context: int = 128,
    decode_contexts: Sequence[int] = (),
    *,
    peaks: dict | None = None,
    matmul_size: int | None = None,
    buffer_bytes: int | None = None,
    repeats: int = 3,
    progress: Callable[[str], None] | None = None,
    cuda_graph: bool = False,
) -> dict:
    """Measure the peaks (unless given) and the prefill/decode points; return the JSON-ready result.

    Prefill at each of ``prompt_lens`` (batch 1); decode at ``decode_context`` for each
    of ``decode_batches``, and at batch 1 for each of ``decode_contexts``.
    """
    device, dtype = model.device, next(model.parameters()).dtype
    say = progress or (lambda _msg: None)
    decodes = [(decode_context, b) for b in decode_batches] + [(c, 1) for c in decode_contexts]
    for t in prompt_lens:  # every size is checked before anything is measured
        named("prompt_lens", lambda t=t: prefill_cost(model.config, t))
    for b in decode_batches:
        named("decode_context", lambda: decode_cost(model.config, decode_context))
        named("decode_batches", lambda b=b: decode_cost(model.config, decode_context, b))
    for c in decode_contexts:
        named("decode_contexts", lambda c=c: decode_cost(model.config, c))
    if peaks is None:
        say("measuring the peaks")
        peaks = measure_peaks(device, dtype, matmul_size=matmul_size, buffer_bytes=buffer_bytes)
    peaks, points = checked_peaks(peaks), []
    for t in prompt_lens:
        say(f"prefill {t} tokens")
        points.append(measure_prefill(model, t, 1, repeats=repeats, cuda_graph=cuda_graph))
    points += _decode_points(model, decodes, max(repeats, 3), cuda_graph, say)
    result = {
        "schema": SCHEMA,
        **machine(device),
        "dtype": str(dtype).removeprefix("torch."),
        "model": {
            "config": model.config.to_dict(),
            "parameters": model.num_parameters(),
            "weight_bytes": sum(p.nbytes for p in model.parameters()),
        },
        "peaks": peaks,
        "ridge_point": ridge_point(peaks["matmul_flops_per_s"], peaks["bandwidth_bytes_per_s"]),
        "points": [p.to_dict() for p in points],
    }
    result["key_figures"] = key_figures(result)
    return result


def _decode_points(model, decodes, rounds: int, cuda_graph: bool, say) -> list[Point]:
    """Decode steps at each (context, batch), timed in turns (``ar_lab.base.timing.interleaved``): a
    load that comes and goes on a shared machine then slows every batch alike, and the points keep
    their order."""
    if not decodes:
        return []
    say(f"decode steps at {len(decodes)} (context, batch) pairs, in turns")
    with inference(model):
        prepared = {
            key: prepare_forward(
                model, 1, key[0] - 1, key[1], phase="decode", cuda_graph=cuda_graph
            )
            for key in decodes
        }
        times = interleaved(
            {key: p[0] for key, p in prepared.items()}, rounds, warmup=2, device=model.device
        )
    return [
        Point(cost, times[key], mode, note) for key, (_fn, cost, mode, note) in prepared.items()
    ]


def key_figures(result: dict) -> dict:
    """Decode at batch 1: fraction of the measured bandwidth; largest prefill: fraction of the
    matmul peak."""
    peaks = result["peaks"]
    decode = [p for p in result["points"] if p["phase"] == "decode" and p["batch"] == 1]
    prefill = [p for p in result["points"] if p["phase"] == "prefill"]
    out = {}
    if decode:
        # the weights dominate at the shortest context
        best = min(decode, key=lambda p: p["context"])
        out["decode_bandwidth_fraction"] = best["bytes_per_s"] / peaks["bandwidth_bytes_per_s"]
        out["decode_context"] = best["context"]
    if prefill:
        big = max(prefill, key=lambda p: p["tokens"] * p["batch"])
        out["prefill_compute_fraction"] = big["flops_per_s"] / peaks["matmul_flops_per_s"]
        out["prefill_tokens"] = big["tokens"]
    return out


# --- 3. results on disk ------------------------------------------------------------


def load_result(path: str | Path) -> dict:
    """Read a roofline JSON file written by ``python -m ar_lab.bench roofline --json PATH``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"no roofline result at {path} (write one: python -m ar_lab.bench roofline --json)"
        )
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadValue(f"path {path} is not valid JSON: {e}", arg="path") from None
    required = ("schema", "device", "dtype", "versions", "date", "peaks", "points")
    missing = (
        [k for k in required if k not in result] if isinstance(result, dict) else list(required)
    )
    if missing:
        raise BadValue(f"path {path} is not a roofline result: missing {missing}", arg="path")
    if result["schema"] != SCHEMA:
        raise BadValue(
            f"path {path} has schema {result['schema']!r}; this version of ar_lab reads {SCHEMA!r}",
            arg="path",
        )
    checked_peaks(result["peaks"], f"path {path}: peaks", arg="path")
    for i, p in enumerate(result["points"]):
        for k in ("phase", "batch", "tokens", "context", "intensity", "flops_per_s", "seconds"):
            if not isinstance(p, dict) or k not in p:
                raise BadValue(f"path {path}: point {i} has no {k!r}", arg="path")
    return result


def reference_files(
    data_dir: str | Path | None = None, device_type: str | None = None
) -> list[Path]:
    """The roofline results in ``data_dir`` (default: the data folder,
    ``ar_lab.model.data.data_dir()``) named ``roofline_*.json``, optionally only those of one device
    type."""
    folder = data.data_dir() if data_dir is None else Path(data_dir)
    if not folder.is_dir():
        raise FileNotFoundError(f"no folder {folder} to look for roofline_*.json in")
    paths = sorted(folder.glob("roofline_*.json"))
    return [
        p for p in paths if device_type is None or load_result(p)["device"]["type"] == device_type
    ]


SUMMARY_HEADERS = [
    "phase",
    "batch",
    "tokens",
    "context",
    "ms",
    "FLOP/byte",
    "GFLOP/s",
    "GB/s",
    "of roof",
]


def summary_rows(result: dict) -> list[list]:
    """Rows for a table under ``SUMMARY_HEADERS``, one per measured point."""
    peaks, rows = result["peaks"], []
    for p in result["points"]:
        roof = attainable_flops(
            p["intensity"], peaks["matmul_flops_per_s"], peaks["bandwidth_bytes_per_s"]
        )
        ms, intensity = round(p["seconds"] * 1e3, 2), round(p["intensity"], 1)
        gflops, gbytes = round(p["flops_per_s"] / 1e9, 1), round(p["bytes_per_s"] / 1e9, 1)
        of_roof = f"{p['flops_per_s'] / roof:.0%}"
        rows.append(
            [
                p["phase"],
                p["batch"],
                p["tokens"],
                p["context"],
                ms,
                intensity,
                gflops,
                gbytes,
                of_roof,
            ]
        )
    return rows
