"""Inputs that gave silently wrong results are refused (issue 64): a prefix cache used with another
model or after its weights changed, a chi-square test of counts or probabilities that mean nothing,
a memory read too small to tell a cache from memory, a seed no generator takes. Each error names its
argument."""

from __future__ import annotations

import gc
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ar_lab.base.args import SEED_MAX
from ar_lab.base.errors import BadValue
from ar_lab.course.views.speculative_view import PROBS_TOLERANCE, chi_square, speculation_view
from ar_lab.engine.generate import generate
from ar_lab.engine.prefix_cache import PrefixCache, weights_fingerprint
from ar_lab.model.cache import KVCache
from ar_lab.model.gpt import GPT, GPTConfig
from ar_lab.perf import peaks
from tests.raising import raises

CONFIG = GPTConfig(block_size=48, n_layer=2, n_head=2, n_embd=16)
PREFIX, PROMPT = [5, 6, 7, 8, 9], [5, 6, 7, 8, 9, 10, 11]


def model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(CONFIG).eval()


# --- PrefixCache ----------------------------------------------------------------------------------


def test_the_model_that_filled_a_prefix_cache_reuses_it_and_gets_plain_decodings_tokens():
    m = model()
    pc = PrefixCache(m, PREFIX)
    # running the model (its decoders, its lean copies) changes no weight
    generate(m, PROMPT, 4, eos_id=None)
    reused = generate(m, PROMPT, 4, eos_id=None, cache=pc.cache_for(PROMPT, 4, model=m))
    assert reused.tokens == generate(m, PROMPT, 4, eos_id=None).tokens
    assert pc.copy_into(KVCache.for_model(m, max_len=20), PROMPT, model=m) == len(PREFIX)


@pytest.mark.parametrize("other", ["another seed", "a copy", "the same checkpoint loaded again"])
def test_another_model_of_the_same_shape_is_refused(other):
    m = model()
    pc = PrefixCache(m, PREFIX)
    second = {"another seed": lambda: model(1), "a copy": lambda: __import__("copy").deepcopy(m),
              "the same checkpoint loaded again": lambda: _loaded(m)}[other]()
    with raises(BadValue, "model"):
        pc.cache_for(PROMPT, 4, model=second)
    with raises(BadValue, "model"):
        pc.copy_into(KVCache.for_model(second, max_len=20), PROMPT, model=second)


def test_serve_refuses_a_prefix_cache_filled_by_another_model():
    from ar_lab.engine.serving.requests import Request
    from ar_lab.engine.serving.server import serve

    m, other = model(), model(1)
    pc = PrefixCache(m, PREFIX)
    assert serve(m, [Request(PROMPT, 3)], prefix=pc, eos_id=None).results[0].tokens == generate(
        m, PROMPT, 3, eos_id=None).tokens
    with raises(BadValue, "prefix"):
        serve(other, [Request(PROMPT, 3)], prefix=pc)


def _loaded(m: GPT) -> GPT:
    again = model(3)
    again.load_state_dict(m.state_dict())
    return again


def _edit_in_place(m):
    with torch.no_grad():
        m.blocks[0].attn.qkv.weight.add_(0.5)


def _load_other_weights(m):
    m.load_state_dict(model(2).state_dict())


def _train_one_step(m):
    m.train()
    optimizer = torch.optim.SGD(m.parameters(), lr=0.1)
    m(torch.tensor([PROMPT])).sum().backward()
    optimizer.step()
    m.eval()


def _cast(m):
    m.double()


@pytest.mark.parametrize("edit", [_edit_in_place, _load_other_weights, _train_one_step, _cast])
def test_weights_changed_after_filling_make_its_keys_stale_and_refused(edit):
    m = model()
    pc = PrefixCache(m, PREFIX)
    before = weights_fingerprint(m)
    edit(m)
    assert weights_fingerprint(m) != before
    with raises(BadValue, "model"):  # whether or not the caller names the model
        pc.cache_for(PROMPT, 4)
    with raises(BadValue, "model"):
        pc.cache_for(PROMPT, 4, model=m)


def test_a_prefix_cache_whose_model_is_gone_is_refused():
    pc = PrefixCache(model(), PREFIX)
    gc.collect()
    with raises(BadValue, "model"):
        pc.cache_for(PROMPT, 4)


# --- chi_square -----------------------------------------------------------------------------------

distributions = st.lists(st.floats(0.01, 1.0), min_size=2, max_size=8).map(
    lambda w: torch.tensor(w, dtype=torch.float64) / sum(w))


@given(probs=distributions, data=st.data())
def test_chi_square_takes_counts_and_a_distribution(probs, data):
    k = len(probs)
    counts = data.draw(
        st.lists(st.integers(0, 50), min_size=k, max_size=k).filter(lambda c: sum(c) > 0)
    )
    counts = torch.tensor(counts, dtype=torch.float64)
    stat, dof, p = chi_square(counts, probs)
    assert stat >= 0 and dof == k - 1 and 0 <= p <= 1


@given(probs=distributions, data=st.data())
def test_chi_square_refuses_negative_fractional_or_no_counts(probs, data):
    k = len(probs)
    counts = torch.tensor(
        data.draw(st.lists(st.integers(1, 50), min_size=k, max_size=k)), dtype=torch.float64
    )
    i = data.draw(st.integers(0, k - 1))
    negative, fractional = counts.clone(), counts.clone()
    negative[i] = -data.draw(st.integers(1, 50))
    fractional[i] += 0.5
    for bad in (negative, fractional, torch.zeros(k), torch.full((k,), math.nan)):
        with raises(BadValue, "counts"):
            chi_square(bad, probs)


@given(
    probs=distributions,
    scale=st.floats(0.0, 3.0).filter(lambda s: abs(s - 1) > 2 * PROBS_TOLERANCE),
)
def test_chi_square_refuses_probabilities_that_do_not_sum_to_one(probs, scale):
    counts = torch.ones(len(probs))
    with raises(BadValue, "probs"):
        chi_square(counts, probs * scale)
    shifted = probs.clone()
    shifted[0], shifted[1] = -0.1, shifted[1] + shifted[0] + 0.1  # sums to 1, one negative
    with raises(BadValue, "probs"):
        chi_square(counts, shifted)


def test_chi_square_refuses_empty_observations():
    with raises(BadValue, "counts"):
        chi_square(torch.zeros(0), torch.zeros(0))
    with raises(BadValue, "counts"):
        chi_square(torch.zeros(3), torch.tensor([0.2, 0.3, 0.5]))


# --- reads_from_memory ----------------------------------------------------------------------------


@settings(max_examples=30)
@given(nbytes=st.integers(1, peaks.MIN_READ_BYTES - 1))
def test_a_read_too_small_to_tell_a_cache_from_memory_is_refused(nbytes):
    """reads_from_memory(24) reported "from main memory": the call's overhead set both rates."""
    with raises(BadValue, "nbytes"):
        peaks.reads_from_memory(nbytes)


@settings(max_examples=30)
@given(nbytes=st.integers(peaks.MIN_READ_BYTES, 2**32), data=st.data())
def test_a_reference_not_larger_than_twice_the_buffer_is_refused(nbytes, data):
    """A reference the buffer's size reads at the buffer's rate wherever both come from: "from
    memory" always."""
    reference = data.draw(st.integers(1, 2 * nbytes - 1))
    with raises(BadValue, "reference"):
        peaks.reads_from_memory(nbytes, reference=reference)


# --- speculation_view's seed ----------------------------------------------------------------------


@given(
    st.one_of(
        st.integers(max_value=-1),
        st.integers(min_value=SEED_MAX + 1),
        st.booleans(),
        st.floats(),
        st.text(max_size=3),
    )
)
def test_speculation_view_refuses_a_seed_like_every_other_entry_point(seed):
    """Checked before the models are touched (none is given here)."""
    with raises(BadValue, "seed"):
        speculation_view(None, None, "The", seed=seed)
