"""Generation in production: many users, one model (chapter 08).

A server does not run one request at a time. This module holds the pieces that let it
serve many, each tested against plain ``generate``:

- **Streaming** lives in ``ar_lab.engine.generate.stream`` (text as it is produced, never half a
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
- **Prefix (prompt) caching** lives in ``ar_lab.engine.prefix_cache``: ``serve(..., prefix=...)``
  copies a shared prefix's keys/values into each request, which prefills only the rest.

A new request is prefilled alone (batch 1) straight into its slot's buffers, then joins the
running batch. The workloads and measurements of chapter 08 are in ``ar_lab.perf.serving_measure``.
"""

from __future__ import annotations

import heapq
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ar_lab.base.args import check_seed, finite_number
from ar_lab.engine.decoder import ForwardDecoder
from ar_lab.engine.generate import Generation, GenerationStats
from ar_lab.engine.prefix_cache import PrefixCache
from ar_lab.engine.prompts import checked_prompt
from ar_lab.engine.sampling import GREEDY, SamplingParams, sample
from ar_lab.engine.scheduling import POLICIES, admitted, policy_function, policy_name
from ar_lab.model.cache import BatchKVCache
from ar_lab.model.inference import inference
from ar_lab.model.tokenizer import EOS_ID, decode


@dataclass(frozen=True)
class StreamSummary:
    """What a user of a stream feels: the wait for the first token, then the pace."""

    ttft: float  # seconds to the first token (prefill)
    tpot: float  # median seconds per later token (decode)
    tokens: int
    total: float  # seconds for the whole stream

    @classmethod
    def from_stats(cls, stats: GenerationStats) -> StreamSummary:
        if not isinstance(stats, GenerationStats):
            raise TypeError(f"stats must be a GenerationStats (a stream's or generate(...)'s .stats), got {stats!r}")
        if stats.forward_calls == 0:
            raise ValueError("the stream produced no token yet: nothing to summarise")
        tpot = statistics.median(stats.decode_times) if stats.decode_times else float("nan")
        return cls(stats.prefill_time, tpot, stats.forward_calls, stats.total_time)

    @property
    def tokens_per_s(self) -> float:
        """Output tokens per second over the whole stream, first token included."""
        return self.tokens / _elapsed("the stream's total time", self.total)

    @property
    def decode_tokens_per_s(self) -> float:
        """The pace after the first token: 1 / TPOT (NaN for a one-token stream: it has no later token)."""
        return self.tpot if math.isnan(self.tpot) else 1.0 / _elapsed("TPOT", self.tpot)


def _elapsed(what: str, seconds: float) -> float:
    """``seconds`` to divide by; a clock that did not advance makes a rate undefined, so say so."""
    if not seconds > 0:
        raise ValueError(f"{what} is {seconds} s by its clock, so a rate is undefined: use a clock that advances")
    return seconds


def latency_budget(ttft: float, tpot: float, n_tokens: int) -> float:
    """Seconds until the last of ``n_tokens`` arrives: TTFT + (n - 1) x TPOT.

    A request's time is not one unit: the first token costs a prefill of the whole
    prompt, each later token one decode step. ``n_tokens`` is at most 2**53, the counts a float holds exactly.
    """
    if not isinstance(n_tokens, int) or isinstance(n_tokens, bool) or not 1 <= n_tokens <= 2**53:
        raise ValueError(f"n_tokens must be an int from 1 to 2**53, got {n_tokens!r}")
    return finite_number("ttft (seconds)", ttft) + (n_tokens - 1) * finite_number("tpot (seconds)", tpot)


def tokens_within(budget: float, ttft: float, tpot: float) -> int:
    """The most tokens whose last one arrives within ``budget`` seconds (0 if not even the first)."""
    budget, ttft = finite_number("budget (seconds)", budget), finite_number("ttft (seconds)", ttft)
    tpot = finite_number("tpot (seconds)", tpot, above=True)
    if budget < ttft:
        return 0
    if not math.isfinite(later := (budget - ttft) / tpot):
        raise ValueError(f"budget / tpot is too large to count ({budget!r} s / {tpot!r} s): give a larger tpot")
    return 1 + math.floor(later + 1e-9)


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
        return self.tokens / _elapsed("the run's total time", self.total_time)

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
        prompts.append(checked_prompt(model, r.prompt, r.max_new_tokens))
        if r.seed is not None:
            check_seed(r.seed, f"requests[{i}].seed")
    return prompts


def _check_schedule(max_batch: int, policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    _check_slots(max_batch)


def _check_slots(max_batch: int) -> None:
    if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
        raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")


class _Server:
    """The state of one ``serve`` run: the slots and who decodes in them, each request's result, the timings."""

    def __init__(self, model, requests, prompts, slots: int, *, prefix, sampling, eos_id, clock) -> None:
        self.model, self.prompts, self.prefix, self.sampling, self.eos_id = model, prompts, prefix, sampling, eos_id
        self.clock, self.t0, self.slots = clock, 0.0, slots
        max_len = max(len(p) + r.max_new_tokens - 1 for p, r in zip(prompts, requests, strict=True))
        self.cache = BatchKVCache.for_model(model, max_batch=slots, max_len=max_len)
        self.decoder = ForwardDecoder(model)  # rows at lengths of their own: through forward
        device = model.device
        self.results = [RequestResult(r, p) for r, p in zip(requests, prompts, strict=True)]
        self.greedy = sampling.greedy and sampling.repetition_penalty == 1.0
        self.penalised = sampling.repetition_penalty != 1.0
        self.generators = [
            None if r.seed is None or self.greedy else torch.Generator(device=device).manual_seed(r.seed)
            for r in requests
        ]
        self.rows: list[int] = []  # rows[i]: the request decoding in slot i
        self.last = torch.zeros(slots, dtype=torch.long, device=device)  # each row's newest token: the next input
        self.step_times: list[float] = []
        self.step_rows: list[int] = []
        self.prefill_times: list[float] = []

    def pick(self, logits: torch.Tensor, j: int) -> int:
        """Request j's next token from its logits (vocab,)."""
        if self.greedy and math.isfinite(float(logits.max())):
            return int(logits.argmax())
        res = self.results[j]
        history = res.prompt + res.tokens if self.penalised else ()
        return int(sample(logits, self.sampling, self.generators[j], history))

    def record(self, j: int, token: int, now: float) -> bool:
        """Add request j's new token; True when the request is finished."""
        res = self.results[j]
        res.token_times.append(now)
        if self.eos_id is not None and token == self.eos_id:
            res.stop_reason = "eos"
            return True
        res.tokens.append(token)
        if len(res.token_times) == res.request.max_new_tokens:
            res.stop_reason = "max_new_tokens"
            return True
        return False

    def admit(self, j: int) -> None:
        """Prefill request j alone, straight into the next free slot; it joins the batch unless already done."""
        res, ids, cache = self.results[j], self.prompts[j], self.cache
        slot = cache.slot(cache.rows)  # a batch-1 view of the next free slot: the prefill writes in place
        slot.length = 0
        res.reused = self.prefix.copy_into(slot, ids) if self.prefix is not None else 0
        start = self.clock()
        res.admitted, res.admitted_step = start - self.t0, len(self.step_times)
        new = torch.tensor([ids[res.reused :]], device=self.model.device)
        logits = self.decoder.prefill(new, slot, res.reused)[0, -1]
        token = self.pick(logits, j)
        now = self.clock()
        res.prefill_time = now - start
        self.prefill_times.append(res.prefill_time)
        res.finish_step = len(self.step_times)
        if not self.record(j, token, now - self.t0):
            self.last[cache.add(slot.length)] = token
            self.rows.append(j)

    def decode_step(self) -> None:
        """One batched forward step: one more token for every row; finished rows leave their slots."""
        n, rows = len(self.rows), self.rows
        start = self.clock()
        logits = self.decoder.step(self.last[:n], self.cache, None)  # (n, vocab): one token for every row
        if self.greedy and bool(torch.isfinite(logits).all()):
            tokens = logits.argmax(dim=-1)
            new = tokens.tolist()
        else:
            new = [self.pick(logits[i], j) for i, j in enumerate(rows)]
            tokens = torch.tensor(new, device=self.model.device)
        now = self.clock()
        self.step_times.append(now - start)
        self.step_rows.append(n)
        self.last[:n] = tokens
        done = [i for i, (j, t) in enumerate(zip(rows, new, strict=True)) if self.record(j, t, now - self.t0)]
        for i in reversed(done):  # highest first: the row moved into i is never a finished one
            self.results[rows[i]].finish_step = len(self.step_times)
            moved = self.cache.remove(i)
            if moved is not None:
                self.last[i] = self.last[moved]
            rows[i] = rows[-1]
            rows.pop()


def serve(
    model,
    requests: Sequence[Request],
    *,
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
    step, free slots are refilled from the queue. Or a function of one's own
    (``ar_lab.engine.scheduling.AdmissionPolicy``), asked before every step. Each admitted request is prefilled alone
    (reusing ``prefix``'s keys/values where its prompt starts with them), which gives its
    first token; then every decode step gives one more token to every row.
    """
    admit = policy_function(policy)  # a name of POLICIES or a function; anything else is refused here
    _check_slots(max_batch)
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    if prefix is not None and not isinstance(prefix, PrefixCache):
        raise TypeError(f"prefix must be a PrefixCache(model, prefix_text) or None, got {type(prefix).__name__}")
    if eos_id is not None and (not isinstance(eos_id, int) or isinstance(eos_id, bool)):
        raise ValueError(f"eos_id must be None or a token id (an int), got {eos_id!r}")
    if not callable(clock):
        raise TypeError(f"clock must be a function returning seconds (e.g. time.perf_counter), got {clock!r}")
    prompts = _check_requests(model, requests)
    server = _Server(
        model,
        requests,
        prompts,
        min(max_batch, len(requests)),
        prefix=prefix,
        sampling=sampling,
        eos_id=eos_id,
        clock=clock,
    )
    queue = deque(range(len(requests)))
    with inference(model):
        server.t0 = clock()
        while queue or server.rows:
            # The policy says how many requests join the batch; one its prefill finishes takes no slot.
            goal = len(server.rows) + (admitted(admit, len(queue), len(server.rows), server.slots) if queue else 0)
            while queue and len(server.rows) < goal:
                server.admit(queue.popleft())
            if server.rows:
                server.decode_step()
        total = clock() - server.t0
    return ServeReport(
        policy_name(policy), max_batch, server.results, total, server.step_times, server.step_rows, server.prefill_times
    )


def generate_batch(
    model,
    prompts: Sequence[str | Sequence[int]],
    max_new_tokens: int | Sequence[int],
    *,
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
    if not isinstance(max_new_tokens, (int, Sequence)) or not isinstance(seeds, (Sequence, type(None))):
        raise ValueError("give max_new_tokens as an int (or one per prompt) and seeds as None or one int per prompt")
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
    This is ``serve``'s schedule: ``serve(...).results[i].finish_step`` is the same number. Counted
    by events, not stepped: the time grows with the number of requests, not with their steps.
    """
    _check_schedule(max_batch, policy)
    if not isinstance(steps_needed, Sequence) or isinstance(steps_needed, str):
        raise ValueError(f"steps_needed must be a list of ints >= 0 (one per request), got {steps_needed!r}")
    if any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in steps_needed):
        raise ValueError(f"steps_needed must hold ints >= 0, got {list(steps_needed)}")
    finish, running, step = [], [], 0  # running: the steps at which the requests in slots finish
    for s in steps_needed:  # each request, in order, admitted at the first step with a free slot
        if len(running) == max_batch:  # no free slot: static waits for the whole batch, continuous for one
            step, running = (max(running), []) if policy == "static" else (heapq.heappop(running), running)
        finish.append(step + s)
        if s:  # 0 steps: its prefill alone finishes it, and it never takes a slot
            heapq.heappush(running, step + s)
    return finish
