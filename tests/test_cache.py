import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ar_lab.base.errors import BadType, BadValue, ContextFull
from ar_lab.engine.decoder import ForwardDecoder, decoder_for
from ar_lab.engine.generate import generate
from ar_lab.model.cache import KVCache, kv_cache_bytes
from ar_lab.model.gpt import GPT, GPTConfig
from tests.raising import raises

configs = st.builds(
    lambda layers, heads, group, d, seed: (
        GPTConfig(
            block_size=48, n_layer=layers, n_head=heads, n_kv_heads=heads // group, n_embd=heads * d
        ),
        seed,
    ),
    layers=st.integers(1, 3),
    heads=st.sampled_from([2, 4]),
    group=st.sampled_from([1, 2]),  # 1: MHA; 2: GQA (or MQA when heads == 2)
    d=st.sampled_from([4, 8]),
    seed=st.integers(0, 2**16),
)


@pytest.mark.slow
@given(configs, st.integers(1, 20), st.integers(1, 6), st.data())
def test_cached_equals_uncached(cfg_seed, prompt_len, chunk, data):
    """Feeding a sequence in chunks through the cache gives the full-sequence logits."""
    cfg, seed = cfg_seed
    torch.manual_seed(seed)
    model = GPT(cfg).eval()
    x = torch.randint(0, cfg.vocab_size, (2, prompt_len + 10))
    cache = KVCache.for_model(model, batch_size=2)
    with torch.no_grad():
        full = model(x)
        parts, pos = [], 0
        while pos < x.shape[1]:
            parts.append(model(x[:, pos : pos + chunk], cache))
            pos += chunk
        # roll back a few positions and recompute them: must give the same logits
        back = data.draw(st.integers(0, x.shape[1] - 1))
        cache.truncate(back)
        again = model(x[:, back:], cache)
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(again, full[:, back:], atol=1e-5, rtol=1e-4)


@settings(max_examples=15)
@given(configs, st.integers(1, 15))
def test_cached_and_uncached_greedy_tokens_agree(cfg_seed, prompt_len):
    cfg, seed = cfg_seed
    torch.manual_seed(seed)
    model = GPT(cfg).eval()
    prompt = torch.randint(0, 256, (prompt_len,)).tolist()
    a = generate(model, prompt, 20, use_cache=True, eos_id=None)
    b = generate(model, prompt, 20, use_cache=False, eos_id=None)
    assert a.tokens == b.tokens


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_nbytes_matches_the_formula(kv_heads):
    cfg = GPTConfig(block_size=100, n_layer=3, n_head=4, n_kv_heads=kv_heads, n_embd=64)
    cache = KVCache.for_model(GPT(cfg), batch_size=5)
    assert cache.nbytes == kv_cache_bytes(3, kv_heads, 16, 100, 5, 4)
    assert cache.nbytes == 3 * kv_heads * 16 * 100 * 5 * 2 * 4


def test_truncate_and_capacity_errors(tiny_model):
    cache = KVCache.for_model(tiny_model, max_len=8)
    with torch.no_grad():
        tiny_model(torch.zeros(1, 5, dtype=torch.long), cache)
    assert cache.length == 5
    with raises(BadValue, 'n'):
        cache.truncate(6)
    cache.truncate(2)
    assert cache.length == 2 and cache.used_bytes == cache.nbytes * 2 // 8
    with raises(ContextFull, 'cache'):
        with torch.no_grad():
            tiny_model(torch.zeros(1, 7, dtype=torch.long), cache)
    with raises(ContextFull, 'max_len'):
        KVCache.for_model(tiny_model, max_len=65)
    with raises(BadValue, 'cache'):
        with torch.no_grad():
            tiny_model(torch.zeros(2, 1, dtype=torch.long), KVCache.for_model(tiny_model))
    with raises(BadValue, 'n_layer'):
        KVCache(0, 1, 1, 1, 1)


def test_a_batch_1_cache_records_the_tokens_it_holds(tiny_model):
    """The decoders record which tokens a cache holds (what lets generate reuse it); the model does
    not."""
    cache, decoder = KVCache.for_model(tiny_model, max_len=16), decoder_for(tiny_model)
    assert cache.token_ids == []
    with torch.inference_mode():
        decoder.prefill(torch.tensor([[5, 6, 7]]), cache, 0)
        decoder.step(8, cache, 3)
    assert cache.token_ids == [5, 6, 7, 8]
    cache.truncate(2)
    assert cache.token_ids == [5, 6]
    with torch.inference_mode():
        decoder.prefill(torch.tensor([[9, 10]]), cache, 2)
        decoder.extend([11, 12], cache, 3)  # at position 3: drops 10, the position it rewrites
    assert cache.token_ids == [5, 6, 9, 11, 12]
    assert cache.reusable([5, 6, 9, 11, 13]) == 4  # the positions where cache and prompt agree
    assert cache.reusable([5, 6, 9, 11]) == 3  # never the last prompt token: its logits are needed
    assert cache.reusable([1, 6]) == 0
    with torch.no_grad():
        # the model alone writes keys and values, names no token
        tiny_model(torch.tensor([[1]]), cache)
    assert cache.token_ids is None


def test_positions_written_without_their_ids_are_unknown(tiny_model):
    cache = KVCache.for_model(tiny_model, max_len=16)
    with torch.no_grad():
        ForwardDecoder(tiny_model).prefill(torch.tensor([[5, 6, 7]]), cache)
    k = torch.zeros(1, 4, 2, 8)
    cache.update(0, 1, k, k)  # rewrites positions 1..2 of one layer: their ids are no longer known
    assert cache.token_ids is None
    with raises(BadValue, 'cache'):
        cache.reusable([5, 6, 7, 8])
    cache.truncate(1)
    assert cache.token_ids == [5]
    cache.length = 3  # set by hand: positions 1..2 hold something unnamed
    assert cache.token_ids is None
    cache.record(1, [6, 7])
    assert cache.token_ids == [5, 6, 7]
    view = KVCache.from_buffers(cache.k, cache.v, length=2)  # over existing buffers: ids unknown
    assert view.token_ids is None
    batch = KVCache.for_model(tiny_model, batch_size=2)
    with torch.no_grad():
        tiny_model(torch.zeros(2, 3, dtype=torch.long), batch)
    assert batch.token_ids is None  # several rows: no ids are recorded


def test_a_cache_of_ones_own_still_works_with_forward(tiny_model):
    """Chapter 04 has the learner write a cache that concatenates: forward takes any object with
    ``length``, ``batch_size`` and ``update`` (token ids are recorded only by KVCache)."""

    class ConcatCache:
        def __init__(self, n_layer):
            self.k, self.v, self.length, self.batch_size = [None] * n_layer, [None] * n_layer, 0, 1

        def update(self, layer, start, k, v):
            if self.k[layer] is not None:
                k, v = torch.cat([self.k[layer], k], dim=2), torch.cat([self.v[layer], v], dim=2)
            self.k[layer], self.v[layer] = k, v
            return k, v

    x = torch.randint(0, 256, (1, 6))
    cache = ConcatCache(tiny_model.config.n_layer)
    with torch.no_grad():
        parts = [
            tiny_model(x[:, :4], cache),
            tiny_model(x[:, 4:5], cache),
            tiny_model(x[:, 5:], cache),
        ]
        torch.testing.assert_close(torch.cat(parts, dim=1), tiny_model(x), atol=1e-5, rtol=1e-4)


def test_a_cache_of_another_dtype_than_the_model_is_refused_before_any_write():
    import ar_lab
    from ar_lab.model.cache import KVCache

    model = ar_lab.load_pretrained("course")
    c = model.config
    cache = KVCache(c.n_layer, 1, c.n_head, 16, c.n_embd // c.n_head, dtype=torch.float64)
    with raises(BadType, 'cache'):
        model(torch.tensor([[1, 2]]), cache)
    assert cache.length == 0 and not cache.k[0].any()  # nothing was written
