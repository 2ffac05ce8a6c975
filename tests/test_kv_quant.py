"""ar_lab.engine.kv_quant: the int8 KV cache, its size formula, and generate's cached paths on
it."""

from __future__ import annotations

import threading

import pytest
import torch

import ar_lab
from ar_lab.base.errors import BadType, BadValue
from ar_lab.engine import lean
from ar_lab.engine.generate import generate
from ar_lab.engine.kv_quant import Int8KVCache, int8_kv_cache_bytes
from ar_lab.engine.quant import quantize_model
from ar_lab.model.cache import KVCache, kv_cache_bytes
from ar_lab.model.gpt import GPT, GPTConfig
from ar_lab.perf.quality import kv_cache_agreement
from tests.raising import raises

PROMPTS = ["def main(args):\n    ", "import os\nimport sys\n", "The for statement"]


@pytest.fixture(scope="module")
def course():
    return ar_lab.load_pretrained("course", "cpu").eval()


def _model(seed: int = 0, **kw) -> GPT:
    """Weights that matter (biases and LayerNorms too), so a wrong key or value shows in the
    logits."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=32, **kw)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("kv_heads", [None, 2, 1])
def test_real_caches_hold_what_the_formulas_say(kv_heads):
    model = _model(n_kv_heads=kv_heads)
    cfg = model.config
    sizes = (cfg.n_layer, cfg.kv_heads, cfg.head_dim, 40)
    int8, fp32 = Int8KVCache.for_model(model, max_len=40), KVCache.for_model(model, max_len=40)
    assert int8.nbytes == int8_kv_cache_bytes(*sizes) and fp32.nbytes == kv_cache_bytes(*sizes)
    D = cfg.head_dim
    # D bytes + one scale vs 4 D bytes
    assert int8.nbytes / fp32.nbytes == pytest.approx((D + 4) / (4 * D))
    assert int8.k[0].dtype == torch.int8 and int8.k_scale[0].shape == (1, cfg.kv_heads, 40)
    assert repr(int8).startswith("Int8KVCache(")


def test_update_stores_each_vector_within_half_a_step():
    torch.manual_seed(0)
    cache = Int8KVCache(2, 1, 3, 16, 8)
    k, v = torch.randn(1, 3, 5, 8), torch.randn(1, 3, 5, 8) * 100
    k[0, 1, 2] = 0.0  # an all-zero vector: exact zeros back, no NaN
    keys, values = cache.update(1, 0, k, v)
    assert keys.shape == (1, 3, 5, 8) and keys.dtype == torch.float32
    for got, want, scale in ((keys, k, cache.k_scale[1]), (values, v, cache.v_scale[1])):
        assert bool(((got - want).abs() <= scale[:, :, :5, None] / 2 * (1 + 1e-6)).all())
        torch.testing.assert_close(
            scale[0, :, :5], torch.where(want.abs().amax(-1) > 0, want.abs().amax(-1) / 127, 1.0)[0]
        )
    assert bool((keys[0, 1, 2] == 0).all())


@pytest.mark.parametrize("kv_heads", [None, 2, 1])
def test_lean_step_on_an_int8_cache_equals_forward_on_one(kv_heads):
    model = _model(1, n_kv_heads=kv_heads)
    ids = torch.randint(0, 257, (1, 9))
    a, b, full = (
        Int8KVCache.for_model(model),
        Int8KVCache.for_model(model),
        KVCache.for_model(model),
    )
    engine = lean.for_model(model)
    with torch.inference_mode():
        model(ids, a), model(ids, b), model(ids, full)
        for t in [3, 100, 7, 250]:
            got = engine.step(t, a)
            torch.testing.assert_close(
                got, model(torch.tensor([[t]]), b)[0, -1], atol=1e-4, rtol=1e-4
            )
            exact = model(torch.tensor([[t]]), full)[0, -1]
            # int8 keys/values: close
            assert float((got - exact).abs().max()) < 0.05 * float(exact.abs().max())
    for layer in range(2):  # both paths stored the same integers and scales
        assert torch.equal(a.k[layer][:, :, : a.length], b.k[layer][:, :, : b.length])
        torch.testing.assert_close(a.v_scale[layer], b.v_scale[layer])


def test_generate_with_an_int8_cache(course):
    for prompt in PROMPTS:
        n = 30
        cache = Int8KVCache.for_model(course, max_len=len(prompt) + n)
        tokens = generate(course, prompt, n, eos_id=None, cache=cache).tokens
        lean_free = Int8KVCache.for_model(course, max_len=len(prompt) + n)
        assert (
            generate(course, prompt, n, eos_id=None, cache=lean_free, lean=False).tokens == tokens
        )
        # the cache is left holding the sequence: a longer prompt reuses its positions, as with a
        # float cache
        longer = prompt + "x"
        again = generate(course, longer, 10, eos_id=None, cache=cache).tokens
        fresh = generate(
            course, longer, 10, eos_id=None, cache=Int8KVCache.for_model(course, max_len=64)
        ).tokens
        assert again == fresh
    quantized = quantize_model(course, weights="int8")  # int8 weights and an int8 cache together
    cache = Int8KVCache.for_model(quantized, max_len=40)
    assert len(generate(quantized, PROMPTS[0], 12, eos_id=None, cache=cache).tokens) == 12


def test_int8_cache_agrees_with_a_float_cache(course):
    agreement = kv_cache_agreement(course, PROMPTS, n_tokens=24)
    assert agreement.top1 > 0.9 and agreement.first_divergence > 4
    torch.manual_seed(0)
    # near-uniform logits: a sterner test of ties, still mostly equal
    random = GPT(course.config).eval()
    assert kv_cache_agreement(random, PROMPTS[:1], n_tokens=8).top1 >= 0.5


def test_an_int8_cache_extends_as_forward_does_and_refuses_what_it_cannot_do():
    model = _model()
    cache, other = Int8KVCache.for_model(model), Int8KVCache.for_model(model)
    engine = lean.for_model(model)
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3]]), cache)
        model(torch.tensor([[1, 2, 3]]), other)
        torch.testing.assert_close(
            engine.extend([4, 5], cache), model(torch.tensor([[4, 5]]), other)[0]
        )
    with raises(BadType, None):
        Int8KVCache.from_buffers(cache.k, cache.v)
    with raises(BadValue, 'dtype'):
        Int8KVCache(1, 1, 1, 4, 4, torch.int8)
    bf16 = quantize_model(model, weights="bf16")
    with raises(BadValue, 'cache'), torch.inference_mode():
        lean.for_model(bf16).step(1, Int8KVCache.for_model(model))


def test_threads_with_their_own_int8_caches(course):
    def run(p):
        return generate(
            course, p, 12, eos_id=None, cache=Int8KVCache.for_model(course, max_len=40)
        ).tokens

    alone = [run(p) for p in PROMPTS]
    got: dict[int, list[int]] = {}
    threads = [
        threading.Thread(target=lambda i=i: got.__setitem__(i, run(PROMPTS[i])))
        for i in range(len(PROMPTS))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got[i] for i in range(len(PROMPTS))] == alone
