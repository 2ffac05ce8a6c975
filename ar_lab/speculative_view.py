"""Speculative decoding measured on real prompts: what chapter 07's explorer and benchmark show.

``speculation_view`` runs plain and speculative decoding of one prompt side by side, with
the same settings, and gathers the measured acceptance rate alpha, the cost ratio c and
the speedup next to the theory's curves (``ar_lab.speculative``). The explorer widget is
a thin shell over it. ``benchmark_prompts`` gives the fixed validation prompts that the
chapter and ``python -m ar_lab.bench speculative`` time on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ar_lab.data import corpus_tokens, train_val_split
from ar_lab.generate import generate
from ar_lab.sampling import GREEDY, SamplingParams
from ar_lab.speculative import (
    SpeculativeGeneration,
    expected_speedup,
    expected_tokens_per_iteration,
    speculative_generate,
)
from ar_lab.timing import steady_clock, synchronize
from ar_lab.tokenizer import EOS_ID, encode


@dataclass
class SpeculationView:
    """One setting of the explorer: a speculative run, the plain run it is timed against, the theory."""

    prompt: str
    draft_name: str
    gamma: int
    sampling: SamplingParams
    seed: int
    result: SpeculativeGeneration
    baseline: object  # ar_lab.generate.Generation: plain cached decoding with the target, same settings
    baseline_time: float  # seconds for the plain run (the fastest of the repeats)
    speculative_time: float  # seconds for the speculative run (the fastest of the repeats)
    clock_name: str = "wall clock"
    max_gamma: int = 8

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
        """c: one draft forward pass (with its pick) / one target step, both measured in this view."""
        return self.result.stats.draft_time_per_call / self.target_step_time if self.gamma else 0.0

    @property
    def measured_speedup(self) -> float:
        """Plain decoding's time / speculative decoding's, for the same number of tokens."""
        return self.baseline_time / self.speculative_time

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
) -> SpeculationView:
    """Run plain and speculative decoding side by side on ``prompt`` and gather what the explorer shows.

    Both runs generate exactly ``max_new_tokens`` tokens (no EOS stop, so their times
    compare) with ``sampling``, each from a generator seeded with ``seed``. They alternate
    ``repeats`` times and the fastest run of each is kept (a shared machine's hiccups
    only ever add time), timed with ``clock`` (default: ``ar_lab.timing.steady_clock``). The
    same arguments give the same tokens and counts; the times are measurements.
    """
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("the prompt is empty: type at least one character")
    if not isinstance(max_gamma, int) or max_gamma < max(gamma, 1):
        raise ValueError(f"max_gamma must be an int >= gamma and >= 1, got {max_gamma!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    device = target.device
    clock = steady_clock(device) if clock is None else clock

    def seeded():
        return torch.Generator(device).manual_seed(seed)

    def run(name: str):
        if name == "plain":
            return generate(target, prompt, max_new_tokens, sampling=sampling, generator=seeded(), eos_id=None)
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
        )

    generate(target, prompt, 2, sampling=sampling, generator=seeded(), eos_id=None)  # warm-up
    best: dict[str, tuple[float, object]] = {}
    for _ in range(repeats):
        for name in ("plain", "speculative"):
            t0 = clock()
            out = run(name)
            synchronize(device)
            seconds = clock() - t0
            if name not in best or seconds < best[name][0]:
                best[name] = (seconds, out)
    clock_name = "CPU time" if clock in (time.process_time, time.thread_time) else "wall clock"
    (t_plain, baseline), (t_spec, result) = best["plain"], best["speculative"]
    return SpeculationView(
        prompt, draft_name, gamma, sampling, seed, result, baseline, t_plain, t_spec, clock_name, max_gamma
    )


def benchmark_prompts(n: int = 3, length: int = 32) -> list[list[int]]:
    """``n`` prompts of up to ``length`` tokens, evenly spaced through the validation text.

    Text the models never trained on; a window that crosses a document boundary starts
    after its EOS. Chapter 07 and ``python -m ar_lab.bench speculative`` time on these.
    """
    if not isinstance(n, int) or n < 1 or not isinstance(length, int) or length < 1:
        raise ValueError(f"n and length must be ints >= 1, got {n!r} and {length!r}")
    _, val = train_val_split(corpus_tokens())
    step = (len(val) - length) // n
    prompts = []
    for i in range(n):
        window = val[i * step : i * step + length].tolist()
        if EOS_ID in window:
            window = window[window.index(EOS_ID) + 1 :] or window[: window.index(EOS_ID)]
        prompts.append([t for t in window if t != EOS_ID] or encode(" "))
    return prompts
