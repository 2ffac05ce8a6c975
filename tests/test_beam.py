"""Beam search: compared with brute-force enumeration on table models of known distributions.

A table model's next-token logits are a fixed function of the whole context, so every
continuation's exact score can be enumerated and beam search checked against it.
"""

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ar_lab.base.errors import BadValue, ContextFull
from ar_lab.engine.beam import beam_search, beam_search_batch, length_normalised
from ar_lab.engine.generate import generate
from ar_lab.model.gpt import GPT, GPTConfig
from tests.conftest import ScriptedModel
from tests.raising import raises


class TableModel(torch.nn.Module):
    """A model whose next-token logits are a fixed function of the whole context.

    ``fn(context tuple) -> logits (V,)``; by default a seeded pseudo-random table. With a
    KV cache it stores each token id as its 'key' and reads the context back from the
    cache, so a beam search that reorders the cache wrongly gets the wrong context.
    """

    def __init__(
        self, vocab: int, seed: int = 0, fn=None, block_size: int = 16, scale: float = 2.0
    ):
        super().__init__()
        self.config = GPTConfig(
            vocab_size=vocab, block_size=block_size, n_layer=1, n_head=1, n_embd=1
        )
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
        return (
            torch.randn(self.config.vocab_size, generator=torch.Generator().manual_seed(h))
            * self.scale
        )

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
            # (len(seq), V)
            logp = torch.log_softmax(model(full[:, :-1]).float(), dim=-1)[0, len(prompt) - 1 :]
        lp = float(logp.double()[torch.arange(len(seq)), torch.tensor(seq)].sum())
        ended = eos_id is not None and seq[-1] == eos_id
        scored.append(
            (length_normalised(lp, len(seq), length_penalty), seq[:-1] if ended else seq, lp)
        )
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
    result = beam_search(
        model, prompt, steps, num_beams=K, length_penalty=alpha, eos_id=eos_id, use_cache=use_cache
    )
    assert result.tokens == exact[0][1]
    assert result.best.score == pytest.approx(exact[0][0], abs=1e-9)
    # Every sequence comes back, in the exact order.
    assert [h.tokens for h in result.hypotheses] == [s[1] for s in exact][:K]
    assert [h.logprob for h in result.hypotheses] == pytest.approx(
        [s[2] for s in exact][:K], abs=1e-9
    )


@pytest.mark.slow
@given(
    vocab=st.integers(3, 5),
    steps=st.integers(2, 4),
    seed=st.integers(0, 10_000),
    beams=st.integers(1, 3),
    alpha=st.sampled_from([0.0, 1.0]),
)
def test_pruned_beam_search_never_beats_the_optimum_and_scores_honestly(
    vocab, steps, seed, beams, alpha
):
    model = TableModel(vocab, seed)
    exact = brute_force(model, [1], steps, alpha, eos_id=0)
    truth = {tuple(s[1]): s for s in exact}
    result = beam_search(model, [1], steps, num_beams=beams, length_penalty=alpha, eos_id=0)
    assert 1 <= len(result.hypotheses) <= beams
    assert result.best.score <= exact[0][0] + 1e-9
    for h in result.hypotheses:
        score, _, lp = truth[tuple(h.tokens)]
        assert h.logprob == pytest.approx(lp, abs=1e-9) and h.score == pytest.approx(
            score, abs=1e-9
        )
        assert h.finished_by == ("eos" if len(h.tokens) < steps else "max_new_tokens")
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
    assert [h.score for h in cached.hypotheses] == pytest.approx(
        [h.score for h in uncached.hypotheses], abs=1e-5
    )
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
    with raises(BadValue, 'num_beams'):
        beam_search(tiny_model, "a", 3, num_beams=0)
    with raises(BadValue, 'length_penalty'):
        beam_search(tiny_model, "a", 3, length_penalty=float("nan"))
    with raises(BadValue, 'eos_id'):
        beam_search(tiny_model, "a", 3, eos_id=999)
    with raises(BadValue, 'prompts'):
        beam_search(tiny_model, "", 3)
    with raises(ContextFull, 'max_new_tokens'):
        beam_search(tiny_model, "a" * 60, 10)
