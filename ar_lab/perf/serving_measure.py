"""Serving measured: a mixed workload, both scheduling policies, batched decode, prefix reuse.

The measurements chapter 08 and ``python -m ar_lab.bench serving`` make with the pieces of
``ar_lab.engine.serving`` and ``ar_lab.engine.prefix_cache``. Each returns data (reports, rows,
dicts); printing is the caller's. Runs that are compared alternate, so a change of load on a shared
machine hits both sides alike.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from ar_lab.base.args import positive_int
from ar_lab.base.errors import BadType, BadValue, ContextFull
from ar_lab.base.timing import interleaved, steady_clock, synchronize
from ar_lab.engine.decoder import ForwardDecoder
from ar_lab.engine.generate import generate
from ar_lab.engine.prefix_cache import PrefixCache
from ar_lab.engine.prompts import prompt_ids
from ar_lab.engine.serving import POLICIES, Request, ServeReport, serve
from ar_lab.model.cache import BatchKVCache
from ar_lab.model.gpt import checked_model
from ar_lab.model.inference import inference

PROMPTS = [
    "The for statement",
    "A list comprehension",
    "def ",
    "Exceptions are raised when",
    "The with statement",
    "class ",
    "import ",
    "A dictionary maps",
    "The return value of",
    "Strings are immutable",
    "The while loop",
    "Keyword arguments",
]


MAX_REQUESTS = 10_000  # mixed_workload's limit: more than any run on one CPU serves in minutes
MAX_CACHE_BYTES = 2**31  # decode_throughput's limit on the batched KV cache it allocates


def mixed_workload(
    n_requests: int = 12, short: int = 8, long: int = 96, long_every: int = 4
) -> list[Request]:
    """Requests of mixed lengths: every ``long_every``-th wants ``long`` new tokens, the rest
    ``short``.

    Prompts cycle through a fixed list of short Python-docs openings of different lengths.
    """
    for name, v in [
        ("n_requests", n_requests),
        ("short", short),
        ("long", long),
        ("long_every", long_every),
    ]:
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise BadValue(f"{name} must be an int >= 1, got {v!r}", arg=name)
    if n_requests > MAX_REQUESTS:
        raise BadValue(
            f"n_requests must be at most {MAX_REQUESTS:,} (a workload to serve here), got "
            f"{n_requests:,}",
            arg="n_requests",
        )
    return [
        Request(
            PROMPTS[i % len(PROMPTS)],
            long if i % long_every == long_every - 1 else short,
            name=f"r{i}",
        )
        for i in range(n_requests)
    ]


def compare_policies(
    model,
    requests: Sequence[Request],
    max_batch: int,
    *,
    repeats: int = 1,
    eos_id: int | None = None,
    policies: dict | None = None,
) -> dict[str, list[ServeReport]]:
    """``serve`` the same requests under each policy, alternating, ``repeats`` times each (so a load
    change on the machine hits all alike). ``policies``: name -> policy (a name of ``POLICIES`` or
    an admission function, e.g. the learner's); by default static and continuous batching."""
    positive_int("repeats", repeats)
    policies = {p: p for p in POLICIES} if policies is None else dict(policies)
    reports: dict[str, list[ServeReport]] = {name: [] for name in policies}
    for _ in range(repeats):
        for name, policy in policies.items():
            reports[name].append(
                serve(model, requests, max_batch=max_batch, policy=policy, eos_id=eos_id)
            )
    return reports


def long_prompt_workload(
    n_requests: int = 16, prompt: int = 768, new: int = 48, long_every: int = 4
) -> list[Request]:
    """Requests that chat (a short prompt, ``new`` tokens) while every ``long_every``-th brings a
    long document (``prompt`` positions of the built-in corpus, 8 new tokens): the load under which
    a whole-prompt prefill stalls every running stream."""
    from ar_lab.model.data import builtin_corpus

    for name, v in [("n_requests", n_requests), ("prompt", prompt), ("new", new),
                    ("long_every", long_every)]:
        positive_int(name, v)
    corpus = builtin_corpus()
    if prompt > len(corpus):
        raise BadValue(f"prompt must be at most {len(corpus):,} positions (the built-in corpus), "
                       f"got {prompt:,}", arg="prompt")
    return [
        Request(corpus[97 * i : 97 * i + prompt], 8, name=f"document{i}")
        if i % long_every == long_every - 1
        else Request(PROMPTS[i % len(PROMPTS)], new, name=f"chat{i}")
        for i in range(n_requests)
    ]


def compare_chunks(
    model, requests: Sequence[Request], max_batch: int, chunks: Sequence[int | None], *,
    repeats: int = 1,
) -> dict[int | None, list[ServeReport]]:
    """``serve`` the same requests (continuous batching, greedy, no EOS) with each chunk size (None:
    every prompt prefilled whole), alternating, ``repeats`` times each."""
    positive_int("repeats", repeats)
    reports: dict[int | None, list[ServeReport]] = {c: [] for c in chunks}
    for _ in range(repeats):
        for c in chunks:
            reports[c].append(serve(model, requests, max_batch=max_batch, eos_id=None, chunk=c))
    return reports


def _random_batches(model, batch_sizes: Sequence[int], context: int, steps: int):
    """For each batch size: a ``BatchKVCache`` with every row at ``context`` random positions, and
    one random input token per row (timing depends on shapes, not contents)."""
    g = torch.Generator(device=model.device).manual_seed(0)
    caches, inputs = {}, {}
    for b in batch_sizes:
        c = BatchKVCache.for_model(model, max_batch=b, max_len=context + steps)
        for buf in c.k + c.v:
            buf.normal_(generator=g)
        for _ in range(b):
            c.add(context)
        caches[b] = c
        # (b, 1)
        inputs[b] = torch.randint(
            0, model.config.vocab_size, (b, 1), generator=g, device=model.device
        )
    return caches, inputs


def decode_step_runs(
    model, batch_sizes: Sequence[int], *, context: int = 64, steps: int = 16
) -> dict[int, Callable[[], None]]:
    """For each batch size, a function of no arguments that runs ``steps`` batched decode steps,
    every row at ``context`` positions (its cache holds random keys/values: timing depends on
    shapes, not contents). Each call starts from the same state, so every call is the same work:
    what ``decode_throughput`` times, and what a timing claim (``course.claims.timed_claim``)
    re-times."""
    checked_model(model)
    if isinstance(batch_sizes, str) or not isinstance(batch_sizes, Sequence):
        raise BadType(
            f"batch_sizes must be a list of ints >= 1, e.g. [1, 2, 4], got {batch_sizes!r}",
            arg="batch_sizes",
        )
    if not batch_sizes or any(
        not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in batch_sizes
    ):
        raise BadValue(f"batch_sizes must be ints >= 1, got {list(batch_sizes)}", arg="batch_sizes")
    positive_int("context", context), positive_int("steps", steps)
    if context + steps > model.config.block_size:
        raise ContextFull(
            f"context + steps must fit in the context window ({model.config.block_size})",
            arg="context",
        )
    cfg, value = model.config, next(model.parameters()).element_size()
    need = (
        max(batch_sizes) * cfg.n_layer * 2 * cfg.kv_heads * cfg.head_dim * (context + steps) * value
    )
    if need > MAX_CACHE_BYTES:
        raise BadValue(
            f"batch_sizes: a batch of {max(batch_sizes):,} needs {need / 2**30:.1f} GiB of KV "
            f"cache, more than the {MAX_CACHE_BYTES / 2**30:.0f} GiB this measurement allows; "
            "ask for smaller batches",
            arg="batch_sizes",
        )
    caches, inputs = _random_batches(model, batch_sizes, context, steps)
    decoder = ForwardDecoder(model)

    def decode_steps(b: int) -> Callable[[], None]:
        def run() -> None:
            with inference(model):
                caches[b].lengths[:b] = [context] * b  # every row back at `context` positions
                for _ in range(steps):
                    # one token for every row, as serve steps
                    decoder.step(inputs[b][:, 0], caches[b], None)

        return run

    return {b: decode_steps(b) for b in batch_sizes}


def decode_throughput(
    model, batch_sizes: Sequence[int], *, context: int = 64, steps: int = 16, repeats: int = 3
) -> list[dict]:
    """Tokens/s of batched decode steps at each batch size, every row at ``context`` positions.

    Each repeat runs ``steps`` decode steps per batch size (``decode_step_runs``), the batch sizes
    taking turns (``ar_lab.base.timing.interleaved``) so a load change on the machine hits them
    alike, on the steady clock (``steady_clock``: one thread's CPU time, which another process
    cannot inflate by taking the CPU away). Medians are reported.
    """
    positive_int("repeats", repeats)
    runs = decode_step_runs(model, batch_sizes, context=context, steps=steps)
    # 1 round warms up
    clock = steady_clock(model.device)
    times = interleaved(runs, repeats, warmup=1, clock=clock, device=model.device)
    out = []
    for b in batch_sizes:
        step = statistics.median(t / steps for t in times[b])
        out.append({"batch": b, "step_s": step, "tokens_per_s": b / step})
    return out


def prefix_ttft(
    model,
    prefix: str | Sequence[int],
    suffixes: Sequence[str | Sequence[int]],
    *,
    max_new_tokens: int = 8,
    repeats: int = 3,
) -> dict:
    """Time to first token for prefix + each suffix, prefilled whole vs reusing a ``PrefixCache``.

    The reuse side is charged for building its cache (allocate + copy the prefix) as well as
    its prefill; building the prefix cache itself is paid once (``build_s``). Runs alternate,
    medians are reported, and the tokens of both sides are compared.
    """
    checked_model(model)
    if isinstance(suffixes, str) or not isinstance(suffixes, Sequence):
        raise BadType(
            "suffixes must be a list of suffixes (texts or token ids), got "
            f"{type(suffixes).__name__}",
            arg="suffixes",
        )
    if not suffixes:
        raise BadValue(
            "suffixes: give at least one suffix (the part of each prompt after the shared prefix)",
            arg="suffixes",
        )
    positive_int("repeats", repeats)
    pc = PrefixCache(model, prefix)
    prompts = [pc.tokens + prompt_ids(s) for s in suffixes]
    plain_t, reuse_t, same = [], [], []
    for _ in range(repeats):
        for p in prompts:
            plain = generate(model, p, max_new_tokens, eos_id=None)
            t0 = time.perf_counter()
            cache = pc.cache_for(p, max_new_tokens, model=model)
            synchronize(model.device)
            copy = time.perf_counter() - t0
            reused = generate(model, p, max_new_tokens, eos_id=None, cache=cache)
            plain_t.append(plain.stats.prefill_time)
            reuse_t.append(copy + reused.stats.prefill_time)
            same.append(plain.tokens == reused.tokens)
    plain_s, reuse_s = statistics.median(plain_t), statistics.median(reuse_t)
    return {
        "prefix_tokens": len(pc),
        "suffix_tokens": [len(p) - len(pc) for p in prompts],
        "ttft_plain_s": plain_s,
        "ttft_reused_s": reuse_s,
        "speedup": plain_s / reuse_s,
        "build_s": pc.build_time,
        "identical_outputs": sum(same),
        "runs": len(same),
    }
