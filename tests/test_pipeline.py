"""One logits pipeline (``LogitsPipeline``): every loop that picks tokens runs it, so the greedy
shortcut, the finiteness check and the ``sampler=`` hook behave the same in each; ``serve`` takes
``sampler=`` through it."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ar_lab.base.errors import BadType, BadValue
from ar_lab.engine.generate import generate, sample_batch
from ar_lab.engine.pipeline import LogitsPipeline
from ar_lab.engine.sampling import GREEDY, SamplingParams, probabilities, sample
from ar_lab.engine.serving import Request, serve
from ar_lab.engine.speculative import speculative_generate
from tests.raising import raises

PARAMS = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.5, 1.0, 1.7]),
    top_k=st.sampled_from([None, 1, 3, 50]),
    top_p=st.sampled_from([1.0, 0.9, 0.3]),
    min_p=st.sampled_from([0.0, 0.1]),
    repetition_penalty=st.sampled_from([1.0, 1.3]),
)


@given(params=PARAMS, seed=st.integers(0, 2**16), batch=st.integers(1, 4))
def test_the_pipeline_picks_what_sample_picks_for_the_same_seed(params, seed, batch):
    logits = torch.randn(batch, 11, generator=torch.Generator().manual_seed(seed)) * 3
    history = [1, 4]
    picker = LogitsPipeline(params)
    got = picker(logits, torch.Generator().manual_seed(seed), history)
    assert (
        got.tolist()
        == sample(logits, params, torch.Generator().manual_seed(seed), history).tolist()
    )
    assert picker.one(logits[0], torch.Generator().manual_seed(seed), history) == int(
        sample(logits[0], params, torch.Generator().manual_seed(seed), history))
    assert torch.equal(
        picker.probabilities(logits, history), probabilities(logits, params, history)
    )


def test_only_greedy_without_a_penalty_or_a_sampler_takes_the_argmax_directly():
    assert LogitsPipeline(GREEDY).argmax_only
    assert not LogitsPipeline(SamplingParams(temperature=0.0, repetition_penalty=1.2)).argmax_only
    assert not LogitsPipeline(GREEDY, sampler=sample).argmax_only
    assert not LogitsPipeline(SamplingParams()).argmax_only


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_broken_winner_raises_instead_of_being_picked(bad):
    logits = torch.zeros(2, 5)
    logits[1, 3] = bad
    with raises(BadValue, "logits") as info:
        LogitsPipeline(GREEDY)(logits)
    # the wording is the point here: NaN (broken inputs or weights) and +inf (an overflow: check the
    # dtype) need different fixes, and both name the same argument, so only the message tells the
    # learner which one to make
    info.match("NaN" if bad != bad else r"\+inf")
    with pytest.raises(ValueError):
        LogitsPipeline(GREEDY).one(logits[1])
    # -inf elsewhere is fine
    assert LogitsPipeline(GREEDY).one(torch.tensor([0.0, -float("inf"), 2.0])) == 2


def test_the_pipeline_refuses_what_it_cannot_run():
    with pytest.raises(TypeError):
        LogitsPipeline({"temperature": 0})
    with pytest.raises(TypeError):
        LogitsPipeline(GREEDY, sampler="top-p")
    with raises(BadValue, "sampler"):  # a sampler picks tokens; it gives no distribution
        LogitsPipeline(GREEDY, sampler=sample).probabilities(torch.zeros(5))


class Broken(torch.nn.Module):
    """A model whose logits turn NaN after ``good`` calls (weights gone wrong mid-run)."""

    def __init__(self, model, good: int):
        super().__init__()
        self.model, self.good, self.config = model, good, model.config

    @property
    def device(self):
        return self.model.device

    def forward(self, idx, cache=None, **kw):
        logits = self.model(idx, cache, **kw)
        self.good -= 1
        return logits if self.good >= 0 else logits * float("nan")


def test_speculative_greedy_raises_on_nan_logits_instead_of_emitting_a_token(tiny_model):
    torch.manual_seed(1)
    with raises(BadValue, "logits"):
        speculative_generate(
            Broken(tiny_model, 2), tiny_model, "ab", 20, gamma=3, eos_id=None, lean=False
        )
    with raises(BadValue, "logits"):
        speculative_generate(
            tiny_model, Broken(tiny_model, 3), "ab", 20, gamma=3, eos_id=None, lean=False
        )


def test_serve_takes_a_sampler_of_ones_own_with_each_requests_generator(tiny_model):
    requests = [Request("ab", 6, seed=1), Request("hello", 4, seed=2), Request("x", 5, seed=1)]
    plain = serve(tiny_model, requests, max_batch=2, eos_id=None)
    argmax = serve(
        tiny_model, requests, max_batch=2, eos_id=None, sampler=lambda x, p, g: int(x.argmax())
    )
    assert [r.tokens for r in argmax.results] == [r.tokens for r in plain.results]
    params = SamplingParams(temperature=1.0, top_k=20)
    drawn = serve(tiny_model, requests, max_batch=2, eos_id=None, sampling=params)
    hooked = serve(tiny_model, requests, max_batch=2, eos_id=None, sampling=params, sampler=sample)
    assert [r.tokens for r in hooked.results] == [r.tokens for r in drawn.results]
    # each request's tokens are what generate draws alone with that request's seed
    for r, result in zip(requests, hooked.results, strict=True):
        alone = generate(tiny_model, r.prompt, r.max_new_tokens, sampling=params, eos_id=None,
                         generator=torch.Generator().manual_seed(r.seed), sampler=sample)
        assert result.tokens == alone.tokens
    seen = []
    serve(tiny_model, requests[:1], eos_id=None, sampler=lambda x, p, g: seen.append(g) or 7)
    assert len(seen) == 6 and len({id(g) for g in seen}) == 1
    with raises(BadValue, "sampler"):  # it returned -1, not a token id
        serve(tiny_model, requests, eos_id=None, sampler=lambda x, p, g: -1)
    with raises(BadType, "sampler"):
        serve(tiny_model, requests, sampler=3)


def test_sample_batch_greedy_is_each_rows_argmax_path(tiny_model):
    rows = sample_batch(tiny_model, ["ab", "cd"], 8, sampling=GREEDY, eos_id=None)
    assert rows == [generate(tiny_model, p, 8, eos_id=None).tokens for p in ["ab", "cd"]]


def test_eos_id_has_one_rule_in_every_loop(tiny_model):
    """An end token the model cannot emit would never stop anything: every loop refuses it the same
    way, and every loop takes a numpy integer where it takes an int."""
    import numpy as np

    from ar_lab.engine.beam import beam_search
    from ar_lab.model.tokenizer import EOS_ID

    loops = {
        "generate": lambda eos: generate(tiny_model, "ab", 3, eos_id=eos),
        "sample_batch": lambda eos: sample_batch(tiny_model, ["ab"], 3, eos_id=eos),
        "serve": lambda eos: serve(tiny_model, [Request("ab", 3)], eos_id=eos),
        "beam_search": lambda eos: beam_search(tiny_model, "ab", 3, num_beams=2, eos_id=eos),
        "speculative": lambda eos: speculative_generate(
            tiny_model, tiny_model, "ab", 3, eos_id=eos
        ),
    }
    for _name, run in loops.items():
        for bad in [10_000, -1, True, 2.0]:
            with raises(BadValue, "eos_id"):  # the same type and argument in every loop
                run(bad)
        run(np.int64(EOS_ID))
        run(None)


def test_a_count_has_one_rule_numpy_integers_included(tiny_model):
    """``top_k`` took a numpy integer and ``max_new_tokens`` refused one; both take it now
    (base.args.positive_int)."""
    import numpy as np

    params = SamplingParams(temperature=1.0, top_k=np.int64(5))
    out = generate(tiny_model, "ab", np.int64(4), sampling=params, eos_id=None,
                   generator=torch.Generator().manual_seed(0))
    assert out.tokens == generate(tiny_model, "ab", 4, sampling=params, eos_id=None,
                                  generator=torch.Generator().manual_seed(0)).tokens
    assert (
        len(
            serve(tiny_model, [Request("ab", 3)], max_batch=np.int64(2), eos_id=None)
            .results[0]
            .tokens
        )
        == 3
    )
    for bad in [np.float64(4.0), True, 0, np.int64(0)]:
        with raises(BadValue, 'max_new_tokens'):
            generate(tiny_model, "ab", bad)
