"""Chapter 07's course layer: the explorer's spread of runs, whitespace drawn visibly, the
benchmark's report without its targets, and the accept rule's named mistakes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ar_lab.course.checkers.checks import CheckFailed, check_matches
from ar_lab.course.checkers.mistakes import (
    accept_dist_mistakes,
    accepted_count_mistakes,
    check_exact,
    check_raises,
)
from ar_lab.course.views.plots import COLORS
from ar_lab.course.views.speculative_view import SpeculationView, speculation_text_html
from ar_lab.engine.accept import accept_step
from ar_lab.engine.sampling import GREEDY
from ar_lab.engine.speculative import SpeculativeStats
from ar_lab.model.tokenizer import encode
from tests.raising import mistaken


def _view(baseline_times, speculative_times):
    return SpeculationView(
        "ab",
        "d",
        2,
        GREEDY,
        0,
        SimpleNamespace(stats=None),
        SimpleNamespace(tokens=[1]),
        min(baseline_times),
        min(speculative_times),
        "CPU time",
        8,
        tuple(baseline_times),
        tuple(speculative_times),
    )


def test_the_speedup_is_the_median_of_the_rounds_with_their_range():
    view = _view([1.0, 2.0, 1.2], [1.0, 1.0, 2.4])  # rounds: 1.0x, 2.0x, 0.5x
    assert view.speedups == [1.0, 2.0, 0.5]
    assert view.measured_speedup == 1.0 and view.speedup_range == (0.5, 2.0)
    # no rounds kept: the one ratio
    single = SpeculationView("ab", "d", 2, GREEDY, 0, None, None, 3.0, 2.0)
    assert single.speedups == [1.5] and single.speedup_range == (1.5, 1.5)
    with pytest.raises(ValueError):  # rounds of two lengths cannot be paired
        _ = _view([1.0, 2.0], [1.0]).speedups


def test_whitespace_is_shaded_in_the_colour_of_whoever_chose_it():
    stats = SpeculativeStats(gamma=2, accepted_per_iteration=[2, 0], emitted_per_iteration=[3, 1])
    view = SimpleNamespace(prompt="A ", result=SimpleNamespace(tokens=encode("a \nb"), stats=stats))
    html = speculation_text_html(view)  # a, space, newline: draft, draft, target; b: target
    draft, target = COLORS["draft"], COLORS["target"]
    assert f"<span style='color:{draft}'>a</span>" in html
    assert f"<span style='color:{draft};background:{draft}40'> </span>" in html
    assert f"<span style='color:{target};background:{target}40'>↵\n</span>" in html
    assert f"<span style='color:{target}'>b</span>" in html


def test_the_benchmark_report_can_leave_out_its_targets():
    from ar_lab.bench.speculative import format_speculative_results, speculative_benchmark
    from ar_lab.model.gpt import GPT, GPTConfig

    def tiny(seed, **kw):
        torch.manual_seed(seed)
        return GPT(
            GPTConfig(**{"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 64, **kw})
        ).eval()

    res = speculative_benchmark(
        tiny(0),
        tiny(1, n_layer=1, n_embd=16),
        tokens=8,
        prompts=1,
        prompt_tokens=8,
        gammas=[1, 2],
        repeats=1,
        modes={"greedy": GREEDY},
    )
    full, measured = format_speculative_results(res), format_speculative_results(res, targets=False)
    assert "targets (greedy" in full and "met" in full
    assert (
        "targets (greedy" not in measured
        and " met" not in measured
        and measured in full.replace("\n" + full.splitlines()[-1], "")
    )


def test_the_accept_rule_mistakes_are_named():
    p = torch.tensor([0.05, 0.45, 0.25, 0.15, 0.10])
    q = torch.tensor([0.30, 0.20, 0.30, 0.05, 0.15])
    P, Q = torch.stack([p, p, p]), torch.stack([q, q])
    drafts, u = [0, 1], torch.tensor([0.5, 0.0])  # a rejected at once: the residual at position 0
    n, dist = accept_step(P, Q, drafts, u)
    wrong = accept_dist_mistakes(P, Q, n)
    with mistaken("drawing the replacement from p instead of the residual"):
        check_matches("dist", p, dist, mistakes=wrong)
    unnormalised = (p - q).clamp_min(0)
    with mistaken("left unnormalised"):
        check_matches("dist", unnormalised, dist, mistakes=wrong)
    check_matches("dist", dist, dist, mistakes=wrong)  # the right answer passes
    # a full accept: the bonus from the wrong row
    assert "p[γ - 1]" in next(iter(accept_dist_mistakes(P, Q, 2)))
    # a run that does not stop at the first rejection: c rejected (0.9 >= 5/6), then a passes
    counted = accepted_count_mistakes(P, Q, [2, 0], torch.tensor([0.9, 0.1]))
    with mistaken("stopping at the first rejection"):
        check_exact("n", 1, 0, counted)


def test_check_raises_names_a_missing_error():
    def refuses(a):
        if a < 0:
            raise ValueError("a must be >= 0")
        return a

    check_raises("refuses", refuses, [(-1,), (-2,)])
    with pytest.raises(CheckFailed, match=r"refuses\(1\): returned 1; expected a ValueError"):
        check_raises("refuses", refuses, [(-1,), (1,)])
    with pytest.raises(CheckFailed, match="raised TypeError"):
        check_raises("refuses", refuses, [("x",)])

    def stub(a):
        raise NotImplementedError()

    with pytest.raises(CheckFailed, match="not implemented yet"):
        check_raises("stub", stub, [(1,)])


def test_the_view_runs_an_iteration_of_ones_own_and_measures_the_verify_cost():
    """speculation_view(..., iteration=) runs the loop's round passed in (chapter 07's section 6
    runs the learner's): ar_lab's own round gives the default's tokens and counts; the verify cost
    is the target's time per call in plain decode steps, and the prediction with it uses that cost
    in place of one step."""
    from ar_lab.course.views.speculative_view import speculation_view
    from ar_lab.engine.speculative import expected_tokens_per_iteration, speculative_iteration
    from ar_lab.model.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    target = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=96)).eval()
    calls = []

    def counted(*args):
        calls.append(args[3])
        return speculative_iteration(*args)

    mine = speculation_view(
        target, target, "abc", gamma=3, max_new_tokens=20, repeats=1, iteration=counted
    )
    plain = speculation_view(target, target, "abc", gamma=3, max_new_tokens=20, repeats=1)
    assert (
        calls
        and calls[0] == 3
        and mine.result.tokens == plain.result.tokens == mine.baseline.tokens
    )
    s = mine.result.stats
    assert mine.verify_cost == pytest.approx(s.target_time / s.target_calls / mine.target_step_time)
    want = expected_tokens_per_iteration(1.0, 3) / (3 * mine.cost_ratio + mine.verify_cost)
    assert mine.alpha == 1.0 and mine.predicted_with_verify == pytest.approx(want)
