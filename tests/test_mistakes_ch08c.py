"""Chapter 08c's named mistakes: the chunked server step, the router and the dispatch. Each classic
slip, written out by hand, fails its check naming it; the right answer passes."""

import pytest
import torch

from ar_lab.course.checkers.checks import CheckFailed
from ar_lab.course.checkers.chunk_checks import check_chunked_step
from ar_lab.course.checkers.moe_checks import check_dispatch, check_route
from ar_lab.engine.serving import chunked_step
from ar_lab.model.cache import row_mask
from ar_lab.model.moe import dispatch, route
from tests.raising import fails_naming


def _decode(server):
    tokens = server.pick(server.decode(row_mask(server.lengths, 1)))
    server.retire([i for i, t in enumerate(tokens) if server.record(i, t)])


def _next_prompt(server):
    j = server.prefilling
    if j is None and server.waiting and len(server.rows) < server.max_batch:
        j = server.waiting.popleft()
    return j


def whole_prompts(server, chunk):
    if server.rows:
        _decode(server)
    if server.waiting and len(server.rows) < server.max_batch:
        server.prefill(server.waiting.popleft())


def chunk_first(server, chunk):
    rows = bool(server.rows)
    j = _next_prompt(server)
    if j is not None:
        server.prefill_chunk(j, min(chunk, server.prompt_left(j)))
    if rows:
        _decode(server)


def stall_while_prefilling(server, chunk):
    j = _next_prompt(server)
    if j is not None:
        server.prefill_chunk(j, min(chunk, server.prompt_left(j)))
    elif server.rows:
        _decode(server)


def over_budget(server, chunk):
    if server.rows:
        _decode(server)
    j = _next_prompt(server)
    if j is not None:
        server.prefill_chunk(j, min(2 * chunk, server.prompt_left(j)))


def one_chunk_of_what_is_left(server, chunk):  # stops at a prompt's end, budget or not
    if server.rows:
        _decode(server)
    j = _next_prompt(server)
    if j is not None:
        server.prefill_chunk(j, min(chunk, server.prompt_left(j), 5))


def test_the_chunked_step_passes_and_each_slip_is_named():
    check_chunked_step(chunked_step, chunk=16)
    check_chunked_step(chunked_step, chunk=7, seed=1)
    for slip, named in [
        (whole_prompts, "a whole prompt prefilled at once, the budget ignored"),
        (chunk_first, "a chunk prefilled before the running rows' decode step"),
        (stall_while_prefilling, "no decode step for the running rows while a prompt is prefilled"),
        (over_budget, "more positions than the budget"),
        (one_chunk_of_what_is_left, "a step that stops with budget left while a prompt is half in"),
    ]:
        fails_naming(named, check_chunked_step, slip, chunk=16)
    # a step that breaks the loop (it does nothing): the loop's StepError, as a verdict
    with pytest.raises(CheckFailed):
        check_chunked_step(lambda server, chunk: None, chunk=16)


def test_the_router_passes_in_any_order_and_each_slip_is_named():
    check_route(route, k=2)
    check_route(lambda logits, k: tuple(t.flip(-1) for t in route(logits, k)), k=3, seed=1)
    slips = {
        "the softmax over all experts' logits, not renormalised over the k chosen (a token's "
        "weights then sum to less than 1)":
            lambda lg, k: (lg.topk(k).indices, torch.softmax(lg, -1).gather(1, lg.topk(k).indices)),
        "the chosen logits themselves as weights, with no softmax": lambda lg, k: lg.topk(k)[::-1],
        "the k smallest logits chosen (an ascending sort, or topk(largest=False))":
            lambda lg, k: (lg.topk(k, largest=False).indices,
                           torch.softmax(lg.gather(1, lg.topk(k, largest=False).indices), -1)),
        "a token sent to the same expert twice":
            lambda lg, k: (lg.argmax(-1, keepdim=True).repeat(1, k), torch.full((lg.shape[0], k),
                                                                                1 / k)),
    }
    for named, slip in slips.items():
        fails_naming(named, check_route, slip, k=2)


def test_the_dispatch_passes_and_each_slip_is_named():
    check_dispatch(dispatch)

    def every_expert(h, experts, weights, fns):
        out = torch.zeros_like(h)
        for e, f in enumerate(fns):
            y = f(h)
            w = (weights * (experts == e)).sum(-1, keepdim=True)
            out += w * y
        return out

    def per_token(h, experts, weights, fns):
        out = torch.zeros_like(h)
        for i in range(h.shape[0]):
            for j in range(experts.shape[1]):
                out[i] += weights[i, j] * fns[int(experts[i, j])](h[i : i + 1])[0]
        return out

    def unweighted(h, experts, weights, fns):
        return dispatch(h, experts, torch.ones_like(weights), fns)

    def overwritten(h, experts, weights, fns):
        out = torch.zeros_like(h)
        for e in experts.unique().tolist():
            rows, slot = (experts == e).nonzero(as_tuple=True)
            out[rows] = fns[e](h[rows]) * weights[rows, slot, None]
        return out

    for slip, named in [
        (every_expert, "every expert run, the unchosen ones too"),
        (per_token, "an expert run once per token instead of once on all its rows"),
        (unweighted, "the experts' outputs summed without their weights"),
        (overwritten, "each expert's output written over the rows (out[rows] = ...) instead of "
                      "added: a token's later expert erases its earlier one"),
    ]:
        fails_naming(named, check_dispatch, slip)
