"""KV memory reserved against used: contiguous max-length slots against paged blocks (chapter 08).

A contiguous cache reserves, for every request, room for the longest one the server accepts; the
request fills only its own length, and the rest is waste (internal fragmentation of the whole
reservation). A paged cache (``ar_lab.engine.paged``) reserves whole blocks as a request grows: the
only waste is the unfilled part of each request's last block, and any free block serves any
request (no external fragmentation). These functions count both for a list of request lengths,
how many requests fit a fixed budget each way, and the same question for a real model on a real
GPU (``scale_up``: Llama-3-8B on an 80 GB card by default, from ``ar_lab.perf.llm_costs``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from ar_lab.base.args import positive_int
from ar_lab.base.errors import BadValue, ContextFull
from ar_lab.base.timing import interleaved, steady_clock
from ar_lab.engine.paged import PagedKVCache, blocks_for
from ar_lab.engine.prompts import prompt_ids
from ar_lab.engine.serving import Request, ServeReport, serve
from ar_lab.perf.gpus import as_gpu
from ar_lab.perf.llm_costs import as_model, kv_memory, weight_memory
from ar_lab.perf.serving_measure import PROMPTS


def _lengths(lengths) -> list[int]:
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence) or not lengths:
        raise BadValue(
            f"lengths must be a non-empty list of request lengths (ints >= 1), got {lengths!r}",
            arg="lengths",
        )
    return [positive_int(f"lengths[{i}]", n, arg="lengths") for i, n in enumerate(lengths)]


@dataclass(frozen=True)
class Footprint:
    """KV memory set aside for some requests, and the part of it holding keys and values (positions
    or bytes: whatever unit the counts were made in)."""

    reserved: int
    used: int

    @property
    def waste(self) -> int:
        return self.reserved - self.used

    @property
    def waste_share(self) -> float:
        """The share of the reservation that holds nothing."""
        return self.waste / self.reserved if self.reserved else 0.0


def contiguous_footprint(
    lengths: Sequence[int], max_len: int, bytes_per_position: int = 1
) -> Footprint:
    """Every request reserves ``max_len`` positions (the longest the server accepts) and fills its
    length."""
    lengths, max_len = _lengths(lengths), positive_int("max_len", max_len)
    bpp = positive_int("bytes_per_position", bytes_per_position)
    if max(lengths) > max_len:
        raise ContextFull(
            f"a request of {max(lengths)} positions does not fit max_len={max_len}", arg="max_len"
        )
    return Footprint(len(lengths) * max_len * bpp, sum(lengths) * bpp)


def paged_footprint(
    lengths: Sequence[int], block_size: int, bytes_per_position: int = 1
) -> Footprint:
    """Every request reserves ceil(length / block_size) blocks: at most one partly filled block
    each."""
    lengths, bs = _lengths(lengths), positive_int("block_size", block_size)
    bpp = positive_int("bytes_per_position", bytes_per_position)
    return Footprint(sum(blocks_for(n, bs) for n in lengths) * bs * bpp, sum(lengths) * bpp)


def fit_contiguous(lengths: Sequence[int], budget: int, max_len: int) -> int:
    """How many of ``lengths`` (in order) run at once in ``budget`` positions, each reserving
    ``max_len``."""
    lengths, budget, max_len = (
        _lengths(lengths),
        positive_int("budget", budget, 0),
        positive_int("max_len", max_len),
    )
    return min(len(lengths), budget // max_len)


def fit_paged(lengths: Sequence[int], budget: int, block_size: int) -> int:
    """How many of ``lengths`` (in order) run at once in ``budget`` positions of ``block_size``
    blocks."""
    lengths, bs = _lengths(lengths), positive_int("block_size", block_size)
    free, n = positive_int("budget", budget, 0) // bs, 0
    for length in lengths:
        free -= blocks_for(length, bs)
        if free < 0:
            break
        n += 1
    return n


def mixed_lengths(n: int, max_len: int, *, shortest: int = 64, seed: int = 0) -> list[int]:
    """``n`` request lengths (prompt + answer) drawn log-uniformly from ``shortest`` to ``max_len``,
    seeded: many short chats, a few long documents (a stand-in for a real trace)."""
    n, max_len, shortest = (
        positive_int("n", n),
        positive_int("max_len", max_len),
        positive_int("shortest", shortest),
    )
    if shortest > max_len:
        raise BadValue(f"shortest ({shortest}) must be at most max_len ({max_len})", arg="shortest")
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=g, dtype=torch.float64)
    return [min(max_len, round(shortest * (max_len / shortest) ** float(x))) for x in u]


@dataclass(frozen=True)
class ScaleUp:
    """How many requests of ``lengths`` fit a GPU's KV memory at once, contiguous against paged."""

    model: str
    gpu: str
    memory: float  # the GPU's bytes
    weights: float  # bytes the weights take (bf16)
    bytes_per_position: int  # K and V of one position, all layers
    max_len: int  # the model's window: what a contiguous slot reserves
    block_size: int
    lengths: list[int]
    contiguous_fit: int
    paged_fit: int
    contiguous: Footprint  # bytes, for the requests that fit contiguously
    paged: Footprint  # bytes, for the requests that fit paged

    @property
    def kv_budget(self) -> int:
        """Bytes left for the KV cache after the weights (activations and workspace not counted)."""
        return int(self.memory - self.weights)

    @property
    def gain(self) -> float:
        """Concurrent requests paged / contiguous."""
        return self.paged_fit / self.contiguous_fit if self.contiguous_fit else math.inf


def scale_up(
    shape="Llama-3-8B",
    gpu="H100 SXM",
    *,
    n_requests: int = 1000,
    block_size: int = 16,
    seed: int = 0,
    lengths=None,
) -> ScaleUp:
    """``shape`` (a name of ``llm_costs.MODELS``) in bf16 on ``gpu`` (a name of ``gpus.GPUS``, 80 GB
    for the H100 SXM): the weights subtracted, how many of ``lengths`` (by default
    ``mixed_lengths(n_requests, window)``) fit at once with contiguous slots of the model's window
    against paged blocks, and the waste of each."""
    shape, spec = as_model(shape), as_gpu(gpu)
    if lengths is None:
        positive_int("n_requests", n_requests)
    window = shape.max_context
    lengths = mixed_lengths(n_requests, window, seed=seed) if lengths is None else _lengths(lengths)
    bpp = int(kv_memory(shape, 1))  # bf16 keys and values of one position, all layers
    weights = weight_memory(shape)
    budget = max(0, int(spec.memory - weights)) // bpp  # positions
    nc, npg = fit_contiguous(lengths, budget, window), fit_paged(lengths, budget, block_size)
    if nc == 0 or npg == 0:
        raise BadValue(
            f"{shape.name}'s weights leave no room for one request's KV cache on the {spec.name}"
            ": choose a gpu with more memory",
            arg="gpu",
        )
    return ScaleUp(
        shape.name,
        spec.name,
        spec.memory,
        weights,
        bpp,
        window,
        block_size,
        list(lengths),
        nc,
        npg,
        contiguous_footprint(lengths[:nc], window, bpp),
        paged_footprint(lengths[:npg], block_size, bpp),
    )


# --- measured on a model: serving with slots against serving on blocks ------------------------


def paged_workload(
    n: int = 16, *, longest: int = 192, shortest: int = 4, seed: int = 0
) -> list[Request]:
    """``n`` requests with short documentation prompts and answers of ``shortest`` to ``longest``
    new tokens, drawn log-uniformly (seeded): most answers short, a few long, as in a chat
    service."""
    news = mixed_lengths(n, longest, shortest=shortest, seed=seed)
    return [Request(PROMPTS[i % len(PROMPTS)], k, name=f"r{i}") for i, k in enumerate(news)]


def _reports(model, requests, options: dict[str, dict], repeats: int, clock) -> tuple[dict, dict]:
    """``serve`` once per option set, in turns, ``repeats`` times: the fastest report of each, and
    all times."""
    best: dict[str, ServeReport] = {}

    def run(name: str):
        def go() -> None:
            r = serve(model, requests, eos_id=None, **options[name])
            if name not in best or r.total_time < best[name].total_time:
                best[name] = r
        return go

    times = interleaved(
        {name: run(name) for name in options}, repeats, clock=clock, device=model.device
    )
    return best, times


def compare_kv(model, requests: Sequence[Request], *, max_batch: int = 8, block_size: int = 16,
               budget_slots: int = 2, repeats: int = 2) -> dict:
    """Serve ``requests`` with slots (``BatchKVCache``) and on blocks (``PagedKVCache``), and
    compare.

    - *same slots*: ``max_batch`` rows both ways, the paged pool as large as the slots: the same
      schedule, so the difference in time is the paged cache's bookkeeping and gather (timed in
      turns).
    - *fixed budget*: KV memory for ``budget_slots`` contiguous slots of the longest request; the
      paged pool of the same bytes admits a request whenever all of it fits, up to ``max_batch``
      rows.

    Every run gives the same tokens (checked). Memory in positions (``bytes_per_position``
    converts)."""
    positive_int("max_batch", max_batch)
    positive_int("block_size", block_size)
    positive_int("budget_slots", budget_slots)
    positive_int("repeats", repeats)
    ids = [prompt_ids(r.prompt) for r in requests]
    # each one's longest
    lengths = [len(p) + r.max_new_tokens - 1 for p, r in zip(ids, requests, strict=True)]
    longest = max(lengths)
    budget = budget_slots * longest  # positions
    # within the budget (the longest must fit)
    pool = max(budget // block_size, blocks_for(longest, block_size))
    options = {
        "contiguous": {"max_batch": max_batch},
        "paged": {"max_batch": max_batch, "kv": "paged", "block_size": block_size},
        "contiguous, fixed budget": {"max_batch": budget_slots},
        "paged, fixed budget": {"max_batch": max_batch, "kv": "paged", "block_size": block_size,
                                "num_blocks": pool},
    }
    best, times = _reports(model, requests, options, repeats, steady_clock(model.device))
    want = [r.tokens for r in best["contiguous"].results]
    for name, rep in best.items():
        if [r.tokens for r in rep.results] != want:
            raise AssertionError(f"serving {name} gave other tokens than the contiguous cache")
    runs = {
        name: {
            "seconds": min(times[name]),
            "tokens_per_s": rep.tokens / min(times[name]),
            "decode_steps": rep.decode_steps,
            "mean_rows": rep.mean_rows,
            "most_rows": max(rep.step_rows),
            "ms_per_step": 1e3 * statistics.median(rep.step_times),
            "mean_reserved": statistics.fmean(rep.kv_reserved),
            "mean_used": statistics.fmean(rep.kv_used),
        }
        for name, rep in best.items()
    }
    same, paged = runs["contiguous"], runs["paged"]
    return {
        "requests": len(requests),
        "lengths": lengths,
        "longest": longest,
        "max_batch": max_batch,
        "block_size": block_size,
        "budget_positions": budget,
        "budget_slots": budget_slots,
        "bytes_per_position": PagedKVCache.for_model(model, 1, 1, block_size=1).bytes_per_position,
        "contiguous_footprint": asdict(contiguous_footprint(lengths, longest)),
        "paged_footprint": asdict(paged_footprint(lengths, block_size)),
        "fit_contiguous": fit_contiguous(lengths, budget, longest),
        "fit_paged": fit_paged(lengths, budget, block_size),
        "runs": runs,
        "identical_tokens": True,
        "paged_vs_contiguous_tokens_per_s": paged["tokens_per_s"] / same["tokens_per_s"],
        "paged_vs_contiguous_step": paged["ms_per_step"] / same["ms_per_step"],
        "report": best,
    }
