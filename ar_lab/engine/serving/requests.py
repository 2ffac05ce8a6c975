"""What serving deals in: requests, their results, a run's report, and the latency arithmetic
(chapter 08).

A user feels two numbers: the wait for the first token (TTFT, a prefill) and the pace after it
(TPOT, a decode step). ``StreamSummary`` reads them off a stream's timings; ``latency_budget`` and
``tokens_within`` turn them into what a service promises. ``Request`` is what ``serve`` takes,
``RequestResult`` what it records for each request and ``ServeReport`` the whole run.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ar_lab.base.args import finite_number
from ar_lab.base.errors import BadType, BadValue
from ar_lab.engine.generate import GenerationStats
from ar_lab.model.tokenizer import decode


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
            raise BadType(
                "stats must be a GenerationStats (a stream's or generate(...)'s .stats), got "
                f"{stats!r}",
                arg="stats",
            )
        if stats.forward_calls == 0:
            raise BadValue(
                "the stream produced no token yet (stats.forward_calls is 0): nothing to summarise",
                arg="stats",
            )
        tpot = statistics.median(stats.decode_times) if stats.decode_times else float("nan")
        return cls(stats.prefill_time, tpot, stats.forward_calls, stats.total_time)

    @property
    def tokens_per_s(self) -> float:
        """Output tokens per second over the whole stream, first token included."""
        return self.tokens / _elapsed("the stream's total time", self.total, "total")

    @property
    def decode_tokens_per_s(self) -> float:
        """The pace after the first token: 1 / TPOT (NaN for a one-token stream: it has no later
        token)."""
        return (
            self.tpot if math.isnan(self.tpot) else 1.0 / _elapsed("TPOT (tpot)", self.tpot, "tpot")
        )


def _elapsed(what: str, seconds: float, field: str) -> float:
    """``seconds`` (the summary's ``field``) to divide by; a clock that did not advance makes a rate
    undefined."""
    if not seconds > 0:
        raise BadValue(
            f"{what} is {seconds} s by its clock, so a rate is undefined: use a clock that "
            "advances",
            arg=field,
        )
    return seconds


def latency_budget(ttft: float, tpot: float, n_tokens: int) -> float:
    """Seconds until the last of ``n_tokens`` arrives: TTFT + (n - 1) x TPOT.

    A request's time is not one unit: the first token costs a prefill of the whole prompt, each
    later token one decode step. ``n_tokens`` is at most 2**53, the counts a float holds exactly.
    """
    if not isinstance(n_tokens, int) or isinstance(n_tokens, bool) or not 1 <= n_tokens <= 2**53:
        raise BadValue(f"n_tokens must be an int from 1 to 2**53, got {n_tokens!r}", arg="n_tokens")
    return finite_number("ttft (seconds)", ttft, arg="ttft") + (n_tokens - 1) * finite_number(
        "tpot (seconds)", tpot, arg="tpot"
    )


def tokens_within(budget: float, ttft: float, tpot: float) -> int:
    """The most tokens whose last one arrives within ``budget`` seconds (0 if not even the
    first)."""
    budget = finite_number("budget (seconds)", budget, arg="budget")
    ttft = finite_number("ttft (seconds)", ttft, arg="ttft")
    tpot = finite_number("tpot (seconds)", tpot, above=True, arg="tpot")
    if budget < ttft:
        return 0
    if not math.isfinite(later := (budget - ttft) / tpot):
        raise BadValue(
            f"budget / tpot is too large to count ({budget!r} s / {tpot!r} s): give a larger tpot",
            arg="tpot",
        )
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
    # seconds after the start when each token appeared
    token_times: list[float] = field(default_factory=list)
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
        """Seconds from the start (all requests are queued at 0) to the first token: queueing
        included."""
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
    kv: str = "contiguous"  # the KV cache's layout: "contiguous" (slots) or "paged" (blocks)
    # positions of KV memory set aside at each decode step
    kv_reserved: list[int] = field(default_factory=list)
    kv_used: list[int] = field(default_factory=list)  # positions of it holding keys and values

    @property
    def tokens(self) -> int:
        return sum(len(r.token_times) for r in self.results)

    @property
    def throughput(self) -> float:
        """Output tokens per second over the whole run."""
        return self.tokens / _elapsed(
            "the run's total time (total_time)", self.total_time, "total_time"
        )

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

    def gaps(self) -> list[float]:
        """Every request's seconds between consecutive tokens (its inter-token gaps, the first
        token's wait excluded): what a long prefill run between two decode steps stretches."""
        return [b - a for r in self.results
                for a, b in zip(r.token_times, r.token_times[1:], strict=False)]

    @property
    def p99_gap(self) -> float:
        gaps = self.gaps()
        return _percentile(gaps, 0.99) if gaps else float("nan")

    @property
    def max_gap(self) -> float:
        return max(self.gaps(), default=float("nan"))

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
            "p99_gap_s": self.p99_gap,
            "max_gap_s": self.max_gap,
        }
