"""Prompt lookup decoding (ar_lab.engine.lookup): the n-gram proposer, and speculative decoding
driven by it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ar_lab.base.errors import BadType, BadValue
from ar_lab.engine.generate import generate
from ar_lab.engine.lookup import PromptLookup, checked_proposal, prompt_lookup
from ar_lab.engine.sampling import SamplingParams
from ar_lab.engine.speculative import speculative_generate
from ar_lab.model.bigram import BigramModel
from ar_lab.model.gpt import GPT, GPTConfig
from tests.raising import raises
from tests.test_speculative import (
    N_SAMPLES,
    N_TOKENS,
    PROMPT,
    TARGET_TABLE,
    chi_square_pvalue,
    exact_joint,
)


def test_the_earliest_match_of_the_longest_ngram_proposes_what_followed_it():
    # earliest of two matches of [1, 2, 3]
    assert prompt_lookup([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [9, 1]
    # [1, 2, 3] never occurred before: [2, 3] did
    assert prompt_lookup([4, 2, 3, 5, 1, 2, 3], 3) == [5, 1, 2]
    # never past the end of the text
    assert prompt_lookup([1, 2, 3, 4, 1, 2, 3], 10) == [4, 1, 2, 3]
    assert (
        prompt_lookup([1, 2, 3], 4) == []
        and prompt_lookup([7], 4) == []
        and prompt_lookup([], 4) == []
    )
    assert prompt_lookup([1, 2, 1, 2], 0) == []
    # only a 1-gram matches
    assert prompt_lookup([5, 6, 1, 2, 5], 2, max_ngram=3, min_ngram=2) == []
    assert PromptLookup(max_ngram=2)([1, 2, 3, 9, 1, 2, 3], 1) == [9]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=30), st.integers(0, 6), st.integers(1, 4))
def test_a_proposal_is_what_followed_an_earlier_occurrence_of_the_texts_end(tokens, k, max_ngram):
    out = prompt_lookup(tokens, k, max_ngram)
    assert len(out) <= k
    matches = [(n, s) for n in range(min(max_ngram, len(tokens) - 1), 0, -1)
               for s in range(len(tokens) - n) if tokens[s : s + n] == tokens[len(tokens) - n :]]
    if not matches or k == 0:
        assert out == []
    else:
        n = matches[0][0]  # the longest n that matches at all, then its earliest start
        s = min(s for m, s in matches if m == n)
        assert out == tokens[s + n : s + n + k]


def _tiny(seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(block_size=128, n_layer=2, n_head=2, n_embd=32)).eval()


@settings(max_examples=15, deadline=None)
@given(
    st.text(alphabet="ab (),:=\n", min_size=1, max_size=24), st.integers(0, 6), st.integers(1, 3)
)
def test_greedy_with_prompt_lookup_is_plain_greedy_token_for_token(prompt, gamma, max_ngram):
    target = _tiny(0)
    want = generate(target, prompt, 30, eos_id=None)
    got = speculative_generate(target, PromptLookup(max_ngram), prompt, 30, gamma, eos_id=None)
    assert got.tokens == want.tokens
    assert got.stats.produced == 30 and got.stats.proposals >= got.stats.acceptances


def test_a_repetitive_text_is_mostly_drafted_by_lookup():
    # A target that repeats a cycle: after one lap the context holds the answer, and lookup finds
    # it.
    table = torch.full((6, 6), 1e-3)
    for i in range(5):
        table[i, i + 1] = 1.0
    table[5, 0] = 1.0
    target = BigramModel(table, smoothing=0.0, block_size=128)
    out = speculative_generate(target, PromptLookup(), [0, 1, 2, 3, 4, 5], 60, gamma=8, eos_id=None)
    assert out.tokens == generate(target, [0, 1, 2, 3, 4, 5], 60, eos_id=None).tokens
    assert out.stats.alpha == 1.0 and out.stats.tokens_per_target_call > 6


@pytest.mark.slow
@pytest.mark.parametrize("gamma", [1, 2])
def test_sampling_with_a_proposer_keeps_exactly_the_target_distribution(gamma):
    """A proposal is a one-hot draft: accept with probability p(x), else draw from p without x.
    Exact."""
    target = BigramModel(TARGET_TABLE, smoothing=0.0, block_size=16)

    def repeat_last(tokens, k):  # a deterministic proposer, right sometimes, wrong often
        return [tokens[-1]] * k

    g, counts, params = torch.Generator().manual_seed(0), {}, SamplingParams()
    for _ in range(N_SAMPLES):
        out = speculative_generate(
            target, repeat_last, PROMPT, N_TOKENS, gamma, sampling=params, generator=g, eos_id=None
        )
        counts[tuple(out.tokens)] = counts.get(tuple(out.tokens), 0) + 1
    assert chi_square_pvalue(counts, exact_joint(target, params), N_SAMPLES) > 1e-3


def test_bad_proposers_and_settings_are_refused_with_the_reason():
    target = _tiny(0)
    for proposer, kind in [
        (lambda tokens, k: [1] * (k + 1), BadValue),  # more tokens than asked for
        (lambda tokens, k: [300], BadValue),  # outside the vocabulary
        (lambda tokens, k: "ab", BadType),  # not a list of token ids
        (lambda tokens, k: [1.0], BadValue),  # a float, not an int
    ]:
        with raises(kind, "draft"):
            speculative_generate(target, proposer, "hello", 5, gamma=2)
    with raises(BadValue, 'min_ngram'):
        PromptLookup(max_ngram=1, min_ngram=2)
    with raises(BadValue, 'max_ngram'):
        PromptLookup(max_ngram=0)
    with raises(BadValue, 'k'):
        prompt_lookup([1, 2], -1)
    assert checked_proposal((3, 4), 2, 257) == [3, 4]


def test_the_benchmark_returns_data_with_identical_tokens_every_way(capsys):
    from ar_lab.bench.lookup import QUOTE, format_lookup_results, lookup_benchmark, lookup_prompts
    from ar_lab.model.tokenizer import decode

    prompts = lookup_prompts(2)
    assert set(prompts) == {"repeats its context", "fresh text"} and all(
        len(v) == 2 for v in prompts.values()
    )
    quoted = decode(prompts["repeats its context"][0])
    head, tail = quoted.split(QUOTE)
    assert head.startswith(tail)  # the quote repeats the passage's start
    torch.manual_seed(0)
    target = GPT(GPTConfig(block_size=512, n_layer=1, n_head=2, n_embd=32)).eval()
    torch.manual_seed(1)
    draft = GPT(GPTConfig(block_size=512, n_layer=1, n_head=1, n_embd=16)).eval()
    res = lookup_benchmark(target, draft, tokens=8, prompts=1, lookahead=4, repeats=1)
    assert capsys.readouterr().out == ""
    assert res["identical_tokens"] is True and set(res["kinds"]) == set(prompts)
    for k in res["kinds"].values():
        assert 0 <= k["alpha"] <= 1 and k["tokens_per_target_call"] >= 1
        assert {
            "plain",
            "lookup",
            "draft model",
            "transformers plain",
            "transformers lookup",
        } == set(k["ms_per_token"])
        assert k["ar_lab_vs_transformers_lookup"] > 0
    assert "ar_lab / transformers" in format_lookup_results(res)
    with raises(BadValue, 'lookahead'):
        lookup_benchmark(target, draft, lookahead=0)
