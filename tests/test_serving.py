import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ar_lab.base.errors import BadType, BadValue, ContextFull
from ar_lab.engine.decoder import ForwardDecoder
from ar_lab.engine.generate import generate, stream
from ar_lab.engine.prefix_cache import PrefixCache, reusable_length
from ar_lab.engine.sampling import SamplingParams
from ar_lab.engine.serving import (
    Request,
    StreamSummary,
    generate_batch,
    latency_budget,
    serve,
    simulate,
    tokens_within,
)
from ar_lab.model.cache import BatchKVCache, KVCache
from ar_lab.model.gpt import GPT, GPTConfig
from ar_lab.perf.serving_measure import (
    compare_policies,
    decode_step_runs,
    decode_throughput,
    mixed_workload,
    prefix_ttft,
)
from tests.greedy import assert_same_greedy
from tests.raising import raises

configs = st.builds(
    lambda layers, heads, group, d, seed: (
        GPTConfig(
            block_size=64, n_layer=layers, n_head=heads, n_kv_heads=heads // group, n_embd=heads * d
        ),
        seed,
    ),
    layers=st.integers(1, 2),
    heads=st.sampled_from([2, 4]),
    group=st.sampled_from([1, 2]),  # 1: MHA; 2: GQA (MQA when heads == 2)
    d=st.sampled_from([4, 8]),
    seed=st.integers(0, 2**16),
)


def model_for(cfg_seed) -> GPT:
    cfg, seed = cfg_seed
    torch.manual_seed(seed)
    return GPT(cfg).eval()


def random_prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


# --- BatchKVCache and the model's per-row path ---------------------------------------------


@pytest.mark.slow
@given(configs, st.lists(st.integers(1, 12), min_size=1, max_size=5), st.integers(1, 3))
def test_rows_of_different_lengths_give_each_sequence_its_own_logits(cfg_seed, lengths, chunk):
    """Every row, fed ``chunk`` tokens per step at its own positions, gets the logits of its
    sequence run alone from position 0 (float tolerance)."""
    model = model_for(cfg_seed)
    seqs = random_prompts([n + 3 * chunk for n in lengths], seed=len(lengths))
    cache = BatchKVCache.for_model(model, max_batch=len(lengths), max_len=max(lengths) + 3 * chunk)
    with torch.no_grad():
        # prefill each prompt alone, straight into its slot
        for n, s in zip(lengths, seqs, strict=True):
            slot = cache.slot(cache.rows)
            model(torch.tensor([s[:n]]), slot)
            cache.add(slot.length)
        steps = []
        for k in range(3):
            idx = torch.tensor(
                [s[n + k * chunk : n + (k + 1) * chunk] for n, s in zip(lengths, seqs, strict=True)]
            )
            steps.append(ForwardDecoder(model).prefill(idx, cache, None))  # (rows, chunk, vocab)
        for row, (n, s) in enumerate(zip(lengths, seqs, strict=True)):
            full = model(torch.tensor([s]))[0, n:]  # (3 * chunk, vocab)
            batched = torch.cat([st_[row] for st_ in steps])
            torch.testing.assert_close(batched, full, atol=1e-5, rtol=1e-4)
    assert cache.lengths[: cache.rows] == [n + 3 * chunk for n in lengths]


@pytest.mark.slow
@given(configs, st.lists(st.integers(1, 12), min_size=1, max_size=5), st.integers(1, 10))
def test_batched_greedy_equals_each_alone(cfg_seed, lengths, n_new):
    model = model_for(cfg_seed)
    prompts = random_prompts(lengths, seed=sum(lengths))
    batched = generate_batch(model, prompts, n_new, eos_id=None)
    for p, g in zip(prompts, batched, strict=True):
        alone = generate(model, p, n_new, eos_id=None)
        assert len(g.tokens) == n_new and g.stats.forward_calls == n_new
        assert_same_greedy(model, p, alone.tokens, g.tokens)


def test_batched_greedy_equals_alone_with_per_prompt_lengths_and_eos(tiny_model):
    prompts = random_prompts([3, 11, 1, 7], seed=3)
    counts = [5, 12, 2, 9]
    free = [
        generate(tiny_model, p, n, eos_id=None).tokens for p, n in zip(prompts, counts, strict=True)
    ]
    eos = free[1][4]  # a token the second request produces: it must stop there, like generate does
    batched = generate_batch(tiny_model, prompts, counts, eos_id=eos)
    for p, n, g in zip(prompts, counts, batched, strict=True):
        alone = generate(tiny_model, p, n, eos_id=eos)
        assert g.tokens == alone.tokens and g.text == alone.text
        assert g.stats.stop_reason == alone.stats.stop_reason
    assert batched[1].stats.stop_reason == "eos" and len(batched[1].tokens) <= 4


def test_batched_sampling_equals_alone_with_the_same_seeds(tiny_model):
    prompts = random_prompts([2, 9, 5], seed=1)
    params = SamplingParams(temperature=0.9, top_k=40)
    seeds = [11, 22, 33]
    batched = generate_batch(tiny_model, prompts, 12, sampling=params, seeds=seeds, eos_id=None)
    for p, s, g in zip(prompts, seeds, batched, strict=True):
        alone = generate(
            tiny_model,
            p,
            12,
            sampling=params,
            generator=torch.Generator().manual_seed(s),
            eos_id=None,
        )
        assert g.tokens == alone.tokens
    assert batched[0].tokens != batched[1].tokens  # really sampled, per request


def test_batch_cache_slots_stay_packed():
    c = BatchKVCache(n_layer=2, max_batch=3, n_kv_heads=1, max_len=8, head_dim=2)
    for i, n in enumerate([2, 5, 3]):
        view = c.slot(c.rows)
        assert view.length == 0 and view.batch_size == 1
        for buf in view.k + view.v:
            buf[:, :, :n] = float(i + 1)  # writes through the view land in slot i
        c.add(n)
    assert c.rows == 3 and c.lengths == [2, 5, 3]
    with raises(BadValue, 'cache'):
        c.add(1)
    assert c.remove(0) == 2  # the last row moves into the freed slot
    assert c.rows == 2 and c.lengths[:2] == [3, 5]
    assert torch.all(c.k[1][0, :, :3] == 3.0) and torch.all(c.v[0][1, :, :5] == 2.0)
    assert c.remove(1) is None and c.rows == 1  # removing the last row moves nothing
    with raises(BadValue, 'i'):
        c.remove(1)
    positions, mask = c.begin(2)
    assert positions.tolist() == [[3, 4]]
    assert mask.shape == (1, 1, 2, 5) and mask[0, 0].tolist() == [[True] * 4 + [False], [True] * 5]


def test_batch_cache_errors(tiny_model):
    c = BatchKVCache.for_model(tiny_model, max_batch=2, max_len=6)
    with raises(BadValue, 'cache'):
        tiny_model(torch.tensor([[1]]), c)  # forward alone cannot place rows of different lengths
    with raises(BadValue, 'cache'):
        ForwardDecoder(tiny_model).step(torch.tensor([1]), c, None)
    c.add(5)
    with raises(ContextFull, 'cache'):
        ForwardDecoder(tiny_model).prefill(torch.tensor([[1, 2]]), c, None)
    with raises(ContextFull, 'max_len'):
        BatchKVCache.for_model(tiny_model, max_batch=2, max_len=65)
    with raises(BadValue, 'max_batch'):
        BatchKVCache(1, 0, 1, 4, 2)
    with raises(BadValue, 'v'):
        KVCache.from_buffers([torch.zeros(1, 1, 4, 2)], [torch.zeros(1, 1, 3, 2)])


# --- the scheduler -------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["static", "continuous"])
def test_serve_outputs_and_schedule(tiny_model, policy):
    requests = [
        Request(p, n)
        for p, n in zip(random_prompts([4, 9, 2, 6, 3, 5, 1]), [3, 20, 2, 1, 8, 15, 6], strict=True)
    ]
    report = serve(tiny_model, requests, max_batch=3, policy=policy, eos_id=None)
    steps_needed = [r.max_new_tokens - 1 for r in requests]
    assert [r.finish_step for r in report.results] == simulate(steps_needed, 3, policy)
    assert report.decode_steps == max(simulate(steps_needed, 3, policy))
    assert sum(report.step_rows) == sum(steps_needed)  # every decode step gives each row one token
    assert max(report.step_rows) <= 3
    assert report.tokens == sum(r.max_new_tokens for r in requests)
    for req, res in zip(requests, report.results, strict=True):
        alone = generate(tiny_model, req.prompt, req.max_new_tokens, eos_id=None)
        assert_same_greedy(tiny_model, list(req.prompt), alone.tokens, res.tokens)
        assert len(res.token_times) == req.max_new_tokens and res.token_times == sorted(
            res.token_times
        )
        assert res.admitted <= res.ttft <= res.latency <= report.total_time
    if policy == "static":  # a new batch starts only when every request admitted before it is done
        for r in report.results:
            earlier = [e for e in report.results if e.admitted_step < r.admitted_step]
            assert all(
                e.finish_step <= r.admitted_step and e.latency <= r.admitted for e in earlier
            )
        # r0-r2, then r3 (prefill only) + r4-r6
        assert len({r.admitted_step for r in report.results}) == 2


def test_continuous_batching_keeps_the_batch_full_and_needs_fewer_steps(tiny_model):
    requests = mixed_workload(n_requests=8, short=3, long=24, long_every=4)
    reports = compare_policies(tiny_model, requests, max_batch=4)
    static, cont = reports["static"][0], reports["continuous"][0]
    assert cont.decode_steps < static.decode_steps
    assert cont.mean_rows > static.mean_rows
    assert [r.tokens for r in cont.results] == [r.tokens for r in static.results]
    # while a request still waits in the queue, every continuous step runs a full batch
    last_admission = max(r.admitted_step for r in cont.results)
    assert last_admission > 0 and all(n == 4 for n in cont.step_rows[:last_admission])
    assert any(n < 4 for n in static.step_rows[: max(r.admitted_step for r in static.results)])


@given(st.lists(st.integers(0, 9), max_size=12), st.integers(1, 4))
def test_simulate_static_closed_form_and_continuous_never_later(needs, max_batch):
    static = simulate(needs, max_batch, "static")
    cont = simulate(needs, max_batch, "continuous")
    assert all(c <= s for c, s in zip(cont, static, strict=True))
    # Static, closed form: requests that take a slot form batches of max_batch, in order; a full
    # batch runs until its longest request is done before anyone else is admitted.
    offset, batch = 0, []
    for i, n in enumerate(needs):
        if len(batch) == max_batch:
            offset += max(needs[j] for j in batch)
            batch = []
        if n > 0:
            batch.append(i)
        assert static[i] == offset + n
    # continuous: no faster than the work spread over all slots, or the longest
    if needs and any(needs):
        assert max(cont) >= max(max(needs), math.ceil(sum(needs) / max_batch))
    if max_batch == 1:
        assert cont == static  # one slot: nothing to refill early


def test_simulate_by_hand():
    # two slots; lengths 1, 10, 10: static waits for the long one before admitting the third
    assert simulate([1, 10, 10], 2, "static") == [1, 10, 20]
    assert simulate([1, 10, 10], 2, "continuous") == [1, 10, 11]
    # a prefill-only request never takes the slot
    assert simulate([0, 2], 1, "continuous") == [0, 2]
    with raises(BadValue, 'policy'):
        simulate([1], 1, "dynamic")
    with raises(BadValue, 'steps_needed'):
        simulate([1, -1], 1)


def test_serve_rejects_bad_input(tiny_model):
    with raises(BadValue, 'requests'):
        serve(tiny_model, [])
    with raises(BadType, 'requests'):
        serve(tiny_model, [("hi", 3)])
    with raises(BadValue, 'requests'):
        serve(tiny_model, [Request("hi", 0)])
    with raises(ContextFull, 'requests'):
        serve(tiny_model, [Request("x" * 60, 10)])
    with raises(BadValue, 'max_batch'):
        serve(tiny_model, [Request("hi", 2)], max_batch=0)
    with raises(BadValue, 'policy'):
        serve(tiny_model, [Request("hi", 2)], policy="fifo")
    with raises(BadValue, 'max_new_tokens'):
        generate_batch(tiny_model, ["a", "b"], [2])


# --- prefix cache ----------------------------------------------------------------------------


@given(configs, st.integers(1, 30), st.integers(0, 8), st.integers(1, 8))
def test_prefix_cache_gives_the_same_output_and_prefills_only_the_rest(
    cfg_seed, prefix_len, suffix_len, n_new
):
    model = model_for(cfg_seed)
    prefix, suffix = random_prompts([prefix_len, suffix_len], seed=prefix_len)
    prompt = prefix + suffix
    pc = PrefixCache(model, prefix)
    plain = generate(model, prompt, n_new, eos_id=None)
    reused = generate(model, prompt, n_new, eos_id=None, cache=pc.cache_for(prompt, n_new))
    assert_same_greedy(model, prompt, plain.tokens, reused.tokens)
    n = min(prefix_len, len(prompt) - 1)
    assert pc.reusable(prompt) == n
    # the prefill fed only the positions after the reused prefix (at least the last prompt token)
    assert reused.stats.positions_processed == plain.stats.positions_processed - n
    with torch.no_grad():  # and the first token's logits are those of the full prompt
        c = pc.cache_for(prompt, 1)
        first = model(torch.tensor([prompt[n:]]), c)[0, -1]
        torch.testing.assert_close(
            first, model(torch.tensor([prompt]))[0, -1], atol=1e-5, rtol=1e-4
        )


def test_reusable_length_rules():
    assert reusable_length([1, 2, 3], [1, 2, 3, 4, 5]) == 3
    assert reusable_length([1, 2, 3], [1, 2, 3]) == 2  # the last prompt token must still be fed
    assert reusable_length([1, 2, 3], [1, 2]) == 1
    assert reusable_length([1, 2, 3], [1, 9, 3, 4]) == 1  # only the shared start counts
    assert reusable_length([1, 2, 3], [7, 8]) == 0
    with raises(BadValue, 'prompt'):
        reusable_length([1], [])


def test_prefix_cache_in_serve_and_shape_errors(tiny_model):
    prefix = random_prompts([30])[0]
    requests = [
        Request(prefix + s, n)
        for s, n in zip(random_prompts([3, 6, 1], seed=5), [6, 3, 9], strict=True)
    ]
    pc = PrefixCache(tiny_model, prefix)
    with_prefix = serve(tiny_model, requests, max_batch=2, prefix=pc, eos_id=None)
    without = serve(tiny_model, requests, max_batch=2, eos_id=None)
    assert [r.reused for r in with_prefix.results] == [30, 30, 30]
    assert [r.reused for r in without.results] == [0, 0, 0]
    for a, b in zip(without.results, with_prefix.results, strict=True):
        assert_same_greedy(tiny_model, a.prompt, a.tokens, b.tokens)
    other = GPT(GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=32))
    with raises(BadValue, 'cache'):
        pc.copy_into(KVCache.for_model(other, max_len=40), prefix + [1])
    with raises(ContextFull, 'prefix'):
        PrefixCache(tiny_model, list(range(65)))


# --- streaming and the cache= argument of generate ---------------------------------------


def test_stream_events_carry_each_tokens_latency(tiny_model):
    events = list(stream(tiny_model, "héllo wörld", 25, eos_id=None))
    stats = events[0].stats
    token_events = [e for e in events if e.token >= 0]
    assert token_events[0].latency == stats.prefill_time > 0
    assert [e.latency for e in token_events[1:]] == stats.decode_times
    assert math.isclose(sum(e.latency for e in events), stats.total_time)
    s = StreamSummary.from_stats(stats)
    assert s.tokens == 25 and s.ttft == stats.prefill_time


def test_generate_continues_a_conversation_through_its_cache(tiny_model):
    """Turn 1, then a long inserted block (a tool result), then turn 2: reusing the cache gives
    what a fresh run over the whole text gives, and prefills only the inserted tokens."""
    prompt, inserted = random_prompts([5, 20], seed=9)
    cache = KVCache.for_model(tiny_model, max_len=50)
    first = generate(tiny_model, prompt, 8, eos_id=None, cache=cache)
    assert cache.length == len(prompt) + 8 - 1  # the last new token is not fed yet
    context = prompt + first.tokens + inserted
    second = generate(tiny_model, context, 10, eos_id=None, cache=cache)
    fresh = generate(tiny_model, context, 10, eos_id=None)
    assert_same_greedy(tiny_model, context, fresh.tokens, second.tokens)
    # last turn-1 token + inserted, then 9 steps
    assert second.stats.positions_processed == len(inserted) + 1 + 9
    with raises(BadValue, 'use_cache'):
        generate(tiny_model, prompt, 3, use_cache=False, cache=cache)
    with raises(ContextFull, 'cache'):
        generate(tiny_model, prompt, 8, cache=KVCache.for_model(tiny_model, max_len=6))
    with raises(BadValue, 'cache'):
        generate(tiny_model, prompt, 3, cache=KVCache.for_model(tiny_model, batch_size=2))


# --- figures -----------------------------------------------------------------------------------


def test_latency_budget_and_its_inverse():
    assert latency_budget(0.5, 0.02, 1) == 0.5
    assert latency_budget(0.5, 0.02, 801) == pytest.approx(16.5)
    for n in (1, 2, 10, 800):
        assert tokens_within(latency_budget(0.3, 0.01, n), 0.3, 0.01) == n
    assert tokens_within(0.1, 0.3, 0.01) == 0
    with raises(BadValue, 'n_tokens'):
        latency_budget(0.1, 0.1, 0)


def test_decode_throughput_rows(tiny_model):
    rows = decode_throughput(tiny_model, [1, 4], context=8, steps=3, repeats=1)
    assert [r["batch"] for r in rows] == [1, 4]
    assert all(r["step_s"] > 0 for r in rows)
    with raises(ContextFull, 'context'):
        decode_throughput(tiny_model, [1], context=60, steps=10)


def test_decode_step_runs_can_be_called_again_and_again(tiny_model):
    """Each call starts from the same state (rows back at ``context``), so a timing claim can
    re-time it: the cache holds exactly ``context + steps`` positions, and a call that did not reset
    would overflow it."""
    runs = decode_step_runs(tiny_model, [1, 3], context=8, steps=3)
    for _ in range(4):
        runs[1](), runs[3]()
    with raises(BadValue, 'batch_sizes'):
        decode_step_runs(tiny_model, [0])


def test_prefix_ttft_reports_both_sides_and_equal_outputs(tiny_model):
    prefix = random_prompts([40])[0]
    res = prefix_ttft(tiny_model, prefix, [[1, 2, 3], [4, 5]], max_new_tokens=4, repeats=2)
    assert res["prefix_tokens"] == 40 and res["suffix_tokens"] == [3, 2]
    assert res["runs"] == 4 and res["identical_outputs"] == 4
    assert res["ttft_plain_s"] > 0 and res["ttft_reused_s"] > 0
    with raises(BadValue, 'suffixes'):
        prefix_ttft(tiny_model, prefix, [])


def test_serving_leaves_the_model_as_it_was(tiny_model):
    """Every inference path restores training mode and gradients, whatever the model was in."""
    tiny_model.train()
    serve(tiny_model, [Request("ab", 3), Request("xyz", 2)], max_batch=2, eos_id=None)
    generate_batch(tiny_model, ["ab"], 2)
    PrefixCache(tiny_model, "abc")
    decode_throughput(tiny_model, [1, 2], context=4, steps=2, repeats=1)
    assert tiny_model.training and torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


def test_serve_takes_an_admission_policy_of_ones_own_and_checks_its_answers(tiny_model):
    """policy= a function (chapter 08's learner passes theirs): the package's two as functions give
    the named schedules; another policy runs too, with every request served its own tokens; bad
    answers are refused."""
    from ar_lab.engine.scheduling import continuous_admit, static_admit
    from ar_lab.perf.serving_measure import compare_policies

    requests = [
        Request(p, n)
        for p, n in zip(random_prompts([4, 9, 2, 6, 3]), [3, 12, 1, 5, 8], strict=True)
    ]
    needs = [r.max_new_tokens - 1 for r in requests]
    for name, fn in [("static", static_admit), ("continuous", continuous_admit)]:
        report = serve(tiny_model, requests, max_batch=2, policy=fn, eos_id=None)
        assert [r.finish_step for r in report.results] == simulate(
            needs, 2, name
        ) and report.policy == fn.__name__

    def one_at_a_time(waiting, running, max_batch):
        return min(waiting, 1) if running < max_batch else 0

    report = serve(tiny_model, requests, max_batch=2, policy=one_at_a_time, eos_id=None)
    named = serve(tiny_model, requests, max_batch=2, policy="continuous", eos_id=None)
    assert [r.tokens for r in report.results] == [r.tokens for r in named.results]
    runs = compare_policies(
        tiny_model, requests, 2, policies={"mine": one_at_a_time, "static": "static"}
    )
    assert list(runs) == ["mine", "static"] and runs["mine"][0].policy == "one_at_a_time"
    for bad, _why in [
        (lambda w, r, b: w + 1, "an int from 0 to"),
        (lambda w, r, b: 0, "wait forever"),
        (lambda w, r, b: 1.0, "an int from 0 to"),
        (lambda w, r, b: -1, "an int from 0 to"),
    ]:
        with raises(BadValue, 'policy'):
            serve(tiny_model, requests, max_batch=2, policy=bad, eos_id=None)
    for bad in ("dynamic", 3):
        with raises(BadValue, 'policy'):
            serve(tiny_model, requests, max_batch=2, policy=bad, eos_id=None)


# --- the server's step: serve(..., step=...) -------------------------------------------------


def _a_step(mask=None, *, retire=True, record_all=True, drop_one=False):
    """A server step written against ServerState only, as chapter 08's learner writes it (with a
    slip switched on)."""
    from ar_lab.model.cache import row_mask

    def step(server):
        if server.waiting:
            goal = len(server.rows) + server.policy(
                len(server.waiting), len(server.rows), server.max_batch
            )
            if drop_one:
                server.waiting.popleft()  # taken from the queue, never prefilled
            while server.waiting and len(server.rows) < goal and server.has_room():
                server.prefill(server.waiting.popleft())
        if server.rows:
            tokens = server.pick(server.decode((mask or row_mask)(server.lengths, 1)))
            done = [
                i
                for i, t in enumerate(tokens[: len(tokens) if record_all else -1])
                if server.record(i, t)
            ]
            if retire:
                server.retire(done)

    return step


def _observed(report):
    return (
        [(r.tokens, r.finish_step, r.admitted_step, r.stop_reason) for r in report.results],
        report.step_rows,
        report.kv_reserved,
        report.kv_used,
    )


@pytest.mark.parametrize(
    "options",
    [
        {"policy": "static"},
        {"policy": "continuous"},
        {"kv": "paged", "block_size": 4, "num_blocks": 9},
        {"sampling": SamplingParams(temperature=0.9, top_k=30, repetition_penalty=1.2)},
    ],
    ids=["static", "continuous", "paged-tight", "sampled"],
)
def test_the_package_step_keeps_serves_schedule_and_a_step_of_ones_own_gives_the_same(
    tiny_model, options
):
    """serve's own step (serve_step, the default) keeps serve's schedule (simulate's finish steps,
    generate's tokens per request, a request its prefill finishes taking no row); a step written
    against ServerState gives the same tokens, steps, rows and KV accounting, on contiguous slots, a
    tight paged pool and sampled tokens."""
    from ar_lab.engine.serving import serve_step

    lengths, counts = [4, 9, 2, 6, 3, 5, 1], [3, 12, 2, 1, 8, 6, 5]
    requests = [
        Request(p, n, seed=i)
        for i, (p, n) in enumerate(zip(random_prompts(lengths), counts, strict=True))
    ]
    ours = serve(tiny_model, requests, max_batch=3, eos_id=None, **options)
    for step in (serve_step, _a_step()):
        assert _observed(
            serve(tiny_model, requests, max_batch=3, eos_id=None, step=step, **options)
        ) == _observed(ours)
    if "sampling" in options:
        return
    needs = [n - 1 for n in counts]
    if "kv" not in options:  # the pool holds fewer rows than 3 at times: a request waits for room
        assert [r.finish_step for r in ours.results] == simulate(needs, 3, options["policy"])
    else:
        assert any(n < 3 for n in ours.step_rows[: max(r.admitted_step for r in ours.results)])
    for req, res in zip(requests, ours.results, strict=True):
        assert_same_greedy(
            tiny_model,
            list(req.prompt),
            generate(tiny_model, req.prompt, req.max_new_tokens, eos_id=None).tokens,
            res.tokens,
        )


def test_the_steps_mask_is_the_one_the_decode_step_attends_through(tiny_model):
    """ServerState.decode uses the mask it is given: a mask that lets each row attend to the padding
    (every row masked as the longest) changes some request's tokens."""
    requests = [Request(p, 12) for p in random_prompts([2, 11, 5])]
    right = serve(tiny_model, requests, max_batch=3, eos_id=None, step=_a_step())

    def longest(lengths, T):
        return torch.ones(len(lengths), 1, T, max(lengths) + T, dtype=torch.bool)

    wrong = serve(tiny_model, requests, max_batch=3, eos_id=None, step=_a_step(longest))
    assert [r.tokens for r in wrong.results] != [r.tokens for r in right.results]


def test_a_step_that_breaks_the_loop_or_a_helper_given_bad_input_fails_with_a_typed_error(
    tiny_model,
):
    from ar_lab.engine.serving import StepError

    requests = [Request(p, n) for p, n in zip(random_prompts([3, 5, 2]), [4, 2, 3], strict=True)]

    def run(step, **kw):
        return serve(tiny_model, requests, max_batch=2, eos_id=None, step=step, **kw)

    for bad in ("serve_step", 3):
        with raises(BadType, 'step'):
            run(bad)
    with raises(StepError, 'step'):
        run(_a_step(retire=False))
    with raises(StepError, 'step'):
        run(_a_step(record_all=False))
    with raises(StepError, 'step'):
        run(lambda server: None)
    with raises(StepError, 'step'):
        run(_a_step(drop_one=True))

    def calls(action):
        def step(server):
            if server.waiting:
                server.prefill(server.waiting.popleft())
            action(server)
        return step

    cases = [
        # not bool
        (lambda s: s.decode(torch.ones(len(s.rows), 1, 1, max(s.lengths) + 1)), BadType, "mask"),
        (lambda s: s.decode([[True]]), BadType, "mask"),  # not a tensor
        # wrong shape
        (lambda s: s.decode(torch.ones(len(s.rows), 1, 1, 2, dtype=torch.bool)), BadValue, "mask"),
        (lambda s: s.record(0, 5), BadValue, "i"),  # not a row waiting for its token
        (lambda s: s.retire([0]), BadValue, "done"),  # row 0's request is not finished
        (lambda s: s.retire([5]), BadValue, "done"),  # not a row in use
        (lambda s: s.retire("0"), BadType, "done"),  # not a list of row indices
        (lambda s: s.prefill(0), BadValue, "j"),  # already admitted
        (lambda s: s.prefill("1"), BadType, "j"),  # not an int
        (lambda s: s.pick(torch.zeros(7, 3)), BadValue, "logits"),  # not the decode step's shape
    ]
    for action, kind, arg in cases:
        with raises(kind, arg):
            run(calls(action))

    def overfill(server):
        while server.waiting:
            server.prefill(server.waiting.popleft())

    with raises(BadValue, 'server'):
        run(overfill)
    with raises(BadValue, 'server'):
        run(overfill, kv="paged", block_size=2, num_blocks=4)
