"""Chunked prefill in the server (``serve(chunk=...)``, ``chunked_step``, ``ServerState.
prefill_chunk``): every request's tokens are those of unchunked serving, on either KV layout, with
rows finishing while a prompt is half in; no step prefills more than its budget; bad input is
refused, naming the argument."""

import functools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ar_lab
from ar_lab.base.errors import BadValue
from ar_lab.engine.serving import Request, ServeReport, chunked_step, serve
from ar_lab.engine.serving.requests import RequestResult
from ar_lab.model.cache import row_mask
from ar_lab.model.gpt import GPT, GPTConfig
from tests.greedy import assert_same_greedy
from tests.raising import raises


def _requests(lengths_and_new, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [Request(torch.randint(0, 256, (n,), generator=g).tolist(), new, name=f"r{i}")
            for i, (n, new) in enumerate(lengths_and_new)]


@functools.cache
def _course() -> GPT:
    """The course model: a random tiny model's tokens hardly depend on attention, so misplaced keys
    would go unseen."""
    return ar_lab.load_pretrained("course", "cpu")


def _tokens(report):
    return [r.tokens for r in report.results]


@given(
    work=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12)), min_size=1, max_size=7),
    chunk=st.integers(1, 48),
    max_batch=st.integers(1, 4),
    kv=st.sampled_from(["contiguous", "paged"]),
)
def test_chunked_serving_gives_every_request_the_unchunked_tokens(work, chunk, max_batch, kv):
    model, requests = _course(), _requests(work)
    options = dict(max_batch=max_batch, kv=kv, eos_id=None)
    plain = serve(model, requests, **options)
    chunked = serve(model, requests, chunk=chunk, **options)
    for r, a, b in zip(requests, _tokens(plain), _tokens(chunked), strict=True):
        assert len(a) == len(b) == r.max_new_tokens
        assert_same_greedy(model, r.prompt, a, b)


def test_a_row_finishing_while_a_prompt_is_half_in_leaves_that_prompts_keys_where_they_belong():
    """Row 0 finishes while the long prompt is in its slot (the row after the running ones): the
    slot moves down when it joins, on the contiguous layout, and its tokens stay right."""
    requests = _requests([(3, 2), (3, 20), (50, 6)])
    seen = []

    def step(server):
        chunked_step(server, 8)
        seen.append((len(server.rows), server.prefilling))

    for kv in ("contiguous", "paged"):
        seen.clear()
        got = serve(_course(), requests, max_batch=3, kv=kv, eos_id=None, step=step)
        assert _tokens(got) == _tokens(serve(_course(), requests, max_batch=3, kv=kv,
                                             eos_id=None))
        # request 0 left (one row running) while request 2 was still being prefilled
        assert (1, 2) in seen, seen


def test_no_step_prefills_more_than_its_budget_and_decodes_come_first(tiny_model):
    requests = _requests([(4, 30), (60, 4), (45, 4)])
    per_step = []

    def step(server):
        rows_before, before = len(server.rows), server.positions_prefilled
        tokens_before = sum(len(r.tokens) for r in server.results)
        chunked_step(server, 16)
        per_step.append(server.positions_prefilled - before)
        if rows_before:  # every running row got its token in this step, whatever was prefilled
            assert sum(len(r.tokens) for r in server.results) >= tokens_before + rows_before

    serve(tiny_model, requests, max_batch=3, eos_id=None, step=step)
    assert max(per_step) == 16 and sum(per_step) == 4 + 60 + 45
    # the long prompts took several steps each: the first request decoded in between
    assert sum(1 for n in per_step if n) >= (60 + 45) // 16


def test_the_course_model_serves_32_mixed_requests_chunked_with_the_unchunked_tokens():
    model = _course()
    lengths = [(8 + 37 * i % 200, 4 + 11 * i % 24) for i in range(32)]
    requests = _requests(lengths, seed=1)
    plain = serve(model, requests, max_batch=8, eos_id=None)
    for kv in ("contiguous", "paged"):
        chunked = serve(model, requests, max_batch=8, eos_id=None, chunk=64, kv=kv)
        for r, a, b in zip(requests, _tokens(plain), _tokens(chunked), strict=True):
            assert_same_greedy(model, r.prompt, a, b)


def test_the_report_gives_inter_token_gaps():
    results = [RequestResult(Request([1], 3), [1], [5, 6, 7], [0.5, 0.7, 1.7]),
               RequestResult(Request([1], 2), [1], [5, 6], [0.2, 0.3])]
    report = ServeReport("continuous", 2, results, 2.0, [], [], [])
    assert report.gaps() == pytest.approx([0.2, 1.0, 0.1])
    assert report.max_gap == pytest.approx(1.0)
    assert 0.9 < report.p99_gap <= 1.0
    assert report.summary()["max_gap_s"] == pytest.approx(1.0)


def test_bad_chunks_and_misused_chunk_helpers_are_refused(tiny_model):
    requests = _requests([(5, 3), (9, 3)])
    for bad in (0, -4, 2.5, "8", True):
        with raises(BadValue, "chunk"):
            serve(tiny_model, requests, chunk=bad)
    with raises(BadValue, "chunk"):
        serve(tiny_model, requests, chunk=8, policy="static")
    with raises(BadValue, "chunk"):
        serve(tiny_model, requests, chunk=8, step=lambda server: chunked_step(server, 8))

    def n_zero(server):
        server.prefill_chunk(server.waiting.popleft(), 0)

    def two_at_once(server):
        server.prefill_chunk(server.waiting.popleft(), 2)
        server.prefill_chunk(server.waiting.popleft(), 2)

    def whole_meanwhile(server):
        server.prefill_chunk(server.waiting.popleft(), 2)
        server.prefill(server.waiting.popleft())

    for step, arg in ((n_zero, "n"), (two_at_once, "j"), (whole_meanwhile, "j")):
        with raises(BadValue, arg):
            serve(tiny_model, requests, step=step)


def test_a_server_step_of_ones_own_can_prefill_in_chunks_of_its_choosing():
    """A step that prefills four positions a step, without decoding while a prompt is in, gets
    the tokens of the package's steps."""
    torch.manual_seed(3)
    model = GPT(GPTConfig(block_size=64, n_layer=1, n_head=2, n_embd=16)).eval()
    requests = _requests([(20, 5), (13, 7)])

    def own(server):
        if server.prefilling is not None or (server.waiting and not server.rows):
            j = server.prefilling
            server.prefill_chunk(server.waiting.popleft() if j is None else j, 4)
            return
        tokens = server.pick(server.decode(row_mask(server.lengths, 1)))
        server.retire([i for i, t in enumerate(tokens) if server.record(i, t)])

    got = serve(model, requests, max_batch=1, eos_id=None, step=own)
    assert _tokens(got) == _tokens(serve(model, requests, max_batch=1, eos_id=None))
