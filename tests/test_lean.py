"""ar_lab.lean: the batch-1 decode step without nn.Module layers must be GPT.forward's arithmetic."""

import gc

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ar_lab import lean
from ar_lab.cache import BatchKVCache, KVCache
from ar_lab.generate import generate
from ar_lab.model import GPT, GPTConfig
from ar_lab.sampling import SamplingParams
from ar_lab.speculative import speculative_generate
from tests.conftest import ScriptedModel


@st.composite
def configs(draw):
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    n_head = kv_heads * draw(st.sampled_from([1, 2]))  # MHA, GQA and MQA
    head_dim = draw(st.sampled_from([2, 8, 16]))  # 16: 1/sqrt(D) exact in binary; 2 and 8: not
    return GPTConfig(
        block_size=48, n_layer=draw(st.integers(1, 3)), n_head=n_head, n_kv_heads=kv_heads, n_embd=n_head * head_dim
    )


def _pair(cfg: GPTConfig, seed: int, prefix: int):
    """A model with non-trivial weights (biases and LayerNorms too) and two caches holding one prefix."""
    torch.manual_seed(seed)
    model = GPT(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    ids = torch.randint(0, cfg.vocab_size, (1, prefix))
    a, b = KVCache.for_model(model), KVCache.for_model(model)
    with torch.inference_mode():
        model(ids, a), model(ids, b)
    return model, a, b


@pytest.mark.slow
@given(cfg=configs(), seed=st.integers(0, 10_000), prefix=st.integers(1, 30), steps=st.integers(1, 6))
def test_step_equals_forward(cfg, seed, prefix, steps):
    model, a, b = _pair(cfg, seed, prefix)
    engine = lean.for_model(model)
    tokens = torch.randint(0, cfg.vocab_size, (steps,)).tolist()
    with torch.inference_mode():
        for t in tokens:
            got = engine.step(t, a)
            want = model(torch.tensor([[t]]), b)[0, -1]
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert a.length == b.length == prefix + steps
    for layer in range(cfg.n_layer):  # the cache holds the same keys and values
        torch.testing.assert_close(a.k[layer][:, :, : a.length], b.k[layer][:, :, : b.length], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.v[layer][:, :, : a.length], b.v[layer][:, :, : b.length], atol=1e-5, rtol=1e-5)


@given(cfg=configs(), seed=st.integers(0, 10_000), prefix=st.integers(1, 30), T=st.integers(1, 12))
def test_extend_equals_forward(cfg, seed, prefix, T):
    model, a, b = _pair(cfg, seed, prefix)
    tokens = torch.randint(0, cfg.vocab_size, (T,)).tolist()
    with torch.inference_mode():
        got = lean.for_model(model).extend(tokens, a)
        want = model(torch.tensor([tokens]), b)[0]
    assert got.shape == (T, cfg.vocab_size)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert a.length == b.length == prefix + T
    torch.testing.assert_close(a.k[-1][:, :, : a.length], b.k[-1][:, :, : b.length], atol=1e-5, rtol=1e-5)


@given(prompt=st.lists(st.integers(0, 255), min_size=1, max_size=20), n=st.integers(1, 25))
def test_generate_lean_gives_forward_tokens(prompt, n):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, n_layer=2, n_head=4, n_kv_heads=2, n_embd=32)).eval()
    lean_run = generate(model, prompt, n, eos_id=None)
    plain = generate(model, prompt, n, eos_id=None, lean=False)
    assert lean_run.tokens == plain.tokens
    assert lean_run.stats.positions_processed == plain.stats.positions_processed == len(prompt) + n - 1


@pytest.mark.slow
def test_sampled_generation_and_speculative_match_forward(tiny_model):
    params = SamplingParams(temperature=0.9, top_k=40)
    runs = [
        generate(tiny_model, "abc", 30, sampling=params, generator=torch.Generator().manual_seed(4), lean=lean_)
        for lean_ in (True, False)
    ]
    assert runs[0].tokens == runs[1].tokens
    torch.manual_seed(1)
    draft = GPT(GPTConfig(block_size=64, n_layer=1, n_head=2, n_kv_heads=1, n_embd=16)).eval()
    for gamma in (1, 3, 6):
        a = speculative_generate(tiny_model, draft, "abc", 40, gamma, eos_id=None)
        b = speculative_generate(tiny_model, draft, "abc", 40, gamma, eos_id=None, lean=False)
        assert a.tokens == b.tokens == generate(tiny_model, "abc", 40, eos_id=None, lean=False).tokens
        assert a.stats.acceptances == b.stats.acceptances


def test_engine_is_reused_and_rebuilt_when_weights_change(tiny_model):
    engine = lean.for_model(tiny_model)
    assert lean.for_model(tiny_model) is engine
    before = generate(tiny_model, "hello", 20, eos_id=None).tokens
    opt = torch.optim.SGD(tiny_model.parameters(), lr=1.0)
    loss = tiny_model(torch.tensor([[1, 2, 3]]))[0].logsumexp(-1).sum()
    loss.backward()
    opt.step()  # updates every parameter in place
    assert lean.for_model(tiny_model) is not engine
    after = generate(tiny_model, "hello", 20, eos_id=None)
    assert after.tokens == generate(tiny_model, "hello", 20, eos_id=None, lean=False).tokens
    assert after.tokens != before  # the new weights are used, not stale copies
    torch.manual_seed(5)
    other = GPT(tiny_model.config).eval()
    tiny_model.load_state_dict(other.state_dict())
    assert generate(tiny_model, "xy", 15, eos_id=None).tokens == generate(other, "xy", 15, eos_id=None).tokens


def test_models_with_their_own_forward_or_blocks_are_not_bypassed(tiny_model):
    """generate must follow what the model computes: a subclass's forward or a swapped block stays in charge."""

    class AlwaysA(GPT):
        def forward(self, idx, cache=None):
            logits = super().forward(idx, cache)
            logits[..., ord("A")] += 1e4  # this model always says "A"
            return logits

    model = AlwaysA(tiny_model.config).eval()
    assert not lean.supports(model) and lean.supports(tiny_model)
    assert generate(model, "xy", 10, eos_id=None).text == "A" * 10
    with pytest.raises(TypeError, match="stock blocks"):
        lean.LeanGPT(model)

    class Doubled(torch.nn.Module):  # an experiment: a block whose MLP output is doubled
        def __init__(self, mlp):
            super().__init__()
            self.mlp = mlp

        def forward(self, x):
            return 2 * self.mlp(x)

    torch.manual_seed(2)
    swapped = GPT(tiny_model.config).eval()
    swapped.blocks[0].mlp = Doubled(swapped.blocks[0].mlp)
    assert not lean.supports(swapped)
    got = generate(swapped, "hello", 20, eos_id=None).tokens
    assert got == generate(swapped, "hello", 20, eos_id=None, use_cache=False).tokens


def test_engines_do_not_keep_models_alive():
    model = GPT(GPTConfig(block_size=16, n_layer=1, n_head=1, n_embd=8))
    lean.for_model(model)
    n = len(lean._ENGINES)
    del model
    gc.collect()
    assert len(lean._ENGINES) == n - 1


def test_bad_input_is_explained(tiny_model):
    engine = lean.for_model(tiny_model)
    with pytest.raises(TypeError, match="runs a GPT"):
        lean.LeanGPT(ScriptedModel([1], 1))
    assert not lean.supports(ScriptedModel([1], 1))
    with pytest.raises(ValueError, match="batch size 1"):
        engine.step(1, KVCache.for_model(tiny_model, batch_size=2))
    with pytest.raises(TypeError, match="must be a KVCache"):
        engine.step(1, BatchKVCache.for_model(tiny_model, max_batch=2))
    with pytest.raises(ValueError, match="not shaped for this model"):
        engine.step(1, KVCache(1, 1, 4, 16, 8))
    with pytest.raises(ValueError, match="holds torch.float64"):
        engine.step(1, KVCache.for_model(tiny_model, dtype=torch.float64))
    full = KVCache.for_model(tiny_model, max_len=3)
    with torch.inference_mode():
        engine.extend([1, 2, 3], full)
        with pytest.raises(ValueError, match="KV cache full"):
            engine.step(4, full)
        with pytest.raises(ValueError, match="KV cache full"):
            engine.extend([4, 5], full)
        window = KVCache.for_model(tiny_model)  # block_size 64
        engine.extend(list(range(60)), window)
        with pytest.raises(ValueError, match="context window of 64"):
            engine.extend([1, 2, 3, 4, 5], window)
        assert window.length == 60  # a refused call changes nothing
        with pytest.raises(ValueError, match="non-empty 1-D"):
            engine.extend([], window)


def test_layer_weights_are_the_blocks_own_by_name(tiny_model):
    """Each field of a layer's weights is the block tensor it names; only the query rows of qkv are scaled."""
    engine = lean.for_model(tiny_model)
    C = tiny_model.config.n_embd
    for w, b in zip(engine.layers, tiny_model.blocks, strict=True):
        assert w.ln1_weight is b.ln1.weight and w.ln2_bias is b.ln2.bias and w.attn_proj_bias is b.attn.proj.bias
        assert w.fc_weight is b.mlp.fc.weight and w.mlp_proj_weight is b.mlp.proj.weight
        torch.testing.assert_close(w.qkv_weight[:C], b.attn.qkv.weight[:C] * engine.scale)
        torch.testing.assert_close(w.qkv_bias[C:], b.attn.qkv.bias[C:])  # keys and values: unscaled
