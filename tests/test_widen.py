"""widen: a wider GPT that computes the same function (Net2Net's function-preserving widening)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ar_lab import load_pretrained
from ar_lab.engine import lean
from ar_lab.engine.generate import generate
from ar_lab.model.gpt import GPT, GPTConfig
from ar_lab.model.widen import widen


@settings(max_examples=12, deadline=None)
@given(k=st.integers(1, 4), kv=st.sampled_from([None, 1, 2]), seed=st.integers(0, 2**16))
def test_the_wide_model_has_the_same_logits_at_every_position(k, kv, seed):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(block_size=32, n_layer=2, n_head=4, n_kv_heads=kv, n_embd=32)).eval()
    # weights off their init scale, so that every term of the widening matters
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    before = {n: p.clone() for n, p in model.state_dict().items()}
    wide = widen(model, k)
    assert wide.config.n_embd == 32 * k and wide.config.n_head == 4 and wide.config.n_kv_heads == kv
    # every block's matrices k^2 times larger
    assert wide.num_parameters() > (k * k - 1) * 12 * 32 * 32 * 2
    idx = torch.randint(0, model.config.vocab_size, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(wide(idx), model(idx), atol=2e-4, rtol=2e-4)
    # the original is untouched
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())


def test_a_widened_trained_model_writes_the_same_text():
    course_model = load_pretrained("course")
    wide = widen(course_model, 3)
    prompt = "The cat sat on the"
    assert (
        generate(wide, prompt, 40, eos_id=None).tokens
        == generate(course_model, prompt, 40, eos_id=None).tokens
    )
    # dense, no padding
    assert all(p.count_nonzero() > 0.9 * p.numel() for p in wide.parameters() if p.ndim == 2)
    # tied: the lean engine runs it
    assert wide.lm_head.weight is wide.wte.weight and lean.supports(wide)


@pytest.mark.parametrize("k", [0, 2.0, True, "2"])
def test_bad_widening_factors_are_refused(tiny_model, k):
    with pytest.raises(ValueError):
        widen(tiny_model, k)


def test_only_a_stock_tied_float_gpt_is_widened(tiny_model):
    from ar_lab.engine.quant import quantize_model

    class Other(GPT):
        pass

    untied = GPT(tiny_model.config)
    untied.lm_head.weight = torch.nn.Parameter(untied.wte.weight.detach().clone())
    subclass = Other(tiny_model.config)
    quantized = quantize_model(
        GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32)), weights="int8"
    )
    for model in (torch.nn.Linear(2, 2), subclass, untied, quantized):
        with pytest.raises(TypeError):
            widen(model, 2)
