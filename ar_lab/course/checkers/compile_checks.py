"""Appendix A1's check: a decode step compiled once for every position.

``check_compiles_once`` hands the learner's function a decode step ``step(token, cache, pos)``, runs
what it returns at several positions of a cache beside the eager step on a cache of its own, and
counts the graphs TorchDynamo made meanwhile (its own counter, after a reset). The logits and the
keys and values written must be the eager step's, to float rounding, and one graph must serve every
position. Each wrong count of graphs is named:

- none: the step came back uncompiled;
- two: the default compile took the first position it saw as a constant, and compiled again, with
  the position as a symbol, at the second ("automatic dynamic shapes");
- one per position: every position a constant (``dynamic=False``), a compile each until PyTorch's
  recompile limit, then eager steps without a word.

The learner's compile traces the step, and the graphs are counted by the process that compiled. The
grading step runs a learner's answer in a process of its own, where the test's step is only a handle
that no compile traces, so this test keeps the kernel's verdict (INSTRUCTORS.md lists it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ar_lab.course.checkers.answers import require_answer
from ar_lab.course.checkers.checks import check_matches, run_answer, verdict

NOT_COMPILED = "the step uncompiled (no graph made)"
RECOMPILED = "a compile that took the first position as a constant and compiled again at the next"
PER_POSITION = "a graph for every position (each position a constant: dynamic=False)"


def _graphs() -> int:
    from torch._dynamo.utils import counters  # (imported at first use: it takes a while)

    return int(counters["stats"]["unique_graphs"])


def graph_mistake(graphs: int, positions: int) -> str | None:
    """The named mistake ``graphs`` graphs for ``positions`` different positions stand for (None:
    one graph, right; or a count no named mistake makes)."""
    if graphs == 0:
        return NOT_COMPILED
    if graphs == positions > 2:
        return PER_POSITION
    if graphs == 2:
        return RECOMPILED
    return None


def check_compiles_once(
    what: str,
    compile_once: Callable,
    step: Callable,
    make_cache: Callable,
    positions: Sequence[int],
    hint: str = "",
) -> int:
    """``compile_once(step)`` is ``step`` compiled into one graph for every position of
    ``positions`` (each past 1 and short of the cache's end: torch gives the values 0 and 1, and a
    read to a buffer's end, graphs of their own): its logits and cache writes are the eager step's.
    ``make_cache()``: a fresh cache for ``step``. Returns the number of graphs (1)."""
    import torch._dynamo as dynamo

    require_answer("compile_once", compile_once)  # None, or the package's own: no answer yet
    dynamo.reset()  # no graph of an earlier compile of `step` is reused, and counted afresh
    before = _graphs()
    eager_cache, cache = make_cache(), make_cache()
    # PyTorch can remember on disk which ints changed in earlier runs and start from a symbol: off,
    # so a compile that would recompile does so here too
    with torch.inference_mode(), dynamo.config.patch(automatic_dynamic_local_pgo=False):
        compiled = run_answer(what, compile_once, step, hint=hint)
        if not callable(compiled):
            raise verdict(what, f"expected the compiled step (a callable), got "
                          f"{type(compiled).__name__}", hint)
        for i, pos in enumerate(positions):
            token = torch.tensor([1 + i])  # (ids below 10: any vocabulary of the tests)
            expected = step(token, eager_cache, pos)
            got = run_answer(f"{what}, the step at position {pos}", compiled, token, cache, pos,
                             hint=hint)
            check_matches(f"{what}: the logits at position {pos}", got, expected, atol=1e-4,
                          rtol=1e-4, hint=hint)
            for name, written, want in (("keys", cache.k, eager_cache.k),
                                        ("values", cache.v, eager_cache.v)):
                check_matches(f"{what}: the {name} written at position {pos}",
                              torch.stack([w[:, :, pos] for w in written]),
                              torch.stack([w[:, :, pos] for w in want]), atol=1e-4, rtol=1e-4,
                              hint=hint)
    graphs = _graphs() - before
    if graphs != 1:
        mistake = graph_mistake(graphs, len(positions))
        said = f"your code gives {mistake}" if mistake else "one graph for all of them is the goal"
        raise verdict(what, f"{graphs} graph(s) compiled for {len(positions)} positions: {said}",
                      hint, mistake)
    return graphs
