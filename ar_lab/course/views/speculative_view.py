"""Speculative decoding measured on real prompts: what chapter 07's explorer and benchmark show.

``speculation_view`` runs plain and speculative decoding of one prompt side by side, with
the same settings, and gathers the measured acceptance rate alpha, the cost ratio c and
the speedup next to the theory's curves (``ar_lab.engine.speculative``). The explorer widget is
a thin shell over it, drawing with ``plot_speculation_view`` and ``speculation_text_html``
(the text coloured by who chose each token). ``ar_lab.model.data.benchmark_prompts`` gives the fixed
validation prompts that the chapter and ``python -m ar_lab.bench speculative`` time on.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ar_lab.base.args import check_seed
from ar_lab.base.errors import BadValue
from ar_lab.base.timing import interleaved, steady_clock
from ar_lab.engine.generate import generate
from ar_lab.engine.sampling import GREEDY, SamplingParams
from ar_lab.engine.speculative import (
    SpeculativeGeneration,
    expected_speedup,
    expected_tokens_per_iteration,
    speculative_generate,
    token_sources,
)
from ar_lab.model.tokenizer import EOS_ID, StreamDecoder


@dataclass
class SpeculationView:
    """One setting of the explorer: a speculative run, the plain run it is timed against, the
    theory."""

    prompt: str
    draft_name: str
    gamma: int
    sampling: SamplingParams
    seed: int
    result: SpeculativeGeneration
    # ar_lab.engine.generate.Generation: plain cached decoding with the target, same settings
    baseline: object
    baseline_time: float  # seconds for the plain run (the fastest of the repeats)
    speculative_time: float  # seconds for the speculative run (the fastest of the repeats)
    clock_name: str = "wall clock"
    max_gamma: int = 8
    # every plain run's seconds, one per round (the rounds took turns)
    baseline_times: tuple[float, ...] = ()
    speculative_times: tuple[float, ...] = ()  # every speculative run's seconds, in the same rounds

    @property
    def alpha(self) -> float:
        return self.result.stats.alpha

    @property
    def tokens_per_target_call(self) -> float:
        return self.result.stats.tokens_per_target_call

    @property
    def target_step_time(self) -> float:
        """Seconds per token of plain decoding: one target step, as plain decoding pays it."""
        return self.baseline_time / max(1, len(self.baseline.tokens))

    @property
    def cost_ratio(self) -> float:
        """c: one draft forward pass (with its pick) / one target step, both measured in this
        view."""
        return self.result.stats.draft_time_per_call / self.target_step_time if self.gamma else 0.0

    @property
    def verify_cost(self) -> float:
        """The target's side of an iteration (pass, accept rule, draws) in plain decode steps
        (theory: 1)."""
        s = self.result.stats
        return s.target_time / s.target_calls / self.target_step_time

    @property
    def predicted_with_verify(self) -> float:
        """The predicted speedup with the measured verify cost in place of the theory's one step."""
        a = min(max(self.alpha, 0.0), 1.0)
        return expected_tokens_per_iteration(a, self.gamma) / (
            self.gamma * self.cost_ratio + self.verify_cost
        )

    @property
    def speedups(self) -> list[float]:
        """Plain time / speculative time in each round (the two ran in turns, so a round's load hits
        both)."""
        pairs = zip(self.baseline_times, self.speculative_times, strict=True)
        return [plain / spec for plain, spec in pairs] or [
            self.baseline_time / self.speculative_time
        ]

    @property
    def measured_speedup(self) -> float:
        """Plain decoding's time / speculative decoding's, for the same number of tokens: the median
        of the rounds' ratios (one run is one draw from a spread: ``speedup_range`` gives it)."""
        return statistics.median(self.speedups)

    @property
    def speedup_range(self) -> tuple[float, float]:
        """The lowest and highest of the rounds' speedups."""
        return min(self.speedups), max(self.speedups)

    @property
    def predicted_speedup(self) -> float:
        return expected_speedup(min(max(self.alpha, 0.0), 1.0), self.gamma, self.cost_ratio)

    @property
    def same_tokens(self) -> bool:
        return self.result.tokens == self.baseline.tokens

    def theory(self) -> dict[str, list[float]]:
        """The curves over gamma = 0..max_gamma for the measured alpha and c."""
        a, c = min(max(self.alpha, 0.0), 1.0), self.cost_ratio
        gammas = list(range(self.max_gamma + 1))
        return {
            "gamma": gammas,
            "tokens_per_iteration": [expected_tokens_per_iteration(a, g) for g in gammas],
            "speedup": [expected_speedup(a, g, c) for g in gammas],
        }


def _check_view_arguments(prompt, gamma, max_gamma, repeats, seed) -> None:
    """``speculation_view``'s own arguments, checked before anything runs."""
    if not isinstance(prompt, str) or not prompt:
        raise BadValue("the prompt is empty: type at least one character", arg="prompt")
    if not isinstance(max_gamma, int) or isinstance(max_gamma, bool) or max_gamma < 1:
        raise BadValue(f"max_gamma must be an int >= 1, got {max_gamma!r}", arg="max_gamma")
    if not isinstance(gamma, int) or isinstance(gamma, bool) or not 1 <= gamma <= max_gamma:
        raise BadValue(
            f"gamma must be a whole number from 1 to max_gamma ({max_gamma}), got {gamma!r}",
            arg="gamma",
        )
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise BadValue(f"repeats must be an int >= 1, got {repeats!r}", arg="repeats")
    check_seed(seed)


def speculation_view(
    target,
    draft,
    prompt: str,
    *,
    gamma: int = 4,
    sampling: SamplingParams = GREEDY,
    seed: int = 0,
    max_new_tokens: int = 64,
    draft_name: str = "draft",
    max_gamma: int = 8,
    repeats: int = 2,
    clock: Callable[[], float] | None = None,
    accept=None,
    iteration=None,
) -> SpeculationView:
    """Run plain and speculative decoding side by side on ``prompt`` and gather what the explorer
    shows.

    Both runs generate exactly ``max_new_tokens`` tokens (no EOS stop, so their times compare) with
    ``sampling``, each from a generator seeded with ``seed``. They take turns ``repeats`` times
    (``ar_lab.base.timing.interleaved``) and the fastest run of each is kept (a shared machine's
    hiccups only ever add time) for the counts and the cost ratio c; the speedup is the median of
    the rounds' ratios, with their range beside it (``speedups``). Timed with ``clock`` (default:
    ``ar_lab.base.timing.steady_clock``). The same arguments give the same tokens and counts; the
    times are measurements. ``accept``: an accept rule of one's own for the speculative run
    (``ar_lab.engine.accept.AcceptRule``; chapter 07), ``iteration`` a loop's round of one's own
    (``speculative_generate``'s ``iteration=``; chapter 07's exercise 2).
    """
    _check_view_arguments(prompt, gamma, max_gamma, repeats, seed)
    device = target.device
    clock = steady_clock(device) if clock is None else clock

    def seeded():
        return torch.Generator(device).manual_seed(seed)

    def run(name: str):
        if name == "plain":
            return generate(
                target, prompt, max_new_tokens, sampling=sampling, generator=seeded(), eos_id=None
            )
        return speculative_generate(
            target,
            draft,
            prompt,
            max_new_tokens,
            gamma,
            sampling=sampling,
            generator=seeded(),
            eos_id=None,
            clock=clock,
            accept=accept,
            iteration=iteration,
        )

    generate(target, prompt, 2, sampling=sampling, generator=seeded(), eos_id=None)  # warm-up
    # every run's output, in the order of its times
    outs: dict[str, list] = {"plain": [], "speculative": []}
    runs = {name: lambda name=name: outs[name].append(run(name)) for name in outs}
    times = interleaved(runs, repeats, clock=clock, device=device)

    def fastest(name: str) -> tuple[float, object]:
        """A side's fastest run (the first, if tied) and its output."""
        i = times[name].index(min(times[name]))
        return times[name][i], outs[name][i]

    clock_name = "CPU time" if clock in (time.process_time, time.thread_time) else "wall clock"
    (t_plain, baseline), (t_spec, result) = fastest("plain"), fastest("speculative")
    return SpeculationView(
        prompt,
        draft_name,
        gamma,
        sampling,
        seed,
        result,
        baseline,
        t_plain,
        t_spec,
        clock_name,
        max_gamma,
        tuple(times["plain"]),
        tuple(times["speculative"]),
    )


def token_pieces(tokens: Sequence[int]) -> list[str]:
    """The text each token completes, one string per token.

    A character of several UTF-8 bytes (each byte a token) belongs to the token that completed
    it; the tokens before it in that character get "". EOS is shown as "⟨EOS⟩" (bytes it cut
    short become U+FFFD, on the token before it). Joined, the pieces read as the decoded text.
    """
    pieces: list[str] = []
    decoder = StreamDecoder()
    for token in tokens:
        if token == EOS_ID:
            if pieces:
                pieces[-1] += decoder.flush()
            pieces.append("⟨EOS⟩")
            decoder = StreamDecoder()
        else:
            pieces.append(decoder.feed(token))
    if pieces:
        pieces[-1] += decoder.flush()
    return pieces


def _text_span(piece: str, colour: str) -> str:
    """One token's text in its colour; whitespace, which no text colour shows, is shaded in it
    instead (a line end also gets a visible ↵), so a run of spaces shows who chose each one."""
    import html

    if not piece.isspace():
        return f"<span style='color:{colour}'>{html.escape(piece)}</span>"
    shown = html.escape(piece).replace("\n", "↵\n")
    return f"<span style='color:{colour};background:{colour}40'>{shown}</span>"


def speculation_text_html(view) -> str:
    """The generated text with each character coloured by who chose the token that completed it:
    an accepted draft token or the target (whitespace shaded in that colour, line ends marked ↵)."""
    import html

    from ar_lab.course.views.plots import COLORS

    pieces = token_pieces(view.result.tokens)
    spans = [
        _text_span(piece, COLORS[source])
        for piece, source in zip(pieces, token_sources(view.result.stats), strict=False)
        if piece
    ]
    legend = (
        f"<span style='color:{COLORS['draft']}'>■ accepted draft token</span> &nbsp; <span "
        f"style='color:{COLORS['target']}'>■ token drawn by the target (residual or "
        "bonus)</span> &nbsp; (spaces shaded in these colours, line ends marked ↵)"
    )
    prompt = html.escape(view.prompt)
    return (
        f"<div>{legend}</div><pre style='white-space:pre-wrap;margin:2px 0'>"
        f"<span style='color:#7f8c8d'>{prompt}</span>{''.join(spans)}</pre>"
    )


def plot_speculation_view(axes, view):
    """Two panels: tokens per target call and measured speedup against gamma.

    Lines: the theory for the alpha and c measured in ``view`` (Leviathan et al., 2023); dots: what
    this run measured at its gamma (the speedup: the median of the runs, with their range).
    """
    from ar_lab.course.views.plots import COLORS

    theory = view.theory()
    gammas = theory["gamma"]
    left, right = axes
    left.plot(
        gammas, theory["tokens_per_iteration"], "-o", ms=3, color=COLORS["theory"], label="theory"
    )
    left.plot(
        gammas, [g + 1 for g in gammas], ":", color=COLORS["dropped"], label="ceiling γ + 1 (α = 1)"
    )
    left.plot(
        [view.gamma],
        [view.tokens_per_target_call],
        "o",
        ms=9,
        color=COLORS["draft"],
        label="measured",
    )
    left.set_xlabel("γ (draft tokens per iteration)")
    left.set_ylabel("tokens per target call")
    left.set_title(f"α = {view.alpha:.2f} (measured)", fontsize=10.5)
    left.legend(loc="upper left")
    label = f"theory (c = {view.cost_ratio:.2f})"
    right.plot(gammas, theory["speedup"], "-o", ms=3, color=COLORS["theory"], label=label)
    right.axhline(1.0, color=COLORS["accent"], lw=1, ls="--", label="plain decoding")
    low, high = view.speedup_range
    mid = view.measured_speedup
    right.errorbar(
        [view.gamma],
        [mid],
        yerr=[[mid - low], [high - mid]],
        fmt="o",
        ms=9,
        capsize=5,
        color=COLORS["draft"],
        label=f"measured: median, min–max of {len(view.speedups)} runs",
    )
    right.set_xlabel("γ (draft tokens per iteration)")
    right.set_ylabel("speedup over plain decoding (×)")
    right.set_title(f"draft: {view.draft_name}, {view.sampling.label}", fontsize=10.5)
    right.set_ylim(bottom=0)
    right.legend(loc="best")
    for ax in axes:
        ax.set_xticks(gammas)
    return axes


# how far from 1 the probabilities chi_square tests against may sum (float32 rounding)
PROBS_TOLERANCE = 1e-4


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int, float]:
    """Pearson's chi-square test of observed ``counts`` (K,) against exact probabilities ``probs``
    (K,).

    ``counts`` must be whole numbers >= 0, not all 0; ``probs`` a distribution (>= 0, summing to 1
    within ``PROBS_TOLERANCE``): a ``BadValue`` naming the argument otherwise, since the test would
    return a p-value for a question that means nothing.

    Returns (statistic, degrees of freedom, upper-tail p-value), over the outcomes with probability
    > 0; an outcome of probability 0 that was observed makes the p-value 0 (impossible under
    ``probs``). How chapter 07 checks that speculative sampling reproduces the target's distribution
    exactly.
    """
    counts, probs = (
        torch.as_tensor(counts, dtype=torch.float64),
        torch.as_tensor(probs, dtype=torch.float64),
    )
    if counts.shape != probs.shape or counts.ndim != 1:
        raise BadValue(
            f"counts and probs must be 1-D of one length, got {tuple(counts.shape)}, "
            f"{tuple(probs.shape)}",
            arg="probs" if counts.ndim == 1 else "counts",
        )
    if (
        not bool(torch.isfinite(counts).all())
        or bool((counts < 0).any())
        or bool((counts != counts.round()).any())
    ):
        raise BadValue(
            "counts must be whole numbers >= 0 (how often each outcome was seen), got "
            f"{counts.tolist()}",
            arg="counts",
        )
    if float(counts.sum()) == 0:
        raise BadValue(
            "counts are empty: no outcome was observed, so there is nothing to test", arg="counts"
        )
    total = float(probs.sum())
    if (
        not bool(torch.isfinite(probs).all())
        or bool((probs < 0).any())
        or abs(total - 1.0) > PROBS_TOLERANCE
    ):
        raise BadValue(
            "probs must be a distribution: finite, >= 0 and summing to 1 (within "
            f"{PROBS_TOLERANCE:g}), got {[round(x, 6) for x in probs.tolist()[:8]]}"
            f"{' ...' * (len(probs) > 8)}, summing to {total:.6g}",
            arg="probs",
        )
    possible = probs > 0
    n = float(counts.sum())
    expected = n * probs[possible]
    stat = float(((counts[possible] - expected) ** 2 / expected).sum())
    dof = int(possible.sum()) - 1
    if counts[~possible].sum() > 0:
        return float("inf"), dof, 0.0
    half = {"dtype": torch.float64}
    upper = torch.special.gammaincc(torch.tensor(dof / 2, **half), torch.tensor(stat / 2, **half))
    return stat, dof, float(upper)
