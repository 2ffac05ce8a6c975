"""Samplers (logits -> token): exact semantics, pinned.

Property tests (hypothesis) check the invariants on random logits. Beam search is
tested in test_beam.py; batched sampling and the explorer's view in test_generate.py.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ar_lab.base.errors import BadType, BadValue
from ar_lab.engine.generate import generate, sample_batch
from ar_lab.engine.sampling import (
    GREEDY,
    GREEDY_EPS,
    SamplingParams,
    apply_repetition_penalty,
    entropy_bits,
    filter_min_p,
    filter_top_k,
    filter_top_p,
    probabilities,
    processed_logits,
    repeated_ngram_fraction,
    sample,
)
from tests.raising import raises

NEG_INF = float("-inf")

# --- strategies ------------------------------------------------------------------------


@st.composite
def logit_vectors(draw, min_size=2, max_size=40, allow_neg_inf=True, scale=(1.0, 30.0)):
    """Random float32 logits, some -inf (never all), with a random spread."""
    n = draw(st.integers(min_size, max_size))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * draw(st.floats(*scale))
    if allow_neg_inf and draw(st.booleans()):
        mask = torch.rand(n, generator=g) < draw(st.floats(0.0, 0.9))
        mask[int(x.argmax())] = False  # keep at least one finite logit
        x = x.masked_fill(mask, NEG_INF)
    return x


sampling_params = st.builds(
    SamplingParams,
    temperature=st.one_of(st.just(0.0), st.floats(1e-3, 5.0)),
    top_k=st.one_of(st.none(), st.integers(1, 60)),
    top_p=st.floats(0.01, 1.0),
    min_p=st.floats(0.0, 1.0),
    repetition_penalty=st.floats(0.5, 3.0),
)


# --- parameters ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"temperature": "1"},
        {"top_k": 0},
        {"top_k": -3},
        {"top_k": 2.5},
        {"top_k": True},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_p": float("nan")},
        {"min_p": -0.1},
        {"min_p": 1.01},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": -1.0},
        {"repetition_penalty": float("inf")},
    ],
)
def test_invalid_parameters_raise_clear_errors(kwargs):
    (arg,) = kwargs  # the error names the one parameter given
    with raises(BadValue, arg):
        SamplingParams(**kwargs)


def test_parameters_accept_numpy_numbers_and_store_python_ones():
    np = pytest.importorskip("numpy")
    p = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), top_p=np.float64(0.9))
    assert type(p.temperature) is float and type(p.top_k) is int and p.top_k == 3
    assert SamplingParams(temperature=0.7, top_p=0.9).label == "T=0.7, top-p 0.9"
    assert GREEDY.label == "greedy" and GREEDY.greedy


def test_filters_validate_their_arguments_too():
    x = torch.zeros(5)
    with raises(BadValue, 'k'):
        filter_top_k(x, 0)
    with raises(BadValue, 'p'):
        filter_top_p(x, 0.0)
    with raises(BadValue, 'min_p'):
        filter_min_p(x, 2.0)


@pytest.mark.parametrize(
    "logits, kind",
    [
        (torch.tensor([0.0, float("nan"), 1.0]), BadValue),  # NaN
        (torch.tensor([0.0, float("inf"), 1.0]), BadValue),  # +inf
        (torch.full((4,), NEG_INF), BadValue),  # every logit is -inf
        # every logit of one row is -inf
        (torch.tensor([[0.0, 1.0], [NEG_INF, NEG_INF]]), BadValue),
        (torch.zeros(2, 3, 4), BadValue),  # not (vocab,) or (batch, vocab)
        (torch.tensor([1, 2, 3]), BadType),  # not floating-point
    ],
)
def test_bad_logits_raise_clear_errors(logits, kind):
    for params in (SamplingParams(), GREEDY):
        with raises(kind, "logits"):
            sample(logits, params)
    with raises(kind, "logits"):
        probabilities(logits)


# --- the distribution --------------------------------------------------------------


@given(logit_vectors(), sampling_params, st.lists(st.integers(0, 1), max_size=3))
def test_probabilities_are_float32_finite_and_sum_to_one(x, params, history):
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        p = probabilities(x.to(dtype), params, history)
        assert p.dtype == torch.float32
        assert torch.isfinite(p).all() and (p >= 0).all()
        assert p.sum().item() == pytest.approx(1.0, abs=1e-5)
        assert (p[torch.isneginf(x)] == 0).all()  # a masked token stays impossible


def test_extreme_logits_do_not_overflow():
    x = torch.tensor([3e38, -3e38, 1e38, NEG_INF])
    p = probabilities(x, SamplingParams(temperature=GREEDY_EPS * 1.01))
    assert torch.isfinite(p).all() and p[0] == 1.0
    p = probabilities(
        torch.tensor([-1e30, -1e30 - 1e25, NEG_INF]), SamplingParams(temperature=1e-3)
    )
    assert torch.isfinite(p).all() and p.sum() == pytest.approx(1.0)


@given(logit_vectors(), st.floats(1e-3, 10.0))
def test_temperature_is_softmax_of_logits_over_t(x, t):
    expected = torch.softmax(x.double() / t, dim=-1).float()
    torch.testing.assert_close(
        probabilities(x, SamplingParams(temperature=t)), expected, atol=1e-6, rtol=1e-4
    )


@given(
    logit_vectors(allow_neg_inf=True),
    st.sampled_from([0.0, GREEDY_EPS / 2, 1e-9]),
    st.integers(0, 3),
)
def test_temperature_zero_is_greedy_without_division(x, t, n_rep):
    params = SamplingParams(temperature=t)
    assert params.greedy
    p = probabilities(x, params)
    assert torch.isfinite(p).all() and p.sum() == 1.0 and p.max() == 1.0
    assert int(p.argmax()) == int(x.argmax()) == int(sample(x, params))
    g = torch.Generator().manual_seed(0)
    assert all(int(sample(x, params, g)) == int(x.argmax()) for _ in range(n_rep))  # no randomness


def test_greedy_ties_go_to_the_lowest_token_id():
    x = torch.tensor([1.0, 3.0, 0.0, 3.0])
    assert int(sample(x, GREEDY)) == 1
    assert probabilities(x, GREEDY).tolist() == [0.0, 1.0, 0.0, 0.0]
    assert GREEDY_EPS > 0 and SamplingParams(temperature=GREEDY_EPS).greedy is False


def test_temperature_extremes():
    x = torch.tensor([2.0, 1.0, 0.0, NEG_INF])
    hot = probabilities(x, SamplingParams(temperature=1e4))
    torch.testing.assert_close(hot[:3], torch.full((3,), 1 / 3), atol=1e-3, rtol=0)
    assert hot[3] == 0
    cold = probabilities(x, SamplingParams(temperature=1e-3))
    assert cold[0] == pytest.approx(1.0)


# --- top-k ---------------------------------------------------------------------------


@given(logit_vectors(allow_neg_inf=False), st.integers(1, 50))
def test_top_k_keeps_the_k_largest(x, k):
    kept = filter_top_k(x, k) > NEG_INF
    n = min(k, x.numel())
    assert int(kept.sum()) == n  # random floats: no ties
    assert set(kept.nonzero().flatten().tolist()) == set(x.topk(n).indices.tolist())


def test_top_k_clamps_to_the_vocabulary_and_keeps_ties():
    x = torch.tensor([3.0, 2.0, 2.0, 1.0, 0.0])
    assert torch.equal(filter_top_k(x, 5), x) and torch.equal(filter_top_k(x, 1000), x)
    # tie at the 2nd: both kept
    assert (filter_top_k(x, 2) > NEG_INF).tolist() == [True, True, True, False, False]
    assert (filter_top_k(x, 1) > NEG_INF).tolist() == [True, False, False, False, False]
    p = probabilities(x, SamplingParams(top_k=2))
    torch.testing.assert_close(p[:3], torch.softmax(x[:3], 0))


# --- top-p ---------------------------------------------------------------------------


@given(logit_vectors(), st.floats(0.01, 0.999))
def test_top_p_keeps_the_smallest_set_reaching_p(x, p):
    probs = torch.softmax(x.double(), dim=-1)
    kept = filter_top_p(x, p) > NEG_INF
    m = int(kept.sum())
    assert m >= 1
    ranked = probs.sort(descending=True).values
    # The kept set is the m most likely tokens (no kept token is less likely than a dropped one) ...
    if (~kept).any():
        assert probs[kept].min() >= probs[~kept].max()
    # ... its mass reaches p (the crossing token is in), and it is minimal: m - 1 tokens do not
    # reach p.
    assert probs[kept].sum() >= p - 1e-6 or m == int((probs > 0).sum())
    assert ranked[: m - 1].sum() < p + 1e-6


def test_top_p_includes_the_crossing_token_and_p_one_keeps_all():
    x = torch.tensor([0.5, 0.3, 0.2]).log()
    # 0.5 < 0.6: 0.3 crosses
    assert (filter_top_p(x, 0.6) > NEG_INF).tolist() == [True, True, False]
    assert (filter_top_p(x, 0.4) > NEG_INF).tolist() == [True, False, False]
    assert (filter_top_p(x, 0.85) > NEG_INF).tolist() == [True, True, True]
    tiny = torch.tensor([10.0, -60.0, -80.0])  # probabilities that underflow still survive p = 1
    assert torch.equal(filter_top_p(tiny, 1.0), tiny)
    assert probabilities(tiny, SamplingParams(top_p=1.0))[1] > 0


def test_top_p_exact_boundary_and_ties():
    x = torch.zeros(4)  # four tokens at exactly 0.25
    # 0.25 + 0.25 reaches 0.5
    assert (filter_top_p(x, 0.5) > NEG_INF).tolist() == [True, True, False, False]
    assert (filter_top_p(x, 0.51) > NEG_INF).tolist() == [True, True, True, False]
    # ties: lowest id first
    assert (filter_top_p(x, 1e-9) > NEG_INF).tolist() == [True, False, False, False]


def test_top_p_applies_to_what_top_k_left():
    x = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    # After top-k 2 the renormalised masses are 4/7 and 3/7: top-p 0.5 keeps only the first.
    assert (probabilities(x, SamplingParams(top_k=2, top_p=0.5)) > 0).tolist() == [
        True,
        False,
        False,
        False,
    ]
    assert (probabilities(x, SamplingParams(top_p=0.5)) > 0).tolist() == [True, True, False, False]


# --- min-p ---------------------------------------------------------------------------


@given(logit_vectors(), st.floats(0.0, 1.0), st.floats(0.05, 5.0))
def test_min_p_keeps_tokens_above_a_fraction_of_the_top_after_temperature(x, min_p, t):
    p_t = torch.softmax(x.double() / t, dim=-1)
    kept = processed_logits(x, SamplingParams(temperature=t, min_p=min_p)) > NEG_INF
    ratio = p_t / p_t.max()
    clear = (ratio - min_p).abs() > 1e-4  # leave float32 rounding at the boundary out
    if min_p > 0:
        assert torch.equal(kept[clear], (ratio >= min_p)[clear])
    else:
        assert torch.equal(kept, ~torch.isneginf(x))  # kept even where the probability underflows
    assert kept[int(x.argmax())]


def test_min_p_depends_on_temperature():
    x = torch.tensor([2.0, 0.0])  # p1 / p0 = exp(-2 / T)
    # e^-2 = 0.135
    assert (probabilities(x, SamplingParams(min_p=0.2)) > 0).tolist() == [True, False]
    # e^-1
    assert (probabilities(x, SamplingParams(min_p=0.2, temperature=2.0)) > 0).tolist() == [
        True,
        True,
    ]
    assert (probabilities(x, SamplingParams(min_p=1.0)) > 0).tolist() == [True, False]
    underflow = torch.tensor([0.0, -200.0])  # ratio e^-200 underflows float32, but is above 1e-90
    assert (filter_min_p(underflow, 1e-90) > NEG_INF).tolist() == [True, True]


# --- repetition penalty --------------------------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_once():
    x = torch.tensor([2.0, -2.0, 0.0, 4.0, -1.0])
    out = apply_repetition_penalty(x, [0, 1, 2, 1, 1, 0], 2.0)
    assert out.tolist() == [1.0, -4.0, 0.0, 4.0, -1.0]  # seen 3 times: penalised once
    assert torch.equal(apply_repetition_penalty(x, [0, 1, 2], 2.0), out)
    mask = torch.tensor([True, True, True, False, False])
    assert torch.equal(apply_repetition_penalty(x, mask, 2.0), out)
    # int tensor
    assert torch.equal(apply_repetition_penalty(x, torch.tensor([1, 1, 0, 2]), 2.0), out)
    assert torch.equal(apply_repetition_penalty(x, [0, 1], 1.0), x)
    # < 1 encourages repeats
    assert apply_repetition_penalty(x, [0, 1], 0.5).tolist()[:2] == [4.0, -1.0]
    with raises(BadValue, 'history'):
        apply_repetition_penalty(x, [9], 2.0)


def test_penalty_comes_before_temperature_and_truncation():
    x = torch.tensor([3.0, 2.0, 1.0])
    p = probabilities(
        x, SamplingParams(temperature=0.5, top_k=1, repetition_penalty=3.0), history=[0]
    )
    assert p.tolist() == [0.0, 1.0, 0.0]  # 3 / 3 = 1 < 2: the penalised leader drops out of top-1
    batch = probabilities(
        torch.stack([x, x]),
        SamplingParams(repetition_penalty=3.0),
        history=torch.tensor([[True, False, False], [False, False, False]]),
    )
    torch.testing.assert_close(
        batch[0], probabilities(x, SamplingParams(repetition_penalty=3.0), [0])
    )
    torch.testing.assert_close(batch[1], torch.softmax(x, 0))


def test_the_prompt_counts_for_the_repetition_penalty(tiny_model):
    params = SamplingParams(temperature=0.0, repetition_penalty=4.0)
    prompt = "the the the "
    ids = list(prompt.encode())

    def reference(history_includes_prompt: bool) -> list[int]:
        seq = list(ids)
        out = []
        with torch.inference_mode():
            for _ in range(12):
                logits = tiny_model(torch.tensor([seq]))[0, -1]
                hist = seq if history_includes_prompt else out
                tok = int(sample(logits, params, history=hist))
                seq.append(tok)
                out.append(tok)
        return out

    with_prompt = reference(True)
    assert generate(tiny_model, prompt, 12, sampling=params, eos_id=None).tokens == with_prompt
    assert sample_batch(tiny_model, [prompt], 12, sampling=params, eos_id=None) == [with_prompt]
    assert reference(False) != with_prompt  # it makes a difference here


# --- picking -------------------------------------------------------------------------


def test_sample_draws_from_exactly_probabilities():
    x = torch.tensor([1.0, 0.5, 0.0, -1.0, NEG_INF, 2.0])
    params = SamplingParams(temperature=0.8, top_k=4)
    p = probabilities(x, params)
    n = 40_000
    draws = sample(x.expand(n, -1), params, torch.Generator().manual_seed(1))
    assert draws.shape == (n,)
    freq = torch.bincount(draws, minlength=x.numel()).float() / n
    assert (freq[p == 0] == 0).all()
    torch.testing.assert_close(freq, p, atol=0.01, rtol=0)


def test_seeded_sampling_is_reproducible_and_shapes_follow_the_input():
    x = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.2, top_p=0.95)

    def draws(seed):
        g = torch.Generator().manual_seed(seed)
        return [sample(x, params, g).tolist() for _ in range(20)]

    assert draws(7) == draws(7) and draws(7) != draws(8)
    assert sample(x[0], params).shape == () and sample(x, params).shape == (3,)
    assert sample(x[0], GREEDY).shape == () and sample(x, GREEDY).tolist() == x.argmax(-1).tolist()


@given(st.lists(logit_vectors(min_size=7, max_size=7), min_size=2, max_size=4), sampling_params)
def test_batched_rows_match_single_rows(rows, params):
    x = torch.stack(rows)
    torch.testing.assert_close(
        probabilities(x, params), torch.stack([probabilities(r, params) for r in rows])
    )


@given(logit_vectors(), sampling_params)
def test_processed_logits_and_probabilities_agree(x, params):
    z = processed_logits(x, params)
    p = probabilities(x, params)
    assert torch.equal(p, torch.softmax(z, dim=-1))
    assert (p[z == NEG_INF] == 0).all()
    # the top token always survives
    assert int(x.argmax()) in (z > NEG_INF).nonzero().flatten().tolist()


def test_entropy_bits():
    assert float(entropy_bits(torch.full((8,), 1 / 8))) == pytest.approx(3.0)
    assert float(entropy_bits(torch.tensor([1.0, 0.0, 0.0]))) == 0.0


# --- repetition measure --------------------------------------------------------------


def test_repeated_ngram_fraction():
    assert repeated_ngram_fraction([1, 2, 1, 2, 1, 2], 2) == pytest.approx(3 / 5)
    assert repeated_ngram_fraction([7] * 10, 3) == pytest.approx(7 / 8)
    assert repeated_ngram_fraction(list(range(20)), 1) == 0.0
    assert repeated_ngram_fraction([1, 2], 4) == 0.0
    with raises(BadValue, 'n'):
        repeated_ngram_fraction([1, 2, 3], 0)
