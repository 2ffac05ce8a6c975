import pytest
import torch

from ar_lab.base.errors import BadType, BadValue, ContextFull
from ar_lab.engine.generate import generate
from ar_lab.model.gpt import GPT, GPTConfig
from ar_lab.model.reference import have_transformers, to_hf_gpt2
from tests.raising import raises


def test_config_validation():
    with raises(BadValue, 'n_head'):
        GPTConfig(n_embd=30, n_head=4)
    with raises(BadValue, 'n_kv_heads'):
        GPTConfig(n_head=4, n_kv_heads=3)
    with raises(BadValue, 'n_layer'):
        GPTConfig(n_layer=0)
    with raises(BadType, 'config'):
        GPT({"n_layer": 2})


def test_forward_shapes_and_errors(tiny_model):
    x = torch.randint(0, 257, (3, 10))
    assert tiny_model(x).shape == (3, 10, 257)
    with raises(ContextFull, 'idx'):
        tiny_model(torch.zeros(1, 65, dtype=torch.long))
    with raises(BadValue, 'idx'):
        tiny_model(torch.zeros(5, dtype=torch.long))
    with raises(BadType, 'idx'):
        tiny_model(torch.zeros(1, 5))


def test_causality(tiny_model):
    """Changing a future token never changes the logits of earlier positions."""
    x = torch.randint(0, 257, (1, 20))
    y = x.clone()
    y[0, 12:] = (y[0, 12:] + 1) % 257
    with torch.no_grad():
        a, b = tiny_model(x), tiny_model(y)
    assert torch.allclose(a[:, :12], b[:, :12], atol=1e-6)
    assert not torch.allclose(a[:, 12:], b[:, 12:])


@pytest.mark.parametrize(
    "kv_heads, expected_qkv_out", [(None, 3 * 32), (2, 32 + 2 * 2 * 8), (1, 32 + 2 * 8)]
)
def test_gqa_mqa_shrink_the_kv_projection(kv_heads, expected_qkv_out):
    m = GPT(GPTConfig(block_size=16, n_layer=1, n_head=4, n_kv_heads=kv_heads, n_embd=32))
    assert m.blocks[0].attn.qkv.out_features == expected_qkv_out


def test_parameter_count_matches_the_formula():
    cfg = GPTConfig(block_size=64, n_layer=3, n_head=4, n_embd=32)
    C, L = cfg.n_embd, cfg.n_layer
    per_block = (C * 3 * C + 3 * C) + (C * C + C) + (C * 4 * C + 4 * C) + (4 * C * C + C) + 4 * C
    expected = cfg.vocab_size * C + cfg.block_size * C + L * per_block + 2 * C  # tied head
    assert GPT(cfg).num_parameters() == expected


@pytest.mark.skipif(not have_transformers(), reason="transformers is not installed (dev extra)")
def test_same_logits_and_tokens_as_hugging_face_gpt2():
    torch.manual_seed(1)
    model = GPT(GPTConfig(block_size=128, n_layer=3, n_head=4, n_embd=64)).eval()
    hf = to_hf_gpt2(model)
    x = torch.randint(0, 257, (2, 50))
    with torch.no_grad():
        ours, theirs = model(x), hf(x).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    prompt = [72, 105, 33]
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=40,
            min_new_tokens=40,
            do_sample=False,
            pad_token_id=256,
        )
    assert out[0, len(prompt) :].tolist() == generate(model, prompt, 40, eos_id=None).tokens


@pytest.mark.skipif(not have_transformers(), reason="transformers is not installed (dev extra)")
def test_reference_refuses_gqa():
    with raises(BadValue, 'model'):
        to_hf_gpt2(GPT(GPTConfig(block_size=16, n_layer=1, n_head=4, n_kv_heads=2, n_embd=32)))
