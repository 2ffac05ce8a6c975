"""Samplers, beam search and the chapter-06 explorer: exact semantics, pinned.

Property tests (hypothesis) check the invariants on random logits; a table model with
known distributions lets beam search be compared with brute-force enumeration.
"""

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ar_lab import generate
from ar_lab.model import GPT, GPTConfig
from ar_lab.sampling import (
    GREEDY,
    GREEDY_EPS,
    SamplingParams,
    apply_repetition_penalty,
    beam_search,
    beam_search_batch,
    entropy_bits,
    filter_min_p,
    filter_top_k,
    filter_top_p,
    length_normalised,
    probabilities,
    processed_logits,
    repeated_ngram_fraction,
    sample,
    sample_batch,
    sampler_view,
)
from tests.conftest import ScriptedModel

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
    "kwargs, match",
    [
        ({"temperature": -0.1}, "temperature must be a finite number >= 0"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_k": 0}, r"top_k must be an int >= 1 or None \(no top-k\), got 0"),
        ({"top_k": -3}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\] \(1 keeps everything\), got 1.5"),
        ({"top_p": float("nan")}, "top_p"),
        ({"min_p": -0.1}, r"min_p must be in \[0, 1\]"),
        ({"min_p": 1.01}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ],
)
def test_invalid_parameters_raise_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_parameters_accept_numpy_numbers_and_store_python_ones():
    np = pytest.importorskip("numpy")
    p = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), top_p=np.float64(0.9))
    assert type(p.temperature) is float and type(p.top_k) is int and p.top_k == 3
    assert SamplingParams(temperature=0.7, top_p=0.9).label == "T=0.7, top-p 0.9"
    assert GREEDY.label == "greedy" and GREEDY.greedy


def test_filters_validate_their_arguments_too():
    x = torch.zeros(5)
    with pytest.raises(ValueError, match="top_k"):
        filter_top_k(x, 0)
    with pytest.raises(ValueError, match="top_p"):
        filter_top_p(x, 0.0)
    with pytest.raises(ValueError, match="min_p"):
        filter_min_p(x, 2.0)


@pytest.mark.parametrize(
    "logits, err, match",
    [
        (torch.tensor([0.0, float("nan"), 1.0]), ValueError, "NaN"),
        (torch.tensor([0.0, float("inf"), 1.0]), ValueError, r"\+inf"),
        (torch.full((4,), NEG_INF), ValueError, "every logit is -inf"),
        (torch.tensor([[0.0, 1.0], [NEG_INF, NEG_INF]]), ValueError, "every logit is -inf"),
        (torch.zeros(2, 3, 4), ValueError, r"shape \(vocab,\) or \(batch, vocab\)"),
        (torch.tensor([1, 2, 3]), TypeError, "floating-point"),
    ],
)
def test_bad_logits_raise_clear_errors(logits, err, match):
    for params in (SamplingParams(), GREEDY):
        with pytest.raises(err, match=match):
            sample(logits, params)
    with pytest.raises(err, match=match):
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
    p = probabilities(torch.tensor([-1e30, -1e30 - 1e25, NEG_INF]), SamplingParams(temperature=1e-3))
    assert torch.isfinite(p).all() and p.sum() == pytest.approx(1.0)


@given(logit_vectors(), st.floats(1e-3, 10.0))
def test_temperature_is_softmax_of_logits_over_t(x, t):
    expected = torch.softmax(x.double() / t, dim=-1).float()
    torch.testing.assert_close(probabilities(x, SamplingParams(temperature=t)), expected, atol=1e-6, rtol=1e-4)


@given(logit_vectors(allow_neg_inf=True), st.sampled_from([0.0, GREEDY_EPS / 2, 1e-9]), st.integers(0, 3))
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
    assert (filter_top_k(x, 2) > NEG_INF).tolist() == [True, True, True, False, False]  # tie at the 2nd: both kept
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
    assert probs[kept].min() >= probs[~kept].max() if (~kept).any() else True
    # ... its mass reaches p (the crossing token is in), and it is minimal: m - 1 tokens do not reach p.
    assert probs[kept].sum() >= p - 1e-6 or m == int((probs > 0).sum())
    assert ranked[: m - 1].sum() < p + 1e-6


def test_top_p_includes_the_crossing_token_and_p_one_keeps_all():
    x = torch.tensor([0.5, 0.3, 0.2]).log()
    assert (filter_top_p(x, 0.6) > NEG_INF).tolist() == [True, True, False]  # 0.5 < 0.6: 0.3 crosses
    assert (filter_top_p(x, 0.4) > NEG_INF).tolist() == [True, False, False]
    assert (filter_top_p(x, 0.85) > NEG_INF).tolist() == [True, True, True]
    tiny = torch.tensor([10.0, -60.0, -80.0])  # probabilities that underflow still survive p = 1
    assert torch.equal(filter_top_p(tiny, 1.0), tiny)
    assert probabilities(tiny, SamplingParams(top_p=1.0))[1] > 0


def test_top_p_exact_boundary_and_ties():
    x = torch.zeros(4)  # four tokens at exactly 0.25
    assert (filter_top_p(x, 0.5) > NEG_INF).tolist() == [True, True, False, False]  # 0.25 + 0.25 reaches 0.5
    assert (filter_top_p(x, 0.51) > NEG_INF).tolist() == [True, True, True, False]
    assert (filter_top_p(x, 1e-9) > NEG_INF).tolist() == [True, False, False, False]  # ties: lowest id first


def test_top_p_applies_to_what_top_k_left():
    x = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    # After top-k 2 the renormalised masses are 4/7 and 3/7: top-p 0.5 keeps only the first.
    assert (probabilities(x, SamplingParams(top_k=2, top_p=0.5)) > 0).tolist() == [True, False, False, False]
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
    assert (probabilities(x, SamplingParams(min_p=0.2)) > 0).tolist() == [True, False]  # e^-2 = 0.135
    assert (probabilities(x, SamplingParams(min_p=0.2, temperature=2.0)) > 0).tolist() == [True, True]  # e^-1
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
    assert torch.equal(apply_repetition_penalty(x, torch.tensor([1, 1, 0, 2]), 2.0), out)  # int tensor
    assert torch.equal(apply_repetition_penalty(x, [0, 1], 1.0), x)
    assert apply_repetition_penalty(x, [0, 1], 0.5).tolist()[:2] == [4.0, -1.0]  # < 1 encourages repeats
    with pytest.raises(ValueError, match=r"history holds token id 9, outside the vocabulary \[0, 4\]"):
        apply_repetition_penalty(x, [9], 2.0)


def test_penalty_comes_before_temperature_and_truncation():
    x = torch.tensor([3.0, 2.0, 1.0])
    p = probabilities(x, SamplingParams(temperature=0.5, top_k=1, repetition_penalty=3.0), history=[0])
    assert p.tolist() == [0.0, 1.0, 0.0]  # 3 / 3 = 1 < 2: the penalised leader drops out of top-1
    batch = probabilities(
        torch.stack([x, x]),
        SamplingParams(repetition_penalty=3.0),
        history=torch.tensor([[True, False, False], [False, False, False]]),
    )
    torch.testing.assert_close(batch[0], probabilities(x, SamplingParams(repetition_penalty=3.0), [0]))
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
    assert sample_batch(tiny_model, [prompt], 12, params, eos_id=None) == [with_prompt]
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
    torch.testing.assert_close(probabilities(x, params), torch.stack([probabilities(r, params) for r in rows]))


@given(logit_vectors(), sampling_params)
def test_processed_logits_and_probabilities_agree(x, params):
    z = processed_logits(x, params)
    p = probabilities(x, params)
    assert torch.equal(z > NEG_INF, p > 0) or (p[z > NEG_INF] >= 0).all()
    assert (p[z == NEG_INF] == 0).all()
    assert int(x.argmax()) in (z > NEG_INF).nonzero().flatten().tolist()  # the top token always survives


def test_entropy_bits():
    assert float(entropy_bits(torch.full((8,), 1 / 8))) == pytest.approx(3.0)
    assert float(entropy_bits(torch.tensor([1.0, 0.0, 0.0]))) == 0.0


# --- sampling continuations in a batch -----------------------------------------------


def test_sample_batch_matches_generate_row_by_row(tiny_model):
    prompts = ["abc", "xyz"]
    out = sample_batch(tiny_model, prompts, 8, GREEDY, eos_id=None)
    assert out == [generate(tiny_model, p, 8, eos_id=None).tokens for p in prompts]
    params = SamplingParams(temperature=1.0, top_k=20)
    a = sample_batch(tiny_model, prompts, 8, params, torch.Generator().manual_seed(0), eos_id=None)
    b = sample_batch(tiny_model, prompts, 8, params, torch.Generator().manual_seed(0), eos_id=None, use_cache=False)
    assert a == b  # same draws, cached or not
    with pytest.raises(ValueError, match="same number of tokens"):
        sample_batch(tiny_model, ["a", "bc"], 3)
    with pytest.raises(ValueError, match="non-empty list"):
        sample_batch(tiny_model, "abc", 3)


def test_sample_batch_stops_each_row_at_eos():
    model = ScriptedModel([ord("h"), ord("i"), 256, ord("x")], prompt_len=2)
    assert sample_batch(model, ["ab", "cd"], 4, GREEDY) == [[104, 105], [104, 105]]
    assert sample_batch(model, ["ab"], 4, GREEDY, eos_id=None) == [[104, 105, 256, 120]]


# --- repetition measure --------------------------------------------------------------


def test_repeated_ngram_fraction():
    assert repeated_ngram_fraction([1, 2, 1, 2, 1, 2], 2) == pytest.approx(3 / 5)
    assert repeated_ngram_fraction([7] * 10, 3) == pytest.approx(7 / 8)
    assert repeated_ngram_fraction(list(range(20)), 1) == 0.0
    assert repeated_ngram_fraction([1, 2], 4) == 0.0
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        repeated_ngram_fraction([1, 2, 3], 0)


# --- beam search ---------------------------------------------------------------------


class TableModel(torch.nn.Module):
    """A model whose next-token logits are a fixed function of the whole context.

    ``fn(context tuple) -> logits (V,)``; by default a seeded pseudo-random table. With a
    KV cache it stores each token id as its 'key' and reads the context back from the
    cache, so a beam search that reorders the cache wrongly gets the wrong context.
    """

    def __init__(self, vocab: int, seed: int = 0, fn=None, block_size: int = 16, scale: float = 2.0):
        super().__init__()
        self.config = GPTConfig(vocab_size=vocab, block_size=block_size, n_layer=1, n_head=1, n_embd=1)
        self.seed, self.fn, self.scale = seed, fn, scale
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    @property
    def device(self):
        return self.dummy.device

    def logits_for(self, ctx: tuple) -> torch.Tensor:
        if self.fn is not None:
            return self.fn(ctx)
        h = self.seed + 1
        for c in ctx:
            h = (h * 1_000_003 + c + 1) % (2**61 - 1)
        return torch.randn(self.config.vocab_size, generator=torch.Generator().manual_seed(h)) * self.scale

    def forward(self, idx, cache=None):
        B, T = idx.shape
        start = 0 if cache is None else cache.length
        if cache is not None:
            keys = idx[:, None, :, None].float()  # (B, 1, T, 1): the token ids themselves
            ctx, _ = cache.update(0, start, keys, keys)
            ctx = ctx[:, 0, :, 0].long()  # (B, start + T)
            cache.length = start + T
        else:
            ctx = idx
        out = torch.empty(B, T, self.config.vocab_size)
        for b in range(B):
            for t in range(T):
                out[b, t] = self.logits_for(tuple(ctx[b, : start + t + 1].tolist()))
        return out


def brute_force(model, prompt, max_new_tokens, length_penalty, eos_id):
    """Every possible continuation, scored from the model's full-sequence forward pass."""
    V = model.config.vocab_size
    normal = [v for v in range(V) if v != eos_id]
    candidates = [list(s) for s in itertools.product(normal, repeat=max_new_tokens)]
    if eos_id is not None:
        for n in range(max_new_tokens):
            candidates += [list(s) + [eos_id] for s in itertools.product(normal, repeat=n)]
    scored = []
    for seq in candidates:
        full = torch.tensor([prompt + seq])
        with torch.inference_mode():
            logp = torch.log_softmax(model(full[:, :-1]).float(), dim=-1)[0, len(prompt) - 1 :]  # (len(seq), V)
        lp = float(logp.double()[torch.arange(len(seq)), torch.tensor(seq)].sum())
        ended = eos_id is not None and seq[-1] == eos_id
        scored.append((length_normalised(lp, len(seq), length_penalty), seq[:-1] if ended else seq, lp))
    return sorted(scored, key=lambda s: -s[0])


@given(
    vocab=st.integers(2, 4),
    steps=st.integers(1, 3),
    seed=st.integers(0, 10_000),
    alpha=st.sampled_from([0.0, 0.6, 1.0, 2.0, -0.5]),
    eos=st.sampled_from(["none", "first", "last"]),
    use_cache=st.booleans(),
)
def test_unpruned_beam_search_equals_brute_force(vocab, steps, seed, alpha, eos, use_cache):
    model = TableModel(vocab, seed)
    eos_id = {"none": None, "first": 0, "last": vocab - 1}[eos]
    prompt = [vocab - 1, 0][: 1 + seed % 2]
    exact = brute_force(model, prompt, steps, alpha, eos_id)
    K = vocab**steps  # wide enough that nothing is ever pruned
    result = beam_search(model, prompt, steps, num_beams=K, length_penalty=alpha, eos_id=eos_id, use_cache=use_cache)
    assert result.tokens == exact[0][1]
    assert result.best.score == pytest.approx(exact[0][0], abs=1e-9)
    # Every sequence comes back, in the exact order.
    assert [h.tokens for h in result.hypotheses] == [s[1] for s in exact][:K]
    assert [h.logprob for h in result.hypotheses] == pytest.approx([s[2] for s in exact][:K], abs=1e-9)


@given(
    vocab=st.integers(3, 5),
    steps=st.integers(2, 4),
    seed=st.integers(0, 10_000),
    beams=st.integers(1, 3),
    alpha=st.sampled_from([0.0, 1.0]),
)
def test_pruned_beam_search_never_beats_the_optimum_and_scores_honestly(vocab, steps, seed, beams, alpha):
    model = TableModel(vocab, seed)
    exact = brute_force(model, [1], steps, alpha, eos_id=0)
    truth = {tuple(s[1]): s for s in exact}
    result = beam_search(model, [1], steps, num_beams=beams, length_penalty=alpha, eos_id=0)
    assert 1 <= len(result.hypotheses) <= beams
    assert result.best.score <= exact[0][0] + 1e-9
    for h in result.hypotheses:
        score, _, lp = truth[tuple(h.tokens)]
        assert h.logprob == pytest.approx(lp, abs=1e-9) and h.score == pytest.approx(score, abs=1e-9)
        assert h.finished_by == ("eos" if len(h.tokens) < steps else h.finished_by)
    scores = [h.score for h in result.hypotheses]
    assert scores == sorted(scores, reverse=True)


def _script(table: dict):
    """A TableModel fn from {continuation tuple (after the prompt [0]): probabilities}."""

    def fn(ctx):
        probs = torch.tensor(table.get(ctx[1:], [0.25, 0.25, 0.25, 0.25]))
        return probs.log()

    return fn


def test_beam_search_finds_what_greedy_misses():
    # Greedy takes 1 (0.6) and then faces a flat 0.25; 2 (0.4) leads to 3 with 0.9: 0.36 > 0.15.
    model = TableModel(4, fn=_script({(): [0.0, 0.6, 0.4, 0.0], (2,): [0.05, 0.0, 0.05, 0.9]}))
    greedy = generate(model, [0], 2, eos_id=None)
    assert greedy.tokens[0] == 1
    beam = beam_search(model, [0], 2, num_beams=2, length_penalty=0.0, eos_id=None)
    assert beam.tokens == [2, 3] and beam.best.logprob == pytest.approx(math.log(0.36))
    one = beam_search(model, [0], 2, num_beams=1, length_penalty=0.0, eos_id=None)
    assert one.tokens == greedy.tokens


def test_length_penalty_decides_between_short_and_long_texts():
    eos = 3
    table = {(): [0.5, 0.0, 0.0, 0.5], (0,): [0.9, 0.0, 0.0, 0.1], (0, 0): [0.9, 0.0, 0.0, 0.1]}
    model = TableModel(4, fn=_script(table))
    short = beam_search(model, [0], 3, num_beams=2, length_penalty=0.0, eos_id=eos)
    assert short.tokens == [] and short.best.finished_by == "eos"  # log 0.5 beats log(0.5 * 0.81)
    assert short.best.score == pytest.approx(math.log(0.5))
    long = beam_search(model, [0], 3, num_beams=2, length_penalty=1.0, eos_id=eos)
    assert long.tokens == [0, 0, 0] and long.best.finished_by == "max_new_tokens"
    assert long.best.score == pytest.approx(math.log(0.5 * 0.81) / 3)
    assert long.text == "\x00\x00\x00"


def test_beam_search_with_the_gpt_cached_equals_uncached_and_brute_force():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=4, block_size=16, n_layer=2, n_head=2, n_embd=16)).eval()
    with torch.no_grad():
        model.wte.weight.mul_(40)  # peaked distributions: no near-ties between sequences
    cached = beam_search(model, [1, 2], 3, num_beams=3, eos_id=0)
    uncached = beam_search(model, [1, 2], 3, num_beams=3, eos_id=0, use_cache=False)
    assert [h.tokens for h in cached.hypotheses] == [h.tokens for h in uncached.hypotheses]
    assert [h.score for h in cached.hypotheses] == pytest.approx([h.score for h in uncached.hypotheses], abs=1e-5)
    full = beam_search(model, [1, 2], 3, num_beams=64, eos_id=0)
    exact = brute_force(model, [1, 2], 3, 1.0, 0)
    assert full.tokens == exact[0][1] and full.best.score == pytest.approx(exact[0][0], abs=1e-5)
    assert cached.forward_calls <= 3 and cached.positions_processed == 2 + cached.forward_calls - 1


def test_beam_width_one_is_greedy_on_the_course_architecture(tiny_model):
    g = generate(tiny_model, "hello", 12, eos_id=None)
    assert beam_search(tiny_model, "hello", 12, num_beams=1, eos_id=None).tokens == g.tokens
    scripted = ScriptedModel([ord("o"), ord("k"), 256, ord("x")], prompt_len=2)
    r = beam_search(scripted, "ab", 4, num_beams=1)
    assert r.tokens == [ord("o"), ord("k")] and r.best.finished_by == "eos" and r.text == "ok"


def test_beam_search_batch_matches_one_prompt_at_a_time(tiny_model):
    prompts = ["one ", "two "]
    batch = beam_search_batch(tiny_model, prompts, 6, num_beams=3)
    for p, r in zip(prompts, batch, strict=True):
        alone = beam_search(tiny_model, p, 6, num_beams=3)
        assert [h.tokens for h in r.hypotheses] == [h.tokens for h in alone.hypotheses]


def test_beam_search_stops_early_when_nothing_can_beat_the_finished():
    # EOS is certain at every step: everything ends after one token, and beam search stops.
    model = TableModel(3, fn=lambda ctx: torch.tensor([0.0, -30.0, -30.0]))
    r = beam_search(model, [1], 8, num_beams=2, length_penalty=0.0, eos_id=0)
    assert r.forward_calls < 8 and r.tokens == [] and r.best.finished_by == "eos"


def test_beam_search_rejects_bad_arguments(tiny_model):
    with pytest.raises(ValueError, match="num_beams must be an int >= 1"):
        beam_search(tiny_model, "a", 3, num_beams=0)
    with pytest.raises(ValueError, match="length_penalty must be a finite number"):
        beam_search(tiny_model, "a", 3, length_penalty=float("nan"))
    with pytest.raises(ValueError, match="eos_id 999 is outside the vocabulary"):
        beam_search(tiny_model, "a", 3, eos_id=999)
    with pytest.raises(ValueError, match="prompt is empty"):
        beam_search(tiny_model, "", 3)
    with pytest.raises(ValueError, match="ask for at most"):
        beam_search(tiny_model, "a" * 60, 10)


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
    assert greedy.n_kept == 1 and len(set(greedy.continuations)) == 1 and greedy.entropy_after == 0.0
    with pytest.raises(ValueError, match="prompt is empty"):
        sampler_view(tiny_model, "", params)


def test_sampler_explorer_widget_headless(tiny_model):
    pytest.importorskip("ipywidgets")
    from ar_lab.widgets import sampler_explorer

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
