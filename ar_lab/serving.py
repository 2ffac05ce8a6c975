"""Generation in production: many users, one model (chapter 08).

A server does not run one request at a time. This module holds the pieces that let it
serve many, each tested against plain ``generate``:

- **Streaming** lives in ``ar_lab.generate.stream`` (text as it is produced, never half a
  character, each event with its token's latency); ``StreamSummary`` and
  ``latency_budget`` turn its timings into the figures a service promises: time to first
  token (TTFT), time per output token (TPOT), tokens/s.
- **Batched decoding** of sequences of different lengths: a ``BatchKVCache`` gives every
  row its own length, positions and attention mask, so one forward step advances every
  request by one token while reading the weights once.
- **Scheduling**: ``serve`` runs a queue of requests through a fixed number of slots,
  either *static* batching (admit a new batch only when the whole batch is done) or
  *continuous* batching (refill a slot as soon as its request finishes), recording when
  each token of each request appears. ``simulate`` gives the same schedules counted in
  decode steps.
- **Prefix (prompt) caching**: ``PrefixCache`` computes the keys/values of a shared static
  prefix (a long system prompt) once; each request copies them and prefills only the rest.

A new request is always prefilled alone (batch 1), straight into its slot's buffers, and
joins the running batch for decoding.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ar_lab.cache import BatchKVCache, KVCache
from ar_lab.generate import Generation, GenerationStats, _check_args, _prompt_ids, generate
from ar_lab.sampling import GREEDY, SamplingParams, sample
from ar_lab.tokenizer import EOS_ID, decode

POLICIES = ("static", "continuous")


# --- streaming figures ------------------------------------------------------------------


@dataclass(frozen=True)
class StreamSummary:
    """What a user of a stream feels: the wait for the first token, then the pace."""

    ttft: float  # seconds to the first token (prefill)
    tpot: float  # median seconds per later token (decode)
    tokens: int
    total: float  # seconds for the whole stream

    @classmethod
    def from_stats(cls, stats: GenerationStats) -> StreamSummary:
        if stats.forward_calls == 0:
            raise ValueError("the stream produced no token yet: nothing to summarise")
        tpot = statistics.median(stats.decode_times) if stats.decode_times else float("nan")
        return cls(stats.prefill_time, tpot, stats.forward_calls, stats.total_time)

    @property
    def tokens_per_s(self) -> float:
        """Output tokens per second over the whole stream, first token included."""
        return self.tokens / self.total

    @property
    def decode_tokens_per_s(self) -> float:
        """The pace after the first token: 1 / TPOT."""
        return 1.0 / self.tpot


def latency_budget(ttft: float, tpot: float, n_tokens: int) -> float:
    """Seconds until the last of ``n_tokens`` arrives: TTFT + (n - 1) x TPOT.

    A request's time is not one unit: the first token costs a prefill of the whole
    prompt, each later token one decode step.
    """
    if not isinstance(n_tokens, int) or isinstance(n_tokens, bool) or n_tokens < 1:
        raise ValueError(f"n_tokens must be an int >= 1, got {n_tokens!r}")
    if not (ttft >= 0 and tpot >= 0):
        raise ValueError(f"ttft and tpot must be >= 0 seconds, got {ttft} and {tpot}")
    return ttft + (n_tokens - 1) * tpot


def tokens_within(budget: float, ttft: float, tpot: float) -> int:
    """The most tokens whose last one arrives within ``budget`` seconds (0 if not even the first)."""
    if not (ttft >= 0 and tpot > 0):
        raise ValueError(f"ttft must be >= 0 and tpot > 0 seconds, got {ttft} and {tpot}")
    if budget < ttft:
        return 0
    return 1 + math.floor((budget - ttft) / tpot + 1e-9)


# --- prefix (prompt) cache -------------------------------------------------------------


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def reusable_length(cached: Sequence[int], prompt: Sequence[int]) -> int:
    """Prompt positions whose keys/values can be taken from a cache of ``cached`` tokens.

    The positions the two share from the start, but never the whole prompt: its last
    token must still go through the model, because its logits give the first new token.
    """
    if len(prompt) == 0:
        raise ValueError("the prompt is empty")
    return min(common_prefix_length(cached, prompt), len(prompt) - 1)


class PrefixCache:
    """The keys/values of a shared static prefix (e.g. a long system prompt), computed once.

    ``copy_into(cache, prompt)`` puts the reusable part into a request's own cache, so its
    prefill only has to process the rest of the prompt. Keys and values of a position
    depend only on the tokens up to it, so the outputs are the same as without reuse
    (up to float rounding); only the time to first token changes.
    """

    def __init__(self, model, prefix: str | Sequence[int]) -> None:
        self.tokens = _prompt_ids(prefix)
        if len(self.tokens) > model.config.block_size:
            raise ValueError(
                f"the prefix has {len(self.tokens)} tokens but the context window holds {model.config.block_size}"
            )
        self.cache = KVCache.for_model(model, max_len=len(self.tokens))
        was_training = model.training
        model.eval()
        try:
            with torch.inference_mode():
                t0 = time.perf_counter()
                model(torch.tensor([self.tokens], device=model.device), self.cache)
                self.build_time = time.perf_counter() - t0  # paid once, not per request
        finally:
            model.train(was_training)

    def __len__(self) -> int:
        return len(self.tokens)

    def reusable(self, prompt: str | Sequence[int]) -> int:
        return reusable_length(self.tokens, _prompt_ids(prompt))

    def copy_into(self, cache: KVCache, prompt: str | Sequence[int]) -> int:
        """Copy the reusable keys/values into ``cache`` (batch 1); returns how many positions."""
        n = self.reusable(prompt)
        src = self.cache.k[0]
        if cache.batch_size != 1 or len(cache.k) != len(self.cache.k) or cache.k[0].shape[1::2] != src.shape[1::2]:
            raise ValueError(
                f"cannot copy a prefix cache of shape {tuple(src.shape)} per layer into one of "
                f"{tuple(cache.k[0].shape)}: it must be batch 1, with the same layers, KV heads and head size"
            )
        if cache.max_len < n:
            raise ValueError(f"the cache holds {cache.max_len} positions, the reusable prefix {n}")
        for dst, s in zip(cache.k + cache.v, self.cache.k + self.cache.v, strict=True):
            dst[:, :, :n] = s[:, :, :n]
        cache.length = n
        return n

    def cache_for(self, prompt: str | Sequence[int], max_new_tokens: int) -> KVCache:
        """A fresh cache for one request (``generate(..., cache=...)``), the prefix already in it."""
        ids = _prompt_ids(prompt)
        src = self.cache.k[0]
        _, h, _, d = src.shape
        cache = KVCache(len(self.cache.k), 1, h, len(ids) + max_new_tokens - 1, d, src.dtype, src.device)
        self.copy_into(cache, ids)
        return cache


# --- requests and the scheduler ----------------------------------------------------------


@dataclass
class Request:
    prompt: str | Sequence[int]
    max_new_tokens: int
    name: str = ""
    seed: int | None = None  # seeds this request's sampler (ignored for greedy decoding)


@dataclass
class RequestResult:
    request: Request
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)  # new tokens (EOS excluded)
    token_times: list[float] = field(default_factory=list)  # seconds after the start when each token appeared
    admitted: float = 0.0  # seconds after the start when its prefill began (time spent queued)
    admitted_step: int = 0  # decode steps the server had run when it was admitted
    prefill_time: float = 0.0  # seconds of its own prefill
    reused: int = 0  # prompt positions taken from the prefix cache
    finish_step: int = 0  # decode steps the server had run when it finished
    stop_reason: str = ""

    @property
    def text(self) -> str:
        return decode(self.tokens)

    @property
    def ttft(self) -> float:
        """Seconds from the start (all requests are queued at 0) to the first token: queueing included."""
        return self.token_times[0]

    @property
    def latency(self) -> float:
        """Seconds from the start to the last token: what the user waits for the whole answer."""
        return self.token_times[-1]

    @property
    def tpot(self) -> float:
        """Mean seconds between its later tokens (other requests' prefills included)."""
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else float("nan")


def _percentile(values: Sequence[float], q: float) -> float:
    return float(torch.tensor(list(values), dtype=torch.float64).quantile(q))


@dataclass
class ServeReport:
    policy: str
    max_batch: int
    results: list[RequestResult]  # in request order
    total_time: float
    step_times: list[float]  # seconds of each batched decode step
    step_rows: list[int]  # rows (requests) each decode step advanced
    prefill_times: list[float]

    @property
    def tokens(self) -> int:
        return sum(len(r.token_times) for r in self.results)

    @property
    def throughput(self) -> float:
        """Output tokens per second over the whole run."""
        return self.tokens / self.total_time

    @property
    def decode_steps(self) -> int:
        return len(self.step_times)

    @property
    def mean_rows(self) -> float:
        """Average rows per decode step: how full the batch was kept."""
        return sum(self.step_rows) / len(self.step_rows) if self.step_rows else 0.0

    def latencies(self) -> list[float]:
        return [r.latency for r in self.results]

    @property
    def mean_latency(self) -> float:
        return statistics.fmean(self.latencies())

    @property
    def p90_latency(self) -> float:
        return _percentile(self.latencies(), 0.9)

    @property
    def mean_ttft(self) -> float:
        return statistics.fmean(r.ttft for r in self.results)

    def summary(self) -> dict:
        return {
            "policy": self.policy,
            "max_batch": self.max_batch,
            "requests": len(self.results),
            "tokens": self.tokens,
            "seconds": self.total_time,
            "tokens_per_s": self.throughput,
            "decode_steps": self.decode_steps,
            "mean_rows": self.mean_rows,
            "mean_latency_s": self.mean_latency,
            "p90_latency_s": self.p90_latency,
            "mean_ttft_s": self.mean_ttft,
        }


def _check_requests(model, requests) -> list[list[int]]:
    if isinstance(requests, (str, bytes)) or not isinstance(requests, Sequence) or not requests:
        raise ValueError("requests must be a non-empty list of Request objects")
    prompts = []
    for i, r in enumerate(requests):
        if not isinstance(r, Request):
            raise TypeError(f"requests[{i}] must be a Request(prompt, max_new_tokens), got {type(r).__name__}")
        ids = _prompt_ids(r.prompt)
        _check_args(model, ids, r.max_new_tokens, None)
        prompts.append(ids)
    return prompts


def serve(
    model,
    requests: Sequence[Request],
    max_batch: int = 8,
    policy: str = "continuous",
    prefix: PrefixCache | None = None,
    sampling: SamplingParams = GREEDY,
    eos_id: int | None = EOS_ID,
    clock: Callable[[], float] = time.perf_counter,
) -> ServeReport:
    """Run ``requests`` (all queued at time 0, served in order) through ``max_batch`` slots.

    ``policy="static"``: a batch of up to ``max_batch`` requests is admitted only when the
    previous batch has completely finished (finished rows stop being computed, but their
    slots stay empty until the whole batch is done). ``"continuous"``: before every decode
    step, free slots are refilled from the queue. Each admitted request is prefilled alone
    (reusing ``prefix``'s keys/values where its prompt starts with them), which gives its
    first token; then every decode step gives one more token to every row.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
        raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    prompts = _check_requests(model, requests)
    slots = min(max_batch, len(requests))
    max_len = max(len(p) + r.max_new_tokens - 1 for p, r in zip(prompts, requests, strict=True))
    cache = BatchKVCache.for_model(model, max_batch=slots, max_len=max_len)
    device = model.device
    results = [RequestResult(r, p) for r, p in zip(requests, prompts, strict=True)]
    greedy = sampling.greedy and sampling.repetition_penalty == 1.0
    generators = [
        None if r.seed is None or greedy else torch.Generator(device=device).manual_seed(r.seed) for r in requests
    ]
    penalised = sampling.repetition_penalty != 1.0
    queue = deque(range(len(requests)))
    rows: list[int] = []  # rows[i]: the request decoding in slot i
    last = torch.zeros(slots, dtype=torch.long, device=device)  # each row's newest token: the next input
    step_times: list[float] = []
    step_rows: list[int] = []
    prefill_times: list[float] = []

    def pick(logits: torch.Tensor, j: int) -> int:  # logits (vocab,) of request j
        if greedy and math.isfinite(float(logits.max())):
            return int(logits.argmax())
        res = results[j]
        return int(sample(logits, sampling, generators[j], res.prompt + res.tokens if penalised else ()))

    def record(j: int, token: int, now: float) -> bool:
        """Add request j's new token; True when the request is finished."""
        res = results[j]
        res.token_times.append(now)
        if eos_id is not None and token == eos_id:
            res.stop_reason = "eos"
            return True
        res.tokens.append(token)
        if len(res.token_times) == res.request.max_new_tokens:
            res.stop_reason = "max_new_tokens"
            return True
        return False

    def admit(j: int, t0: float) -> None:
        res, ids = results[j], prompts[j]
        slot = cache.slot(cache.rows)  # a batch-1 view of the next free slot: the prefill writes in place
        slot.length = 0
        res.reused = prefix.copy_into(slot, ids) if prefix is not None else 0
        start = clock()
        res.admitted, res.admitted_step = start - t0, len(step_times)
        logits = model(torch.tensor([ids[res.reused :]], device=device), slot)[0, -1]
        token = pick(logits, j)
        now = clock()
        res.prefill_time = now - start
        prefill_times.append(res.prefill_time)
        res.finish_step = len(step_times)
        if not record(j, token, now - t0):
            last[cache.add(slot.length)] = token
            rows.append(j)

    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            t0 = clock()
            while queue or rows:
                if policy == "continuous" or not rows:
                    while queue and len(rows) < slots:
                        admit(queue.popleft(), t0)
                    if not rows:
                        continue
                n = len(rows)
                start = clock()
                logits = model(last[:n, None], cache)[:, -1]  # (n, vocab): one token for every row
                if greedy and bool(torch.isfinite(logits).all()):
                    tokens = logits.argmax(dim=-1)
                    new = tokens.tolist()
                else:
                    new = [pick(logits[i], j) for i, j in enumerate(rows)]
                    tokens = torch.tensor(new, device=device)
                now = clock()
                step_times.append(now - start)
                step_rows.append(n)
                last[:n] = tokens
                done = [i for i, (j, t) in enumerate(zip(rows, new, strict=True)) if record(j, t, now - t0)]
                for i in reversed(done):  # highest first: the row moved into i is never a finished one
                    results[rows[i]].finish_step = len(step_times)
                    moved = cache.remove(i)
                    if moved is not None:
                        last[i] = last[moved]
                    rows[i] = rows[-1]
                    rows.pop()
            total = clock() - t0
    finally:
        model.train(was_training)
    return ServeReport(policy, max_batch, results, total, step_times, step_rows, prefill_times)


def generate_batch(
    model,
    prompts: Sequence[str | Sequence[int]],
    max_new_tokens: int | Sequence[int],
    sampling: SamplingParams = GREEDY,
    seeds: Sequence[int] | None = None,
    eos_id: int | None = EOS_ID,
) -> list[Generation]:
    """Generate for several prompts of any lengths at once; one ``Generation`` per prompt.

    Each prompt is prefilled alone, then all rows decode together (one forward step per
    token for the whole batch). Greedy output is the same as ``generate`` on each prompt
    alone; sampled output too when each prompt's seed seeds its own generator.
    """
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompts must be a non-empty list of prompts (texts or lists of token ids)")
    counts = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    seeds = [None] * len(prompts) if seeds is None else list(seeds)
    if len(counts) != len(prompts) or len(seeds) != len(prompts):
        raise ValueError(f"give one max_new_tokens and one seed per prompt ({len(prompts)} prompts)")
    requests = [Request(p, n, seed=s) for p, n, s in zip(prompts, counts, seeds, strict=True)]
    report = serve(model, requests, max_batch=len(requests), policy="static", sampling=sampling, eos_id=eos_id)
    out = []
    for r in report.results:
        times = r.token_times
        stats = GenerationStats(
            forward_calls=len(times),
            positions_processed=len(r.prompt) + len(times) - 1,
            prefill_time=r.prefill_time,
            decode_times=[b - a for a, b in zip(times, times[1:], strict=False)],
            stop_reason=r.stop_reason,
        )
        out.append(Generation(r.prompt, r.tokens, r.text, stats))
    return out


# --- the schedules in decode steps ----------------------------------------------------------


def simulate(steps_needed: Sequence[int], max_batch: int, policy: str = "continuous") -> list[int]:
    """The decode step at which each request finishes, for requests queued in order.

    ``steps_needed[i]``: decode steps request i needs after its prefill (its new tokens
    minus one; 0 means its prefill alone finishes it, and it never takes a slot). Every
    step advances every running request by one. Static: a new batch is admitted only
    when no request is running; continuous: free slots are refilled before every step.
    This is ``serve``'s schedule: ``serve(...).results[i].finish_step`` is the same number.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
        raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
    if any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in steps_needed):
        raise ValueError(f"steps_needed must hold ints >= 0, got {list(steps_needed)}")
    queue = deque(range(len(steps_needed)))
    left: dict[int, int] = {}  # running request -> steps still to go
    finish = [0] * len(steps_needed)
    step = 0
    while queue or left:
        if policy == "continuous" or not left:
            while queue and len(left) < max_batch:
                i = queue.popleft()
                if steps_needed[i] == 0:
                    finish[i] = step
                else:
                    left[i] = steps_needed[i]
            if not left:
                continue
        step += 1
        for i in list(left):
            left[i] -= 1
            if left[i] == 0:
                finish[i] = step
                del left[i]
    return finish


# --- workloads and measurements ------------------------------------------------------------

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


def mixed_workload(n_requests: int = 12, short: int = 8, long: int = 96, long_every: int = 4) -> list[Request]:
    """Requests of mixed lengths: every ``long_every``-th wants ``long`` new tokens, the rest ``short``.

    Prompts cycle through a fixed list of short Python-docs openings of different lengths.
    """
    for name, v in [("n_requests", n_requests), ("short", short), ("long", long), ("long_every", long_every)]:
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    return [
        Request(PROMPTS[i % len(PROMPTS)], long if i % long_every == long_every - 1 else short, name=f"r{i}")
        for i in range(n_requests)
    ]


def compare_policies(
    model, requests: Sequence[Request], max_batch: int, repeats: int = 1, eos_id: int | None = None
) -> dict[str, list[ServeReport]]:
    """``serve`` the same requests under both policies, alternating, ``repeats`` times each
    (so a load change on the machine hits both alike)."""
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    reports: dict[str, list[ServeReport]] = {p: [] for p in POLICIES}
    for _ in range(repeats):
        for policy in POLICIES:
            reports[policy].append(serve(model, requests, max_batch, policy, eos_id=eos_id))
    return reports


def decode_throughput(
    model, batch_sizes: Sequence[int], context: int = 64, steps: int = 16, repeats: int = 3
) -> list[dict]:
    """Tokens/s of batched decode steps at each batch size, every row at ``context`` positions.

    The cache is filled with random keys/values (timing depends on shapes, not contents);
    each repeat runs ``steps`` decode steps per batch size, interleaved across batch sizes so
    a load change on the machine hits them alike. Medians are reported.
    """
    if not batch_sizes or any(not isinstance(b, int) or b < 1 for b in batch_sizes):
        raise ValueError(f"batch_sizes must be ints >= 1, got {list(batch_sizes)}")
    if not isinstance(context, int) or context < 1 or context + steps > model.config.block_size:
        raise ValueError(f"context + steps must fit in the context window ({model.config.block_size})")
    model.eval()
    g = torch.Generator(device=model.device).manual_seed(0)
    caches, inputs = {}, {}
    for b in batch_sizes:
        c = BatchKVCache.for_model(model, max_batch=b, max_len=context + steps)
        for buf in c.k + c.v:
            buf.normal_(generator=g)
        for _ in range(b):
            c.add(context)
        caches[b] = c
        inputs[b] = torch.randint(0, model.config.vocab_size, (b, 1), generator=g, device=model.device)
    times: dict[int, list[float]] = {b: [] for b in batch_sizes}
    with torch.inference_mode():
        for r in range(repeats + 1):  # the first round warms up
            for b in batch_sizes:
                c = caches[b]
                c.lengths[:b] = [context] * b
                t0 = time.perf_counter()
                for _ in range(steps):
                    model(inputs[b], c)
                if c.device.type == "cuda":
                    torch.cuda.synchronize()
                if r:
                    times[b].append((time.perf_counter() - t0) / steps)
    out = []
    for b in batch_sizes:
        step = statistics.median(times[b])
        out.append({"batch": b, "step_s": step, "tokens_per_s": b / step})
    return out


def prefix_ttft(
    model,
    prefix: str | Sequence[int],
    suffixes: Sequence[str | Sequence[int]],
    max_new_tokens: int = 8,
    repeats: int = 3,
) -> dict:
    """Time to first token for prefix + each suffix, prefilled whole vs reusing a ``PrefixCache``.

    The reuse side is charged for building its cache (allocate + copy the prefix) as well as
    its prefill; building the prefix cache itself is paid once (``build_s``). Runs alternate,
    medians are reported, and the tokens of both sides are compared.
    """
    if not suffixes:
        raise ValueError("give at least one suffix (the part of each prompt after the shared prefix)")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    pc = PrefixCache(model, prefix)
    prompts = [pc.tokens + _prompt_ids(s) for s in suffixes]
    plain_t, reuse_t, same = [], [], []
    for _ in range(repeats):
        for p in prompts:
            plain = generate(model, p, max_new_tokens, eos_id=None)
            t0 = time.perf_counter()
            cache = pc.cache_for(p, max_new_tokens)
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
