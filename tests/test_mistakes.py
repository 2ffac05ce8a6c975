"""The named mistakes of chapters 01, 02 and 04: a wrong answer written out by hand is named for its
mistake, a right one passes, and a value that matches no mistake gets the plain comparison."""

import math

import pytest
import torch

from ar_lab.course.checkers.checks import CheckFailed, check_close, check_log_prob, check_matches
from ar_lab.course.checkers.mistakes import (
    check_exact,
    distribution_mistakes,
    generation_mistakes,
    name_mistake,
    positions_mistakes,
    sampler_mistakes,
    sequence_log_prob_mistakes,
    single_head_mistakes,
    temperature_mistakes,
    top_p_mistakes,
)
from ar_lab.course.checkers.model_checks import attention_mistakes
from ar_lab.model.gpt import GPT, GPTConfig
from tests.raising import fails_naming


@pytest.fixture
def counts():
    g = torch.Generator().manual_seed(0)
    c = torch.randint(0, 5, (12, 12), generator=g)
    c[3, 7] = 0
    return c


def test_distribution_mistakes_are_named(counts):
    token, s = 3, 0.1
    right = (counts[token].double() + s) / (counts[token].double() + s).sum()
    wrong = {
        "no smoothing": counts[token].double() / counts[token].sum(),
        "column": (counts[:, token].double() + s) / (counts[:, token].double() + s).sum(),
        "raw row sum": (counts[token].double() + s) / counts[token].sum(),
    }
    for fragment, answer in wrong.items():
        mistakes = distribution_mistakes(counts, token, s)
        fails_naming(fragment, name_mistake, "d", answer.float(), right.float(), mistakes)
    # right: quiet
    name_mistake("d", right.float(), right.float(), distribution_mistakes(counts, token, s))
    check_close("d", right.float(), right.float())


def test_sequence_log_prob_mistakes_are_named(counts):
    lp = ((counts.double() + 0.1) / (counts.double() + 0.1).sum(1, keepdim=True)).log()
    tokens = [1, 4, 4, 9, 2, 3]
    pairs = list(zip(tokens[:-1], tokens[1:], strict=True))
    right = sum(float(lp[a, b]) for a, b in pairs)
    swapped = sum(float(lp[b, a]) for a, b in pairs)
    mean = right / len(pairs)
    mistakes = sequence_log_prob_mistakes(lp, tokens)
    fails_naming("indices swapped", name_mistake, "s", swapped, right, mistakes)
    fails_naming("mean over the pairs", name_mistake, "s", mean, right, mistakes)
    name_mistake("s", right, right, mistakes)
    check_log_prob("s", right, right)
    # one token: no pair, nothing to get wrong
    assert sequence_log_prob_mistakes(lp, tokens[:1]) == {}


def test_generation_mistakes_are_named():
    prompt, new = [5, 6], [7, 8, 9]
    mistakes = generation_mistakes(prompt, new, 0)
    fails_naming("the prompt with the new tokens", check_exact, "g", prompt + new, new, mistakes)
    fails_naming("keeping EOS", check_exact, "g", [0], [], generation_mistakes(prompt, [], 0))
    fails_naming(
        "one token early", check_exact, "g", [7, 8], new, generation_mistakes(prompt, new, 0)
    )
    with pytest.raises(CheckFailed) as plain:
        check_exact("g", [1, 2, 3], new, generation_mistakes(prompt, new, 0))
    assert plain.value.mistake is None  # no mistake matched: the plain comparison
    check_exact("g", new, new, generation_mistakes(prompt, new, 0))


def _attention(q, k, v, mask, *, scale=None, fill=-math.inf, dim=-1):
    s = q @ k.T * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if mask is not None:
        s = s.masked_fill(~mask, fill)
    return s.softmax(dim=dim) @ v


def test_single_head_mistakes_are_named():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(6, 8, generator=g) for _ in range(3))
    mask = torch.ones(6, 6, dtype=torch.bool).tril()
    right = _attention(q, k, v, mask)
    mistakes = single_head_mistakes(q, k, v, mask)
    for fragment, answer in {
        "not scaled": _attention(q, k, v, mask, scale=1.0),
        "divided by d instead": _attention(q, k, v, mask, scale=1 / 8),
        "over the queries": _attention(q, k, v, mask, dim=0),
        "mask ignored": _attention(q, k, v, None),
        "set to 0 instead of -inf": _attention(q, k, v, mask, fill=0.0),
    }.items():
        fails_naming(fragment, check_matches, "a", answer, right, mistakes=mistakes)
    check_matches("a", right, right, mistakes=mistakes)
    assert "the mask ignored (every query reads every key)" not in single_head_mistakes(
        q, k, v, None
    )


def test_multi_head_mistakes_name_a_missing_projection():
    torch.manual_seed(0)
    attn = (
        GPT(GPTConfig(vocab_size=11, block_size=16, n_layer=1, n_head=4, n_embd=32))
        .blocks[0]
        .attn.eval()
    )
    x = torch.randn(1, 7, 32)
    with torch.no_grad():
        right = attn(x, None, 0, 0)[0]
        q, k, v = attn.qkv(x)[0].split(32, dim=-1)
        heads = [
            _attention(
                q[:, h * 8 : (h + 1) * 8],
                k[:, h * 8 : (h + 1) * 8],
                v[:, h * 8 : (h + 1) * 8],
                torch.ones(7, 7, dtype=torch.bool).tril(),
            )
            for h in range(4)
        ]
        no_proj = torch.cat(heads, dim=-1)
        mistakes = {m: out[0] for m, out in attention_mistakes(attn, x).items()}
    fails_naming(
        "without the output projection",
        check_matches,
        "m",
        no_proj,
        right,
        mistakes=mistakes,
        atol=1e-4,
    )
    check_matches("m", attn.proj(no_proj).detach(), right, mistakes=mistakes, atol=1e-4)


@pytest.mark.parametrize("P,N", [(1, 1000), (7, 50), (30, 1), (3, 2)])
def test_positions_mistakes_are_named(P, N):
    uncached, cached = sum(P + n for n in range(N)), P + N - 1
    fails_naming(
        "feeding the last new token back",
        check_exact,
        "p",
        P + N,
        cached,
        positions_mistakes(P, N, True),
    )
    fails_naming(
        "one step too many",
        check_exact,
        "p",
        uncached + P + N,
        uncached,
        positions_mistakes(P, N, False),
    )
    check_exact("p", cached, cached, positions_mistakes(P, N, True))
    check_exact("p", uncached, uncached, positions_mistakes(P, N, False))
    # P x N is then the right uncached count: a right answer is never named for a mistake
    if N == 1:
        assert positions_mistakes(P, N, False)["P x N (the prompt alone, every step)"] == uncached


def test_temperature_mistakes_are_named():
    z = torch.tensor([2.0, 1.0, 0.0, -1.0])
    right = (z / 0.5).softmax(-1)
    mistakes = temperature_mistakes(z, 0.5)
    fails_naming(
        "multiplying the logits by T",
        check_matches,
        "t",
        (z * 0.5).softmax(-1),
        right,
        mistakes=mistakes,
    )
    fails_naming(
        "temperature left out", check_matches, "t", z.softmax(-1), right, mistakes=mistakes
    )
    check_matches("t", right, right, mistakes=mistakes)
    assert temperature_mistakes(z, 0.0) == {}


def test_top_p_mistakes_are_named():
    q = torch.tensor([0.2, 0.5, 0.3])
    # 0.5 alone is below 0.6: the 0.3 that crosses it stays
    right = torch.tensor([False, True, True])
    mistakes = top_p_mistakes(q, 0.6)
    # the cumulative sum including the token must stay <= p
    strict = torch.tensor([False, True, False])
    fails_naming("crosses p", check_exact, "p", strict, right, mistakes)
    in_order = torch.tensor([True, True, False])  # running sum over ids 0, 1, 2
    fails_naming("token order", check_exact, "p", in_order, right, mistakes)
    check_exact("p", right, right, mistakes)


def _chain(z, params, order, renormalise=True):
    steps = {
        "T": lambda x: (x - x.max()) / params.temperature,
        "k": lambda x: (
            x.masked_fill(x < x.topk(params.top_k).values[-1], -math.inf) if params.top_k else x
        ),
        "p": lambda x: x.masked_fill(~my_keep(x.softmax(-1), params.top_p), -math.inf),
        "m": lambda x: x.masked_fill(x.softmax(-1) < params.min_p * x.softmax(-1).max(), -math.inf),
    }
    for name in order:
        z = steps[name](z)
    return z.softmax(-1)


def my_keep(probs, p):
    s, order = probs.sort(descending=True, stable=True)
    keep = s.cumsum(-1) - s < p
    return torch.empty_like(keep).scatter_(-1, order, keep)


def test_sampler_mistakes_are_named():
    from ar_lab.engine.sampling import SamplingParams, probabilities

    g = torch.Generator().manual_seed(5)
    params = SamplingParams(temperature=1.5, top_k=40, top_p=0.9, min_p=0.1)
    z = torch.randn(257, generator=g) * 3
    right = probabilities(z, params)
    check_close("ours by hand", _chain(z, params, "Tkpm"), right, atol=1e-6)
    mistakes = sampler_mistakes(z, params)
    early = _chain(z, params, "mTkp")
    fails_naming(
        "min-p before the temperature", check_matches, "s", early, right, mistakes=mistakes
    )
    fails_naming(
        "temperature last", check_matches, "s", _chain(z, params, "kpmT"), right, mistakes=mistakes
    )
    check_matches("s", right, right, mistakes=mistakes)
    assert sampler_mistakes(z, SamplingParams(temperature=0.0)) == {}
