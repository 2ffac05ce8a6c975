"""Speculative decoding: the theory formulas, the exactness proof, the real checkpoints, the
explorer.

The central test is statistical: with bigram "models" whose next-token distributions
are known exactly, the joint distribution of the first three speculative tokens must
match the target's (chi-square). The same test, at the same sample size, rejects two
wrong rules (resampling from p instead of the residual; drawing the bonus token from
the wrong row). Leaving out the bonus token altogether is *not* a distribution error
(each iteration still emits exactly-distributed tokens): the test file shows that it
passes the distribution test and fails the efficiency test instead.
"""

import itertools
import math
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ar_lab.base.errors import BadType, BadValue, ContextFull
from ar_lab.base.timing import steady_clock
from ar_lab.course.views.speculative_view import chi_square, speculation_view
from ar_lab.engine.accept import accept_step, accepted_count, residual_distribution
from ar_lab.engine.generate import generate
from ar_lab.engine.sampling import SamplingParams, probabilities
from ar_lab.engine.speculative import (
    acceptance_rate,
    alpha_for_speedup,
    best_gamma,
    expected_speedup,
    expected_tokens_per_iteration,
    speculative_generate,
    speculative_iteration,
    token_sources,
    total_variation,
)
from ar_lab.model.bigram import BigramModel
from ar_lab.model.data import benchmark_prompts
from ar_lab.model.gpt import GPT, GPTConfig
from ar_lab.model.tokenizer import EOS_ID, encode
from tests.conftest import ScriptedModel
from tests.raising import raises

# --- the theory ------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.5, 0.8, 0.95, 0.999])
@pytest.mark.parametrize("gamma", [0, 1, 2, 5, 12])
def test_expected_tokens_is_the_geometric_sum(alpha, gamma):
    assert expected_tokens_per_iteration(alpha, gamma) == pytest.approx(
        sum(alpha**k for k in range(gamma + 1))
    )


def test_expected_tokens_limits():
    # every draft rejected: the target's own token only
    assert expected_tokens_per_iteration(0.0, 7) == 1.0
    assert expected_tokens_per_iteration(1.0, 7) == 8.0  # all accepted + the bonus
    for eps in (1e-4, 1e-8, 1e-12, 1e-15):  # continuous as alpha -> 1, no cancellation
        got = expected_tokens_per_iteration(1.0 - eps, 7)
        assert 8.0 - 28 * eps * 1.01 <= got <= 8.0  # 8 - eps * (0 + 1 + ... + 7) to first order
    assert expected_tokens_per_iteration(0.5, 0) == 1.0


def test_expected_tokens_matches_a_simulation_of_the_acceptance_process():
    """Independent check: simulate iterations with i.i.d. accept coins; count tokens."""
    g = torch.Generator().manual_seed(0)
    for alpha, gamma in [(0.3, 3), (0.7, 5), (0.9, 8)]:
        coins = torch.rand(200_000, gamma, generator=g) < alpha  # (iterations, gamma)
        # run of accepts before the first rejection
        accepted = coins.int().cumprod(dim=1).sum(dim=1)
        tokens = accepted + 1  # plus the residual draw or the bonus
        assert float(tokens.double().mean()) == pytest.approx(
            expected_tokens_per_iteration(alpha, gamma), rel=5e-3
        )


def test_expected_speedup_and_its_limits():
    assert expected_speedup(0.7, 0, 0.3) == 1.0  # gamma 0 is plain decoding
    assert expected_speedup(0.7, 4, 0.0) == expected_tokens_per_iteration(0.7, 4)  # free draft
    assert expected_speedup(1.0, 4, 0.25) == pytest.approx(5 / 2)  # (gamma + 1) / (gamma c + 1)
    assert expected_speedup(1.0 - 1e-13, 4, 0.25) == pytest.approx(5 / 2, rel=1e-9)
    assert expected_speedup(0.0, 3, 0.1) == pytest.approx(1 / 1.3)  # useless draft: pure cost
    # Leviathan et al.'s trade-off at alpha 0.8, c 0.1, worked by hand: gamma 6 is best (2.469x).
    assert expected_speedup(0.8, 6, 0.1) == pytest.approx((1 - 0.8**7) / (0.2 * 1.6))
    assert best_gamma(0.8, 0.1) == 6


@given(st.floats(0.0, 1.0), st.floats(0.0, 2.0), st.integers(0, 30))
def test_best_gamma_is_the_argmax(alpha, c, max_gamma):
    best = best_gamma(alpha, c, max_gamma)
    speedups = [expected_speedup(alpha, g, c) for g in range(max_gamma + 1)]
    assert 0 <= best <= max_gamma and speedups[best] == max(speedups)


def test_best_gamma_extremes():
    assert best_gamma(0.0, 0.01) == 0  # nothing is ever accepted: do not speculate
    assert best_gamma(0.9, 2.0) == 0  # the draft costs more than the target
    assert best_gamma(1.0, 0.0, max_gamma=20) == 20  # free, always right: as many as allowed
    assert best_gamma(0.95, 0.02) > best_gamma(0.6, 0.02) > 0  # a better draft earns a longer gamma


def test_alpha_for_speedup_inverts_the_formula():
    for speedup, gamma, c, v in [
        (1.5, 2, 0.2, 1.0),
        (2.0, 4, 0.1, 1.0),
        (1.5, 3, 0.19, 1.5),
        (1.2, 1, 0.0, 1.0),
    ]:
        a = alpha_for_speedup(speedup, gamma, c, v)
        assert expected_tokens_per_iteration(a, gamma) / (gamma * c + v) == pytest.approx(
            speedup, rel=1e-9
        )
    # verify_cost 1
    assert expected_speedup(alpha_for_speedup(1.5, 2, 0.2), 2, 0.2) == pytest.approx(1.5)
    assert alpha_for_speedup(3.5, 2, 0.0) is None  # gamma 2 emits at most 3 tokens per call
    assert alpha_for_speedup(0.5, 2, 0.2) == 0.0  # slower than plain decoding is always reachable
    with raises(BadValue, 'verify_cost'):
        alpha_for_speedup(1.5, 2, 0.2, 0.0)


@pytest.mark.parametrize(
    "call, arg",
    [
        (lambda: expected_tokens_per_iteration(1.5, 3), "alpha"),
        (lambda: expected_tokens_per_iteration(0.5, -1), "gamma"),
        (lambda: expected_tokens_per_iteration(0.5, 2.0), "gamma"),
        (lambda: expected_speedup(0.5, 3, -0.1), "c"),
        (lambda: expected_speedup(0.5, 3, float("inf")), "c"),
        (lambda: best_gamma(0.5, 0.1, max_gamma=-1), "max_gamma"),
    ],
)
def test_theory_rejects_bad_input(call, arg):
    with raises(BadValue, arg):
        call()


@st.composite
def distribution_pairs(draw):
    n = draw(st.integers(2, 30))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    p = torch.softmax(torch.randn(n, generator=g) * draw(st.floats(0.1, 6.0)), dim=0)
    q = torch.softmax(torch.randn(n, generator=g) * draw(st.floats(0.1, 6.0)), dim=0)
    return p.double() / p.double().sum(), q.double() / q.double().sum()


@given(distribution_pairs())
def test_alpha_is_one_minus_total_variation(pq):
    p, q = pq
    assert float(acceptance_rate(p, q)) == pytest.approx(
        1 - float(total_variation(p, q)), abs=1e-12
    )
    assert float(acceptance_rate(p, p)) == pytest.approx(1.0)


@given(distribution_pairs())
def test_accept_then_residual_gives_back_p(pq):
    """The algebra of exactness: P(x) = q(x) min(1, p(x)/q(x)) + (1 - alpha) residual(x) = p(x)."""
    p, q = pq
    accepted = q * torch.clamp(p / q, max=1.0)  # = min(p, q)
    r = residual_distribution(p, q).double()
    assert float(r.sum()) == pytest.approx(1.0, abs=1e-6) and bool((r[p <= q] == 0).all())
    total = accepted + (1 - float(acceptance_rate(p, q))) * r
    torch.testing.assert_close(total, p, atol=1e-6, rtol=0)


def test_accepted_count_is_the_run_before_the_first_rejection():
    p_x = torch.tensor([0.5, 0.3, 0.1, 0.9], dtype=torch.float64)
    q_x = torch.tensor([0.2, 0.3, 0.4, 0.1], dtype=torch.float64)
    assert accepted_count(p_x, q_x, torch.tensor([0.99, 0.99, 0.2, 0.0], dtype=torch.float64)) == 4
    assert accepted_count(p_x, q_x, torch.tensor([0.99, 0.99, 0.3, 0.0], dtype=torch.float64)) == 2
    assert accepted_count(p_x[:0], q_x[:0], p_x[:0]) == 0
    # p = 0: never
    assert accepted_count(torch.zeros(3), torch.full((3,), 0.5), torch.zeros(3)) == 0
    g = torch.Generator().manual_seed(0)
    u = torch.rand(20_000, 1, generator=g, dtype=torch.float64)
    hits = sum(accepted_count(torch.tensor([0.1]), torch.tensor([0.4]), row) for row in u)
    assert hits / 20_000 == pytest.approx(0.25, abs=0.01)  # min(1, p/q)


# --- exactness, statistically: bigram tables with known distributions -------------------

V = 4
TARGET_TABLE = torch.tensor([[5.0, 3, 1, 1], [1, 6, 1, 2], [3, 1, 1, 5], [2, 2, 5, 1]])
DRAFT_TABLE = torch.tensor([[1.0, 2, 3, 4], [5, 1, 2, 2], [2, 5, 2, 1], [1, 4, 1, 4]])
PROMPT, N_TOKENS, N_SAMPLES = [0], 3, 2000


@pytest.fixture(scope="module")
def tables():
    target = BigramModel(TARGET_TABLE, smoothing=0.0, block_size=16)
    return target, BigramModel(DRAFT_TABLE, smoothing=0.0, block_size=16)


def exact_joint(model, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(first N_TOKENS tokens) under the target with the sampler, by enumeration (the history
    counts)."""
    out = {}
    for ys in itertools.product(range(V), repeat=N_TOKENS):
        prob, history = 1.0, list(PROMPT)
        for y in ys:
            prob *= float(probabilities(model.log_probs[history[-1]], params, history)[y])
            history.append(y)
        out[ys] = prob
    return out


def speculative_samples(target, draft, gamma, params, n=N_SAMPLES, seed=0, accept=None):
    """(tokens, tokens the first iteration emitted) of ``n`` runs drawing from one generator, in
    order."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        out = speculative_generate(
            target,
            draft,
            PROMPT,
            N_TOKENS,
            gamma,
            sampling=params,
            generator=g,
            eos_id=None,
            accept=accept,
        )
        samples.append((tuple(out.tokens), out.stats.emitted_per_iteration[0]))
    return samples


def tally(samples):
    """Outcome counts and the mean tokens of the first iteration."""
    counts = {}
    for key, _ in samples:
        counts[key] = counts.get(key, 0) + 1
    return counts, sum(first for _, first in samples) / len(samples)


def run_speculative(target, draft, gamma, params, n=N_SAMPLES, seed=0, accept=None):
    return tally(speculative_samples(target, draft, gamma, params, n, seed, accept))


@pytest.fixture(scope="module")
def gamma2_samples(tables):
    """The built-in rule's N_SAMPLES runs at gamma 2, T=1, seed 0: several tests read the same
    draws, computed once (the first n of them are exactly what a run of n draws, the generator being
    consumed in order)."""
    target, draft = tables
    return speculative_samples(target, draft, 2, T1)


def chi_square_pvalue(counts: dict, probs: dict, n: int) -> float:
    """Pearson's chi-square test (``speculative_view.chi_square``) of outcome counts against exact
    probabilities."""
    assert set(counts) <= {k for k, p in probs.items() if p > 0}, (
        "an impossible outcome was produced"
    )
    keys = list(probs)
    observed = torch.tensor([counts.get(k, 0) for k in keys], dtype=torch.float64)
    assert observed.sum() == n
    return chi_square(observed, torch.tensor([probs[k] for k in keys], dtype=torch.float64))[2]


def expected_first_iteration(
    target, draft, gamma: int, params: SamplingParams
) -> tuple[float, float]:
    """Exact E[tokens emitted by the first iteration] and P(all gamma drafts accepted), by
    enumeration.

    E[tokens] = 1 + sum_k P(the first k drafts are all accepted); the drafts are enumerated.
    """
    expected, p_all = 1.0, 0.0

    def walk(history, k, prob_so_far):  # prob_so_far: P(drafts so far drawn and all accepted)
        nonlocal expected, p_all
        if k == gamma:
            p_all += prob_so_far
            return
        p = probabilities(target.log_probs[history[-1]], params, history).double()
        q = probabilities(draft.log_probs[history[-1]], params, history).double()
        for x in range(V):
            both = float(torch.minimum(p[x], q[x]))  # q(x) * min(1, p(x)/q(x))
            if both > 0:
                expected += prob_so_far * both
                walk(history + [x], k + 1, prob_so_far * both)

    walk(list(PROMPT), 0, 1.0)
    return expected, p_all


T1 = SamplingParams()


@pytest.mark.slow
@pytest.mark.parametrize("gamma", [1, 2])
def test_speculative_output_has_exactly_the_target_distribution(tables, gamma, request):
    target, draft = tables
    counts, _ = tally(request.getfixturevalue("gamma2_samples")) if gamma == 2 else run_speculative(
        target, draft, gamma, T1
    )
    assert chi_square_pvalue(counts, exact_joint(target, T1), N_SAMPLES) > 1e-3


@pytest.mark.slow
def test_exact_under_any_sampler_settings(tables):
    """p and q are the distributions after temperature, top-k and the repetition penalty, on both
    sides."""
    target, draft = tables
    params = SamplingParams(temperature=0.7, top_k=3, repetition_penalty=1.5)
    counts, _ = run_speculative(target, draft, 2, params)
    exact = exact_joint(target, params)
    assert chi_square_pvalue(counts, exact, N_SAMPLES) > 1e-3
    assert exact != exact_joint(target, T1)  # the settings do change the distribution being matched


# Accept rules with a classic mistake each, run through speculative_generate's accept= hook.


def _resample_from_p(p, q, drafts, u):
    n, dist = accept_step(p, q, drafts, u)
    # WRONG: after a rejection, p instead of the residual
    return n, (p[n] if n < len(drafts) else dist)


def _bonus_from_previous_row(p, q, drafts, u):
    n, dist = accept_step(p, q, drafts, u)
    # WRONG: the bonus from the last draft's row
    return n, (p[n - 1] if n == len(drafts) and n > 0 else dist)


def _accept_when_q_below_p(p, q, drafts, u):
    n = 0  # WRONG: accept exactly when q(x) <= p(x), no random test
    while n < len(drafts) and q[n, drafts[n]] <= p[n, drafts[n]]:
        n += 1
    return n, (residual_distribution(p[n], q[n]) if n < len(drafts) else p[n])


@pytest.mark.parametrize(
    "rule",
    [_resample_from_p, _bonus_from_previous_row, _accept_when_q_below_p],
    ids=lambda f: f.__name__[1:],
)
@pytest.mark.slow
def test_the_distribution_test_catches_wrong_rules(tables, rule):
    """The exactness test above, with the same samples, fails for these accept rules."""
    target, draft = tables
    counts, _ = run_speculative(target, draft, 2, T1, accept=rule)
    assert chi_square_pvalue(counts, exact_joint(target, T1), N_SAMPLES) < 1e-6


@pytest.mark.slow
def test_the_accept_hook_runs_a_correct_rule_exactly_and_checks_what_it_returns(
    tables, gamma2_samples
):
    """accept_step through the hook draws what the built-in path draws, sample for sample."""
    target, draft = tables
    hooked = speculative_samples(target, draft, 2, T1, n=300, accept=accept_step)
    # the built-in path's first 300 runs (run_speculative with n=300)
    assert hooked == gamma2_samples[:300]
    for bad, _why in [
        (lambda p, q, d, u: (len(d) + 1, p[0]), "n an int in"),
        (lambda p, q, d, u: 1, "n an int in"),
        (lambda p, q, d, u: (0, p[0] * 2), "probability vector"),
        (lambda p, q, d, u: (0, p), "shape"),
    ]:
        with raises(BadValue, 'accept'):
            speculative_generate(
                target, draft, PROMPT, N_TOKENS, 2, sampling=T1, eos_id=None, accept=bad
            )
    with raises(BadType, 'accept'):
        speculative_generate(target, draft, PROMPT, N_TOKENS, 2, eos_id=None, accept="min(p, q)")


@pytest.mark.slow
def test_the_first_iteration_emits_the_expected_tokens_bonus_included(tables, gamma2_samples):
    """The bonus token is free speed: the first iteration emits, on average, the exact expectation
    (enumerated), which counts the bonus with probability P(all accepted)."""
    target, draft = tables
    expected, p_all = expected_first_iteration(target, draft, 2, T1)
    se = 1.0 / math.sqrt(N_SAMPLES)  # emitted tokens lie in [1, 3]: standard deviation <= 1
    counts, mean_first = tally(gamma2_samples)
    assert (
        len(gamma2_samples) == N_SAMPLES and p_all > 10 * se and abs(mean_first - expected) < 4 * se
    )


# --- greedy: the target's own output, token for token ---------------------------------


def _tiny(seed, **kw):
    torch.manual_seed(seed)
    return GPT(
        GPTConfig(**{"block_size": 96, "n_layer": 2, "n_head": 2, "n_embd": 32, **kw})
    ).eval()


@pytest.mark.parametrize("gamma", [0, 1, 3, 8])
def test_greedy_equals_target_greedy_tiny_models(gamma):
    target, draft = _tiny(0), _tiny(1, n_layer=1, n_embd=16)
    for prompt in ["a", "hello world", "def f(x):"]:
        want = generate(target, prompt, 40, eos_id=None)
        got = speculative_generate(target, draft, prompt, 40, gamma)
        assert got.tokens == want.tokens and got.text == want.text


def test_greedy_fast_path_equals_the_general_rule():
    """Greedy takes the argmax shortcut; an accept rule passed in (here the package's own) takes it
    through one-hot distributions: the same tokens and counts."""
    target, draft = _tiny(0), _tiny(1, n_layer=1, n_embd=16)
    fast = speculative_generate(target, draft, "abc", 40, 3)
    slow = speculative_generate(target, draft, "abc", 40, 3, accept=accept_step)
    assert fast.tokens == slow.tokens
    assert fast.stats.accepted_per_iteration == slow.stats.accepted_per_iteration
    assert fast.stats.alpha_exact == slow.stats.alpha_exact == fast.stats.alpha


def _checkpoints():
    from ar_lab.model.train import checkpoint_path, load_checkpoint

    if not (checkpoint_path("course").exists() and checkpoint_path("draft").exists()):
        pytest.skip("data/course.safetensors or data/draft.safetensors missing (make checkpoints)")
    return load_checkpoint(checkpoint_path("course"), "cpu"), load_checkpoint(
        checkpoint_path("draft"), "cpu"
    )


@pytest.mark.slow
def test_greedy_equals_target_greedy_with_the_shipped_checkpoints():
    from ar_lab.model.data import corpus_tokens, train_val_split

    target, draft = _checkpoints()
    _, val = train_val_split(corpus_tokens())
    g = torch.Generator().manual_seed(7)
    starts = torch.randint(0, len(val) - 64, (4,), generator=g).tolist()
    prompts = [val[s : s + int(torch.randint(4, 48, (), generator=g))].tolist() for s in starts]
    prompts += [encode("The "), encode("def ")]
    for i, prompt in enumerate(prompts):
        want = generate(target, prompt, 64).tokens  # EOS stops both alike
        for gamma in (1, 3, 6) if i % 2 else (2, 4, 8):
            got = speculative_generate(target, draft, prompt, 64, gamma)
            assert got.tokens == want, (
                f"prompt {i}, gamma {gamma}: differs at token {_first_diff(got.tokens, want)}"
            )


def _first_diff(a, b):
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def test_self_draft_accepts_everything_and_tracks_its_cache():
    """Target as its own draft: alpha = 1, gamma + 1 tokens per call. After each full accept the
    draft must first read its own last proposal and the bonus token; if it skipped either,
    its proposals would drift from the target's and get rejected."""
    target = _tiny(0)
    out = speculative_generate(target, target, "abc", 41, 4)
    s = out.stats
    assert s.acceptances == s.tested == s.proposals and s.alpha == 1.0
    # the last: max_new_tokens cuts gamma
    assert s.emitted_per_iteration == [5] * 8 + [1] and s.target_calls == 9
    # prompt, then 2 new + 3 per iteration
    assert s.draft_calls == 32 and s.draft_positions == 3 + 3 + 7 * (2 + 3)
    assert out.tokens == generate(target, "abc", 41, eos_id=None).tokens


def test_useless_draft_still_gives_the_target_text():
    target = _tiny(0)
    want = generate(target, "abc", 30, eos_id=None)
    # proposes EOS at every position
    wrong = ScriptedModel([EOS_ID] * 40, prompt_len=3, block_size=96)
    got = speculative_generate(target, wrong, "abc", 30, 3, eos_id=None)
    assert got.tokens == want.tokens and got.stats.acceptances == 0 and got.stats.target_calls == 30
    # the last iteration has no room to propose
    assert got.stats.tested == got.stats.target_calls - 1


def test_stop_rules_match_generate():
    prompt = encode("ab")
    target = ScriptedModel(encode("xyz") + [EOS_ID] + encode("never"), len(prompt))
    draft = ScriptedModel(encode("xyq") + [EOS_ID] * 10, len(prompt))
    want = generate(target, prompt, 20)
    for gamma in (1, 2, 5):
        got = speculative_generate(target, draft, prompt, 20, gamma)
        assert got.tokens == want.tokens == encode("xyz") and got.text == "xyz"
        assert got.stats.stop_reason == want.stats.stop_reason == "eos" and got.stats.produced == 4
    for n in (1, 2, 3):
        got = speculative_generate(target, draft, prompt, n, 4)
        assert (
            got.tokens == generate(target, prompt, n).tokens
            and got.stats.stop_reason == "max_new_tokens"
        )
    no_eos = speculative_generate(target, draft, prompt, 8, 3, eos_id=None)
    assert (
        no_eos.tokens == generate(target, prompt, 8, eos_id=None).tokens and len(no_eos.tokens) == 8
    )


def test_gamma_zero_is_plain_sampling_draw_for_draw():
    """With no drafts, each iteration draws the target's token exactly as generate's sampler
    does."""
    target, draft = _tiny(0), _tiny(1, n_layer=1, n_embd=16)
    params = SamplingParams(temperature=0.9, top_k=50)
    want = generate(
        target, "abc", 30, sampling=params, generator=torch.Generator().manual_seed(3), eos_id=None
    )
    g = torch.Generator().manual_seed(3)
    got = speculative_generate(
        target, draft, "abc", 30, 0, sampling=params, generator=g, eos_id=None
    )
    assert got.tokens == want.tokens and got.stats.draft_calls == 0 and got.stats.target_calls == 30


def test_sampled_runs_are_seeded_and_counted_consistently():
    target, draft = _tiny(0), _tiny(1, n_layer=1, n_embd=16)
    params = SamplingParams(temperature=1.0)
    runs = [
        speculative_generate(
            target, draft, "abc", 50, 3, sampling=params, generator=torch.Generator().manual_seed(s)
        )
        for s in (1, 1, 2)
    ]
    assert runs[0].tokens == runs[1].tokens != runs[2].tokens
    for out in runs:
        s = out.stats
        assert (
            s.produced == sum(s.emitted_per_iteration) == len(out.tokens) + (s.stop_reason == "eos")
        )
        assert s.target_calls == len(s.accepted_per_iteration) and s.acceptances == sum(
            s.accepted_per_iteration
        )
        assert s.acceptances <= s.tested <= s.proposals == s.draft_calls
        assert 0 <= s.alpha <= 1 and 0 < s.alpha_exact <= 1
        assert (
            s.target_time > 0 and s.draft_time > 0 and s.total_time >= s.target_time + s.draft_time
        )
        assert len(token_sources(s)) == len(out.tokens) + (s.stop_reason == "eos")


def test_training_mode_is_restored_and_bad_input_is_explained():
    target, draft = _tiny(0), _tiny(1, n_layer=1, n_embd=16)
    target.train()
    speculative_generate(target, draft, "ab", 5, 2)
    assert target.training and not draft.training and not torch.is_inference_mode_enabled()
    other_vocab = GPT(GPTConfig(vocab_size=100, block_size=96, n_layer=1, n_head=1, n_embd=8))
    with raises(BadValue, 'draft'):
        speculative_generate(target, other_vocab, "ab", 5)
    with raises(BadValue, 'gamma'):
        speculative_generate(target, draft, "ab", 5, -1)
    with raises(BadValue, 'prompt'):
        speculative_generate(target, draft, "", 5)
    short = _tiny(1, n_layer=1, n_embd=16, block_size=8)
    with raises(ContextFull, 'max_new_tokens'):
        speculative_generate(target, short, "abcd", 10)
    with raises(BadType, 'sampling'):
        speculative_generate(target, draft, "ab", 5, 2, sampling=0.5)


# --- the explorer: pure function, then the widget ------------------------------------


def test_speculation_view_measures_and_predicts():
    target, draft = _tiny(0), _tiny(1, n_layer=1, n_embd=16)
    view = speculation_view(target, draft, "hello", gamma=3, max_new_tokens=24, draft_name="tiny")
    again = speculation_view(
        target, draft, "hello", gamma=3, max_new_tokens=24, draft_name="tiny", repeats=1
    )
    assert (
        view.same_tokens and view.result.tokens == again.result.tokens and view.alpha == again.alpha
    )
    assert view.measured_speedup > 0 and view.cost_ratio > 0 and view.clock_name == "CPU time"
    curves = view.theory()
    assert curves["gamma"] == list(range(9)) and curves["speedup"][0] == 1.0
    assert curves["speedup"][3] == pytest.approx(view.predicted_speedup)
    assert curves["tokens_per_iteration"][3] == pytest.approx(
        expected_tokens_per_iteration(view.alpha, 3)
    )
    params = SamplingParams(temperature=1.0)
    sampled = speculation_view(
        target, draft, "hello", gamma=3, sampling=params, seed=5, max_new_tokens=24
    )
    assert len(sampled.result.tokens) == len(sampled.baseline.tokens) == 24
    self_view = speculation_view(target, target, "hello", gamma=2, max_new_tokens=24)
    assert self_view.alpha == 1.0 and self_view.tokens_per_target_call > 2.5
    with raises(BadValue, 'prompt'):
        speculation_view(target, draft, "")
    with raises(BadValue, 'repeats'):
        speculation_view(target, draft, "hello", repeats=0)


@pytest.mark.slow
def test_speculation_explorer_widget_headless():
    pytest.importorskip("ipywidgets")
    from ar_lab.course.views.widgets import speculation_explorer

    target, draft = _tiny(0), _tiny(1, n_layer=1, n_embd=16)
    w = speculation_explorer(
        target, {"tiny draft": draft, "the target itself": target}, "hello", 2, 20
    )
    assert w.error == "" and w.view.gamma == 2 and w.view.same_tokens and "yes" in w.status.value
    assert w.image.value[:4] == b"\x89PNG" and "accepted draft token" in w.text.value
    w.draft.value = "the target itself"
    assert w.view.alpha == 1.0 and w.view.draft_name == "the target itself"
    w.gamma.value = 5
    assert w.view.gamma == 5 and w.view.tokens_per_target_call > 4
    w.temperature.value = 1.0
    assert (
        not w.view.sampling.greedy
        and "T=1" in w.status.value
        and "plain greedy" not in w.status.value
    )
    w.prompt.value = ""
    assert "prompt is empty" in w.error and "prompt is empty" in w.status.value
    assert w.view.prompt == "hello"
    w.prompt.value = "abc"
    assert w.error == "" and w.view.prompt == "abc"
    with raises(BadValue, 'drafts'):
        speculation_explorer(target, {})


# --- the benchmark ---------------------------------------------------------------------


def test_speculative_benchmark_runs_and_reports_ratios():
    from ar_lab.bench.speculative import format_speculative_results, speculative_benchmark

    target, draft = _tiny(0, block_size=128), _tiny(1, n_layer=1, n_embd=16, block_size=128)
    res = speculative_benchmark(
        target, draft, tokens=12, prompts=2, prompt_tokens=8, gammas=[1, 3], repeats=1
    )
    assert set(res["modes"]) == {"greedy", "T=1"} and res["greedy_best"]["gamma"] in (1, 3)
    for mode in res["modes"].values():
        assert set(mode["gammas"]) == {1, 3} and mode["cost_ratio_c"] > 0
        for g, row in mode["gammas"].items():
            assert 0 <= row["alpha"] <= 1 and 1 <= row["tokens_per_target_call"] <= g + 1
            assert row["predicted_speedup"] == pytest.approx(
                expected_speedup(row["alpha"], g, mode["cost_ratio_c"])
            )
            assert row["speedup"] > 0 and row["measured_over_predicted"] == pytest.approx(
                row["speedup"] / row["predicted_speedup"]
            )
    table = format_speculative_results(res)
    assert "meas/pred" in table and "greedy" in table and "T=1" in table
    with raises(BadValue, 'gammas'):
        speculative_benchmark(target, draft, gammas=[0])
    if not torch.cuda.is_available():
        with raises(BadValue, 'device'):
            speculative_benchmark(device="cuda")
        from ar_lab.bench.__main__ import main

        with pytest.raises(SystemExit) as stop:  # the command line: the message, no traceback
            main(["speculative", "--device", "cuda"])
        assert stop.value.code == 2
    with raises(BadValue, 'device'):
        speculative_benchmark(device="gpu0")


def test_benchmark_prompts_are_fixed_validation_windows():
    a, b = benchmark_prompts(4, 20), benchmark_prompts(4, 20)
    assert a == b and len(a) == 4 and len({tuple(p) for p in a}) == 4
    assert all(1 <= len(p) <= 20 and EOS_ID not in p for p in a)
    with raises(BadValue, 'n'):
        benchmark_prompts(0)


def test_steady_clock_is_cpu_time_only_for_one_cpu_thread():
    assert steady_clock("cpu") is time.process_time  # the module runs on one thread
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert steady_clock("cpu") is time.perf_counter
    finally:
        torch.set_num_threads(before)
    assert steady_clock("cuda") is time.perf_counter


# --- an iteration of one's own (chapter 07's loop) ----------------------------------------


def _learners_iteration(target, draft, seq, gamma, accept, probs, generator):
    """Chapter 07's solution, as a learner writes it through the sides."""
    from ar_lab.engine.accept import draw

    drafts, qs = [], []
    for _ in range(gamma):
        text = seq + drafts
        qs.append(probs(draft.feed(text[draft.length :])[-1], text))
        drafts.append(draw(qs[-1], generator))
    p = probs(target.feed(seq[-1:] + drafts), seq + drafts)
    n, dist = accept(p, qs, drafts)
    target.truncate(len(seq) + n)
    draft.truncate(min(draft.length, len(seq) + n))
    return drafts[:n] + [draw(dist, generator)]


def test_the_package_iteration_through_the_hook_is_speculative_generate():
    """speculative_generate's own round passed as iteration= gives the same tokens and counts,
    greedy (its argmax path), sampled with a penalty, and with a proposer for a draft."""
    from ar_lab.engine.lookup import PromptLookup
    from ar_lab.engine.speculative import speculative_iteration

    target, draft = _tiny(0), _tiny(1, n_layer=1, n_embd=16)
    for d, params in [
        (draft, SamplingParams(temperature=0.0)),
        (draft, SamplingParams(repetition_penalty=1.3)),
        (PromptLookup(), SamplingParams(temperature=0.8)),
        (target, SamplingParams(temperature=0.0)),
    ]:
        runs = [
            speculative_generate(
                target,
                d,
                "abcab",
                37,
                3,
                sampling=params,
                eos_id=None,
                iteration=it,
                generator=torch.Generator().manual_seed(5),
            )
            for it in (None, speculative_iteration)
        ]
        a, b = (r.stats for r in runs)
        assert runs[0].tokens == runs[1].tokens
        for field in (
            "target_calls",
            "draft_calls",
            "proposals",
            "tested",
            "acceptances",
            "produced",
            "accepted_per_iteration",
            "emitted_per_iteration",
            "target_positions",
            "draft_positions",
        ):
            assert getattr(a, field) == getattr(b, field), field
        assert a.alpha_sum == pytest.approx(b.alpha_sum)


@pytest.mark.parametrize("gamma", [0, 1, 3, 8])
def test_a_learners_iteration_gives_greedys_tokens_and_the_package_loops_counts(gamma):
    target, draft = _tiny(0), _tiny(1, n_layer=1, n_embd=16)
    for prompt in ["a", "def f(x):"]:
        ours = speculative_generate(target, draft, prompt, 40, gamma, eos_id=None)
        theirs = speculative_generate(
            target, draft, prompt, 40, gamma, eos_id=None, iteration=_learners_iteration
        )
        assert theirs.tokens == ours.tokens == generate(target, prompt, 40, eos_id=None).tokens
        assert theirs.stats.accepted_per_iteration == ours.stats.accepted_per_iteration
        a, b = theirs.stats, ours.stats
        assert (a.target_calls, a.draft_calls, a.tested) == (
            b.target_calls,
            b.draft_calls,
            b.tested,
        )


@pytest.mark.parametrize("slip", ["rollback", "bonus", "lag"])
@pytest.mark.parametrize("partial", [False, True], ids=["full accepts", "rejections"])
def test_a_loop_that_leaves_a_cache_off_the_text_stops_with_an_error(slip, partial):
    """A forgotten rollback, a dropped bonus token, a draft fed only the text's last token: each
    leaves a cache holding what the text does not, which would make the next pass wrong; the loop
    stops (CacheMismatch) instead of returning a wrong text. The right loop runs on the same
    models."""
    from ar_lab.course.checkers.mistakes import slipped_iteration
    from ar_lab.engine.sides import CacheMismatch

    target = _tiny(2)
    # itself: every draft right, full accepts
    draft = _tiny(1, n_layer=1, n_embd=16) if partial else target
    ok = speculative_generate(
        target, draft, "abc", 40, 2, eos_id=None, iteration=speculative_iteration
    )
    assert ok.tokens == generate(target, "abc", 40, eos_id=None).tokens
    # every draft accepted: nothing to roll back, and nothing goes wrong
    if not partial and slip == "rollback":
        slipped = speculative_generate(
            target, draft, "abc", 40, 2, eos_id=None, iteration=slipped_iteration(slip)
        )
        assert slipped.tokens == ok.tokens
        return
    if partial and slip != "rollback" and all(n < 2 for n in ok.stats.accepted_per_iteration):
        pytest.skip("no full accept with this draft: the slip has nothing to act on")
    with pytest.raises(CacheMismatch):
        speculative_generate(
            target, draft, "abc", 40, 2, eos_id=None, iteration=slipped_iteration(slip)
        )


@pytest.mark.parametrize(
    "bad, kind, arg",
    [
        (lambda t, d, s, g, a, p, r: {5}, BadType, "iteration"),
        (lambda t, d, s, g, a, p, r: torch.tensor([5]), BadType, "iteration"),
        (lambda t, d, s, g, a, p, r: [5.0], BadType, "iteration"),
        (lambda t, d, s, g, a, p, r: [5] * (g + 2), BadValue, "iteration"),
        (lambda t, d, s, g, a, p, r: [], BadValue, "iteration"),
        (lambda t, d, s, g, a, p, r: [999], BadValue, "iteration"),
        (
            lambda t, d, s, g, a, p, r: [
                int(a(p(t.feed(s[-1:] + [1, 2]), s + [1, 2]), [], [1, 2])[0])
            ],
            BadValue,
            "qs",
        ),
        (lambda t, d, s, g, a, p, r: [int(a(p(t.feed(s[-1:]), s), [], [1])[0])], BadValue, "p"),
        (lambda t, d, s, g, a, p, r: d.feed("ab"), BadType, "tokens"),
        (lambda t, d, s, g, a, p, r: d.feed([300]), BadValue, "tokens"),
        ("not a function", BadType, "iteration"),
    ],
)
def test_an_iteration_of_ones_own_is_checked(bad, kind, arg):
    target, draft = _tiny(0), _tiny(1, n_layer=1, n_embd=16)
    with raises(kind, arg):
        speculative_generate(target, draft, "abc", 10, 2, eos_id=None, iteration=bad)


@pytest.mark.slow
@given(st.integers(0, 2**31 - 1), st.integers(1, 3), st.sampled_from([1.0, 0.7]))
def test_sampling_through_a_learners_iteration_is_speculative_sampling_draw_for_draw(
    seed, gamma, temperature
):
    """Property: the learner's round draws what ar_lab's draws (same generator, same order of
    draws), so its sampled output is the package's, which the chi-square tests above prove exact."""
    target = BigramModel(TARGET_TABLE, smoothing=0.0, block_size=16)
    draft = BigramModel(DRAFT_TABLE, smoothing=0.0, block_size=16)
    params = SamplingParams(temperature=temperature)
    runs = [
        speculative_generate(
            target,
            draft,
            PROMPT,
            8,
            gamma,
            sampling=params,
            eos_id=None,
            iteration=it,
            generator=torch.Generator().manual_seed(seed),
        )
        for it in (None, _learners_iteration)
    ]
    assert runs[0].tokens == runs[1].tokens
    assert runs[0].stats.accepted_per_iteration == runs[1].stats.accepted_per_iteration


@pytest.mark.slow
def test_a_learners_iteration_samples_exactly(tables):
    """The joint distribution of the first tokens through the learner's round: the chi-square
    test."""
    target, draft = tables
    g = torch.Generator().manual_seed(0)
    counts = {}
    for _ in range(N_SAMPLES):
        out = speculative_generate(
            target,
            draft,
            PROMPT,
            N_TOKENS,
            2,
            sampling=T1,
            generator=g,
            eos_id=None,
            iteration=_learners_iteration,
        )
        counts[tuple(out.tokens)] = counts.get(tuple(out.tokens), 0) + 1
    assert chi_square_pvalue(counts, exact_joint(target, T1), N_SAMPLES) > 1e-3
