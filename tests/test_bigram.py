import math

import pytest
import torch

from ar_lab.base.errors import BadValue
from ar_lab.engine.generate import generate
from ar_lab.model.bigram import BigramModel, bigram_counts
from ar_lab.model.tokenizer import encode
from tests.raising import raises


def test_counts_and_probabilities():
    toks = torch.tensor(encode("abab"))
    c = bigram_counts(toks)
    assert c[97, 98] == 2 and c[98, 97] == 1 and c.sum() == 3
    m = BigramModel(c, smoothing=0.0)
    logits = m(torch.tensor([[97, 98]]))
    assert logits.shape == (1, 2, 257)
    assert logits[0, 0, 98].exp().item() == pytest.approx(1.0)
    assert logits[0, 1].exp().sum().item() == pytest.approx(1.0)
    assert logits[0, 0, 120].exp().item() == 0.0
    # a context never seen (with no smoothing) is uniform, not NaN
    assert m(torch.tensor([[0]]))[0, 0, 5].exp().item() == pytest.approx(1 / 257)


def test_generate_runs_the_bigram_and_caching_changes_nothing():
    m = BigramModel.from_tokens(
        torch.tensor(encode("the cat sat on the mat. " * 20)), smoothing=0.01
    )
    a = generate(m, "the", 30, use_cache=True, eos_id=None)
    b = generate(m, "the", 30, use_cache=False, eos_id=None)
    assert a.tokens == b.tokens and len(a.text) == 30
    assert a.stats.positions_processed == 3 + 29


def test_bad_input():
    with raises(BadValue, 'tokens'):
        bigram_counts(torch.tensor([1]))
    with raises(BadValue, 'smoothing'):
        BigramModel(torch.zeros(3, 3), smoothing=-1)
    assert math.isfinite(BigramModel(torch.zeros(3, 3), smoothing=1.0).log_probs.sum().item())
