"""Claims a notebook makes about its own outputs, checked where they are made.

A sentence under a plot is only as good as the measurement beside it. Two tools keep them
together: ``say`` renders Markdown from the values a cell just measured (so a quoted figure
is the figure), and ``claim`` asserts a comparative statement right after its measurement,
with bounds wide enough for a noisy 2-core machine. When a claim stops being true, the cell
raises ``ClaimFailed`` naming it, and the notebook tests (nbval) fail on that cell.

``timed_claim`` is ``claim`` for timings: it times the sides itself, in turns, and times them
again while a busy machine leaves the verdict open, so another process delays a verdict
instead of deciding it.

A claim has two audiences. The tests run the notebooks with ``AR_LAB_CLAIMS=strict``: every
false claim fails. A learner's kernel is not strict: a claim about logic still stops the
notebook, but one whose verdict rests on timings (``noisy=True``, and every ``timed_claim``)
shows a caveat instead, so a busy machine does not end a lesson.
"""

from __future__ import annotations

import itertools
import math
import numbers
import os
import statistics
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from ar_lab.base.args import positive_int
from ar_lab.base.errors import BadType, BadValue
from ar_lab.base.timing import checked_device, default_device, interleaved, steady_clock


class ClaimFailed(AssertionError):
    """A notebook's sentence no longer matches what its cell measured."""


# Who reads a false claim: "strict" (the course's tests set it for the notebooks they run) fails
# the cell; anything else is a learner's kernel, where a claim the machine's noise decides
# (``noisy``) shows a caveat and the lesson goes on.
MODE_ENV = "AR_LAB_CLAIMS"


def strict() -> bool:
    """True where every false claim must stop the notebook (``AR_LAB_CLAIMS=strict``: the tests)."""
    return os.environ.get(MODE_ENV, "") == "strict"


def _caveat(name: str, measured: str) -> None:
    """What a learner sees when a timing claim does not hold on their machine, this time."""
    say(
        f"⚠ **Not on this machine, this time.** The text here says: *{name}*; this run measured "
        f"{measured or 'otherwise'}. Timings move with whatever else the machine is doing "
        "(another program, a shared server): the saved outputs were measured where it held, and "
        "the course's tests fail when it does not. Run this section again when the machine is "
        "quieter."
    )


def truth(holds) -> bool:
    """``holds`` as a Python bool if it is a real boolean: a bool, a numpy bool or a 0-d bool array
    or tensor (what a comparison of numpy / torch scalars gives). Anything else is a TypeError: a
    list, a string, a number or NaN is "true" to ``bool()`` whatever was measured, a claim that
    cannot fail."""
    if isinstance(holds, bool):
        return holds
    if getattr(holds, "ndim", None) == 0 and str(getattr(holds, "dtype", "")) in (
        "bool",
        "torch.bool",
    ):
        return bool(holds)
    got = type(holds).__name__
    if getattr(holds, "shape", None) is not None:
        got += f" of shape {tuple(holds.shape)}, dtype {getattr(holds, 'dtype', None)}"
    raise BadType(
        "claim needs holds to be a boolean (a comparison such as x < y, or bool((a == b).all()) "
        f"for arrays), got {got}: {holds!r}"[:400],
        arg="holds",
    )


def claim(name: str, holds: bool, measured: str = "", *, noisy: bool = False) -> None:
    """Raise ``ClaimFailed`` unless ``holds``; ``name`` quotes the claim, ``measured`` what was
    seen.

    ``holds`` must be a real boolean (``truth``), so that a claim can fail: the result of a
    comparison, not the measured value itself. ``noisy``: the verdict rests on timings, which a
    busy machine can move; in a learner's kernel (not ``strict``) a false one shows a caveat and
    returns, where a claim about logic (a count, an equality) always raises."""
    if not isinstance(name, str) or not name.strip():
        raise BadType(
            f"claim needs name to be the claim's sentence (a non-empty str), got {name!r}",
            arg="name",
        )
    if not isinstance(noisy, bool):
        raise BadType(f"noisy must be True or False, got {noisy!r}", arg="noisy")
    if not truth(holds):
        if noisy and not strict():
            _caveat(name, measured)
            return
        raise ClaimFailed(
            f"the notebook claims: {name!r}, but the measurement says otherwise"
            + (f" ({measured})" if measured else "")
            + ". Re-run the cell; if it still fails, the text around it needs rewriting."
        )


@dataclass(frozen=True)
class Timed:
    """What a timing claim measured: the seconds of every call of each side, in the attempt that
    decided."""

    samples: dict[Hashable, list[float]]
    attempts: int  # measurements taken: 1 when the first one decided
    seconds: float  # wall-clock time the claim spent measuring

    def median(self, name: Hashable) -> float:
        return statistics.median(self.samples[name])

    def medians(self) -> dict[Hashable, float]:
        return {name: self.median(name) for name in self.samples}

    def spread(self, name: Hashable) -> tuple[float, float]:
        """The lower and upper quartile of the side's times (its min and max with fewer than 4)."""
        values = sorted(self.samples[name])
        if len(values) < 4:
            return values[0], values[-1]
        q = statistics.quantiles(values, n=4)
        return q[0], q[2]

    def describe(self) -> str:
        """Each side's median and quartiles; with two sides, the ratio of the second to the
        first."""
        parts = [
            f"{name}: {_ms(self.median(name))} ({_ms(self.spread(name)[0])}-"
            f"{_ms(self.spread(name)[1])})"
            for name in self.samples
        ]
        if len(self.samples) == 2:
            a, b = self.samples
            (a_lo, a_hi), (b_lo, b_hi) = self.spread(a), self.spread(b)
            parts.append(
                f"{b} / {a} = {self.median(b) / self.median(a):.2f}x ({b_lo / a_hi:.2f}-"
                f"{b_hi / a_lo:.2f})"
            )
        return "; ".join(parts) + f"; {self.attempts} measurement(s) in {self.seconds:.1f} s"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def _undecided(samples: dict[Hashable, list[float]], holds: Callable[[dict], object]) -> bool:
    """True when the claim holds at some corner of the sides' ranges (each side at its fastest or
    slowest): the spreads overlap the claimed bound, so another measurement may decide it. A side
    timed fewer than 3 times has no spread to speak of: that is undecided too."""
    if any(len(v) < 3 for v in samples.values()):
        return True
    ends = [(min(v), max(v)) for v in samples.values()]
    return any(
        truth(holds(dict(zip(samples, corner, strict=True)))) for corner in itertools.product(*ends)
    )


def timed_claim(
    name: str,
    runs: dict[Hashable, Callable[[], object]],
    holds: Callable[[dict[Hashable, float]], object],
    *,
    rounds: int = 5,
    warmup: int = 1,
    budget_s: float = 20.0,
    device: torch.device | str | None = None,
    first: dict[Hashable, list[float]] | None = None,
) -> Timed:
    """Claim ``name`` about how long the calls in ``runs`` take, and measure until the measurement
    decides.

    The sides are timed in turns (``interleaved``: ``rounds`` calls each, after ``warmup``), on the
    steady clock (one thread's CPU time on a CPU, which another process cannot inflate by taking the
    CPU away, only by competing for caches and memory bandwidth) of ``device`` (by default the one
    the notebooks compute on: a CUDA GPU when present, else the CPU). ``holds`` gets each side's
    median seconds and returns the verdict, e.g. ``lambda t: t["cached"] < t["uncached"] / 3``.
    ``first``, the samples a cell already measured for its table or plot, is judged before anything
    more is timed. While the verdict is false but the spreads overlap the bound (the claim holds
    with some side at its fastest or slowest, or a side was timed fewer than 3 times, as ``first``
    may be), the sides are measured again, up to ``budget_s`` seconds in all: a busy machine delays
    a verdict, it does not decide it. A claim that stays false, or is false at every corner of the
    spreads, raises ``ClaimFailed`` with each side's median, its quartiles and (for two sides) their
    ratio (in a learner's kernel, not ``strict``: shows them in a caveat and returns the last
    measurement). Returns the deciding measurement.
    """
    if not isinstance(runs, dict) or not runs:
        raise BadValue(
            f"runs must be a non-empty dict {{name: function of no arguments}}, got {runs!r}",
            arg="runs",
        )
    if not callable(holds):
        raise BadType(
            "holds must be a function of the sides' median seconds, e.g. lambda t: t['a'] < "
            f"t['b']; got {holds!r}",
            arg="holds",
        )
    positive_int("rounds", rounds)
    if isinstance(budget_s, bool) or not isinstance(budget_s, numbers.Real) or not budget_s >= 0:
        raise BadValue(
            f"budget_s must be a number of seconds >= 0, got {budget_s!r}", arg="budget_s"
        )
    if first is not None and (
        not isinstance(first, dict) or set(first) != set(runs) or not all(first.values())
    ):
        raise BadValue(
            f"first must hold samples for exactly the sides {list(runs)}, got {first!r}"[:300],
            arg="first",
        )
    # where the notebooks compute
    device = default_device() if device is None else checked_device(device)
    clock = steady_clock(device) if device.type == "cpu" else None
    start, attempts = time.perf_counter(), 0
    samples = {k: list(v) for k, v in first.items()} if first is not None else None
    while True:
        if samples is None:
            samples = interleaved(
                runs, rounds, warmup=warmup if attempts == 0 else 0, clock=clock, device=device
            )
        attempts += 1
        timed = Timed(samples, attempts, time.perf_counter() - start)
        if truth(holds(timed.medians())):
            return timed
        if not _undecided(samples, holds) or time.perf_counter() - start >= budget_s:
            claim(name, False, timed.describe(), noisy=True)  # (a learner's kernel: a caveat)
            return timed
        samples = None


def say(text: str) -> None:
    """Show ``text`` (Markdown, usually an f-string of measured values) as the cell's output."""
    from IPython.display import Markdown, display

    if not isinstance(text, str):
        raise BadType(
            f"say needs text to be a str (Markdown, e.g. an f-string), got {text!r}", arg="text"
        )
    display(Markdown(text))


def magnitude(x: float) -> str:
    """A positive number as a power of ten for prose: 6.2e5 -> '6 × 10⁵', 1.2e-3 -> '1 × 10⁻³'."""
    # a 0-d tensor or numpy scalar: its number
    if getattr(x, "ndim", None) == 0 and not isinstance(x, bool):
        x = x.item()
    if isinstance(x, bool) or not (isinstance(x, numbers.Real) and math.isfinite(x) and x > 0):
        raise BadValue(f"magnitude needs x to be a finite positive number, got {x!r}", arg="x")
    # exact, subnormals included
    mantissa, exponent = (int(part) for part in f"{float(x):.0e}".split("e"))
    superscript = str(exponent).translate(str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹"))
    return f"{mantissa} × 10{superscript}"


def plural(n: int, word: str, many: str | None = None) -> str:
    """A count with its noun for prose: plural(1, 'thread') -> '1 thread', plural(2, 'KV head') ->
    '2 KV heads'."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise BadType(f"plural needs n to be an int count, got {n!r}", arg="n")
    if not isinstance(word, str) or not (many is None or isinstance(many, str)):
        raise BadType(f"plural needs word (and many, if given) to be str, got {word!r}, {many!r}",
                      arg="word" if not isinstance(word, str) else "many")
    return f"{int(n):,} {word if n == 1 else (many or word + 's')}"
