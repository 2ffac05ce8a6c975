"""The sampler hook: a function of one's own picks every token of every decode loop (chapter 06's
learner passes theirs), called once per row and step with the settings and the one generator, its
answer checked."""

import html

import pytest
import torch

from ar_lab.base.errors import BadType, BadValue
from ar_lab.course.views.sampler_view import sampler_view
from ar_lab.engine.generate import generate, sample_batch
from ar_lab.engine.pipeline import pick
from ar_lab.engine.sampling import GREEDY, SamplingParams, probabilities, sample
from tests.raising import raises

SETTINGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.9),
    SamplingParams(temperature=1.3, min_p=0.05, repetition_penalty=1.2),
    GREEDY,
]


def written_out(logits, params, generator):
    """A sampler written from the documented chain (what a learner writes): the distribution, then
    one draw."""
    if params.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(probabilities(logits, params), 1, generator=generator))


@pytest.mark.parametrize("params", SETTINGS, ids=lambda p: p.label)
def test_a_sampler_hook_draws_what_the_package_draws_for_the_same_seed(tiny_model, params):
    runs = {}
    for name, sampler in [
        ("package", None),
        ("hook: sample", sample),
        ("hook: written out", written_out),
    ]:
        g = torch.Generator().manual_seed(7)
        runs[name] = generate(
            tiny_model, "ab", 40, sampling=params, generator=g, eos_id=None, sampler=sampler
        ).tokens
    assert runs["package"] == runs["hook: sample"] == runs["hook: written out"]
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    if not params.greedy:  # the hook really draws: another seed, another text
        a, b = (
            generate(
                tiny_model, "ab", 40, sampling=params, generator=g, eos_id=None, sampler=written_out
            ).tokens
            for g in (g1, g2)
        )
        assert a != b


def test_the_hook_is_called_per_row_and_step_after_the_penalty_with_the_one_generator(tiny_model):
    calls = []
    g = torch.Generator().manual_seed(0)
    # greedy: the hook is still called
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)

    def spy(logits, p, generator):
        calls.append((logits.clone(), p, generator))
        return int(logits.argmax())

    rows = sample_batch(
        tiny_model, ["ab", "cd", "ef"], 5, sampling=params, generator=g, eos_id=None, sampler=spy
    )
    assert len(calls) == 3 * 5 and all(p is params and gen is g for _, p, gen in calls)
    assert all(
        x.shape == (tiny_model.config.vocab_size,) and x.dtype == torch.float32 for x, _, _ in calls
    )
    assert [r[0] for r in rows] == [int(x.argmax()) for x, _, _ in calls[:3]]  # rows in order
    logits = torch.tensor([3.0, 1.0, -2.0])
    seen = pick(lambda x, p, gen: (calls.append(x) or 0), logits, params, None, history=[0])
    assert int(seen) == 0 and calls[-1].tolist() == [1.5, 1.0, -2.0]  # the penalty came first


def test_a_sampler_that_answers_anything_but_a_token_id_is_refused(tiny_model):
    for bad in [300, -1, 1.5, True, "a", torch.tensor([1, 2]), torch.tensor(2.0)]:
        with raises(BadValue, 'sampler'):
            generate(tiny_model, "ab", 3, sampler=lambda logits, p, g, bad=bad: bad)
    assert (
        generate(
            tiny_model, "ab", 3, eos_id=None, sampler=lambda logits, p, g: torch.tensor(5)
        ).tokens
        == [5] * 3
    )
    for call in (generate, sample_batch):
        prompts = "ab" if call is generate else ["ab"]
        with raises(BadType, 'sampler'):
            call(tiny_model, prompts, 3, sampler="top_p")
    with raises(BadValue, 'logits'):
        pick(written_out, torch.tensor([0.0, float("nan")]), SamplingParams())


def test_the_explorer_shows_the_same_samples_for_either_sampler_and_says_which(tiny_model):
    from ar_lab.course.views.widgets import sampler_explorer

    params = SamplingParams(temperature=0.9, top_p=0.95)
    views = [
        sampler_view(tiny_model, "ab", params, seed=3, n_samples=3, max_new_tokens=12, sampler=s)
        for s in (sample, written_out)
    ]
    assert views[0].continuations == views[1].continuations and len(set(views[0].continuations)) > 1
    explorer = sampler_explorer(tiny_model, "ab", n_samples=2, max_new_tokens=8,
                                samplers={"your sampler": written_out, "ar_lab's": sample})
    shown = {}
    for name in ("your sampler", "ar_lab's"):
        explorer.sampler.value = name
        assert not explorer.error and f"picked by {html.escape(name)}" in explorer.samples.value
        shown[name] = explorer.view.continuations
    assert shown["your sampler"] == shown["ar_lab's"]
    for bad in ({}, [written_out], {"x": 3}):
        with pytest.raises((ValueError, TypeError)):
            sampler_explorer(tiny_model, samplers=bad)
