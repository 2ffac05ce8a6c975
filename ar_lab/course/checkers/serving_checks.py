"""Chapter 08's server-step exercise: the learner's step run by ``serve`` beside the package's own.

``check_server_step`` serves the same requests twice, with ``serve_step`` and with the learner's
step, and compares what a user and an operator can observe: each request's tokens, the decode step
at which it finished, and the rows every decode step ran. A step breaking the loop's protocol (a
finished row left in the batch, a row without its token, a step that does nothing) fails inside
``serve`` with its ``StepError``. When the tokens differ, ``server_step_mistakes`` names the classic
wrong mask whose tokens the learner's equal: the package's step run with that mask.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch

from ar_lab.course.checkers.answers import require_answer
from ar_lab.course.checkers.checks import check_equal
from ar_lab.course.checkers.mistakes import name_mistake, row_mask_mistakes
from ar_lab.engine.serving import Request, serve, serve_step


def _wrong(name: str) -> Callable:
    """The mask function ``(lengths, T) -> mask`` of the row-mask mistake ``name``
    (``row_mask_mistakes``)."""
    return lambda lengths, T: torch.tensor(row_mask_mistakes(lengths, T)[name])


def wrong_masks() -> dict[str, Callable]:
    """The classic wrong masks of a decode step: exercise 1's named mistakes (with T = 1, attending
    to every key, no mask at all, is the first: every row masked as if it were as long as the
    longest)."""
    return {name: _wrong(name) for name in row_mask_mistakes([1], 1)}


def server_step_mistakes(
    model, requests: Sequence[Request], **options
) -> dict[str, list[list[int]]]:
    """Each request's tokens when the package's step attends through a classic wrong mask
    (``wrong_masks``)."""
    return {
        name: [
            r.tokens
            for r in serve(model, requests, step=partial(serve_step, mask=mask), **options).results
        ]
        for name, mask in wrong_masks().items()
    }


def check_server_step(model, requests: Sequence[Request], step: Callable, **options) -> None:
    """``serve(model, requests, step=step, **options)`` against ``serve``'s own step: the same
    tokens for each request, the same finish steps and the same rows in every decode step. None, or
    ar_lab's own step, is no answer yet (``answers.require_answer``): ``serve`` would run its own
    step."""
    require_answer("my_server_step", step)
    ours = serve(model, requests, **options)
    yours = serve(model, requests, step=step, **options)
    shown = ", ".join(f"{k}={v!r}" for k, v in options.items())
    what = (
        f"serve(model, {len(requests)} requests, {shown}, step={getattr(step, '__name__', 'step')})"
    )
    got, want = [r.tokens for r in yours.results], [r.tokens for r in ours.results]
    if got != want:
        name_mistake(
            f"{what}: each request's tokens",
            got,
            want,
            server_step_mistakes(model, requests, **options),
            hint="row i's new token sits at position lengths[i]: it sees keys 0..lengths[i], no "
            "padding",
        )
    check_equal(f"{what}: each request's tokens", got, want,
                hint="the decode step's mask must be your row mask of server.lengths with T = 1")
    check_equal(
        f"{what}: the decode step at which each request finished",
        [r.finish_step for r in yours.results],
        [r.finish_step for r in ours.results],
        hint="before each decode step, ask server.policy(waiting, running, max_batch) and "
        "prefill that many (a request its prefill finishes takes no row: admit the next in its "
        "place)",
    )
    check_equal(f"{what}: the rows of every decode step", yours.step_rows, ours.step_rows,
                hint="one decode step per call of your step, over every running row")
