"""The decode loop (token_steps, stream, generate), batched sampling and the explorer's view."""

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ar_lab
import ar_lab.engine.prompts
from ar_lab.base.errors import BadType, BadValue, ContextFull
from ar_lab.course.views.sampler_view import sampler_view
from ar_lab.engine.generate import generate, sample_batch, stream, token_steps
from ar_lab.engine.sampling import GREEDY, SamplingParams, probabilities
from ar_lab.model.cache import KVCache, common_prefix_length
from ar_lab.model.gpt import GPT, GPTConfig
from ar_lab.model.tokenizer import EOS_ID, encode
from tests.conftest import ScriptedModel
from tests.raising import raises


@pytest.mark.slow
def test_headline_count_500500_vs_1000():
    """1,000 tokens from a 1-token prompt: 500,500 positions uncached, 1,000 cached."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=1024, n_layer=1, n_head=1, n_embd=8)).eval()
    uncached = generate(model, [0], 1000, use_cache=False, eos_id=None)
    cached = generate(model, [0], 1000, use_cache=True, eos_id=None)
    assert uncached.stats.positions_processed == 500_500
    assert cached.stats.positions_processed == 1_000
    assert uncached.stats.forward_calls == cached.stats.forward_calls == 1000
    assert uncached.tokens == cached.tokens


@pytest.mark.parametrize("P, N", [(1, 1), (1, 7), (5, 1), (9, 12), (30, 20)])
def test_positions_for_any_prompt_length(tiny_model, P, N):
    prompt = list(range(P))
    un = generate(tiny_model, prompt, N, use_cache=False, eos_id=None).stats
    ca = generate(tiny_model, prompt, N, use_cache=True, eos_id=None).stats
    # uncached: P + (P+1) + ... + (P+N-1); cached: P (prefill) + N - 1 single steps
    assert un.positions_processed == N * P + N * (N - 1) // 2
    assert ca.positions_processed == P + N - 1


def test_stops_at_eos_and_excludes_it():
    prompt = encode("ab")
    model = ScriptedModel(encode("xyz") + [EOS_ID] + encode("never"), len(prompt))
    for use_cache in (True, False):
        g = generate(model, prompt, 20, use_cache=use_cache)
        assert g.text == "xyz" and g.tokens == encode("xyz")
        assert g.stats.stop_reason == "eos" and g.stats.forward_calls == 4


def test_first_token_eos_gives_empty_text_and_real_stats():
    model = ScriptedModel([EOS_ID], 1)
    g = generate(model, "a", 5)
    assert (
        g.text == ""
        and g.tokens == []
        and g.stats.stop_reason == "eos"
        and g.stats.forward_calls == 1
    )


def test_max_new_tokens_cap():
    model = ScriptedModel(encode("abcdefgh"), 1)
    g = generate(model, "a", 3)
    assert g.text == "abc" and g.stats.stop_reason == "max_new_tokens"


def test_stop_strings_cut_the_text_and_are_never_streamed():
    prompt = encode("Q")
    model = ScriptedModel(encode("hello\n\nworld"), len(prompt))
    events = list(stream(model, prompt, 20, stop_strings=["\n\n"]))
    assert "".join(e.text for e in events) == "hello"
    assert events[-1].stats.stop_reason == "stop_string"
    assert generate(model, prompt, 20, stop_strings=["lo\n"]).text == "hel"


def test_streaming_never_splits_a_character():
    text = "né €5 — ok"
    model = ScriptedModel(encode(text), 1)
    pieces = [e.text for e in stream(model, "a", len(encode(text)))]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # the first bytes of multi-byte characters produced no text yet


def test_timings_are_recorded(tiny_model):
    s = generate(tiny_model, "hello", 10, eos_id=None).stats
    assert s.prefill_time > 0 and len(s.decode_times) == 9 and all(t > 0 for t in s.decode_times)
    assert s.total_time == pytest.approx(s.prefill_time + sum(s.decode_times))


def test_seeded_sampling_is_reproducible(tiny_model):
    params = SamplingParams(temperature=1.0)
    a = generate(
        tiny_model,
        "x",
        30,
        sampling=params,
        generator=torch.Generator().manual_seed(3),
        eos_id=None,
    )
    b = generate(
        tiny_model,
        "x",
        30,
        sampling=params,
        generator=torch.Generator().manual_seed(3),
        eos_id=None,
    )
    c = generate(
        tiny_model,
        "x",
        30,
        sampling=params,
        generator=torch.Generator().manual_seed(4),
        eos_id=None,
    )
    assert a.tokens == b.tokens and a.tokens != c.tokens


def test_bad_input_is_rejected_clearly(tiny_model):
    with raises(BadValue, 'prompt'):
        generate(tiny_model, "", 5)
    with raises(ContextFull, 'prompt'):
        generate(tiny_model, "a" * 65, 1)
    with raises(ContextFull, 'max_new_tokens'):
        generate(tiny_model, "a" * 60, 6)
    assert len(generate(tiny_model, "a" * 60, 5, eos_id=None).tokens) == 5
    with raises(BadValue, 'max_new_tokens'):
        generate(tiny_model, "a", 0)
    with raises(BadValue, 'prompt'):
        generate(tiny_model, [1, 999], 3)
    with raises(BadValue, 'stop_strings'):
        generate(tiny_model, "a", 3, stop_strings="\n")
    with raises(BadValue, 'top_p'):
        generate(tiny_model, "a", 3, sampling=SamplingParams(top_p=1.5))


def test_token_steps_restores_training_mode(tiny_model):
    tiny_model.train()
    list(token_steps(tiny_model, "ab", 3))
    assert tiny_model.training


# --- options: keyword-only, checked once, at the call -----------------------------------


def test_options_after_the_budget_are_keyword_only(tiny_model):
    # each fourth argument is valid as its keyword (use_cache=False, sampling=GREEDY, seed=1): the
    # only TypeError these calls can raise is Python's own, for an option passed by position
    for call in (generate, stream, token_steps):
        with pytest.raises(TypeError):
            call(tiny_model, "a", 3, False)
    with pytest.raises(TypeError):
        sample_batch(tiny_model, ["a"], 3, GREEDY)
    with pytest.raises(TypeError):
        sampler_view(tiny_model, "a", GREEDY, 1)


def test_arguments_are_checked_at_the_call_not_at_the_first_token(tiny_model):
    for call in (stream, token_steps):
        with raises(BadValue, 'prompt'):
            call(tiny_model, "", 5)  # no next(): the call itself raises
    with raises(BadValue, 'stop_strings'):
        stream(tiny_model, "a", 3, stop_strings="\n")
    with raises(BadType, 'sampling'):
        generate(tiny_model, "a", 3, sampling=0.5)
    with raises(BadType, 'sampling'):
        sample_batch(tiny_model, ["a"], 3, sampling=0.5)


def test_the_prompt_is_parsed_and_checked_once_per_call(tiny_model, monkeypatch):
    calls = []
    for name in ("prompt_ids", "check_prompt"):
        real = getattr(ar_lab.engine.prompts, name)
        spy = lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a)  # noqa: E731
        monkeypatch.setattr(ar_lab.engine.prompts, name, spy)
    generate(tiny_model, "hello", 4)
    assert calls == ["prompt_ids", "check_prompt"]
    calls.clear()
    list(stream(tiny_model, "hello", 4))
    list(token_steps(tiny_model, "hello", 4))
    assert calls == ["prompt_ids", "check_prompt"] * 2


def test_stop_strings_take_a_list_tuple_or_set_but_not_a_one_shot_iterator():
    model = ScriptedModel(encode("hello\n\nworld"), 1)
    assert generate(model, "Q", 20, stop_strings=("lo\n",)).text == "hel"
    assert generate(model, "Q", 20, stop_strings={"\n\n"}).text == "hello"
    with raises(BadValue, 'stop_strings'):
        generate(model, "Q", 20, stop_strings=(s for s in ["\n\n"]))  # was consumed and ignored
    with raises(BadValue, 'stop_strings'):
        generate(model, "Q", 20, stop_strings=["\n", ""])


# --- a paused generator leaves the notebook as it was -----------------------------------


def test_a_paused_stream_leaves_training_mode_and_gradients_on(tiny_model):
    whole = generate(tiny_model, "ab", 6, eos_id=None).tokens
    tiny_model.train()
    runs = {
        "stream": stream(tiny_model, "ab", 6, eos_id=None),
        "token_steps": token_steps(tiny_model, "ab", 6),
    }
    for name, steps in runs.items():
        first = next(steps)
        assert tiny_model.training, name
        assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled(), name
        tiny_model.zero_grad()
        # a training step during the pause works
        tiny_model(torch.tensor([[1, 2, 3]])).sum().backward()
        assert tiny_model.wte.weight.grad is not None and tiny_model.wte.weight.grad.abs().sum() > 0
        rest = list(steps)
        tokens = (
            [e.token for e in [first, *rest] if e.token >= 0]
            if name == "stream"
            else [first, *rest]
        )
        assert tokens == whole, name  # the pause changed nothing in the generation
        assert tiny_model.training, name


def test_sampler_view_refuses_active_dropout_and_never_switches_the_model():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=32, dropout=0.5)).eval()
    want = sampler_view(model, "hello", SamplingParams(), seed=1, n_samples=2, max_new_tokens=5)
    model.train()
    with raises(BadValue, 'model'):
        sampler_view(model, "hello", SamplingParams(), seed=1, n_samples=2, max_new_tokens=5)
    assert model.training  # refused, not switched
    got = sampler_view(
        model.eval(), "hello", SamplingParams(), seed=1, n_samples=2, max_new_tokens=5
    )
    assert torch.equal(got.before, want.before) and got.continuations == want.continuations


def test_a_stream_paused_while_dropout_is_switched_on_refuses_its_next_step():
    model = GPT(GPTConfig(block_size=64, n_layer=1, n_head=2, n_embd=16, dropout=0.2)).eval()
    steps = token_steps(model, "ab", 5)
    next(steps)
    model.train()  # dropout on during the pause: the next step would be random
    with raises(BadValue, 'model'):
        next(steps)


# --- sampling continuations in a batch -----------------------------------------------


def test_sample_batch_matches_generate_row_by_row(tiny_model):
    prompts = ["abc", "xyz"]
    out = sample_batch(tiny_model, prompts, 8, sampling=GREEDY, eos_id=None)
    assert out == [generate(tiny_model, p, 8, eos_id=None).tokens for p in prompts]
    params = SamplingParams(temperature=1.0, top_k=20)
    options = dict(sampling=params, eos_id=None)
    a = sample_batch(tiny_model, prompts, 8, generator=torch.Generator().manual_seed(0), **options)
    b = sample_batch(
        tiny_model,
        prompts,
        8,
        generator=torch.Generator().manual_seed(0),
        use_cache=False,
        **options,
    )
    assert a == b  # same draws, cached or not
    with raises(BadValue, 'prompts'):
        sample_batch(tiny_model, ["a", "bc"], 3)
    with raises(BadValue, 'prompts'):
        sample_batch(tiny_model, "abc", 3)


def test_sample_batch_stops_each_row_at_eos():
    model = ScriptedModel([ord("h"), ord("i"), 256, ord("x")], prompt_len=2)
    assert sample_batch(model, ["ab", "cd"], 4, sampling=GREEDY) == [[104, 105], [104, 105]]
    assert sample_batch(model, ["ab"], 4, sampling=GREEDY, eos_id=None) == [[104, 105, 256, 120]]


# --- the explorer: pure function, then the widget ------------------------------------


def test_sampler_view_is_a_pure_function_of_its_arguments(tiny_model):
    params = SamplingParams(temperature=1.0, top_k=10)
    a = sampler_view(tiny_model, "hello", params, seed=3, n_samples=3, max_new_tokens=8)
    b = sampler_view(tiny_model, "hello", params, seed=3, n_samples=3, max_new_tokens=8)
    c = sampler_view(tiny_model, "hello", params, seed=4, n_samples=3, max_new_tokens=8)
    assert a.continuations == b.continuations and a.continuations != c.continuations
    assert len(a.continuations) == 3 and torch.equal(a.after, b.after)
    assert a.n_kept == 10 and 0 < a.kept_mass < 1 and a.entropy_after < a.entropy_before
    torch.testing.assert_close(a.after, probabilities(a.before.log(), params), atol=1e-6, rtol=1e-5)
    nucleus = sampler_view(tiny_model, "hello", SamplingParams(top_p=0.5), n_samples=0)
    assert nucleus.kept_mass >= 0.5 - 1e-6 and nucleus.continuations == []
    greedy = sampler_view(tiny_model, "hello", GREEDY, seed=1, n_samples=3, max_new_tokens=6)
    assert (
        greedy.n_kept == 1 and len(set(greedy.continuations)) == 1 and greedy.entropy_after == 0.0
    )
    with raises(BadValue, 'prompt'):
        sampler_view(tiny_model, "", params)


@pytest.mark.slow
def test_sampler_explorer_widget_headless(tiny_model):
    pytest.importorskip("ipywidgets")
    from ar_lab.course.views.widgets import sampler_explorer

    w = sampler_explorer(tiny_model, prompt="hello", n_samples=2, max_new_tokens=5)
    assert w.view.n_kept == tiny_model.config.vocab_size and w.error == ""
    assert w.image.value[:4] == b"\x89PNG" and w.samples.value.count("<pre") == 2
    w.top_k.value = 20
    assert w.view.n_kept == 20 and w.view.params.top_k == 20
    w.top_k.value = 3
    assert w.view.n_kept == 3
    w.top_k.value = 0  # 0 switches top-k off
    w.top_p.value = 0.3
    kept_p = w.view.n_kept
    assert w.view.kept_mass >= 0.3 - 1e-6
    w.temperature.value = 0.3  # colder: the same mass needs fewer tokens
    assert w.view.n_kept < kept_p
    w.min_p.value = 1.0
    assert w.view.n_kept == 1
    before = list(w.view.continuations)
    w.min_p.value, w.top_p.value, w.temperature.value = 0.0, 1.0, 1.5
    w.seed.value = 1
    first = list(w.view.continuations)
    w.seed.value = 2
    w.seed.value = 1
    assert w.view.continuations == first != before
    w.prompt.value = ""
    assert "prompt is empty" in w.error and "prompt is empty" in w.status.value
    assert w.view.prompt == "hello"  # the last good view stays
    w.prompt.value = "abc"
    assert w.error == "" and w.view.prompt == "abc"
    w.temperature.value = 0.0
    assert w.view.n_kept == 1 and "greedy" in w.status.value


# --- reusing a cache: only the positions whose token ids match the prompt --------------------


@pytest.fixture(scope="module")
def course():
    return ar_lab.load_pretrained("course")


def test_a_cache_filled_from_another_prompt_gives_that_prompts_own_tokens(course):
    cache = KVCache.for_model(course, max_len=80)
    generate(course, "import os\n", 12, eos_id=None, cache=cache)  # fills it from prompt A
    for b in ["The with statement", "import sys\n"]:  # nothing, then "import " in common with A
        fresh = generate(course, b, 25, eos_id=None)
        shared = 0 if b[0] == "T" else len("import ")
        reused = generate(course, b, 25, eos_id=None, cache=cache)
        assert reused.tokens == fresh.tokens
        # only the differing part is prefilled
        assert reused.stats.positions_processed == len(b) - shared + 25 - 1
        assert cache.token_ids == encode(b) + reused.tokens[:-1]
        generate(course, "import os\n", 12, eos_id=None, cache=cache)
    streamed = [
        e.token
        for e in stream(course, "The with statement", 25, eos_id=None, cache=cache)
        if e.token >= 0
    ]
    assert streamed == generate(course, "The with statement", 25, eos_id=None).tokens
    assert (
        list(token_steps(course, "import os\n", 12, cache=cache))
        == generate(course, "import os\n", 12).tokens
    )


def test_reuse_for_a_prompt_that_extends_the_cached_text_prefills_only_the_new_part(course):
    cache = KVCache.for_model(course, max_len=120)
    first = generate(course, "The for statement", 20, eos_id=None, cache=cache)
    held = len(encode("The for statement")) + 20 - 1
    assert cache.length == held
    longer = encode("The for statement") + first.tokens + encode("\nThe while statement")
    second = generate(
        course,
        longer,
        30,
        eos_id=None,
        cache=cache,
        sampling=SamplingParams(temperature=0.8, top_k=20),
        generator=torch.Generator().manual_seed(1),
    )
    want = generate(
        course,
        longer,
        30,
        eos_id=None,
        sampling=SamplingParams(temperature=0.8, top_k=20),
        generator=torch.Generator().manual_seed(1),
    )
    assert second.tokens == want.tokens
    assert second.stats.positions_processed == len(longer) - held + 30 - 1


def test_a_cache_holding_positions_of_unknown_tokens_is_refused(course):
    cache = KVCache.for_model(course, max_len=60)
    k = torch.zeros(1, course.config.kv_heads, 5, course.config.head_dim)
    for layer in range(course.config.n_layer):
        cache.update(layer, 0, k, k)  # filled by hand: the cache cannot know which tokens these are
    cache.length = 5
    for call in (generate, stream, token_steps):
        with raises(BadValue, 'cache'):
            # refused at the call, before any token
            call(course, "The for statement", 10, cache=cache)
    cache.truncate(0)  # reuse only its memory
    assert (
        generate(course, "The for", 10, cache=cache).tokens
        == generate(course, "The for", 10).tokens
    )


@functools.cache
def context_model() -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=40, n_layer=2, n_head=2, n_embd=16)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))  # weights whose outputs depend on the context
    return model


@settings(max_examples=25)
@given(
    a=st.lists(st.integers(0, 2), min_size=1, max_size=12),
    b=st.lists(st.integers(0, 2), min_size=1, max_size=12),
    n_a=st.integers(1, 6),
    n_b=st.integers(1, 8),
)
def test_any_reused_cache_gives_the_fresh_tokens(a, b, n_a, n_b):
    """Prompts over a 3-token alphabet share prefixes of every length with the cached text."""
    model = context_model()  # the same weights every example: built once
    cache = KVCache.for_model(model, max_len=40)
    first = generate(model, a, n_a, eos_id=None, cache=cache)
    cached = a + first.tokens[:-1]
    reused = generate(model, b, n_b, eos_id=None, cache=cache)
    assert reused.tokens == generate(model, b, n_b, eos_id=None).tokens
    shared = min(common_prefix_length(cached, b), len(b) - 1)
    assert reused.stats.positions_processed == len(b) - shared + n_b - 1
