"""Chapter 08c's checker for chunked prefill: a learner's server step, run by ``serve`` on the
course model, against unchunked serving, with the classic slips named.

``check_chunked_step`` watches every step (what ran, in which order, how many prompt positions it
prefilled): a whole prompt prefilled at once (the budget ignored), more positions than the budget,
a step that runs no decode for the running rows (they stall behind the prompt) or runs it after a
chunk (their tokens wait for it), a step that stops with budget left while a prompt is half in; then
every request's tokens must be unchunked serving's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from ar_lab.course.checkers.checks import run_answer, verdict
from ar_lab.engine.serving import Request, serve
from ar_lab.model.data import builtin_corpus
from ar_lab.model.tokenizer import encode
from ar_lab.model.train.presets import load_pretrained


@functools.cache
def _course():
    return load_pretrained("course", "cpu")


def chunk_workload(seed: int = 0) -> list[Request]:
    """Chats with a few new tokens each and two documents of 100 to 160 positions among them."""
    text = builtin_corpus()
    start = 1000 + 731 * seed
    chats = [Request(encode(text[start + 50 * i : start + 50 * i + 12 + 7 * i]), 10 + 3 * i)
             for i in range(4)]
    docs = [Request(encode(text[start + 400 + 300 * i : start + 500 + 360 * i]), 4)
            for i in range(2)]
    return [chats[0], chats[1], docs[0], chats[2], docs[1], chats[3]]


class _Watch:
    """Every step's record: rows running at its start, the helpers it called in order, positions
    prefilled, and whether a prompt was left half in."""

    def __init__(self, fn: Callable, chunk: int) -> None:
        self.fn, self.chunk, self.steps = fn, chunk, []

    def __call__(self, server) -> None:
        calls: list[str] = []
        for name in ("decode", "prefill", "prefill_chunk"):
            setattr(server, name, self._logged(getattr(type(server), name), server, name, calls))
        rows, before = len(server.rows), server.positions_prefilled
        try:
            self.fn(server, self.chunk)
        finally:
            for name in ("decode", "prefill", "prefill_chunk"):
                delattr(server, name)
        self.steps.append((rows, calls, server.positions_prefilled - before,
                           server.prefilling is not None))

    @staticmethod
    def _logged(method, server, name: str, calls: list):
        def call(*args, **kwargs):
            calls.append(name)
            return method(server, *args, **kwargs)

        return call


def _step_verdict(what: str, steps, chunk: int, hint: str) -> None:
    for n, (rows, calls, prefilled, half_in) in enumerate(steps):
        if "prefill" in calls:
            raise verdict(what, f"step {n} prefilled a whole prompt (server.prefill): prefill in "
                                f"chunks of at most {chunk} positions (server.prefill_chunk)",
                          hint, "a whole prompt prefilled at once, the budget ignored")
        if prefilled > chunk:
            raise verdict(what, f"step {n} prefilled {prefilled} prompt positions, over its "
                                f"budget of {chunk}", hint, "more positions than the budget")
        if rows and "decode" not in calls:
            raise verdict(what, f"step {n} began with {rows} running rows and ran no decode step: "
                                "they wait behind the prompt, as without chunking", hint,
                          "no decode step for the running rows while a prompt is prefilled")
        if rows and "prefill_chunk" in calls and calls.index("prefill_chunk") < calls.index(
                "decode"):
            raise verdict(what, f"step {n} prefilled a chunk before the running rows' decode step: "
                                "their tokens wait for the chunk", hint,
                          "a chunk prefilled before the running rows' decode step")
        if half_in and prefilled < chunk:
            raise verdict(what, f"step {n} prefilled {prefilled} of its {chunk} positions and "
                                "stopped with a prompt half in: spend the budget", hint,
                          "a step that stops with budget left while a prompt is half in")


def check_chunked_step(fn: Callable, chunk: int = 16, seed: int = 0, hint: str = "") -> None:
    """``fn(server, chunk)`` is a server step with chunked prefill: run by ``serve`` (three rows),
    each step within its budget and decoding the running rows first, every request's tokens those
    of unchunked serving."""
    what = f"my_chunked_step(server, chunk={chunk})"
    model, work = _course(), chunk_workload(seed)
    watch = _Watch(fn, chunk)
    # (a StepError from the loop, or a helper's BadValue, comes back as a verdict naming it)
    got = run_answer(what, serve, model, work, max_batch=3, eos_id=None, step=watch, hint=hint)
    _step_verdict(what, watch.steps, chunk, hint)
    want = serve(model, work, max_batch=3, eos_id=None)
    for i, (a, b) in enumerate(zip(got.results, want.results, strict=True)):
        if a.tokens != b.tokens:
            raise verdict(what, f"request {i} got tokens {a.tokens[:8]}..., unchunked serving "
                                f"{b.tokens[:8]}...", hint)
